//! A flow's verdict and the questions every rule and the report ask of a
//! flow's evidence, each answered once: is this event in the node, what
//! kind of packet is this, where did DNAT send it, where was it dropped,
//! and how long may a decision still wait for evidence.
use serde::Serialize;
use tracer_common::{hook, icmp, nat_stage, nf_hook, proto, tcp_flags};

use super::{
    drop_reason::KnownReasons,
    flow::{Flow, NEIGH_FAIL_WAIT_NS},
    ifnames::IfNames,
    types::{Dir, Endpoint, Obs, in_node, node_egress, packet_kind},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// The reply reached the client reverse-NATed (source = Service ip:port).
    Ok,
    /// The reply reached the client side with another source (the backend's).
    ReplyNotReverseNated,
    /// No reply reached the client within the reply timeout.
    NoReply,
    /// No reply reached the client, and a packet of the flow was dropped.
    Dropped,
    /// The first reply reached the client reverse-NATed, but it was a RST:
    /// the backend refused the connection.
    Refused,
    /// nattrace did not see the flow open (it began before tracing did, or
    /// while the programs were still attaching) and nothing seen since
    /// tells how it went: a missing reply is no evidence then.
    Unseen,
    /// No reply yet and no failure seen when tracing stopped, before the
    /// reply timeout had run out: cut by the stop, too early to tell. Not a
    /// failure (a reply may have been on its way), not `ok` either.
    Undecided,
}

impl Verdict {
    pub const ALL: [Verdict; 7] = [
        Verdict::Ok,
        Verdict::ReplyNotReverseNated,
        Verdict::NoReply,
        Verdict::Dropped,
        Verdict::Refused,
        Verdict::Unseen,
        Verdict::Undecided,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::ReplyNotReverseNated => "reply_not_reverse_nated",
            Verdict::NoReply => "no_reply",
            Verdict::Dropped => "dropped",
            Verdict::Refused => "refused",
            Verdict::Unseen => "unseen",
            Verdict::Undecided => "undecided",
        }
    }

    /// Not a failure seen: no evidence either way (the opening unseen, or
    /// the trace stopped before the reply timeout). No exit status 1.
    pub fn is_undetermined(self) -> bool {
        matches!(self, Verdict::Unseen | Verdict::Undecided)
    }
}

/// `stopped_early`: decided at the trace's end before the flow's reply
/// timeout ran out. Only a missing reply is cut short by that; positive
/// evidence (a drop, a reply not reverse-NATed, a RST) decides as ever.
pub(crate) fn verdict_of(
    flow: &Flow,
    known: &KnownReasons,
    node_netns: u32,
    stopped_early: bool,
) -> Verdict {
    match flow.client_reply {
        Some(r)
            if r.reverse_nated
                && flow.proto == proto::TCP
                && flow.packets[r.packet as usize].key.tcp_flags & tcp_flags::RST != 0 =>
        {
            Verdict::Refused
        }
        Some(r) if r.reverse_nated && !request_drop_stands(flow, known, node_netns) => Verdict::Ok,
        Some(r) if r.reverse_nated => Verdict::Dropped,
        Some(_) => Verdict::ReplyNotReverseNated,
        None if first_drop(flow, known).is_some() => Verdict::Dropped,
        None if neighbour_gave_up(flow, node_netns).is_some() => Verdict::Dropped,
        None if !flow.opening_seen => Verdict::Unseen,
        None if stopped_early => Verdict::Undecided,
        None => Verdict::NoReply,
    }
}

/// A reopened (established) flow whose packets to the backend are being
/// dropped in the node, with none seen leaving it since: a reverse-NATed
/// reply at the client does not mean the connection got over the drop
/// then. With the client's ACKs dropped, the backend retransmits data the
/// client already has, and each copy reaches it reverse-NATed (its TCP
/// drops the copy as TCP_OLD_DATA, tcp_data_queue in net/ipv4/tcp_input.c,
/// a reason the kernel's watch counts as benign) while nothing the client
/// sends arrives. Recovery is a request leaving the node after the drop.
pub(crate) fn request_drop_stands(flow: &Flow, known: &KnownReasons, node_netns: u32) -> bool {
    if !flow.watch.is_some_and(|w| w.failed()) {
        return false;
    }
    let Some(drop) = first_drop(flow, known) else {
        return false;
    };
    if flow.packets[drop.packet as usize].dir != Dir::Request || !in_node(drop.netns, node_netns) {
        return false;
    }
    !flow.obs.iter().any(|o| {
        o.ts_ns > drop.ts_ns
            && flow.packets[o.packet as usize].dir == Dir::Request
            && o.netns == node_netns
            && node_egress(o.hook)
    })
}

/// Only drops of packets this node handled: another node's drop of a reply
/// that bypassed this one is that node's story.
pub(crate) fn first_drop<'f>(flow: &'f Flow, known: &KnownReasons) -> Option<&'f Obs> {
    flow.obs.iter().find(|o| {
        o.hook == hook::DROP
            && known.is_drop(o.drop_reason)
            && flow.packets[o.packet as usize].in_node
    })
}

impl Flow {
    /// "SYN", "SYN-ACK", "request", ... for one of the flow's packets.
    pub(crate) fn kind(&self, packet: u8) -> &'static str {
        let p = &self.packets[packet as usize];
        packet_kind(p.key.proto, p.key.tcp_flags, p.dir)
    }

    /// The kind of the flow's first request packet ("SYN", "request").
    pub(crate) fn first_request_kind(&self) -> &'static str {
        self.packets
            .iter()
            .position(|p| p.dir == Dir::Request)
            .map_or("request", |i| self.kind(i as u8))
    }

    /// The client reached itself through the Service.
    pub(crate) fn is_hairpin(&self) -> bool {
        self.backend.is_some_and(|b| b.addr == self.client.addr)
    }
}

/// Where a dropped packet was last seen before the drop, e.g. "after netfilter FORWARD".
pub(crate) fn drop_place(flow: &Flow, drop: &Obs, ifnames: &IfNames) -> String {
    let before = flow
        .obs
        .iter()
        .filter(|o| o.packet == drop.packet && o.ts_ns <= drop.ts_ns && o.hook != hook::DROP)
        .max_by_key(|o| o.ts_ns);
    match before {
        Some(o) if o.hook == hook::NETFILTER => {
            format!("after netfilter {}", nf_hook::name(o.nf_hook))
        }
        Some(o) if o.ifindex == 0 => format!("after {}", hook::name(o.hook)),
        Some(o) => format!(
            "after {} on {}",
            hook::name(o.hook),
            ifnames.describe(o.netns, o.ifindex)
        ),
        None => "before any other observation point".to_string(),
    }
}

/// Where DNAT sent this request packet: its destination after the node's
/// NAT, when that differs from the Service.
pub(crate) fn packet_backend(flow: &Flow, packet: u8) -> Option<Endpoint> {
    flow.packet_obs(packet)
        .find(|o| o.dst != flow.service && o.dst != flow.client)
        .map(|o| o.dst)
}

/// The backend a reply packet came from, as seen before reverse NAT.
pub(crate) fn reply_backend(flow: &Flow, packet: u8) -> Option<Endpoint> {
    flow.packet_obs(packet)
        .find(|o| o.src != flow.service)
        .map(|o| o.src)
}

/// The first time a request of the flow was DNATed in the node and then
/// vanished: no hook after NAT saw it leave, deliver it, or drop it. That is
/// a packet held on a neighbour entry's queue (see checks/backend.rs), whose
/// fate the kernel reports only when resolution fails.
pub(crate) fn vanished_since(flow: &Flow, node_netns: u32) -> Option<u64> {
    flow.packets
        .iter()
        .enumerate()
        .filter(|(_, p)| p.dir == Dir::Request && p.in_node)
        .filter_map(|(i, p)| {
            let mut dnated = false;
            for o in flow.packet_obs(i as u8) {
                // Left, dropped, or delivered to a local socket (a host-network
                // backend): not waiting for a neighbour.
                if o.hook == hook::DROP
                    || (in_node(o.netns, node_netns) && node_egress(o.hook))
                    || (o.hook == hook::NETFILTER && o.nf_hook == nf_hook::LOCAL_IN)
                {
                    return None;
                }
                if o.hook == hook::NETFILTER
                    && o.nat_stage == nat_stage::AFTER
                    && o.dst != flow.service
                {
                    dnated = true;
                }
            }
            dnated.then_some(p.first_ts)
        })
        .min()
}

/// A request held here for neighbour resolution that the kernel gave up
/// on, known by the error the node sent about it when the drop event itself
/// is missing (the kernel skips a tracing program that fires while the same
/// program runs on that CPU, kernel/trace/bpf_trace.c `__bpf_trace_run`,
/// and the queued packet is freed from the neighbour timer's softirq).
/// `neigh_invalidate` hands each queued packet to the family's error report
/// (net/core/neighbour.c): `arp_error_report` (net/ipv4/arp.c) sends ICMP
/// host unreachable through `dst_link_failure` and frees the packet as
/// NEIGH_FAILED; `ndisc_error_report` (net/ipv6/ndisc.c) sends ICMPv6
/// address unreachable. Returns the packet and the error's time.
pub(crate) fn neighbour_gave_up(flow: &Flow, node_netns: u32) -> Option<(u8, u64)> {
    // Asked of every report (its attempts); without an ICMP error there is
    // nothing to find, and the vanished request's search cost ~280
    // instructions per healthy connection (callgrind, BENCHMARKS.md).
    flow.icmp.as_ref()?;
    let since = vanished_since(flow, node_netns)?;
    let packet = flow
        .packets
        .iter()
        .position(|p| p.first_ts == since && p.dir == Dir::Request)? as u8;
    let backend = packet_backend(flow, packet)?;
    super::icmp::groups(flow).iter().find_map(|g| {
        let first = &g[0];
        let gave_up = if first.v6 {
            first.icmp_type == icmp::V6_DEST_UNREACH && first.code == icmp::V6_ADDR_UNREACH
        } else {
            first.icmp_type == icmp::V4_DEST_UNREACH && first.code == icmp::V4_HOST_UNREACH
        };
        // Sent by the node itself, quoting the request as DNAT left it.
        (gave_up
            && first.obs.ts_ns >= since
            && in_node(first.obs.netns, node_netns)
            && first.obs.hook == hook::NETFILTER
            && first.obs.nf_hook == nf_hook::LOCAL_OUT
            && first.obs.dst == backend)
            .then_some((packet, first.obs.ts_ns))
    })
}

/// Until when a `no_reply` decision should wait: a request DNATed here with
/// no reply seen anywhere may still be reported dropped by neighbour
/// resolution — here (it vanished after DNAT) or on the backend's node — and
/// that would make a routing cause (no_reply_through_node) wrong advice.
pub(crate) fn hold_until(flow: &Flow, node_netns: u32, known: &KnownReasons) -> Option<u64> {
    if flow.backend.is_none() || flow.packets.iter().any(|p| p.dir == Dir::Reply) {
        return None;
    }
    // Already dropped on the way (a rule, the bridge, no route): that is
    // the evidence, nothing more to wait for.
    if first_drop(flow, known).is_some() {
        return None;
    }
    let first = flow
        .packets
        .iter()
        .enumerate()
        .filter(|(i, p)| p.dir == Dir::Request && packet_backend(flow, *i as u8).is_some())
        .map(|(_, p)| p.first_ts)
        .min();
    let vanished = vanished_since(flow, node_netns);
    first.or(vanished).map(|t| t + NEIGH_FAIL_WAIT_NS)
}
