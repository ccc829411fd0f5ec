//! What an event is made of (the packet, where it was seen) and how it
//! leaves the kernel: the ring buffer and the per-CPU counters. The Service
//! filter (`filter.rs`) and the per-flow buffer (`held.rs`) both emit
//! through here.
use aya_ebpf::helpers::bpf_ktime_get_ns;
use tracer_common::{PacketEvent, stat};

// Where they were defined before icmp.rs (which fills an event from them)
// needed them without emit.rs.
pub use crate::packet::{Packet, copy_addr};

use crate::{EVENTS, STATS};

/// Where a packet was seen. No implicit padding: it is passed by pointer to
/// a global function (filter.rs `judge`), and the verifier refuses to pass
/// stack memory with an uninitialised byte (kernel/bpf/verifier.c
/// `check_stack_range_initialized`).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Point {
    pub hook: u8,
    pub nf_hook: u8,
    pub nat_stage: u8,
    /// 1: this NAT hook's BEFORE and AFTER points are both observed in
    /// this program run (netfilter.rs `try_netfilter_nat`), which follows
    /// rule 4 from the BEFORE point's match itself: no INFLIGHT entry is
    /// written at BEFORE nor looked up at AFTER.
    pub nat_pair: u8,
    _pad: [u8; 4],
    /// Kernel address of the sk_buff (0 if unknown).
    pub skb: u64,
    pub netns: u32,
    pub ifindex: u32,
    pub drop_reason: u32,
    _pad2: u32,
}

impl Point {
    #[inline(always)]
    pub fn new(hook: u8) -> Point {
        Point {
            hook,
            nf_hook: tracer_common::nf_hook::NONE,
            ..Default::default()
        }
    }
}

#[inline(always)]
pub fn stat_inc(index: u32) {
    if let Some(counter) = STATS.get_ptr_mut(index) {
        // Per-CPU slot: no other writer while this program runs on this CPU.
        unsafe { *counter += 1 };
    }
}

#[inline(always)]
pub fn stat_add(index: u32, n: u64) {
    if let Some(counter) = STATS.get_ptr_mut(index) {
        unsafe { *counter += n };
    }
}

/// Written in place in the ring buffer: a 128-bit-address event on the
/// stack next to the packet and the map keys would pass the 512-byte BPF
/// stack limit.
#[inline(always)]
pub fn emit(pkt: &Packet, at: &Point, dir: u8, svc: u8, flags: u8, good: u32) {
    let Some(mut entry) = EVENTS.reserve::<PacketEvent>(0) else {
        stat_inc(stat::RINGBUF_FULL);
        return;
    };
    // SAFETY: bpf_ktime_get_ns has no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    fill(entry.as_mut_ptr(), now, pkt, at, dir, svc, flags);
    // SAFETY: the reservation holds a PacketEvent.
    unsafe { (*entry.as_mut_ptr()).good = good };
    entry.submit(wakeup_flag());
    stat_inc(stat::EVENTS);
}

/// Writes every field of the event at `ev` (a ring-buffer reservation or a
/// `HELD` slot), so no uninitialised bytes reach userspace. `ts_ns` is the
/// caller's clock read: a held event's is the one its entry's age was
/// judged by (one `bpf_ktime_get_ns` per held event, not two).
#[inline(always)]
pub fn fill(
    ev: *mut PacketEvent,
    ts_ns: u64,
    pkt: &Packet,
    at: &Point,
    dir: u8,
    svc: u8,
    flags: u8,
) {
    // SAFETY: `ev` points at sizeof(PacketEvent) bytes the caller owns.
    unsafe {
        (*ev).ts_ns = ts_ns;
        (*ev).skb = at.skb;
        (*ev).netns = at.netns;
        (*ev).ifindex = at.ifindex;
        copy_addr(&raw mut (*ev).saddr, &pkt.saddr);
        copy_addr(&raw mut (*ev).daddr, &pkt.daddr);
        (*ev).sport = pkt.sport;
        (*ev).dport = pkt.dport;
        (*ev).seq = pkt.seq;
        (*ev).ack = pkt.ack;
        (*ev).drop_reason = at.drop_reason;
        (*ev).payload_head = pkt.payload_head;
        (*ev).ip_len = pkt.ip_len;
        (*ev).ip_id = pkt.ip_id;
        (*ev).hook = at.hook;
        (*ev).nf_hook = at.nf_hook;
        (*ev).nat_stage = at.nat_stage;
        (*ev).proto = pkt.proto;
        (*ev).tcp_flags = pkt.tcp_flags;
        (*ev).direction = dir;
        (*ev).svc = svc;
        (*ev).flags = flags;
        (*ev).good = 0;
        (*ev)._reserved = 0;
    }
    if !crate::icmp::fill(ev, pkt) {
        stat_inc(stat::READ_ERRORS);
    }
}

const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;
const BPF_RB_AVAIL_DATA: u64 = 0;
const BPF_RB_RING_SIZE: u64 = 1;

/// A wakeup per event costs an irq_work and a reader context switch each;
/// the reader polls every few ms anyway, so only a filling buffer wakes it.
#[inline(always)]
pub fn wakeup_flag() -> u64 {
    let avail = EVENTS.query(BPF_RB_AVAIL_DATA);
    let size = EVENTS.query(BPF_RB_RING_SIZE);
    if avail >= size / 4 {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    }
}
