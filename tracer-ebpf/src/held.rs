//! The per-flow buffer (docs/DESIGN.md, "Event budget"). A TCP connection
//! opened from a pod sends its first event (flag HOLDING); its next events
//! are held in `HELD` until the flow shows what it is:
//! - healthy (the reply reaches the client reverse-NATed, the point where
//!   the filter mutes it): the buffer is discarded except the first request
//!   event past DNAT (KEPT, the backend's evidence), and the reply is sent
//!   with VIA_NODE;
//! - a problem (un-reversed reply, RST, drop, a reply later than the
//!   deadline userspace pulls at, a retransmitted SYN, a reply that never
//!   crossed the node, the buffer full): the buffer is sent in order
//!   (FLUSHED), then the event, and the flow goes per packet;
//! - no reply: userspace pulls the buffer at the flow's reply deadline and
//!   at exit (tracer-userspace/src/probes/held.rs).
//!
//! The rule's decision is tracer-common's `held::decide` (and
//! `slot_marks`): this file is its map calls, and the model test
//! (tracer-userspace/tests/held.rs) replays every recorded fixture through
//! the same decision.

use aya_ebpf::{
    helpers::bpf_ktime_get_ns,
    macros::map,
    maps::{HashMap, PerCpuArray},
};
use tracer_common::{
    EndpointKey, EndpointState, HELD_CLOSED, HELD_SLOTS, HeldFlow, PacketEvent, event_flags,
    held::{DONE, Entry, Fate, NO_SLOT, Step, decide, slot_marks},
    stat,
};

use crate::{
    EVENTS,
    emit::{Packet, Point, copy_addr, fill, stat_add, stat_inc, wakeup_flag},
};

/// Held flows at once. A healthy handshake holds its entry for a round
/// trip; an unanswered one for the reply timeout. Preallocated (2.1 KiB
/// each, ~4.4 MiB): kernels before 6.1 refuse run-time allocated hash maps
/// in tracing programs. Full → the new flow goes per packet (counted).
const HELD_FLOWS: u32 = 2048;

#[map]
static HELD: HashMap<EndpointKey, HeldFlow> = HashMap::with_max_entries(HELD_FLOWS, 0);

/// The template a new entry is copied from: a 2 KiB value cannot be built
/// on the 512-byte BPF stack.
#[map]
static HELD_INIT: PerCpuArray<HeldFlow> = PerCpuArray::with_max_entries(1, 0);

const BPF_NOEXIST: u64 = 1;
const EEXIST: i32 = 17;

/// Applies the buffer rule to an event the filter would send. Returns the
/// flags to send it with, or None when it is held.
#[inline(always)]
pub fn hold(
    client: &EndpointKey,
    state: *mut EndpointState,
    pkt: &Packet,
    at: &Point,
    dir: u8,
    svc: u8,
    fate: Fate,
) -> Option<u8> {
    let Some(cfg) = crate::config::config() else {
        return Some(0);
    };
    let held = unsafe { core::ptr::read_volatile(&raw const (*state).held) };
    let same_syn = unsafe { core::ptr::read_volatile(&raw const (*state).syn_seq) } == pkt.seq;
    // The rule itself is tracer-common's (`held::decide`), the one the
    // model test replays the recordings through; here are its map calls.
    // The clock is read once for a held flow's event: its entry's age, and
    // the time of the event if it is stored (read_tsc was +1.0 ms per 1000
    // connections in the bench's profile, mostly these).
    let mut now = 0;
    let d = decide(
        held,
        same_syn,
        fate,
        cfg.buffer != 0,
        cfg.reply_timeout_ns,
        || start(client, pkt, at),
        || {
            let p = HELD.get_ptr_mut(client)?;
            now = unsafe { bpf_ktime_get_ns() };
            let e = unsafe {
                Entry {
                    age_ns: now.saturating_sub((*p).first_ts),
                    retransmit: (*p).retransmit != 0,
                    reply_in_node: (*p).reply_in_node != 0,
                    at_client_ns: (*p).client_netns == at.netns,
                    from_service: same_addr(&(*p).service, &pkt.saddr)
                        && (*p).service_port == pkt.sport,
                }
            };
            Some((p, e))
        },
    );
    if d.syn_seq {
        unsafe { core::ptr::write_volatile(&raw mut (*state).syn_seq, pkt.seq) };
    }
    if let Some(h) = d.held {
        set_held(state, h);
    }
    // One flush site per program: each is a 24-iteration loop the verifier
    // walks (6.1 under emulation took seconds per program with several).
    let act = match d.step {
        Step::Send(flags) => Act::Send(flags),
        Step::Flush => Act::Flush,
        Step::Discard(p) => Act::Send(discard(client, p)),
        Step::Store { entry, retransmit } => {
            if retransmit {
                unsafe { core::ptr::write_volatile(&raw mut (*entry).retransmit, 1) };
            }
            store(state, entry, now, pkt, at, dir, svc)
        }
    };
    match act {
        Act::Send(flags) => Some(flags),
        Act::Held => None,
        Act::Flush => {
            take_and_flush(client);
            Some(0)
        }
    }
}

/// What [`hold`] does with the event.
enum Act {
    Send(u8),
    Held,
    /// Send the flow's buffer, then the event.
    Flush,
}

/// Word by word: array equality may become a `bcmp` call, which the BPF
/// target cannot link (bpf-linker crashed on it).
#[inline(always)]
fn same_addr(a: &tracer_common::Addr, b: &tracer_common::Addr) -> bool {
    a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3]
}

#[inline(always)]
fn set_held(state: *mut EndpointState, v: u8) {
    unsafe { core::ptr::write_volatile(&raw mut (*state).held, v) }
}

/// A fresh entry for the connection opened by `pkt` (its first event).
#[inline(always)]
fn start(client: &EndpointKey, pkt: &Packet, at: &Point) -> bool {
    let Some(init) = HELD_INIT.get_ptr_mut(0) else {
        return false;
    };
    unsafe {
        (*init).count = 0;
        (*init).syn_seq = pkt.seq;
        (*init).client_netns = at.netns;
        (*init).first_ts = bpf_ktime_get_ns();
        copy_addr(&raw mut (*init).service, &pkt.daddr);
        (*init).service_port = pkt.dport;
        (*init).dnat_slot = NO_SLOT;
        (*init).reply_in_node = 0;
        (*init).retransmit = 0;
    }
    // By reference: `*init` would copy 2 KiB onto the 512-byte stack.
    #[allow(clippy::needless_borrows_for_generic_args)]
    match HELD.insert(client, unsafe { &*init }, BPF_NOEXIST) {
        Ok(()) => true,
        // Left by a connection whose endpoint state was evicted (LRU) while
        // held: userspace pulls it (at its deadline, or as stale); this
        // connection goes per packet.
        Err(e) if e == -EEXIST => false,
        Err(_) => {
            stat_inc(stat::HELD_MAP_FULL);
            false
        }
    }
}

/// Claims a slot ([`fetch_add`]: two CPUs may hold events of the same flow
/// at once only in a rare race). A writer racing the CPU that takes the
/// buffer can lose its one event (written after the copy, or into a freed
/// entry).
#[inline(always)]
fn store(
    state: *mut EndpointState,
    p: *mut HeldFlow,
    now: u64,
    pkt: &Packet,
    at: &Point,
    dir: u8,
    svc: u8,
) -> Act {
    let idx = fetch_add(p, 1);
    if idx >= HELD_CLOSED {
        // Taken meanwhile: the flow goes per packet.
        return Act::Send(0);
    }
    let i = idx as usize;
    if i >= HELD_SLOTS {
        // Full: a spill, not a loss. The buffer goes out, then this event.
        stat_inc(stat::HELD_SPILLED);
        set_held(state, DONE);
        return Act::Flush;
    }
    let node_netns = crate::config::config().map_or(0, |c| c.node_netns);
    let in_node = tracer_common::held::in_node(at.hook, at.netns, node_netns);
    // Clamped again after a read through memory: LLVM spills the count it
    // read (a full u64) before the check above, and 6.1's verifier keeps no
    // bounds for a spilled unbounded scalar (check_stack_write_fixed_off
    // saves the register only if register_is_bounded), so the reload it
    // indexes with is unbounded ("math between map_value pointer and
    // register with unbounded min value"). 6.3 tracks such spills.
    let i = unsafe { core::ptr::read_volatile(&i) }.min(HELD_SLOTS - 1);
    unsafe {
        let slot = &raw mut (*p).events[i];
        // Flagged as it will be sent if the flow turns out a problem.
        fill(slot, now, pkt, at, dir, svc, event_flags::FLUSHED);
        let to_service = same_addr(&pkt.daddr, &(*p).service) && pkt.dport == (*p).service_port;
        let (dnat, reply) = slot_marks(dir, in_node, (*p).dnat_slot == NO_SLOT, to_service);
        if dnat {
            (*p).dnat_slot = i as u8;
        }
        if reply {
            (*p).reply_in_node = 1;
        }
    }
    Act::Held
}

/// Claims `n` on the entry's count and returns what it was. Not atomic:
/// a fetch-add needs BPF_ATOMIC | BPF_FETCH, which LLVM emits only for
/// `-mcpu=v3`, and aya-build compiles for the generic CPU (LLVM refuses
/// "Invalid usage of the XADD return value"); the core atomics are not
/// offered for this target. Safe enough because a flow's held events are
/// causally ordered: a packet crosses the node's points one after the
/// other on one CPU, and the reply exists only after the request arrived.
/// Two CPUs meet only when a retransmitted SYN overlaps the reply: then
/// one event can be overwritten (a hop missing from a problem flow's
/// evidence) or a buffer sent twice (the collector drops duplicate events).
#[inline(always)]
fn fetch_add(p: *mut HeldFlow, n: u64) -> u64 {
    unsafe {
        let count = &raw mut (*p).count;
        let old = core::ptr::read_volatile(count);
        core::ptr::write_volatile(count, old + n);
        old
    }
}

/// Takes the buffer: the number of events held, or None if another CPU
/// took it first.
#[inline(always)]
fn take(p: *mut HeldFlow) -> Option<usize> {
    let n = fetch_add(p, HELD_CLOSED);
    (n < HELD_CLOSED).then_some((n as usize).min(HELD_SLOTS))
}

/// Sends the held events in order (FLUSHED) and deletes the entry. A full
/// ring buffer loses them like any event (STATS[RINGBUF_FULL]), so the
/// collector marks the flow incomplete as it does for any loss.
#[inline(always)]
fn take_and_flush(client: &EndpointKey) {
    let Some(p) = HELD.get_ptr_mut(client) else {
        return;
    };
    if let Some(n) = take(p)
        && n > 0
    {
        // One record of n events (slots are stored flagged FLUSHED):
        // one helper call the verifier checks once, where a loop of
        // reservations was walked slot by slot. The reader splits it.
        // Clamped after a read through memory: LLVM would otherwise keep
        // n on the stack without the check, and 6.1's verifier loses a
        // spilled scalar's bounds ("R3 min value is negative").
        let n = unsafe { core::ptr::read_volatile(&n) }.min(HELD_SLOTS);
        let held = unsafe { &(&(*p).events)[..n] };
        if EVENTS.output::<[PacketEvent]>(held, wakeup_flag()).is_ok() {
            stat_add(stat::EVENTS, n as u64);
        } else {
            stat_add(stat::RINGBUF_FULL, n as u64);
        }
    }
    let _ = HELD.remove(client);
}

/// Healthy: the kept DNAT event goes out, the rest is only counted.
#[inline(always)]
fn discard(client: &EndpointKey, p: *mut HeldFlow) -> u8 {
    let Some(n) = take(p) else {
        return 0;
    };
    // Through memory, so LLVM cannot fold `kept < HELD_SLOTS` into
    // `kept < n` (n ≤ HELD_SLOTS): 6.1's verifier does not carry bounds
    // across a comparison of two registers ("R9 max value is outside of the
    // allowed memory range"), so the slot index needs the constant one.
    let n = unsafe { core::ptr::read_volatile(&n) };
    let kept = unsafe { (*p).dnat_slot } as usize;
    let mut sent = 0;
    if kept < HELD_SLOTS && kept < n {
        send_copy(unsafe { &raw const (*p).events[kept] }, event_flags::KEPT);
        sent = 1;
    }
    stat_add(stat::HELD_DISCARDED, (n - sent) as u64);
    let _ = HELD.remove(client);
    event_flags::VIA_NODE
}

/// One held event into the ring buffer with `flags`.
#[inline(always)]
fn send_copy(src: *const PacketEvent, flags: u8) {
    let Some(mut entry) = EVENTS.reserve::<PacketEvent>(0) else {
        stat_inc(stat::RINGBUF_FULL);
        return;
    };
    let ev = entry.as_mut_ptr();
    // SAFETY: the reservation is sizeof(PacketEvent) bytes, ours until
    // submit; the slot was filled completely by `fill`.
    unsafe {
        core::ptr::copy_nonoverlapping(src, ev, 1);
        (*ev).flags = flags;
    }
    entry.submit(wakeup_flag());
    stat_inc(stat::EVENTS);
}
