//! One observation as reported (a `Hop`) and what naming it needs (the
//! node's facts, interface and drop-reason names): below both the flow
//! report (`report.rs`) and the ICMP error report (`icmp.rs`).
use std::net::SocketAddr;

use serde::Serialize;
use tracer_common::{hook, nat_stage, nf_hook};

use super::pod_names::PodNames;
use super::{
    drop_reason::{DropReasons, KnownReasons},
    ifnames::IfNames,
    types::{Name, Obs, in_node},
};
use crate::facts::NodeFacts;

/// One event of a packet, as reported.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Hop {
    pub ts_ns: u64,
    pub hook: &'static str,
    /// Netfilter hook ("PREROUTING", ...) for netfilter events.
    pub nf_hook: Option<&'static str>,
    /// "before-nat" / "after-nat" where the event brackets a NAT stage.
    pub nat_stage: Option<&'static str>,
    pub ifindex: u32,
    /// The interface's name in its namespace (`netns`), when known: the
    /// node's from the start, pods' and new ones as they are seen.
    pub ifname: Option<Name>,
    /// Inode of the namespace (the node's, for tc and netfilter events).
    pub netns: u32,
    pub node_ns: bool,
    #[serde(serialize_with = "super::addr_text::serialize")]
    pub src: SocketAddr,
    #[serde(serialize_with = "super::addr_text::serialize")]
    pub dst: SocketAddr,
    pub drop_reason: Option<Name>,
    /// This is where the reply was judged.
    pub client_side: bool,
    /// The node whose recording this hop comes from, when flows are merged
    /// across nodes (`analyze b.rec a.rec`); absent for one node.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<Name>,
    /// The pod whose namespace `netns` is (`namespace/name`), or `netns
    /// NAME` when only its `ip netns` name is known; absent in the node's
    /// namespace and when unknown (src/pods).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<Name>,
}

pub(crate) struct ReportCtx<'a> {
    pub facts: &'a NodeFacts,
    pub ifnames: &'a IfNames,
    pub reasons: &'a DropReasons,
    pub known: &'a KnownReasons,
    pub reply_timeout_ns: u64,
    pub kube: crate::ruleset::IndexedRules<'a>,
    pub pods: &'a PodNames,
    /// How much of an `ok` report is built ([`super::CollectorConfig::ok_report`]).
    pub ok_report: super::OkReport,
}

impl ReportCtx<'_> {
    pub(crate) fn is_node(&self, netns: u32) -> bool {
        in_node(netns, self.facts.netns_inode)
    }

    pub(crate) fn reason_name(&self, value: u32) -> Name {
        self.reasons
            .name(value)
            .cloned()
            .unwrap_or_else(|| Name(format!("reason {value}").into()))
    }
}

/// One observation as reported.
pub(crate) fn hop(o: &Obs, ctx: &ReportCtx<'_>, client_side: bool) -> Hop {
    Hop {
        ts_ns: o.ts_ns,
        hook: hook::name(o.hook),
        nf_hook: (o.hook == hook::NETFILTER).then(|| nf_hook::name(o.nf_hook)),
        nat_stage: (o.nat_stage != nat_stage::NONE).then(|| nat_stage::name(o.nat_stage)),
        ifindex: o.ifindex,
        ifname: ctx.ifnames.get(o.netns, o.ifindex).cloned(),
        netns: if o.netns == 0 {
            ctx.facts.netns_inode
        } else {
            o.netns
        },
        node_ns: ctx.is_node(o.netns),
        src: o.src.socket_addr(),
        dst: o.dst.socket_addr(),
        drop_reason: (o.hook == hook::DROP).then(|| ctx.reason_name(o.drop_reason)),
        client_side,
        node: None,
        pod: if ctx.is_node(o.netns) {
            None
        } else {
            ctx.pods.label(o.netns).cloned()
        },
    }
}
