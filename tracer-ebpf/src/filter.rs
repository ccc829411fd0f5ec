//! The Service filter shared by every program (docs/DESIGN.md, "Kernel
//! filter"); what it passes leaves through `emit.rs`.
use network_types::{
    ip::{IpProto, Ipv6Hdr},
    udp::UdpHdr,
};
use tracer_common::{
    Addr, EndpointKey, EndpointState, InflightPacket, ServiceKey, direction, event_flags,
    held::Fate, hook, icmp, nat_stage, proto, stat, tcp_flags,
};

use crate::{
    ENDPOINTS, INFLIGHT, SERVICES,
    emit::{Packet, Point, emit, stat_add, stat_inc},
    held, prefilter,
    watch::{self, Check},
};

/// BPF_NOEXIST: a concurrent first packet of the same flow on another CPU must
/// not reset the other's counters.
const BPF_NOEXIST: u64 = 1;
const EEXIST: i32 = 17;

/// UDP header length (ports, length, checksum).
pub const UDP_HDR_LEN: usize = UdpHdr::LEN;

/// Extension headers walked before giving up (RFC 8200 4.1 lists at most
/// six in the recommended order; the bound keeps the verifier's loop finite).
pub const MAX_IPV6_EXT: usize = 6;

/// What an IPv6 header chain step found.
pub enum Ipv6Next {
    /// TCP, UDP or ICMPv6 (the protocol) starts here.
    L4(u8),
    /// Another extension header to step over: its length in bytes and its
    /// Next Header value.
    Skip(usize, u8),
    /// Nothing we trace (no next header, another protocol).
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
        proto::TCP | proto::UDP | icmp::PROTO_ICMPV6 => Ipv6Next::L4(next),
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
#[derive(Clone, Copy)]
pub struct Match {
    dir: u8,
    svc: u8,
    state: Option<*mut EndpointState>,
}

/// Rules 1-4 of DESIGN.md, in order. Only reads the packet's addresses and
/// ports: this is the path every packet of the node takes.
#[inline(always)]
pub fn classify(pkt: &Packet, at: &Point) -> Option<Match> {
    // Pre-filters (prefilter.rs): rule 1 needs a Service's destination
    // address, rule 2 a client's source, rule 3 a client's destination.
    let (dst_slot, src_slot) = (prefilter::slot(&pkt.daddr), prefilter::slot(&pkt.saddr));
    let src = key(pkt.saddr, pkt.sport, pkt.proto);
    if prefilter::service(dst_slot)
        && let Some(svc) = service_at(pkt.daddr, pkt.dport, pkt.proto)
    {
        return Some(Match {
            dir: direction::REQUEST,
            svc,
            state: endpoint(&src, svc),
        });
    }
    if prefilter::client(src_slot)
        && let Some(state) = ENDPOINTS.get_ptr_mut(src)
    {
        let svc = unsafe { (*state).svc };
        return Some(Match {
            dir: direction::REQUEST,
            svc,
            state: Some(state),
        });
    }
    let dst = key(pkt.daddr, pkt.dport, pkt.proto);
    if prefilter::client(dst_slot)
        && let Some(state) = ENDPOINTS.get_ptr_mut(dst)
    {
        let svc = unsafe { (*state).svc };
        return Some(Match {
            dir: direction::REPLY,
            svc,
            state: Some(state),
        });
    }
    // Rule 4 can only apply right after a NAT stage rewrote a client side
    // that no map knows yet (SNAT/masquerade); everywhere else the packet
    // already matched by its addresses, so the miss path skips the lookup.
    // A program that saw the BEFORE point itself follows it without the
    // map ([`follow_rewrite`]).
    if at.skb == 0 || at.nat_stage != nat_stage::AFTER || at.nat_pair != 0 {
        return None;
    }
    let seen = unsafe { INFLIGHT.get(at.skb) }?;
    if seen.ip_id != pkt.ip_id || seen.seq != pkt.seq {
        return None;
    }
    Some(followed(pkt, seen.direction, seen.svc))
}

/// Rule 4's match: NAT rewrote the client side of a packet whose BEFORE
/// point matched (`dir`, `svc`), and the new client side is followed from
/// now on (found, or created as rule 1 does).
#[inline(always)]
fn followed(pkt: &Packet, dir: u8, svc: u8) -> Match {
    Match {
        dir,
        svc,
        state: endpoint(&client_key(pkt, dir), svc),
    }
}

/// Rule 4 where one program observes both points of a NAT hook: at the
/// AFTER point, a packet whose rewritten side no map knows yet belongs to
/// the flow its BEFORE point matched (`before`: its direction and Service,
/// [`Match::pair`]), and its new client side is followed from now on, as
/// an INFLIGHT entry of the same skb would have it. The miss path pays
/// nothing: it had an INFLIGHT lookup per call at PREROUTING and
/// POSTROUTING, and a traced handshake an LRU insert per packet and hook.
#[inline(always)]
pub fn follow_rewrite(pkt: &Packet, before: u16) -> Option<Match> {
    if before == NO_PAIR {
        return None;
    }
    Some(followed(pkt, (before >> 8) as u8, before as u8))
}

/// [`Match::pair`] of no match.
pub const NO_PAIR: u16 = u16::MAX;

impl Match {
    /// What [`follow_rewrite`] needs of the BEFORE point's match, read
    /// after that point was observed, packed so that it stays in a register
    /// across the observation (the NAT programs' frames are at 6.1's
    /// limit, tests/stack_depth.rs): [`NO_PAIR`] where `judge` would not
    /// have written the INFLIGHT entry, i.e. a muted flow's packet that was
    /// only counted (a SYN, RST or ICMP error, or one the watch flagged,
    /// goes on to `judge`, which unmutes it or writes the entry for it).
    #[inline(always)]
    pub fn pair(m: Option<Match>, pkt: &Packet) -> u16 {
        let Some(m) = m else {
            return NO_PAIR;
        };
        let control = control(pkt);
        if let Some(state) = m.state
            && muted(state)
            && control == 0
        {
            return NO_PAIR;
        }
        (u16::from(m.dir) << 8) | u16::from(m.svc)
    }
}

/// Applies the filter to one observed packet and emits an event if it belongs
/// to a traced flow. `details` reads what only a matched packet needs (payload
/// head, device, namespace) and returns false when this point adds nothing.
/// Returns whether the packet belongs to a traced flow at all (rules 1-4),
/// whatever was sent.
#[inline(always)]
pub fn observe(
    pkt: &mut Packet,
    at: &mut Point,
    details: impl FnOnce(&mut Packet, &mut Point) -> bool,
) -> bool {
    let m = classify(pkt, at);
    observe_via::<true>(pkt, at, m, details)
}

/// [`observe`] of a packet [`classify`] already matched (`m`) at a point
/// with the same addresses in this program run, where rule 4 cannot
/// apply (a veth's transmit and its peer's receive). Exact: what the first
/// observation may have added to the maps in between is its own client
/// side (rule 1's `endpoint`), which rules 1-2 find again by the same
/// source.
#[inline(always)]
pub fn observe_matched(
    pkt: &mut Packet,
    at: &mut Point,
    m: Option<Match>,
    details: impl FnOnce(&mut Packet, &mut Point) -> bool,
) -> bool {
    observe_via::<true>(pkt, at, m, details)
}

/// [`observe`] handing `judge` the caller's own Packet and Point: for the
/// kprobe programs, whose frames sit at 6.1's 512-byte limit with `judge`
/// on top and grow past it when the arguments go through `JUDGE_ARGS`
/// (tests/stack_depth.rs). They pay the stores a miss does not need, as
/// they did since `judge` became a global function.
#[inline(always)]
pub fn observe_in_place(
    pkt: &mut Packet,
    at: &mut Point,
    details: impl FnOnce(&mut Packet, &mut Point) -> bool,
) {
    let m = classify(pkt, at);
    observe_via::<false>(pkt, at, m, details);
}

#[inline(always)]
fn observe_via<const SLOT: bool>(
    pkt: &mut Packet,
    at: &mut Point,
    m: Option<Match>,
    details: impl FnOnce(&mut Packet, &mut Point) -> bool,
) -> bool {
    let Some(m) = m else {
        return false;
    };
    let is_drop = at.hook == hook::DROP;
    let control = control(pkt);
    if let Some(state) = m.state {
        // The bulk of a muted flow stops here, before reading anything
        // more; only a reply at a device may still have to unmute it below.
        if muted(state)
            && control == 0
            && !is_drop
            && !(m.dir == direction::REPLY && at.hook == hook::DEV_RX)
        {
            // Every packet passes the node's netfilter hooks, so each
            // side's FIN is noted here at the latest.
            if pkt.tcp_flags & tcp_flags::FIN != 0 {
                watch::note_fin(state, m.dir);
            }
            stat_inc(stat::MUTED_PACKETS);
            return true;
        }
    }
    if !details(pkt, at) {
        return true;
    }
    if let Some(state) = m.state
        && muted(state)
        && control == 0
        && fine_before_judge(state, pkt, at, m.dir)
    {
        stat_inc(stat::MUTED_PACKETS);
        return true;
    }
    if !SLOT {
        judge(pkt, at, u32::from(m.dir), u32::from(m.svc));
        return true;
    }
    // judge's arguments are copied into a per-CPU slot here, on the match
    // path only. Handed the caller's own Packet and Point, their addresses
    // escaped into a call LLVM cannot see through, so every program kept
    // both in stack memory from the parse on and stored and reloaded each
    // field before classify() could miss: +8-12 ns per netfilter call on
    // untraced packets (BENCHMARKS.md, "The miss path against main before
    // issue 23"). Copies on the stack would do the same but take 6.1's
    // 512 bytes past their limit (tests/stack_depth.rs); a map value is
    // plain memory to the global function as the stack is
    // (kernel/bpf/btf.c `btf_check_func_arg_match` → check_mem_reg).
    let Some(depth) = JUDGE_DEPTH.get_ptr_mut(0) else {
        return true;
    };
    // SAFETY: this CPU's counter; a run that interrupts this one on the
    // CPU takes the next slot and gives it back before this one goes on.
    let d = unsafe { core::ptr::read_volatile(depth) };
    let Some(args) = JUDGE_ARGS.get_ptr_mut(d) else {
        // Nested deeper than JUDGE_SLOTS: the event is lost, and counted so.
        stat_inc(stat::RINGBUF_FULL);
        return true;
    };
    // SAFETY: slot `d` is this run's until the counter is given back.
    unsafe {
        core::ptr::write_volatile(depth, d + 1);
        (*args).pkt = *pkt;
        (*args).at = *at;
        judge(
            &raw mut (*args).pkt,
            &raw mut (*args).at,
            u32::from(m.dir),
            u32::from(m.svc),
        );
        core::ptr::write_volatile(depth, d);
    }
    true
}

/// What `judge` would only count as fine, for a muted flow's packet
/// without SYN, RST or ICMP error, decided before the slot's copy, the call
/// and the state's lookup again:
/// - a reply at a device in another namespace than its client's (the
///   node's side of the backend's veth): the watch checks replies where
///   the client receives them (watch.rs `check` passes it, and nothing
///   after that sends it);
/// - at its client's device, the reply from the Service, the watch's
///   common case (watch.rs `fine_at_client`);
/// - a deviceless drop, a closing socket's queue purge (one per
///   connection; `watch::check` counts it as fine).
#[inline(always)]
fn fine_before_judge(state: *mut EndpointState, pkt: &Packet, at: &Point, dir: u8) -> bool {
    if at.hook == hook::DROP {
        return at.ifindex == 0;
    }
    at.hook == hook::DEV_RX
        && (watch::elsewhere(state, at)
            || (dir == direction::REPLY
                && at_client(at)
                && watch::fine_at_client(state, at, || {
                    service_at(pkt.saddr, pkt.sport, pkt.proto).is_some()
                })))
}

/// Whether a NAT hook's packet stops at the muted check at both of its
/// points, looked up as it is (after the rewrite): `kept` is the
/// direction whose flow is keyed by the side the hook does not rewrite
/// (DNAT hooks: a request, found by its source; SNAT hooks: a reply, found
/// by its destination). The packet before the rewrite has that side too,
/// so rules 1-3 find the same state for it (rules 1 and 2 by the same
/// source; a reply's rule 3 by the same destination, unless its source
/// before the de-DNAT, the backend's address and port, is also a traced
/// client's (a UDP server querying from its listening socket), when the
/// point before would have passed it as a request of that other flow,
/// which it is not); and a muted state stops a packet without SYN, RST or
/// ICMP error at a netfilter point whatever else it carries
/// (`observe_via`). Then the hook skips conntrack's three reads and both
/// points' classification. Counted as the two muted points it stands for.
/// Only the lookups rules 1-3 would make, in the order that leaves a
/// packet that is not such soonest; the match itself is not kept (its
/// slot took 6.1's combined stack past 512 bytes, tests/stack_depth.rs).
#[inline(always)]
pub fn muted_across_nat<const KEPT: u8>(pkt: &Packet) -> bool {
    let control = control(pkt);
    // The side the flow is found by must be in the pre-filter: an
    // untraced packet stops here, as its classification below does.
    let side = if KEPT == direction::REQUEST {
        &pkt.saddr
    } else {
        &pkt.daddr
    };
    if control != 0 || !prefilter::client(prefilter::slot(side)) {
        return false;
    }
    let words = |a: &Addr| {
        (
            u64::from(a[0]) | u64::from(a[1]) << 32,
            u64::from(a[2]) | u64::from(a[3]) << 32,
        )
    };
    let (s0, s1) = words(&pkt.saddr);
    // A request's flow is found by its source alone.
    let (d0, d1) = if KEPT == direction::REQUEST {
        (0, 0)
    } else {
        words(&pkt.daddr)
    };
    let rest = u64::from(pkt.sport)
        | u64::from(pkt.dport) << 16
        | u64::from(pkt.proto) << 32
        | u64::from(KEPT) << 40
        | u64::from(pkt.tcp_flags & tcp_flags::FIN != 0) << 48;
    muted_by_keys(s0, s1, d0, d1, rest) != 0
}

/// [`muted_across_nat`]'s map lookups, in a frame of their own: inlined,
/// their keys took the NAT programs' frames past 6.1's combined limit with
/// `judge` on top (tests/stack_depth.rs). Scalars only (the packet's
/// addresses as words; ports, protocol, direction and FIN packed in
/// `rest`), so the caller's packet does not escape into the call, which
/// would keep it in stack memory on the miss path too. A static
/// subprogram: verified at its one call site per program, with these
/// arguments as plain scalars.
#[inline(never)]
fn muted_by_keys(s0: u64, s1: u64, d0: u64, d1: u64, rest: u64) -> u64 {
    let addr = |w0: u64, w1: u64| [w0 as u32, (w0 >> 32) as u32, w1 as u32, (w1 >> 32) as u32];
    let (sport, dport, proto) = (rest as u16, (rest >> 16) as u16, (rest >> 32) as u8);
    let (kept, fin) = ((rest >> 40) as u8, (rest >> 48) & 1 != 0);
    let (saddr, daddr) = (addr(s0, s1), addr(d0, d1));
    if kept == direction::REQUEST {
        // Rule 1 (a Service destination) or rule 2 finds the client by
        // the source, and a muted state exists.
        let Some(state) = ENDPOINTS.get_ptr_mut(key(saddr, sport, proto)) else {
            return 0;
        };
        if !muted(state) {
            return 0;
        }
        if fin {
            watch::note_fin(state, direction::REQUEST);
        }
    } else {
        let Some(state) = ENDPOINTS.get_ptr_mut(key(daddr, dport, proto)) else {
            return 0;
        };
        // Rule 3 applies only where rules 1 and 2 do not.
        if !muted(state)
            || (prefilter::service(prefilter::slot(&daddr))
                && service_at(daddr, dport, proto).is_some())
            || (prefilter::client(prefilter::slot(&saddr))
                && ENDPOINTS.get_ptr_mut(key(saddr, sport, proto)).is_some())
        {
            return 0;
        }
        if fin {
            watch::note_fin(state, direction::REPLY);
        }
    }
    stat_add(stat::MUTED_PACKETS, 2);
    1
}

/// [`judge`]'s arguments, written on the match path only (see `observe`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct JudgeArgs {
    pkt: Packet,
    at: Point,
}

/// Slots per CPU, one per nesting level (`JUDGE_DEPTH`). Runs nest on a
/// CPU: a netfilter program at LOCAL_OUT runs in process context with
/// softirqs enabled, and the softirq that interrupts it runs the same
/// programs on forwarded packets (netfilter programs have no recursion
/// guard; tracing programs are skipped only when the same one is running);
/// a drop's tracepoint can fire in a hard interrupt. So a slot is taken
/// by depth, not by program or hook: process, softirq, hard interrupt, NMI.
const JUDGE_SLOTS: u32 = 4;

#[aya_ebpf::macros::map]
static JUDGE_ARGS: aya_ebpf::maps::PerCpuArray<JudgeArgs> =
    aya_ebpf::maps::PerCpuArray::with_max_entries(JUDGE_SLOTS, 0);

/// How many runs on this CPU hold a `JUDGE_ARGS` slot now.
#[aya_ebpf::macros::map]
static JUDGE_DEPTH: aya_ebpf::maps::PerCpuArray<u32> =
    aya_ebpf::maps::PerCpuArray::with_max_entries(1, 0);

/// Everything after the match: the watch, the per-flow buffer and the event.
/// A global BPF function (exported, never inlined: its BTF linkage is
/// global), so the kernel verifies it once, on its own, with the packet and
/// the point as unknown memory (kernel/bpf/verifier.c `do_check_subprogs`;
/// a static subprogram or inlined code is walked again for every path that
/// reaches it, kernel/bpf/verifier.c `check_func_call`). Inlined, each of
/// classify()'s matches and each way a packet is parsed (IPv4, IPv6, the
/// quote of an ICMP error) walked this code again with its own constants:
/// about 80k instructions per program on 6.18, minutes per kprobe program
/// on 6.1 under TCG. Its arguments are a per-CPU slot (`JUDGE_ARGS`),
/// filled only for a packet that matched. The state is looked up again by
/// the client side: a global function receives its pointer arguments as
/// plain memory, never as a map value it could look into
/// (kernel/bpf/btf.c `btf_prepare_func_args`). The return value
/// is unused: 6.1 refuses a global function that does not return a scalar.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn judge(pkt: *mut Packet, at: *mut Point, dir: u32, svc: u32) -> u32 {
    // SAFETY: `observe` passes a JUDGE_ARGS slot of this CPU's; the verifier
    // only knows it as memory that may be null.
    let (Some(pkt), Some(at)) = (unsafe { pkt.as_mut() }, unsafe { at.as_mut() }) else {
        return 0;
    };
    let (dir, svc) = (dir as u8, svc as u8);
    let m = Match {
        dir,
        svc,
        state: ENDPOINTS.get_ptr_mut(client_key(pkt, dir)),
    };
    let is_drop = at.hook == hook::DROP;
    let control = control(pkt);
    let mut flags = 0;
    let mut hold_for = None;
    let mut good = 0;
    if let Some(state) = m.state
        && muted(state)
        && pkt.icmp_type == 0
        && watch::closing(state, pkt.tcp_flags, at)
    {
        stat_inc(stat::MUTED_PACKETS);
        return 0;
    }
    if let Some(state) = m.state
        && muted(state)
        && (pkt.tcp_flags & tcp_flags::RST != 0 || pkt.icmp_type != 0)
    {
        // A reset or an ICMP error about a muted flow is sent as it is; the
        // collector judges it (a bare RST from the backend's side, any ICMP
        // error is news) and needs the count of replies that were fine
        // before it. The ICMP error comes first: a UDP request to a closed
        // port is answered (__udp4_lib_rcv → icmp_send) before its skb is
        // freed with NO_SOCKET, whose WATCH event carries the count too.
        good = watch::good(state);
    }
    if let Some(state) = m.state
        && pkt.tcp_flags & tcp_flags::RST != 0
        && m.dir == direction::REPLY
        && watch::reply_fin(state)
    {
        flags = event_flags::AFTER_FIN;
    }
    if let Some(state) = m.state
        && muted(state)
        && control == 0
    {
        let check = watch::check(
            state,
            at,
            m.dir,
            || service_at(pkt.saddr, pkt.sport, pkt.proto).is_some(),
            at_client(at),
        );
        match check {
            Check::Fine => {
                stat_inc(stat::MUTED_PACKETS);
                return 0;
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
        // An ICMP error quoting a SYN or a reply is neither: its quote
        // only names the flow.
        if pkt.proto == proto::TCP && !is_drop && pkt.icmp_type == 0 {
            let syn_ack = pkt.tcp_flags & (tcp_flags::SYN | tcp_flags::ACK);
            if m.dir == direction::REQUEST && syn_ack == tcp_flags::SYN {
                // A new connection from this client port: trace it afresh.
                set_muted(state, false);
                watch::clear_fins(state);
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
        if is_drop || pkt.tcp_flags & tcp_flags::RST != 0 || pkt.icmp_type != 0 {
            fate = Fate::Anomaly;
        }
        // A deviceless "drop" of a muted flow is a delivered packet purged
        // from a closing socket's queue (net/core/stream.c
        // sk_stream_kill_queues → __skb_queue_purge, reason QUEUE_PURGE;
        // NOT_SPECIFIED on 6.1): one per connection, never evidence, since
        // an `ok` verdict stands once the reply reached the client.
        // An ICMP error dropped before it had a device (a rule at OUTPUT
        // dropping a locally generated one) is evidence, not a purge.
        let purged = is_drop && at.ifindex == 0 && pkt.icmp_type == 0;
        if muted(state) && ((control == 0 && !is_drop) || purged) {
            stat_inc(stat::MUTED_PACKETS);
            return 0;
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
        } else if at.nat_stage == nat_stage::BEFORE && at.nat_pair == 0 {
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
        // The key made again, not kept from the lookup above: kept, it
        // held 24 bytes of judge's frame from start to end, and judge is at
        // 6.1's 128 bytes (tests/stack_depth.rs).
        match held::hold(&client_key(pkt, m.dir), state, pkt, at, m.dir, m.svc, fate) {
            Some(f) => flags |= f,
            None => return 0,
        }
    }

    emit(pkt, at, m.dir, m.svc, flags, good);
    0
}

/// The key of `pkt`'s client: its source for a request, its destination
/// for a reply.
#[inline(always)]
fn client_key(pkt: &Packet, dir: u8) -> EndpointKey {
    if dir == direction::REPLY {
        key(pkt.daddr, pkt.dport, pkt.proto)
    } else {
        key(pkt.saddr, pkt.sport, pkt.proto)
    }
}

/// Nonzero for a packet that is always reported, muted flow or not: a
/// handshake (SYN), a reset or an ICMP error. A FIN of an `ok` flow only
/// closes it and counts like data.
#[inline(always)]
fn control(pkt: &Packet) -> u8 {
    (pkt.tcp_flags & (tcp_flags::SYN | tcp_flags::RST)) | pkt.icmp_type
}

/// A device event outside the traced node namespace (the pods' side).
#[inline(always)]
fn at_client(at: &Point) -> bool {
    at.netns != 0 && crate::config::config().is_some_and(|c| at.netns != c.node_netns)
}
