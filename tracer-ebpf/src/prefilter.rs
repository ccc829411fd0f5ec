//! The early address pre-filter (tracer_common::prefilter): what every
//! program of the miss path does before any hash lookup.
use aya_ebpf::{macros::map, maps::Array};
use tracer_common::prefilter::{WORDS, slot};

/// Byte `slot % 8` of word `slot / 8` is non-zero when an address with that
/// slot may be traced. Userspace sets the Services' slots before attaching;
/// the programs set a client side's slot when they start following it.
/// Slots are never cleared (an evicted endpoint's stale slot only costs the
/// exact lookups), so plain byte stores race harmlessly: every writer
/// stores the same 1 and no read-modify-write is needed.
#[map]
static ADDR_SLOTS: Array<u64> = Array::with_max_entries(WORDS, 0);

#[inline(always)]
fn byte<const N: usize>(addr: &[u8; N]) -> Option<*mut u8> {
    let s = slot(addr);
    let word = ADDR_SLOTS.get_ptr_mut(s >> 3)?;
    Some(unsafe { (word as *mut u8).add((s & 7) as usize) })
}

/// False only when neither address can belong to a traced flow.
#[inline(always)]
pub fn may_match<const N: usize>(saddr: &[u8; N], daddr: &[u8; N]) -> bool {
    let set = |a: &[u8; N]| byte(a).is_some_and(|b| unsafe { *b } != 0);
    set(saddr) || set(daddr)
}

/// A client side the programs now follow.
#[inline(always)]
pub fn remember<const N: usize>(addr: &[u8; N]) {
    if let Some(b) = byte(addr) {
        unsafe { *b = 1 };
    }
}
