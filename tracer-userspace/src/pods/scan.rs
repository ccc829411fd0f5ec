//! Reading the node for the [`PodIndex`]: the container runtime's CRI,
//! /proc, kubelet's pod directories under the host root, and `ip netns`
//! names. Unreadable parts are skipped: a name is a help, never a reason to
//! stop tracing.
use std::{
    collections::HashMap,
    fs,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

use super::{
    PodEntry, PodIndex, PodSource, cri, local_v4, local_v6, pod_of_log_dir, pod_uid_of_cgroup,
};

// Roots and netns_of live in the parent module: cri.rs needs them too, and
// taking them from here made scan.rs and cri.rs import each other.
use super::netns_of;
pub use super::{KUBELET_PODS_DIR, Roots};

/// Reads the node's pods again when asked, and every [`REFRESH_EVERY`]
/// (a namespace inode freed by a deleted pod can be another's later).
pub struct Rescan {
    roots: Roots,
    node_netns: u32,
    last: Option<std::time::Instant>,
    cri: Option<CriSource>,
}

/// The runtime's socket and what it last said.
struct CriSource {
    socket: PathBuf,
    /// The runtime's name and version, or why it did not answer.
    answer: Option<Result<String, String>>,
    /// After a timeout: not asked again before then (each ask holds up
    /// the event loop for as long as the runtime hangs).
    resting_until: Option<std::time::Instant>,
}

/// A /proc walk takes milliseconds: this often costs nothing.
pub const REFRESH_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// How long a runtime that timed out is left alone.
pub const CRI_REST: std::time::Duration = std::time::Duration::from_secs(60);

/// The budget of a rescan's CRI query (the start's is [`cri::TIMEOUT`]):
/// a rescan runs on the event loop between ring-buffer drains, so a slow
/// runtime may hold the loop this long at most, once a [`CRI_REST`]. A
/// healthy containerd answers a node's hundred pods in tens of ms.
pub const CRI_RESCAN_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(500);

impl Rescan {
    pub fn new(roots: Roots, node_netns: u32) -> Self {
        Self {
            roots,
            node_netns,
            last: None,
            cri: None,
        }
    }

    /// Asks the runtime at `socket` first (`--cri-socket`, else the first
    /// of [`cri::SOCKETS`] under the host root: see [`cri::find_socket`]).
    pub fn with_cri(mut self, socket: Option<PathBuf>) -> Self {
        self.cri = socket.map(|socket| CriSource {
            socket,
            answer: None,
            resting_until: None,
        });
        self
    }

    /// Where the names come from, for the start (issue 29 asks it be said).
    pub fn source_line(&self, index: &PodIndex) -> String {
        let host = self.roots.host.display();
        let count = |src| {
            index
                .pods
                .iter()
                .filter(|p| p.named_by == Some(src))
                .count()
        };
        let kubelet = self.roots.host.join(KUBELET_PODS_DIR).is_dir();
        let cri_failed = match &self.cri {
            Some(CriSource {
                socket,
                answer: Some(Ok(runtime)),
                ..
            }) => {
                let more = match count(PodSource::Kubelet) {
                    0 => String::new(),
                    n => format!(", {n} more from kubelet's pod directories under {host}"),
                };
                return format!(
                    "pod names from the container runtime ({runtime} at {}; {} pods{more})",
                    socket.display(),
                    count(PodSource::Cri)
                );
            }
            Some(CriSource {
                socket,
                answer: Some(Err(why)),
                ..
            }) => Some(format!(
                "the container runtime at {} did not answer ({why})",
                socket.display()
            )),
            _ => None,
        };
        if kubelet {
            // The wording the lab's tests look for when this is the source.
            let line = format!(
                "pod names from kubelet's pod directories under {host} and the pods' cgroups ({} pods of this node now)",
                count(PodSource::Kubelet)
            );
            return match cri_failed {
                Some(why) => format!("{line}; {why}"),
                None => line,
            };
        }
        let cri = cri_failed.unwrap_or_else(|| {
            format!(
                "no container runtime socket under {host} ({}; give its path with --cri-socket)",
                cri::SOCKETS.join(", ")
            )
        });
        format!(
            "pods are not named: {cri}, and no kubelet pod directories ({KUBELET_PODS_DIR}) under {host}; point --host-root at the node's root filesystem (e.g. /host)"
        )
    }

    pub fn stale(&self) -> bool {
        self.last.is_none_or(|t| t.elapsed() >= REFRESH_EVERY)
    }

    pub fn scan(&mut self) -> PodIndex {
        let now = std::time::Instant::now();
        let budget = if self.last.is_none() {
            cri::TIMEOUT
        } else {
            CRI_RESCAN_TIMEOUT
        };
        self.last = Some(now);
        let from_cri = match self.cri.as_mut() {
            Some(c) if c.resting_until.is_none_or(|t| now >= t) => {
                match cri::query(&c.socket, budget) {
                    Ok(listing) => {
                        c.answer = Some(Ok(listing.runtime.clone()));
                        c.resting_until = None;
                        listing.entries(&self.roots, self.node_netns)
                    }
                    Err(e) => {
                        if e.is_timeout() {
                            c.resting_until = Some(now + CRI_REST);
                        }
                        log::debug!("CRI at {}: {e}", c.socket.display());
                        c.answer = Some(Err(e.to_string()));
                        Vec::new()
                    }
                }
            }
            _ => Vec::new(),
        };
        scan_with(&self.roots, self.node_netns, from_cri)
    }
}

/// Pod UID → `namespace/name`, from kubelet's pod directories.
fn kubelet_pods(host: &Path) -> HashMap<String, String> {
    let Ok(dir) = fs::read_dir(host.join(KUBELET_PODS_DIR)) else {
        return HashMap::new();
    };
    dir.flatten()
        .filter_map(|e| pod_of_log_dir(&e.file_name().to_string_lossy()))
        .map(|(name, uid)| (uid, name))
        .collect()
}

/// Netns inode → `ip netns` name.
fn netns_names(run_netns: &Path) -> HashMap<u32, String> {
    let Ok(dir) = fs::read_dir(run_netns) else {
        return HashMap::new();
    };
    dir.flatten()
        .filter_map(|e| {
            let ino = fs::metadata(e.path()).ok()?.ino();
            Some((
                u32::try_from(ino).ok()?,
                e.file_name().to_string_lossy().into_owned(),
            ))
        })
        .collect()
}

/// Every pod network namespace but the node's own (`node_netns`), from
/// the node's files alone.
pub fn scan(roots: &Roots, node_netns: u32) -> PodIndex {
    scan_with(roots, node_netns, Vec::new())
}

/// [`scan`], with the runtime's pods (`from_cri`) taking precedence.
pub fn scan_with(roots: &Roots, node_netns: u32, from_cri: Vec<PodEntry>) -> PodIndex {
    let names = kubelet_pods(&roots.host);
    let netns_names = netns_names(&roots.run_netns);
    let mut by_netns: HashMap<u32, PodEntry> = HashMap::new();
    let procs = fs::read_dir(&roots.proc).into_iter().flatten().flatten();
    for e in procs {
        if !e
            .file_name()
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
        {
            continue;
        }
        let dir = e.path();
        let Some(netns) = netns_of(&dir).filter(|n| *n != node_netns) else {
            continue;
        };
        let entry = by_netns.entry(netns).or_insert_with(|| PodEntry {
            netns,
            addrs: addrs_of(&dir),
            pod: None,
            uid: None,
            netns_name: netns_names.get(&netns).cloned(),
            named_by: None,
        });
        if entry.uid.is_some() {
            continue;
        }
        let cgroup = fs::read_to_string(dir.join("cgroup")).unwrap_or_default();
        if let Some(uid) = cgroup.lines().find_map(pod_uid_of_cgroup) {
            entry.pod = names.get(&uid).cloned();
            entry.named_by = entry.pod.as_ref().map(|_| PodSource::Kubelet);
            entry.uid = Some(uid);
        }
    }
    // Named namespaces no process holds (yet): the name alone.
    for (netns, name) in netns_names {
        if netns != node_netns {
            by_netns.entry(netns).or_insert_with(|| PodEntry {
                netns,
                addrs: Vec::new(),
                pod: None,
                uid: None,
                netns_name: Some(name),
                named_by: None,
            });
        }
    }
    let mut pods: Vec<PodEntry> = merge(by_netns.into_values().collect(), from_cri)
        .into_iter()
        .filter(|p| p.uid.is_some() || p.netns_name.is_some() || p.pod.is_some())
        .collect();
    pods.sort_by(|a, b| (a.netns, &a.pod).cmp(&(b.netns, &b.pod)));
    PodIndex { pods }
}

/// The runtime's pods over what the node's files say: each CRI entry takes
/// the found namespace of the same inode (or of the same pod UID) and
/// gives it its pod, UID and addresses (the namespace's own when the
/// runtime lists none); the `ip netns` name stays. Namespaces the runtime
/// did not list keep what the cgroups and kubelet's directories said.
pub fn merge(mut found: Vec<PodEntry>, from_cri: Vec<PodEntry>) -> Vec<PodEntry> {
    for c in from_cri {
        // By UID only when the runtime's netns was not found here: a
        // UID's other namespace is its pod's previous sandbox.
        let same = if c.netns != 0 {
            found.iter().position(|f| f.netns == c.netns)
        } else {
            c.uid
                .as_ref()
                .and_then(|u| found.iter().position(|f| f.uid.as_ref() == Some(u)))
        };
        match same {
            Some(i) => {
                let f = &mut found[i];
                if !c.addrs.is_empty() {
                    f.addrs = c.addrs;
                }
                f.pod = c.pod;
                f.uid = c.uid.or(f.uid.take());
                f.named_by = Some(PodSource::Cri);
            }
            None => found.push(c),
        }
    }
    found
}

fn addrs_of(pid_dir: &Path) -> Vec<std::net::IpAddr> {
    let read = |f: &str| fs::read_to_string(pid_dir.join("net").join(f)).unwrap_or_default();
    let mut out = local_v4(&read("fib_trie"));
    out.extend(local_v6(&read("if_inet6")));
    out
}
