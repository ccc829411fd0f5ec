//! IPv6 causes: seed 000/001 over IPv6, where the same-node reply crosses
//! the bridge past ip6tables. br_netfilter has a switch per family: bridged
//! IPv6 frames reach the ip6tables hooks only with
//! `net.bridge.bridge-nf-call-ip6tables=1` (net/bridge/br_netfilter_hooks.c,
//! br_nf_pre_routing: `if (!brnet->call_ip6tables && !br_opt_get(br,
//! BROPT_NF_CALL_IP6TABLES)) return NF_ACCEPT;`), whatever the IPv4 one says.
use super::{Found, RuleCtx, bridged_past_netfilter};

/// The reply of an IPv6 flow was bridged without netfilter while
/// bridge-nf-call-ip6tables was 0 (or br_netfilter absent).
pub(in crate::collector) fn bridged_reply6_sysctl_off(ctx: &RuleCtx<'_>) -> Option<Found> {
    if !ctx.flow.service.addr.is_ipv6() {
        return None;
    }
    bridged_past_netfilter(
        ctx,
        ctx.facts.bridge_nf_call_ip6tables,
        "bridge-nf-call-ip6tables",
    )
}
