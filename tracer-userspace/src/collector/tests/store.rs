//! The flow store: chunked slots and the pair index that reads its keys
//! from the flows.
use tracer_common::PacketEvent;

use crate::collector::{
    Collector,
    flow::Flow,
    store::{PairIndex, Slots},
    testing::{config, from_jsonl},
    types::PairKey,
};

const HEALTHY: &str = include_str!(crate::fixture!("seed000_healthy.jsonl"));

fn opening(port: u16) -> PacketEvent {
    let mut ev = from_jsonl(HEALTHY)[0];
    ev.sport = port;
    ev
}

fn add(slots: &mut Slots, ev: &PacketEvent) -> u32 {
    let idx = slots.push();
    slots.get_mut(idx).expect("pushed").flow = Some(Flow::new(ev));
    idx
}

#[test]
fn pair_index_finds_replaces_and_forgets() {
    let mut slots = Slots::default();
    let mut index = PairIndex::default();
    // Across several slot chunks and table resizes.
    for port in 1000..3500 {
        let ev = opening(port);
        let idx = add(&mut slots, &ev);
        index.insert(&PairKey::of(&ev), idx, 0, &slots);
    }
    for port in 1000..3500 {
        let found = index.get(&PairKey::of(&opening(port)), &slots);
        assert_eq!(found, Some(u32::from(port - 1000)));
    }
    assert_eq!(index.get(&PairKey::of(&opening(9000)), &slots), None);

    // A new connection from the same client port takes the pair over; the
    // old flow leaving does not take it away.
    let ev = opening(1007);
    let key = PairKey::of(&ev);
    let newer = add(&mut slots, &ev);
    index.insert(&key, newer, 0, &slots);
    assert_eq!(index.get(&key, &slots), Some(newer));
    index.remove(&key, 7, 0);
    assert_eq!(index.get(&key, &slots), Some(newer));
    index.remove(&key, newer, 0);
    assert_eq!(index.get(&key, &slots), None);
    // 8-byte entries and a control byte each, for ~2,500 entries.
    assert!(index.heap_bytes() < 4096 * 9 + 64, "{}", index.heap_bytes());
}

/// Every tuple a flow recorded (the ends stored as roles, or as extra
/// endpoints) leads back to it, for flows with NAT on both ends.
#[test]
fn recorded_pairs_lead_back_to_their_flow() {
    let mut checked = 0;
    // One collector each: the fixtures share client ports.
    for text in [
        HEALTHY,
        include_str!(crate::fixture!("seed000_broken.jsonl")),
        include_str!(crate::fixture!("cross_node_ok.jsonl")),
        include_str!(crate::fixture!("reply_dropped.jsonl")),
    ] {
        let mut c = Collector::new(config(Some(true)));
        let events = from_jsonl(text);
        for &ev in &events {
            c.push(ev);
        }
        // Out of the reorder buffer, decided, not yet idle.
        let last = events.iter().map(|e| e.ts_ns).max().unwrap_or(0);
        c.tick(last + 5_000_000_000);
        for (idx, slot) in c.slots.iter().enumerate() {
            let Some(flow) = &slot.flow else { continue };
            for pair in flow.pairs() {
                assert_eq!(c.pairs.get(&pair, &c.slots), Some(idx as u32));
                checked += 1;
            }
        }
    }
    // Each flow has its tuple before and after DNAT at least.
    assert!(checked >= 8, "{checked}");
}
