//! Device and drop tracepoints: global (every network namespace), so they
//! see the pod side of a flow and drops anywhere.
//!
//! The transmit and the drop are BTF tracepoints (tp_btf, issue 25): their
//! `struct sk_buff *` and `struct net_device *` arguments are pointers the
//! verifier types, so those structs' members are plain loads (skb.rs
//! [`Direct`]) instead of bpf_probe_read_kernel calls, on every packet of
//! every namespace. The receive stays a raw tracepoint (plain-number
//! arguments, [`Probe`]): it is attached late, and only on nodes that need
//! it (probes/receive.rs), where a tp_btf load would need vmlinux's BTF
//! parsed again or kept for the trace's life.
use aya_ebpf::{
    macros::{btf_tracepoint, raw_tracepoint},
    programs::{BtfTracePointContext, RawTracePointContext},
};
use tracer_common::{Config, hook};

use crate::{
    TC_IFACES, config,
    emit::{Packet, Point},
    filter::{self, observe, observe_matched},
    skb::{self, Direct, L3, Probe, TrustedDev},
};

/// `netif_receive_skb(struct sk_buff *skb)`: fires before the network header
/// is reset, but `skb->data` already points at the IP header. Attached only
/// where a device that is neither a veth nor loopback nor covered by tc
/// can receive (probes/table.rs `Need::UnpairedReceive`): the receives on
/// those two are reported by `net_dev_start_xmit` and skipped here.
#[raw_tracepoint(tracepoint = "netif_receive_skb")]
pub fn netif_receive_skb(ctx: RawTracePointContext) -> i32 {
    let skb: u64 = ctx.arg(0);
    let _ = try_receive(skb);
    0
}

/// `net_dev_start_xmit(struct sk_buff *skb, struct net_device *dev)`: the
/// transmit, and for a veth or loopback the receive it leads to.
#[btf_tracepoint(function = "net_dev_start_xmit")]
pub fn net_dev_start_xmit(ctx: BtfTracePointContext) -> i32 {
    // The tracepoint's first two arguments (include/trace/events/net.h).
    let (skb, dev): (u64, u64) = (ctx.arg(0), ctx.arg(1));
    let _ = try_transmit(skb, dev);
    0
}

/// `kfree_skb(struct sk_buff *skb, void *location, enum skb_drop_reason reason, ...)`.
/// Only real drops: consumed skbs go to the `consume_skb` tracepoint.
#[btf_tracepoint(function = "kfree_skb")]
pub fn kfree_skb(ctx: BtfTracePointContext) -> i32 {
    // Arguments 0 and 2 (include/trace/events/skb.h).
    let (skb, reason): (u64, u64) = (ctx.arg(0), ctx.arg(2));
    let _ = try_drop(skb, reason as u32);
    0
}

#[inline(always)]
fn try_receive(skb: u64) -> Result<(), ()> {
    let cfg = config::config().ok_or(())?;
    let off = config::offsets();
    let (mut pkt, payload) = skb::parse::<Probe>(skb, off, L3::Data)?;
    let mut at = Point::new(hook::DEV_RX);
    at.skb = skb;
    observe(&mut pkt, &mut at, |pkt, at| {
        let dev = skb::skb_dev::<Probe>(skb, off);
        !skb::reported_at_transmit::<Probe>(dev, off)
            && on_device(cfg, skb::dev_info::<Probe>(dev, off), pkt, payload, at)
    });
    Ok(())
}

/// One program call per veth crossing instead of two (issue 25): the
/// packet a veth transmits is, unchanged, the one its peer receives next
/// (nothing runs between on the peer but tc ingress, which the node's
/// own interfaces report themselves, and generic XDP, which no CNI here
/// uses), so the receive event is sent from here, right after the
/// transmit's, in the order the two programs sent them. A miss costs the
/// parse and the filter once for both.
#[inline(always)]
fn try_transmit(skb: u64, dev: u64) -> Result<(), ()> {
    let cfg = config::config().ok_or(())?;
    let off = config::offsets();
    let dev = TrustedDev::load(dev, off);
    let (mut pkt, payload) = skb::parse::<Direct>(skb, off, L3::NetworkHeader)?;
    let mut at = Point::new(hook::DEV_TX);
    at.skb = skb;
    // Both observations have the same addresses: classified once.
    let m = filter::classify(&pkt, &at);
    if !observe_matched(&mut pkt, &mut at, m, |pkt, at| {
        on_device(cfg, dev.info(off), pkt, payload, at)
    }) {
        return Ok(());
    }
    let mut at = Point::new(hook::DEV_RX);
    at.skb = skb;
    observe_matched(&mut pkt, &mut at, m, |pkt, at| {
        let peer = dev.receiver(off);
        peer != 0 && on_device(cfg, skb::dev_info::<Probe>(peer, off), pkt, payload, at)
    });
    Ok(())
}

#[inline(always)]
fn try_drop(skb: u64, drop_reason: u32) -> Result<(), ()> {
    let cfg = config::config().ok_or(())?;
    let off = config::offsets();
    // Loaded before the first branch: `skb` is trusted ([`TrustedDev`]);
    // the device it gives is not, and is read as it comes.
    let dev = skb::skb_dev::<Direct>(skb, off);
    let (mut pkt, payload) = skb::parse::<Direct>(skb, off, L3::NetworkHeader)?;
    let mut at = Point::new(hook::DROP);
    at.skb = skb;
    at.drop_reason = drop_reason;
    observe(&mut pkt, &mut at, |pkt, at| {
        on_device(cfg, skb::dev_info::<Direct>(dev, off), pkt, payload, at)
    });
    Ok(())
}

/// Where a matched packet is (its device's ifindex and namespace); false when
/// tc reports the same packet on the same device in the traced namespace
/// (ingress right after the receive, egress right before the transmit),
/// with nothing in between that the collector uses: one event there is
/// enough.
#[inline(always)]
fn on_device(
    cfg: &Config,
    (ifindex, netns): (u32, u32),
    pkt: &mut Packet,
    payload: u64,
    at: &mut Point,
) -> bool {
    if at.hook != hook::DROP
        && netns != 0
        && netns == cfg.node_netns
        && unsafe { TC_IFACES.get(ifindex) }.is_some()
    {
        return false;
    }
    at.ifindex = ifindex;
    at.netns = netns;
    skb::payload_head(pkt, payload);
    true
}
