//! A stale conntrack entry (issue 22): the failing flow was DNATed to an
//! address that kube-proxy's rules no longer send the Service to. A packet
//! that matches an existing conntrack entry is not shown to the nat table
//! again — NAT applies the mapping stored in the entry (nf_nat_inet_fn,
//! net/netfilter/nf_nat_core.c: only `IP_CT_NEW` walks the nat chains) —
//! so a UDP client that keeps one source port, and so keeps refreshing its
//! entry, goes on reaching the old pod long after the rules changed.
//!
//! Told apart from `backend_unreachable` (a stale *rule*: the KUBE-SEP /
//! endpoint chain still DNATs to the gone pod) by the rules as re-read when
//! the flow is decided (`Collector::take_rules_request`): backend among the
//! Service's endpoints → the rule is stale; not among them while the
//! Service still has its rules → the entry is. The rule that decides
//! between the two when a backend dies mid-flow and its rule is gone too:
//! the entry wins, since it is what still sends packets to the dead
//! address and deleting it is the fix.
//!
//! kube-proxy deletes such entries itself, for UDP only and only for a
//! Service that has at least one serving endpoint: `CleanStaleEntries` in
//! kubernetes pkg/proxy/conntrack/cleanup.go deletes every UDP entry whose
//! `--orig-dst`/`--orig-port-dst` is a Service IP:port and whose
//! `--reply-src` is no serving endpoint. TCP entries are never cleaned:
//! they end with the connection.
use std::borrow::Cow;

use super::{Found, RuleCtx};
use crate::{
    collector::types::{Endpoint, Proto},
    ruleset::SvcRule,
};

/// The Service port of the flow in the rules, if kube-proxy programs it.
fn service_rule<'a>(ctx: &RuleCtx<'a>, proto: Proto) -> Option<&'a SvcRule> {
    let svc = ctx.flow.service;
    ctx.kube.service_port(svc.addr, svc.port, proto.as_str())
}

/// The backend the kernel DNATed the flow to, when the rules no longer
/// list it among the Service's endpoints; with the current endpoints.
fn stale_backend(ctx: &RuleCtx<'_>) -> Option<(Endpoint, Vec<Endpoint>, Proto)> {
    let flow = ctx.flow;
    let backend = flow.backend?;
    if backend == flow.service {
        return None;
    }
    let proto = Proto::from_raw(flow.proto)?;
    let current: Vec<Endpoint> = match service_rule(ctx, proto) {
        Some(svc) => svc
            .endpoints
            .iter()
            .map(|e| Endpoint {
                addr: e.endpoint.ip(),
                port: e.endpoint.port(),
            })
            .collect(),
        // Its endpoints all gone: kube-proxy REJECTs it now, so a DNATed
        // packet can only have followed an entry made before.
        None => {
            ctx.kube
                .no_endpoints_for(flow.service.socket_addr(), proto.as_str())?;
            Vec::new()
        }
    };
    (!current.contains(&backend)).then_some((backend, current, proto))
}

/// `conntrack -D` for exactly this flow's entry: its original tuple (the
/// client as it sent, the Service) and the stale backend as reply source.
fn delete_command(ctx: &RuleCtx<'_>, backend: Endpoint, proto: Proto) -> String {
    let flow = ctx.flow;
    let family = if flow.service.addr.is_ipv6() {
        " -f ipv6"
    } else {
        ""
    };
    format!(
        "conntrack -D{family} -p {} --orig-src {} --orig-port-src {} --orig-dst {} --orig-port-dst {} --reply-src {}",
        proto.as_str(),
        flow.client.addr,
        flow.client.port,
        flow.service.addr,
        flow.service.port,
        backend.addr
    )
}

pub(in crate::collector) fn stale_conntrack_entry(ctx: &RuleCtx<'_>) -> Option<Found> {
    let (backend, current, proto) = stale_backend(ctx)?;
    let now = if current.is_empty() {
        "it has no endpoints now".to_string()
    } else {
        let list: Vec<String> = current.iter().map(ToString::to_string).collect();
        format!("its endpoints now are {}", list.join(", "))
    };
    let name = service_rule(ctx, proto)
        .map(|s| format!(" {}", s.name))
        .unwrap_or_default();
    Some((
        format!("a stale conntrack entry DNATs it to {backend}, no longer an endpoint"),
        format!(
            "the {} was DNATed to {backend} by its conntrack entry, but kube-proxy's rules no longer send the Service{name} ({}) there: {now}; the entry outlived the endpoint (run in the node's network namespace {}: `{}`)",
            ctx.first_request_kind(),
            ctx.flow.service,
            ctx.facts.netns_name,
            delete_command(ctx, backend, proto)
        ),
    ))
}

/// The fix for this flow: the exact command, and why it was needed.
pub(in crate::collector) fn fix(ctx: &RuleCtx<'_>) -> Option<Cow<'static, str>> {
    let (backend, _, proto) = stale_backend(ctx)?;
    let why = match proto {
        Proto::Udp => {
            "kube-proxy normally deletes UDP entries to endpoints it removed (CleanStaleEntries, kubernetes pkg/proxy/conntrack/cleanup.go, after each sync, only while the Service has a serving endpoint): check kube-proxy's log for \"Failed to clear all conntrack entries\" and that it can reach conntrack (CAP_NET_ADMIN)"
        }
        _ => {
            "kube-proxy never deletes TCP entries (pkg/proxy/conntrack/cleanup.go cleans UDP only): the entry lives until the connection closes or times out (net.netfilter.nf_conntrack_tcp_timeout_established); the client should reconnect from a new source port"
        }
    };
    Some(Cow::Owned(format!(
        "delete the stale entry in the node's network namespace: {}; {why}",
        delete_command(ctx, backend, proto)
    )))
}
