//! What a kubelet leaves on a node for each pod, for the lab's pods: a
//! sandbox process (pause) in the pod's network namespace and in a cgroup
//! whose path names the pod's UID (cgroupfs driver:
//! `kubepods/besteffort/pod<UID>`), and the pod's log directory
//! `var/log/pods/NAMESPACE_NAME_UID` under a host root of the lab's own
//! (never the machine's real /var/log/pods). nattrace is pointed at it
//! with `--host-root`, as at `/host` in its image.
//!
//! The cgroups live under `<cgroup2 mount>/<lab id>/`, the only thing
//! outside the lab's namespaces it creates: removed on drop, and left-overs
//! of a killed test process by the next [`KubeletLayout::empty`].

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};

use crate::Lab;
use crate::error::{LabError, Result};

/// The layout of one lab; removes what it created when dropped.
#[derive(Debug)]
pub struct KubeletLayout {
    lab_id: String,
    host_root: PathBuf,
    cgroup_root: Option<PathBuf>,
    /// (lab target, `namespace/name`, UID).
    pods: Vec<(String, String, String)>,
    pause: Vec<Child>,
}

/// Where the unified (v2) cgroup hierarchy is mounted, if anywhere.
pub fn cgroup2_mount() -> Option<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        let point = left.split_whitespace().nth(4)?;
        (right.split_whitespace().next()? == "cgroup2").then(|| PathBuf::from(point))
    })
}

/// The Kubernetes namespace and name a lab pod gets: kube-system for the
/// DNS pods, default otherwise, with a ReplicaSet-like suffix so the name
/// is never the lab's target (or `ip netns`) name.
pub fn k8s_name(target: &str) -> String {
    let ns = if target.contains("dns") {
        "kube-system"
    } else {
        "default"
    };
    format!("{ns}/{target}-5d78c9869d-x2x7q")
}

pub(crate) fn uid_of(lab_id: &str, target: &str) -> String {
    let mut h = DefaultHasher::new();
    (lab_id, target).hash(&mut h);
    let a = h.finish();
    target.hash(&mut h);
    let b = h.finish();
    let hex = format!("{a:016x}{b:016x}");
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

impl KubeletLayout {
    /// An empty host root (no pods yet): what a node looks like before its
    /// pods start.
    pub fn empty(lab: &Lab) -> Result<Self> {
        cleanup_stale_cgroups();
        let host_root = std::env::temp_dir().join(format!("{}-host", lab.id()));
        std::fs::create_dir_all(host_root.join("var/log/pods"))
            .map_err(|e| LabError::Spec(format!("creating {}: {e}", host_root.display())))?;
        Ok(Self {
            lab_id: lab.id().to_string(),
            host_root,
            cgroup_root: None,
            pods: Vec::new(),
            pause: Vec::new(),
        })
    }

    /// Every pod of the lab, as a kubelet would have them running. Needs
    /// the v2 cgroup hierarchy ([`cgroup2_mount`]).
    pub fn start_pods(&mut self, lab: &Lab) -> Result<()> {
        let mount = cgroup2_mount()
            .ok_or_else(|| LabError::Spec("no cgroup2 hierarchy is mounted".into()))?;
        let root = mount.join(&self.lab_id);
        self.cgroup_root = Some(root.clone());
        let pods: Vec<String> = lab
            .spec()
            .nodes
            .iter()
            .flat_map(|n| n.pods.iter().map(|p| p.name.clone()))
            .collect();
        for target in pods {
            let uid = uid_of(&self.lab_id, &target);
            let name = k8s_name(&target);
            let dir = name.replace('/', "_") + "_" + &uid;
            let io = |what: &str, e: std::io::Error| LabError::Spec(format!("{what}: {e}"));
            std::fs::create_dir_all(self.host_root.join("var/log/pods").join(&dir).join("app"))
                .map_err(|e| io("creating the pod's log directory", e))?;
            let cgroup = root.join("kubepods/besteffort").join(format!("pod{uid}"));
            std::fs::create_dir_all(&cgroup).map_err(|e| io("creating the pod's cgroup", e))?;
            let mut cmd = lab.netns(&target)?.command("sleep")?;
            cmd.arg("infinity")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let child = cmd.spawn().map_err(|e| io("starting the pod's pause", e))?;
            let pid = child.id();
            self.pause.push(child);
            std::fs::write(cgroup.join("cgroup.procs"), pid.to_string())
                .map_err(|e| io("moving pause into the pod's cgroup", e))?;
            self.pods.push((target, name, uid));
        }
        Ok(())
    }

    /// What `--host-root` is given.
    pub fn host_root(&self) -> &Path {
        &self.host_root
    }

    /// The `namespace/name` of a lab pod.
    pub fn pod(&self, target: &str) -> &str {
        self.pods
            .iter()
            .find(|(t, _, _)| t == target)
            .map(|(_, n, _)| n.as_str())
            .unwrap_or_else(|| panic!("{target} is no pod of this layout"))
    }
}

/// Removes a cgroup tree, leaves first (cgroupfs refuses anything else).
pub(crate) fn remove_cgroups(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroups(&e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

/// Cgroup trees of labs whose test process is gone.
fn cleanup_stale_cgroups() {
    let Some(mount) = cgroup2_mount() else { return };
    let Ok(entries) = std::fs::read_dir(&mount) else {
        return;
    };
    for e in entries.flatten() {
        if crate::netns::of_a_dead_lab(&e.file_name().to_string_lossy()) {
            remove_cgroups(&e.path());
        }
    }
}

impl Drop for KubeletLayout {
    fn drop(&mut self) {
        for c in &mut self.pause {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(root) = &self.cgroup_root {
            remove_cgroups(root);
        }
        let _ = std::fs::remove_dir_all(&self.host_root);
    }
}
