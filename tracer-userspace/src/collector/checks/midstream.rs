//! Causes only an established flow has (issue 21): the connection's socket
//! gone at the backend while the client still uses it.
use tracer_common::{hook, tcp_flags};

use super::{Found, RuleCtx};
use crate::collector::{
    types::{Proto, in_node},
    verdict::{Verdict, drop_place, reply_backend},
};

/// A flow that was `ok` and then got a bare RST (no ACK) from the backend's
/// side: the backend's kernel had no socket for the client's segment (the
/// process crashed or restarted, or a new pod has the old one's address),
/// so it answered as for any unknown segment (tcp_v4_send_reset). An
/// endpoint's own abort (SO_LINGER 0) is RST|ACK and is no failure
/// (`established::is_bare_rst`). With no listener left on the port the
/// segment is dropped with NO_SOCKET; with a restarted one listening,
/// tcp_rcv_state_process answers the ACK at TCP_LISTEN (TCP_FLAGS).
pub(in crate::collector) fn backend_restarted(ctx: &RuleCtx<'_>) -> Option<Found> {
    let flow = ctx.flow;
    if ctx.verdict != Verdict::Refused || !flow.watch.is_some_and(|w| w.failed()) {
        return None;
    }
    let reply = flow.client_reply?;
    let p = &flow.packets[reply.packet as usize];
    if p.key.tcp_flags & (tcp_flags::RST | tcp_flags::ACK) != tcp_flags::RST {
        return None;
    }
    // Not made by the node itself: a REJECT --reject-with tcp-reset's RST
    // is first seen at a netfilter hook of the node (LOCAL_OUT).
    flow.packet_obs(reply.packet)
        .min_by_key(|o| o.ts_ns)
        .filter(|o| !(o.hook == hook::NETFILTER && in_node(o.netns, ctx.node_netns)))?;
    let backend = reply_backend(flow, reply.packet).or(flow.backend)?;
    let dropped = flow
        .obs
        .iter()
        .find(|o| o.hook == hook::DROP && Some(o.drop_reason) == ctx.known.no_socket)
        .map(|o| {
            format!(
                ", after dropping the client's {} as {}",
                ctx.kind(o.packet),
                ctx.reason(o.drop_reason)
            )
        })
        .unwrap_or_default();
    Some((
        format!("backend {backend} no longer has the connection (restarted?)"),
        format!(
            "backend {backend} answered the client's segment with a bare RST (no ACK: what a kernel sends for a segment no socket of its owns){dropped}: the connection's socket is gone there — the backend's kernel lost it without closing it (node or pod sandbox restarted, a pod with the same address replaced it), or the segment was load-balanced to another backend after the connection's conntrack entry was lost — and the client gets ECONNRESET"
        ),
    ))
}

/// A flow that was `ok` and then was dropped by netfilter, with a DROP or
/// REJECT rule of the node's filter table (read again when the flow failed
/// the watch) that matches the dropped packet: a NetworkPolicy or firewall
/// rule added mid-stream, named as written. kube-proxy's INVALID rule is
/// left to `conntrack_invalid`, and so is a drop no understood rule
/// matches.
pub(in crate::collector) fn dropped_by_rule(ctx: &RuleCtx<'_>) -> Option<Found> {
    let flow = ctx.flow;
    if ctx.verdict != Verdict::Dropped || !flow.watch.is_some_and(|w| w.failed()) {
        return None;
    }
    let proto = Proto::from_raw(flow.proto)?.as_str();
    let (drop, rule) = flow
        .obs
        .iter()
        .filter(|o| o.hook == hook::DROP && Some(o.drop_reason) == ctx.known.netfilter_drop)
        .find_map(|o| {
            let rule = ctx.kube.filter_drops.iter().find(|r| {
                !r.invalid
                    && !r.other_matches
                    && r.allows(o.src.addr, o.src.port, o.dst.addr, o.dst.port, proto)
            })?;
            Some((o, rule))
        })?;
    Some((
        format!("netfilter rule in chain {} dropped it", rule.chain),
        format!(
            "mid-stream the {} ({} → {}) was dropped by netfilter, and the node's filter table has a rule that drops it: `{}` (chain {}; a NetworkPolicy or firewall rule added after the connection was opened)",
            ctx.kind(drop.packet),
            drop.src,
            drop.dst,
            rule.rule,
            rule.chain
        ),
    ))
}

/// Cause `conntrack_invalid`: an established flow whose opening conntrack
/// NATed stops being NATed while br_netfilter runs (a netfilter hook saw
/// its packets after the failure): netfilter dropped one after FORWARD —
/// kube-proxy's `-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP`,
/// which it installs unless nf_conntrack_tcp_be_liberal is set (1.29+),
/// is the rule that drops INVALID packets there — or its reply reached the
/// client with the backend's source although it passed netfilter.
/// nf_nat_inet_fn (net/netfilter/nf_nat_core.c) NATs only packets with a
/// conntrack entry; an INVALID one has none (skb->_nfct is 0).
pub(crate) fn conntrack_invalid(ctx: &RuleCtx<'_>) -> Option<Found> {
    let flow = ctx.flow;
    if !flow.watch.is_some_and(|w| w.failed()) || ctx.facts.bridge_nf_call_iptables == Some(false) {
        return None;
    }
    let in_nf = |p: u8| {
        flow.packet_obs(p)
            .any(|o| o.hook == tracer_common::hook::NETFILTER && in_node(o.netns, ctx.node_netns))
    };
    match ctx.verdict {
        Verdict::Dropped => {
            // The watched drop itself comes alone (its hops were muted); the
            // retransmissions after it show where netfilter dropped them.
            let place = "after netfilter FORWARD";
            let drop = flow.obs.iter().find(|o| {
                o.hook == tracer_common::hook::DROP
                    && Some(o.drop_reason) == ctx.known.netfilter_drop
                    && drop_place(flow, o, ctx.ifnames) == place
            })?;
            // The node's own INVALID rule as written, when its filter table
            // (read again at the failure) has one; kube-proxy's nftables
            // rules are not read for it.
            let rule = match ctx.kube.filter_drops.iter().find(|r| r.invalid) {
                Some(r) => format!("the node's `{}` (chain {})", r.rule, r.chain),
                None => "kube-proxy's `-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP` (or its nftables mode's `ct state invalid drop`)".to_string(),
            };
            Some((
                "conntrack no longer tracked the connection and netfilter dropped it as INVALID"
                    .to_string(),
                format!(
                    "mid-stream, after the opening was DNATed, a netfilter rule dropped the {} {place} ({} → {}): a packet of an established connection dropped in FORWARD is what {rule} does once the connection's conntrack entry is gone (deleted, flushed, timed out with nf_conntrack_tcp_loose=0) or its packet is out of the TCP window; no other DROP rule of the filter table matches it",
                    ctx.kind(drop.packet),
                    drop.src,
                    drop.dst
                ),
            ))
        }
        Verdict::ReplyNotReverseNated => {
            let passed = (0..flow.packets.len() as u8).find(|&p| in_nf(p))?;
            Some((
                "conntrack no longer NATs the connection (entry gone or INVALID)".to_string(),
                format!(
                    "mid-stream the reply reached the client with the backend's source although the flow's packets still pass netfilter (the {} did): conntrack no longer holds the connection's NAT — its entry was deleted or flushed (with nf_conntrack_tcp_loose=0 no new one is made mid-stream) or the packets are INVALID (out of the TCP window), and NAT skips packets without an entry",
                    ctx.kind(passed)
                ),
            ))
        }
        _ => None,
    }
}
