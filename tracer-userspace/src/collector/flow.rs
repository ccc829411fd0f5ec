//! One flow (client ip:port + Service ip:port + proto) across the NAT: its
//! packets, each with the events seen at every observation point, and what
//! those events taught us (backend, masquerade address, where the client is).
use tracer_common::{
    PacketEvent, direction, event_flags, hook, nat_stage, nf_hook, proto, tcp_flags,
};

use super::{
    drop_reason::KnownReasons,
    types::{Dir, Endpoint, Obs, PacketKey, PairKey, in_node, node_egress, node_ingress},
};

/// Tuples a flow can be seen with: client→Service, client→backend,
/// masqueraded→backend, plus one spare (e.g. a second SNAT).
pub(crate) const MAX_PAIRS: usize = 4;

/// How long after a request vanished inside the node (queued for neighbour
/// resolution) its NEIGH_FAILED drop can still arrive: 3 probes × 1 s
/// (arp_tbl defaults, net/ipv4/arp.c) plus timer slack.
pub(crate) const NEIGH_FAIL_WAIT_NS: u64 = 3_500_000_000;

/// How far back in a flow's packets to look for the packet an event belongs
/// to: events of one packet are microseconds apart, so the newest few suffice.
const PACKET_SEARCH_DEPTH: usize = 16;

/// Collector-wide settings a flow needs while taking events.
pub(crate) struct FlowCtx<'a> {
    pub node_netns: u32,
    pub packet_gap_ns: u64,
    pub settle_ns: u64,
    pub max_packets: usize,
    pub max_obs: usize,
    pub known: &'a KnownReasons,
}

impl FlowCtx<'_> {
    pub fn is_node(&self, netns: u32) -> bool {
        in_node(netns, self.node_netns)
    }
}

/// Which of the flow's endpoints one end of a pair is. backend and snat
/// are set once, so what an `End` names never changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    Client,
    Service,
    Backend,
    Snat,
    /// `Flow::extra[i]`: at most two per pair.
    Extra(u8),
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Packet {
    pub key: PacketKey,
    pub dir: Dir,
    pub first_ts: u64,
    pub last_ts: u64,
    /// Seen at a point of the traced node namespace (tc, netfilter, or a
    /// device there): the node handled this packet.
    pub in_node: bool,
    /// A RST the kernel flagged `event_flags::AFTER_FIN`: the backend had
    /// closed the connection with its FIN before.
    pub after_fin: bool,
}

/// The first reply event at the client side: what decides `ok` vs `reply_not_reverse_nated`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ClientReply {
    pub packet: u8,
    pub obs: u16,
    pub reverse_nated: bool,
}

/// `add_event` was handed an event the flow already holds.
struct Duplicate;

/// What adding an event changed, for the collector's indexes.
#[derive(Default)]
pub(crate) struct Added {
    pub duplicate: bool,
    pub new_pair: Option<PairKey>,
    pub new_packet: Option<(u64, PacketKey)>,
    pub decidable_at: Option<u64>,
}

#[derive(Debug)]
pub(crate) struct Flow {
    pub proto: u8,
    pub client: Endpoint,
    pub service: Endpoint,
    /// Destination after DNAT.
    pub backend: Option<Endpoint>,
    /// Source after SNAT/MASQUERADE.
    pub snat: Option<Endpoint>,
    /// ISN of the SYN that opened the flow: a SYN with another ISN from the
    /// same client port is a new connection.
    pub syn_seq: Option<u32>,
    pub first_ts: u64,
    pub last_ts: u64,
    /// Namespace of the client (where its request was transmitted), 0 = unknown/none.
    pub client_netns: u32,
    /// Interface of the node namespace where the request entered (client's
    /// bridge port, or the uplink for off-node clients), 0 = unknown.
    pub client_ifindex: u32,
    /// The request came from a process of the node namespace (nat OUTPUT).
    pub client_local: bool,
    pub client_rst: bool,
    /// Raw tracepoints see every namespace of the kernel: a flow that never
    /// touched the traced node (another node on the same kernel) is foreign.
    pub seen_in_node: bool,
    /// Tuples seen, as the roles of their two ends (see [`Ends`]): a pair's
    /// endpoints are the flow's own, so storing them again would cost
    /// 4 × 42 bytes a flow.
    pairs: [(End, End); MAX_PAIRS],
    npairs: u8,
    /// Endpoints of pairs that hold no role of the flow (rare: a second
    /// SNAT, a reply from elsewhere). Boxed: 8 bytes in every flow.
    #[expect(
        clippy::box_collection,
        reason = "8 bytes in every flow instead of a Vec's 24, for what few flows have"
    )]
    extra: Option<Box<Vec<Endpoint>>>,
    pub client_reply: Option<ClientReply>,
    pub reported: bool,
    /// Evidence hit the per-flow caps; later packets were not recorded.
    pub truncated: bool,
    /// Pushed out by the live-flow limit before its verdict was certain.
    pub evicted: bool,
    /// Its first event was the opening request (a SYN, a UDP request) from
    /// the client, once every program was attached: else a missing reply
    /// proves nothing ([`super::Verdict::Unseen`]).
    pub opening_seen: bool,
    /// The kernel holds its next events (event_flags::HOLDING) until the
    /// flow proves healthy or not, or userspace pulls them at its deadline.
    pub held: bool,
    /// Set once the opening was reported `ok`: the rest of the connection
    /// is watched (`established.rs`).
    pub watch: Option<Watch>,
    pub packets: Vec<Packet>,
    pub obs: Vec<Obs>,
    /// ICMP errors about the flow's packets (`icmp.rs`). Boxed: 8 bytes in
    /// every flow for what few flows have.
    #[expect(
        clippy::box_collection,
        reason = "8 bytes in every flow instead of a Vec's 24, for what few flows have"
    )]
    pub icmp: Option<Box<Vec<IcmpObs>>>,
}

/// A decided flow's evidence vectors, emptied, for a new flow: their
/// allocation when a flow opens and their free when it is decided were
/// ~650 of the ~10k instructions a healthy connection costs the collector
/// (issue 25, callgrind). The collector keeps a few ([`Buffers::worth_keeping`]).
pub struct Buffers {
    packets: Vec<Packet>,
    obs: Vec<Obs>,
}

impl Buffers {
    /// Small enough to keep: a long flow's vectors are freed, not hoarded.
    pub(crate) fn worth_keeping(&self) -> bool {
        self.obs.capacity() <= 32 && self.packets.capacity() <= 8
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        self.packets.capacity() * size_of::<Packet>() + self.obs.capacity() * size_of::<Obs>()
    }
}

impl Flow {
    /// A DNATed flow's conntrack tuple as its client sent it, and the
    /// client → backend one that an entry made mid-stream without NAT holds
    /// as its reply direction (crate::ctnetlink).
    pub fn ct_tuples(&self) -> Option<(crate::ctnetlink::CtTuple, crate::ctnetlink::CtTuple)> {
        use crate::ctnetlink::CtTuple;
        use std::net::SocketAddr;
        let backend = self.backend?;
        let client = SocketAddr::new(self.client.addr, self.client.port);
        let tuple = |to: Endpoint| CtTuple {
            proto: self.proto,
            src: client,
            dst: SocketAddr::new(to.addr, to.port),
        };
        Some((tuple(self.service), tuple(backend)))
    }

    #[cfg(test)]
    pub fn new(ev: &PacketEvent) -> Self {
        Self::reusing(ev, None)
    }

    /// A new flow whose evidence goes into a decided flow's emptied
    /// vectors, when there is one ([`Buffers`]).
    pub(crate) fn reusing(ev: &PacketEvent, spare: Option<Buffers>) -> Self {
        let Buffers { packets, obs } = spare.unwrap_or_else(|| Buffers {
            packets: Vec::with_capacity(4),
            // Grown as needed (4, 8, 16, ...): a healthy flow whose hops the
            // kernel buffers sends 2 events, a full path ~32.
            obs: Vec::new(),
        });
        let client = Endpoint::src(ev);
        let service = Endpoint::dst(ev);
        let syn = ev.proto == proto::TCP && ev.tcp_flags & tcp_flags::SYN != 0;
        Self {
            proto: ev.proto,
            client,
            service,
            backend: None,
            snat: None,
            syn_seq: syn.then_some(ev.seq),
            first_ts: ev.ts_ns,
            last_ts: ev.ts_ns,
            client_netns: 0,
            client_ifindex: 0,
            client_local: false,
            client_rst: false,
            seen_in_node: false,
            pairs: [(End::Client, End::Service); MAX_PAIRS],
            npairs: 1,
            extra: None,
            client_reply: None,
            reported: false,
            truncated: false,
            evicted: false,
            opening_seen: ev.direction == direction::REQUEST
                && match ev.proto {
                    proto::TCP => {
                        ev.tcp_flags & (tcp_flags::SYN | tcp_flags::ACK | tcp_flags::RST)
                            == tcp_flags::SYN
                    }
                    _ => true,
                },
            held: false,
            watch: None,
            packets,
            obs,
            icmp: None,
        }
    }

    /// Heap bytes of the flow's evidence and extra endpoints.
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        self.packets.capacity() * size_of::<Packet>()
            + self.obs.capacity() * size_of::<Obs>()
            + self.extra.as_ref().map_or(0, |v| {
                size_of::<Vec<Endpoint>>() + v.capacity() * size_of::<Endpoint>()
            })
            + self.icmp.as_ref().map_or(0, |v| {
                size_of::<Vec<IcmpObs>>() + v.capacity() * size_of::<IcmpObs>()
            })
    }

    pub fn pair_count(&self) -> usize {
        self.npairs as usize
    }

    pub fn pairs(&self) -> impl Iterator<Item = PairKey> + '_ {
        (0..self.pair_count()).filter_map(|i| self.pair(i))
    }

    pub fn pair(&self, i: usize) -> Option<PairKey> {
        let &(a, b) = self.pairs[..self.pair_count()].get(i)?;
        Some(PairKey::new(self.proto, self.end(a), self.end(b)))
    }

    fn end(&self, e: End) -> Endpoint {
        match e {
            End::Client => self.client,
            End::Service => self.service,
            // Set once, before any pair names it (`end_of`).
            End::Backend => self.backend.unwrap_or_default(),
            End::Snat => self.snat.unwrap_or_default(),
            End::Extra(i) => self
                .extra
                .as_ref()
                .and_then(|v| v.get(i as usize).copied())
                .unwrap_or_default(),
        }
    }

    /// The role of `ep` in this flow, adding it to the extra endpoints if it has none.
    fn end_of(&mut self, ep: Endpoint) -> End {
        if ep == self.client {
            End::Client
        } else if ep == self.service {
            End::Service
        } else if Some(ep) == self.backend {
            End::Backend
        } else if Some(ep) == self.snat {
            End::Snat
        } else {
            let extra = self.extra.get_or_insert_with(Box::default);
            let i = match extra.iter().position(|&e| e == ep) {
                Some(i) => i,
                None => {
                    extra.push(ep);
                    extra.len() - 1
                }
            };
            End::Extra(i as u8)
        }
    }

    pub fn packet_obs(&self, packet: u8) -> impl Iterator<Item = &Obs> + '_ {
        self.obs.iter().filter(move |o| o.packet == packet)
    }

    /// Lets go of the evidence once the verdict is out; the flow stays only
    /// to absorb its remaining packets until it goes idle. Its vectors,
    /// emptied, are handed back for the next flow.
    pub fn drop_evidence(&mut self) -> Buffers {
        self.icmp = None;
        let mut b = Buffers {
            packets: std::mem::take(&mut self.packets),
            obs: std::mem::take(&mut self.obs),
        };
        b.packets.clear();
        b.obs.clear();
        b
    }

    pub fn add_event(&mut self, ev: &PacketEvent, key: PacketKey, ctx: &FlowCtx<'_>) -> Added {
        let mut out = Added::default();
        self.last_ts = self.last_ts.max(ev.ts_ns);
        if self.reported {
            return out;
        }
        let probe = Obs::new(ev, 0);
        let found = match self.find_packet(ev, key, &probe, ctx) {
            Ok(found) => found,
            Err(Duplicate) => {
                out.duplicate = true;
                return out;
            }
        };
        let Some((idx, prev)) = self.packet_slot(ev, key, found, ctx, &mut out) else {
            return out;
        };
        if self.obs.len() >= ctx.max_obs.min(u16::MAX as usize) {
            self.truncated = true;
            return out;
        }
        let obs = Obs {
            packet: idx,
            ..probe
        };
        // A healthy held flow's reply arrives alone: the kernel discarded
        // its events in the node and says that it crossed it. So does the
        // watch's reply at the client of an established flow: its hops in
        // the node were muted, as those of every reply since its `ok`
        // opening, whose replies crossed this node (established.rs).
        // A watched drop on a device of the node namespace was the node's.
        let watched = ev.flags & event_flags::WATCH != 0
            && (ev.hook == hook::DEV_RX
                || (ev.hook == hook::DROP && ev.netns != 0 && ev.netns == ctx.node_netns));
        if ev.flags & event_flags::AFTER_FIN != 0 {
            self.packets[idx as usize].after_fin = true;
        }
        if observed_in_node(&obs, ctx) || ev.flags & event_flags::VIA_NODE != 0 || watched {
            self.packets[idx as usize].in_node = true;
            self.seen_in_node = true;
        }
        match self.packets[idx as usize].dir {
            Dir::Request => self.learn_from_request(ev, &obs, prev.as_ref(), ctx),
            Dir::Reply => {
                if self.client_reply.is_none() && self.is_client_side(&obs, ctx) {
                    self.client_reply = Some(ClientReply {
                        packet: idx,
                        obs: self.obs.len() as u16,
                        reverse_nated: obs.src == self.service,
                    });
                    // Wait a little: the client's reaction (drop, RST, ACK) belongs in the evidence.
                    out.decidable_at = Some(ev.ts_ns + ctx.settle_ns);
                }
            }
        }
        self.obs.push(obs);
        let pair = PairKey::new(self.proto, obs.src, obs.dst);
        if self.pair_count() < MAX_PAIRS && !self.pairs().any(|p| p == pair) {
            // backend and snat are learned above, before the pair names them.
            let ends = (self.end_of(obs.src), self.end_of(obs.dst));
            self.pairs[self.pair_count()] = ends;
            self.npairs += 1;
            out.new_pair = Some(pair);
        }
        out
    }

    /// The recent packet with this key and time whose evidence has no event
    /// at this point yet, if any; `Duplicate` if this very event is there.
    fn find_packet(
        &self,
        ev: &PacketEvent,
        key: PacketKey,
        probe: &Obs,
        ctx: &FlowCtx<'_>,
    ) -> Result<Option<u8>, Duplicate> {
        // A packet queued on a neighbour entry is freed (NEIGH_FAILED) only
        // when resolution gives up, seconds later (checks/backend.rs): its
        // drop still belongs to it.
        let late_gap = if ev.hook == hook::DROP {
            ctx.packet_gap_ns.max(NEIGH_FAIL_WAIT_NS)
        } else {
            ctx.packet_gap_ns
        };
        for (i, p) in self
            .packets
            .iter()
            .enumerate()
            .rev()
            .take(PACKET_SEARCH_DEPTH)
        {
            if p.key != key
                || ev.ts_ns + ctx.packet_gap_ns < p.first_ts
                || ev.ts_ns > p.last_ts + late_gap
            {
                continue;
            }
            let idx = i as u8;
            let mut clash = false;
            for o in self.packet_obs(idx) {
                if *o
                    == (Obs {
                        packet: idx,
                        ..*probe
                    })
                {
                    return Err(Duplicate);
                }
                clash |= o.same_point(probe);
            }
            if !clash {
                return Ok(Some(idx));
            }
        }
        Ok(None)
    }

    /// The packet found (its times widened to the event, with its last
    /// observation), or a new one; None when the flow holds its maximum.
    fn packet_slot(
        &mut self,
        ev: &PacketEvent,
        key: PacketKey,
        found: Option<u8>,
        ctx: &FlowCtx<'_>,
        out: &mut Added,
    ) -> Option<(u8, Option<Obs>)> {
        match found {
            Some(idx) => {
                let p = &mut self.packets[idx as usize];
                p.last_ts = p.last_ts.max(ev.ts_ns);
                p.first_ts = p.first_ts.min(ev.ts_ns);
                Some((idx, self.packet_obs(idx).last().copied()))
            }
            None => {
                if self.packets.len() >= ctx.max_packets.min(u8::MAX as usize) {
                    self.truncated = true;
                    return None;
                }
                let dir = self.classify(ev);
                self.packets.push(Packet {
                    key,
                    dir,
                    first_ts: ev.ts_ns,
                    last_ts: ev.ts_ns,
                    in_node: false,
                    after_fin: false,
                });
                out.new_packet = Some((ev.skb, key));
                Some(((self.packets.len() - 1) as u8, None))
            }
        }
    }

    fn classify(&self, ev: &PacketEvent) -> Dir {
        let (src, dst) = (Endpoint::src(ev), Endpoint::dst(ev));
        if src == self.client || Some(src) == self.snat {
            Dir::Request
        } else if dst == self.client
            || Some(dst) == self.snat
            // Neither end known yet (NAT rewrote both): trust the kernel's match.
            || ev.direction == tracer_common::direction::REPLY
        {
            Dir::Reply
        } else {
            Dir::Request
        }
    }

    fn learn_from_request(
        &mut self,
        ev: &PacketEvent,
        obs: &Obs,
        prev: Option<&Obs>,
        ctx: &FlowCtx<'_>,
    ) {
        if let Some(prev) = prev {
            // The same packet with another tuple than at its previous hook: NAT ran in between.
            if obs.dst != prev.dst && obs.dst != self.service && self.backend.is_none() {
                self.backend = Some(obs.dst);
            }
            if obs.src != prev.src && obs.src != self.client && self.snat.is_none() {
                self.snat = Some(obs.src);
            }
        }
        let node = ctx.is_node(obs.netns);
        if !node && obs.hook == hook::DEV_TX && obs.src == self.client && self.client_netns == 0 {
            self.client_netns = obs.netns;
        }
        if node && self.client_ifindex == 0 && !self.client_local {
            if node_ingress(obs.hook) {
                self.client_ifindex = obs.ifindex;
            } else if obs.hook == hook::NETFILTER && obs.nf_hook == nf_hook::LOCAL_OUT {
                self.client_local = true;
            }
        }
        if ev.proto == proto::TCP && ev.tcp_flags & tcp_flags::RST != 0 && obs.src == self.client {
            self.client_rst = true;
        }
    }

    /// Where the reply is past everything this node does to it: in the
    /// client's namespace, on the interface the request came in by, or at
    /// INPUT after NAT for a node-local client.
    fn is_client_side(&self, obs: &Obs, ctx: &FlowCtx<'_>) -> bool {
        let node = ctx.is_node(obs.netns);
        match obs.hook {
            hook::DEV_RX | hook::DROP if !node => {
                // A reply this node never handled came back another way: it
                // says nothing about this node's NAT (seed 003 seen from the
                // DNATing node) — unless it never left the client's own
                // namespace (hairpin without masquerade).
                let via_node = self.packets[obs.packet as usize].in_node;
                self.client_netns != 0
                    && obs.netns == self.client_netns
                    && obs.dst == self.client
                    && (via_node || obs.src.addr == self.client.addr)
            }
            h if node && node_egress(h) => {
                self.client_ifindex != 0 && obs.ifindex == self.client_ifindex
            }
            hook::NETFILTER if node && self.client_local => {
                obs.nf_hook == nf_hook::LOCAL_IN && obs.nat_stage == nat_stage::AFTER
            }
            hook::DROP if node && self.client_local => {
                obs.dst == self.client && ctx.known.is_drop(obs.drop_reason)
            }
            _ => false,
        }
    }
}

/// tc and netfilter run only in the traced namespace; device events count
/// when they are on one of its interfaces. Drops do not: a drop without a
/// device has no namespace.
fn observed_in_node(obs: &Obs, ctx: &FlowCtx<'_>) -> bool {
    match obs.hook {
        hook::TC_INGRESS | hook::TC_EGRESS | hook::NETFILTER | hook::BR_FORWARD => {
            ctx.is_node(obs.netns)
        }
        hook::DEV_RX | hook::DEV_TX => obs.netns != 0 && obs.netns == ctx.node_netns,
        _ => false,
    }
}

/// The watch of one flow, kept on the flow after its opening was `ok`
/// (24 bytes: every `ok` flow carries one until it goes idle).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Watch {
    /// When the opening was decided `ok`.
    pub ok_ts: u64,
    /// The first failure's time; 0 while none.
    pub failed_ts: u64,
    /// Reverse-NATed replies at the client: seen here after the `ok`
    /// (events the kernel did not mute), then at the first failure the
    /// larger of that and the kernel's count.
    pub good: u32,
    /// The established report is out (one per flow).
    pub reported: bool,
    /// A RST of the flow was seen while it was healthy: the connection was
    /// closed by an endpoint (an abort, SO_LINGER 0), and what follows (a
    /// segment in flight reaching the closed socket: NO_SOCKET, a bare
    /// RST back) is its aftermath, not a failure.
    pub closed: bool,
    /// The FINs seen while healthy (`tracer_common::fins` bits, as the
    /// kernel's watch keeps them): after both, the close's aftermath
    /// (`established::closing`) is no failure.
    pub fins: u8,
}

impl Watch {
    pub fn failed(&self) -> bool {
        self.failed_ts != 0
    }
}

/// Error events a flow keeps at most (each error packet is seen at
/// about ten points; a black hole repeats its error per retransmission).
const MAX_ICMP_OBS: usize = 64;

/// One event of an ICMP error about the flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct IcmpObs {
    /// Where it was seen, with the quote's endpoints as `src`/`dst`.
    pub obs: Obs,
    pub icmp_type: u8,
    pub code: u8,
    pub v6: bool,
    pub mtu: u32,
    pub from: std::net::IpAddr,
    /// The quoted packet's length, IP id and TCP seq: the same at every
    /// point (NAT rewrites none of them), so they name the error packet.
    pub quoted_len: u16,
    pub quoted_ip_id: u16,
    pub quoted_seq: u32,
}

impl IcmpObs {
    pub fn new(ev: &PacketEvent) -> Self {
        let from = crate::service::ip_of(ev.icmp_from);
        Self {
            obs: Obs::new(ev, 0),
            icmp_type: ev.icmp_type,
            code: ev.icmp_code,
            v6: crate::service::ip_of(ev.daddr).is_ipv6(),
            mtu: ev.icmp_mtu,
            from,
            quoted_len: ev.ip_len,
            quoted_ip_id: ev.ip_id,
            quoted_seq: ev.seq,
        }
    }

    pub(crate) fn same_error(&self, other: &IcmpObs) -> bool {
        self.icmp_type == other.icmp_type
            && self.code == other.code
            && self.quoted_len == other.quoted_len
            && self.quoted_ip_id == other.quoted_ip_id
            && self.quoted_seq == other.quoted_seq
    }

    pub fn is_too_big(&self) -> bool {
        tracer_common::icmp::is_too_big(self.v6, self.icmp_type, self.code)
    }

    pub fn is_port_unreachable(&self) -> bool {
        tracer_common::icmp::is_port_unreachable(self.v6, self.icmp_type, self.code)
    }
}

impl Flow {
    /// Keeps an error event; false when the flow holds its maximum.
    pub(crate) fn add_icmp(&mut self, ev: &PacketEvent) -> bool {
        self.last_ts = self.last_ts.max(ev.ts_ns);
        let list = self.icmp.get_or_insert_with(Box::default);
        if list.len() >= MAX_ICMP_OBS {
            self.truncated = true;
            return false;
        }
        let o = IcmpObs::new(ev);
        if list.contains(&o) {
            return false;
        }
        list.push(o);
        true
    }

    pub(crate) fn icmp_obs(&self) -> &[IcmpObs] {
        self.icmp.as_deref().map_or(&[], |v| v.as_slice())
    }
}
