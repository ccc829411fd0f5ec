//! Causes told by the ICMP errors about a flow (issue 23): a path-MTU
//! black hole, an error not translated back for the client, and the
//! evidence that a REJECT's port unreachable reached the client.
use tracer_common::hook;

use super::{Found, RuleCtx};
use crate::collector::{
    icmp::{self, IcmpObs},
    types::{Dir, Obs},
    verdict::drop_place,
};

/// The drop reason the IPv4 and IPv6 forwarding paths give a packet that
/// does not fit the next hop's MTU (ip_forward, ip6_forward:
/// SKB_DROP_REASON_PKT_TOO_BIG, next to their icmp_send/icmpv6_send of the
/// error).
const PKT_TOO_BIG: &str = "PKT_TOO_BIG";

/// The flow's PKT_TOO_BIG drop, preferring one whose packet was seen
/// before it died (a retransmission, sent per packet after the watch's
/// alert: the first drop of a muted flow comes alone).
fn too_big_drop<'f>(ctx: &RuleCtx<'f>) -> Option<&'f Obs> {
    let flow = ctx.flow;
    let mut drops = flow.obs.iter().filter(|o| {
        o.hook == hook::DROP
            && ctx
                .reasons
                .name(o.drop_reason)
                .is_some_and(|n| n.as_str() == PKT_TOO_BIG)
    });
    let first = drops.clone().next();
    drops
        .find(|d| {
            flow.packet_obs(d.packet)
                .any(|o| o.hook != hook::DROP && o.ts_ns <= d.ts_ns)
        })
        .or(first)
}

/// Where a hop was: "netfilter OUTPUT", "dev-rx eth0".
fn point(ctx: &RuleCtx<'_>, o: &Obs) -> String {
    if o.hook == hook::NETFILTER {
        format!("netfilter {}", tracer_common::nf_hook::name(o.nf_hook))
    } else {
        format!(
            "{} on {}",
            hook::name(o.hook),
            ctx.ifnames.describe(o.netns, o.ifindex)
        )
    }
}

fn error_name(v6: bool) -> &'static str {
    if v6 {
        "ICMPv6 packet too big"
    } else {
        "ICMP fragmentation needed"
    }
}

/// Where the error packet `g` died, or was last seen.
fn fate(ctx: &RuleCtx<'_>, g: &[IcmpObs], sender: &str) -> String {
    let describe = |o: &Obs| ctx.ifnames.describe(o.netns, o.ifindex);
    if let Some(d) = icmp::drop_of(g) {
        return format!(
            "dropped {} ({})",
            icmp::drop_place(g, d, describe),
            ctx.reason(d.obs.drop_reason)
        );
    }
    match g.iter().max_by_key(|o| o.obs.ts_ns) {
        Some(last) => format!(
            "last seen at {}, never at the {sender}",
            point(ctx, &last.obs)
        ),
        None => format!("never seen at the {sender}"),
    }
}

/// Cause `pmtu_blackhole`: packets of the flow dropped as too big for the
/// next link (PKT_TOO_BIG, or a frag-needed / packet-too-big generated for
/// them), and no such error reached their sender, which therefore keeps
/// sending packets that cannot pass.
pub(crate) fn pmtu_blackhole(ctx: &RuleCtx<'_>) -> Option<Found> {
    let flow = ctx.flow;
    let drop = too_big_drop(ctx);
    let groups = icmp::groups(flow);
    let errors: Vec<&Vec<IcmpObs>> = groups.iter().filter(|g| g[0].is_too_big()).collect();
    if drop.is_none() && errors.is_empty() {
        return None;
    }
    if errors
        .iter()
        .any(|g| icmp::reached_sender(flow, g, ctx.node_netns))
    {
        // Path-MTU discovery got its answer: whatever failed, not this.
        return None;
    }
    let v6 = flow.service.addr.is_ipv6();
    let name = error_name(v6);
    let first = errors.first().map(|g| &g[0]);
    let dir = match (first, drop) {
        (Some(o), _) => icmp::about_dir(flow, o),
        (None, Some(d)) => flow.packets[d.packet as usize].dir,
        (None, None) => return None,
    };
    let (sender, what) = match dir {
        Dir::Request => ("client", "request packets"),
        Dir::Reply => ("backend", "reply packets"),
    };
    let size = first
        .map(|o| format!(" of {} bytes", o.quoted_len))
        .unwrap_or_default();
    let mtu = first.map(|o| o.mtu).filter(|&m| m != 0);
    let link = mtu.map_or_else(
        || "the next link".to_string(),
        |m| format!("a {m}-byte link"),
    );
    let at = match drop {
        Some(d) if flow.packet_obs(d.packet).any(|o| o.hook != hook::DROP) => format!(
            " (dropped {}, {PKT_TOO_BIG})",
            drop_place(flow, d, ctx.ifnames)
        ),
        Some(d) => format!(
            " (dropped as {PKT_TOO_BIG}, in by {})",
            ctx.ifnames.describe(d.netns, d.ifindex)
        ),
        None => String::new(),
    };
    let died = match errors.first() {
        Some(g) => format!("the {name} from {} was {}", g[0].from, fate(ctx, g, sender)),
        None => format!(
            "no {name} was seen for them (not sent: rate-limited, or sent where nattrace does not look)"
        ),
    };
    let sizes = match (first, mtu) {
        (Some(o), Some(m)) => format!("{}-byte packets, {m}-byte path MTU", o.quoted_len),
        _ => "packets larger than the path MTU".to_string(),
    };
    Some((
        format!("path-MTU black hole: {sizes}; the {name} never reached the {sender}"),
        format!(
            "path-MTU black hole: {what}{size} did not fit {link}{at}, and {died}: the {sender} never learns the smaller MTU and keeps sending packets that cannot pass (the handshake works, large transfers stall)"
        ),
    ))
}

/// Cause `icmp_error_not_reverse_nated`: an error about the flow's request
/// reached the client quoting the backend's address, not the Service's —
/// conntrack did not translate it back (nf_nat_icmp_reply_translation), so
/// the client's stack finds no socket for it and discards it.
pub(crate) fn icmp_error_not_reverse_nated(ctx: &RuleCtx<'_>) -> Option<Found> {
    let flow = ctx.flow;
    icmp::groups(flow).iter().find_map(|g| {
        let c = icmp::at_client(flow, g)?;
        if icmp::about_dir(flow, c) != Dir::Request || c.obs.dst == flow.service {
            return None;
        }
        let e = icmp::describe(c);
        Some((
            format!("the {e} reached the client quoting {} instead of the Service", c.obs.dst),
            format!(
                "the {e} reached the client quoting {} → {} (the backend) instead of {}: conntrack did not translate the error's quoted header back (nf_nat_icmp_reply_translation), so the client's stack matches it to no socket and discards it",
                c.obs.src, c.obs.dst, flow.service
            ),
        ))
    })
}

/// For `no_endpoints`: what became of the REJECT's port unreachable.
pub(crate) fn reject_evidence(ctx: &RuleCtx<'_>) -> String {
    let flow = ctx.flow;
    let groups = icmp::groups(flow);
    let Some(g) = groups.iter().find(|g| g[0].is_port_unreachable()) else {
        return String::new();
    };
    let e = icmp::describe(&g[0]);
    match icmp::at_client(flow, g) {
        Some(c) if c.obs.dst == flow.service => format!(
            "; the client received the {e} quoting {} (its connect fails at once)",
            flow.service
        ),
        Some(c) => format!(
            "; the client received the {e} quoting {} instead of {}",
            c.obs.dst, flow.service
        ),
        None => format!("; the {e} was {}", fate(ctx, g, "client")),
    }
}
