//! Small value types of the collector. Kept `Copy` and compact: they are
//! stored per event and per flow, and the collector must hold 100k flows in
//! a few tens of MiB.
use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4},
    sync::Arc,
};

use serde::Serialize;
use tracer_common::{PacketEvent, proto};

/// A shared, immutable name (interface, drop reason). Cloning it never
/// allocates, so reports can carry names without per-flow string copies.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Name(pub Arc<str>);

impl Name {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<&str> for Name {
    fn from(s: &str) -> Self {
        Name(s.into())
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for Name {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

/// Address (IPv4 or IPv6; the events' IPv4-mapped form read back as IPv4)
/// and port (host order), as in [`PacketEvent`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    pub addr: IpAddr,
    pub port: u16,
}

impl Default for Endpoint {
    fn default() -> Self {
        Self {
            addr: Ipv4Addr::UNSPECIFIED.into(),
            port: 0,
        }
    }
}

impl Endpoint {
    pub fn src(ev: &PacketEvent) -> Self {
        Self {
            addr: crate::service::ip_of(ev.saddr),
            port: ev.sport,
        }
    }

    pub fn dst(ev: &PacketEvent) -> Self {
        Self {
            addr: crate::service::ip_of(ev.daddr),
            port: ev.dport,
        }
    }

    /// `a.b.c.d:port` or `[v6]:port`.
    pub fn socket_addr(self) -> SocketAddr {
        SocketAddr::new(self.addr, self.port)
    }

    /// The IPv4 socket address, for what knows only IPv4 (kube-proxy's
    /// iptables rules as read today); None for IPv6.
    pub fn socket_v4(self) -> Option<SocketAddrV4> {
        match self.addr {
            IpAddr::V4(a) => Some(SocketAddrV4::new(a, self.port)),
            IpAddr::V6(_) => None,
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(super::addr_text::AddrText::new(&self.socket_addr()).as_str())
    }
}

/// Both ends of a packet, order-independent, so a request and its reply map
/// to the same key (what conntrack would call the tuple and its inverse).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PairKey {
    lo: Endpoint,
    hi: Endpoint,
    proto: u8,
}

impl PairKey {
    pub fn new(proto: u8, a: Endpoint, b: Endpoint) -> Self {
        let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
        Self { lo, hi, proto }
    }

    pub fn of(ev: &PacketEvent) -> Self {
        Self::new(ev.proto, Endpoint::src(ev), Endpoint::dst(ev))
    }
}

/// What NAT does not rewrite: the same packet has the same key at every hook.
/// Distinct transmissions can share a key (a retransmitted SYN-ACK has IP id
/// 0 and the same seq/ack), so a key only names a packet within a short window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PacketKey {
    pub seq: u32,
    pub ack: u32,
    pub payload_head: u32,
    pub ip_id: u16,
    pub proto: u8,
    pub tcp_flags: u8,
}

impl PacketKey {
    pub fn of(ev: &PacketEvent) -> Self {
        Self {
            seq: ev.seq,
            ack: ev.ack,
            payload_head: ev.payload_head,
            ip_id: ev.ip_id,
            proto: ev.proto,
            tcp_flags: ev.tcp_flags,
        }
    }
}

/// Which way a packet travels within its flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Dir {
    /// client → Service / backend.
    Request,
    /// backend / Service → client.
    Reply,
}

impl Dir {
    /// As serialized.
    pub fn as_str(self) -> &'static str {
        match self {
            Dir::Request => "request",
            Dir::Reply => "reply",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    pub fn from_raw(p: u8) -> Option<Self> {
        match p {
            proto::TCP => Some(Proto::Tcp),
            proto::UDP => Some(Proto::Udp),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }
}

/// One event of a packet, minus what its packet already holds (identity,
/// flags). 40 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Obs {
    pub ts_ns: u64,
    pub netns: u32,
    pub ifindex: u32,
    pub src: Endpoint,
    pub dst: Endpoint,
    pub drop_reason: u32,
    pub hook: u8,
    pub nf_hook: u8,
    pub nat_stage: u8,
    /// Index into the flow's packets.
    pub packet: u8,
}

impl Obs {
    pub fn new(ev: &PacketEvent, packet: u8) -> Self {
        Self {
            ts_ns: ev.ts_ns,
            netns: ev.netns,
            ifindex: ev.ifindex,
            src: Endpoint::src(ev),
            dst: Endpoint::dst(ev),
            drop_reason: ev.drop_reason,
            hook: ev.hook,
            nf_hook: ev.nf_hook,
            nat_stage: ev.nat_stage,
            packet,
        }
    }

    /// A packet passes each observation point once; seeing the same point
    /// again means another transmission with the same identity.
    pub fn same_point(&self, other: &Obs) -> bool {
        self.hook == other.hook
            && self.nf_hook == other.nf_hook
            && self.nat_stage == other.nat_stage
            && self.ifindex == other.ifindex
            && self.netns == other.netns
    }
}

/// Human name of a TCP packet by its flags ("SYN-ACK", "RST"), or of a UDP
/// datagram by its direction.
pub fn packet_kind(proto: u8, tcp_flags: u8, dir: Dir) -> &'static str {
    use tracer_common::tcp_flags::*;
    if proto == proto::UDP {
        return match dir {
            Dir::Request => "request",
            Dir::Reply => "reply",
        };
    }
    let f = tcp_flags;
    if f & SYN != 0 {
        if f & ACK != 0 { "SYN-ACK" } else { "SYN" }
    } else if f & RST != 0 {
        if f & ACK != 0 { "RST-ACK" } else { "RST" }
    } else if f & FIN != 0 {
        "FIN"
    } else if f & PSH != 0 {
        "data"
    } else {
        "ACK"
    }
}

/// A packet entering a device of the node namespace: tc ingress, or the
/// receive tracepoint of the same device where tc is not attached (yet: the
/// kernel reports one of the two, see tracer-ebpf/src/tracepoints.rs).
/// Whether an event with this `netns` happened in the traced node
/// namespace: tc and netfilter events carry netns 0 (they run only there);
/// tracepoints carry the real inode.
pub(crate) fn in_node(netns: u32, node_netns: u32) -> bool {
    netns == 0 || netns == node_netns
}

pub(crate) fn node_ingress(hook: u8) -> bool {
    hook == tracer_common::hook::TC_INGRESS || hook == tracer_common::hook::DEV_RX
}

/// A packet leaving a device of the node namespace (tc egress, or the
/// transmit tracepoint where tc is not attached).
pub(crate) fn node_egress(hook: u8) -> bool {
    hook == tracer_common::hook::TC_EGRESS || hook == tracer_common::hook::DEV_TX
}
