//! Names of the interfaces that events come from, in whatever namespace:
//! the node's own (also those created after start, e.g. a new pod's veth)
//! and the pods' (the device tracepoints see every namespace). An event
//! carries only (netns inode, ifindex); the name is read once per pair,
//! read-only, from the namespace itself: find a file of that namespace
//! (`/run/netns/*`, `/proc/<pid>/ns/net`), enter it on a short-lived thread
//! and dump its links over rtnetlink.
use std::{
    collections::HashMap,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use super::netns::{self, Netns};
use crate::facts::Interface;

/// A pair not found is looked up again after this long (the interface may
/// not exist yet, or its namespace file may appear later).
const RETRY: Duration = Duration::from_secs(1);
/// `/proc` is scanned for namespace files at most this often.
const SCAN_EVERY: Duration = Duration::from_secs(1);
/// Where `ip netns` and container runtimes (CNI's `cni-<uuid>`) keep
/// namespace files; processes' `/proc/<pid>/ns/net` cover the rest.
const NETNS_DIRS: &[&str] = &["/run/netns", "/var/run/netns"];
/// Interfaces remembered at most (see [`IfNameResolver::learn`]).
const MAX_STATES: usize = 65536;

enum State {
    Known,
    Missing(Instant),
}

pub struct IfNameResolver {
    node: Netns,
    state: HashMap<(u32, u32), State>,
    /// Namespace inode → a file of it, from the last scan.
    paths: HashMap<u32, PathBuf>,
    last_scan: Option<Instant>,
}

impl IfNameResolver {
    /// `node`: the traced namespace (`--netns`), whose interfaces at start
    /// (`known`) are named already.
    pub fn new(node: Netns, known: &[Interface]) -> Self {
        let inode = node.inode;
        Self {
            node,
            state: known
                .iter()
                .map(|i| ((inode, i.ifindex), State::Known))
                .collect(),
            paths: HashMap::new(),
            last_scan: None,
        }
    }

    /// Names learned for the namespace of (`netns`, `ifindex`) if that pair
    /// is new: every interface of that namespace not reported before, as
    /// (ifindex, name). Empty when the pair is known, was looked up less
    /// than [`RETRY`] ago, or its namespace is gone.
    pub fn learn(&mut self, netns: u32, ifindex: u32) -> Vec<(u32, String)> {
        let inode = if netns == 0 { self.node.inode } else { netns };
        match self.state.get(&(inode, ifindex)) {
            Some(State::Known) => return Vec::new(),
            Some(State::Missing(at)) if at.elapsed() < RETRY => return Vec::new(),
            _ => {}
        }
        if self.state.len() >= MAX_STATES {
            // A long run sees thousands of pods come and go: forget
            // theirs (a live one is looked up again), keep the node's.
            let node = self.node.inode;
            self.state.retain(|&(ns, _), _| ns == node);
        }
        let started = Instant::now();
        let links = self.links(inode).unwrap_or_default();
        log::debug!(
            "interface names of netns {inode}: {} links in {:?}",
            links.len(),
            started.elapsed()
        );
        let mut learned = Vec::new();
        for link in links {
            let key = (inode, link.ifindex);
            if !matches!(self.state.get(&key), Some(State::Known)) && !link.name.is_empty() {
                self.state.insert(key, State::Known);
                learned.push((link.ifindex, link.name));
            }
        }
        if !matches!(self.state.get(&(inode, ifindex)), Some(State::Known)) {
            self.state
                .insert((inode, ifindex), State::Missing(Instant::now()));
        }
        learned
    }

    fn links(&mut self, inode: u32) -> Option<Vec<Interface>> {
        if inode == self.node.inode {
            return self.node.run(netns::list_interfaces).ok()?.ok();
        }
        let path = self.path_of(inode)?;
        let ns = Netns::open(Some(&path.to_string_lossy())).ok()?;
        // The file may now be another namespace (pid reused, file replaced).
        if ns.inode != inode {
            self.paths.remove(&inode);
            return None;
        }
        ns.run(netns::list_interfaces).ok()?.ok()
    }

    fn path_of(&mut self, inode: u32) -> Option<PathBuf> {
        if let Some(p) = self.paths.get(&inode) {
            return Some(p.clone());
        }
        if self.last_scan.is_some_and(|t| t.elapsed() < SCAN_EVERY) {
            return None;
        }
        self.last_scan = Some(Instant::now());
        self.paths = scan_netns_files();
        self.paths.get(&inode).cloned()
    }
}

/// Every namespace file found, by inode (the first path per inode).
pub(super) fn scan_netns_files() -> HashMap<u32, PathBuf> {
    let mut paths = HashMap::new();
    let mut add = |path: PathBuf| {
        if let Ok(meta) = std::fs::metadata(&path) {
            paths.entry(meta.ino() as u32).or_insert(path);
        }
    };
    for dir in NETNS_DIRS {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            add(entry.path());
        }
    }
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let name = entry.file_name();
        if name
            .to_str()
            .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        {
            add(Path::new("/proc").join(name).join("ns/net"));
        }
    }
    paths
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_its_own_namespace_by_inode() {
        let own = std::fs::metadata("/proc/self/ns/net").unwrap().ino() as u32;
        assert!(scan_netns_files().contains_key(&own));
    }

    #[test]
    fn names_interfaces_of_another_namespace_file_once() {
        // The current namespace, looked up as if it were a pod's: through
        // the scan, not through the node handle.
        let node = Netns::open(Some("/proc/self/ns/net")).unwrap();
        let own = node.inode;
        let mut r = IfNameResolver::new(node, &[]);
        r.node.inode = 0; // so `own` is not taken for the node
        let learned = r.learn(own, 1);
        assert!(
            learned.iter().any(|(i, n)| *i == 1 && n == "lo"),
            "{learned:?}"
        );
        assert!(r.learn(own, 1).is_empty(), "reported once");
        // A namespace that does not exist: nothing, and no second scan.
        assert!(r.learn(u32::MAX, 1).is_empty());
    }
}
