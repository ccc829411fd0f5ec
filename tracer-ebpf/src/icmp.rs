//! ICMP and ICMPv6 errors about a traced flow (issue 23): "fragmentation
//! needed" / "packet too big" from a link too small for the flow's
//! packets, "port unreachable" from kube-proxy's REJECT, "host
//! unreachable" from a failed neighbour. An error quotes the offending
//! packet's IP header and the first bytes of its TCP/UDP header; the quoted
//! packet is what the filter matches (a request quoted as client → backend
//! before conntrack translates the error back, client → Service after), so
//! the error becomes an event of the flow it is about. The quote's
//! addresses, ports and seq fill the [`Packet`]; the type, code and MTU,
//! and who sent the error, travel beside it.
//!
//! Only packets whose protocol is ICMP/ICMPv6 get here (skb.rs and tc.rs
//! call in where TCP/UDP parsing gives up), so other packets pay nothing.
//! Echo, redirects, neighbour discovery and every other informational type
//! stop at the first read.
use core::ffi::c_void;

use aya_ebpf::{
    helpers::generated::{bpf_probe_read_kernel, bpf_skb_load_bytes},
    macros::map,
    maps::PerCpuArray,
    programs::TcContext,
};
use network_types::{
    eth::EthHdr,
    ip::{Ipv4Hdr, Ipv6Hdr},
};
use tracer_common::{
    Addr, PacketEvent, addr_from_bytes,
    icmp::{self, is_error_v4, is_error_v6},
    proto, v4_mapped,
};

use crate::packet::{Packet, copy_addr};

/// Bytes of the error read at once: the ICMPv6 header, the quoted IPv6
/// header and 8 bytes of its L4 header (the largest quote read).
const QUOTE_LEN: usize = 8 + Ipv6Hdr::LEN + 8;

/// What an ICMP event carries besides the [`Packet`], and the buffer its
/// quote is read into. In a per-CPU map, not on the stack: this parse
/// runs as a BPF-to-BPF call below programs whose own frames leave it
/// little of the verifier's 512-byte combined limit (a tc program's 288
/// bytes plus a first, stack-reading version's 280 were refused). Written
/// by the parser and read by `fill` in the same program run (per-CPU, and
/// a program is not migrated while it runs). A run can still be
/// interrupted on its CPU between the two by another that parses an ICMP
/// error too (a netfilter program at LOCAL_OUT runs with softirqs on; a
/// drop's tracepoint may fire in a hard interrupt): `quote` names the
/// quoted packet whose parse the value holds ([`quote_key`]), so `fill`
/// never gives one packet another's sender and MTU.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IcmpScratch {
    pub from: Addr,
    pub mtu: u32,
    pub quote: u64,
    pub buf: [u8; QUOTE_LEN],
}

#[map]
static ICMP_SCRATCH: PerCpuArray<IcmpScratch> = PerCpuArray::with_max_entries(1, 0);

/// Reads `len` bytes at an offset from the start of the outer IP header
/// into `dst`: from the kernel's copy (`bpf_probe_read_kernel`) or the tc
/// packet (`bpf_skb_load_bytes`, bounds checked by the helper).
pub trait Quote {
    fn read(&self, off: usize, dst: *mut u8, len: u32) -> Result<(), ()>;
}

/// The IP header at this kernel address.
pub struct Kernel(pub u64);

impl Quote for Kernel {
    #[inline(always)]
    fn read(&self, off: usize, dst: *mut u8, len: u32) -> Result<(), ()> {
        // SAFETY: the helper checks the source; `dst` holds `len` bytes.
        let r = unsafe {
            bpf_probe_read_kernel(dst.cast(), len, (self.0 + off as u64) as *const c_void)
        };
        if r == 0 { Ok(()) } else { Err(()) }
    }
}

/// The IP header right after the Ethernet header of a tc packet.
pub struct Tc<'a>(pub &'a TcContext);

impl Quote for Tc<'_> {
    #[inline(always)]
    fn read(&self, off: usize, dst: *mut u8, len: u32) -> Result<(), ()> {
        // SAFETY: the helper checks the packet bounds; `dst` holds `len` bytes.
        let r = unsafe {
            bpf_skb_load_bytes(
                self.0.skb.skb as *const c_void,
                (EthHdr::LEN + off) as u32,
                dst.cast(),
                len,
            )
        };
        if r == 0 { Ok(()) } else { Err(()) }
    }
}

/// What names a parse's quoted packet in the scratch: the error's type and
/// code, the quote's TCP sequence number, IP ID, length and protocol. Not
/// its addresses or ports: the kprobe backend rewrites them in place between
/// a NAT pair's two events (kprobes.rs `emit_pair`). Not the skb: carrying
/// it into the parsers grew the `kfree_skb` program's frame past 6.1's
/// combined stack limit.
#[inline(always)]
fn quote_key(pkt: &Packet) -> u64 {
    (u64::from(pkt.seq) << 32)
        ^ (u64::from(pkt.ip_id) << 16)
        ^ u64::from(pkt.ip_len)
        ^ (u64::from(pkt.icmp_type) << 56)
        ^ (u64::from(pkt.icmp_code) << 48)
        ^ (u64::from(pkt.proto) << 40)
}

/// A small read onto the stack.
#[inline(always)]
fn small<Q: Quote, const N: usize>(q: &Q, off: usize) -> Result<[u8; N], ()> {
    let mut b = [0u8; N];
    q.read(off, b.as_mut_ptr(), N as u32)?;
    Ok(b)
}

/// ICMP header (type, code, checksum, the 4 type-specific bytes) and the
/// quoted IPv4 header with the first 8 bytes of its L4 header (ports and
/// TCP seq: what RFC 792 guarantees is quoted).
#[repr(C)]
#[derive(Clone, Copy)]
struct V4Quote {
    icmp: [u8; 8],
    ip: Ipv4Hdr,
    l4: [u8; 8],
}

#[repr(C)]
#[derive(Clone, Copy)]
struct V6Quote {
    icmp: [u8; 8],
    ip: Ipv6Hdr,
    l4: [u8; 8],
}

const _: () = assert!(size_of::<V6Quote>() == QUOTE_LEN && size_of::<V4Quote>() <= QUOTE_LEN);

/// An IPv4 ICMP error at the outer IPv4 header `q` (proto 1, checked by the
/// caller). Fills `pkt`, which must be `Packet::default()`, with the quoted
/// packet.
#[inline(never)]
pub fn v4<Q: Quote>(q: &Q, pkt: &mut Packet) -> Result<(), ()> {
    let s = ICMP_SCRATCH.get_ptr_mut(0).ok_or(())?;
    // vihl, tos, tot_len, id, frags.
    let outer = small::<Q, 8>(q, 0)?;
    let ihl = ((outer[0] & 0x0f) as usize) * 4;
    if ihl < Ipv4Hdr::LEN || u16::from_be_bytes([outer[6], outer[7]]) & 0x1fff != 0 {
        return Err(());
    }
    // SAFETY: the per-CPU scratch value, this run's; V4Quote is bytes.
    let h = unsafe {
        q.read(
            ihl & 0x3c,
            (*s).buf.as_mut_ptr(),
            size_of::<V4Quote>() as u32,
        )?;
        &*((*s).buf.as_ptr() as *const V4Quote)
    };
    let t = h.icmp[0];
    if !is_error_v4(t) {
        return Err(());
    }
    let inner_ihl = ((h.ip.vihl & 0x0f) as usize) * 4;
    if h.ip.vihl >> 4 != 4
        || inner_ihl < Ipv4Hdr::LEN
        || u16::from_be_bytes(h.ip.frags) & 0x1fff != 0
        || (h.ip.proto != proto::TCP && h.ip.proto != proto::UDP)
    {
        return Err(());
    }
    pkt.saddr = v4_mapped(h.ip.src_addr);
    pkt.daddr = v4_mapped(h.ip.dst_addr);
    pkt.ip_len = u16::from_be_bytes(h.ip.tot_len);
    pkt.ip_id = u16::from_be_bytes(h.ip.id);
    pkt.proto = h.ip.proto;
    pkt.icmp_type = t;
    pkt.icmp_code = h.icmp[1];
    let mtu = if t == icmp::V4_DEST_UNREACH && h.icmp[1] == icmp::V4_FRAG_NEEDED {
        u32::from(u16::from_be_bytes([h.icmp[6], h.icmp[7]]))
    } else {
        0
    };
    let l4_at = (ihl & 0x3c) + 8 + (inner_ihl & 0x3c);
    let l4 = if inner_ihl == Ipv4Hdr::LEN {
        h.l4
    } else {
        small::<Q, 8>(q, l4_at)?
    };
    let avail = (u16::from_be_bytes([outer[2], outer[3]]) as usize).saturating_sub(ihl);
    quoted_l4(q, pkt, l4, l4_at, avail, 8 + inner_ihl);
    let src = small::<Q, 4>(q, 12)?;
    // SAFETY: as above.
    unsafe {
        copy_addr(&raw mut (*s).from, &v4_mapped(src));
        (*s).mtu = mtu;
        (*s).quote = quote_key(pkt);
    }
    Ok(())
}

/// An ICMPv6 error whose ICMPv6 header is `l3_len` bytes after the outer
/// IPv6 header `q`; `pkt` must be `Packet::default()`. A quoted packet with
/// extension headers before its TCP/UDP header is not followed (a
/// fragment's or routing header's quote): nodes a Service's traffic
/// crosses quote plain TCP/UDP.
#[inline(never)]
pub fn v6<Q: Quote>(q: &Q, l3_len: usize, pkt: &mut Packet) -> Result<(), ()> {
    if l3_len > 0x7ff {
        return Err(());
    }
    let s = ICMP_SCRATCH.get_ptr_mut(0).ok_or(())?;
    let at = l3_len & 0x7ff;
    // SAFETY: the per-CPU scratch value, this run's; V6Quote is bytes.
    let h = unsafe {
        q.read(at, (*s).buf.as_mut_ptr(), QUOTE_LEN as u32)?;
        &*((*s).buf.as_ptr() as *const V6Quote)
    };
    let t = h.icmp[0];
    if !is_error_v6(t) {
        return Err(());
    }
    let next = h.ip.next_hdr;
    if next != proto::TCP && next != proto::UDP {
        return Err(());
    }
    pkt.saddr = addr_from_bytes(h.ip.src_addr);
    pkt.daddr = addr_from_bytes(h.ip.dst_addr);
    pkt.ip_len = u16::from_be_bytes(h.ip.payload_len).saturating_add(Ipv6Hdr::LEN as u16);
    pkt.proto = next;
    pkt.icmp_type = t;
    pkt.icmp_code = h.icmp[1];
    let mtu = if t == icmp::V6_PACKET_TOO_BIG {
        u32::from_be_bytes([h.icmp[4], h.icmp[5], h.icmp[6], h.icmp[7]])
    } else {
        0
    };
    // The outer header's payload length.
    let outer_len = small::<Q, 2>(q, 4)?;
    let avail = (u16::from_be_bytes(outer_len) as usize + Ipv6Hdr::LEN).saturating_sub(at);
    // Read from the scratch value after the call above, not kept across it.
    quoted_l4(q, pkt, h.l4, at + 8 + Ipv6Hdr::LEN, avail, 8 + Ipv6Hdr::LEN);
    // SAFETY: as above; the outer source is read straight into place.
    unsafe {
        q.read(8, (&raw mut (*s).from).cast(), 16)?;
        (*s).mtu = mtu;
        (*s).quote = quote_key(pkt);
    }
    Ok(())
}

/// Ports (and TCP's seq) from the guaranteed 8 bytes; TCP's ack and flags
/// too when the error quotes them (Linux quotes up to 576 bytes of IPv4,
/// 1280 of IPv6: icmp_send, icmp6_send), so the quoted packet reads as the
/// same packet the flow's other events show.
#[inline(always)]
fn quoted_l4<Q: Quote>(
    q: &Q,
    pkt: &mut Packet,
    l4: [u8; 8],
    l4_at: usize,
    avail: usize,
    l4_in_icmp: usize,
) {
    pkt.set_ports([l4[0], l4[1]], [l4[2], l4[3]]);
    if pkt.proto != proto::TCP {
        return;
    }
    pkt.seq = u32::from_be_bytes([l4[4], l4[5], l4[6], l4[7]]);
    if avail >= l4_in_icmp + 16
        && let Ok(rest) = small::<Q, 8>(q, l4_at + 8)
    {
        pkt.ack = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]);
        pkt.tcp_flags = rest[5];
    }
}

/// The ICMP fields of an event (`fill`): the type and code come with the
/// packet, the MTU and sender from this run's parse, copied from the map
/// straight into the event. When a run that interrupted this one parsed
/// another packet's error in between, the sender and MTU are left 0 and it
/// returns false (the caller counts a read error): the quoted tuple, in the
/// packet, is still right. Inlined: every event path fills within
/// filter.rs's `judge` or held.rs, and a frame of its own, rounded to 32
/// bytes by 6.1, passed the combined stack limit under `judge`.
#[inline(always)]
pub fn fill(ev: *mut PacketEvent, pkt: &Packet) -> bool {
    let (icmp_type, icmp_code) = (pkt.icmp_type, pkt.icmp_code);
    // SAFETY: `ev` points at a PacketEvent the caller owns.
    unsafe {
        (*ev).icmp_type = icmp_type;
        (*ev).icmp_code = icmp_code;
        (*ev)._icmp_pad = 0;
    }
    let scratch = if icmp_type != 0 {
        // SAFETY: this CPU's scratch value.
        ICMP_SCRATCH
            .get_ptr(0)
            .filter(|e| unsafe { (**e).quote } == quote_key(pkt))
    } else {
        None
    };
    let ours = icmp_type == 0 || scratch.is_some();
    // SAFETY: as above; the scratch value is this run's.
    unsafe {
        match scratch {
            Some(e) => {
                copy_addr(&raw mut (*ev).icmp_from, &(*e).from);
                (*ev).icmp_mtu = (*e).mtu;
            }
            None => {
                copy_addr(&raw mut (*ev).icmp_from, &[0; 4]);
                (*ev).icmp_mtu = 0;
            }
        }
    }
    ours
}
