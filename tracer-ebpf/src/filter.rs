//! The Service filter shared by every program (docs/DESIGN.md, "Kernel filter")
//! and event emission.
use aya_ebpf::helpers::bpf_ktime_get_ns;
use network_types::{
    ip::{IpProto, Ipv4Hdr, Ipv6Hdr},
    tcp::TcpHdr,
    udp::UdpHdr,
};
use tracer_common::{
    Addr, EndpointKey, EndpointState, InflightPacket, PacketEvent, ServiceKey, addr_from_bytes,
    direction, event_flags, hook, nat_stage, proto, stat, tcp_flags, v4_mapped,
};

use crate::{
    ENDPOINTS, EVENTS, INFLIGHT, SERVICES, STATS,
    pending::{self, Fate},
    prefilter,
    watch::{self, Check},
};

/// BPF_NOEXIST: a concurrent first packet of the same flow on another CPU must
/// not reset the other's counters.
const BPF_NOEXIST: u64 = 1;
const EEXIST: i32 = 17;

/// UDP header length (ports, length, checksum).
pub const UDP_HDR_LEN: usize = UdpHdr::LEN;

/// What every observation point extracts from a packet.
#[derive(Clone, Copy, Default)]
pub struct Packet {
    pub saddr: Addr,
    pub daddr: Addr,
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
    pub fn from_ipv4(ip: &Ipv4Hdr) -> Option<(Packet, usize)> {
        let ihl = ((ip.vihl & 0x0f) as usize) * 4;
        if ip.vihl >> 4 != 4 || ihl < Ipv4Hdr::LEN {
            return None;
        }
        // Non-first fragments carry no L4 header.
        if (u16::from_be_bytes(ip.frags) & 0x1fff) != 0 {
            return None;
        }
        if ip.proto != proto::TCP && ip.proto != proto::UDP {
            return None;
        }
        let pkt = Packet {
            saddr: v4_mapped(ip.src_addr),
            daddr: v4_mapped(ip.dst_addr),
            ip_len: u16::from_be_bytes(ip.tot_len),
            ip_id: u16::from_be_bytes(ip.id),
            proto: ip.proto,
            ..Default::default()
        };
        Some((pkt, ihl))
    }

    /// L3 fields of an IPv6 packet whose TCP/UDP header is `l4` (see
    /// [`ipv6_l4`]). `ip_len` is the IPv4-style total length (the fixed
    /// header plus its payload length), so both families read alike.
    #[inline(always)]
    pub fn from_ipv6(ip: &Ipv6Hdr, l4: u8) -> Packet {
        Packet {
            saddr: addr_from_bytes(ip.src_addr),
            daddr: addr_from_bytes(ip.dst_addr),
            ip_len: u16::from_be_bytes(ip.payload_len).saturating_add(Ipv6Hdr::LEN as u16),
            proto: l4,
            ..Default::default()
        }
    }

    #[inline(always)]
    pub fn set_ports(&mut self, sport: [u8; 2], dport: [u8; 2]) {
        self.sport = u16::from_be_bytes(sport);
        self.dport = u16::from_be_bytes(dport);
    }

    /// Returns the TCP header length (where the payload starts).
    #[inline(always)]
    pub fn set_tcp(&mut self, tcp: &TcpHdr) -> usize {
        self.set_ports(tcp.source, tcp.dest);
        self.seq = u32::from_be_bytes(tcp.seq);
        self.ack = u32::from_be_bytes(tcp.ack_seq);
        // network-types exposes the data offset and flags as a bindgen
        // bitfield with one accessor per flag; the two bytes as on the wire
        // (data offset << 4, then the flags byte) are cheaper to take whole.
        // SAFETY: BitfieldU16 is #[repr(C)] around a single [u8; 2].
        let raw: [u8; 2] = unsafe { core::mem::transmute(tcp._bitfield_1) };
        self.tcp_flags = raw[1];
        ((raw[0] >> 4) as usize) * 4
    }
}

/// Extension headers walked before giving up (RFC 8200 4.1 lists at most
/// six in the recommended order; the bound keeps the verifier's loop finite).
pub const MAX_IPV6_EXT: usize = 6;

/// What an IPv6 header chain step found.
pub enum Ipv6Next {
    /// TCP or UDP (the protocol) starts here.
    L4(u8),
    /// Another extension header to step over: its length in bytes and its
    /// Next Header value.
    Skip(usize, u8),
    /// Nothing we trace (ICMPv6, no next header, another protocol).
    Untraced,
    /// Cannot be followed: a non-first fragment, ESP/AH or another
    /// extension header we do not walk. Counted in STATS[IPV6_UNFOLLOWED].
    Unfollowed,
}

/// One step of the IPv6 header chain: `next` is the current Next Header
/// value, `ext` the first 8 bytes of the header it names (only read when
/// it is an extension header).
#[inline(always)]
pub fn ipv6_step(next: u8, ext: impl FnOnce() -> Result<[u8; 8], ()>) -> Ipv6Next {
    const HOPOPT: u8 = IpProto::HopOpt as u8;
    const ROUTING: u8 = IpProto::Ipv6Route as u8;
    const FRAGMENT: u8 = IpProto::Ipv6Frag as u8;
    const DSTOPTS: u8 = IpProto::Ipv6Opts as u8;
    const ESP: u8 = IpProto::Esp as u8;
    const AH: u8 = IpProto::Ah as u8;
    const MOBILITY: u8 = IpProto::MobilityHeader as u8;
    const HIP: u8 = IpProto::Hip as u8;
    const SHIM6: u8 = IpProto::Shim6 as u8;
    match next {
        proto::TCP | proto::UDP => Ipv6Next::L4(next),
        HOPOPT | ROUTING | DSTOPTS => match ext() {
            // Hdr Ext Len counts 8-octet units past the first (RFC 8200 4.3-4.6).
            Ok(h) => Ipv6Next::Skip((h[1] as usize + 1) * 8, h[0]),
            Err(()) => Ipv6Next::Unfollowed,
        },
        FRAGMENT => match ext() {
            // Fragment Offset is the top 13 bits of bytes 2-3 (RFC 8200 4.5):
            // only the first fragment carries the TCP/UDP header.
            Ok(h) if u16::from_be_bytes([h[2], h[3]]) & 0xfff8 == 0 => Ipv6Next::Skip(8, h[0]),
            _ => Ipv6Next::Unfollowed,
        },
        ESP | AH | MOBILITY | HIP | SHIM6 | 253 | 254 => Ipv6Next::Unfollowed,
        _ => Ipv6Next::Untraced,
    }
}

/// Walks the extension headers after an IPv6 fixed header whose Next Header
/// is `next`; `read8(offset)` reads 8 bytes at `offset` from the start of
/// the IPv6 header. Returns the L4 protocol and its offset.
#[inline(always)]
pub fn ipv6_l4(mut next: u8, read8: impl Fn(usize) -> Result<[u8; 8], ()>) -> Option<(u8, usize)> {
    let mut off = Ipv6Hdr::LEN;
    for _ in 0..MAX_IPV6_EXT {
        match ipv6_step(next, || read8(off)) {
            Ipv6Next::L4(p) => return Some((p, off)),
            Ipv6Next::Skip(len, hdr) => {
                next = hdr;
                off += len;
            }
            Ipv6Next::Untraced => return None,
            Ipv6Next::Unfollowed => {
                stat_inc(stat::IPV6_UNFOLLOWED);
                return None;
            }
        }
    }
    stat_inc(stat::IPV6_UNFOLLOWED);
    None
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
pub fn stat_add(index: u32, n: u64) {
    if let Some(counter) = STATS.get_ptr_mut(index) {
        unsafe { *counter += n };
    }
}

#[inline(always)]
fn key(addr: Addr, port: u16, proto: u8) -> EndpointKey {
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
fn service_at(addr: Addr, port: u16, proto: u8) -> Option<u8> {
    let mut k = ServiceKey {
        addr,
        port,
        proto,
        _pad: 0,
    };
    if let Some(svc) = unsafe { SERVICES.get(k) } {
        return Some(*svc);
    }
    k.port = 0;
    unsafe { SERVICES.get(k) }.copied()
}

/// Finds (or, for a new client side, creates) the flow's endpoint state.
#[inline(always)]
fn endpoint(client: &EndpointKey, svc: u8) -> Option<*mut EndpointState> {
    if let Some(state) = ENDPOINTS.get_ptr_mut(client) {
        return Some(state);
    }
    // As five words (muted 0; svc, held 0, pad; syn_seq 0; good 0;
    // client_netns 0), little-endian:
    // `..Default::default()` zeroed the 7 bytes after `svc` with a call to
    // `memset`, a BPF-to-BPF call whose frame pushed 6.1's combined stack
    // past 512 bytes in the kprobe programs.
    // SAFETY: EndpointState is repr(C), 20 bytes, every bit pattern valid.
    let fresh: EndpointState =
        unsafe { core::mem::transmute([0u32, u32::from(svc), 0u32, 0u32, 0u32]) };
    if let Err(err) = ENDPOINTS.insert(client, fresh, BPF_NOEXIST)
        && err != -EEXIST
    {
        stat_inc(stat::FLOW_MAP_FULL);
        return None;
    }
    // The pre-filter must know the new client side before its next packet.
    prefilter::remember(&client.addr);
    ENDPOINTS.get_ptr_mut(client)
}

/// The map value is shared: programs on other CPUs and userspace write
/// `muted` while this one runs, so it is read and written through the raw
/// pointer (one aligned u32 access each) and never borrowed as `&mut`.
#[inline(always)]
fn muted(state: *mut EndpointState) -> bool {
    unsafe { core::ptr::read_volatile(&raw const (*state).muted) != 0 }
}

#[inline(always)]
fn set_muted(state: *mut EndpointState, on: bool) {
    unsafe { core::ptr::write_volatile(&raw mut (*state).muted, u32::from(on)) }
}

/// How the filter matched a packet (rules 1-4 of DESIGN.md).
struct Match {
    dir: u8,
    svc: u8,
    state: Option<*mut EndpointState>,
    /// Rule 1: the destination is a traced Service.
    to_service: bool,
}

/// Rules 1-4 of DESIGN.md, in order. Only reads the packet's addresses and
/// ports: this is the path every packet of the node takes.
#[inline(always)]
fn classify(pkt: &Packet, at: &Point) -> Option<Match> {
    // Pre-filter (ADDR_SLOTS): rules 1 and 3 need a known destination
    // address, rule 2 a known source address.
    let dst_known = prefilter::known(&pkt.daddr);
    let src_known = prefilter::known(&pkt.saddr);
    let src = key(pkt.saddr, pkt.sport, pkt.proto);
    if dst_known && let Some(svc) = service_at(pkt.daddr, pkt.dport, pkt.proto) {
        return Some(Match {
            dir: direction::REQUEST,
            svc,
            state: endpoint(&src, svc),
            to_service: true,
        });
    }
    if src_known && let Some(state) = ENDPOINTS.get_ptr_mut(src) {
        let svc = unsafe { (*state).svc };
        return Some(Match {
            dir: direction::REQUEST,
            svc,
            state: Some(state),
            to_service: false,
        });
    }
    let dst = key(pkt.daddr, pkt.dport, pkt.proto);
    if dst_known && let Some(state) = ENDPOINTS.get_ptr_mut(dst) {
        let svc = unsafe { (*state).svc };
        return Some(Match {
            dir: direction::REPLY,
            svc,
            state: Some(state),
            to_service: false,
        });
    }
    // Rule 4 can only apply right after a NAT stage rewrote a client side
    // that no map knows yet (SNAT/masquerade); everywhere else the packet
    // already matched by its addresses, so the miss path skips the lookup.
    if at.skb == 0 || at.nat_stage != nat_stage::AFTER {
        return None;
    }
    let seen = unsafe { INFLIGHT.get(at.skb) }?;
    if seen.ip_id != pkt.ip_id || seen.seq != pkt.seq {
        return None;
    }
    let (dir, svc) = (seen.direction, seen.svc);
    // NAT rewrote the client side: follow the new one too.
    let client = if dir == direction::REPLY { dst } else { src };
    Some(Match {
        dir,
        svc,
        state: endpoint(&client, svc),
        to_service: false,
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
        // The bulk of a muted flow stops here, before reading anything
        // more; only a reply at a device may still have to unmute it below.
        if muted(state)
            && control == 0
            && !is_drop
            && !(m.dir == direction::REPLY && at.hook == hook::DEV_RX)
            && !watch::at_nat_point(m.dir, m.to_service, at)
        {
            stat_inc(stat::MUTED_PACKETS);
            return;
        }
    }
    if !details(pkt, at) {
        return;
    }

    let mut flags = 0;
    let mut hold_for = None;
    let mut good = 0;
    if let Some(state) = m.state
        && muted(state)
        && control == 0
    {
        let check = watch::check(
            state,
            at,
            m.dir,
            m.to_service,
            || service_at(pkt.saddr, pkt.sport, pkt.proto).is_some(),
            at_client(at),
        );
        match check {
            Check::Fine => {
                stat_inc(stat::MUTED_PACKETS);
                return;
            }
            Check::Alert => {
                set_muted(state, false);
                flags = event_flags::WATCH;
                good = watch::good(state);
            }
            Check::Pass => {}
        }
    }
    if let Some(state) = m.state {
        let mut mute_now = false;
        let mut fate = Fate::Other;
        if pkt.proto == proto::TCP && !is_drop {
            let syn_ack = pkt.tcp_flags & (tcp_flags::SYN | tcp_flags::ACK);
            if m.dir == direction::REQUEST && syn_ack == tcp_flags::SYN {
                // A new connection from this client port: trace it afresh.
                set_muted(state, false);
                if at.hook == hook::DEV_TX && at_client(at) {
                    fate = Fate::Start;
                }
            } else if m.dir == direction::REPLY
                && at.hook == hook::DEV_RX
                && at_client(at)
                && watch::is_client_netns(state, at)
            {
                // The reply reached the client's namespace. Reverse-NATed
                // (source = a Service) means the collector's verdict is `ok`
                // (it decides on the SYN-ACK, which is always emitted), so
                // the rest of the connection is only counted; anything else
                // is an anomaly and the flow is reported per packet again.
                if service_at(pkt.saddr, pkt.sport, pkt.proto).is_some() {
                    mute_now = true;
                    fate = Fate::Healthy;
                } else {
                    set_muted(state, false);
                    fate = Fate::Anomaly;
                }
            }
        }
        if is_drop || pkt.tcp_flags & tcp_flags::RST != 0 {
            fate = Fate::Anomaly;
        }
        // A deviceless "drop" of a muted flow is a delivered packet purged
        // from a closing socket's queue (net/core/stream.c
        // sk_stream_kill_queues → __skb_queue_purge, reason QUEUE_PURGE;
        // NOT_SPECIFIED on 6.1): one per connection, never evidence, since
        // an `ok` verdict stands once the reply reached the client.
        let purged = is_drop && at.ifindex == 0;
        if muted(state) && ((control == 0 && !is_drop) || purged) {
            stat_inc(stat::MUTED_PACKETS);
            return;
        }
        if mute_now {
            set_muted(state, true);
            watch::note_muted(state, at.netns);
        }
        if pkt.proto == proto::TCP {
            hold_for = Some((state, fate));
        }
    }

    if at.skb != 0 {
        if is_drop {
            // The skb is being freed and its address will be reused.
            let _ = INFLIGHT.remove(at.skb);
        } else if at.nat_stage == nat_stage::BEFORE {
            // Only the AFTER point of the same hook looks this up (rule 4).
            let seen = InflightPacket {
                seq: pkt.seq,
                ip_id: pkt.ip_id,
                direction: m.dir,
                svc: m.svc,
            };
            let _ = INFLIGHT.insert(at.skb, seen, 0);
        }
    }

    if let Some((state, fate)) = hold_for {
        // The client side the state belongs to, whichever rule matched.
        let client = if m.dir == direction::REPLY {
            key(pkt.daddr, pkt.dport, pkt.proto)
        } else {
            key(pkt.saddr, pkt.sport, pkt.proto)
        };
        match pending::hold(&client, state, pkt, at, m.dir, m.svc, fate) {
            Some(f) => flags |= f,
            None => return,
        }
    }

    emit(pkt, at, m.dir, m.svc, flags, good);
}

/// A device event outside the traced node namespace (the pods' side).
#[inline(always)]
fn at_client(at: &Point) -> bool {
    at.netns != 0 && crate::config::config().is_some_and(|c| at.netns != c.node_netns)
}

/// Written in place in the ring buffer: a 128-bit-address event on the
/// stack next to the packet and the map keys would pass the 512-byte BPF
/// stack limit.
#[inline(always)]
fn emit(pkt: &Packet, at: &Point, dir: u8, svc: u8, flags: u8, good: u32) {
    let Some(mut entry) = EVENTS.reserve::<PacketEvent>(0) else {
        stat_inc(stat::RINGBUF_FULL);
        return;
    };
    fill(entry.as_mut_ptr(), pkt, at, dir, svc, flags);
    // SAFETY: the reservation holds a PacketEvent.
    unsafe { (*entry.as_mut_ptr()).good = good };
    entry.submit(wakeup_flag());
    stat_inc(stat::EVENTS);
}

/// Word by word, volatile: into a map value (a `PENDING` slot) LLVM cannot
/// rule out overlap and emits a call to `memmove`, a BPF-to-BPF call whose
/// frame pushed 6.1's combined stack limit past 512 bytes (kprobe programs).
#[inline(always)]
pub fn copy_addr(dst: *mut tracer_common::Addr, src: &tracer_common::Addr) {
    let dst = dst.cast::<u32>();
    for (i, w) in src.iter().enumerate() {
        // SAFETY: `dst` points at an Addr, four u32 words.
        unsafe { core::ptr::write_volatile(dst.add(i), *w) };
    }
}

/// Writes every field of the event at `ev` (a ring-buffer reservation or a
/// `PENDING` slot), so no uninitialised bytes reach userspace.
#[inline(always)]
pub fn fill(ev: *mut PacketEvent, pkt: &Packet, at: &Point, dir: u8, svc: u8, flags: u8) {
    // SAFETY: `ev` points at sizeof(PacketEvent) bytes the caller owns.
    unsafe {
        (*ev).ts_ns = bpf_ktime_get_ns();
        (*ev).skb = at.skb;
        (*ev).netns = at.netns;
        (*ev).ifindex = at.ifindex;
        copy_addr(&raw mut (*ev).saddr, &pkt.saddr);
        copy_addr(&raw mut (*ev).daddr, &pkt.daddr);
        (*ev).sport = pkt.sport;
        (*ev).dport = pkt.dport;
        (*ev).seq = pkt.seq;
        (*ev).ack = pkt.ack;
        (*ev).drop_reason = at.drop_reason;
        (*ev).payload_head = pkt.payload_head;
        (*ev).ip_len = pkt.ip_len;
        (*ev).ip_id = pkt.ip_id;
        (*ev).hook = at.hook;
        (*ev).nf_hook = at.nf_hook;
        (*ev).nat_stage = at.nat_stage;
        (*ev).proto = pkt.proto;
        (*ev).tcp_flags = pkt.tcp_flags;
        (*ev).direction = dir;
        (*ev).svc = svc;
        (*ev).flags = flags;
        (*ev).good = 0;
        (*ev)._reserved = 0;
    }
}

const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;
const BPF_RB_AVAIL_DATA: u64 = 0;
const BPF_RB_RING_SIZE: u64 = 1;

/// A wakeup per event costs an irq_work and a reader context switch each;
/// the reader polls every few ms anyway, so only a filling buffer wakes it.
#[inline(always)]
pub fn wakeup_flag() -> u64 {
    let avail = EVENTS.query(BPF_RB_AVAIL_DATA);
    let size = EVENTS.query(BPF_RB_RING_SIZE);
    if avail >= size / 4 {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    }
}
