//! What the collector hands to outputs: one `FlowReport` per decided flow,
//! with its evidence resolved to names. Built once per flow, never per event.
use std::{net::SocketAddr, sync::Arc};

use serde::Serialize;
use tracer_common::{hook, nat_stage, nf_hook, proto, tcp_flags};

pub use super::hops::Hop;
pub(crate) use super::hops::{ReportCtx, hop};

use super::{
    OkReport, addr_text,
    causes::{self, Cause},
    checks::RuleCtx,
    established::{Established, Phase},
    flow::{ClientReply, Flow},
    types::{Dir, Name, Obs, Proto, packet_kind},
    verdict::{
        Verdict, drop_place, first_drop, neighbour_gave_up, packet_backend, reply_backend,
        verdict_of,
    },
};
use crate::ruleset::KubeMatch;

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PacketEvidence {
    /// "SYN", "SYN-ACK", "RST", "request", "reply", ...
    pub kind: &'static str,
    pub dir: Dir,
    pub tcp_flags: u8,
    pub seq: u32,
    pub ack: u32,
    pub ip_id: u16,
    /// For DNS (UDP port 53): the query id from the payload head.
    pub dns_id: Option<u16>,
    pub hops: Vec<Hop>,
}

/// One transmission of the flow's opening request (a SYN and its
/// retransmits, or each UDP request): a retransmitted SYN whose first
/// attempt's conntrack entry died unconfirmed is load-balanced again, so
/// attempts can go to different backends (issue 11).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Attempt {
    /// First event of this transmission.
    pub at_ns: u64,
    /// Where DNAT sent it (None: not seen after DNAT).
    #[serde(serialize_with = "super::addr_text::serialize_opt")]
    pub backend: Option<SocketAddr>,
    /// kube-proxy's endpoint chain for that backend.
    pub sep_chain: Option<Arc<str>>,
    /// A reply came back from that backend for it.
    pub answered: bool,
    /// Drop reason, if a drop of this transmission was seen.
    pub dropped: Option<Name>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FlowReport {
    pub verdict: Verdict,
    pub proto: Proto,
    pub client: SocketAddr,
    pub service: SocketAddr,
    pub backend: Option<SocketAddr>,
    /// The client's address after SNAT/MASQUERADE, if it was rewritten.
    pub snat: Option<SocketAddr>,
    /// The client reached itself through the Service (backend = client's own address).
    pub hairpin: bool,
    /// Service name and kube-proxy chains that sent the flow to its backend.
    pub kube: Option<KubeMatch>,
    /// kube-proxy's name of the Service port (`namespace/name:port`), also
    /// for a Service without endpoints (named by its REJECT rule).
    pub k8s_service: Option<Arc<str>>,
    /// The client's and the backend's pods (`namespace/name`), when they
    /// are pods of this node (src/pods): shared names, so a report costs
    /// no string copy for them.
    pub client_pod: Option<Name>,
    pub backend_pod: Option<Name>,
    pub cause: Option<Cause>,
    /// One sentence: what happened, for the text line.
    pub detail: String,
    /// Events may be missing (kernel loss, eviction): the verdict is not
    /// confirmed and absence-based causes are withheld.
    pub incomplete: bool,
    /// Its opening request was seen (see `Flow::opening_seen`).
    pub opening_seen: bool,
    /// The flow had more packets than the evidence cap; later ones are not listed.
    pub truncated: bool,
    pub first_ts_ns: u64,
    pub decided_ts_ns: u64,
    /// Each transmission of the opening request and its backend.
    pub attempts: Vec<Attempt>,
    pub packets: Vec<PacketEvidence>,
    /// `established`: the opening was `ok` and the connection broke later
    /// (`collector/established.rs`); absent for an opening.
    #[serde(skip_serializing_if = "Phase::is_opening")]
    pub phase: Phase,
    /// When and after how much it broke (phase established only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub established: Option<Established>,
    /// ICMP/ICMPv6 errors about the flow's packets (issue 23): each error
    /// packet with every point it passed; absent when there were none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub icmp_errors: Vec<super::icmp::IcmpError>,
}

/// How the decision was reached, beyond the flow's own evidence.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Decision {
    pub decided_ts: u64,
    /// Decided before the reply timeout ran out (tracing stopped, or the
    /// flow was evicted).
    pub cut_short: bool,
    /// Decided at the trace's end (`Collector::finish`).
    pub stopped: bool,
}

/// A printed report's vectors, emptied, for a report decided later: a
/// tick's reports are built together and freed together, so their ~5
/// allocations each overflowed glibc's per-thread cache (7 chunks a size)
/// and went through its bins both ways, ~2k instructions of an `ok`
/// report printed as a JSON line (issue 25, callgrind).
#[derive(Default)]
pub(crate) struct Recycled {
    /// Each with its hops vector, emptied: [`evidence`] writes over them.
    packets: Vec<PacketEvidence>,
    attempts: Vec<Attempt>,
    detail: String,
}

impl Recycled {
    /// `r`'s vectors, or None when they are larger than a healthy
    /// connection's (a problem flow's are freed, not kept): at most
    /// ~2.4 KiB, eight 200-byte hops most of it.
    pub(crate) fn of(r: FlowReport) -> Option<Self> {
        let FlowReport {
            mut packets,
            mut attempts,
            mut detail,
            ..
        } = r;
        let hops: usize = packets.iter().map(|p| p.hops.capacity()).sum();
        if packets.capacity() > 4 || hops > 8 || attempts.capacity() > 4 || detail.capacity() > 256
        {
            return None;
        }
        for p in &mut packets {
            p.hops.clear();
        }
        attempts.clear();
        detail.clear();
        Some(Self {
            packets,
            attempts,
            detail,
        })
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        let hops: usize = self.packets.iter().map(|p| p.hops.capacity()).sum();
        self.packets.capacity() * size_of::<PacketEvidence>()
            + hops * size_of::<Hop>()
            + self.attempts.capacity() * size_of::<Attempt>()
            + self.detail.capacity()
    }
}

pub(crate) fn build(
    flow: &Flow,
    ctx: &ReportCtx<'_>,
    d: Decision,
    spare: Option<Recycled>,
) -> FlowReport {
    let spare = spare.unwrap_or_default();
    let verdict = verdict_of(
        flow,
        ctx.known,
        ctx.facts.netns_inode,
        d.stopped && d.cut_short,
    );
    let incomplete = flow.evicted;
    let drop =
        super::established::placed_drop(flow, ctx.known).or_else(|| first_drop(flow, ctx.known));
    let rule_ctx = RuleCtx {
        flow,
        verdict,
        facts: ctx.facts,
        known: ctx.known,
        node_netns: ctx.facts.netns_inode,
        reply_timeout_ns: ctx.reply_timeout_ns,
        drop,
        kube: ctx.kube,
        ifnames: ctx.ifnames,
        reasons: ctx.reasons,
        decided_ts: d.decided_ts,
    };
    // Causes rest on the absence of events too (no netfilter hook, no reply):
    // with events missing they would be guesses.
    let cause = if incomplete {
        None
    } else {
        causes::infer(&rule_ctx)
    };
    let reply_src = flow.client_reply.map(|r| flow.obs[r.obs as usize].src);
    // The backend that answered, which is not the first one DNAT picked when
    // a retransmit was load-balanced again.
    let answered_by = flow
        .client_reply
        .and_then(|r| reply_backend(flow, r.packet))
        .filter(|_| flow.backend.is_some());
    let backend = answered_by
        .or(flow.backend)
        .or(reply_src.filter(|_| verdict == Verdict::ReplyNotReverseNated));
    let proto = Proto::from_raw(flow.proto).unwrap_or(Proto::Tcp);
    let kube = ctx.kube.lookup(
        flow.service.socket_addr(),
        proto.as_str(),
        backend.map(|b| b.socket_addr()),
    );
    // An `ok` report no output prints is only counted (summary, metrics):
    // its sentence, attempts and hops were half of a healthy connection's
    // cost in the collector (counted with callgrind, BENCHMARKS.md). One
    // the text line prints without hops needs no packets.
    let ok_report = if verdict == Verdict::Ok {
        ctx.ok_report
    } else {
        OkReport::Whole
    };
    let lean = ok_report == OkReport::Counted;
    let (detail, attempts, icmp_errors) = if lean {
        Default::default()
    } else {
        (
            detail(flow, ctx, verdict, cause.as_ref(), drop, d, spare.detail),
            attempts(flow, ctx, proto, (backend, kube.as_ref()), spare.attempts),
            super::icmp::errors(flow, ctx),
        )
    };
    let packets = match ok_report {
        OkReport::Whole => evidence(flow, ctx, spare.packets),
        OkReport::Line | OkReport::Counted => Vec::new(),
    };
    let k8s_service = kube.as_ref().map(|k| k.service.clone()).or_else(|| {
        ctx.kube
            .no_endpoints_for(flow.service.socket_addr(), proto.as_str())
            .map(|r| Arc::from(r.port_name.as_str()))
    });
    FlowReport {
        verdict,
        proto,
        client: flow.client.socket_addr(),
        service: flow.service.socket_addr(),
        backend: backend.map(|b| b.socket_addr()),
        snat: flow.snat.map(|s| s.socket_addr()),
        hairpin: flow.is_hairpin(),
        kube,
        k8s_service,
        client_pod: ctx.pods.pod_of(flow.client.addr).cloned(),
        backend_pod: backend
            .filter(|_| !lean)
            .and_then(|b| ctx.pods.pod_of(b.addr))
            .cloned(),
        cause,
        detail,
        incomplete,
        opening_seen: flow.opening_seen,
        truncated: flow.truncated,
        first_ts_ns: flow.first_ts,
        decided_ts_ns: d.decided_ts,
        attempts,
        packets,
        phase: Phase::Opening,
        established: None,
        icmp_errors,
    }
}

/// The opening request's transmissions (SYNs without ACK, or UDP requests),
/// each with its backend, whether that backend answered it, and its drop.
fn attempts(
    flow: &Flow,
    ctx: &ReportCtx<'_>,
    proto: Proto,
    (reported, kube): (Option<super::types::Endpoint>, Option<&KubeMatch>),
    mut out: Vec<Attempt>,
) -> Vec<Attempt> {
    let opening = |key: &super::types::PacketKey| {
        flow.proto != proto::TCP
            || key.tcp_flags & (tcp_flags::SYN | tcp_flags::ACK) == tcp_flags::SYN
    };
    let gave_up = neighbour_gave_up(flow, ctx.facts.netns_inode);
    // Backends are compared as the `SocketAddr`s reported (one for one with
    // the endpoints): carried beside each attempt, they made a second
    // vector, its in-place collect and a shrinking realloc per report.
    out.extend(
        flow.packets
            .iter()
            .enumerate()
            .filter(|(_, p)| p.dir == Dir::Request && opening(&p.key))
            .map(|(i, p)| {
                let b = packet_backend(flow, i as u8);
                let dropped = flow
                    .packet_obs(i as u8)
                    .find(|o| o.hook == hook::DROP && ctx.known.is_drop(o.drop_reason))
                    .map(|o| o.drop_reason)
                    // The reason the kernel frees it with when the drop event
                    // itself was missed (verdict.rs `neighbour_gave_up`).
                    .or_else(|| {
                        gave_up
                            .filter(|(p, _)| usize::from(*p) == i)
                            .and(ctx.known.neigh[0])
                    })
                    .map(|r| ctx.reason_name(r));
                // Usually the reported backend, whose chain is already known.
                let sep_chain = b.and_then(|b| {
                    if Some(b) == reported {
                        return kube.and_then(|k| k.sep_chain.clone());
                    }
                    ctx.kube
                        .lookup(
                            flow.service.socket_addr(),
                            proto.as_str(),
                            Some(b.socket_addr()),
                        )
                        .and_then(|m| m.sep_chain)
                });
                Attempt {
                    at_ns: p.first_ts,
                    backend: b.map(|b| b.socket_addr()),
                    sep_chain,
                    answered: false,
                    dropped,
                }
            }),
    );
    out.sort_by_key(|a| a.at_ns);
    for (i, p) in flow.packets.iter().enumerate() {
        if p.dir != Dir::Reply {
            continue;
        }
        let Some(from) = reply_backend(flow, i as u8) else {
            continue;
        };
        let from = Some(from.socket_addr());
        // The latest transmission to that backend before the reply is the one answered.
        if let Some(a) = out
            .iter_mut()
            .rev()
            .find(|a| a.backend == from && a.at_ns <= p.first_ts)
        {
            a.answered = true;
        }
    }
    answered_by_reverse_nat(flow, &mut out);
    out
}

/// A reply reverse-NATed at the client answers an attempt too. A healthy
/// connection costs three events (issue 25): its reply is seen only where
/// it reaches the client, never leaving the backend, so `reply_backend`
/// finds no backend for it, and every `ok` line said its one attempt went
/// unanswered. The reverse NAT is conntrack's, of the entry DNAT made for
/// the request; when every attempt went to one backend, the latest before
/// the reply is the one it answers. Attempts to several backends with no
/// reply seen leaving one stay as they are: which entry answered is not
/// known then.
fn answered_by_reverse_nat(flow: &Flow, out: &mut [Attempt]) {
    let Some(r) = flow.client_reply.filter(|r| r.reverse_nated) else {
        return;
    };
    let Some(first) = out.first().and_then(|a| a.backend) else {
        return;
    };
    if out.iter().any(|a| a.answered || a.backend != Some(first)) {
        return;
    }
    let at = flow.packets[usize::from(r.packet)].first_ts;
    if let Some(a) = out.iter_mut().rev().find(|a| a.at_ns <= at) {
        a.answered = true;
    }
}

/// "no socket" from NO_SOCKET: drop reasons read better in a sentence in lower case.
fn reason_words(name: &Name) -> String {
    name.as_str().to_ascii_lowercase().replace('_', " ")
}

fn detail(
    flow: &Flow,
    ctx: &ReportCtx<'_>,
    verdict: Verdict,
    cause: Option<&Cause>,
    drop: Option<&Obs>,
    d: Decision,
    buf: String,
) -> String {
    if let (Verdict::Ok, Some(r)) = (verdict, flow.client_reply)
        && let Some(s) = outside_netfilter_detail(flow, ctx, r)
    {
        // No cause or eviction note: nattrace cannot judge such a flow.
        return s;
    }
    let mut s = match (verdict, flow.client_reply) {
        (Verdict::Ok, Some(r)) => ok_detail(flow, r, buf),
        (Verdict::ReplyNotReverseNated, Some(r)) => not_reverse_nated_detail(flow, ctx, cause, r),
        (Verdict::Refused, Some(r)) => {
            let from = reply_backend(flow, r.packet)
                .map(|b| format!(" from backend {b}"))
                .unwrap_or_default();
            // After an `ok` opening the RST ends a connection, it refuses none.
            let what = if flow.watch.is_some() {
                "the connection was reset"
            } else {
                "the connection was refused"
            };
            format!(
                "{}{from} reached the client (reverse-NATed to {}): {what}",
                flow.kind(r.packet),
                flow.service
            )
        }
        (Verdict::Dropped, _) => match drop {
            Some(o) => dropped_detail(flow, ctx, o),
            None => gave_up_detail(flow, ctx),
        },
        (Verdict::Undecided, _) => undecided_detail(flow, ctx, d),
        _ => no_reply_detail(flow, ctx, d),
    };
    if verdict != Verdict::ReplyNotReverseNated
        && let Some(c) = cause
    {
        s.push_str("; ");
        s.push_str(&c.clause);
    }
    if flow.evicted {
        s.push_str("; evicted early (flow table full), evidence incomplete");
    }
    s
}

/// An ok reply to a Service that something other than netfilter NAT
/// translates (IPVS, eBPF): no claim about a reverse NAT netfilter never did.
fn outside_netfilter_detail(flow: &Flow, ctx: &ReportCtx<'_>, r: ClientReply) -> Option<String> {
    let ip = flow.service.addr;
    let o = ctx.kube.outside_netfilter.iter().find(|o| o.ip == ip)?;
    Some(format!(
        "{} reached the client from {}; {ip} is translated by {}, not netfilter NAT, which nattrace cannot judge",
        flow.kind(r.packet),
        flow.service,
        o.by
    ))
}

/// Into `s` (empty, a printed report's when there was one).
fn ok_detail(flow: &Flow, r: ClientReply, mut s: String) -> String {
    // Pushed, not formatted: this sentence is in every `ok` line, and
    // `format!` cost ~1.2k instructions of it (callgrind).
    s.reserve(96);
    s.push_str(flow.kind(r.packet));
    s.push_str(" reached the client from ");
    addr_text::push_str(&mut s, &flow.service.socket_addr());
    s.push_str(" (reverse-NATed");
    if let Some(at) = reverse_nat_point(flow, r.packet) {
        s.push_str(" at ");
        s.push_str(at);
    }
    s.push(')');
    if flow.is_hairpin() {
        s.push_str("; hairpin: the pod reached itself through the Service");
    }
    if let Some(snat) = flow.snat {
        s.push_str("; client masqueraded to ");
        addr_text::push_str(&mut s, &snat.socket_addr());
    }
    s
}

/// The reply's wrong source, the cause's clause, and what the client did with it.
fn not_reverse_nated_detail(
    flow: &Flow,
    ctx: &ReportCtx<'_>,
    cause: Option<&Cause>,
    r: ClientReply,
) -> String {
    let seen = &flow.obs[r.obs as usize];
    let mut s = format!(
        "{} reached the client with source {} instead of {}",
        flow.kind(r.packet),
        seen.src,
        flow.service
    );
    if let Some(c) = cause {
        s.push_str("; ");
        s.push_str(&c.clause);
    }
    let client_drop = flow.packet_obs(r.packet).find(|o| {
        o.hook == hook::DROP
            && ctx.known.is_drop(o.drop_reason)
            && (o.netns == flow.client_netns || flow.client_local)
    });
    if let Some(o) = client_drop {
        s.push_str(&format!(
            "; the client dropped it ({})",
            reason_words(&ctx.reason_name(o.drop_reason))
        ));
        if flow.client_rst {
            s.push_str(" and sent RST");
        }
    } else if flow.client_rst {
        s.push_str("; the client answered with RST");
    }
    s
}

fn dropped_detail(flow: &Flow, ctx: &ReportCtx<'_>, o: &Obs) -> String {
    let place = if ctx.is_node(o.netns) {
        format!("in the node namespace {}", drop_place(flow, o, ctx.ifnames))
    } else if o.netns == flow.client_netns {
        format!(
            "in the client's namespace {}",
            drop_place(flow, o, ctx.ifnames)
        )
    } else {
        format!(
            "in namespace {} {}",
            o.netns,
            drop_place(flow, o, ctx.ifnames)
        )
    };
    // A reply at the client with a drop still standing: the backend's
    // retransmissions of what the client already had (verdict.rs
    // request_drop_stands).
    let replies = if flow.client_reply.is_some() {
        "replies still reached the client, but nothing the client sent after it left the node"
    } else {
        "no reply reached the client"
    };
    format!(
        "the {} was dropped {place}, reason {}; {replies}",
        flow.kind(o.packet),
        ctx.reason_name(o.drop_reason)
    )
}

/// Dropped with no drop event: the node's ICMP error tells the queued
/// request's fate (verdict.rs `neighbour_gave_up`).
fn gave_up_detail(flow: &Flow, ctx: &ReportCtx<'_>) -> String {
    let Some((p, at)) = neighbour_gave_up(flow, ctx.facts.netns_inode) else {
        return "no reply reached the client".to_string();
    };
    let since = flow.packets[p as usize].first_ts;
    let error = if flow.client.addr.is_ipv6() {
        "ICMPv6 address unreachable"
    } else {
        "ICMP host unreachable"
    };
    format!(
        "the {} was dropped in the node namespace after DNAT when neighbour resolution failed: {} ms later the node answered the client with {error} (its drop event was not seen); no reply reached the client",
        flow.kind(p),
        at.saturating_sub(since) / 1_000_000
    )
}

/// Events were lost while the flow was traced: its cause rested on the
/// absence of events that may just have been lost.
pub(crate) fn mark_incomplete(r: &mut FlowReport) {
    r.incomplete = true;
    if let Some(c) = r.cause.take() {
        let clause = format!("; {}", c.clause);
        if let Some(pos) = r.detail.find(&clause) {
            r.detail.replace_range(pos..pos + clause.len(), "");
        }
    }
    r.detail
        .push_str("; events were lost while this flow was traced, evidence may be incomplete");
}

fn no_reply_detail(flow: &Flow, ctx: &ReportCtx<'_>, d: Decision) -> String {
    let first = flow.first_request_kind();
    let mut s = match flow.backend {
        Some(b) => format!("{first} DNATed to {b}"),
        None => format!("{first} sent"),
    };
    let last_reply = flow
        .obs
        .iter()
        .filter(|o| {
            let p = &flow.packets[o.packet as usize];
            p.dir == Dir::Reply && p.in_node
        })
        .max_by_key(|o| o.ts_ns);
    match last_reply {
        Some(o) => s.push_str(&format!(
            "; a reply was last seen at {} but never reached the client",
            hop_words(o, ctx)
        )),
        // Evicted before its reply timeout (the trace's end is `undecided`).
        None if d.cut_short => s.push_str(&format!(
            "; no reply before it was evicted ({} ms after the request)",
            d.decided_ts.saturating_sub(flow.first_ts) / 1_000_000
        )),
        // Held past the reply timeout for a neighbour failure (checks/backend.rs).
        None => s.push_str(&format!(
            "; no reply within {} ms",
            d.decided_ts
                .saturating_sub(flow.first_ts)
                .max(ctx.reply_timeout_ns)
                / 1_000_000
        )),
    }
    s
}

/// How long before the stop the request was, against the reply timeout:
/// what tells an on-call reader that the missing reply proves nothing.
fn undecided_detail(flow: &Flow, ctx: &ReportCtx<'_>, d: Decision) -> String {
    let first = flow.first_request_kind();
    let mut s = match flow.backend {
        Some(b) => format!("{first} DNATed to {b}"),
        None => format!("{first} sent"),
    };
    s.push_str(&format!(
        " {} ms before tracing stopped, within the {} ms reply timeout: no reply yet and no failure seen, cut by the stop",
        d.decided_ts.saturating_sub(flow.first_ts) / 1_000_000,
        ctx.reply_timeout_ns / 1_000_000
    ));
    s
}

fn hop_words(o: &Obs, ctx: &ReportCtx<'_>) -> String {
    if o.hook == hook::NETFILTER {
        return format!(
            "netfilter {} {}",
            nf_hook::name(o.nf_hook),
            nat_stage::name(o.nat_stage)
        )
        .trim_end()
        .to_string();
    }
    if o.ifindex == 0 {
        return hook::name(o.hook).to_string();
    }
    let name = ctx.ifnames.describe(o.netns, o.ifindex);
    if ctx.is_node(o.netns) {
        format!("{} {name}", hook::name(o.hook))
    } else {
        format!("{} {name} (netns {})", hook::name(o.hook), o.netns)
    }
}

/// The netfilter hook where the reply's source became the Service address.
fn reverse_nat_point(flow: &Flow, packet: u8) -> Option<&'static str> {
    let mut prev: Option<&Obs> = None;
    for o in flow.packet_obs(packet) {
        if let Some(p) = prev
            && p.src != flow.service
            && o.src == flow.service
            && o.hook == hook::NETFILTER
        {
            return Some(nf_hook::name(o.nf_hook));
        }
        prev = Some(o);
    }
    None
}

/// Into `packets`: a printed report's, written over with their hops
/// vectors kept, or empty.
fn evidence(
    flow: &Flow,
    ctx: &ReportCtx<'_>,
    mut packets: Vec<PacketEvidence>,
) -> Vec<PacketEvidence> {
    let client_obs = flow.client_reply.map(|r| r.obs as usize);
    // Exact sizes: a tick can hold thousands of reports at once, and
    // pushing hops one by one leaves a third of them unused.
    // On the stack for the usual few packets (an allocation per report).
    let (mut few, mut many) = ([0usize; 16], Vec::new());
    let hop_counts: &mut [usize] = match flow.packets.len() {
        n @ 0..=16 => &mut few[..n],
        n => {
            many.resize(n, 0);
            &mut many
        }
    };
    for o in &flow.obs {
        hop_counts[o.packet as usize] += 1;
    }
    packets.truncate(flow.packets.len());
    for (i, (p, &n)) in flow.packets.iter().zip(hop_counts.iter()).enumerate() {
        let ev = |hops| PacketEvidence {
            kind: packet_kind(p.key.proto, p.key.tcp_flags, p.dir),
            dir: p.dir,
            tcp_flags: p.key.tcp_flags,
            seq: p.key.seq,
            ack: p.key.ack,
            ip_id: p.key.ip_id,
            dns_id: None,
            hops,
        };
        match packets.get_mut(i) {
            Some(old) => {
                let mut hops = std::mem::take(&mut old.hops);
                hops.reserve_exact(n);
                *old = ev(hops);
            }
            None => packets.push(ev(Vec::with_capacity(n))),
        }
    }
    for (i, o) in flow.obs.iter().enumerate() {
        packets[o.packet as usize]
            .hops
            .push(hop(o, ctx, client_obs == Some(i)));
    }
    let dns = flow.proto == proto::UDP && flow.service.port == 53;
    for (ev, p) in packets.iter_mut().zip(&flow.packets) {
        // Events arrive sorted, but a late one may have been appended out of order.
        ev.hops.sort_by_key(|h| h.ts_ns);
        if dns {
            ev.dns_id = Some((p.key.payload_head >> 16) as u16);
        }
    }
    packets.sort_by_key(|p| p.hops.first().map_or(0, |h| h.ts_ns));
    packets
}
