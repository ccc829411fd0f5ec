//! Causes only an established flow has (issue 21): the connection's socket
//! gone at the backend while the client still uses it.
use tracer_common::{hook, tcp_flags};

use super::{Found, RuleCtx};
use crate::collector::{
    types::{Proto, in_node},
    verdict::{Verdict, reply_backend},
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
