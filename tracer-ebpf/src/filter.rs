//! The Service filter shared by every program (docs/DESIGN.md, "Kernel filter")
//! and event emission.
use aya_ebpf::helpers::bpf_ktime_get_ns;
use tracer_common::{
    EndpointKey, EndpointState, InflightPacket, PacketEvent, ServiceKey, direction, hook,
    nat_stage, prefilter, proto, stat, tcp_flags,
};

use crate::{ENDPOINTS, EVENTS, INFLIGHT, SERVICES, STATS};

/// BPF_NOEXIST: a concurrent first packet of the same flow on another CPU must
/// not reset the other's counters.
const BPF_NOEXIST: u64 = 1;
const EEXIST: i32 = 17;

/// IPv4 header as on the wire; byte arrays keep it alignment-free so it can be
/// overlaid on packet memory at any offset.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IpHdr {
    pub vihl: u8,
    pub tos: u8,
    pub tot_len: [u8; 2],
    pub id: [u8; 2],
    pub frag: [u8; 2],
    pub ttl: u8,
    pub proto: u8,
    pub csum: [u8; 2],
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
}

/// The first 20 bytes of a TCP header; UDP uses only the first 8 (ports).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct TcpHdr {
    pub sport: [u8; 2],
    pub dport: [u8; 2],
    pub seq: [u8; 4],
    pub ack: [u8; 4],
    pub doff: u8,
    pub flags: u8,
    pub rest: [u8; 6],
}

pub const UDP_HDR_LEN: usize = 8;

/// What every observation point extracts from a packet.
#[derive(Clone, Copy, Default)]
pub struct Packet {
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    pub sport: u16,
    pub dport: u16,
    pub seq: u32,
    pub ack: u32,
    pub payload_head: u32,
    pub ip_len: u16,
    pub ip_id: u16,
    pub proto: u8,
    pub tcp_flags: u8,
}

impl Packet {
    /// L3 fields of an IPv4 TCP/UDP first fragment, and the header length in
    /// bytes; None for anything we do not trace.
    #[inline(always)]
    pub fn from_ip(ip: &IpHdr) -> Option<(Packet, usize)> {
        let ihl = ((ip.vihl & 0x0f) as usize) * 4;
        if ip.vihl >> 4 != 4 || ihl < 20 {
            return None;
        }
        // Non-first fragments carry no L4 header.
        if (u16::from_be_bytes(ip.frag) & 0x1fff) != 0 {
            return None;
        }
        if ip.proto != proto::TCP && ip.proto != proto::UDP {
            return None;
        }
        let pkt = Packet {
            saddr: ip.saddr,
            daddr: ip.daddr,
            ip_len: u16::from_be_bytes(ip.tot_len),
            ip_id: u16::from_be_bytes(ip.id),
            proto: ip.proto,
            ..Default::default()
        };
        Some((pkt, ihl))
    }

    #[inline(always)]
    pub fn set_ports(&mut self, sport: [u8; 2], dport: [u8; 2]) {
        self.sport = u16::from_be_bytes(sport);
        self.dport = u16::from_be_bytes(dport);
    }

    /// Returns the TCP header length (where the payload starts).
    #[inline(always)]
    pub fn set_tcp(&mut self, tcp: &TcpHdr) -> usize {
        self.set_ports(tcp.sport, tcp.dport);
        self.seq = u32::from_be_bytes(tcp.seq);
        self.ack = u32::from_be_bytes(tcp.ack);
        self.tcp_flags = tcp.flags;
        ((tcp.doff >> 4) as usize) * 4
    }
}

/// Where a packet was seen.
#[derive(Clone, Copy, Default)]
pub struct Point {
    pub hook: u8,
    pub nf_hook: u8,
    pub nat_stage: u8,
    /// Kernel address of the sk_buff (0 if unknown).
    pub skb: u64,
    pub netns: u32,
    pub ifindex: u32,
    pub drop_reason: u32,
}

impl Point {
    #[inline(always)]
    pub fn new(hook: u8) -> Point {
        Point {
            hook,
            nf_hook: tracer_common::nf_hook::NONE,
            ..Default::default()
        }
    }
}

#[inline(always)]
pub fn stat_inc(index: u32) {
    if let Some(counter) = STATS.get_ptr_mut(index) {
        // Per-CPU slot: no other writer while this program runs on this CPU.
        unsafe { *counter += 1 };
    }
}

#[inline(always)]
fn key(addr: [u8; 4], port: u16, proto: u8) -> EndpointKey {
    EndpointKey {
        addr,
        port,
        proto,
        _pad: 0,
    }
}

/// The Service index of (addr, port, proto): an exact port entry, else the
/// Service's any-port entry (port 0).
#[inline(always)]
fn service_at(addr: [u8; 4], port: u16, proto: u8) -> Option<u8> {
    let slot = crate::prefilter::bits(&addr);
    if slot & prefilter::SERVICE == 0 {
        return None;
    }
    let mut k = ServiceKey {
        addr,
        port,
        proto,
        _pad: 0,
    };
    if let Some(svc) = unsafe { SERVICES.get(&k) } {
        return Some(*svc);
    }
    if slot & prefilter::ANY_PORT == 0 {
        return None;
    }
    k.port = 0;
    unsafe { SERVICES.get(&k) }.copied()
}

/// Finds (or, for a new client side, creates) the flow's endpoint state.
#[inline(always)]
fn endpoint(client: &EndpointKey, svc: u8) -> Option<*mut EndpointState> {
    if let Some(state) = ENDPOINTS.get_ptr_mut(client) {
        return Some(state);
    }
    let fresh = EndpointState {
        svc,
        ..Default::default()
    };
    // Before the entry exists: rules 2 and 3 look for it only where the
    // pre-filter says a client side may be.
    crate::prefilter::remember(&client.addr);
    if let Err(err) = ENDPOINTS.insert(client, &fresh, BPF_NOEXIST) {
        if err != -EEXIST {
            stat_inc(stat::FLOW_MAP_FULL);
            return None;
        }
    }
    ENDPOINTS.get_ptr_mut(client)
}

/// How the filter matched a packet (rules 1-4 of DESIGN.md).
struct Match {
    dir: u8,
    svc: u8,
    state: Option<*mut EndpointState>,
}

/// Rules 1-4 of DESIGN.md, in order. Only reads the packet's addresses and
/// ports: this is the path every packet of the node takes.
#[inline(always)]
fn classify(pkt: &Packet, at: &Point) -> Option<Match> {
    let src = key(pkt.saddr, pkt.sport, pkt.proto);
    let dst = key(pkt.daddr, pkt.dport, pkt.proto);
    // Rule 1 needs a Service as destination, rules 2 and 3 a followed
    // client side as source or destination: the pre-filter's bits rule
    // each out for almost all other traffic, and spare a traced packet
    // the lookups of the rules that cannot apply to it.
    let (sbits, dbits) = (
        crate::prefilter::bits(&pkt.saddr),
        crate::prefilter::bits(&pkt.daddr),
    );
    if (sbits & prefilter::CLIENT) | (dbits & (prefilter::CLIENT | prefilter::SERVICE)) == 0 {
        return after_nat(pkt, at, &src, &dst);
    }
    if let Some(svc) = service_at(pkt.daddr, pkt.dport, pkt.proto) {
        return Some(Match {
            dir: direction::REQUEST,
            svc,
            state: endpoint(&src, svc),
        });
    }
    if sbits & prefilter::CLIENT != 0
        && let Some(state) = ENDPOINTS.get_ptr_mut(&src)
    {
        let svc = unsafe { (*state).svc };
        return Some(Match {
            dir: direction::REQUEST,
            svc,
            state: Some(state),
        });
    }
    if dbits & prefilter::CLIENT != 0
        && let Some(state) = ENDPOINTS.get_ptr_mut(&dst)
    {
        let svc = unsafe { (*state).svc };
        return Some(Match {
            dir: direction::REPLY,
            svc,
            state: Some(state),
        });
    }
    after_nat(pkt, at, &src, &dst)
}

/// Rule 4.
#[inline(always)]
fn after_nat(pkt: &Packet, at: &Point, src: &EndpointKey, dst: &EndpointKey) -> Option<Match> {
    // Rule 4 can only apply right after a NAT stage rewrote a client side
    // that no map knows yet (SNAT/masquerade); everywhere else the packet
    // already matched by its addresses, so the miss path skips the lookup.
    if at.skb == 0 || at.nat_stage != nat_stage::AFTER {
        return None;
    }
    let seen = unsafe { INFLIGHT.get(&at.skb) }?;
    if seen.ip_id != pkt.ip_id || seen.seq != pkt.seq {
        return None;
    }
    let (dir, svc) = (seen.direction, seen.svc);
    // NAT rewrote the client side: follow the new one too.
    let client = if dir == direction::REPLY { dst } else { src };
    Some(Match {
        dir,
        svc,
        state: endpoint(client, svc),
    })
}

/// Applies the filter to one observed packet and emits an event if it belongs
/// to a traced flow. `details` reads what only a matched packet needs (payload
/// head, device, namespace) and returns false when this point adds nothing.
#[inline(always)]
pub fn observe(
    pkt: &mut Packet,
    at: &mut Point,
    details: impl FnOnce(&mut Packet, &mut Point) -> bool,
) {
    let Some(m) = classify(pkt, at) else {
        return;
    };
    let is_drop = at.hook == hook::DROP;
    // Handshakes and resets are always reported; FINs of an `ok` flow
    // only close it and are counted like data.
    let control = pkt.tcp_flags & (tcp_flags::SYN | tcp_flags::RST);
    if let Some(state) = m.state {
        let state = unsafe { &mut *state };
        // The bulk of a muted flow stops here, before reading anything
        // more; only a reply at a device may still have to unmute it below.
        if state.muted != 0
            && control == 0
            && !is_drop
            && !(m.dir == direction::REPLY && at.hook == hook::DEV_RX)
        {
            state.packets += 1;
            stat_inc(stat::MUTED_PACKETS);
            return;
        }
    }
    if !details(pkt, at) {
        return;
    }

    if let Some(state) = m.state {
        let state = unsafe { &mut *state };
        state.packets += 1;
        let mut mute_now = false;
        if pkt.proto == proto::TCP && !is_drop {
            let syn_ack = pkt.tcp_flags & (tcp_flags::SYN | tcp_flags::ACK);
            if m.dir == direction::REQUEST && syn_ack == tcp_flags::SYN {
                // A new connection from this client port: trace it afresh.
                state.muted = 0;
            } else if m.dir == direction::REPLY && at.hook == hook::DEV_RX && at_client(at) {
                // The reply reached the client's namespace. Reverse-NATed
                // (source = a Service) means the collector's verdict is `ok`
                // (it decides on the SYN-ACK, which is always emitted), so
                // the rest of the connection is only counted; anything else
                // is an anomaly and the flow is reported per packet again.
                if service_at(pkt.saddr, pkt.sport, pkt.proto).is_some() {
                    mute_now = true;
                } else {
                    state.muted = 0;
                }
            }
        }
        if state.muted != 0 && control == 0 && !is_drop {
            stat_inc(stat::MUTED_PACKETS);
            return;
        }
        if mute_now {
            state.muted = 1;
        }
    }

    if at.skb != 0 {
        if is_drop {
            // The skb is being freed and its address will be reused.
            let _ = INFLIGHT.remove(&at.skb);
        } else if at.nat_stage == nat_stage::BEFORE {
            // Only the AFTER point of the same hook looks this up (rule 4).
            let seen = InflightPacket {
                seq: pkt.seq,
                ip_id: pkt.ip_id,
                direction: m.dir,
                svc: m.svc,
            };
            let _ = INFLIGHT.insert(&at.skb, &seen, 0);
        }
    }

    emit(pkt, at, m.dir, m.svc);
}

/// A device event outside the traced node namespace (the pods' side).
#[inline(always)]
fn at_client(at: &Point) -> bool {
    at.netns != 0 && crate::skb::config().is_some_and(|c| at.netns != c.node_netns)
}

#[inline(always)]
fn emit(pkt: &Packet, at: &Point, dir: u8, svc: u8) {
    let ev = PacketEvent {
        ts_ns: unsafe { bpf_ktime_get_ns() },
        skb: at.skb,
        netns: at.netns,
        ifindex: at.ifindex,
        saddr: pkt.saddr,
        daddr: pkt.daddr,
        sport: pkt.sport,
        dport: pkt.dport,
        seq: pkt.seq,
        ack: pkt.ack,
        drop_reason: at.drop_reason,
        payload_head: pkt.payload_head,
        ip_len: pkt.ip_len,
        ip_id: pkt.ip_id,
        hook: at.hook,
        nf_hook: at.nf_hook,
        nat_stage: at.nat_stage,
        proto: pkt.proto,
        tcp_flags: pkt.tcp_flags,
        direction: dir,
        svc,
        _pad: 0,
    };
    match EVENTS.output::<PacketEvent>(&ev, wakeup_flag()) {
        Ok(()) => stat_inc(stat::EVENTS),
        Err(_) => stat_inc(stat::RINGBUF_FULL),
    }
}

const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;
const BPF_RB_AVAIL_DATA: u64 = 0;
const BPF_RB_RING_SIZE: u64 = 1;

/// A wakeup per event costs an irq_work and a reader context switch each;
/// the reader polls every few ms anyway, so only a filling buffer wakes it.
#[inline(always)]
fn wakeup_flag() -> u64 {
    let avail = EVENTS.query(BPF_RB_AVAIL_DATA);
    let size = EVENTS.query(BPF_RB_RING_SIZE);
    if avail >= size / 4 {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    }
}
