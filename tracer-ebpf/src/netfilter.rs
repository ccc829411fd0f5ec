//! BPF_PROG_TYPE_NETFILTER programs (kernel >= 6.4): one after each NAT
//! hook's rewrite that reports both sides of it (`nf_dnat` at PREROUTING
//! and OUTPUT, `nf_snat` at POSTROUTING and INPUT; or, without conntrack's
//! layout, one on each side of each hook), one at FORWARD.
//!
//! aya 0.14 cannot load this program type; userspace loads these functions'
//! instructions itself (tracer-userspace/src/probes/nf_link.rs). Their ELF
//! section must still be one aya's parser accepts, so they are filed as
//! `socket/...` programs that the loader never asks aya to load.
//!
//! The context is `struct bpf_nf_ctx { const struct nf_hook_state *state;
//! struct sk_buff *skb; }`. `ctx->skb` is loaded directly (no helper call):
//! the verifier types it PTR_TO_BTF_ID, and adding our offsets to such a
//! pointer is allowed (kernel/bpf/verifier.c `adjust_ptr_min_max_vals`
//! refuses arithmetic only on packet-end, socket and map pointers). The
//! sk_buff's members are still read with bpf_probe_read_kernel
//! (skb.rs [`Probe`]), whose source is any value: loaded directly, as
//! the tp_btf programs do, they made these programs' verification several
//! times longer, the start-up's critical path (docs/DESIGN.md, "Direct
//! loads"). All but the headers' two, `head` and `network_header`, where
//! the kernel types what `head` gives as readable memory (6.17+, [`parse`]):
//! then the miss path makes no helper call. Storing the address in an
//! event or map key needs allow_ptr_leaks, i.e. a privileged loader.
use core::ffi::c_void;

use tracer_common::{Addr, KernelOffsets, as_v4, direction, hook, nat_stage, nf_hook, v4_mapped};

use crate::{
    config,
    emit::{Packet, Point},
    filter::{self, Match, observe, observe_matched},
    skb::{self, Direct, Kmem, L3, Probe, read},
};

const NF_ACCEPT: i32 = 1;

#[inline(always)]
fn try_netfilter(ctx: *mut c_void, nf_hook: u8, stage: u8) -> Result<(), ()> {
    // SAFETY: ctx is the kernel's bpf_nf_ctx; the verifier allows this load.
    let skb: u64 = unsafe { core::ptr::read_volatile((ctx as *const u8).add(8) as *const u64) };
    let off = config::offsets();
    let (mut pkt, payload) = parse(skb, off)?;
    let mut at = Point::new(hook::NETFILTER);
    at.nf_hook = nf_hook;
    at.nat_stage = stage;
    at.skb = skb;
    // netns stays 0: these programs only run in the traced namespace.
    observe(&mut pkt, &mut at, |pkt, at| {
        // skb->dev is NULL at LOCAL_OUT (set by ip_output before POSTROUTING).
        at.ifindex = skb::dev_ifindex::<Probe>(skb::skb_dev::<Probe>(skb, off), off);
        skb::payload_head(pkt, payload);
        true
    });
    Ok(())
}

/// Which side of the packet a hook's NAT rewrites.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Rewrites {
    /// DNAT (PREROUTING, OUTPUT) rewrites a request's destination, and the
    /// destination of a reply to a masqueraded connection.
    Destination,
    /// SNAT (POSTROUTING, INPUT) rewrites a request's source, and the source
    /// of a reply the DNAT is undone on.
    Source,
}

/// A NAT hook in one program after the rewrite (issue 25: one program call
/// per packet crossing the hook instead of two): the BEFORE event is the
/// packet with the side NAT rewrites as conntrack saw it, the AFTER event
/// the packet as it is. The entry's tuple for the packet's direction
/// (`ct->tuplehash[dir]`) is the packet as conntrack took it, at
/// PREROUTING/OUTPUT before any NAT (net/netfilter/nf_conntrack_core.c
/// `resolve_normal_ct`; NF_IP_PRI_CONNTRACK -200 < NF_IP_PRI_NAT_DST -100),
/// and each hook's NAT rewrites one side only (nf_nat_core.c
/// `nf_nat_manip_pkt`, the manip type per hook, `HOOK2MANIP`). Without an
/// entry (INVALID, untracked) nothing rewrote it.
///
/// At the SNAT hooks only NAT (100) runs between the pair's before (99) and
/// after (101) points, so nothing is lost. At the DNAT hooks mangle (-150)
/// and kube-proxy nftables' filter chains (-110) run between them: a packet
/// those drop now shows no PREROUTING/OUTPUT point at all, and its drop is
/// placed after the point before (the device it came in by); conntrack
/// itself (-200) and the raw table (-300) already dropped before any.
/// An ICMP error's quote, which NAT rewrites the other way
/// (`nf_nat_icmp_reply_translation`), is reported as it is at both stages.
/// The loader uses these only when it knows `sk_buff._nfct` and
/// nf_conntrack's tuple layout (probes/table.rs `NatPoints`).
#[inline(always)]
fn try_netfilter_nat(ctx: *mut c_void, rewrites: Rewrites) -> Result<(), ()> {
    // SAFETY: ctx is the kernel's bpf_nf_ctx; the verifier allows this load.
    let skb: u64 = unsafe { core::ptr::read_volatile((ctx as *const u8).add(8) as *const u64) };
    let off = config::offsets();
    let (mut pkt, payload) = parse(skb, off)?;
    // The packet as it is (the AFTER point) is looked at first: the bulk
    // of an established flow then stops here, before conntrack is read.
    let muted = match rewrites {
        Rewrites::Destination => filter::muted_across_nat::<{ direction::REQUEST }>(&pkt),
        Rewrites::Source => filter::muted_across_nat::<{ direction::REPLY }>(&pkt),
    };
    if muted {
        return Ok(());
    }
    let after = match rewrites {
        Rewrites::Source => (pkt.saddr, pkt.sport),
        Rewrites::Destination => (pkt.daddr, pkt.dport),
    };
    if pkt.icmp_type == 0
        && let Some(seen) = side_conntrack_saw(skb, off, &pkt, rewrites)
    {
        set_side(&mut pkt, rewrites, seen);
    }
    let mut at = Point::new(hook::NETFILTER);
    // Read here, not at entry: held across the parse and conntrack's reads
    // it took `nf_snat`'s frame 8 bytes past what `judge`'s leaves of the
    // combined 512 (docs/DESIGN.md, "One netfilter program per NAT hook").
    at.nf_hook = hook_of(ctx);
    at.nat_stage = nat_stage::BEFORE;
    at.nat_pair = 1;
    at.skb = skb;
    let details = |pkt: &mut Packet, at: &mut Point| {
        at.ifindex = skb::dev_ifindex::<Probe>(skb::skb_dev::<Probe>(skb, off), off);
        skb::payload_head(pkt, payload);
        true
    };
    let before = filter::classify(&pkt, &at);
    observe_matched(&mut pkt, &mut at, before, details);
    // Read after the BEFORE point was judged, which may unmute the flow.
    let before = Match::pair(before, &pkt);
    set_side(&mut pkt, rewrites, after);
    at.nat_stage = nat_stage::AFTER;
    let m = filter::classify(&pkt, &at).or_else(|| filter::follow_rewrite(&pkt, before));
    observe_matched(&mut pkt, &mut at, m, details);
    Ok(())
}

/// The packet's headers. Where `skb->head` loads as readable memory
/// ([`KernelOffsets::head_is_mem`]), `head` and `network_header` are two
/// plain loads and the first 40 header bytes five more (skb.rs
/// `load_head`): no helper call on a miss. Elsewhere two probe reads.
#[inline(always)]
fn parse(skb: u64, off: &KernelOffsets) -> Result<(Packet, u64), ()> {
    if off.head_is_mem != 0 {
        skb::parse::<Direct>(skb, off, L3::NetworkHeader)
    } else {
        skb::parse::<Probe>(skb, off, L3::NetworkHeader)
    }
}

#[inline(always)]
fn set_side(pkt: &mut Packet, side: Rewrites, (addr, port): (Addr, u16)) {
    match side {
        Rewrites::Source => (pkt.saddr, pkt.sport) = (addr, port),
        Rewrites::Destination => (pkt.daddr, pkt.dport) = (addr, port),
    }
}

/// `enum ip_conntrack_info`: `_nfct`'s low 3 bits (NFCT_INFOMASK).
const NFCT_INFOMASK: u64 = 7;
/// From here on, reply-direction packets (IP_CT_IS_REPLY).
const IP_CT_IS_REPLY: u64 = 3;
/// No entry by choice (the raw table's NOTRACK).
const IP_CT_UNTRACKED: u64 = 7;

/// One side (address, port) of `pkt`'s direction in its conntrack entry.
#[inline(always)]
fn side_conntrack_saw(
    skb: u64,
    off: &KernelOffsets,
    pkt: &Packet,
    side: Rewrites,
) -> Option<(Addr, u16)> {
    if off.sk_buff_nfct == 0 || off.nf_conn_tuplehash == 0 {
        return None;
    }
    let nfct = read::<u64>(skb + off.sk_buff_nfct as u64).ok()?;
    let (ct, info) = (nfct & !NFCT_INFOMASK, nfct & NFCT_INFOMASK);
    if ct == 0 || info == IP_CT_UNTRACKED {
        return None;
    }
    let dir = u64::from(info >= IP_CT_IS_REPLY);
    let tuple = ct + off.nf_conn_tuplehash as u64 + dir * off.nf_conntrack_tuple_hash_size as u64;
    let (u3, u) = match side {
        Rewrites::Source => (off.tuple_src_u3, off.tuple_src_u),
        Rewrites::Destination => (off.tuple_dst_u3, off.tuple_dst_u),
    };
    let at = tuple + u3 as u64;
    let addr = if as_v4(&pkt.saddr).is_some() {
        v4_mapped(read::<[u8; 4]>(at).ok()?)
    } else {
        read::<Addr>(at).ok()?
    };
    let port = read::<[u8; 2]>(tuple + u as u64).ok()?;
    Some((addr, u16::from_be_bytes(port)))
}

macro_rules! nf_program {
    ($name:ident, $section:literal, $hook:expr, $stage:expr) => {
        #[unsafe(no_mangle)]
        #[unsafe(link_section = $section)]
        pub fn $name(ctx: *mut c_void) -> i32 {
            let _ = try_netfilter(ctx, $hook, $stage);
            NF_ACCEPT
        }
    };
}

// Names and hook/stage pairs must match the loader's table (probes/table.rs).
nf_program!(
    nf_pre_before,
    "socket/nf_pre_before",
    nf_hook::PRE_ROUTING,
    nat_stage::BEFORE
);
nf_program!(
    nf_pre_after,
    "socket/nf_pre_after",
    nf_hook::PRE_ROUTING,
    nat_stage::AFTER
);
nf_program!(
    nf_out_before,
    "socket/nf_out_before",
    nf_hook::LOCAL_OUT,
    nat_stage::BEFORE
);
nf_program!(
    nf_out_after,
    "socket/nf_out_after",
    nf_hook::LOCAL_OUT,
    nat_stage::AFTER
);
nf_program!(nf_fwd, "socket/nf_fwd", nf_hook::FORWARD, nat_stage::NONE);
nf_program!(
    nf_post_before,
    "socket/nf_post_before",
    nf_hook::POST_ROUTING,
    nat_stage::BEFORE
);
nf_program!(
    nf_post_after,
    "socket/nf_post_after",
    nf_hook::POST_ROUTING,
    nat_stage::AFTER
);
nf_program!(
    nf_in_before,
    "socket/nf_in_before",
    nf_hook::LOCAL_IN,
    nat_stage::BEFORE
);
nf_program!(
    nf_in_after,
    "socket/nf_in_after",
    nf_hook::LOCAL_IN,
    nat_stage::AFTER
);

macro_rules! nf_nat_program {
    ($name:ident, $section:literal, $rewrites:expr) => {
        #[unsafe(no_mangle)]
        #[unsafe(link_section = $section)]
        pub fn $name(ctx: *mut c_void) -> i32 {
            let _ = try_netfilter_nat(ctx, $rewrites);
            NF_ACCEPT
        }
    };
}

// One program for both hooks of each NAT side, told apart by the hook
// they run at: the verifier's work is start-up's longest part, and two
// programs whose code differs only by a stored constant cost it twice
// (~35k instructions each).
nf_nat_program!(nf_dnat, "socket/nf_dnat", Rewrites::Destination);
nf_nat_program!(nf_snat, "socket/nf_snat", Rewrites::Source);

/// `ctx->state->hook` (`enum nf_inet_hooks`, our `nf_hook`): `state` is a
/// pointer the verifier types (`struct nf_hook_state`, net/netfilter/nf_bpf_link.c
/// `nf_is_valid_access`), so its member is a plain load; a scalar, which
/// the verifier loads without the trusted-pointer lookups skb.rs's
/// `TrustedDev` describes.
#[inline(always)]
fn hook_of(ctx: *mut c_void) -> u8 {
    // SAFETY: ctx is the kernel's bpf_nf_ctx; `state` is its first member.
    let state: u64 = unsafe { core::ptr::read_volatile(ctx as *const u64) };
    Direct::field::<u8>(state, config::offsets().nf_hook_state_hook).unwrap_or(nf_hook::NONE)
}
