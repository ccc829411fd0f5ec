//! What every observation point extracts from a packet, below both the
//! emitting (`emit.rs`) and the ICMP quote parsing (`icmp.rs`) that fill an
//! event from it.
use network_types::{
    ip::{Ipv4Hdr, Ipv6Hdr},
    tcp::TcpHdr,
};
use tracer_common::{Addr, addr_from_bytes, proto, v4_mapped};

/// The IPv6 parsers' (tc.rs `ipv6`, skb.rs `parse_ipv6`) "not a packet we
/// trace".
pub const NOT_TRACED: u64 = u64::MAX;
/// The IPv6 parsers' "an ICMPv6 message at this offset" (low 11 bits): the
/// caller parses it beside the parser, so that icmp.rs's frame is not stacked
/// under the parser's (6.1's verifier limits the deepest chain of calls to
/// 512 bytes in all, each frame rounded up to 32).
pub const ICMPV6_AT: u64 = u64::MAX << 16;

/// [`ICMPV6_AT`] for the message at `l3_len`.
#[inline(always)]
pub fn icmpv6_at(l3_len: usize) -> u64 {
    ICMPV6_AT | (l3_len as u64 & 0x7ff)
}

const _: () = assert!(size_of::<Packet>() == 56);

/// What every observation point extracts from a packet. repr(C) with no
/// padding: passed by pointer to a global function, as emit.rs's `Point`.
#[repr(C)]
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
