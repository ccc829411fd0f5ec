//! Causes that are about the backend itself rather than the path: a stale
//! endpoint (the pod is gone, its KUBE-SEP rule still DNATs to it) and a
//! backend that refuses the connection (alive, port closed).
//!
//! What the kernel shows for a request DNATed to a deleted pod on a bridged
//! node (measured on 6.18 with `tests/tests/scenarios/stale.rs`, recordings in
//! `tracer-userspace/fixtures/stale_*.rec`):
//! - No neighbour entry for the pod's address (never talked to, or already
//!   failed): br_netfilter's PREROUTING DNATs it, and as the new route leads
//!   back out of the bridge the packet is re-bridged ("bridged_dnat" in
//!   br_nf_pre_routing_finish, net/bridge/br_netfilter_hooks.c), whose
//!   br_nf_pre_routing_finish_bridge calls `neigh->output`: the packet waits
//!   on the entry's arp_queue (`__neigh_event_send`, net/core/neighbour.c)
//!   and no later hook sees it. When the probes run out
//!   (`neigh_max_probes` = ucast_probes + app_probes + mcast_probes, counting
//!   from ucast_probes: 3 broadcast probes `retrans_time` = 1 s apart, the
//!   arp_tbl defaults in net/ipv4/arp.c), `neigh_invalidate` hands every
//!   queued packet to `arp_error_report`, which frees it with
//!   `SKB_DROP_REASON_NEIGH_FAILED` — about 3 s after the first one queued,
//!   usually after the reply timeout.
//! - A neighbour entry that still has the MAC (the pod answered recently):
//!   the bridge looks the MAC up, no port has it any more, so it floods the
//!   frame — other pods drop it with `OTHERHOST`, and with no other port the
//!   bridge frees it with `NO_TX_TARGET` (br_flood, net/bridge/br_forward.c).
//!   The neighbour state machine is not driven on this path (the cached
//!   header is copied by neigh_hh_bridge), so no NEIGH_FAILED follows.
//!   Which of the two happens can depend on the bridge's MAC: one never set
//!   by hand follows its lowest port MAC, and when the deleted port had it,
//!   the change flushes the bridge's neighbour entries (NETDEV_CHANGEADDR →
//!   neigh_changeaddr in arp_netdev_event, net/ipv4/arp.c).
//!
//! Because the queued packet never reached POSTROUTING, its conntrack entry
//! was never confirmed: it dies with the packet, and the client's
//! retransmitted SYN is load-balanced again, possibly to a live backend
//! (see `attempts` in report.rs).

use tracer_common::{hook, nat_stage, nf_hook, proto, tcp_flags};

use super::{Found, RuleCtx};
use crate::collector::{
    drop_reason::KnownReasons,
    flow::Flow,
    flow::NEIGH_FAIL_WAIT_NS,
    types::{Dir, Endpoint, Obs, Proto, in_node},
    verdict::{neighbour_gave_up, packet_backend, reply_backend, vanished_since},
};

/// A request dropped in the node at the route lookup right after DNAT: no
/// route to the backend, e.g. a routed node (Calico) whose pod /32 route
/// left with the pod's veth, so the address falls into the node block's
/// blackhole route. Measured with such a route in the lab: NOT_SPECIFIED
/// (ip_error keeps its default reason for a blackhole).
fn is_no_route_drop(flow: &Flow, known: &KnownReasons, o: &Obs, node_netns: u32) -> bool {
    if o.hook != hook::DROP
        || !in_node(o.netns, node_netns)
        || !known.no_route.contains(&Some(o.drop_reason))
    {
        return false;
    }
    // The packet's previous point: the DNAT itself (PREROUTING or, for a
    // node-local client, OUTPUT); tc ingress of the same device may repeat.
    flow.packet_obs(o.packet)
        .filter(|p| p.ts_ns <= o.ts_ns && p.hook != hook::DROP)
        .filter(|p| p.hook == hook::NETFILTER)
        .max_by_key(|p| p.ts_ns)
        .is_some_and(|p| {
            p.nat_stage == nat_stage::AFTER
                && matches!(p.nf_hook, nf_hook::PRE_ROUTING | nf_hook::LOCAL_OUT)
                && p.dst == o.dst
                && p.dst != flow.service
        })
}

fn is_stale_drop(known: &KnownReasons, o: &Obs, node_netns: u32) -> bool {
    if o.hook != hook::DROP {
        return false;
    }
    let r = o.drop_reason;
    known.is_neigh_failure(r)
        || Some(r) == known.queue_purge
        || Some(r) == known.no_tx_target
        // Flooded by the bridge to pods that are not the backend.
        || (Some(r) == known.otherhost && !in_node(o.netns, node_netns))
}

fn sep_of(ctx: &RuleCtx<'_>, backend: Endpoint) -> String {
    Proto::from_raw(ctx.flow.proto)
        .and_then(|p| {
            ctx.kube.lookup(
                ctx.flow.service.socket_addr(),
                p.as_str(),
                Some(backend.socket_addr()),
            )
        })
        .and_then(|m| m.sep_chain)
        .map(|sep| format!(" (endpoint chain {sep})"))
        .unwrap_or_default()
}

pub(in crate::collector) fn backend_unreachable(ctx: &RuleCtx<'_>) -> Option<Found> {
    let flow = ctx.flow;
    let drop = flow.obs.iter().find(|o| {
        flow.packets[o.packet as usize].dir == Dir::Request
            && o.dst != flow.service
            && (is_stale_drop(ctx.known, o, ctx.node_netns)
                || is_no_route_drop(flow, ctx.known, o, ctx.node_netns))
    });
    let (backend, how) = match drop {
        Some(o) => {
            let ip = o.dst.addr;
            // Tracepoints see every namespace of the kernel: in a lab or kind
            // the backend's own node may be another namespace here.
            let who = if ctx.is_node(o.netns) {
                format!(
                    "the node could not resolve {ip}'s MAC address on {}",
                    ctx.ifname(o.ifindex)
                )
            } else {
                format!(
                    "namespace {} (the backend's node?) could not resolve {ip}'s MAC address",
                    o.netns
                )
            };
            let how = if is_no_route_drop(flow, ctx.known, o, ctx.node_netns) {
                format!(
                    "the node has no route to {ip}: the {} was dropped at the routing decision right after DNAT ({}), as on a routed node whose route to the pod left with the pod's veth (the node's pod block is a blackhole route)",
                    ctx.kind(o.packet),
                    ctx.reason(o.drop_reason)
                )
            } else if ctx.known.is_neigh_failure(o.drop_reason) {
                format!(
                    "{who}: nothing answered its ARP requests, and the kernel dropped the queued {} ({})",
                    ctx.kind(o.packet),
                    ctx.reason(o.drop_reason)
                )
            } else if Some(o.drop_reason) == ctx.known.queue_purge {
                // neigh_flush_dev (net/core/neighbour.c) purges an entry's
                // queue when its device loses carrier or changes address,
                // e.g. a bridge whose last port (the pod's) went away.
                format!(
                    "{who}: the {} was queued waiting for it when the kernel flushed the neighbour entry ({}), as when the device towards the pod lost its last port or changed its MAC address",
                    ctx.kind(o.packet),
                    ctx.reason(o.drop_reason)
                )
            } else if Some(o.drop_reason) == ctx.known.no_tx_target {
                format!(
                    "the node still had {ip}'s old MAC address, but no bridge port has it any more: the bridge found nowhere to send the {} ({})",
                    ctx.kind(o.packet),
                    ctx.reason(o.drop_reason)
                )
            } else {
                format!(
                    "the node still had {ip}'s old MAC address, but no bridge port has it any more: the bridge flooded the {} to other pods, which dropped it ({} in namespace {})",
                    ctx.kind(o.packet),
                    ctx.reason(o.drop_reason),
                    o.netns
                )
            };
            (o.dst, how)
        }
        None if let Some((p, at)) = neighbour_gave_up(flow, ctx.node_netns) => {
            let b = packet_backend(flow, p)?;
            let since = flow.packets[p as usize].first_ts;
            let (asked, error) = if b.addr.is_ipv6() {
                ("neighbour solicitations", "ICMPv6 address unreachable")
            } else {
                ("ARP requests", "ICMP host unreachable")
            };
            (
                b,
                format!(
                    "the node could not resolve {}'s MAC address: nothing answered its {asked}, and {} ms after the {} was queued the kernel gave up, answered the client with {error} and freed the {} (NEIGH_FAILED; that drop's own event was not seen)",
                    b.addr,
                    at.saturating_sub(since) / 1_000_000,
                    ctx.kind(p),
                    ctx.kind(p),
                ),
            )
        }
        None => {
            // No drop (yet): a request held for neighbour resolution for
            // longer than resolution takes.
            let since = vanished_since(flow, ctx.node_netns)?;
            if ctx.decided_ts < since + NEIGH_FAIL_WAIT_NS {
                return None;
            }
            let p = flow
                .packets
                .iter()
                .position(|p| p.first_ts == since && p.dir == Dir::Request)?;
            let b = packet_backend(flow, p as u8)?;
            (
                b,
                format!(
                    "the {} never left the node after DNAT (held waiting for {}'s MAC address for {} ms)",
                    ctx.kind(p as u8),
                    b.addr,
                    (ctx.decided_ts - since) / 1_000_000
                ),
            )
        }
    };
    Some((
        format!("backend {backend} is unreachable (stale endpoint?)"),
        format!(
            "the {} was DNATed to backend {backend}{}, which is gone or unreachable: {how}",
            ctx.first_request_kind(),
            sep_of(ctx, backend),
        ),
    ))
}

/// The first reply the client got was a RST from the backend itself.
pub(in crate::collector) fn backend_port_closed(ctx: &RuleCtx<'_>) -> Option<Found> {
    let flow = ctx.flow;
    let reply = flow.client_reply?;
    let p = &flow.packets[reply.packet as usize];
    if flow.proto != proto::TCP || p.key.tcp_flags & tcp_flags::RST == 0 {
        return None;
    }
    let backend = reply_backend(flow, reply.packet).or(flow.backend)?;
    Some((
        format!("backend {backend} refused the connection (port closed)"),
        format!(
            "the {} was DNATed to backend {backend}{}, which answered with {}: the pod is there but nothing listens on port {} (not started yet, crashed, or a wrong targetPort)",
            ctx.first_request_kind(),
            sep_of(ctx, backend),
            ctx.kind(reply.packet),
            backend.port
        ),
    ))
}
