//! Raw tracepoints: global (every network namespace), so they see the pod
//! side of a flow and drops anywhere. Their args are plain scalars, which is
//! what lets skb.rs do pointer arithmetic with runtime offsets.
use aya_ebpf::{macros::raw_tracepoint, programs::RawTracePointContext};
use tracer_common::hook;

use crate::{
    TC_IFACES, config,
    emit::Point,
    filter::observe,
    skb::{self, L3},
};

/// `netif_receive_skb(struct sk_buff *skb)`: fires before the network header
/// is reset, but `skb->data` already points at the IP header.
#[raw_tracepoint(tracepoint = "netif_receive_skb")]
pub fn netif_receive_skb(ctx: RawTracePointContext) -> i32 {
    let skb: u64 = ctx.arg(0);
    let _ = try_device(skb, 0, hook::DEV_RX, L3::Data, 0);
    0
}

/// `net_dev_start_xmit(struct sk_buff *skb, struct net_device *dev)`.
#[raw_tracepoint(tracepoint = "net_dev_start_xmit")]
pub fn net_dev_start_xmit(ctx: RawTracePointContext) -> i32 {
    let skb: u64 = ctx.arg(0);
    let dev: u64 = ctx.arg(1);
    let _ = try_device(skb, dev, hook::DEV_TX, L3::NetworkHeader, 0);
    0
}

/// `kfree_skb(struct sk_buff *skb, void *location, enum skb_drop_reason reason, ...)`.
/// Only real drops: consumed skbs go to the `consume_skb` tracepoint.
#[raw_tracepoint(tracepoint = "kfree_skb")]
pub fn kfree_skb(ctx: RawTracePointContext) -> i32 {
    let skb: u64 = ctx.arg(0);
    let reason: u64 = ctx.arg(2);
    let _ = try_device(skb, 0, hook::DROP, L3::NetworkHeader, reason as u32);
    0
}

/// `dev` 0 = take it from `skb->dev`.
#[inline(always)]
fn try_device(skb: u64, dev: u64, hook: u8, l3: L3, drop_reason: u32) -> Result<(), ()> {
    let cfg = config::config().ok_or(())?;
    let off = &cfg.offsets;
    let (mut pkt, payload) = skb::parse(skb, off, l3)?;
    let mut at = Point::new(hook);
    at.skb = skb;
    at.drop_reason = drop_reason;
    observe(&mut pkt, &mut at, |pkt, at| {
        let dev = if dev != 0 {
            dev
        } else {
            skb::skb_dev(skb, off)
        };
        let (ifindex, netns) = skb::dev_info(dev, off);
        // In the traced namespace tc sees the same packet on the same
        // device (ingress right after netif_receive_skb, egress right
        // before the transmit), with nothing in between that the collector
        // uses: one event there is enough, where tc is attached.
        if hook != hook::DROP
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
    });
    Ok(())
}
