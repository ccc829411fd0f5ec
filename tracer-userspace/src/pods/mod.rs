//! Pods by name with no API server (issue 28 item 4): which pod a network
//! namespace and an address belong to, from what the node itself has.
//!
//! - First the container runtime's CRI ([`cri`], issue 29), when its socket
//!   is there: kubelet's own view of the pods. What follows fills in the
//!   pods it did not list (and is all there is without it).
//! - A pod's processes sit in a cgroup whose path names the pod's UID,
//!   whatever the cgroup driver: cgroupfs `…/kubepods/burstable/pod<UID>/…`,
//!   systemd `…/kubepods-burstable-pod<UID with _>.slice/…` (kubelet's
//!   `pkg/kubelet/cm/cgroup_manager_linux.go`). Every pod has one process at
//!   least (its sandbox's pause), so /proc joins netns inode → pod UID.
//! - kubelet keeps each pod's logs in `/var/log/pods/NAMESPACE_NAME_UID`
//!   (`pkg/kubelet/kuberuntime/helpers.go` `BuildPodLogsDirectory`): UID →
//!   namespace and name. Neither part can hold `_` (DNS-1123 names).
//! - The pod's addresses are its namespace's local ones, read from one of
//!   its processes' `/proc/PID/net` (no setns needed).
//! - Last resort, a netns with no pod found: its `ip netns` name, never
//!   taken for a pod's name.
//!
//! The index is plain data: the session builds it ([`scan`]) and hands it
//! to the collector, and records it (`pods` lines) so `analyze` names the
//! same pods on another machine.
pub mod cri;
pub mod scan;

use std::fs;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

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

/// The netns inode of `/proc/PID`, from its `ns/net` link (`net:[N]`).
pub(crate) fn netns_of(pid_dir: &Path) -> Option<u32> {
    let link = fs::read_link(pid_dir.join("ns/net")).ok()?;
    link.to_str()?
        .strip_prefix("net:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// One pod network namespace of this node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodEntry {
    /// The namespace's inode, as in the events.
    pub netns: u32,
    /// Its local addresses (loopback left out).
    #[serde(default)]
    pub addrs: Vec<IpAddr>,
    /// `namespace/name` from the CRI or kubelet's pod directories; None
    /// when only the netns name below is known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// The `ip netns` name, if the namespace has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns_name: Option<String>,
    /// Where `pod` came from (absent in older recordings, and unnamed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub named_by: Option<PodSource>,
}

/// Which of the node's sources named a pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PodSource {
    /// The container runtime's CRI.
    Cri,
    /// The pod UID in a cgroup path joined with kubelet's pod directories.
    Kubelet,
}

impl PodEntry {
    /// What to call it: the pod, else `netns NAME`.
    pub fn label(&self) -> Option<String> {
        self.pod
            .clone()
            .or_else(|| self.netns_name.as_ref().map(|n| format!("netns {n}")))
    }
}

/// The node's pod namespaces, as last read.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodIndex {
    pub pods: Vec<PodEntry>,
}

impl PodIndex {
    pub fn by_netns(&self, netns: u32) -> Option<&PodEntry> {
        self.pods.iter().find(|p| p.netns == netns && netns != 0)
    }

    /// The pod's `namespace/name` owning `addr` (not a netns name: an
    /// address is named only after a pod). Namespaces that are no pod of
    /// this kubelet may hold the same address (a lab beside another, a
    /// container outside Kubernetes): the named one wins.
    pub fn pod_of(&self, addr: IpAddr) -> Option<&str> {
        self.pods
            .iter()
            .filter(|p| p.addrs.contains(&addr))
            .find_map(|p| p.pod.as_deref())
    }

    /// The label of the namespace `netns` ("ns/name" or "netns NAME").
    pub fn netns_label(&self, netns: u32) -> Option<String> {
        self.by_netns(netns).and_then(PodEntry::label)
    }
}

/// The pod UID a `/proc/PID/cgroup` line's path names, if any.
pub fn pod_uid_of_cgroup(line: &str) -> Option<String> {
    // "hierarchy-ID:controllers:path"; the path may itself hold ':'.
    let path = line.splitn(3, ':').nth(2)?;
    let mut in_kubepods = false;
    for seg in path.split('/') {
        if seg.starts_with("kubepods") || seg.ends_with("kubepods.slice") {
            in_kubepods = true;
        }
        if !in_kubepods {
            continue;
        }
        // cgroupfs: "pod<UID>"; systemd: "kubepods-<qos>-pod<UID_>.slice".
        let uid = if let Some(u) = seg.strip_prefix("pod") {
            Some(u.to_string())
        } else {
            seg.strip_suffix(".slice")
                .and_then(|s| s.rsplit_once("-pod"))
                .map(|(_, u)| u.replace('_', "-"))
        };
        if let Some(u) = uid.filter(|u| is_uid(u)) {
            return Some(u);
        }
    }
    None
}

fn is_uid(s: &str) -> bool {
    s.len() == 36
        && s.chars().enumerate().all(|(i, c)| {
            if matches!(i, 8 | 13 | 18 | 23) {
                c == '-'
            } else {
                c.is_ascii_hexdigit()
            }
        })
}

/// `(namespace/name, uid)` from a kubelet pod log directory's name.
pub fn pod_of_log_dir(name: &str) -> Option<(String, String)> {
    let mut parts = name.splitn(3, '_');
    let (ns, pod, uid) = (parts.next()?, parts.next()?, parts.next()?);
    (!ns.is_empty() && !pod.is_empty() && is_uid(uid)).then(|| (format!("{ns}/{pod}"), uid.into()))
}

/// The local IPv4 addresses in a `/proc/PID/net/fib_trie`: a leaf line
/// (`|-- 10.0.0.5`) followed by `/32 host LOCAL`.
pub fn local_v4(fib_trie: &str) -> Vec<IpAddr> {
    let mut out = Vec::new();
    let mut leaf: Option<IpAddr> = None;
    for line in fib_trie.lines() {
        let t = line.trim();
        if let Some(a) = t.strip_prefix("|-- ") {
            leaf = a.parse().ok();
        } else if t.starts_with("/32 host LOCAL")
            && let Some(a) = leaf
            && !a.is_loopback()
            && !out.contains(&a)
        {
            out.push(a);
        }
    }
    out
}

/// The IPv6 addresses in a `/proc/PID/net/if_inet6` (32 hex digits first
/// on each line), loopback and link-local left out.
pub fn local_v6(if_inet6: &str) -> Vec<IpAddr> {
    if_inet6
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter_map(|hex| u128::from_str_radix(hex, 16).ok())
        .map(std::net::Ipv6Addr::from)
        .filter(|a| !a.is_loopback() && (a.segments()[0] & 0xffc0) != 0xfe80)
        .map(IpAddr::V6)
        .collect()
}

#[cfg(test)]
mod tests;
