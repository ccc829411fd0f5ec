//! ICMP and ICMPv6 errors about a flow (issue 23). The kernel sends an
//! error as an event of the flow whose packet it quotes
//! (tracer-ebpf/src/icmp.rs): its addresses are the quote's, so it joins
//! the flow by the same tuples as the flow's own packets, in translated
//! (client → Service) and untranslated (client → backend) form. Errors are
//! kept beside the flow's packets, not among them: the quote is not a
//! packet of the flow travelling its way (an error about a request travels
//! back to the client), and must teach the flow nothing about its client,
//! backend or reply.
use std::net::{IpAddr, SocketAddr};

use serde::Serialize;
use tracer_common::{hook, icmp, nf_hook};

use super::{
    flow::Flow,
    hops::{Hop, ReportCtx, hop},
    types::{Dir, Name, Obs, in_node},
};

pub(crate) use super::flow::IcmpObs;

/// Events of one error packet are this close (as the flow's packets).
const PACKET_GAP_NS: u64 = 100_000_000;

/// One ICMP error packet about the flow, as reported (JSON `icmp_errors`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct IcmpError {
    pub ts_ns: u64,
    /// "fragmentation needed", "packet too big", "port unreachable", ...
    pub error: &'static str,
    /// "icmp" or "icmpv6".
    pub family: &'static str,
    #[serde(rename = "type")]
    pub icmp_type: u8,
    pub code: u8,
    /// The MTU it reports (fragmentation needed, packet too big).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
    /// Who sent it, as first seen.
    pub from: IpAddr,
    /// Which of the flow's packets it is about: a request (the error
    /// travels to the client) or a reply (to the backend).
    pub about: Dir,
    /// Length of the packet it quotes (the one that did not fit).
    pub quoted_len: u16,
    /// It reached the sender of the packet it is about: the client's
    /// namespace for a request, for a reply its last point a device's
    /// receive outside the node with no drop after.
    pub reached_sender: bool,
    /// For an error reaching the client: its quote named the Service (true:
    /// conntrack translated it back) or the backend (false: the client's
    /// stack finds no socket for it and discards it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub translated: Option<bool>,
    /// The quote as the client (or the last point) saw it.
    pub quoted_src: SocketAddr,
    pub quoted_dst: SocketAddr,
    /// Where it died, if it was dropped: drop reason and place.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dropped: Option<Name>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dropped_at: Option<String>,
    pub hops: Vec<Hop>,
}

impl IcmpError {
    /// "ICMP fragmentation needed (MTU 1400) from 10.0.0.1".
    pub fn describe(&self) -> String {
        let family = if self.family == "icmp" {
            "ICMP"
        } else {
            "ICMPv6"
        };
        let mtu = self.mtu.map(|m| format!(" (MTU {m})")).unwrap_or_default();
        format!("{family} {}{mtu} from {}", self.error, self.from)
    }
}

/// The flow's ICMP errors, one per error packet, in time order.
pub(crate) fn errors(flow: &Flow, ctx: &ReportCtx<'_>) -> Vec<IcmpError> {
    groups(flow)
        .into_iter()
        .map(|g| error(flow, ctx, &g))
        .collect()
}

/// The error events grouped into error packets.
pub(crate) fn groups(flow: &Flow) -> Vec<Vec<IcmpObs>> {
    let mut obs: Vec<IcmpObs> = flow.icmp_obs().to_vec();
    obs.sort_by_key(|o| o.obs.ts_ns);
    let mut out: Vec<Vec<IcmpObs>> = Vec::new();
    for o in obs {
        let at = out.iter().rposition(|g| {
            let last = g.last().expect("groups are never empty");
            last.same_error(&o)
                && o.obs.ts_ns <= last.obs.ts_ns + PACKET_GAP_NS
                && !g.iter().any(|x| x.obs.same_point(&o.obs))
        });
        match at {
            Some(i) => out[i].push(o),
            None => out.push(vec![o]),
        }
    }
    out
}

/// What the flow's packet the error quotes is: a request when the quote
/// comes from the client's side.
fn about(flow: &Flow, o: &IcmpObs) -> Dir {
    if o.obs.src == flow.client || Some(o.obs.src) == flow.snat {
        Dir::Request
    } else {
        Dir::Reply
    }
}

/// The event of an error about a request that is at the client.
pub(crate) fn at_client<'g>(flow: &Flow, g: &'g [IcmpObs]) -> Option<&'g IcmpObs> {
    g.iter().find(|o| {
        let x = &o.obs;
        (x.hook == hook::DEV_RX && flow.client_netns != 0 && x.netns == flow.client_netns)
            || (flow.client_local
                && x.hook == hook::NETFILTER
                && x.nf_hook == nf_hook::LOCAL_IN
                && x.nat_stage == tracer_common::nat_stage::AFTER)
    })
}

/// Whether the error packet `g` reached the sender of the packet it
/// quotes. The backend's namespace is not known to the flow: an error
/// about a reply counts as delivered when its last point is a device's
/// receive outside the node and nothing dropped it.
pub(crate) fn reached_sender(flow: &Flow, g: &[IcmpObs], node_netns: u32) -> bool {
    match about(flow, &g[0]) {
        Dir::Request => at_client(flow, g).is_some(),
        Dir::Reply => g.last().is_some_and(|o| {
            o.obs.hook == hook::DEV_RX
                && !in_node(o.obs.netns, node_netns)
                && !g.iter().any(|x| x.obs.hook == hook::DROP)
        }),
    }
}

/// The drop of error packet `g`, if it was dropped.
pub(crate) fn drop_of(g: &[IcmpObs]) -> Option<&IcmpObs> {
    g.iter().find(|o| o.obs.hook == hook::DROP)
}

/// Where `drop` was last seen before it died, e.g. "after netfilter FORWARD".
pub(crate) fn drop_place(
    g: &[IcmpObs],
    drop: &IcmpObs,
    describe: impl Fn(&Obs) -> String,
) -> String {
    let before = g
        .iter()
        .filter(|o| o.obs.ts_ns <= drop.obs.ts_ns && o.obs.hook != hook::DROP)
        .max_by_key(|o| o.obs.ts_ns);
    match before {
        Some(o) if o.obs.hook == hook::NETFILTER => {
            format!("after netfilter {}", nf_hook::name(o.obs.nf_hook))
        }
        Some(o) => format!("after {} on {}", hook::name(o.obs.hook), describe(&o.obs)),
        None => "before any other observation point".to_string(),
    }
}

fn error(flow: &Flow, ctx: &ReportCtx<'_>, g: &[IcmpObs]) -> IcmpError {
    let first = &g[0];
    let about = about(flow, first);
    let client = at_client(flow, g).filter(|_| about == Dir::Request);
    let shown = client.or(g.last()).unwrap_or(first);
    let drop = drop_of(g);
    let describe = |o: &Obs| ctx.ifnames.describe(o.netns, o.ifindex);
    IcmpError {
        ts_ns: first.obs.ts_ns,
        error: icmp::name(first.v6, first.icmp_type, first.code),
        family: if first.v6 { "icmpv6" } else { "icmp" },
        icmp_type: first.icmp_type,
        code: first.code,
        mtu: (first.mtu != 0).then_some(first.mtu),
        from: first.from,
        about,
        quoted_len: first.quoted_len,
        reached_sender: reached_sender(flow, g, ctx.facts.netns_inode),
        translated: client.map(|c| c.obs.dst == flow.service),
        quoted_src: shown.obs.src.socket_addr(),
        quoted_dst: shown.obs.dst.socket_addr(),
        dropped: drop.map(|d| ctx.reason_name(d.obs.drop_reason)),
        dropped_at: drop.map(|d| drop_place(g, d, describe)),
        hops: g
            .iter()
            .map(|o| hop(&o.obs, ctx, client.is_some_and(|c| c == o)))
            .collect(),
    }
}

/// Which of the flow's packets the error event quotes.
pub(crate) fn about_dir(flow: &Flow, o: &IcmpObs) -> Dir {
    about(flow, o)
}

/// "ICMP fragmentation needed (MTU 1400) from 10.0.0.1" for an event.
pub(crate) fn describe(o: &IcmpObs) -> String {
    let family = if o.v6 { "ICMPv6" } else { "ICMP" };
    let mtu = if o.mtu != 0 {
        format!(" (MTU {})", o.mtu)
    } else {
        String::new()
    };
    format!(
        "{family} {}{mtu} from {}",
        icmp::name(o.v6, o.icmp_type, o.code),
        o.from
    )
}
