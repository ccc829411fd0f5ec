//! Traffic from outside the cluster (issue 24): a NodePort, LoadBalancer or
//! external IP flow that kube-proxy's rules drop because the Service's
//! externalTrafficPolicy is Local and none of its endpoints runs here.
use super::{Found, RuleCtx};
use crate::{
    collector::{types::Proto, verdict::drop_place},
    ruleset::external::{ExternalRule, TrafficPolicy},
};

/// The north-south entry a flow was sent to, if any.
pub(crate) fn entry<'a>(ctx: &RuleCtx<'a>) -> Option<&'a ExternalRule> {
    let proto = Proto::from_raw(ctx.flow.proto)?;
    let svc = ctx.flow.service;
    ctx.kube
        .rules
        .north_south
        .find(svc.addr, svc.port, proto.as_str())
}

/// Not DNATed, and kube-proxy drops this NodePort / LB / external IP for
/// having no local endpoint. kube-proxy's DROP sits in filter
/// `KUBE-EXTERNAL-SERVICES`, jumped to from INPUT (an address of this node:
/// routing delivers the un-DNATed packet locally) and FORWARD (an address
/// the node routes on); NF_DROP frees the packet with reason NETFILTER_DROP
/// (net/netfilter/core.c, nf_hook_slow). The client sees a timeout: DROP
/// sends nothing back.
pub(crate) fn no_local_endpoints(ctx: &RuleCtx<'_>) -> Option<Found> {
    if ctx.flow.backend.is_some() {
        return None;
    }
    let e = entry(ctx)?;
    let rule = e.no_local_endpoints.as_deref()?;
    if e.policy != TrafficPolicy::Local {
        return None;
    }
    let what = ctx.first_request_kind();
    let addr = ctx.flow.service.addr;
    let hook = if ctx.kube.north_south.node_addresses.contains(&addr) || e.ip.is_none() {
        "filter INPUT"
    } else {
        "filter FORWARD"
    };
    let how = match ctx.drop {
        Some(drop) if Some(drop.drop_reason) == ctx.known.netfilter_drop => format!(
            "netfilter dropped the {what} in {hook} (seen {}), never DNATed, and sent nothing back (the client times out)",
            drop_place(ctx.flow, drop, ctx.ifnames)
        ),
        Some(_) => return None,
        None => format!("the {what} was never DNATed and got no reply (the client times out)"),
    };
    let svc = e.service();
    let (namespace, name) = svc.split_once('/').unwrap_or(("<namespace>", svc));
    let health = match e.health_check_node_port {
        Some(p) => format!(
            "the load balancer's health check on healthCheckNodePort {p} (kube-proxy answers 503 there on this node) must take this node out of rotation"
        ),
        None => format!(
            "the load balancer's health check on the Service's healthCheckNodePort (kubectl get svc -n {namespace} {name} -o jsonpath='{{.spec.healthCheckNodePort}}') must take this node out of rotation"
        ),
    };
    Some((
        format!(
            "{} has no local endpoints (externalTrafficPolicy: Local)",
            e.name
        ),
        format!(
            "{} ({} {}) has externalTrafficPolicy: Local and no endpoint on this node: {how}; dropped by kube-proxy's `{rule}`; fix: run an endpoint on this node, or {health}, or set externalTrafficPolicy: Cluster (the client's address is then masqueraded)",
            e.name,
            e.kind.as_str(),
            ctx.flow.service,
        ),
    ))
}

/// A NodePort / LB / external IP flow of an externalTrafficPolicy: Cluster
/// Service, DNATed here to a backend, left the node without the SNAT
/// kube-proxy asked for (its `KUBE-EXT-` / `external-` chain marks every
/// such packet for masquerade; `KUBE-POSTROUTING` / `masquerading` applies
/// it): the backend sees the outside client's address and answers it
/// directly, so no reply comes back through this node.
pub(crate) fn external_not_masqueraded(ctx: &RuleCtx<'_>) -> Option<Found> {
    let backend = ctx.flow.backend?;
    if ctx.flow.snat.is_some() {
        return None;
    }
    let e = entry(ctx)?;
    if e.policy != TrafficPolicy::Cluster {
        return None;
    }
    // The no-reply rule's own conditions (the request left the node, no
    // reply came back through it) decide that the flow failed that way.
    super::no_reply_through_node(ctx)?;
    let chain = e.chain.as_deref().unwrap_or("KUBE-EXT-…");
    Some((
        format!(
            "{} ({}) was not masqueraded although externalTrafficPolicy is Cluster",
            e.name,
            e.kind.as_str()
        ),
        format!(
            "the {} to {} ({} {}) was DNATed here to {backend} but left the node with the client's own address {}: kube-proxy's `{chain}` marks it for masquerade (externalTrafficPolicy: Cluster) and no SNAT was applied, so {backend} answered the client directly and no reply came back through this node; check kube-proxy's masquerade rule (iptables-save -t nat | grep -e KUBE-POSTROUTING -e KUBE-MARK-MASQ; nft list chain ip kube-proxy masquerading) and that nothing clears the 0x4000 mark before POSTROUTING",
            ctx.first_request_kind(),
            ctx.flow.service,
            e.name,
            e.kind.as_str(),
            ctx.flow.client.addr,
        ),
    ))
}
