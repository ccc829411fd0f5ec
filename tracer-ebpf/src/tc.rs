//! tc programs on the interfaces of the traced node namespace (tcx links, or
//! clsact filters on kernels < 6.6). They read the frame with direct packet
//! access and never change traffic.
use aya_ebpf::{bindings::TC_ACT_UNSPEC, macros::classifier, programs::TcContext};
use network_types::{
    eth::{EthHdr, EtherType},
    ip::{Ipv4Hdr, Ipv6Hdr},
    tcp::TcpHdr,
};
use tracer_common::{hook, icmp, proto};

use crate::{
    emit::{Packet, Point},
    filter::{UDP_HDR_LEN, ipv6_l4, observe},
    packet::{NOT_TRACED, icmpv6_at},
};

// TC_ACT_UNSPEC (-1) is also TCX_NEXT: "continue with the next program".
// TC_ACT_PIPE / TC_ACT_OK would end a tcx chain and skip the programs
// (e.g. a CNI's) attached after us.
#[classifier]
pub fn tc_ingress(ctx: TcContext) -> i32 {
    let _ = try_tc(&ctx, hook::TC_INGRESS);
    TC_ACT_UNSPEC
}

#[classifier]
pub fn tc_egress(ctx: TcContext) -> i32 {
    let _ = try_tc(&ctx, hook::TC_EGRESS);
    TC_ACT_UNSPEC
}

#[inline(always)]
fn try_tc(ctx: &TcContext, hook: u8) -> Result<(), ()> {
    let data = ctx.data();
    let end = ctx.data_end();
    if data + EthHdr::LEN + Ipv4Hdr::LEN > end {
        return Err(());
    }
    let eth = unsafe { &*(data as *const EthHdr) };
    // EtherType's discriminants are already in network order.
    let mut pkt = if eth.ether_type == EtherType::Ipv4 as u16 {
        ipv4(ctx, data, end)?
    } else if eth.ether_type == EtherType::Ipv6 as u16 {
        let mut pkt = Packet::default();
        // An ICMPv6 error is parsed here, not under ipv6(): 6.1's verifier
        // rounds each frame up to 32 bytes and refused tc_ingress with
        // icmp::v6's frame stacked under ipv6()'s ("combined stack size of
        // 3 calls is 544", 320 + 96 + 128); as siblings each chain fits.
        let l3_len = ipv6(ctx, &mut pkt);
        if l3_len == NOT_TRACED {
            return Err(());
        }
        if l3_len != 0 {
            crate::icmp::v6(&crate::icmp::Tc(ctx), (l3_len & 0x7ff) as usize, &mut pkt)?;
        }
        pkt
    } else {
        return Err(());
    };
    let mut at = Point::new(hook);
    // In tc the context pointer is the kernel's sk_buff (the __sk_buff view
    // is a rewrite of field accesses), so this is the same identity the
    // tracepoints and netfilter programs report. Storing it needs
    // allow_ptr_leaks, i.e. a privileged loader, which we are.
    at.skb = ctx.skb.skb as u64;
    at.ifindex = unsafe { (*ctx.skb.skb).ifindex };
    observe(&mut pkt, &mut at, |_, _| true);
    Ok(())
}

/// Reads ports (and TCP's fields) and the payload's first 4 bytes from the
/// L4 header at `l4`, if the packet data holds it.
#[inline(always)]
fn l4_fields(pkt: &mut Packet, l4: usize, end: usize) -> Result<(), ()> {
    let l4_len = if pkt.proto == proto::TCP {
        if l4 + TcpHdr::LEN > end {
            return Err(());
        }
        let tcp = unsafe { &*(l4 as *const TcpHdr) };
        pkt.set_tcp(tcp) & 0x3c
    } else {
        if l4 + UDP_HDR_LEN > end {
            return Err(());
        }
        let ports = unsafe { &*(l4 as *const [[u8; 2]; 2]) };
        pkt.set_ports(ports[0], ports[1]);
        UDP_HDR_LEN
    };
    let payload = l4 + l4_len;
    if payload + 4 <= end {
        pkt.payload_head = u32::from_be_bytes(unsafe { *(payload as *const [u8; 4]) });
    }
    Ok(())
}

#[inline(always)]
fn ipv4(ctx: &TcContext, data: usize, end: usize) -> Result<Packet, ()> {
    let ip = unsafe { &*((data + EthHdr::LEN) as *const Ipv4Hdr) };
    let Some((mut pkt, ihl)) = Packet::from_ipv4(ip) else {
        // Only ICMP pays for the quote's read (icmp.rs).
        if ip.proto != icmp::PROTO_ICMP {
            return Err(());
        }
        let mut pkt = Packet::default();
        crate::icmp::v4(&crate::icmp::Tc(ctx), &mut pkt)?;
        return Ok(pkt);
    };
    // Masking keeps the offset provably bounded (<= 60) for the verifier.
    let l4 = data + EthHdr::LEN + (ihl & 0x3c);
    l4_fields(&mut pkt, l4, end)?;
    Ok(pkt)
}

/// IPv6 with TCP/UDP right after the fixed header (nearly all traffic) is
/// read in place; extension headers are walked with bpf_skb_load_bytes,
/// whose bounds the helper checks, since their lengths would have to be
/// proven to the verifier one by one. Not inlined, and filling the caller's
/// `pkt`: inlined, LLVM duplicated the filter and event path per family.
/// Returns 0 for a TCP/UDP packet parsed into `pkt`, [`NOT_TRACED`], or
/// [`crate::packet::ICMPV6_AT`] with the ICMPv6 message's offset in the low bits for the
/// caller to parse (a u64, not a 16-byte Result: see skb.rs parse_ipv6).
#[inline(never)]
fn ipv6(ctx: &TcContext, pkt: &mut Packet) -> u64 {
    let data = ctx.data();
    let end = ctx.data_end();
    let l3 = data + EthHdr::LEN;
    if l3 + Ipv6Hdr::LEN > end {
        return NOT_TRACED;
    }
    let ip = unsafe { &*(l3 as *const Ipv6Hdr) };
    if ip.vcf[0] >> 4 != 6 {
        return NOT_TRACED;
    }
    let Some((l4_proto, l3_len)) = ipv6_l4(ip.next_hdr, |at| {
        ctx.load::<[u8; 8]>(EthHdr::LEN + at).map_err(|_| ())
    }) else {
        return NOT_TRACED;
    };
    // After extension headers the L4 header is at a data-dependent offset:
    // bounded (and masked, so the verifier sees the bound) for direct access.
    if l3_len > 0x7ff {
        return NOT_TRACED;
    }
    if l4_proto == icmp::PROTO_ICMPV6 {
        return icmpv6_at(l3_len);
    }
    *pkt = Packet::from_ipv6(ip, l4_proto);
    let l4 = l3 + (l3_len & 0x7ff);
    match l4_fields(pkt, l4, end) {
        Ok(()) => 0,
        Err(()) => NOT_TRACED,
    }
}
