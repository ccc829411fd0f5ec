//! The address pre-filter shared by the kernel programs and the loader
//! (docs/DESIGN.md, "Kernel filter"): per hash of an address that can be
//! part of a traced flow, one element per role — a Service's (written by
//! userspace) and a client side's (written by the programs when they start
//! following it) — side by side in one array, so both roles of an address
//! are one cache line. A packet neither of whose addresses has its element
//! set for the role a rule needs is certainly untraced, and its program
//! stops after three array reads, which the verifier inlines, instead of
//! hash lookups. A collision only sends a packet on to the exact lookups;
//! elements are never cleared, so no address can be evicted from the filter.

use crate::Addr;

/// 2^16 slots, two elements each. An array map rounds each value up to 8
/// bytes, so the map takes 1 MiB of kernel memory; a node with a few thousand Service and pod
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

/// Elements of the pre-filter's array.
pub const ELEMENTS: u32 = SLOTS * 2;

/// The element of slot `slot` that says its address may be a traced
/// Service's (rule 1).
#[inline(always)]
pub const fn service_of(slot: u32) -> u32 {
    slot * 2
}

/// The element of slot `slot` that says its address may be a followed
/// client side's (rules 2 and 3): next to its Service element, 8 bytes on
/// in the kernel's array, so in the same 64-byte line. Each element has one
/// writer, userspace or the programs, so no read-modify-write races
/// another's.
#[inline(always)]
pub const fn client_of(slot: u32) -> u32 {
    slot * 2 + 1
}

/// `addr`'s Service element ([`service_of`]).
#[inline(always)]
pub fn service_element(addr: &Addr) -> u32 {
    service_of(slot(addr))
}

/// `addr`'s client element ([`client_of`]).
#[inline(always)]
pub fn client_element(addr: &Addr) -> u32 {
    client_of(slot(addr))
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

    #[test]
    fn an_address_s_two_roles_are_neighbours_in_one_line() {
        for a in [
            v4_mapped([100, 67, 30, 133]),
            v4_mapped([255; 4]),
            [u32::MAX; 4],
        ] {
            let (svc, client) = (service_element(&a), client_element(&a));
            assert_ne!(svc, client);
            assert!(client < ELEMENTS, "{client} of {ELEMENTS}");
            // The kernel's array keeps each element in 8 bytes: an even
            // element and the next share a 16-byte-aligned pair, so a
            // 64-byte cache line.
            assert_eq!(svc % 2, 0);
            assert_eq!(client, svc + 1);
        }
    }
}
