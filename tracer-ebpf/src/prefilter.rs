//! The address pre-filter (tracer_common::prefilter): what every program of
//! the miss path does before any hash lookup.
use aya_ebpf::{macros::map, maps::Array};
use tracer_common::{
    Addr,
    prefilter::{SLOTS, slot},
};

/// Non-zero when an address with that slot may be traced. Userspace sets the
/// Services' slots (before attaching, and as kube-proxy's rules add
/// Services); the programs set a client side's slot when they start
/// following it. Never cleared: a stale slot only costs the exact lookups,
/// and an idle Service cannot be evicted (an LRU hash here could, and its
/// Service then went unmatched). Each slot is its own array element, so
/// writers store a whole value and never race a read-modify-write.
#[map]
static ADDR_SLOTS: Array<u8> = Array::with_max_entries(SLOTS, 0);

/// An array lookup the verifier inlines (kernel/bpf/arraymap.c
/// `array_map_gen_lookup`): a bounds check and a load, no helper call and no
/// hashing of a 16-byte key (the `htab_map_hash` + `lookup_nulls_elem_raw`
/// that topped the miss path's profile with an LRU hash here).
#[inline(always)]
pub fn known(addr: &Addr) -> bool {
    ADDR_SLOTS.get(slot(addr)).is_some_and(|v| *v != 0)
}

/// A client side the programs now follow.
#[inline(always)]
pub fn remember(addr: &Addr) {
    if let Some(v) = ADDR_SLOTS.get_ptr_mut(slot(addr)) {
        // SAFETY: a map value, valid while the program runs; every writer
        // stores the same 1.
        unsafe { core::ptr::write_volatile(v, 1) };
    }
}
