//! The watch of an established flow (docs/DESIGN.md, "Watch"): once a
//! flow is muted (its opening judged healthy) most of its packets stop at
//! the filter's first check, but the few points that decide a verdict still
//! look at each packet, and an event is sent only when one fails:
//! - a reply reaching the client's namespace from another address than the
//!   Service it was sent to (not reverse-NATed: br_netfilter switched off,
//!   conntrack INVALID);
//! - a drop of the flow for a failure reason (the drop reasons a healthy
//!   socket has of its own, from userspace in `Config::benign_drops`, are
//!   counted like muted packets).
//!
//! A failure unmutes the flow (per packet from then on) and its event
//! carries `event_flags::WATCH` and the count of replies that were fine.
//!
//! Once both sides' FINs passed, the close's aftermath is counted too
//! ([`closing`]): RSTs, and a late segment whose socket is gone.
use tracer_common::{EndpointState, direction, fins, hook, tcp_flags};

use crate::emit::Point;

/// What the watch makes of one packet of a muted flow.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// Checked and fine: counted, not sent.
    Fine,
    /// Failed a check: unmute, send with WATCH.
    Alert,
    /// Nothing the watch decides (SYN, RST, other points): as before.
    Pass,
}

/// The watch's checks on a packet of a muted flow. `from_service`: the
/// packet's source is a traced Service; `outside_node`: seen in another
/// namespace than the traced node's.
#[inline(always)]
pub fn check(
    state: *mut EndpointState,
    at: &Point,
    dir: u8,
    from_service: impl FnOnce() -> bool,
    outside_node: bool,
) -> Check {
    if at.hook == hook::DROP {
        // A deviceless drop is a delivered packet purged from a closing
        // socket's queue (net/core/stream.c sk_stream_kill_queues).
        if at.ifindex == 0 || benign_drop(at.drop_reason) {
            return Check::Fine;
        }
        return Check::Alert;
    }
    // No check at the DNAT point: a request still addressed to the Service
    // there is a failure only if the opening was DNATed there, and IPVS
    // (DNAT at LOCAL_IN) or a node-local address never is. A flow whose
    // conntrack entry is gone shows instead at its drop (kube-proxy's
    // INVALID rule) or its un-reverse-NATed reply at the client.
    if dir != direction::REPLY || at.hook != hook::DEV_RX || !outside_node {
        return Check::Pass;
    }
    let cn = unsafe { core::ptr::read_volatile(&raw const (*state).client_netns) };
    if cn != 0 && cn != at.netns {
        // Another namespace on this kernel (the backend's node in a lab).
        return Check::Pass;
    }
    if from_service() {
        count_good(state);
        if cn == 0 {
            unsafe { core::ptr::write_volatile(&raw mut (*state).client_netns, at.netns) };
        }
        return Check::Fine;
    }
    if cn == 0 {
        // Which namespace is the client's is not known (muted by
        // userspace before any reply was seen here): no claim.
        return Check::Pass;
    }
    Check::Alert
}

/// [`check`]'s common case decided before `judge` (filter.rs
/// `observe_via`): a reply of a muted flow at a device in the namespace
/// its reply reached before (`outside_node` already known), from the
/// Service — fine, counted. False for anything else, which `judge`'s
/// `check` then decides as before.
#[inline(always)]
pub fn fine_at_client(
    state: *mut EndpointState,
    at: &Point,
    from_service: impl FnOnce() -> bool,
) -> bool {
    let cn = unsafe { core::ptr::read_volatile(&raw const (*state).client_netns) };
    if cn == 0 || cn != at.netns || !from_service() {
        return false;
    }
    count_good(state);
    true
}

#[inline(always)]
fn count_good(state: *mut EndpointState) {
    unsafe {
        let good = core::ptr::read_volatile(&raw const (*state).good);
        core::ptr::write_volatile(&raw mut (*state).good, good.wrapping_add(1));
    }
}

/// The flow was just muted by its reverse-NATed reply in namespace `netns`.
#[inline(always)]
pub fn note_muted(state: *mut EndpointState, netns: u32) {
    unsafe {
        core::ptr::write_volatile(&raw mut (*state).client_netns, netns);
        core::ptr::write_volatile(&raw mut (*state).good, 0);
    }
}

/// A FIN in direction `dir` passed: that side's application closed its
/// end (only counted while muted, so noted here).
#[inline(always)]
pub fn note_fin(state: *mut EndpointState, dir: u8) {
    let bit = fins::of(dir);
    unsafe {
        let seen = core::ptr::read_volatile(&raw const (*state).fins);
        if seen & bit == 0 {
            core::ptr::write_volatile(&raw mut (*state).fins, seen | bit);
        }
    }
}

/// A new connection from the same client port starts without them.
#[inline(always)]
pub fn clear_fins(state: *mut EndpointState) {
    unsafe { core::ptr::write_volatile(&raw mut (*state).fins, 0) }
}

/// The backend's FIN passed.
#[inline(always)]
pub fn reply_fin(state: *mut EndpointState) -> bool {
    unsafe { core::ptr::read_volatile(&raw const (*state).fins) & fins::REPLY != 0 }
}

/// A packet of a muted flow both of whose sides had closed (both FINs
/// passed) that is the close's aftermath, not a failure: a RST (a late
/// segment answered by a kernel whose socket is gone, or a TIME_WAIT
/// socket's end), or a drop for a reason of `Config::closed_drops` (the
/// late segment itself: a close's last ACK that comes twice, after a
/// retransmitted FIN, finds the socket the first freed — NO_SOCKET). No
/// application is left to see it; data dropped for another reason is
/// still checked.
#[inline(always)]
pub fn closing(state: *mut EndpointState, flags: u8, at: &crate::emit::Point) -> bool {
    let seen = unsafe { core::ptr::read_volatile(&raw const (*state).fins) };
    if seen != fins::BOTH {
        return false;
    }
    flags & tcp_flags::RST != 0
        || (at.hook == hook::DROP
            && crate::config::config().is_some_and(|c| reason_in(&c.closed_drops, at.drop_reason)))
}

/// The count a WATCH event carries.
#[inline(always)]
pub fn good(state: *mut EndpointState) -> u32 {
    unsafe { core::ptr::read_volatile(&raw const (*state).good) }
}

/// Whether the reply at the client's device is in the namespace the flow's
/// reply reached before, when known (another lab node on the same kernel
/// is not the client).
#[inline(always)]
pub fn is_client_netns(state: *mut EndpointState, at: &Point) -> bool {
    let cn = unsafe { core::ptr::read_volatile(&raw const (*state).client_netns) };
    cn == 0 || cn == at.netns
}

/// Whether `at` is a device in another namespace than the one the flow's
/// reply reached when it was muted (`check` passes such a reply).
#[inline(always)]
pub fn elsewhere(state: *mut EndpointState, at: &Point) -> bool {
    let cn = unsafe { core::ptr::read_volatile(&raw const (*state).client_netns) };
    cn != 0 && cn != at.netns
}

/// `Config::benign_drops` bit `reason`; reasons past 255 (subsystem
/// reasons) are failures.
#[inline(always)]
fn benign_drop(reason: u32) -> bool {
    crate::config::config().is_some_and(|c| reason_in(&c.benign_drops, reason))
}

/// Bit `reason` of a drop-reason bitmap of `Config`; none past 255.
#[inline(always)]
fn reason_in(bits: &[u64; 4], reason: u32) -> bool {
    if reason >= 256 {
        return false;
    }
    // Constant bounds for the verifier: the index is masked to 0..3.
    let word = bits[((reason >> 6) & 3) as usize];
    word & (1u64 << (reason & 63)) != 0
}
