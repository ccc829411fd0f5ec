//! What an event is made of (the packet, where it was seen) and how it
//! leaves the kernel: the ring buffer and the per-CPU counters. The Service
//! filter (`filter.rs`) and the per-flow buffer (`held.rs`) both emit
//! through here.
use aya_ebpf::helpers::bpf_ktime_get_ns;
use network_types::{
    ip::{Ipv4Hdr, Ipv6Hdr},
    tcp::TcpHdr,
};
use tracer_common::{Addr, PacketEvent, addr_from_bytes, proto, stat, v4_mapped};

use crate::{EVENTS, STATS};

/// What every observation point extracts from a packet.
#[derive(Clone, Copy, Default)]
pub struct Packet {
    pub saddr: Addr,
    pub daddr: Addr,
    pub sport: u16,
    pub dport: u16,
    pub seq: u32,
    pub ack: u32,
    pub payload_head: u32,
    pub ip_len: u16,
    pub ip_id: u16,
    pub proto: u8,
    pub tcp_flags: u8,
    /// An ICMP error quoting this packet (icmp.rs): its type, 0 = none.
    /// With the code, these fill what was padding.
    pub icmp_type: u8,
    pub icmp_code: u8,
}

impl Packet {
    /// L3 fields of an IPv4 TCP/UDP first fragment, and the header length in
    /// bytes; None for anything we do not trace.
    #[inline(always)]
    pub fn from_ipv4(ip: &Ipv4Hdr) -> Option<(Packet, usize)> {
        let ihl = ((ip.vihl & 0x0f) as usize) * 4;
        if ip.vihl >> 4 != 4 || ihl < Ipv4Hdr::LEN {
            return None;
        }
        // Non-first fragments carry no L4 header.
        if (u16::from_be_bytes(ip.frags) & 0x1fff) != 0 {
            return None;
        }
        if ip.proto != proto::TCP && ip.proto != proto::UDP {
            return None;
        }
        let pkt = Packet {
            saddr: v4_mapped(ip.src_addr),
            daddr: v4_mapped(ip.dst_addr),
            ip_len: u16::from_be_bytes(ip.tot_len),
            ip_id: u16::from_be_bytes(ip.id),
            proto: ip.proto,
            ..Default::default()
        };
        Some((pkt, ihl))
    }

    /// L3 fields of an IPv6 packet whose TCP/UDP header is `l4` (see
    /// [`ipv6_l4`]). `ip_len` is the IPv4-style total length (the fixed
    /// header plus its payload length), so both families read alike.
    #[inline(always)]
    pub fn from_ipv6(ip: &Ipv6Hdr, l4: u8) -> Packet {
        Packet {
            saddr: addr_from_bytes(ip.src_addr),
            daddr: addr_from_bytes(ip.dst_addr),
            ip_len: u16::from_be_bytes(ip.payload_len).saturating_add(Ipv6Hdr::LEN as u16),
            proto: l4,
            ..Default::default()
        }
    }

    #[inline(always)]
    pub fn set_ports(&mut self, sport: [u8; 2], dport: [u8; 2]) {
        self.sport = u16::from_be_bytes(sport);
        self.dport = u16::from_be_bytes(dport);
    }

    /// Returns the TCP header length (where the payload starts).
    #[inline(always)]
    pub fn set_tcp(&mut self, tcp: &TcpHdr) -> usize {
        self.set_ports(tcp.source, tcp.dest);
        self.seq = u32::from_be_bytes(tcp.seq);
        self.ack = u32::from_be_bytes(tcp.ack_seq);
        // network-types exposes the data offset and flags as a bindgen
        // bitfield with one accessor per flag; the two bytes as on the wire
        // (data offset << 4, then the flags byte) are cheaper to take whole.
        // SAFETY: BitfieldU16 is #[repr(C)] around a single [u8; 2].
        let raw: [u8; 2] = unsafe { core::mem::transmute(tcp._bitfield_1) };
        self.tcp_flags = raw[1];
        ((raw[0] >> 4) as usize) * 4
    }
}

/// Where a packet was seen.
#[derive(Clone, Copy, Default)]
pub struct Point {
    pub hook: u8,
    pub nf_hook: u8,
    pub nat_stage: u8,
    /// Kernel address of the sk_buff (0 if unknown).
    pub skb: u64,
    pub netns: u32,
    pub ifindex: u32,
    pub drop_reason: u32,
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
    fill(entry.as_mut_ptr(), pkt, at, dir, svc, flags);
    // SAFETY: the reservation holds a PacketEvent.
    unsafe { (*entry.as_mut_ptr()).good = good };
    entry.submit(wakeup_flag());
    stat_inc(stat::EVENTS);
}

/// Word by word, volatile: into a map value (a `HELD` slot) LLVM cannot
/// rule out overlap and emits a call to `memmove`, a BPF-to-BPF call whose
/// frame pushed 6.1's combined stack limit past 512 bytes (kprobe programs).
#[inline(always)]
pub fn copy_addr(dst: *mut tracer_common::Addr, src: &tracer_common::Addr) {
    let dst = dst.cast::<u32>();
    for (i, w) in src.iter().enumerate() {
        // SAFETY: `dst` points at an Addr, four u32 words.
        unsafe { core::ptr::write_volatile(dst.add(i), *w) };
    }
}

/// Writes every field of the event at `ev` (a ring-buffer reservation or a
/// `HELD` slot), so no uninitialised bytes reach userspace.
#[inline(always)]
pub fn fill(ev: *mut PacketEvent, pkt: &Packet, at: &Point, dir: u8, svc: u8, flags: u8) {
    // SAFETY: `ev` points at sizeof(PacketEvent) bytes the caller owns.
    unsafe {
        (*ev).ts_ns = bpf_ktime_get_ns();
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
    crate::icmp::fill(ev, pkt.icmp_type, pkt.icmp_code);
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
