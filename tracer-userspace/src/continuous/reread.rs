//! `--all-services`: kube-proxy's rules re-read every `--rules-interval`
//! on a thread of its own (`iptables-save`/`nft` take from milliseconds to
//! a second on a big node; the event loop must not wait for them). The
//! session takes the newest changed ruleset at its next tick.
use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use crate::ruleset::{self, KubeProxyRules, ProxyMode};

#[derive(Default)]
struct Shared {
    /// The newest ruleset that differs from the previous one, not yet taken.
    changed: Mutex<Option<KubeProxyRules>>,
    stop: AtomicBool,
    reads_ok: AtomicU64,
    reads_failed: AtomicU64,
}

pub struct RulesWatch {
    shared: Arc<Shared>,
}

/// Whether `next` replaces `last`. A read that finds no kube-proxy rules
/// at all where there were some is believed only the second time in a row:
/// a failed read (a tool's lock, a restore in progress) must not untrace
/// every Service for one interval.
fn accept(last: &KubeProxyRules, next: &KubeProxyRules, empty_before: bool) -> bool {
    let empty = next.mode == ProxyMode::None;
    if empty && last.mode != ProxyMode::None && !empty_before {
        return false;
    }
    next != last
}

impl RulesWatch {
    /// `first`: the rules read at start (in the session's header).
    pub fn spawn(netns: Option<String>, interval: Duration, first: KubeProxyRules) -> Self {
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("rules".into())
            .spawn(move || {
                // Found by the session at start (IPVS, eBPF data planes),
                // not by a rules read: carried over.
                let outside = first.outside_netfilter.clone();
                let mut last = first;
                let mut empty_before = false;
                while !s.stop.load(Ordering::Relaxed) {
                    std::thread::sleep(interval);
                    if s.stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let mut next = ruleset::read(netns.as_deref());
                    next.outside_netfilter = outside.clone();
                    let empty = next.mode == ProxyMode::None;
                    if empty {
                        s.reads_failed.fetch_add(1, Ordering::Relaxed);
                    } else {
                        s.reads_ok.fetch_add(1, Ordering::Relaxed);
                    }
                    if accept(&last, &next, empty_before) {
                        *s.changed.lock().unwrap_or_else(|e| e.into_inner()) = Some(next.clone());
                        last = next;
                    }
                    empty_before = empty;
                }
            });
        if let Err(e) = spawned {
            log::warn!("cannot start the rules reader: {e}");
        }
        Self { shared }
    }

    /// The rules if they changed since the last call.
    pub fn take(&self) -> Option<KubeProxyRules> {
        self.shared
            .changed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// (successful, empty or failed) reads so far.
    pub fn reads(&self) -> (u64, u64) {
        (
            self.shared.reads_ok.load(Ordering::Relaxed),
            self.shared.reads_failed.load(Ordering::Relaxed),
        )
    }
}

impl Drop for RulesWatch {
    fn drop(&mut self) {
        // The thread ends after its current sleep or read; nobody waits.
        self.shared.stop.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_empty_read_is_not_believed() {
        let some = KubeProxyRules {
            mode: ProxyMode::Iptables,
            ..Default::default()
        };
        let none = KubeProxyRules::default();
        assert!(!accept(&some, &none, false));
        assert!(accept(&some, &none, true));
        assert!(!accept(&some, &some.clone(), false));
        assert!(accept(&none, &some, false));
    }
}
