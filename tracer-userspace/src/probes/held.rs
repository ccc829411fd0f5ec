//! Userspace's side of the kernel's per-flow buffer (`HELD`,
//! tracer-ebpf/src/held.rs): a held flow whose reply deadline comes is
//! read and deleted here, its events handed on as if they had come through
//! the ring buffer (flag PULLED), so a `no_reply` flow keeps every hop.
use aya::maps::{HashMap, MapData, MapError};
use tracer_common::{EndpointKey, HELD_CLOSED, HELD_SLOTS, HeldFlow, PacketEvent, event_flags};

impl super::Tracer {
    /// The held events of these flows (the collector's
    /// `take_due_held`), read and deleted in the kernel.
    pub fn pull(&mut self, clients: &[EndpointKey], out: &mut Vec<PacketEvent>) {
        self.held.pull(clients, out, self.facts.netns_inode);
    }

    /// The held events of every flow opened before `before_ns`
    /// (CLOCK_MONOTONIC; u64::MAX: all, at exit).
    pub fn pull_older(&mut self, before_ns: u64, out: &mut Vec<PacketEvent>) {
        self.held.pull_older(before_ns, out, self.facts.netns_inode);
    }
}

pub(super) struct HeldMap {
    map: HashMap<MapData, EndpointKey, HeldFlow>,
}

impl HeldMap {
    pub(super) fn new(map: HashMap<MapData, EndpointKey, HeldFlow>) -> Self {
        Self { map }
    }

    /// Reads and deletes these flows' buffers; their events, in order, go
    /// to `out`. A flow the kernel already sent or discarded has none.
    pub(super) fn pull(&mut self, keys: &[EndpointKey], out: &mut Vec<PacketEvent>, inode: u32) {
        for key in keys {
            let flow = match self.map.get(key, 0) {
                Ok(flow) => flow,
                Err(MapError::KeyNotFound) => continue,
                Err(e) => {
                    log::warn!("HELD lookup: {e}");
                    continue;
                }
            };
            // Deleted first: a kernel program that finds no entry sends the
            // flow's next event itself.
            if let Err(e) = self.map.remove(key)
                && !matches!(e, MapError::KeyNotFound)
            {
                log::warn!("HELD delete: {e}");
            }
            take_events(&flow, out, inode);
        }
    }

    /// Every held flow whose first event is older than `before_ns` (all of
    /// them with u64::MAX: at exit). Flows the collector never asked for
    /// (their first event was lost) would otherwise hold an entry forever.
    pub(super) fn pull_older(&mut self, before_ns: u64, out: &mut Vec<PacketEvent>, inode: u32) {
        let keys: Vec<EndpointKey> = self
            .map
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, f)| f.first_ts < before_ns)
            .map(|(k, _)| k)
            .collect();
        self.pull(&keys, out, inode);
    }
}

/// The held events of one flow, flagged PULLED, with the node namespace
/// filled in as the ring-buffer reader does.
fn take_events(flow: &HeldFlow, out: &mut Vec<PacketEvent>, inode: u32) {
    if flow.count >= HELD_CLOSED {
        // Being sent by the kernel right now.
        return;
    }
    let n = (flow.count as usize).min(HELD_SLOTS);
    let start = out.len();
    for ev in &flow.events[..n] {
        let mut ev = *ev;
        ev.flags = event_flags::PULLED;
        super::fill_node_netns(&mut ev, inode);
        out.push(ev);
    }
    // Slots are claimed in order, but two CPUs may have written them out of order.
    out[start..].sort_by_key(|e| e.ts_ns);
}
