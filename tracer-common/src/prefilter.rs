//! The address pre-filters shared by the kernel programs and the loader
//! (docs/DESIGN.md, "Kernel filter"): one slot per hash of an address that
//! can be part of a traced flow, in one filter per role (a Service's,
//! written by userspace; a client side's, written by the programs when they
//! start following it). A packet neither of whose addresses has its slot
//! set is certainly untraced, and its program stops after three array
//! reads, which the verifier inlines, instead of hash lookups. A collision
//! only sends a packet on to the exact lookups; slots are never cleared, so
//! no address can be evicted from a filter.

use crate::Addr;

/// 2^16 slots. An array map rounds each value up to 8 bytes, so each map
/// takes 512 KiB of kernel memory; a node with a few thousand Service and pod
/// addresses sets a few percent of the slots.
pub const SLOTS_LOG2: u32 = 16;
pub const SLOTS: u32 = 1 << SLOTS_LOG2;

/// The slot of an address: a multiplicative hash of its four words (the
/// same host-endian view of the wire bytes on both sides), top bits kept,
/// which every input bit reaches.
#[inline(always)]
pub fn slot(addr: &Addr) -> u32 {
    let mut h: u32 = 0;
    let mut i = 0;
    while i < 4 {
        h = (h ^ addr[i]).wrapping_mul(0x9e37_79b1);
        i += 1;
    }
    h >> (32 - SLOTS_LOG2)
}

#[cfg(test)]
mod tests {
    extern crate std;

    use super::*;
    use crate::{addr_from_bytes, v4_mapped};

    #[test]
    fn a_pod_subnet_spreads_over_distinct_slots() {
        // Pod addresses differ in their last bytes: they must not pile up on
        // a few slots, or every pod's traffic would pass the filter.
        for (a, b) in [(10u8, 244u8), (100, 96)] {
            let mut seen = std::collections::BTreeSet::new();
            for host in 0..=255u8 {
                for third in 0..4u8 {
                    let s = slot(&v4_mapped([a, b, third, host]));
                    assert!(s < SLOTS);
                    seen.insert(s);
                }
            }
            assert!(
                seen.len() >= 1000,
                "{} slots for 1024 addresses",
                seen.len()
            );
        }
        let mut v6 = [0u8; 16];
        v6[..2].copy_from_slice(&[0xfd, 0x00]);
        let mut seen = std::collections::BTreeSet::new();
        for host in 0..=255u8 {
            v6[15] = host;
            seen.insert(slot(&addr_from_bytes(v6)));
        }
        assert!(
            seen.len() >= 250,
            "{} slots for 256 IPv6 addresses",
            seen.len()
        );
    }
}
