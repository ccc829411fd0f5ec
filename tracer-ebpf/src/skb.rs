//! Reading a packet from a kernel `struct sk_buff *` (raw tracepoints,
//! netfilter programs, kprobes). Offsets come from CONFIG, resolved by userspace from
//! the running kernel's BTF: Rust eBPF has no CO-RE, and the layouts differ
//! between kernels (sk_buff.head: 192 bytes on 6.18, 200 on 6.1/6.12).
use aya_ebpf::helpers::bpf_probe_read_kernel;
use tracer_common::{Config, KernelOffsets, proto, stat};

use crate::{
    CONFIG,
    filter::{IpHdr, Packet, TcpHdr, UDP_HDR_LEN, stat_inc},
};

/// Where the IPv4 header of this skb is at this observation point.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum L3 {
    /// `skb->data` (receive path before the network header is reset).
    Data,
    /// `skb->head + skb->network_header` (transmit, netfilter, drops).
    NetworkHeader,
}

/// `skb->network_header` when never set (`(typeof(skb->network_header))~0U`).
const UNSET_HEADER: u16 = 0xffff;

#[inline(always)]
pub fn read<T>(addr: u64) -> Result<T, ()> {
    // bpf_probe_read_kernel tolerates any address: a bad one is an error, not a fault.
    unsafe { bpf_probe_read_kernel(addr as *const T) }.map_err(|_| ())
}

#[inline(always)]
pub fn config() -> Option<&'static Config> {
    CONFIG.get(0)
}

#[inline(always)]
pub fn offsets() -> Option<&'static KernelOffsets> {
    config().map(|c| &c.offsets)
}

/// `dev->ifindex` and the inode of `dev_net(dev)`; zeros when `dev` is NULL.
#[inline(always)]
pub fn dev_info(dev: u64, off: &KernelOffsets) -> (u32, u32) {
    if dev == 0 {
        return (0, 0);
    }
    let ifindex = read::<u32>(dev + off.net_device_ifindex as u64).unwrap_or(0);
    // possible_net_t is a struct holding just the `struct net *`.
    let net = read::<u64>(dev + off.net_device_nd_net as u64).unwrap_or(0);
    let inum = if net != 0 {
        read::<u32>(net + off.net_ns_inum as u64).unwrap_or(0)
    } else {
        0
    };
    (ifindex, inum)
}

#[inline(always)]
pub fn skb_dev(skb: u64, off: &KernelOffsets) -> u64 {
    read::<u64>(skb + off.sk_buff_dev as u64).unwrap_or(0)
}

/// Parses the IPv4 + TCP/UDP headers of `skb`. Err(()) = not a packet we
/// trace (or unreadable, which is counted in STATS[READ_ERRORS]).
#[inline(always)]
pub fn parse(skb: u64, off: &KernelOffsets, l3: L3) -> Result<Packet, ()> {
    let ip_addr = match l3 {
        L3::Data => read::<u64>(skb + off.sk_buff_data as u64).map_err(read_error)?,
        L3::NetworkHeader => {
            let head = read::<u64>(skb + off.sk_buff_head as u64).map_err(read_error)?;
            let nh = read::<u16>(skb + off.sk_buff_network_header as u64).map_err(read_error)?;
            if nh == UNSET_HEADER {
                return Err(());
            }
            head + nh as u64
        }
    };
    if ip_addr == 0 {
        return Err(());
    }
    parse_ip(ip_addr)
}

#[inline(always)]
fn read_error(_: ()) {
    stat_inc(stat::READ_ERRORS);
}

#[inline(always)]
fn parse_ip(ip_addr: u64) -> Result<Packet, ()> {
    let ip = read::<IpHdr>(ip_addr).map_err(read_error)?;
    let (mut pkt, ihl) = Packet::from_ip(&ip).ok_or(())?;
    let l4 = ip_addr + ihl as u64;
    let l4_len = if pkt.proto == proto::TCP {
        let tcp = read::<TcpHdr>(l4).map_err(read_error)?;
        pkt.set_tcp(&tcp)
    } else {
        let ports = read::<[[u8; 2]; 2]>(l4).map_err(read_error)?;
        pkt.set_ports(ports[0], ports[1]);
        UDP_HDR_LEN
    };
    // Only when the IP length says there is a payload: otherwise these bytes
    // are whatever follows the packet in memory.
    if (pkt.ip_len as usize) >= ihl + l4_len + 4 {
        pkt.payload_head = read::<[u8; 4]>(l4 + l4_len as u64)
            .map(u32::from_be_bytes)
            .unwrap_or(0);
    }
    Ok(pkt)
}
