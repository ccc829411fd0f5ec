//! The whole connection judged (issue 21): a flow whose opening was `ok`
//! is watched for the rest of its life. The kernel's watch
//! (tracer-ebpf/src/watch.rs) sends an event flagged WATCH when a muted
//! flow's packet fails a check; with every packet sent (`-v`, or a flow
//! the kernel did not mute) the same checks run here on each event. The
//! first failure reopens the flow: its evidence starts afresh from that
//! packet, the kernel sends the flow per packet again, and the flow is
//! decided [`WATCH_WAIT_NS`] later, at a tick (after the live session
//! re-read the node's sysctls, which may be what changed), with the same
//! verdicts and causes as an opening and `phase: established`. A verdict
//! of `ok` then (a reverse-NATed reply after all) reports nothing.
use serde::Serialize;
use tracer_common::{PacketEvent, event_flags, hook, nat_stage, nf_hook, tcp_flags};

use super::{
    MS,
    drop_reason::{DropReasons, KnownReasons},
    flow::Flow,
    types::Endpoint,
};

/// How long after its first failure an established flow is decided: the
/// retransmissions and the client's reaction (RST, drop) that follow
/// within a few RTOs are its evidence.
pub const WATCH_WAIT_NS: u64 = 1_000 * MS;

/// Which part of the connection a report judges.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The handshake (TCP) or first exchange (UDP): every report before 21.
    #[default]
    Opening,
    /// After an opening judged `ok`: the connection broke mid-stream.
    Established,
}

impl Phase {
    pub fn is_opening(&self) -> bool {
        *self == Phase::Opening
    }
}

/// What the watch knew when an established flow went wrong (JSON
/// `established`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Established {
    /// When the opening was decided `ok`.
    pub ok_ts_ns: u64,
    /// The first packet that failed the watch.
    pub failed_ts_ns: u64,
    /// From the flow's first packet to that failure.
    pub after_ms: u64,
    /// Replies that reached the client reverse-NATed before it (counted in
    /// the kernel while the flow was muted, or seen here).
    pub good_replies: u64,
}

pub(crate) use super::flow::Watch;

/// Whether `ev`, an event of an `ok` flow, fails the watch: the kernel
/// said so (WATCH), or it is a reply at the client side from another
/// address than the Service, a drop for a failure reason on a device, or a
/// request still addressed to the Service after DNAT.
pub(crate) fn fails(
    flow: &Flow,
    ev: &PacketEvent,
    reasons: &DropReasons,
    known: &KnownReasons,
) -> bool {
    if flow
        .watch
        .is_some_and(|w| w.closed || closing(w.fins, ev, reasons))
    {
        return false;
    }
    if ev.flags & event_flags::WATCH != 0 {
        return true;
    }
    // An ICMP error about the connection is news whatever it says (a
    // frag-needed of a path-MTU discovery that then works decides `ok`
    // again, silently).
    if ev.icmp_type != 0 {
        return true;
    }
    // The opening's own SYNs (a retransmit's queued first attempt freed
    // seconds later, NEIGH_FAILED) are the opening's evidence, not a break.
    if ev.proto == tracer_common::proto::TCP && ev.tcp_flags & tracer_common::tcp_flags::SYN != 0 {
        return false;
    }
    // A bare RST on its way to the client fails where it is first seen,
    // so that its hops through the node are the reopened flow's evidence.
    if is_bare_rst(ev) && ev.direction == tracer_common::direction::REPLY && ev.hook != hook::DROP {
        return true;
    }
    let (src, dst) = (Endpoint::src(ev), Endpoint::dst(ev));
    match ev.hook {
        hook::DEV_RX => {
            flow.client_netns != 0
                && ev.netns == flow.client_netns
                && dst == flow.client
                && src != flow.service
        }
        hook::DROP => {
            ev.ifindex != 0 && known.is_drop(ev.drop_reason) && !reasons.is_benign(ev.drop_reason)
        }
        hook::NETFILTER => {
            ev.nat_stage == nat_stage::AFTER
                && matches!(ev.nf_hook, nf_hook::PRE_ROUTING | nf_hook::LOCAL_OUT)
                && src == flow.client
                && dst == flow.service
        }
        _ => false,
    }
}

/// A RST without ACK: what a kernel sends for a segment no connection of
/// its owns (tcp_v4_send_reset / tcp_v6_send_reset, net/ipv4/tcp_ipv4.c:
/// for a segment with ACK, the reset takes its sequence number from the
/// segment's ack_seq and carries no ACK), i.e. the socket is gone or only a
/// listener has the port. An endpoint closing its own connection with RST
/// (SO_LINGER 0, data left unread, tcp_abort) sends it through
/// tcp_send_active_reset (net/ipv4/tcp_output.c) as RST|ACK.
pub(crate) fn is_bare_rst(ev: &PacketEvent) -> bool {
    use tracer_common::tcp_flags::{ACK, RST};
    ev.proto == tracer_common::proto::TCP && ev.tcp_flags & (RST | ACK) == RST
}

/// The kernel's `watch::closing` (tracer-ebpf/src/watch.rs) on an event:
/// once both sides' FINs passed, a RST or a drop for a reason of
/// [`super::drop_reason::CLOSED_DROPS`] is the close's aftermath — a
/// close's last ACK that comes twice (a retransmitted FIN answered again
/// from TIME_WAIT) finds the socket the first one freed, is dropped with
/// NO_SOCKET and answered with a bare RST. Data dropped for another reason
/// is still a failure.
fn closing(fins: u8, ev: &PacketEvent, reasons: &DropReasons) -> bool {
    fins == tracer_common::fins::BOTH
        && ev.icmp_type == 0
        && (ev.tcp_flags & tcp_flags::RST != 0
            || (ev.hook == hook::DROP && reasons.ends_closed(ev.drop_reason)))
}

/// An event of a healthy `ok` flow that did not fail the watch: a
/// reverse-NATed reply is counted, a RST (an endpoint closed the
/// connection itself) ends the watch's claims on what follows, and each
/// side's FIN is noted.
pub(crate) fn note_healthy(flow: &mut Flow, ev: &PacketEvent) {
    let good = is_good_reply(flow, ev);
    let Some(w) = flow.watch.as_mut() else {
        return;
    };
    if good {
        w.good = w.good.saturating_add(1);
    }
    if ev.proto == tracer_common::proto::TCP
        && ev.hook != hook::DROP
        && ev.tcp_flags & tcp_flags::FIN != 0
    {
        w.fins |= tracer_common::fins::of(ev.direction);
    }
    // Only an endpoint's own close (RST|ACK): a bare RST on its way to the
    // client is checked when it gets there.
    use tracer_common::tcp_flags::{ACK, RST};
    // A dropped one closed nothing for its peer.
    if ev.proto == tracer_common::proto::TCP
        && ev.hook != hook::DROP
        && ev.tcp_flags & (RST | ACK) == RST | ACK
    {
        w.closed = true;
    }
}

/// A mid-stream TCP segment to a Service with no flow: a connection begun
/// before the trace (or forgotten, idle), opened as a flow whose opening
/// was not seen (`opening_seen: false`) so that it is watched too. It is
/// judged on positive evidence only: its reverse-NATed reply makes it `ok`
/// (and watched from then on), an un-NATed reply or a drop fails it, and no
/// reply is `unseen`, never `no_reply`. A closing segment (FIN, RST) opens
/// nothing: a connection ending is not one to judge.
pub(crate) fn opens_unseen(ev: &PacketEvent) -> bool {
    use tracer_common::tcp_flags::{FIN, RST, SYN};
    ev.proto == tracer_common::proto::TCP
        && ev.direction == tracer_common::direction::REQUEST
        && ev.tcp_flags & (SYN | RST | FIN) == 0
}

/// A reverse-NATed reply reaching the client of an `ok` flow (counted).
pub(crate) fn is_good_reply(flow: &Flow, ev: &PacketEvent) -> bool {
    good_reply_at(
        flow,
        ev.hook,
        ev.netns,
        Endpoint::src(ev),
        Endpoint::dst(ev),
    )
}

/// [`is_good_reply`] for a packet seen at `hook` in `netns` from `src` to `dst`.
fn good_reply_at(flow: &Flow, hook: u8, netns: u32, src: Endpoint, dst: Endpoint) -> bool {
    hook == hook::DEV_RX
        && flow.client_netns != 0
        && netns == flow.client_netns
        && dst == flow.client
        && src == flow.service
}

/// Reverse-NATed replies at the client already in the flow's evidence
/// beyond the first when its opening is decided `ok`: on a busy node the
/// decision can come after later exchanges were read (a UDP flow's second
/// and third queries answered in the same batch), and those are good
/// replies the watch would otherwise never count.
pub(crate) fn good_before_watch(flow: &Flow) -> u32 {
    let n = flow
        .obs
        .iter()
        .filter(|o| good_reply_at(flow, o.hook, o.netns, o.src, o.dst))
        .count();
    u32::try_from(n.saturating_sub(1)).unwrap_or(u32::MAX)
}

/// The FINs already in the flow's evidence when its opening is decided
/// `ok` (a short connection read in one batch closed before its decision),
/// as [`note_healthy`] would have noted them.
pub(crate) fn fins_before_watch(flow: &Flow) -> u8 {
    use super::types::Dir;
    flow.packets
        .iter()
        .filter(|p| p.key.tcp_flags & tcp_flags::FIN != 0)
        .fold(0, |fins, p| {
            let dir = match p.dir {
                Dir::Reply => tracer_common::direction::REPLY,
                Dir::Request => tracer_common::direction::REQUEST,
            };
            fins | tracer_common::fins::of(dir)
        })
}

/// A bare RST from the backend's side while an opening whose reply reached
/// the client reverse-NATed still settles (`CollectorConfig::settle_ns`):
/// the connection was reset right after its handshake — a listener whose
/// accept queue is full resets the client's first segment
/// (net/ipv4/tcp_minisocks.c `tcp_check_req`, `listen_overflow` with
/// `tcp_abort_on_overflow`). Taken as the opening's evidence, it left the
/// connection `ok` while the client's first read failed; the opening is
/// `ok` (its reply was right) and the reset is the established
/// connection's failure, for the watch to judge.
pub(crate) fn resets_settling_opening(
    flow: &Flow,
    ev: &PacketEvent,
    known: &KnownReasons,
    node_netns: u32,
) -> bool {
    !flow.reported
        && flow.watch.is_none()
        && is_bare_rst(ev)
        && ev.direction == tracer_common::direction::REPLY
        && ev.hook != hook::DROP
        && flow.client_reply.is_some_and(|r| r.reverse_nated)
        // An endpoint's own abort (RST|ACK) before it closed the connection:
        // what follows is its aftermath, as `Watch::closed` says once watched.
        && !flow.packets.iter().any(|p| p.key.tcp_flags & tcp_flags::RST != 0)
        && super::verdict::verdict_of(flow, known, node_netns, false) == super::Verdict::Ok
}

/// The flow's evidence starts again at `ev`, which failed the watch.
pub(crate) fn reopen(flow: &mut Flow, ev: &PacketEvent) {
    let Some(w) = flow.watch.as_mut() else {
        return;
    };
    w.good = w.good.max(ev.good);
    w.failed_ts = ev.ts_ns.max(1);
    flow.reported = false;
    flow.client_reply = None;
    flow.client_rst = false;
    flow.truncated = false;
    flow.packets.clear();
    flow.obs.clear();
    flow.icmp = None;
}

/// For a reopened flow, its first drop whose packet was seen before the
/// drop (a retransmission, sent per packet after the failure): the
/// watched drop that reopened it comes alone and has no place to name.
pub(crate) fn placed_drop<'f>(
    flow: &'f Flow,
    known: &KnownReasons,
) -> Option<&'f super::types::Obs> {
    if !flow.watch.is_some_and(|w| w.failed()) {
        return None;
    }
    let first = super::verdict::first_drop(flow, known)?;
    flow.obs
        .iter()
        .filter(|o| {
            o.hook == tracer_common::hook::DROP
                && o.drop_reason == first.drop_reason
                && flow.packets[o.packet as usize].in_node
        })
        .find(|d| {
            flow.packet_obs(d.packet)
                .any(|o| o.hook != tracer_common::hook::DROP && o.ts_ns <= d.ts_ns)
        })
}

/// The report's `established` part, for a reopened flow.
pub(crate) fn info(flow: &Flow) -> Option<Established> {
    let w = flow.watch.filter(Watch::failed)?;
    Some(Established {
        ok_ts_ns: w.ok_ts,
        failed_ts_ns: w.failed_ts,
        after_ms: w.failed_ts.saturating_sub(flow.first_ts) / MS,
        good_replies: u64::from(w.good),
    })
}

/// "mid-stream after 1.4 s and 57 good replies: " before the detail;
/// under a second in milliseconds, and "before any reply" when none came:
/// a backend that resets right after the handshake (its accept queue full)
/// read "after 0.0 s and 0 good replies".
pub(crate) fn prefix(e: &Established) -> String {
    let when = match e.after_ms {
        0 => "within 1 ms".to_owned(),
        ms @ 1..1000 => format!("after {ms} ms"),
        ms => format!("after {:.1} s", ms as f64 / 1000.0),
    };
    match e.good_replies {
        0 => format!("mid-stream {when}, before any reply: "),
        1 => format!("mid-stream {when} and 1 good reply: "),
        n => format!("mid-stream {when} and {n} good replies: "),
    }
}
