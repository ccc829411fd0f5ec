//! A recording carries no kernel address (issue 26): every event's `skb` is
//! the `sk_buff`'s address, and a file sent to someone else would defeat
//! kptr_restrict. Before an event is written its address is replaced by a
//! per-run number: the same address gets the same number while it is in
//! use, so the collector's "same packet" (the same `skb` within
//! `packet_gap_ns`, collector/mod.rs) reads a recording exactly as it read
//! the live events. 0 (no `sk_buff` known) stays 0.
use std::collections::HashMap;

/// An address not seen for this long gets a new number when it comes back
/// (the allocator reused it: another packet). Far above the collector's
/// 100 ms packet gap, so a number never changes within a packet's life.
const FORGET_NS: u64 = 10_000_000_000;
/// At most this many addresses are remembered (a flood allocates many):
/// about 8 MiB. Past it, those not seen for `FORGET_NS` go; if none has,
/// every one goes (only packets in flight at that instant lose their link).
const MAX_ADDRESSES: usize = 1 << 18;

#[derive(Default)]
pub struct SkbIds {
    /// address → (number, last seen).
    /// foldhash: looked up for every recorded event.
    ids: HashMap<u64, (u64, u64), foldhash::fast::RandomState>,
    next: u64,
    /// The latest event time seen.
    horizon: u64,
    last_purge: u64,
}

impl SkbIds {
    /// The number standing for `skb` in an event at `ts_ns`.
    pub fn id(&mut self, skb: u64, ts_ns: u64) -> u64 {
        if skb == 0 {
            return 0;
        }
        self.horizon = self.horizon.max(ts_ns);
        if self.horizon >= self.last_purge + FORGET_NS / 10 || self.ids.len() >= MAX_ADDRESSES {
            self.purge();
        }
        let next = &mut self.next;
        let entry = self.ids.entry(skb).or_insert_with(|| {
            *next += 1;
            (*next, ts_ns)
        });
        if ts_ns.saturating_sub(entry.1) > FORGET_NS {
            // Held events (pulled later) carry older times: only a gap
            // forward is a reuse.
            *next += 1;
            entry.0 = *next;
        }
        entry.1 = entry.1.max(ts_ns);
        entry.0
    }

    fn purge(&mut self) {
        self.last_purge = self.horizon;
        let horizon = self.horizon;
        self.ids.retain(|_, (_, seen)| *seen + FORGET_NS >= horizon);
        if self.ids.len() >= MAX_ADDRESSES {
            self.ids.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_is_one_number_while_in_use_and_a_new_one_after() {
        let mut ids = SkbIds::default();
        let a = 0xffff_8881_0000_1000;
        let b = 0xffff_8881_0000_2000;
        let first = ids.id(a, 1_000);
        assert_eq!(ids.id(b, 2_000), first + 1);
        assert_eq!(ids.id(a, 50_000_000), first, "same packet, same number");
        assert_eq!(ids.id(0, 60_000_000), 0);
        assert!(first < 1 << 32, "a count, not an address");
        // Reused by the allocator much later: another packet.
        let later = ids.id(a, 50_000_000 + FORGET_NS + 1);
        assert_ne!(later, first);
        assert_eq!(ids.id(a, 50_000_000 + FORGET_NS + 2), later);
    }

    #[test]
    fn memory_is_bounded_under_a_flood() {
        let mut ids = SkbIds::default();
        for i in 0..(MAX_ADDRESSES as u64 * 2) {
            ids.id(0xffff_0000_0000_0000 + i * 256, i);
        }
        assert!(ids.ids.len() <= MAX_ADDRESSES);
    }
}
