//! The address pre-filter (tracer_common::prefilter): what every program
//! of the miss path does before any hash lookup. One element per role an
//! address can have in a rule: a Service's (rule 1's destination) and a
//! client side's (rules 2-3). One element for both sent every reply of a
//! traced flow to two SERVICES lookups for its client's address (rule 1
//! for a destination that is only a client) and, past de-DNAT, to an
//! ENDPOINTS lookup for the Service's (rule 2 for a source that is only a
//! Service): the `htab_map_hash` + `lookup_nulls_elem_raw` at the top of
//! the connection runs' profile. The two elements of an address are
//! neighbours: as two arrays the miss path read one more cache line per
//! address, +15 ns per call on the untraced bulk flow (BENCHMARKS.md).
use aya_ebpf::{macros::map, maps::Array};
use tracer_common::{
    Addr,
    prefilter::{ELEMENTS, client_element, client_of, service_of},
};

pub use tracer_common::prefilter::slot;

/// Non-zero when an address with that element may be a traced Service's
/// (written by userspace only: before attaching, and as kube-proxy's rules
/// add Services) or a followed client side's (written by the programs only,
/// when they start following one). Never cleared: a stale element only
/// costs the exact lookups, and an idle flow's or Service's cannot be
/// evicted (an LRU hash here could, and its traffic then went unmatched).
#[map]
static ADDR_SLOTS: Array<u8> = Array::with_max_entries(ELEMENTS, 0);

/// Whether an address of slot `slot` may be a traced Service's (rule 1).
/// An array lookup the verifier inlines (kernel/bpf/arraymap.c
/// `array_map_gen_lookup`): a bounds check and a load, no helper call and
/// no hashing of a 16-byte key. The slot is taken, not the address: a
/// classification asks two roles of the destination, and computed per
/// question the hash was done again after each lookup (the packet lives
/// in stack memory LLVM must reload after a call).
#[inline(always)]
pub fn service(slot: u32) -> bool {
    ADDR_SLOTS.get(service_of(slot)).is_some_and(|v| *v != 0)
}

/// Whether an address of slot `slot` may be a followed client side's
/// (rules 2 and 3).
#[inline(always)]
pub fn client(slot: u32) -> bool {
    ADDR_SLOTS.get(client_of(slot)).is_some_and(|v| *v != 0)
}

/// A client side the programs now follow.
#[inline(always)]
pub fn remember(addr: &Addr) {
    if let Some(v) = ADDR_SLOTS.get_ptr_mut(client_element(addr)) {
        // SAFETY: a map value, valid while the program runs; every writer
        // of a client element stores the same 1.
        unsafe { core::ptr::write_volatile(v, 1) };
    }
}
