//! Where the live flows are kept: a slot table that grows in fixed chunks,
//! and the index from a packet's address pair to its flow. Both are sized
//! for 100k+ live flows in a few tens of MiB (issue 15), so neither copies
//! what the flows already hold.
use std::{hash::BuildHasher, mem::size_of};

use hashbrown::HashTable;

use super::{flow::Flow, types::PairKey};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct FlowRef {
    pub idx: u32,
    pub generation: u32,
}

pub(super) struct Slot {
    pub generation: u32,
    pub flow: Option<Flow>,
}

/// Slots per chunk: small enough that the last, partly used chunk wastes
/// little, large enough that the chunk list stays short.
const CHUNK: usize = 1024;

/// Flow slots in chunks of [`CHUNK`]: growing never copies the flows
/// and never holds the old and the new table at once, and at most one
/// chunk is unused (a doubling Vec leaves up to half of a 100k-flow table
/// empty, and needs both copies while it grows).
#[derive(Default)]
pub(super) struct Slots {
    chunks: Vec<Vec<Slot>>,
    len: usize,
}

impl Slots {
    pub fn get(&self, idx: u32) -> Option<&Slot> {
        let i = idx as usize;
        self.chunks.get(i / CHUNK)?.get(i % CHUNK)
    }

    pub fn get_mut(&mut self, idx: u32) -> Option<&mut Slot> {
        let i = idx as usize;
        self.chunks.get_mut(i / CHUNK)?.get_mut(i % CHUNK)
    }

    /// Adds an empty slot and returns its index.
    pub fn push(&mut self) -> u32 {
        if self.len.is_multiple_of(CHUNK) {
            self.chunks.push(Vec::with_capacity(CHUNK));
        }
        if let Some(chunk) = self.chunks.last_mut() {
            chunk.push(Slot {
                generation: 0,
                flow: None,
            });
        }
        self.len += 1;
        (self.len - 1) as u32
    }

    pub fn iter(&self) -> impl Iterator<Item = &Slot> {
        self.chunks.iter().flatten()
    }

    pub fn flow(&self, r: FlowRef) -> Option<&Flow> {
        self.get(r.idx)
            .filter(|s| s.generation == r.generation)?
            .flow
            .as_ref()
    }

    pub fn heap_bytes(&self) -> usize {
        self.chunks.len() * CHUNK * size_of::<Slot>()
            + self.chunks.capacity() * size_of::<Vec<Slot>>()
    }

    fn pair(&self, idx: u32, pair: usize) -> Option<PairKey> {
        self.get(idx)?.flow.as_ref()?.pair(pair)
    }
}

/// One entry of [`PairIndex`]: 8 bytes instead of the 52 of a
/// `(PairKey, FlowRef)`; the key itself is read from the flow.
#[derive(Clone, Copy)]
struct PairEntry {
    /// Low half of the key's hash: rehashing needs no flow lookup, and
    /// most mismatches are rejected without one.
    hash: u32,
    /// Slot index << 2 | index of the pair in the flow's pairs.
    slot_pair: u32,
}

const PAIR_BITS: u32 = 2;
const _: () = assert!(super::flow::MAX_PAIRS <= 1 << PAIR_BITS);
/// Slots an entry can name: 2^30 flows are far beyond any live-flow limit
/// that fits in memory.
pub(super) const MAX_SLOTS: usize = 1 << (32 - PAIR_BITS);

impl PairEntry {
    fn new(hash: u32, idx: u32, pair: usize) -> Self {
        Self {
            hash,
            slot_pair: idx << PAIR_BITS | pair as u32,
        }
    }

    fn slot(self) -> u32 {
        self.slot_pair >> PAIR_BITS
    }

    fn pair(self) -> usize {
        (self.slot_pair & ((1 << PAIR_BITS) - 1)) as usize
    }
}

/// Address pair → the flow that last claimed it (what `HashMap<PairKey,
/// FlowRef>` did, at a sixth of the size). Every entry names a live flow:
/// removing a flow removes its entries.
#[derive(Default)]
pub(super) struct PairIndex {
    table: HashTable<PairEntry>,
    /// foldhash, not SipHash: SipHash was 4% of a healthy connection's
    /// instructions (callgrind, BENCHMARKS.md).
    state: foldhash::fast::RandomState,
}

/// The table wants 64 bits: its top 7 select the control byte, the low
/// ones the bucket; a multiply spreads the 32 kept bits over both.
fn spread(hash: u32) -> u64 {
    u64::from(hash).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

impl PairIndex {
    fn hash(&self, key: &PairKey) -> u32 {
        self.state.hash_one(key) as u32
    }

    /// The slot of the flow holding `key`.
    pub fn get(&self, key: &PairKey, slots: &Slots) -> Option<u32> {
        let h = self.hash(key);
        self.table
            .find(spread(h), |e| {
                e.hash == h && slots.pair(e.slot(), e.pair()).as_ref() == Some(key)
            })
            .map(|e| e.slot())
    }

    /// `key` now leads to pair `pair` of the flow in slot `idx` (the flow
    /// holds it already), replacing any flow that held it before.
    pub fn insert(&mut self, key: &PairKey, idx: u32, pair: usize, slots: &Slots) {
        let h = self.hash(key);
        let new = PairEntry::new(h, idx, pair);
        let eq =
            |e: &PairEntry| e.hash == h && slots.pair(e.slot(), e.pair()).as_ref() == Some(key);
        match self.table.find_mut(spread(h), eq) {
            Some(e) => *e = new,
            None => {
                self.table.insert_unique(spread(h), new, |e| spread(e.hash));
            }
        }
    }

    /// Forgets `key` if it still leads to pair `pair` of slot `idx`.
    pub fn remove(&mut self, key: &PairKey, idx: u32, pair: usize) {
        let h = self.hash(key);
        let slot_pair = PairEntry::new(h, idx, pair).slot_pair;
        if let Ok(e) = self
            .table
            .find_entry(spread(h), |e| e.slot_pair == slot_pair)
        {
            e.remove();
        }
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    pub fn heap_bytes(&self) -> usize {
        self.table.allocation_size()
    }
}
