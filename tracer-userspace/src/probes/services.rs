//! The kernel's SERVICES map, kept equal to a wanted set of Service ports
//! by inserting and deleting only the difference: a re-read of kube-proxy's
//! rules that changed nothing costs no syscall, and packets of Services that
//! stay are never unmatched in between (no clear-and-refill).
//! Everything that knows the key layout is here (`key`).
//!
//! The kernel looks a packet up in SERVICES only when its destination
//! address is in the ADDRS pre-filter (an LRU map shared with the flows'
//! client addresses), so every Service address added here goes into ADDRS
//! too. Removed Services' addresses are left there: the address may be a
//! client's too, and a stale entry costs one more lookup, never a wrong match.
use std::collections::BTreeSet;

use aya::maps::{HashMap, MapData};
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
    /// The ADDRS pre-filter (LRU hash; aya's HashMap opens it).
    addrs: HashMap<MapData, Addr, u8>,
    /// What the map holds now.
    current: BTreeSet<ServicePort>,
}

impl ServiceMap {
    /// `current`: what the loader wrote before attaching (`--svc`).
    pub(super) fn new(
        map: HashMap<MapData, ServiceKey, u8>,
        addrs: HashMap<MapData, Addr, u8>,
        current: BTreeSet<ServicePort>,
    ) -> Self {
        Self {
            map,
            addrs,
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
        // Every wanted address, not only the new ones: ADDRS is an LRU map,
        // and a Service without traffic for a long time may have been
        // evicted by client addresses meanwhile (one update per distinct
        // Service IP each time the rules change; between changes an evicted
        // idle Service stays unmatched until they change again).
        let addrs: BTreeSet<_> = wanted.iter().map(|p| p.addr).collect();
        for addr in addrs {
            if let Err(e) = self.addrs.insert(kernel_addr(addr), 1, 0) {
                log::debug!("ADDRS insert {addr}: {e}");
            }
        }
        let new: Vec<ServicePort> = wanted.difference(&self.current).copied().collect();
        for p in new {
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
