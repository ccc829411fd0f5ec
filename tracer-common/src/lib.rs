//! Types shared by nattrace's kernel programs and its userspace collector.
//!
//! Everything here is `#[repr(C)]` and plain-old-data: the kernel side writes
//! these bytes into maps and the ring buffer, userspace reads them back. Both
//! probe backends (tc + netfilter links + tracepoints, and tc + kprobes +
//! tracepoints) emit the same [`PacketEvent`]s so the collector and its
//! verdicts do not depend on the backend.
#![no_std]

pub mod prefilter;

/// Observation point kinds. Stored in [`PacketEvent::hook`].
pub mod hook {
    /// tc ingress on an interface of the traced node namespace.
    pub const TC_INGRESS: u8 = 1;
    /// tc egress on an interface of the traced node namespace.
    pub const TC_EGRESS: u8 = 2;
    /// A netfilter hook of the traced namespace; `nf_hook` and `nat_stage` say which and where.
    pub const NETFILTER: u8 = 3;
    /// A device received the packet (raw tracepoint `netif_receive_skb`, every namespace;
    /// for a veth or loopback, sent by the transmit's program).
    pub const DEV_RX: u8 = 4;
    /// A device is about to transmit the packet (tp_btf `net_dev_start_xmit`, every namespace).
    pub const DEV_TX: u8 = 5;
    /// The kernel dropped the packet (tp_btf `kfree_skb`); `drop_reason` is set.
    pub const DROP: u8 = 6;
    /// The bridge forwarded the frame from one port to another (kprobe `br_forward`).
    pub const BR_FORWARD: u8 = 7;

    pub fn name(hook: u8) -> &'static str {
        match hook {
            TC_INGRESS => "tc-ingress",
            TC_EGRESS => "tc-egress",
            NETFILTER => "netfilter",
            DEV_RX => "dev-rx",
            DEV_TX => "dev-tx",
            DROP => "drop",
            BR_FORWARD => "br-forward",
            _ => "unknown",
        }
    }
}

/// Netfilter hook numbers (`enum nf_inet_hooks`), stored in [`PacketEvent::nf_hook`].
pub mod nf_hook {
    pub const PRE_ROUTING: u8 = 0;
    pub const LOCAL_IN: u8 = 1;
    pub const FORWARD: u8 = 2;
    pub const LOCAL_OUT: u8 = 3;
    pub const POST_ROUTING: u8 = 4;
    /// The event was not taken at a netfilter hook.
    pub const NONE: u8 = 0xff;

    pub fn name(hook: u8) -> &'static str {
        match hook {
            PRE_ROUTING => "PREROUTING",
            LOCAL_IN => "INPUT",
            FORWARD => "FORWARD",
            LOCAL_OUT => "OUTPUT",
            POST_ROUTING => "POSTROUTING",
            _ => "-",
        }
    }
}

/// Where a netfilter event sits relative to the NAT stage of its hook.
pub mod nat_stage {
    /// Not a NAT bracket (FORWARD, tc, tracepoints).
    pub const NONE: u8 = 0;
    /// Before the nat table ran at this hook (priority just after conntrack).
    pub const BEFORE: u8 = 1;
    /// After the nat table ran at this hook.
    pub const AFTER: u8 = 2;

    pub fn name(stage: u8) -> &'static str {
        match stage {
            BEFORE => "before-nat",
            AFTER => "after-nat",
            _ => "",
        }
    }
}

/// Which side of a traced flow the kernel filter matched the packet on.
pub mod direction {
    pub const UNKNOWN: u8 = 0;
    /// client → Service (or → backend after DNAT).
    pub const REQUEST: u8 = 1;
    /// backend/Service → client.
    pub const REPLY: u8 = 2;
}

pub mod proto {
    pub const TCP: u8 = 6;
    pub const UDP: u8 = 17;
}

/// TCP flag bits as they appear in the header's flags byte.
pub mod tcp_flags {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const RST: u8 = 0x04;
    pub const PSH: u8 = 0x08;
    pub const ACK: u8 = 0x10;
}

/// An address as the kernel filter and the events carry it: the 16 bytes of
/// an IPv6 address in wire order, IPv4 as IPv4-mapped (`::ffff:a.b.c.d`,
/// RFC 4291 2.5.5.2). One representation for both families keeps one map
/// per concept and one event layout; the family is the address's own (a
/// mapped address is IPv4). An IPv6 packet that really carries `::ffff:`
/// addresses (never routed on the wire, RFC 4038) would be reported as IPv4.
///
/// Stored as four `u32` words whose memory is the wire bytes (so the
/// numeric values are host-endian views): the BPF side then copies and
/// compares addresses as words. As `[u8; 16]`, LLVM split them into bytes
/// and spilled each to its own stack slot, which passed the 512-byte BPF
/// stack limit.
pub type Addr = [u32; 4];

/// The `::ffff` word of an IPv4-mapped address (bytes 8-11: 0, 0, ff, ff).
const MAPPED_WORD: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

/// `a.b.c.d` as `::ffff:a.b.c.d`.
#[inline(always)]
pub const fn v4_mapped(a: [u8; 4]) -> Addr {
    [0, 0, MAPPED_WORD, u32::from_ne_bytes(a)]
}

/// The IPv4 address of an IPv4-mapped [`Addr`], None for IPv6.
#[inline(always)]
pub fn as_v4(a: &Addr) -> Option<[u8; 4]> {
    (a[0] == 0 && a[1] == 0 && a[2] == MAPPED_WORD).then(|| a[3].to_ne_bytes())
}

/// An [`Addr`] from its 16 wire bytes.
#[inline(always)]
pub fn addr_from_bytes(b: [u8; 16]) -> Addr {
    // SAFETY: same size, every bit pattern valid.
    unsafe { core::mem::transmute(b) }
}

/// The 16 wire bytes of an [`Addr`].
#[inline(always)]
pub fn addr_bytes(a: Addr) -> [u8; 16] {
    // SAFETY: same size, every bit pattern valid.
    unsafe { core::mem::transmute(a) }
}

/// One packet seen at one observation point.
///
/// Addresses are [`Addr`]s (IPv4-mapped for IPv4), ports in host order. The packet's identity across hooks and
/// across NAT is (`skb`, `ip_id`, `seq`, `ack`, `tcp_flags`, `payload_head`):
/// NAT rewrites addresses and ports but none of these.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(serde::Serialize, serde::Deserialize))]
pub struct PacketEvent {
    /// `bpf_ktime_get_ns()`: monotonic, shared by all CPUs.
    pub ts_ns: u64,
    /// Kernel address of the `sk_buff`. Stable while the packet travels veth → bridge → veth,
    /// reused by the allocator afterwards, so only meaningful within a short window.
    pub skb: u64,
    /// Inode of the network namespace the packet was in; 0 = the traced node namespace
    /// (tc and netfilter programs are attached only there; userspace fills it in).
    pub netns: u32,
    pub ifindex: u32,
    #[cfg_attr(feature = "user", serde(with = "ip_text"))]
    pub saddr: Addr,
    #[cfg_attr(feature = "user", serde(with = "ip_text"))]
    pub daddr: Addr,
    pub sport: u16,
    pub dport: u16,
    pub seq: u32,
    pub ack: u32,
    /// `enum skb_drop_reason` for [`hook::DROP`], else 0.
    pub drop_reason: u32,
    /// First four bytes of the L4 payload (the DNS id and flags for DNS over UDP).
    pub payload_head: u32,
    /// IP total length (IPv6: payload length + the 40-byte fixed header).
    pub ip_len: u16,
    /// IPv4 identification; IPv6 has none (0).
    pub ip_id: u16,
    pub hook: u8,
    pub nf_hook: u8,
    pub nat_stage: u8,
    pub proto: u8,
    pub tcp_flags: u8,
    pub direction: u8,
    /// Index of the matched Service in the userspace service list.
    pub svc: u8,
    /// [`event_flags`]: how the kernel's per-flow buffer handled the event.
    /// Recordings made before it existed read as 0 (sent as it happened).
    #[cfg_attr(feature = "user", serde(default, skip_serializing_if = "is_zero"))]
    pub flags: u8,
    /// On a [`event_flags::WATCH`] event and on a RST of a muted flow:
    /// replies of the flow that reached the client reverse-NATed while it
    /// was muted (checked, fine, not sent) before this one. 0 otherwise;
    /// absent in older recordings.
    #[cfg_attr(feature = "user", serde(default, skip_serializing_if = "is_zero_u32"))]
    pub good: u32,
    /// Keeps the layout free of implicit padding (always 0).
    #[cfg_attr(feature = "user", serde(skip))]
    pub _reserved: u32,
    /// An ICMP or ICMPv6 error about this flow (issue 23): its type (IPv4
    /// 3, 11, 12; IPv6 1-4, the family being the addresses'), 0 for every
    /// other event. On such an event the addresses, ports, seq, ack, flags,
    /// `ip_len` and `ip_id` are those of the packet the error quotes (what
    /// matched it to the flow), as the error carried it at this point.
    #[cfg_attr(feature = "user", serde(default, skip_serializing_if = "is_zero"))]
    pub icmp_type: u8,
    #[cfg_attr(feature = "user", serde(default, skip_serializing_if = "is_zero"))]
    pub icmp_code: u8,
    #[cfg_attr(feature = "user", serde(skip))]
    pub _icmp_pad: u16,
    /// The MTU the error reports: next-hop MTU of an IPv4 "fragmentation
    /// needed" (type 3 code 4), MTU of an ICMPv6 "packet too big" (type 2).
    #[cfg_attr(feature = "user", serde(default, skip_serializing_if = "is_zero_u32"))]
    pub icmp_mtu: u32,
    /// Source address of the error packet itself (who sent it, or the
    /// Service once conntrack translated it back); zero on other events.
    #[cfg_attr(
        feature = "user",
        serde(default, with = "ip_text", skip_serializing_if = "is_zero_addr")
    )]
    pub icmp_from: Addr,
}

/// ICMP and ICMPv6 error types nattrace follows (RFC 792, RFC 4443).
pub mod icmp {
    pub const PROTO_ICMP: u8 = 1;
    pub const PROTO_ICMPV6: u8 = 58;
    pub const V4_DEST_UNREACH: u8 = 3;
    pub const V4_TIME_EXCEEDED: u8 = 11;
    pub const V4_PARAMETER_PROBLEM: u8 = 12;
    /// Destination unreachable code 4.
    pub const V4_FRAG_NEEDED: u8 = 4;
    /// Destination unreachable code 3.
    pub const V4_PORT_UNREACH: u8 = 3;
    /// Destination unreachable code 1: what the node sends when ARP for
    /// the next hop fails.
    pub const V4_HOST_UNREACH: u8 = 1;
    pub const V6_DEST_UNREACH: u8 = 1;
    pub const V6_PACKET_TOO_BIG: u8 = 2;
    pub const V6_TIME_EXCEEDED: u8 = 3;
    pub const V6_PARAMETER_PROBLEM: u8 = 4;
    /// Destination unreachable code 4.
    pub const V6_PORT_UNREACH: u8 = 4;
    /// Destination unreachable code 3: neighbour discovery failed.
    pub const V6_ADDR_UNREACH: u8 = 3;

    /// An IPv4 error type followed (redirects, echo, ... are not).
    #[inline(always)]
    pub fn is_error_v4(t: u8) -> bool {
        t == V4_DEST_UNREACH || t == V4_TIME_EXCEEDED || t == V4_PARAMETER_PROBLEM
    }

    /// An ICMPv6 error type followed (1-4; informational ones are 128+).
    #[inline(always)]
    pub fn is_error_v6(t: u8) -> bool {
        (V6_DEST_UNREACH..=V6_PARAMETER_PROBLEM).contains(&t)
    }

    /// "too big": the error a path-MTU discovery waits for.
    pub fn is_too_big(v6: bool, t: u8, code: u8) -> bool {
        if v6 {
            t == V6_PACKET_TOO_BIG
        } else {
            t == V4_DEST_UNREACH && code == V4_FRAG_NEEDED
        }
    }

    /// "port unreachable" (kube-proxy's REJECT of a Service without endpoints).
    pub fn is_port_unreachable(v6: bool, t: u8, code: u8) -> bool {
        if v6 {
            t == V6_DEST_UNREACH && code == V6_PORT_UNREACH
        } else {
            t == V4_DEST_UNREACH && code == V4_PORT_UNREACH
        }
    }

    /// Human name of an error, e.g. "fragmentation needed".
    pub fn name(v6: bool, t: u8, code: u8) -> &'static str {
        if v6 {
            match (t, code) {
                (V6_DEST_UNREACH, 0) => "no route to destination",
                (V6_DEST_UNREACH, 1) => "administratively prohibited",
                (V6_DEST_UNREACH, 3) => "address unreachable",
                (V6_DEST_UNREACH, V6_PORT_UNREACH) => "port unreachable",
                (V6_DEST_UNREACH, _) => "destination unreachable",
                (V6_PACKET_TOO_BIG, _) => "packet too big",
                (V6_TIME_EXCEEDED, _) => "time exceeded",
                (V6_PARAMETER_PROBLEM, _) => "parameter problem",
                _ => "icmpv6 error",
            }
        } else {
            match (t, code) {
                (V4_DEST_UNREACH, 0) => "network unreachable",
                (V4_DEST_UNREACH, 1) => "host unreachable",
                (V4_DEST_UNREACH, V4_PORT_UNREACH) => "port unreachable",
                (V4_DEST_UNREACH, V4_FRAG_NEEDED) => "fragmentation needed",
                (V4_DEST_UNREACH, 9 | 10 | 13) => "administratively prohibited",
                (V4_DEST_UNREACH, _) => "destination unreachable",
                (V4_TIME_EXCEEDED, _) => "time exceeded",
                (V4_PARAMETER_PROBLEM, _) => "parameter problem",
                _ => "icmp error",
            }
        }
    }
}

#[cfg(feature = "user")]
fn is_zero_addr(a: &Addr) -> bool {
    *a == [0; 4]
}

#[cfg(feature = "user")]
fn is_zero(v: &u8) -> bool {
    *v == 0
}

#[cfg(feature = "user")]
fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

/// [`PacketEvent::flags`]: a TCP connection opened from a pod is held in
/// the kernel's per-flow buffer (`HELD`, tracer-ebpf/src/held.rs)
/// until it turns out healthy (the buffer is discarded) or not (it is sent).
pub mod event_flags {
    /// The first event of a flow whose next events the kernel holds back.
    pub const HOLDING: u8 = 1;
    /// Held, then sent because the flow turned out a problem (un-reversed
    /// reply, RST, drop, a late reply, the buffer full).
    pub const FLUSHED: u8 = 2;
    /// Held, then read by userspace at the flow's reply deadline or at exit.
    pub const PULLED: u8 = 4;
    /// Held, then sent from a discarded (healthy) buffer as the flow's DNAT
    /// evidence: the first request event with the backend as destination.
    pub const KEPT: u8 = 8;
    /// On the reply that proved a held flow healthy: this reply packet
    /// crossed the traced node (its events there were discarded).
    pub const VIA_NODE: u8 = 16;
    /// Sent by the watch of an established flow (muted after its opening
    /// was judged healthy, tracer-ebpf/src/watch.rs): this packet failed a
    /// check — a reply reached the client from another address than the
    /// Service, a drop for a failure reason, a request not DNATed at the
    /// NAT point. The flow is per packet again from here; `good` says how
    /// many replies were fine before.
    pub const WATCH: u8 = 32;
    /// On a RST from the backend's side: the backend had sent its FIN
    /// before (seen while the flow was muted, where FINs are only
    /// counted). Its socket was closed (by the application, or by its
    /// process exiting), and the RST answers data the client sent after
    /// (net/ipv4/tcp_input.c `tcp_rcv_state_process`, FIN_WAIT1/2 after
    /// close(): "RFC 1122 says we MUST send a reset"): not a socket the
    /// backend lost without a close.
    pub const AFTER_FIN: u8 = 64;
}

/// The kernel's per-flow buffer (tracer-ebpf/src/held.rs, docs/DESIGN.md
/// "Event budget"): its states, its timing and what an event is to it,
/// defined once for the eBPF program and the model test that replays the
/// recordings through it (tracer-userspace/tests/held.rs).
pub mod held;

/// Events one `HELD` entry holds; one more spills the buffer (sent).
/// A healthy handshake through a bridged node is 17 events past the first.
pub const HELD_SLOTS: usize = 24;
/// Added to [`HeldFlow::count`] by whoever takes the buffer (flush,
/// discard): a writer that then claims a slot sees it taken.
pub const HELD_CLOSED: u64 = 1 << 32;

/// One held flow (`HELD` value, keyed by the client side's [`EndpointKey`]).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HeldFlow {
    /// Slots claimed (atomic fetch-add; 64-bit, as the BPF target has no
    /// 32-bit atomics without alu32); plus [`HELD_CLOSED`] once taken.
    pub count: u64,
    /// `ts_ns` of the first (sent) event.
    pub first_ts: u64,
    /// ISN of the SYN that opened it.
    pub syn_seq: u32,
    /// Namespace the SYN left (the client's): the reply must reach that one.
    pub client_netns: u32,
    /// The Service the flow was opened to (its first event's destination).
    pub service: Addr,
    pub service_port: u16,
    /// Slot of the first request event sent past DNAT; 0xff = none yet.
    pub dnat_slot: u8,
    /// A reply event of the flow was held at a point of the traced node.
    pub reply_in_node: u8,
    /// The opening SYN was sent again: its attempts are evidence (issue 11).
    pub retransmit: u8,
    pub _pad: [u8; 3],
    pub events: [PacketEvent; HELD_SLOTS],
}

/// Key of the in-kernel Service filter. `port` 0 matches every port.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ServiceKey {
    pub addr: Addr,
    pub port: u16,
    pub proto: u8,
    pub _pad: u8,
}

/// The client side of a traced flow: (client ip, client port, proto), or the
/// masqueraded (node ip, port) once SNAT has rewritten it. Requests carry it as
/// source, replies as destination, whatever DNAT did to the other side.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct EndpointKey {
    pub addr: Addr,
    pub port: u16,
    pub proto: u8,
    pub _pad: u8,
}

/// Per-flow state in the kernel filter.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointState {
    /// Set once the flow's verdict is `ok` (by the kernel on the client's
    /// reverse-NATed reply, or by userspace): further plain data packets are
    /// only counted in `STATS[MUTED_PACKETS]` instead of each costing a
    /// ring-buffer event. Written by programs on any CPU and by userspace.
    pub muted: u32,
    pub svc: u8,
    /// The per-flow buffer (`HELD`): [`held::NEVER`], [`held::HOLDING`] or
    /// [`held::DONE`] for the SYN `syn_seq`.
    pub held: u8,
    /// The FINs that passed while the flow was muted ([`fins`] bits,
    /// cleared by a new SYN): after the backend's, its RSTs carry
    /// [`event_flags::AFTER_FIN`]; after both, the close's aftermath is
    /// no failure (tracer-ebpf/src/watch.rs `closing`).
    pub fins: u8,
    pub _pad: u8,
    /// ISN of the last SYN the buffer rule saw at the client: a SYN with
    /// another one is a new connection from a reused port.
    pub syn_seq: u32,
    /// Replies that reached the client reverse-NATed while muted (the
    /// watch's checked-and-fine count, carried in its event). Written
    /// without atomics by programs on any CPU: approximate under races.
    pub good: u32,
    /// Namespace the flow's reverse-NATed reply reached (the client's),
    /// set when the flow is muted; 0 = not known yet. Another namespace
    /// on the same kernel (a router, another lab node) is no client.
    pub client_netns: u32,
}

/// What the kernel remembers about a matched `sk_buff`, so the same packet is
/// still recognised after NAT rewrote both of its endpoints' keys.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InflightPacket {
    pub seq: u32,
    pub ip_id: u16,
    pub direction: u8,
    pub svc: u8,
}

/// Struct member offsets (bytes) read from the running kernel's BTF at start,
/// because Rust eBPF has no CO-RE and offsets differ between kernels. The
/// loader writes them into the object's global `KERNEL_OFFSETS` (read-only,
/// so the verifier knows each as a constant), not into `CONFIG`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(serde::Serialize, serde::Deserialize))]
pub struct KernelOffsets {
    pub sk_buff_head: u32,
    pub sk_buff_data: u32,
    pub sk_buff_network_header: u32,
    pub sk_buff_dev: u32,
    pub net_device_ifindex: u32,
    pub net_device_nd_net: u32,
    /// Offset of `ns.inum` inside `struct net`.
    pub net_ns_inum: u32,
    /// `struct nf_hook_state.hook` (kprobe backend: `nf_hook_slow`).
    pub nf_hook_state_hook: u32,
    pub nf_hook_state_pf: u32,
    /// `struct nf_hook_state.net`: kprobes fire in every namespace, the
    /// netfilter events must come only from the traced one.
    pub nf_hook_state_net: u32,
    /// `struct nf_conn.tuplehash` (kprobe backend: `nf_nat_manip_pkt`).
    pub nf_conn_tuplehash: u32,
    /// `sizeof(struct nf_conntrack_tuple_hash)`: stride between the original and reply tuples.
    pub nf_conntrack_tuple_hash_size: u32,
    /// Offsets of `tuple.src.u3`, ... inside `struct nf_conntrack_tuple_hash`
    /// (the tuple follows the hash-list node).
    pub tuple_src_u3: u32,
    pub tuple_src_u: u32,
    pub tuple_dst_u3: u32,
    pub tuple_dst_u: u32,
    /// `struct nf_conn.status` (kprobe on `nf_nat_packet`, kernels without `nf_nat_manip_pkt`).
    pub nf_conn_status: u32,
    /// `struct net_bridge_port.dev` (module bridge); 0 = unknown, report `skb->dev`.
    pub net_bridge_port_dev: u32,
    /// `struct sk_buff._nfct` (the conntrack entry and ctinfo): the
    /// netfilter backend's one program per SNAT hook reads the source
    /// conntrack saw there. 0 = unknown, read with the conntrack offsets.
    pub sk_buff_nfct: u32,
    /// `net_device.flags` (IFF_UP, IFF_LOOPBACK).
    pub net_device_flags: u32,
    /// `net_device.rtnl_link_ops` and `rtnl_link_ops.kind`: tell a veth
    /// ("veth") from other devices.
    pub net_device_rtnl_link_ops: u32,
    pub rtnl_link_ops_kind: u32,
    /// Where `netdev_priv(dev)` starts: the `priv` member where the kernel
    /// has one (6.12+), else `sizeof(struct net_device)` rounded up to
    /// NETDEV_ALIGN (32), include/linux/netdevice.h. Plus `veth_priv.peer`.
    pub net_device_priv: u32,
    pub veth_priv_peer: u32,
    /// 1: a load of `skb->head` through a BTF pointer gives memory the
    /// program may load from (kernel 6.17+, `PTR_TO_MEM | MEM_RDONLY |
    /// PTR_UNTRUSTED`, kernel/bpf/btf.c `btf_struct_walk` →
    /// `WALK_PTR_UNTRUSTED`), so the tp_btf programs read the headers with
    /// plain loads; 0: a plain number (6.1, 6.12), read with
    /// `bpf_probe_read_kernel`. Known by vmlinux's `enum bpf_features`
    /// value `BPF_FEAT_RDONLY_CAST_TO_VOID`, added in the same series.
    pub head_is_mem: u32,
}

/// [`EndpointState::fins`]: whose FIN passed.
pub mod fins {
    /// The backend's side (a reply's FIN).
    pub const REPLY: u8 = 1;
    /// The client's side (a request's FIN).
    pub const REQUEST: u8 = 2;
    /// Both: each application has closed its end.
    pub const BOTH: u8 = REPLY | REQUEST;

    /// The bit of a FIN travelling in `dir` (`direction::REPLY` or
    /// `REQUEST`), for the kernel's watch and the collector's alike.
    #[inline(always)]
    pub const fn of(dir: u8) -> u8 {
        if dir == super::direction::REPLY {
            REPLY
        } else {
            REQUEST
        }
    }
}

/// Global configuration of the kernel programs (one entry of the `CONFIG` array).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// `ns.inum` of the traced node namespace, for the programs that fire in
    /// every namespace but stand in for per-namespace attachments (kprobes on
    /// netfilter functions).
    pub node_netns: u32,
    /// 1: hold the events of a TCP connection opened from a pod until it
    /// turns out healthy or not (`HELD`); 0 with `-v` (every packet).
    pub buffer: u32,
    /// `--reply-timeout`: a reply later than this (less a margin) flushes
    /// the buffer instead of discarding it, since userspace pulls the
    /// buffer before that deadline.
    pub reply_timeout_ns: u64,
    /// Bit `r` set: drop reason `r` (this kernel's numbering, below 256) is
    /// a healthy socket's own (old or out-of-window data, a closing
    /// socket's purge, ...), not a failure: the watch of an established
    /// flow counts such a drop instead of sending it (collector
    /// `established::BENIGN_DROPS`).
    pub benign_drops: [u64; 4],
    /// Bit `r` set: drop reason `r` (numbered as `benign_drops`) ends a
    /// late segment of a connection both sides had closed (its socket is
    /// gone: NO_SOCKET): the watch counts it once both FINs passed
    /// (collector `drop_reason::CLOSED_DROPS`).
    pub closed_drops: [u64; 4],
}

/// Indexes of the per-CPU counters in the `STATS` map. Summed by userspace.
pub mod stat {
    /// Events written to the ring buffer.
    pub const EVENTS: u32 = 0;
    /// Ring-buffer reservations that failed: events lost.
    pub const RINGBUF_FULL: u32 = 1;
    /// Packets of muted (verdict already `ok`) flows counted instead of emitted.
    pub const MUTED_PACKETS: u32 = 2;
    /// New flows that could not be inserted into the endpoint map.
    pub const FLOW_MAP_FULL: u32 = 3;
    /// Packets that matched but whose headers could not be read.
    pub const READ_ERRORS: u32 = 4;
    /// IPv6 packets whose TCP/UDP header was not reached: non-first
    /// fragments, or extension headers not followed (ESP, AH, more than the
    /// programs walk). Counted before any filtering: they cannot be matched.
    pub const IPV6_UNFOLLOWED: u32 = 5;
    /// Held events of healthy flows, discarded in the kernel (never sent).
    pub const HELD_DISCARDED: u32 = 8;
    /// Flow buffers that filled up and were sent (a spill, not a loss).
    pub const HELD_SPILLED: u32 = 9;
    /// TCP connections sent per packet because `HELD` was full.
    pub const HELD_MAP_FULL: u32 = 10;
    pub const COUNT: u32 = 12;
}

/// Addresses in recordings and fixtures read as `100.96.54.240` or
/// `fd00:10:96::a`, not as byte arrays. IPv4 is written dotted (as before
/// addresses were 128-bit), so recordings of IPv4 flows read the same in
/// every version.
#[cfg(feature = "user")]
mod ip_text {
    use core::net::{IpAddr, Ipv6Addr};

    use serde::{Deserialize, Deserializer, Serializer};

    use super::{Addr, addr_bytes, addr_from_bytes, v4_mapped};

    pub fn serialize<S: Serializer>(addr: &Addr, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&Ipv6Addr::from(addr_bytes(*addr)).to_canonical())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Addr, D::Error> {
        Ok(match IpAddr::deserialize(d)? {
            IpAddr::V4(v4) => v4_mapped(v4.octets()),
            IpAddr::V6(v6) => addr_from_bytes(v6.octets()),
        })
    }
}

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: all of these are #[repr(C)], Copy, and valid for any bit pattern.
    unsafe impl aya::Pod for PacketEvent {}
    unsafe impl aya::Pod for ServiceKey {}
    unsafe impl aya::Pod for EndpointKey {}
    unsafe impl aya::Pod for EndpointState {}
    unsafe impl aya::Pod for InflightPacket {}
    unsafe impl aya::Pod for HeldFlow {}
    unsafe impl aya::Pod for KernelOffsets {}
    unsafe impl aya::Pod for Config {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_have_no_implicit_padding() {
        // The kernel writes these with a fixed layout; a size change means the
        // two sides disagree.
        assert_eq!(core::mem::size_of::<PacketEvent>(), 120);
        assert_eq!(core::mem::size_of::<ServiceKey>(), 20);
        assert_eq!(core::mem::size_of::<EndpointKey>(), 20);
        assert_eq!(core::mem::size_of::<EndpointState>(), 20);
        assert_eq!(core::mem::size_of::<KernelOffsets>(), 100);
        assert_eq!(core::mem::size_of::<Config>(), 80);
        assert_eq!(
            core::mem::size_of::<HeldFlow>(),
            48 + HELD_SLOTS * core::mem::size_of::<PacketEvent>()
        );
    }

    #[test]
    fn ipv4_is_mapped_and_back() {
        let m = v4_mapped([100, 67, 30, 133]);
        assert_eq!(as_v4(&m), Some([100, 67, 30, 133]));
        assert_eq!(
            addr_bytes(m),
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 100, 67, 30, 133]
        );
        let mut v6 = [0u8; 16];
        v6[0] = 0xfd;
        assert_eq!(as_v4(&addr_from_bytes(v6)), None);
        assert_eq!(addr_bytes(addr_from_bytes(v6)), v6);
    }
}
