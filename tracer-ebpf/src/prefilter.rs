//! The address pre-filters (tracer_common::prefilter): what every program
//! of the miss path does before any hash lookup. Two, one per role an
//! address can have in a rule: a Service's (rule 1's destination) and a
//! client side's (rules 2-3). One filter for both sent every reply of a
//! traced flow to two SERVICES lookups for its client's address (rule 1
//! for a destination that is only a client) and, past de-DNAT, to an
//! ENDPOINTS lookup for the Service's (rule 2 for a source that is only a
//! Service): the `htab_map_hash` + `lookup_nulls_elem_raw` at the top of
//! the connection runs' profile.
use aya_ebpf::{macros::map, maps::Array};
use tracer_common::{
    Addr,
    prefilter::{SLOTS, slot},
};

/// Non-zero when a Service may have that slot's address: written by
/// userspace only (before attaching, and as kube-proxy's rules add
/// Services). Never cleared: a stale slot only costs the exact lookups.
#[map]
static SERVICE_SLOTS: Array<u8> = Array::with_max_entries(SLOTS, 0);

/// Non-zero when a followed client side may have that slot's address:
/// written by the programs only, when they start following one. Never
/// cleared, as an idle flow's state cannot be evicted from here (an LRU
/// hash could, and its flow then went unmatched). Each slot is its own
/// array element and each filter has one writer, so no read-modify-write
/// races another's.
#[map]
static CLIENT_SLOTS: Array<u8> = Array::with_max_entries(SLOTS, 0);

/// Whether `addr` may be a traced Service's (rule 1). An array lookup the
/// verifier inlines (kernel/bpf/arraymap.c `array_map_gen_lookup`): a
/// bounds check and a load, no helper call and no hashing of a 16-byte key.
#[inline(always)]
pub fn service(addr: &Addr) -> bool {
    SERVICE_SLOTS.get(slot(addr)).is_some_and(|v| *v != 0)
}

/// Whether `addr` may be a followed client side's (rules 2 and 3).
#[inline(always)]
pub fn client(addr: &Addr) -> bool {
    CLIENT_SLOTS.get(slot(addr)).is_some_and(|v| *v != 0)
}

/// A client side the programs now follow.
#[inline(always)]
pub fn remember(addr: &Addr) {
    if let Some(v) = CLIENT_SLOTS.get_ptr_mut(slot(addr)) {
        // SAFETY: a map value, valid while the program runs; every writer
        // stores the same 1.
        unsafe { core::ptr::write_volatile(v, 1) };
    }
}
