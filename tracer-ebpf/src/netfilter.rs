//! BPF_PROG_TYPE_NETFILTER programs (kernel >= 6.4), one per NAT bracket.
//!
//! aya 0.14 cannot load this program type; userspace loads these functions'
//! instructions itself (tracer-userspace/src/probes/nf_link.rs). Their ELF
//! section must still be one aya's parser accepts, so they are filed as
//! `socket/...` programs that the loader never asks aya to load.
//!
//! The context is `struct bpf_nf_ctx { const struct nf_hook_state *state;
//! struct sk_buff *skb; }`. `ctx->skb` is loaded directly (no helper call):
//! the verifier types it PTR_TO_BTF_ID, and adding our runtime offsets to
//! such a pointer is allowed (kernel/bpf/verifier.c
//! `adjust_ptr_min_max_vals` refuses arithmetic only on packet-end, socket
//! and map pointers); only dereferencing it at a variable offset is refused
//! (`check_ptr_to_btf_access`), and skb.rs never does: it reads through
//! bpf_probe_read_kernel, whose source is any value. Storing the address in
//! an event or map key needs allow_ptr_leaks, i.e. a privileged loader.
use core::ffi::c_void;

use tracer_common::{hook, nat_stage, nf_hook};

use crate::{
    config,
    emit::Point,
    filter::observe,
    skb::{self, L3},
};

const NF_ACCEPT: i32 = 1;

#[inline(always)]
fn try_netfilter(ctx: *mut c_void, nf_hook: u8, stage: u8) -> Result<(), ()> {
    // SAFETY: ctx is the kernel's bpf_nf_ctx; the verifier allows this load.
    let skb: u64 = unsafe { core::ptr::read_volatile((ctx as *const u8).add(8) as *const u64) };
    let off = config::offsets().ok_or(())?;
    let (mut pkt, payload) = skb::parse(skb, off, L3::NetworkHeader)?;
    let mut at = Point::new(hook::NETFILTER);
    at.nf_hook = nf_hook;
    at.nat_stage = stage;
    at.skb = skb;
    // netns stays 0: these programs only run in the traced namespace.
    observe(&mut pkt, &mut at, |pkt, at| {
        // skb->dev is NULL at LOCAL_OUT (set by ip_output before POSTROUTING).
        at.ifindex = skb::dev_ifindex(skb::skb_dev(skb, off), off);
        skb::payload_head(pkt, payload);
        true
    });
    Ok(())
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
