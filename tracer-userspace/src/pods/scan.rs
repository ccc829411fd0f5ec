//! Reading the node for the [`PodIndex`]: /proc, kubelet's pod directories
//! under the host root, and `ip netns` names. Unreadable parts are skipped:
//! a name is a help, never a reason to stop tracing.
use std::{
    collections::HashMap,
    fs,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

use super::{PodEntry, PodIndex, local_v4, local_v6, pod_of_log_dir, pod_uid_of_cgroup};

/// Where kubelet keeps a directory per pod, relative to the host root.
pub const KUBELET_PODS_DIR: &str = "var/log/pods";

/// Where the node's files are read from.
#[derive(Clone, Debug)]
pub struct Roots {
    /// `/proc` of the node's PID namespace.
    pub proc: PathBuf,
    /// The node's root filesystem: `/`, or `/host` in `kubectl debug node`.
    pub host: PathBuf,
    /// `ip netns`'s directory of named namespaces.
    pub run_netns: PathBuf,
}

impl Roots {
    /// `--host-root`, else `/` when it has kubelet's pod directories, else
    /// [`crate::host::HOST_ROOT`] when that has them.
    pub fn node(host_root: Option<&Path>) -> Self {
        let host = host_root.map(Path::to_path_buf).unwrap_or_else(|| {
            let own = PathBuf::from("/");
            let container = PathBuf::from(crate::host::HOST_ROOT);
            if !own.join(KUBELET_PODS_DIR).is_dir() && container.join(KUBELET_PODS_DIR).is_dir() {
                container
            } else {
                own
            }
        });
        Self {
            proc: PathBuf::from("/proc"),
            host,
            run_netns: PathBuf::from("/run/netns"),
        }
    }
}

/// Reads the node's pods again when asked, and every [`REFRESH_EVERY`]
/// (a namespace inode freed by a deleted pod can be another's later).
pub struct Rescan {
    roots: Roots,
    node_netns: u32,
    last: Option<std::time::Instant>,
}

/// A /proc walk takes milliseconds: this often costs nothing.
pub const REFRESH_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

impl Rescan {
    pub fn new(roots: Roots, node_netns: u32) -> Self {
        Self {
            roots,
            node_netns,
            last: None,
        }
    }

    /// Where the names come from, for the start (issue 29 asks it be said).
    pub fn source_line(&self, index: &PodIndex) -> String {
        let host = self.roots.host.display();
        if !self.roots.host.join(KUBELET_PODS_DIR).is_dir() {
            return format!(
                "pods are not named: no kubelet pod directories ({KUBELET_PODS_DIR}) under {host}; point --host-root at the node's root filesystem (e.g. /host)"
            );
        }
        let named = index.pods.iter().filter(|p| p.pod.is_some()).count();
        format!(
            "pod names from kubelet's pod directories under {host} and the pods' cgroups ({named} pods of this node now)"
        )
    }

    pub fn stale(&self) -> bool {
        self.last.is_none_or(|t| t.elapsed() >= REFRESH_EVERY)
    }

    pub fn scan(&mut self) -> PodIndex {
        self.last = Some(std::time::Instant::now());
        scan(&self.roots, self.node_netns)
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

/// The netns inode of `/proc/PID`, from its `ns/net` link (`net:[N]`).
fn netns_of(pid_dir: &Path) -> Option<u32> {
    let link = fs::read_link(pid_dir.join("ns/net")).ok()?;
    link.to_str()?
        .strip_prefix("net:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// Every pod network namespace but the node's own (`node_netns`).
pub fn scan(roots: &Roots, node_netns: u32) -> PodIndex {
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
        });
        if entry.uid.is_some() {
            continue;
        }
        let cgroup = fs::read_to_string(dir.join("cgroup")).unwrap_or_default();
        if let Some(uid) = cgroup.lines().find_map(pod_uid_of_cgroup) {
            entry.pod = names.get(&uid).cloned();
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
            });
        }
    }
    let mut pods: Vec<PodEntry> = by_netns
        .into_values()
        .filter(|p| p.uid.is_some() || p.netns_name.is_some())
        .collect();
    pods.sort_by_key(|p| p.netns);
    PodIndex { pods }
}

fn addrs_of(pid_dir: &Path) -> Vec<std::net::IpAddr> {
    let read = |f: &str| fs::read_to_string(pid_dir.join("net").join(f)).unwrap_or_default();
    let mut out = local_v4(&read("fib_trie"));
    out.extend(local_v6(&read("if_inet6")));
    out
}
