//! Hand-built event sequences for the collector tests, shaped like what the
//! live reader emits at DESIGN.md's observation points (every event carries
//! the inode of the namespace it was seen in; tc and netfilter ones the
//! node's). They are also written as JSON lines under `tracer-userspace/fixtures/` (see
//! `fixture_files_match_builders`).
//!
//! The seed incidents themselves are real recordings (`tracer-userspace/fixtures/recorded/`,
//! `tests/recorded.rs`). Builders stay for what a recording on this host
//! cannot produce, or not on demand: events reordered or lost on the way
//! from the kernel, eviction and evidence caps, the kprobe backend's
//! `BR_FORWARD` without tc beside it and NAT-only netfilter events (the
//! guests' kprobe recordings always have tc too), drops at exact moments
//! relative to the reply timeout, and node layouts (VRF, bond, Calico) the
//! lab does not build.
use tracer_common::{PacketEvent, direction, hook, nat_stage, nf_hook, proto, tcp_flags};

pub use super::testing::*;

pub const CLIENT_NS: u32 = 4026532300;
pub const BACKEND_NS: u32 = 4026532400;
pub const DNS_NS: u32 = 4026532500;

/// A pod's own eth0, inside its namespace.
pub const POD_ETH0: u32 = 3;

pub const NO_SOCKET: u32 = 3;
pub const NETFILTER_DROP: u32 = 12;

pub const CLIENT: ([u8; 4], u16) = ([100, 96, 54, 240], 43534);
pub const BACKEND: ([u8; 4], u16) = ([100, 96, 54, 247], 80);
pub const REMOTE_BACKEND: ([u8; 4], u16) = ([100, 96, 12, 5], 80);
pub const DNS_CLIENT: ([u8; 4], u16) = ([100, 96, 54, 240], 40001);
pub const DNS_BACKEND: ([u8; 4], u16) = ([10, 200, 2, 177], 53);
pub const OFFICE_CLIENT: ([u8; 4], u16) = ([192, 168, 50, 10], 51000);

const US: u64 = 1_000;
const MS: u64 = 1_000_000;
pub const T0: u64 = 5_000_000_000;

/// Where an event was taken.
#[derive(Clone, Copy)]
pub struct At {
    hook: u8,
    nf_hook: u8,
    nat_stage: u8,
    netns: u32,
    ifindex: u32,
    drop_reason: u32,
}

const fn at(hook: u8, netns: u32, ifindex: u32) -> At {
    At {
        hook,
        nf_hook: nf_hook::NONE,
        nat_stage: nat_stage::NONE,
        netns,
        ifindex,
        drop_reason: 0,
    }
}

pub fn tc_in(ifindex: u32) -> At {
    at(hook::TC_INGRESS, NODE_NS, ifindex)
}
pub fn tc_out(ifindex: u32) -> At {
    at(hook::TC_EGRESS, NODE_NS, ifindex)
}
pub fn rx(netns: u32, ifindex: u32) -> At {
    at(hook::DEV_RX, netns, ifindex)
}
pub fn tx(netns: u32, ifindex: u32) -> At {
    at(hook::DEV_TX, netns, ifindex)
}
pub fn nf(h: u8, stage: u8) -> At {
    At {
        nf_hook: h,
        nat_stage: stage,
        ..at(hook::NETFILTER, NODE_NS, 0)
    }
}
pub fn drop(netns: u32, ifindex: u32, reason: u32) -> At {
    At {
        drop_reason: reason,
        ..at(hook::DROP, netns, ifindex)
    }
}

type Ep = ([u8; 4], u16);
/// A point and the packet's tuple there.
pub type Hop = (At, Ep, Ep);

/// One packet: the identity fields shared by all its events.
#[derive(Clone, Copy)]
pub struct Pkt {
    pub proto: u8,
    pub flags: u8,
    pub seq: u32,
    pub ack: u32,
    pub ip_id: u16,
    pub payload_head: u32,
    pub skb: u64,
    pub dir: u8,
}

pub fn tcp(flags: u8, seq: u32, ack: u32, ip_id: u16, skb: u64, dir: u8) -> Pkt {
    Pkt {
        proto: proto::TCP,
        flags,
        seq,
        ack,
        ip_id,
        payload_head: 0,
        skb,
        dir,
    }
}

pub fn udp(dns_id: u16, response: bool, skb: u64, dir: u8) -> Pkt {
    let flags: u16 = if response { 0x8180 } else { 0x0100 };
    let payload_head = (u32::from(dns_id) << 16) | u32::from(flags);
    Pkt {
        proto: proto::UDP,
        flags: 0,
        seq: 0,
        ack: 0,
        ip_id: 0,
        payload_head,
        skb,
        dir,
    }
}

#[derive(Default)]
pub struct Builder {
    pub events: Vec<PacketEvent>,
}

impl Builder {
    /// Events of one packet, `step` apart from `t`; each hop gives the point
    /// and the tuple there. Returns the time after the last hop.
    pub fn path(&mut self, p: Pkt, t: u64, hops: &[Hop]) -> u64 {
        let mut ts = t;
        for &(a, src, dst) in hops {
            self.events.push(PacketEvent {
                ts_ns: ts,
                skb: p.skb,
                netns: a.netns,
                ifindex: a.ifindex,
                saddr: tracer_common::v4_mapped(src.0),
                daddr: tracer_common::v4_mapped(dst.0),
                sport: src.1,
                dport: dst.1,
                seq: p.seq,
                ack: p.ack,
                drop_reason: a.drop_reason,
                payload_head: p.payload_head,
                ip_len: if p.proto == proto::TCP { 60 } else { 70 },
                ip_id: p.ip_id,
                hook: a.hook,
                nf_hook: a.nf_hook,
                nat_stage: a.nat_stage,
                proto: p.proto,
                tcp_flags: p.flags,
                direction: p.dir,
                svc: 0,
                flags: 0,
                good: 0,
                _reserved: 0,
                ..PacketEvent::default()
            });
            ts += 3 * US;
        }
        ts
    }

    /// [`Builder::path`] through consecutive stretches of the way.
    pub fn route(&mut self, p: Pkt, t: u64, legs: &[&[Hop]]) -> u64 {
        self.path(p, t, &legs.concat())
    }
}

use direction::{REPLY, REQUEST};
use nat_stage::{AFTER, BEFORE, NONE};
use nf_hook::{FORWARD, POST_ROUTING, PRE_ROUTING};

/// A packet leaving a pod: its eth0, then the node's end of its veth.
pub fn from_pod(netns: u32, veth: u32, src: Ep, dst: Ep) -> [Hop; 2] {
    [(tx(netns, POD_ETH0), src, dst), (tc_in(veth), src, dst)]
}

/// A packet entering a pod: the node's end of its veth, then its eth0.
pub fn to_pod(veth: u32, netns: u32, src: Ep, dst: Ep) -> [Hop; 2] {
    [(tc_out(veth), src, dst), (rx(netns, POD_ETH0), src, dst)]
}

/// Netfilter's hooks on a forwarded packet: PREROUTING turns `dst` into
/// `dnat_dst` (DNAT, or the reply's reverse SNAT), POSTROUTING turns `src`
/// into `snat_src` (masquerade, or the reply's reverse DNAT).
pub fn forwarded(src: Ep, dst: Ep, dnat_dst: Ep, snat_src: Ep) -> [Hop; 5] {
    [
        (nf(PRE_ROUTING, BEFORE), src, dst),
        (nf(PRE_ROUTING, AFTER), src, dnat_dst),
        (nf(FORWARD, NONE), src, dnat_dst),
        (nf(POST_ROUTING, BEFORE), src, dnat_dst),
        (nf(POST_ROUTING, AFTER), snat_src, dnat_dst),
    ]
}

/// A pod's request to the Service, DNATed at PREROUTING, leaving by `out_if`.
fn request_via_node(
    b: &mut Builder,
    p: Pkt,
    t: u64,
    client: Ep,
    svc: Ep,
    backend: Ep,
    out_if: u32,
) -> u64 {
    let mut hops = [
        &from_pod(CLIENT_NS, VETH_CLIENT, client, svc)[..],
        &[
            (rx(NODE_NS, VETH_CLIENT), client, svc),
            (rx(NODE_NS, CNI0), client, svc),
        ],
        &forwarded(client, svc, backend, client),
        &[(tc_out(out_if), client, backend)],
    ]
    .concat();
    if out_if == VETH_BACKEND {
        hops.push((rx(BACKEND_NS, POD_ETH0), client, backend));
    }
    b.path(p, t, &hops)
}

/// Seed 000 on the same node. `bridge_nf`: whether br_netfilter runs the
/// IPv4 hooks for the bridged SYN-ACK (and so reverse-NATs it).
pub fn seed000_same_node(bridge_nf: bool) -> Vec<PacketEvent> {
    let mut b = Builder::default();
    let (c, s, be) = (CLIENT, SVC, BACKEND);
    let isn = 1_000_000;
    let risn = 7_000_000;
    for (round, t) in [(0u16, T0), (1, T0 + 1_000 * MS)] {
        let syn = tcp(
            tcp_flags::SYN,
            isn,
            0,
            100 + round,
            0xffff_8880_0000_1000 + u64::from(round),
            REQUEST,
        );
        let t1 = request_via_node(&mut b, syn, t, c, s, be, VETH_BACKEND);
        let synack_flags = tcp_flags::SYN | tcp_flags::ACK;
        let synack = tcp(
            synack_flags,
            risn,
            isn + 1,
            0,
            0xffff_8880_0000_2000 + u64::from(round),
            REPLY,
        );
        let t2 = t1 + 40 * US;
        let from_backend = [
            &from_pod(BACKEND_NS, VETH_BACKEND, be, c)[..],
            &[(rx(NODE_NS, VETH_BACKEND), be, c)],
        ]
        .concat();
        if bridge_nf {
            let t3 = b.route(
                synack,
                t2,
                &[
                    &from_backend,
                    &forwarded(be, c, c, s),
                    &to_pod(VETH_CLIENT, CLIENT_NS, s, c),
                ],
            );
            if round == 0 {
                let ack = tcp(
                    tcp_flags::ACK,
                    isn + 1,
                    risn + 1,
                    101,
                    0xffff_8880_0000_3000,
                    REQUEST,
                );
                request_via_node(&mut b, ack, t3 + 20 * US, c, s, be, VETH_BACKEND);
            }
            // The healthy client never needs a retransmit.
            break;
        }
        let t3 = b.route(
            synack,
            t2,
            &[
                &from_backend,
                &to_pod(VETH_CLIENT, CLIENT_NS, be, c),
                &[(drop(CLIENT_NS, POD_ETH0, NO_SOCKET), be, c)],
            ],
        );
        // The client answers the unknown SYN-ACK with RST (conntrack: INVALID, not NATed).
        let rst = tcp(
            tcp_flags::RST,
            isn + 1,
            0,
            0,
            0xffff_8880_0000_4000 + u64::from(round),
            REQUEST,
        );
        b.route(
            rst,
            t3 + 10 * US,
            &[
                &from_pod(CLIENT_NS, VETH_CLIENT, c, be),
                &[(rx(NODE_NS, VETH_CLIENT), c, be)],
                &to_pod(VETH_BACKEND, BACKEND_NS, c, be),
            ],
        );
    }
    b.events
}

/// The SYN of a connection from the client pod to [`REMOTE_BACKEND`] over
/// flannel.1, with its ISN, IP ID and skb, and the SYN-ACK that answers it
/// (skb `syn_skb + 0x1000`), due one overlay round trip later: (SYN-ACK, time).
fn cross_node_syn(b: &mut Builder, isn: u32, risn: u32, ip_id: u16, syn_skb: u64) -> (Pkt, u64) {
    let syn = tcp(tcp_flags::SYN, isn, 0, ip_id, syn_skb, REQUEST);
    let t1 = request_via_node(b, syn, T0, CLIENT, SVC, REMOTE_BACKEND, FLANNEL);
    let synack_flags = tcp_flags::SYN | tcp_flags::ACK;
    let synack = tcp(synack_flags, risn, isn + 1, 0, syn_skb + 0x1000, REPLY);
    (synack, t1 + 400 * US)
}

/// Client pod on this node, backend on another node over flannel.1; the reply
/// is routed (not bridged), so netfilter reverse-NATs it at POSTROUTING.
pub fn cross_node_ok() -> Vec<PacketEvent> {
    let mut b = Builder::default();
    let (c, s, be) = (CLIENT, SVC, REMOTE_BACKEND);
    let (synack, t) = cross_node_syn(&mut b, 500, 900, 7, 0xffff_8880_0001_0000);
    let t2 = b.route(
        synack,
        t,
        &[
            &[(tc_in(FLANNEL), be, c)],
            &forwarded(be, c, c, s),
            &to_pod(VETH_CLIENT, CLIENT_NS, s, c),
        ],
    );
    let ack = tcp(tcp_flags::ACK, 501, 901, 8, 0xffff_8880_0001_2000, REQUEST);
    request_via_node(&mut b, ack, t2 + 20 * US, c, s, be, FLANNEL);
    b.events
}

/// Seed 001: a DNS query to the Service; the server pod is on the same node.
pub fn dns(bridge_nf: bool) -> Vec<PacketEvent> {
    let mut b = Builder::default();
    let (c, s, be) = (DNS_CLIENT, DNS_SVC, DNS_BACKEND);
    let q = udp(0x1234, false, 0xffff_8880_0002_0000, REQUEST);
    let t1 = b.route(
        q,
        T0,
        &[
            &from_pod(CLIENT_NS, VETH_CLIENT, c, s),
            &forwarded(c, s, be, c),
            &to_pod(VETH_DNS, DNS_NS, c, be),
        ],
    );
    let r = udp(0x1234, true, 0xffff_8880_0002_1000, REPLY);
    let from_server = from_pod(DNS_NS, VETH_DNS, be, c);
    let t = t1 + 200 * US;
    if bridge_nf {
        b.route(
            r,
            t,
            &[
                &from_server,
                &forwarded(be, c, c, s),
                &to_pod(VETH_CLIENT, CLIENT_NS, s, c),
            ],
        );
    } else {
        // dig's unconnected socket takes it, then complains about the source.
        b.route(
            r,
            t,
            &[&from_server, &to_pod(VETH_CLIENT, CLIENT_NS, be, c)],
        );
    }
    b.events
}

/// Seed 003 seen from node B: an office client's SYN comes in on eth0, is
/// DNATed to a pod on node A and leaves by flannel.1; the reply takes
/// another way back. SYN retransmits at 1 s and 3 s.
pub fn no_reply() -> Vec<PacketEvent> {
    let mut b = Builder::default();
    let (c, s, be) = (OFFICE_CLIENT, SVC, REMOTE_BACKEND);
    for (i, dt) in [0, 1_000 * MS + 50 * US, 3_000 * MS + 80 * US]
        .into_iter()
        .enumerate()
    {
        let syn = tcp(
            tcp_flags::SYN,
            42,
            0,
            300 + i as u16,
            0xffff_8880_0003_0000 + i as u64,
            REQUEST,
        );
        b.route(
            syn,
            T0 + dt,
            &[
                &[(tc_in(ETH0), c, s), (rx(NODE_NS, ETH0), c, s)],
                &forwarded(c, s, be, c),
                &[(tc_out(FLANNEL), c, be)],
            ],
        );
    }
    b.events
}

/// Cross-node connection whose SYN-ACK a filter rule drops in FORWARD.
pub fn reply_dropped() -> Vec<PacketEvent> {
    let mut b = Builder::default();
    let (c, s, be) = (CLIENT, SVC, REMOTE_BACKEND);
    let (synack, t) = cross_node_syn(&mut b, 800, 1200, 9, 0xffff_8880_0004_0000);
    b.route(
        synack,
        t,
        &[
            &[(tc_in(FLANNEL), be, c)],
            // Dropped in FORWARD: POSTROUTING never sees it.
            &forwarded(be, c, c, s)[..3],
            &[(drop(NODE_NS, FLANNEL, NETFILTER_DROP), be, c)],
        ],
    );
    b.events
}

/// Shuffles events the way per-CPU ring-buffer writes arrive: neighbours
/// within `max_skew_ns` of each other swapped, deterministically.
pub fn reorder(mut events: Vec<PacketEvent>, max_skew_ns: u64) -> Vec<PacketEvent> {
    let mut i = 0;
    while i + 2 < events.len() {
        if events[i + 2].ts_ns - events[i].ts_ns <= max_skew_ns {
            events.swap(i, i + 2);
        }
        i += 3;
    }
    events
}

pub fn duplicate(events: Vec<PacketEvent>) -> Vec<PacketEvent> {
    events
        .into_iter()
        .enumerate()
        .flat_map(|(i, e)| std::iter::repeat_n(e, 1 + usize::from(i % 2 == 0)))
        .collect()
}

pub fn to_jsonl(events: &[PacketEvent]) -> String {
    events
        .iter()
        .map(|e| serde_json::to_string(e).expect("event serializes") + "\n")
        .collect()
}

/// (file name, builder): the fixture files under `tracer-userspace/fixtures/`.
pub fn all() -> Vec<(&'static str, Vec<PacketEvent>)> {
    vec![
        ("seed000_broken.jsonl", seed000_same_node(false)),
        ("seed000_healthy.jsonl", seed000_same_node(true)),
        ("cross_node_ok.jsonl", cross_node_ok()),
        ("dns_broken.jsonl", dns(false)),
        ("dns_ok.jsonl", dns(true)),
        ("no_reply.jsonl", no_reply()),
        ("reply_dropped.jsonl", reply_dropped()),
    ]
}

/// A pod's SYN to its own Service, DNATed back to itself, that the bridge
/// does not send back out of the port it came in by (hairpin_mode off, or
/// no bridge at all).
pub fn hairpin_syn_not_sent_back() -> Builder {
    let mut b = Builder::default();
    let me = CLIENT;
    let me_backend = (CLIENT.0, 80);
    let syn = tcp(tcp_flags::SYN, 10, 0, 1, 0x50, REQUEST);
    b.route(
        syn,
        T0,
        &[
            &from_pod(CLIENT_NS, VETH_CLIENT, me, SVC),
            &forwarded(me, SVC, me_backend, me)[..2],
        ],
    );
    b
}
