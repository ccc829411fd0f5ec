//! The checks behind the causes in `causes.rs`: each looks at one decided
//! flow (its evidence plus the node facts) and either names the cause, as a
//! short clause and a full sentence, or passes. This file has the context
//! they share and the checks about sysctls, rules and drops; path, backend
//! and IPv6 checks live in `path.rs`, `backend.rs` and `ip6.rs`.
pub(super) mod backend;
pub(super) mod icmp;
pub(super) mod insert_failed;
pub(super) mod ip6;
pub(super) mod midstream;
pub(super) mod north_south;
pub(super) mod path;
pub(super) mod stale_entry;
pub(super) mod table_full;

use tracer_common::{hook, nat_stage, nf_hook};

use super::{
    drop_reason::{DropReasons, KnownReasons},
    flow::Flow,
    ifnames::IfNames,
    types::{Dir, Obs, Proto, in_node, node_egress, node_ingress},
    verdict::{Verdict, drop_place},
};
use crate::facts::NodeFacts;

pub(crate) struct RuleCtx<'a> {
    pub flow: &'a Flow,
    pub verdict: Verdict,
    pub facts: &'a NodeFacts,
    pub known: &'a KnownReasons,
    pub node_netns: u32,
    pub reply_timeout_ns: u64,
    /// The first real drop of the flow (dropped verdict).
    pub drop: Option<&'a Obs>,
    pub kube: crate::ruleset::IndexedRules<'a>,
    pub ifnames: &'a IfNames,
    /// Drop reason names, for the cause texts.
    pub reasons: &'a DropReasons,
    /// When the verdict is being decided (event time).
    pub decided_ts: u64,
}

impl RuleCtx<'_> {
    pub(super) fn first_request_kind(&self) -> &'static str {
        self.flow.first_request_kind()
    }

    pub(super) fn is_node(&self, netns: u32) -> bool {
        in_node(netns, self.node_netns)
    }

    pub(super) fn kind(&self, packet: u8) -> &'static str {
        self.flow.kind(packet)
    }

    pub(super) fn reason(&self, value: u32) -> String {
        self.reasons
            .name(value)
            .map_or_else(|| format!("reason {value}"), |n| n.to_string())
    }

    /// The name of a node interface (`if<N>` if unknown).
    pub(super) fn ifname(&self, ifindex: u32) -> String {
        self.ifnames.describe(self.node_netns, ifindex)
    }
}

/// (short clause, full text)
pub(super) type Found = (String, String);

/// The bridge `ifindex` is a port of. Only a master of kind `bridge` counts:
/// on a routed node (Calico, kindnet, AWS VPC CNI) the pods' veths have no
/// master, and a VRF or bond master has no hairpin_mode and no
/// bridge-nf-call-iptables, so the bridge causes must not be named there.
pub(super) fn bridge_of(facts: &NodeFacts, ifindex: u32) -> Option<u32> {
    let master = facts.interface(ifindex)?.master?;
    (facts.interface(master)?.kind == "bridge").then_some(master)
}

/// The reply that reached the client entered a bridge port and left by
/// another port of the same bridge, and no netfilter hook saw it.
pub(super) fn bridged_reply(ctx: &RuleCtx<'_>) -> Option<Found> {
    let reply = ctx.flow.client_reply?;
    let found = bridged_packet(ctx, reply.packet);
    // Mid-stream, the kernel's watch saw the reply only at the client (its
    // earlier hops were muted): the packets after it (the client's RST to
    // the backend, retransmits) show the bridge crossing instead.
    if found.is_none() && ctx.flow.watch.is_some_and(|w| w.failed()) {
        return (0..ctx.flow.packets.len() as u8).find_map(|p| bridged_packet(ctx, p));
    }
    found
}

/// Packet `packet` entered a bridge port and left by another port of the
/// same bridge, and no netfilter hook saw it.
fn bridged_packet(ctx: &RuleCtx<'_>, packet: u8) -> Option<Found> {
    let obs: Vec<&Obs> = ctx.flow.packet_obs(packet).collect();
    if obs.iter().any(|o| o.hook == hook::NETFILTER) {
        return None;
    }
    let port_of = |o: &&Obs, is: fn(u8) -> bool| {
        (is(o.hook) && ctx.is_node(o.netns))
            .then(|| bridge_of(ctx.facts, o.ifindex))
            .flatten()
            .map(|m| (o.ifindex, m))
    };
    let (in_port, bridge) = obs.iter().find_map(|o| port_of(o, node_ingress))?;
    let out_port = obs
        .iter()
        .filter_map(|o| port_of(o, node_egress))
        .find(|&(i, m)| m == bridge && i != in_port)
        .map(|(i, _)| i);
    let bridged_by_kprobe = obs.iter().any(|o| o.hook == hook::BR_FORWARD);
    if out_port.is_none() && !bridged_by_kprobe {
        return None;
    }
    let br = ctx.ifname(bridge);
    let to = out_port
        .map(|i| format!(" to {}", ctx.ifname(i)))
        .unwrap_or_default();
    let clause = format!("it crossed {br} without passing netfilter");
    let text = format!(
        "the {} crossed the bridge {br} from {}{to} without passing any netfilter hook",
        ctx.kind(packet),
        ctx.ifname(in_port)
    );
    Some((clause, text))
}

pub(super) fn bridged_reply_sysctl_off(ctx: &RuleCtx<'_>) -> Option<Found> {
    // IPv6 frames obey bridge-nf-call-ip6tables instead (ip6_rules).
    if ctx.flow.service.addr.is_ipv6() {
        return None;
    }
    bridged_past_netfilter(
        ctx,
        ctx.facts.bridge_nf_call_iptables,
        "bridge-nf-call-iptables",
    )
}

/// The reply was bridged without netfilter while the flow's family's
/// br_netfilter switch `sysctl` (its value, None without br_netfilter) was
/// off: one wording for both families.
pub(super) fn bridged_past_netfilter(
    ctx: &RuleCtx<'_>,
    value: Option<bool>,
    sysctl: &str,
) -> Option<Found> {
    if value == Some(true) {
        return None;
    }
    let (clause, text) = bridged_reply(ctx)?;
    let why = match value {
        None => format!("br_netfilter is not loaded (no net.bridge.{sysctl})"),
        _ => format!("net.bridge.{sysctl} is 0"),
    };
    Some((
        clause,
        format!("{text}; {why} in namespace {}", ctx.facts.netns_name),
    ))
}

pub(super) fn bridged_reply_sysctl_on(ctx: &RuleCtx<'_>) -> Option<Found> {
    let (clause, text) = bridged_reply(ctx)?;
    let knob = if ctx.flow.service.addr.is_ipv6() {
        "bridge-nf-call-ip6tables"
    } else {
        "bridge-nf-call-iptables"
    };
    Some((
        clause,
        format!(
            "{text}, although net.bridge.{knob} was 1 in namespace {} at start (changed since, or another namespace owns the bridge?)",
            ctx.facts.netns_name
        ),
    ))
}

pub(super) fn no_reply_through_node(ctx: &RuleCtx<'_>) -> Option<Found> {
    let backend = ctx.flow.backend?;
    // An asymmetric return path needs a request that left the node; one
    // that never did (held for neighbour resolution) is no routing problem.
    let left = ctx.flow.obs.iter().any(|o| {
        ctx.flow.packets[o.packet as usize].dir == Dir::Request
            && ctx.is_node(o.netns)
            && node_egress(o.hook)
    });
    if !left {
        return None;
    }
    // Decided before a neighbour failure on the way could have been
    // reported (tracing stopped): the backend may just be gone.
    if super::verdict::hold_until(ctx.flow, ctx.node_netns, ctx.known)
        .is_some_and(|t| ctx.decided_ts < t)
    {
        return None;
    }
    if ctx
        .flow
        .packets
        .iter()
        .any(|p| p.dir == Dir::Reply && p.in_node)
    {
        return None;
    }
    // Seen by the global tracepoints only: the reply took another way.
    let elsewhere = ctx
        .flow
        .obs
        .iter()
        .find(|o| {
            ctx.flow.packets[o.packet as usize].dir == Dir::Reply
                && o.dst == ctx.flow.client
                && o.hook == hook::DEV_RX
        })
        .map(|o| {
            format!(
                "; the client got a {} from {} by another path",
                ctx.kind(o.packet),
                o.src
            )
        })
        .unwrap_or_default();
    let at = ctx
        .flow
        .obs
        .iter()
        .find(|o| o.dst == backend && o.hook == hook::NETFILTER)
        .map(|o| format!(" at {}", nf_hook::name(o.nf_hook)))
        .unwrap_or_default();
    Some((
        "DNATed here, the reply never came back through this node".to_string(),
        format!(
            "the {} was DNATed here to {backend}{at}, but no reply came back through this node within {} ms (asymmetric return path){elsewhere}",
            ctx.first_request_kind(),
            ctx.reply_timeout_ns / 1_000_000
        ),
    ))
}

/// Not DNATed, and kube-proxy's ruleset REJECTs this Service IP:port for
/// having no endpoints. REJECT answers with ICMP port unreachable and
/// returns NF_DROP, so the kernel frees the request with reason
/// NETFILTER_DROP (net/netfilter/core.c, nf_hook_slow).
pub(super) fn no_endpoints(ctx: &RuleCtx<'_>) -> Option<Found> {
    if ctx.flow.backend.is_some() {
        return None;
    }
    let proto = Proto::from_raw(ctx.flow.proto)?;
    let reject = ctx
        .kube
        .no_endpoints_for(ctx.flow.service.socket_addr(), proto.as_str())?;
    let what = ctx.first_request_kind();
    let how = match ctx.drop {
        Some(drop) if Some(drop.drop_reason) == ctx.known.netfilter_drop => format!(
            "netfilter dropped the {what} {} and kube-proxy's REJECT answered with ICMP port unreachable (the client sees \"connection refused\")",
            drop_place(ctx.flow, drop, ctx.ifnames)
        ),
        Some(_) => return None,
        None => format!("the {what} was never DNATed and got no reply"),
    } + &icmp::reject_evidence(ctx);
    let (namespace, name) = reject
        .port_name
        .split_once('/')
        .map(|(ns, rest)| (ns, rest.rsplit_once(':').map_or(rest, |(n, _)| n)))
        .unwrap_or(("<namespace>", &reject.port_name));
    Some((
        format!("{} has no endpoints", reject.port_name),
        format!(
            "{} ({}) has no endpoints: {how}; rejected by `{}`; check kubectl get endpointslices -n {namespace} -l kubernetes.io/service-name={name}",
            reject.port_name, ctx.flow.service, reject.rule
        ),
    ))
}

pub(super) fn service_not_netfilter(ctx: &RuleCtx<'_>) -> Option<Found> {
    let ip = ctx.flow.service.addr;
    let by = ctx
        .kube
        .outside_netfilter
        .iter()
        .find(|o| o.ip == ip)
        .map(|o| o.by.as_str())?;
    Some((
        format!("{ip} is translated by {by}, not netfilter"),
        format!(
            "{ip} is translated on this node by {by}, not by netfilter NAT: nattrace saw the packets but cannot judge that NAT, so this verdict does not say why the Service failed"
        ),
    ))
}

pub(super) fn not_dnated(ctx: &RuleCtx<'_>) -> Option<Found> {
    if ctx.flow.backend.is_some() {
        return None;
    }
    let o = ctx.flow.obs.iter().find(|o| {
        o.hook == hook::NETFILTER
            && o.nat_stage == nat_stage::AFTER
            && matches!(o.nf_hook, nf_hook::PRE_ROUTING | nf_hook::LOCAL_OUT)
            && o.dst == ctx.flow.service
    })?;
    Some((
        "no DNAT rule matched".to_string(),
        format!(
            "the {} passed the nat table at {} with destination still {}: no DNAT rule matched on this node",
            ctx.first_request_kind(),
            nf_hook::name(o.nf_hook),
            ctx.flow.service
        ),
    ))
}

fn dropped_with(ctx: &RuleCtx<'_>, reason: Option<u32>, by: &str) -> Option<Found> {
    let drop = ctx.drop?;
    if reason != Some(drop.drop_reason) {
        return None;
    }
    let ns = if ctx.is_node(drop.netns) {
        format!("the node namespace {}", ctx.facts.netns_name)
    } else {
        format!("namespace {}", drop.netns)
    };
    let place = drop_place(ctx.flow, drop, ctx.ifnames);
    Some((
        format!("{by} dropped it"),
        format!(
            "{by} dropped the {} in {ns} {place} ({} → {})",
            ctx.kind(drop.packet),
            drop.src,
            drop.dst
        ),
    ))
}

pub(super) fn dropped_by_netfilter(ctx: &RuleCtx<'_>) -> Option<Found> {
    dropped_with(ctx, ctx.known.netfilter_drop, "a netfilter rule")
}

pub(super) fn dropped_by_rp_filter(ctx: &RuleCtx<'_>) -> Option<Found> {
    dropped_with(ctx, ctx.known.rp_filter, "reverse-path filtering")
}
