//! Causes that depend on the path a flow took through the node rather than
//! on a sysctl: replies that bypass the DNATing node, and hairpin flows.
use tracer_common::hook;

use super::{Found, RuleCtx, bridge_of};
use crate::collector::types::{Dir, Obs, in_node, node_egress, node_ingress};

fn node_obs<'a>(ctx: &'a RuleCtx<'_>, dir: Dir) -> impl Iterator<Item = &'a Obs> + 'a {
    let flow = ctx.flow;
    let node = ctx.node_netns;
    flow.obs.iter().filter(move |o| {
        flow.packets[o.packet as usize].dir == dir && in_node(o.netns, node) && o.hook != hook::DROP
    })
}

/// This node saw the request only after another node had DNATed it, and the
/// reply left here with the backend's address: the node holding the
/// conntrack entry never sees the reply.
pub(in crate::collector) fn reply_bypasses_dnat_node(ctx: &RuleCtx<'_>) -> Option<Found> {
    let backend = ctx.flow.backend?;
    let mut requests = node_obs(ctx, Dir::Request).peekable();
    requests.peek()?;
    let mut came_in = None;
    for o in requests {
        if o.dst == ctx.flow.service {
            return None;
        }
        if came_in.is_none() && node_ingress(o.hook) {
            came_in = Some(o.ifindex);
        }
    }
    let reply = ctx.flow.client_reply?;
    let left = ctx
        .flow
        .packet_obs(reply.packet)
        .filter(|o| node_egress(o.hook) && ctx.is_node(o.netns))
        .last()?;
    let came_in = came_in
        .map(|i| format!(" by {}", ctx.ifname(i)))
        .unwrap_or_default();
    Some((
        "the request was DNATed by another node and the reply left here without going back through it".to_string(),
        format!(
            "the {} arrived at this node{came_in} already DNATed to {backend} by another node, and the {} left by {} with source {} straight towards the client {}, bypassing the node that DNATed it (asymmetric return path)",
            ctx.first_request_kind(),
            ctx.kind(reply.packet),
            ctx.ifname(left.ifindex),
            left.src,
            ctx.flow.client,
        ),
    ))
}

pub(in crate::collector) fn hairpin_not_masqueraded(ctx: &RuleCtx<'_>) -> Option<Found> {
    if !ctx.flow.is_hairpin() || ctx.flow.snat.is_some() {
        return None;
    }
    let backend = ctx.flow.backend?;
    let what = match (ctx.flow.client_reply, ctx.drop) {
        (Some(reply), _) => format!(
            "so the {} stayed inside the pod with source {backend} and never passed the node's reverse NAT",
            ctx.kind(reply.packet)
        ),
        // Without accept_local the pod drops its own source address.
        (None, Some(d)) if !ctx.is_node(d.netns) => format!(
            "so it came back into the pod with the pod's own address {} as source and was dropped there",
            d.src.addr
        ),
        _ => return None,
    };
    let missing = ctx
        .kube
        .lookup(
            ctx.flow.service.socket_addr(),
            crate::collector::types::Proto::from_raw(ctx.flow.proto)?.as_str(),
            Some(backend.socket_addr()),
        )
        .and_then(|m| Some((m.sep_chain?, m.hairpin_masq?)))
        .filter(|(_, masq)| !masq)
        .map(|(sep, _)| {
            let ip = backend.addr;
            match ctx.kube.mode {
                crate::ruleset::ProxyMode::Nftables => {
                    format!("; {sep} has no `ip saddr {ip} jump mark-for-masquerade`")
                }
                _ => format!("; {sep} has no `-s {ip}/32 -j KUBE-MARK-MASQ`"),
            }
        })
        .unwrap_or_default();
    let marker = match ctx.kube.mode {
        crate::ruleset::ProxyMode::Nftables => "its endpoint chain",
        _ => "KUBE-SEP",
    };
    Some((
        format!("hairpin without masquerade ({marker} did not mark it)"),
        format!(
            "the pod reached itself through the Service (hairpin) and the {} was not masqueraded, {what}{missing}",
            ctx.first_request_kind(),
        ),
    ))
}

pub(in crate::collector) fn hairpin_mode_off(ctx: &RuleCtx<'_>) -> Option<Found> {
    if !ctx.flow.is_hairpin() {
        return None;
    }
    let port = ctx.facts.interface(ctx.flow.client_ifindex)?;
    bridge_of(ctx.facts, port.ifindex)?;
    if port.hairpin != Some(false) {
        return None;
    }
    let backend = ctx.flow.backend?;
    Some((
        format!("hairpin_mode is off on the bridge port {}", port.name),
        format!(
            "the pod reached itself through the Service (hairpin): the {} was DNATed back to {backend} and had to leave by the bridge port {} it came in by, but hairpin_mode is off on that port, so the bridge never sent it back",
            ctx.first_request_kind(),
            port.name
        ),
    ))
}
