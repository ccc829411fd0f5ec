//! tc programs on the interfaces of the traced node namespace (tcx links, or
//! clsact filters on kernels < 6.6). They read the frame with direct packet
//! access and never change traffic.
use aya_ebpf::{bindings::TC_ACT_UNSPEC, macros::classifier, programs::TcContext};
use tracer_common::{hook, proto};

use crate::filter::{IpHdr, Packet, Point, TcpHdr, UDP_HDR_LEN, observe};

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;

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
    if data + ETH_HLEN + core::mem::size_of::<IpHdr>() > end {
        return Err(());
    }
    let eth_type = unsafe { *((data + 12) as *const [u8; 2]) };
    if u16::from_be_bytes(eth_type) != ETH_P_IP {
        return Err(());
    }
    let ip = unsafe { &*((data + ETH_HLEN) as *const IpHdr) };
    let (mut pkt, ihl) = Packet::from_ip(ip).ok_or(())?;
    // Masking keeps the offset provably bounded (<= 60) for the verifier.
    let l4 = data + ETH_HLEN + (ihl & 0x3c);
    let l4_len = if pkt.proto == proto::TCP {
        if l4 + core::mem::size_of::<TcpHdr>() > end {
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
