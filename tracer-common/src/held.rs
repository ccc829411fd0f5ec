//! The kernel's per-flow buffer rule, defined once: its states and timing,
//! and the decision over one event ([`decide`], [`slot_marks`]) that the
//! eBPF program (tracer-ebpf/src/held.rs) runs on its maps and the model
//! test (tracer-userspace/tests/held.rs) runs on its own, so the test
//! exercises the kernel's decision itself. Pure and `#[inline(always)]`:
//! the verifier sees it as part of each program.
use crate::{direction, event_flags, hook};

/// [`EndpointState::held`](crate::EndpointState::held): never held.
pub const NEVER: u8 = 0;
/// Its events are held in the flow's `HELD` entry.
pub const HOLDING: u8 = 1;
/// Sent, discarded or pulled, for the SYN `syn_seq`.
pub const DONE: u8 = 2;
/// [`HeldFlow::dnat_slot`](crate::HeldFlow::dnat_slot): no DNAT event
/// held yet.
pub const NO_SLOT: u8 = 0xff;
/// Userspace pulls a buffer this long before its reply deadline at the
/// latest (its tick, 200 ms, plus slack): a reply later than that may
/// find the buffer already pulled, so it is sent instead of discarded.
pub const PULL_AHEAD_NS: u64 = 500_000_000;

/// A healthy reply `age_ns` after the flow's first event came too late
/// to discard the buffer (see [`PULL_AHEAD_NS`]).
#[inline(always)]
pub fn is_late(age_ns: u64, reply_timeout_ns: u64) -> bool {
    age_ns + PULL_AHEAD_NS >= reply_timeout_ns
}

/// What an event is to the buffer rule (decided by the filter,
/// tracer-ebpf/src/filter.rs `observe`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fate {
    /// Nothing decisive: hold it if the flow is held.
    Other,
    /// A SYN without ACK leaving the client's device in its namespace.
    Start,
    /// The reply reached the client reverse-NATed.
    Healthy,
    /// Un-reversed reply at the client, RST or drop.
    Anomaly,
}

/// What the decision reads of a held flow's entry.
#[derive(Clone, Copy, Debug, Default)]
pub struct Entry {
    /// Time since the flow's first (sent) event.
    pub age_ns: u64,
    /// The opening SYN was sent again.
    pub retransmit: bool,
    /// A reply event of the flow was held at a point of the traced node.
    pub reply_in_node: bool,
    /// The event is in the namespace the SYN left (the client's).
    pub at_client_ns: bool,
    /// The event's source is the Service the flow was opened to.
    pub from_service: bool,
}

/// What the buffer rule does with one event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step<P> {
    /// Send the event with these flags.
    Send(u8),
    /// Send the flow's buffer (FLUSHED), then the event.
    Flush,
    /// Healthy: discard the buffer of entry `P` but its DNAT event (KEPT),
    /// and send the event with VIA_NODE.
    Discard(P),
    /// Hold the event in entry `P`; `retransmit`: mark the entry's SYN as
    /// sent again first (every attempt is evidence).
    Store { entry: P, retransmit: bool },
}

/// [`decide`]'s answer: the step and the endpoint's state changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision<P> {
    pub step: Step<P>,
    /// The endpoint's new `held` state ([`NEVER`], [`HOLDING`], [`DONE`]), if it changes.
    pub held: Option<u8>,
    /// The event's sequence number becomes the endpoint's `syn_seq`.
    pub syn_seq: bool,
}

impl<P> Decision<P> {
    #[inline(always)]
    fn new(step: Step<P>, held: Option<u8>, syn_seq: bool) -> Self {
        Self {
            step,
            held,
            syn_seq,
        }
    }
}

/// The buffer rule for one event of a flow whose endpoint is in state
/// `held`. `same_syn`: the event's sequence number is the endpoint's
/// `syn_seq`; `buffering`: the buffer is on (not `-v`). `open` opens a
/// fresh entry for a new connection (false: the map is full or holds a
/// stale one; the connection goes per packet); `entry` looks the held
/// entry up (None: pulled by userspace or taken on another CPU). Both run
/// only where the rule needs them, as the kernel's map calls must.
#[inline(always)]
pub fn decide<P>(
    held: u8,
    same_syn: bool,
    fate: Fate,
    buffering: bool,
    reply_timeout_ns: u64,
    open: impl FnOnce() -> bool,
    entry: impl FnOnce() -> Option<(P, Entry)>,
) -> Decision<P> {
    if fate == Fate::Start && buffering && (held == NEVER || !same_syn) {
        if held == HOLDING {
            // A new connection from the same port while the old one is
            // held: the old one never finished, send what it holds; the
            // new one goes per packet.
            return Decision::new(Step::Flush, Some(DONE), true);
        }
        if open() {
            return Decision::new(Step::Send(event_flags::HOLDING), Some(HOLDING), true);
        }
        return Decision::new(Step::Send(0), Some(DONE), true);
    }
    if held != HOLDING {
        return Decision::new(Step::Send(0), None, false);
    }
    let Some((p, e)) = entry() else {
        return Decision::new(Step::Send(0), Some(DONE), false);
    };
    let late = is_late(e.age_ns, reply_timeout_ns);
    // As the collector's `ok`: the reply reached the namespace the SYN
    // left, from the Service it was sent to, and it crossed this node.
    let as_ok = !e.retransmit && e.reply_in_node && e.at_client_ns && e.from_service;
    match fate {
        Fate::Healthy if as_ok && !late => Decision::new(Step::Discard(p), Some(DONE), false),
        Fate::Healthy | Fate::Anomaly => Decision::new(Step::Flush, Some(DONE), false),
        Fate::Start | Fate::Other => Decision::new(
            Step::Store {
                entry: p,
                retransmit: fate == Fate::Start,
            },
            None,
            false,
        ),
    }
}

/// A point of the traced node: tc and netfilter run only there; a device
/// event counts when its namespace is the node's (as the collector's
/// `observed_in_node`). `node_netns` 0: not known, no device event counts.
#[inline(always)]
pub fn in_node(hook: u8, netns: u32, node_netns: u32) -> bool {
    match hook {
        hook::TC_INGRESS | hook::TC_EGRESS | hook::NETFILTER | hook::BR_FORWARD => true,
        hook::DEV_RX | hook::DEV_TX => netns != 0 && netns == node_netns,
        _ => false,
    }
}

/// What a stored event tells of its flow: (its slot is the flow's DNAT
/// evidence — the first request past DNAT in the node, kept when the
/// buffer is discarded; a reply was held in the node). `dnat_unset`: no
/// slot chosen yet; `to_service`: the event's destination is still the
/// Service the flow was opened to.
#[inline(always)]
pub fn slot_marks(dir: u8, in_node: bool, dnat_unset: bool, to_service: bool) -> (bool, bool) {
    (
        dir == direction::REQUEST && in_node && dnat_unset && !to_service,
        dir == direction::REPLY && in_node,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: u64 = 3_000_000_000;

    fn healthy_entry(age_ns: u64) -> Option<((), Entry)> {
        Some((
            (),
            Entry {
                age_ns,
                retransmit: false,
                reply_in_node: true,
                at_client_ns: true,
                from_service: true,
            },
        ))
    }

    fn on(held: u8, fate: Fate, entry: Option<((), Entry)>) -> Decision<()> {
        decide(held, true, fate, true, TIMEOUT, || true, || entry)
    }

    #[test]
    fn a_new_syn_opens_a_buffer_unless_off_or_full() {
        let d = decide::<()>(NEVER, false, Fate::Start, true, TIMEOUT, || true, || None);
        assert_eq!(d.step, Step::Send(event_flags::HOLDING));
        assert_eq!((d.held, d.syn_seq), (Some(HOLDING), true));
        let d = decide::<()>(NEVER, false, Fate::Start, true, TIMEOUT, || false, || None);
        assert_eq!((d.step, d.held), (Step::Send(0), Some(DONE)));
        let d = decide::<()>(NEVER, false, Fate::Start, false, TIMEOUT, || true, || None);
        assert_eq!((d.step, d.held), (Step::Send(0), None));
        // A new connection from a held port: the old buffer goes out.
        let d = decide::<()>(HOLDING, false, Fate::Start, true, TIMEOUT, || true, || None);
        assert_eq!((d.step, d.held), (Step::Flush, Some(DONE)));
    }

    #[test]
    fn a_healthy_reply_discards_unless_late_or_not_as_ok() {
        let d = on(HOLDING, Fate::Healthy, healthy_entry(1_000_000));
        assert_eq!((d.step, d.held), (Step::Discard(()), Some(DONE)));
        let late = TIMEOUT - PULL_AHEAD_NS;
        assert_eq!(
            on(HOLDING, Fate::Healthy, healthy_entry(late)).step,
            Step::Flush
        );
        let mut e = healthy_entry(1_000_000);
        e.as_mut().unwrap().1.retransmit = true;
        assert_eq!(on(HOLDING, Fate::Healthy, e).step, Step::Flush);
        assert_eq!(
            on(HOLDING, Fate::Anomaly, healthy_entry(1)).step,
            Step::Flush
        );
    }

    #[test]
    fn other_events_are_stored_and_a_resent_syn_marked() {
        let d = on(HOLDING, Fate::Other, healthy_entry(1));
        assert_eq!(
            d.step,
            Step::Store {
                entry: (),
                retransmit: false
            }
        );
        assert_eq!(d.held, None);
        let d = on(HOLDING, Fate::Start, healthy_entry(1));
        assert_eq!(
            d.step,
            Step::Store {
                entry: (),
                retransmit: true
            }
        );
        // Pulled meanwhile: per packet from now on.
        let d = on(HOLDING, Fate::Other, None);
        assert_eq!((d.step, d.held), (Step::Send(0), Some(DONE)));
        assert_eq!(on(DONE, Fate::Other, None).step, Step::Send(0));
    }
}
