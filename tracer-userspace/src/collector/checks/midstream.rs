//! Causes only an established flow has (issue 21): the connection's socket
//! gone at the backend while the client still uses it.
use tracer_common::{hook, tcp_flags};

use crate::ctnetlink::CtLookup;

use super::{Found, RuleCtx};
use crate::collector::{
    types::{Dir, Endpoint, Proto, in_node},
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
/// After the backend's own FIN it is [`backend_closed`] instead.
pub(in crate::collector) fn backend_restarted(ctx: &RuleCtx<'_>) -> Option<Found> {
    let (after_fin, backend) = bare_rst_from_backend(ctx)?;
    if after_fin {
        return None;
    }
    let flow = ctx.flow;
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

/// A connection whose handshake completed but which the backend's listener
/// had no room for in its accept queue (net/ipv4/tcp_minisocks.c
/// `tcp_check_req`: `syn_recv_sock` fails on `sk_acceptq_is_full`,
/// `listen_overflow`). With `net.ipv4.tcp_abort_on_overflow=1`
/// `embryonic_reset` answers the client's first segment with a bare RST:
/// `refused` by a reset that came before the backend answered anything,
/// within [`FIRST_SEGMENT_NS`] of the opening (a pooled connection reset
/// on its first use minutes later is left to `backend_restarted`). At 0,
/// the default, the segment is dropped with TCP_LISTEN_OVERFLOW and the
/// client retransmits into the same queue: `dropped`. Both reproduced in
/// tests/tests/established_more.rs with a listener that never accepts.
pub(in crate::collector) fn listen_queue_overflow(ctx: &RuleCtx<'_>) -> Option<Found> {
    let flow = ctx.flow;
    if ctx.verdict == Verdict::NoReply {
        return silent_listener(ctx);
    }
    if ctx.verdict == Verdict::Dropped {
        let reason = ctx.known.listen_overflow?;
        let drop = flow
            .obs
            .iter()
            .find(|o| o.hook == hook::DROP && o.drop_reason == reason)?;
        return Some((
            format!(
                "{}'s listener had no room for the connection (accept queue full)",
                drop.dst
            ),
            format!(
                "the client's {} was dropped at {} with TCP_LISTEN_OVERFLOW: the handshake completed but the listener's accept queue was full (the server does not accept() as fast as connections come), so the kernel drops the client's segments (net.ipv4.tcp_abort_on_overflow=0) and resends its SYN-ACK until a place frees or the half-open connection expires (net.ipv4.tcp_synack_retries); the client's connect() succeeded and its request hangs",
                ctx.kind(drop.packet),
                drop.dst
            ),
        ));
    }
    let (after_fin, backend) = bare_rst_from_backend(ctx)?;
    let w = flow.watch?;
    if after_fin || w.good != 0 || w.failed_ts.saturating_sub(w.ok_ts) > FIRST_SEGMENT_NS {
        return None;
    }
    Some((
        format!(
            "backend {backend} reset the connection right after its handshake (its listen queue was full?)"
        ),
        format!(
            "backend {backend} answered the client's first segment after the handshake with a bare RST, having answered nothing before: its kernel held nothing of the connection but the handshake — its listener had no room left in its accept queue (the server does not accept() as fast as connections come, and net.ipv4.tcp_abort_on_overflow=1 makes the kernel reset instead of drop), or the listener was closed right after the handshake; the client's connect() succeeded, its first read or write fails with ECONNRESET"
        ),
    ))
}

/// A SYN received in the backend's namespace and never answered, nothing
/// of it dropped where nattrace sees it: a listener whose accept queue is
/// full drops a SYN without a drop event (net/ipv4/tcp_input.c
/// `tcp_conn_request`: `sk_acceptq_is_full` → LISTENOVERFLOWS, `goto
/// drop`, which returns 0, and `tcp_rcv_state_process` then consumes the
/// skb), and the client's connect() times out. It was named
/// `no_reply_through_node` ("the reply never came back through this
/// node"), which needs a reply: here the backend's namespace got the SYN
/// and sent nothing (found with the lab's never-accepting listener). A
/// backend on another node is out of sight of a real node's tracer, so
/// there the routing cause stays.
fn silent_listener(ctx: &RuleCtx<'_>) -> Option<Found> {
    let flow = ctx.flow;
    let backend = flow.backend?;
    if flow.proto != tracer_common::proto::TCP
        || flow.packets.iter().any(|p| p.dir == Dir::Reply)
        || flow.obs.iter().any(|o| o.hook == hook::DROP)
    {
        return None;
    }
    // Decided before a neighbour failure on the way could have been
    // reported (tracing stopped): the SYN may still be waiting for the
    // backend's address to resolve.
    if super::super::verdict::hold_until(flow, ctx.node_netns, ctx.known)
        .is_some_and(|t| ctx.decided_ts < t)
    {
        return None;
    }
    // Where each SYN was seen last: received in a namespace that is not
    // the node's, addressed to the backend, and no further.
    let syn = |p: u8| {
        let k = &flow.packets[p as usize].key;
        flow.packets[p as usize].dir == Dir::Request
            && k.tcp_flags & (tcp_flags::SYN | tcp_flags::ACK) == tcp_flags::SYN
    };
    let rx = flow
        .obs
        .iter()
        .filter(|o| syn(o.packet))
        .max_by_key(|o| o.ts_ns)
        .filter(|o| {
            o.hook == hook::DEV_RX && !in_node(o.netns, ctx.node_netns) && o.dst == backend
        })?;
    let syns = flow
        .packets
        .iter()
        .filter(|p| p.dir == Dir::Request && p.key.tcp_flags & tcp_flags::SYN != 0)
        .count();
    Some((
        format!(
            "backend {backend} received the SYN and never answered (its listen queue was full?)"
        ),
        format!(
            "the SYN reached backend {backend} (received on interface {} of its namespace; {syns} SYN(s) sent) and nothing came back, nothing dropped where nattrace sees: a listener whose accept queue is full drops new SYNs without a trace (the server does not accept() as fast as connections come; `nstat -az TcpExtListenOverflows TcpExtListenDrops` in the pod rises), or the backend's own stack or a filter nattrace does not see discards them; the client's connect() times out",
            rx.ifindex
        ),
    ))
}

/// How soon after the opening a client's first segment comes (a client
/// sends its request as connect() returns).
const FIRST_SEGMENT_NS: u64 = 1_000_000_000;

/// A flow that was `ok`, whose backend then closed the connection (its FIN
/// passed the node while the flow was muted: `event_flags::AFTER_FIN`) and
/// answered the client's later data with a bare RST. A kernel resets data
/// that reaches a socket its application has closed
/// (net/ipv4/tcp_input.c `tcp_rcv_state_process`, FIN_WAIT1/2 with
/// RCV_SHUTDOWN: "RFC 1122 says we MUST send a reset", drop reason
/// TCP_ABORT_ON_DATA; found when iperf3's server ended its tests this way
/// in the bench). The socket was closed, not lost: by the application
/// (the keep-alive race: the client used a connection the server had
/// ended) or by its process exiting, whose sockets the kernel closes the
/// same way (a crash with nothing unread sends a FIN too), so restarts are
/// still named as a thing to check.
pub(in crate::collector) fn backend_closed(ctx: &RuleCtx<'_>) -> Option<Found> {
    let (after_fin, backend) = bare_rst_from_backend(ctx)?;
    if !after_fin {
        return None;
    }
    Some((
        format!("backend {backend} had closed the connection; the client wrote after"),
        format!(
            "backend {backend} closed the connection (its FIN passed the node) and answered the client's later segment with a bare RST: data sent to a socket its application has closed is reset (RFC 1122 4.2.2.13), so the client's next read or write fails (ECONNRESET, or EPIPE after it read the FIN) — the server ended the connection while the client still used it (a server idle or keep-alive timeout shorter than the client's, or a client that writes after the server's last response), or the server's process exited (its kernel closes its sockets the same way: check the pod's restarts)"
        ),
    ))
}

/// The bare RST (no ACK) a failed `refused` established flow got from its
/// backend's side, not made by the node itself: whether the backend's FIN
/// came before it, and the backend that sent it.
fn bare_rst_from_backend(ctx: &RuleCtx<'_>) -> Option<(bool, Endpoint)> {
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
    Some((p.after_fin, backend))
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
    let entry = flow
        .ct_tuples()
        .and_then(|(t, _)| ctx.facts.ct_entry(&t))
        .map(|l| ct_entry_found(l, flow.backend));
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
            let packet = format!(
                "{} {place} ({} → {})",
                ctx.kind(drop.packet),
                drop.src,
                drop.dst
            );
            Some(match entry {
                Some(e) => (
                    format!("{} and netfilter dropped it as INVALID", e.summary),
                    format!(
                        "mid-stream, after the opening was DNATed, {rule} dropped the {packet}: conntrack marked it INVALID. {}",
                        e.detail
                    ),
                ),
                None => (
                    "conntrack no longer tracked the connection and netfilter dropped it as INVALID"
                        .to_string(),
                    format!(
                        "mid-stream, after the opening was DNATed, a netfilter rule dropped the {packet}: a packet of an established connection dropped in FORWARD is what {rule} does once the connection's conntrack entry is gone (deleted, flushed, timed out with nf_conntrack_tcp_loose=0) or its packet is out of the TCP window; no other DROP rule of the filter table matches it"
                    ),
                ),
            })
        }
        Verdict::ReplyNotReverseNated => {
            let passed = (0..flow.packets.len() as u8).find(|&p| in_nf(p))?;
            let passed = ctx.kind(passed);
            Some(match entry {
                Some(e) => (
                    format!("{}: NAT skipped its reply", e.summary),
                    format!(
                        "mid-stream the reply reached the client with the backend's source although the flow's packets still pass netfilter (the {passed} did): NAT skips a packet conntrack marked INVALID. {}",
                        e.detail
                    ),
                ),
                None => (
                    "conntrack no longer NATs the connection (entry gone or INVALID)".to_string(),
                    format!(
                        "mid-stream the reply reached the client with the backend's source although the flow's packets still pass netfilter (the {passed} did): conntrack no longer holds the connection's NAT — its entry was deleted or flushed (with nf_conntrack_tcp_loose=0 no new one is made mid-stream) or the packets are INVALID (out of the TCP window), and NAT skips packets without an entry"
                    ),
                ),
            })
        }
        _ => None,
    }
}

/// Why conntrack marked a flow's packets INVALID, from its entry as looked
/// up over ctnetlink when the flow failed the watch.
struct CtFound {
    summary: String,
    detail: String,
}

fn ct_entry_found(l: &CtLookup, backend: Option<Endpoint>) -> CtFound {
    let sysctl = |v: Option<bool>| match v {
        Some(true) => "1",
        Some(false) => "0",
        None => "unknown",
    };
    let loose = sysctl(l.tcp_loose);
    let liberal = sysctl(l.tcp_be_liberal);
    let backend = backend.map(|b| std::net::SocketAddr::new(b.addr, b.port));
    if let Some(err) = &l.error {
        return CtFound {
            summary: "conntrack no longer NATs the connection (its entry could not be looked up)"
                .to_string(),
            detail: format!(
                "Whether its entry was gone or the packet out of the TCP window is unknown: looking the entry up over ctnetlink failed ({err})."
            ),
        };
    }
    match (&l.entry, &l.unnated) {
        (Some(e), _) if e.dnat() && Some(e.reply.src) == backend => CtFound {
            summary: "conntrack marked a packet INVALID with the connection's entry in place (out of the TCP window)".to_string(),
            detail: format!(
                "When the flow failed, conntrack still held its entry ({}, DNAT to {}{}), so the packet was INVALID for its own sake: outside the TCP window conntrack tracks (tcp_in_window in net/netfilter/nf_conntrack_proto_tcp.c: a SEQ over the receiver's window or an ACK of data never seen; since 6.1 a SEQ under the window — an old retransmission — is ignored, not INVALID). Fix: find what sent the out-of-window segment (a middlebox rewriting sequence numbers, asymmetric routing past this node's conntrack, a TCP stack sending beyond the advertised window); nf_conntrack_tcp_be_liberal=1 (now {liberal}) makes conntrack let such packets through, and kube-proxy 1.29+ then leaves its INVALID DROP rule out (`conntrack.tcpBeLiberal`).",
                e.tcp_state.as_deref().unwrap_or("no TCP state"),
                e.reply.src,
                e.timeout_s.map(|s| format!(", expires in {s} s")).unwrap_or_default()
            ),
        },
        (Some(e), _) => CtFound {
            summary: "conntrack's entry for the connection was replaced".to_string(),
            detail: format!(
                "When the flow failed, conntrack held a different entry for it: {} (orig {} → {}, reply {} → {}), not the one its opening DNATed to {}: the first entry was deleted and a new one made mid-stream (nf_conntrack_tcp_loose={loose}: with 1 conntrack picks a connection up from any packet, and the nat table's rules then ran again for it). Fix: find what deleted the entry (`conntrack -D`/`-F`, kube-proxy's cleanup of stale UDP/endpoint entries, a conntrack timeout shorter than the connection's idle time).",
                if e.dnat() { format!("DNAT to {}", e.reply.src) } else { "no DNAT".to_string() },
                e.orig.src,
                e.orig.dst,
                e.reply.src,
                e.reply.dst,
                backend.map(|b| b.to_string()).unwrap_or_else(|| "its backend".to_string())
            ),
        },
        (None, Some(e)) => CtFound {
            summary: "conntrack's entry for the connection was deleted and replaced by one without NAT".to_string(),
            detail: format!(
                "When the flow failed, conntrack had no entry for the client's tuple ({} → {}) but one made mid-stream for the backend's direction without NAT (orig {} → {}, {}): the DNAT entry was deleted and nf_conntrack_tcp_loose={loose} picked the connection up again from the backend's packet, so its replies are no longer reverse-NATed. Fix: find what deleted the entry (`conntrack -D`/`-F`, a conntrack timeout shorter than the connection's idle time); the client has to reconnect.",
                l.tuple.src,
                l.tuple.dst,
                e.orig.src,
                e.orig.dst,
                e.tcp_state.as_deref().unwrap_or("no TCP state")
            ),
        },
        (None, None) => CtFound {
            summary: "conntrack's entry for the connection was gone (deleted, flushed or expired)".to_string(),
            detail: format!(
                "When the flow failed, conntrack had no entry for it ({} → {}): the entry was deleted (`conntrack -D`/`-F`, kube-proxy's cleanup after an endpoint change) or expired, {}",
                l.tuple.src,
                l.tuple.dst,
                if l.tcp_loose == Some(false) {
                    "and with nf_conntrack_tcp_loose=0 conntrack makes no new one from a packet that is not a SYN (tcp_new in net/netfilter/nf_conntrack_proto_tcp.c), so every later packet is INVALID. Fix: find what deleted the entry; nf_conntrack_tcp_loose=1 (the kernel's default) lets conntrack pick the connection up again; the client has to reconnect."
                        .to_string()
                } else {
                    format!("and no new one was made since (nf_conntrack_tcp_loose={loose}). Fix: find what deleted the entry; the client has to reconnect.")
                }
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ctnetlink::{CtEntry, CtTuple, IPS_DST_NAT};

    fn t(src: &str, dst: &str) -> CtTuple {
        CtTuple {
            proto: 6,
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
        }
    }

    /// Each answer conntrack can give names its own cause.
    #[test]
    fn ct_entry_names_which_invalid() {
        let backend = Endpoint {
            addr: "10.244.1.9".parse().unwrap(),
            port: 8080,
        };
        let sent = t("10.244.1.5:41001", "100.67.30.133:80");
        let entry = |reply_src: &str, status| CtEntry {
            orig: sent,
            reply: t(reply_src, "10.244.1.5:41001"),
            status,
            tcp_state: Some("ESTABLISHED".into()),
            timeout_s: Some(431_999),
        };
        let lookup = |entry, unnated| CtLookup {
            tuple: sent,
            entry,
            unnated,
            tcp_loose: Some(false),
            tcp_be_liberal: Some(false),
            error: None,
        };
        let found = |l: CtLookup| ct_entry_found(&l, Some(backend));
        let window = found(lookup(Some(entry("10.244.1.9:8080", IPS_DST_NAT)), None));
        assert!(
            window.summary.contains("out of the TCP window"),
            "{}",
            window.summary
        );
        assert!(
            window
                .detail
                .contains("ESTABLISHED, DNAT to 10.244.1.9:8080")
        );
        let replaced = found(lookup(Some(entry("10.244.2.7:8080", IPS_DST_NAT)), None));
        assert!(
            replaced.summary.contains("replaced"),
            "{}",
            replaced.summary
        );
        assert!(replaced.detail.contains("DNAT to 10.244.2.7:8080"));
        let unnated = CtEntry {
            orig: t("10.244.1.9:8080", "10.244.1.5:41001"),
            reply: t("10.244.1.5:41001", "10.244.1.9:8080"),
            status: 0,
            tcp_state: Some("ESTABLISHED".into()),
            timeout_s: None,
        };
        let picked = found(lookup(None, Some(unnated)));
        assert!(
            picked.summary.contains("replaced by one without NAT"),
            "{}",
            picked.summary
        );
        let gone = found(lookup(None, None));
        assert!(gone.summary.contains("was gone"), "{}", gone.summary);
        assert!(
            gone.detail
                .contains("nf_conntrack_tcp_loose=0 conntrack makes no new one")
        );
        let unknown = found(CtLookup {
            error: Some("Operation not permitted".into()),
            ..lookup(None, None)
        });
        assert!(unknown.detail.contains("Operation not permitted"));
    }
}
