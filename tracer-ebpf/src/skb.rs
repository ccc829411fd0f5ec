//! Reading a packet from a kernel `struct sk_buff *` (raw tracepoints,
//! netfilter programs, kprobes). Offsets come from the loader
//! (config.rs `KERNEL_OFFSETS`), resolved from the running kernel's BTF:
//! Rust eBPF has no CO-RE, and the layouts differ between kernels
//! (sk_buff.head: 192 bytes on 6.18, 200 on 6.1/6.12).
use aya_ebpf::{helpers::bpf_probe_read_kernel, macros::map, maps::Array};
use network_types::{
    ip::{Ipv4Hdr, Ipv6Hdr},
    tcp::TcpHdr,
};
use tracer_common::{KernelOffsets, icmp, proto, stat};

use crate::{
    emit::{Packet, stat_inc},
    filter::{UDP_HDR_LEN, ipv6_l4},
    packet::{ICMPV6_AT, NOT_TRACED, icmpv6_at},
};

/// Where the IP header of this skb is at this observation point.
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

/// How a program reads a member of a kernel struct (`sk_buff`,
/// `net_device`, `net`) it holds a pointer to.
pub trait Kmem {
    const DIRECT: bool;
    fn field<T>(base: u64, off: u32) -> Result<T, ()>;
}

/// Through `bpf_probe_read_kernel`: the pointer is a plain number to the
/// verifier (kprobes' registers, raw tracepoints' arguments), or one
/// read that way.
pub struct Probe;

impl Kmem for Probe {
    const DIRECT: bool = false;
    #[inline(always)]
    fn field<T>(base: u64, off: u32) -> Result<T, ()> {
        read::<T>(base + off as u64)
    }
}

/// A plain load (issue 25): the pointer is one the verifier types
/// PTR_TO_BTF_ID (a tp_btf program's `struct sk_buff *` argument, and what
/// a load through it gives: `skb->dev`). It turns the load into a BPF_PROBE_MEM
/// one, an exception-table-guarded load instead of a helper call
/// (`copy_from_kernel_nofault` and its range check, mm/maccess.c). The
/// offset is a constant to it ([`crate::config::offsets`]), and each load
/// must be one member of the struct's BTF (kernel/bpf/btf.c
/// `btf_struct_walk`): hence exact-width volatile loads, which LLVM may
/// not merge or widen. A pointer member to a non-struct (`skb->head`)
/// loads as a plain number on 6.1 and 6.12 and as untrusted memory on 6.18
/// (`parse_ipv6`'s offset says why that matters): the first 40 bytes at the
/// network header are then plain loads too ([`load_head`]), and so are the
/// payload's first four ([`payload_of`]); the rest (options, extension
/// headers) [`Probe`] reads.
pub struct Direct;

impl Kmem for Direct {
    const DIRECT: bool = true;
    #[inline(always)]
    fn field<T>(base: u64, off: u32) -> Result<T, ()> {
        // SAFETY: the verifier accepts only a load inside one member of
        // the struct `base` points to, and makes a faulting one read 0.
        Ok(unsafe { core::ptr::read_volatile((base + off as u64) as *const T) })
    }
}

/// `dev->ifindex` and the inode of `dev_net(dev)`; zeros when `dev` is NULL.
#[inline(always)]
pub fn dev_info<M: Kmem>(dev: u64, off: &KernelOffsets) -> (u32, u32) {
    dev_info_in::<M>(dev, dev_net::<M>(dev, off), off)
}

/// [`dev_info`] with `dev_net(dev)` read already ([`TrustedDev`]).
#[inline(always)]
fn dev_info_in<M: Kmem>(dev: u64, net: u64, off: &KernelOffsets) -> (u32, u32) {
    if dev == 0 {
        return (0, 0);
    }
    let ifindex = M::field::<u32>(dev, off.net_device_ifindex).unwrap_or(0);
    let inum = if net != 0 {
        M::field::<u32>(net, off.net_ns_inum).unwrap_or(0)
    } else {
        0
    };
    (ifindex, inum)
}

/// `dev_net(dev)`: possible_net_t is a struct holding just the `struct net *`.
#[inline(always)]
fn dev_net<M: Kmem>(dev: u64, off: &KernelOffsets) -> u64 {
    if dev == 0 {
        return 0;
    }
    M::field::<u64>(dev, off.net_device_nd_net).unwrap_or(0)
}

/// A tp_btf program's `struct net_device *` argument with its two pointer
/// members loaded once, at the program's entry. The verifier holds that
/// argument trusted, and a pointer loaded through a trusted pointer is
/// checked against vmlinux's `<struct>__safe_trusted`, `__safe_trusted_or_null`,
/// `__safe_rcu` and `__safe_rcu_or_null` types (kernel/bpf/verifier.c
/// `check_ptr_to_btf_access` → kernel/bpf/btf.c `btf_nested_type_is_trusted`),
/// each looked up by `btf_find_by_name_kind`: a linear scan of every type
/// in vmlinux, to its end for a `net_device`, which has none. It costs that
/// at every path the verifier walks to the load, and a load inside the
/// filter's branches is walked on dozens: the scans were 14-17% of the
/// start-up's CPU (`perf record -g`). Loaded before the first branch, it
/// is walked once. What is loaded through the pointers these give is not
/// checked again (they are not trusted).
#[derive(Clone, Copy)]
pub struct TrustedDev {
    pub dev: u64,
    net: u64,
    ops: u64,
}

impl TrustedDev {
    #[inline(always)]
    pub fn load(dev: u64, off: &KernelOffsets) -> Self {
        TrustedDev {
            dev,
            net: dev_net::<Direct>(dev, off),
            ops: link_ops::<Direct>(dev, off),
        }
    }

    #[inline(always)]
    pub fn info(&self, off: &KernelOffsets) -> (u32, u32) {
        dev_info_in::<Direct>(self.dev, self.net, off)
    }

    /// The device that receives what this one transmits, when that
    /// follows from the transmit alone ([`Paired`]); 0 for any other
    /// device, or a veth peer that is gone (`veth_dellink` clears it) or
    /// down (`__dev_forward_skb` drops for it, and that drop is reported).
    /// Read only for a packet that matched: up to five reads. The peer is
    /// read from the veth's private area, past the struct's BTF on 6.1: a
    /// probe read, and a plain number.
    #[inline(always)]
    pub fn receiver(&self, off: &KernelOffsets) -> u64 {
        let dev = self.dev;
        if dev == 0 {
            return 0;
        }
        match paired::<Direct>(dev, || self.ops, off) {
            Paired::Loopback => dev,
            Paired::Other => 0,
            Paired::Veth => {
                let peer_at = dev + off.net_device_priv as u64 + off.veth_priv_peer as u64;
                let peer = read::<u64>(peer_at).unwrap_or(0);
                let up = peer != 0
                    && read::<u32>(peer + off.net_device_flags as u64)
                        .is_ok_and(|f| f & IFF_UP != 0);
                if up { peer } else { 0 }
            }
        }
    }
}

/// `dev->ifindex`, 0 when `dev` is NULL (no need for the namespace).
#[inline(always)]
pub fn dev_ifindex<M: Kmem>(dev: u64, off: &KernelOffsets) -> u32 {
    if dev == 0 {
        return 0;
    }
    M::field::<u32>(dev, off.net_device_ifindex).unwrap_or(0)
}

/// include/uapi/linux/if.h.
const IFF_UP: u32 = 1 << 0;
const IFF_LOOPBACK: u32 = 1 << 3;

/// The devices whose receive follows from their transmit.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Paired {
    /// drivers/net/loopback.c `loopback_xmit` → `__netif_rx` on itself.
    Loopback,
    /// drivers/net/veth.c `veth_xmit` → `veth_forward_skb` → `__netif_rx`
    /// on its peer.
    Veth,
    Other,
}

#[inline(always)]
fn paired<M: Kmem>(dev: u64, ops: impl FnOnce() -> u64, off: &KernelOffsets) -> Paired {
    let flags = M::field::<u32>(dev, off.net_device_flags).unwrap_or(0);
    if flags & IFF_LOOPBACK != 0 {
        return Paired::Loopback;
    }
    // `dev->rtnl_link_ops`.
    let ops = ops();
    if ops == 0 {
        return Paired::Other;
    }
    let known = VETH_OPS.get_ptr_mut(0);
    if let Some(known) = known
        && unsafe { core::ptr::read_volatile(known) } == ops
    {
        return Paired::Veth;
    }
    let kind = M::field::<u64>(ops, off.rtnl_link_ops_kind).unwrap_or(0);
    if kind != 0 && read::<[u8; 5]>(kind) == Ok(*b"veth\0") {
        if let Some(known) = known {
            unsafe { core::ptr::write_volatile(known, ops) };
        }
        Paired::Veth
    } else {
        Paired::Other
    }
}

/// The address of veth's `rtnl_link_ops` (drivers/net/veth.c
/// `veth_link_ops`, one static object for every veth), once a device's
/// `kind` read "veth": later veths are told by that pointer alone, two
/// `bpf_probe_read_kernel` calls fewer (`ops->kind`, then its bytes) at
/// every veth transmit that reports its peer's receive. Learned, not
/// given: /proc/kallsyms lists data symbols only with
/// CONFIG_KALLSYMS_ALL. Written again if veth's module is ever reloaded
/// elsewhere (its ops then fail the compare and are read by name); a
/// module can be unloaded only once no veth is left.
#[map]
static VETH_OPS: Array<u64> = Array::with_max_entries(1, 0);

/// Whether a receive on `dev` was reported at its transmit already
/// ([`TrustedDev::receiver`]): the receive tracepoint, where it is attached for other
/// devices, skips it.
#[inline(always)]
pub fn reported_at_transmit<M: Kmem>(dev: u64, off: &KernelOffsets) -> bool {
    dev != 0 && paired::<M>(dev, || link_ops::<M>(dev, off), off) != Paired::Other
}

#[inline(always)]
fn link_ops<M: Kmem>(dev: u64, off: &KernelOffsets) -> u64 {
    M::field::<u64>(dev, off.net_device_rtnl_link_ops).unwrap_or(0)
}

#[inline(always)]
pub fn skb_dev<M: Kmem>(skb: u64, off: &KernelOffsets) -> u64 {
    M::field::<u64>(skb, off.sk_buff_dev).unwrap_or(0)
}

/// Parses the IPv4/IPv6 + TCP/UDP headers of `skb`: what the filter decides on.
/// Also returns where the payload starts (0 = no payload, or read
/// already: [`payload_of`]), for [`payload_head`] once the packet matched.
/// Err(()) = not a packet we trace (or unreadable, which is counted in
/// STATS[READ_ERRORS]).
#[inline(always)]
pub fn parse<M: Kmem>(skb: u64, off: &KernelOffsets, l3: L3) -> Result<(Packet, u64), ()> {
    let ip_addr = match l3 {
        L3::Data => M::field::<u64>(skb, off.sk_buff_data).map_err(read_error)?,
        L3::NetworkHeader => {
            let (head, nh) = head_and_network_header::<M>(skb, off)?;
            if nh == UNSET_HEADER {
                return Err(());
            }
            head + nh as u64
        }
    };
    if ip_addr == 0 {
        return Err(());
    }
    parse_ip(
        ip_addr,
        M::DIRECT && l3 == L3::NetworkHeader && off.head_is_mem != 0,
    )
}

/// `skb->head` and `skb->network_header`. They are a few bytes apart in
/// every sk_buff since the headers group (only `mac_header` and, with
/// CONFIG_KCOV, `kcov_handle`, `tail` and `end` lie between; btf.rs's
/// offsets test checks it on the running kernel), so one 32-byte read from
/// the word holding network_header covers both: one
/// bpf_probe_read_kernel instead of two on every miss at a netfilter hook,
/// transmit or drop (each call pays `copy_from_kernel_nofault` and its
/// `copy_from_kernel_nofault_allowed` check, mm/maccess.c, which the miss
/// path's profile showed). Two reads on a layout where they are further
/// apart, and two plain loads where the pointer is a BTF one ([`Direct`]).
#[inline(always)]
fn head_and_network_header<M: Kmem>(skb: u64, off: &KernelOffsets) -> Result<(u64, u16), ()> {
    if M::DIRECT {
        let head = M::field::<u64>(skb, off.sk_buff_head)?;
        let nh = M::field::<u16>(skb, off.sk_buff_network_header)?;
        return Ok((head, nh));
    }
    let nh_off = off.sk_buff_network_header as u64;
    let head_off = off.sk_buff_head as u64;
    let base = nh_off & !7;
    if head_off >= base && head_off + 8 <= base + 32 && head_off & 7 == 0 {
        let w = read::<[u64; 4]>(skb + base).map_err(read_error)?;
        // Constant indexes: a variable one would be a variable-offset stack
        // read, which older verifiers refuse.
        let head = match (head_off - base) >> 3 {
            0 => w[0],
            1 => w[1],
            2 => w[2],
            _ => w[3],
        };
        // Little-endian BPF: the u16 at byte b of a word is its bits 8b..8b+16.
        let nh = (w[0] >> ((nh_off & 7) * 8)) as u16;
        return Ok((head, nh));
    }
    let head = read::<u64>(skb + head_off).map_err(read_error)?;
    let nh = read::<u16>(skb + nh_off).map_err(read_error)?;
    Ok((head, nh))
}

/// IPv4 header without options followed by a TCP header: one read covers
/// both for nearly every IPv4 packet.
#[repr(C)]
#[derive(Clone, Copy)]
struct Headers {
    ip: Ipv4Hdr,
    l4: TcpHdr,
}

/// The first 40 bytes at the network header: the IPv4 view above, or the
/// whole IPv6 fixed header (also 40 bytes). The version nibble (the first
/// byte's high half in both) says which, so the IPv4 path keeps its single
/// read and IPv6 costs no extra one for the fixed header. Aligned so LLVM
/// loads the headers' byte-array fields as words: BPF has no unaligned
/// loads, so an align-1 `[u8; 4]` becomes four byte loads and spills.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
union Head {
    v4: Headers,
    v6: Ipv6Hdr,
}

const _: () = assert!(size_of::<Headers>() == size_of::<Ipv6Hdr>());

/// The first 40 bytes at `ip_addr` as five 8-byte loads, through a pointer
/// the verifier types `rdonly_untrusted_mem`: it turns each into a
/// BPF_PROBE_MEM load (an exception-table-guarded load that reads 0 if it
/// faults, kernel/bpf/verifier.c `check_mem_access`, the
/// `PTR_TO_MEM | PTR_UNTRUSTED` case), at any offset, aligned or not
/// (the kernel's selftest `mem_rdonly_untrusted.c` `misaligned_access`).
/// Replaces `bpf_probe_read_kernel`'s call, `copy_from_kernel_nofault`
/// and its range check, on every packet a tp_btf program parses. A fault
/// gives a version nibble of 0, which no parse accepts. Only ever reached
/// with `skb->head` plus an offset: a load instruction the verifier sees
/// with two pointer types is refused ("same insn cannot be used with
/// different pointers").
#[inline(always)]
fn load_head(ip_addr: u64) -> Head {
    let p = ip_addr as *const u64;
    // SAFETY: see above; volatile so each stays one 8-byte load of memory
    // Rust knows nothing about.
    let w: [u64; 5] = unsafe {
        [
            core::ptr::read_volatile(p),
            core::ptr::read_volatile(p.wrapping_add(1)),
            core::ptr::read_volatile(p.wrapping_add(2)),
            core::ptr::read_volatile(p.wrapping_add(3)),
            core::ptr::read_volatile(p.wrapping_add(4)),
        ]
    };
    // SAFETY: Head is 40 plain bytes, as is `w`.
    unsafe { core::mem::transmute::<[u64; 5], Head>(w) }
}

#[inline(always)]
fn read_error(_: ()) {
    stat_inc(stat::READ_ERRORS);
}

/// `head_is_mem`: `ip_addr` is `skb->head` loaded directly plus the
/// network header, which the verifier types as readable memory on this
/// kernel ([`KernelOffsets::head_is_mem`]): the first 40 bytes are
/// [`load_head`]'s plain loads, not a helper call. Known at load time
/// (`.rodata`), so the verifier walks only one of the two reads.
#[inline(always)]
fn parse_ip(ip_addr: u64, head_is_mem: bool) -> Result<(Packet, u64), ()> {
    // The linear data is followed by skb_shared_info, so reading 40 bytes
    // of a shorter (UDP) packet stays inside the buffer; only the bytes the
    // headers say are there are used.
    let first = if head_is_mem {
        Ok(load_head(ip_addr))
    } else {
        read::<Head>(ip_addr)
    };
    let (ip, first_l4) = match first {
        // SAFETY: both union views are plain bytes.
        Ok(h) if unsafe { h.v4.ip.vihl } >> 4 == 6 => {
            let mut pkt = Packet::default();
            let at = parse_ipv6(ip_addr, unsafe { &h.v6 }, &mut pkt);
            if at >= ICMPV6_AT {
                if at == NOT_TRACED {
                    return Err(());
                }
                let l3_len = (at & 0x7ff) as usize;
                crate::icmp::v6(&crate::icmp::Kernel(ip_addr), l3_len, &mut pkt)?;
                return Ok((pkt, 0));
            }
            let payload = payload_of(&mut pkt, ip_addr, at, head_is_mem);
            return Ok((pkt, payload));
        }
        Ok(h) => (unsafe { h.v4.ip }, Some(unsafe { h.v4.l4 })),
        Err(()) => (read::<Ipv4Hdr>(ip_addr).map_err(read_error)?, None),
    };
    let Some((mut pkt, ihl)) = Packet::from_ipv4(&ip) else {
        // Only ICMP pays for the quote's read (icmp.rs).
        if ip.proto != icmp::PROTO_ICMP {
            return Err(());
        }
        let mut pkt = Packet::default();
        crate::icmp::v4(&crate::icmp::Kernel(ip_addr), &mut pkt)?;
        return Ok((pkt, 0));
    };
    let hdr = match first_l4 {
        Some(h) if ihl == Ipv4Hdr::LEN => h,
        _ => read::<TcpHdr>(ip_addr + ihl as u64).map_err(read_error)?,
    };
    let l4_len = l4_header(&mut pkt, &hdr);
    let at = payload_at(&pkt, ihl, l4_len);
    // Before the tuple: Packet is Copy, and `(pkt, f(&mut pkt))` would
    // return the copy made before `f` wrote the payload head.
    let payload = payload_of(&mut pkt, ip_addr, at, head_is_mem);
    Ok((pkt, payload))
}

/// Fills ports (and TCP's fields) from the L4 header; returns its length.
#[inline(always)]
fn l4_header(pkt: &mut Packet, hdr: &TcpHdr) -> usize {
    if pkt.proto == proto::TCP {
        pkt.set_tcp(hdr)
    } else {
        // UDP's ports sit where TCP's do.
        pkt.set_ports(hdr.source, hdr.dest);
        UDP_HDR_LEN
    }
}

/// Where the payload starts, from the IP header; 0 = none. Only when the
/// IP length says there is a payload: otherwise the bytes there are
/// whatever follows the packet in memory.
#[inline(always)]
fn payload_at(pkt: &Packet, l3_len: usize, l4_len: usize) -> u64 {
    let at = l3_len + l4_len;
    if (pkt.ip_len as usize) >= at + 4 {
        at as u64
    } else {
        0
    }
}

/// An offset, not an address, comes back from [`parse_ipv6`] and is mixed
/// with its flags there: on 6.18 `skb->head` loaded directly
/// ([`Direct`]) is a pointer to the verifier (untrusted memory), which
/// may be added to a number, not masked or added to another pointer.
#[inline(always)]
fn payload_addr(ip_addr: u64, at: u64) -> u64 {
    if at == 0 { 0 } else { ip_addr + at }
}

/// Where the headers were read as memory (`in_mem`, [`load_head`]), the
/// payload's first four bytes are one more plain load, made here for every
/// packet, and no address is returned (0: [`payload_head`] does nothing).
/// Returned, that address would be a pointer on the paths with a payload
/// and the scalar 0 on the others, carried through the filter and the
/// event: registers of two types never prune each other (kernel/bpf/
/// verifier.c `regsafe`), so the verifier walked every path after the
/// parse once per kind (`nf_dnat` 55.5k instructions; 33.4k as here,
/// `net_dev_start_xmit` 33.0k against 27.1k). Carried as an offset and
/// added to the pointer where a packet matched, it was worse (138k): the
/// addition makes the verifier track the offset's range exactly back
/// through every path that carried it. Here the offset dies in the parse.
#[inline(always)]
fn payload_of(pkt: &mut Packet, ip_addr: u64, at: u64, in_mem: bool) -> u64 {
    if !in_mem {
        return payload_addr(ip_addr, at);
    }
    if at != 0 {
        // SAFETY: as load_head's: a BPF_PROBE_MEM load, any offset, 0 on a fault.
        let w = unsafe { core::ptr::read_volatile((ip_addr + at) as *const u32) };
        pkt.payload_head = u32::from_be(w);
    }
    0
}

/// IPv6: TCP/UDP right after the fixed header, or after the extension
/// headers [`ipv6_l4`] steps over. A BPF-to-BPF call that fills `pkt` in
/// the caller's frame: inlined, LLVM duplicated the whole filter and event
/// path per family, doubling code and passing the 512-byte stack limit.
/// Returns [`payload_at`], or [`NOT_TRACED`]: a 16-byte `Result`
/// came back through a pointer to the caller's frame left in r0, which
/// the verifier refuses ("cannot return stack pointer to the caller").
#[inline(never)]
fn parse_ipv6(ip_addr: u64, ip: &Ipv6Hdr, pkt: &mut Packet) -> u64 {
    let Some((l4_proto, l3_len)) = ipv6_l4(ip.next_hdr, |at| read::<[u8; 8]>(ip_addr + at as u64))
    else {
        return NOT_TRACED;
    };
    if l4_proto == icmp::PROTO_ICMPV6 {
        return icmpv6_at(l3_len);
    }
    *pkt = Packet::from_ipv6(ip, l4_proto);
    let Ok(hdr) = read::<TcpHdr>(ip_addr + l3_len as u64) else {
        read_error(());
        return NOT_TRACED;
    };
    let l4_len = l4_header(pkt, &hdr);
    payload_at(pkt, l3_len, l4_len)
}

/// First four payload bytes; `payload` as returned by [`parse`].
#[inline(always)]
pub fn payload_head(pkt: &mut Packet, payload: u64) {
    if payload != 0 {
        pkt.payload_head = read::<[u8; 4]>(payload)
            .map(u32::from_be_bytes)
            .unwrap_or(0);
    }
}
