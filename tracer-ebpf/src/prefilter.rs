//! The early address pre-filter (tracer_common::prefilter): what every
//! program of the miss path does before any hash lookup, and which of the
//! filter's rules can apply to a packet that passes it.
use aya_ebpf::{macros::map, maps::Array};
use tracer_common::prefilter::{CLIENT, WORDS, slot};

/// Byte `slot % 8` of word `slot / 8` holds the `tracer_common::prefilter`
/// bits of the addresses with that slot. Slots are never cleared (an
/// evicted endpoint's stale bit only costs the exact lookups).
#[map]
static ADDR_SLOTS: Array<u64> = Array::with_max_entries(WORDS, 0);

#[inline(always)]
fn byte<const N: usize>(addr: &[u8; N]) -> Option<*mut u8> {
    let s = slot(addr);
    let word = ADDR_SLOTS.get_ptr_mut(s >> 3)?;
    Some(unsafe { (word as *mut u8).add((s & 7) as usize) })
}

/// The bits of an address's slot (0: certainly neither a Service nor a
/// followed client side).
#[inline(always)]
pub fn bits<const N: usize>(addr: &[u8; N]) -> u8 {
    byte(addr).map_or(0, |b| unsafe { *b })
}

/// A client side the programs now follow. Called before its ENDPOINTS entry
/// is created, so no CPU can find the entry while the bit is still unset.
#[inline(always)]
pub fn remember<const N: usize>(addr: &[u8; N]) {
    if let Some(b) = byte(addr) {
        // Only programs write after attach, and they only add CLIENT: a racing
        // writer stores the same value.
        unsafe {
            if *b & CLIENT == 0 {
                *b |= CLIENT;
            }
        }
    }
}
