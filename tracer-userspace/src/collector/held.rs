//! The collector's side of the kernel's per-flow buffer
//! (tracer-ebpf/src/held.rs, docs/DESIGN.md "Event budget"): which flows
//! the kernel holds, and which of them the live session must pull now.
use std::collections::VecDeque;

use tracer_common::{EndpointKey, PacketEvent, direction, event_flags};

use super::{Collector, Endpoint, FlowRef, MS, flow::Flow, summary::Summary};

/// A held flow is pulled this long before its reply deadline: more than a
/// tick of the live session (200 ms), so its events are in before the
/// collector's clock reaches the deadline; less than the kernel's
/// [`tracer_common::held::PULL_AHEAD_NS`] (500 ms), past which the kernel
/// sends a late reply's buffer.
pub const PULL_AHEAD_NS: u64 = 400 * MS;
const _: () = assert!(PULL_AHEAD_NS < tracer_common::held::PULL_AHEAD_NS);

/// Events that were held in the kernel: older than the events around them
/// by design, not late.
pub(super) const HELD: u8 = event_flags::FLUSHED | event_flags::PULLED | event_flags::KEPT;

/// The client side of an event as the kernel matched it (the key of its
/// `HELD` entry): the destination of a reply, else the source.
pub(super) fn client_of(ev: &PacketEvent) -> Endpoint {
    if ev.direction == direction::REPLY {
        Endpoint::dst(ev)
    } else {
        Endpoint::src(ev)
    }
}

/// What an event's buffer flags say about its flow `r` (with the reply
/// timeout, for the pull deadline).
pub(super) fn note_flags(
    flow: &mut Flow,
    flags: u8,
    (r, reply_timeout_ns): (FlowRef, u64),
    held_due_q: &mut VecDeque<(u64, FlowRef)>,
    summary: &mut Summary,
) {
    if flags & event_flags::HOLDING != 0 && !flow.reported {
        if !flow.held {
            held_due_q.push_back((flow.first_ts + reply_timeout_ns, r));
        }
        flow.held = true;
        summary.buffered_flows += 1;
    }
    if flags & event_flags::FLUSHED != 0 {
        // The kernel sent the buffer: the flow goes per packet now.
        flow.held = false;
        summary.flushed_events += 1;
    }
    if flags & event_flags::PULLED != 0 {
        summary.pulled_events += 1;
    }
}

impl Collector {
    /// Client endpoints of flows the kernel holds (event_flags::HOLDING)
    /// whose reply deadline is within [`PULL_AHEAD_NS`] of `now_ns`: the
    /// live session pulls their held events from the kernel and pushes
    /// them (and records them) before its next `tick`, so a `no_reply`
    /// flow is decided with every hop, live and in `analyze` alike.
    pub fn take_due_held(&mut self, now_ns: u64) -> Vec<EndpointKey> {
        let mut out = Vec::new();
        while let Some(&(deadline, r)) = self.held_due_q.front() {
            if deadline > now_ns.saturating_add(PULL_AHEAD_NS) {
                break;
            }
            self.held_due_q.pop_front();
            let Some(f) = self.flow_mut(r) else { continue };
            if !f.held || f.reported || f.client_reply.is_some() {
                continue;
            }
            f.held = false;
            out.push(EndpointKey {
                addr: crate::service::kernel_addr(f.client.addr),
                port: f.client.port,
                proto: f.proto,
                _pad: 0,
            });
        }
        out
    }
}
