//! The kernel's SERVICES map, kept equal to a wanted set of Service ports
//! by inserting and deleting only the difference: a re-read of kube-proxy's
//! rules that changed nothing costs no syscall, and packets of Services that
//! stay are never unmatched in between (no clear-and-refill).
//! Everything that knows the key layout is here (`key`).
//!
//! The kernel looks a packet up in SERVICES only when its destination
//! address's Service element is set in the ADDR_SLOTS pre-filter
//! (tracer_common::prefilter; the client elements beside them are the
//! programs'), so every Service address added here sets its element too.
//! Elements are never cleared: a stale one costs the exact lookups, never
//! a wrong match.
use std::collections::BTreeSet;

use aya::maps::{Array, HashMap, MapData, MapError};
use tracer_common::{Addr, ServiceKey};

use crate::service::{ServicePort, kernel_addr};

/// Map value for Service ports that come from kube-proxy's rules (the
/// `--svc` ones carry their index, 0..=254: probes::validate allows 255).
const FROM_RULES: u8 = u8::MAX;

/// Entries of SERVICES with `--all-services` (a hash map is preallocated:
/// about 1 MiB of kernel memory). Kubernetes supports 10k Services per
/// cluster; most have one or two ports.
pub const ALL_SERVICES_ENTRIES: u32 = 16384;

fn key(p: &ServicePort) -> ServiceKey {
    ServiceKey {
        addr: kernel_addr(p.addr),
        port: p.port,
        proto: p.proto,
        _pad: 0,
    }
}

/// What one sync changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServicesSynced {
    pub added: usize,
    pub removed: usize,
    /// Wanted but not inserted (the map is full).
    pub failed: usize,
}

pub(super) struct ServiceMap {
    map: HashMap<MapData, ServiceKey, u8>,
    /// The ADDR_SLOTS pre-filter (its Service elements).
    slots: Array<MapData, u8>,
    /// What the map holds now.
    current: BTreeSet<ServicePort>,
}

impl ServiceMap {
    /// `current`: what the loader wrote before attaching (`--svc`).
    pub(super) fn new(
        map: HashMap<MapData, ServiceKey, u8>,
        slots: Array<MapData, u8>,
        current: BTreeSet<ServicePort>,
    ) -> Self {
        Self {
            map,
            slots,
            current,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.current.len()
    }

    pub(super) fn sync(&mut self, wanted: &BTreeSet<ServicePort>) -> ServicesSynced {
        let mut done = ServicesSynced::default();
        let gone: Vec<ServicePort> = self.current.difference(wanted).copied().collect();
        for p in gone {
            match self.map.remove(&key(&p)) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {
                    self.current.remove(&p);
                    done.removed += 1;
                }
                Err(e) => log::warn!("SERVICES delete {}:{}: {e}", p.addr, p.port),
            }
        }
        let new: Vec<ServicePort> = wanted.difference(&self.current).copied().collect();
        for p in new {
            // Before the SERVICES entry, so its first packet passes the
            // pre-filter. Slots are never evicted: once is enough.
            if let Err(e) = remember_addr(&mut self.slots, kernel_addr(p.addr)) {
                log::warn!("ADDR_SLOTS set {}: {e}", p.addr);
            }
            match self.map.insert(key(&p), FROM_RULES, 0) {
                Ok(()) => {
                    self.current.insert(p);
                    done.added += 1;
                }
                Err(e) => {
                    log::debug!("SERVICES insert {}:{}: {e}", p.addr, p.port);
                    done.failed += 1;
                }
            }
        }
        done
    }
}

/// Sets `addr`'s Service element of the pre-filter
/// (tracer_common::prefilter). Only userspace writes Service elements, and
/// only the programs client elements: no read-modify-write to race.
pub(super) fn remember_addr<T: std::borrow::BorrowMut<MapData>>(
    slots: &mut Array<T, u8>,
    addr: Addr,
) -> Result<(), MapError> {
    slots.set(tracer_common::prefilter::service_element(&addr), 1, 0)
}
