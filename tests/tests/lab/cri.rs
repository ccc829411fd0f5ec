//! Issue 29: pods made by containerd's CRI and wired by the CNI bridge
//! plugin (lab::cri), beside the hand-wired lab: the same symptoms, and
//! nothing left behind.
use lab::{Runtime, cri};

use super::*;

/// Skips (with the reason) where containerd is not installed.
macro_rules! require_containerd {
    () => {
        if !Path::new("/usr/bin/containerd").is_file() {
            eprintln!("skipped: containerd is not installed (`cargo xtask setup` installs it)");
            return;
        }
    };
}

fn cri_seed000(bridge_nf_call_iptables: bool) -> Lab {
    build_lab(
        presets::seed000(Seed000 {
            bridge_nf_call_iptables,
            backend: Backend::SameNode,
        })
        .with_runtime(Runtime::Containerd),
    )
}

#[test]
fn root_cri_pods_are_sandboxes_the_bridge_plugin_wired() {
    require_root!();
    require_containerd!();
    let links_before = root_links();
    let lab = cri_seed000(true);
    let node = lab.cri(presets::NODE_A).expect("node-a runs containerd");
    let pods = node.pods();
    assert_eq!(pods.len(), 2, "{pods:?}");
    for p in &pods {
        // The CRI's netns, not one the lab named.
        assert!(p.netns.starts_with("cni-"), "{p:?}");
        assert_eq!(lab.netns(&p.target).unwrap().name(), p.netns);
        assert_eq!(
            lab.pod_ip(&p.target),
            Some(p.ip),
            "the spec took host-local's address"
        );
        assert!(presets::NODE_A_POD_CIDR.contains(p.ip), "{p:?}");
    }
    // cni0 and one veth per pod, made by the plugin, hairpin off as configured.
    let links = lab
        .run(
            presets::NODE_A,
            &["ip", "-d", "-o", "link", "show", "master", "cni0"],
        )
        .expect("ip link");
    assert_eq!(links.lines().count(), 2, "{links}");
    assert!(links.lines().all(|l| l.contains("hairpin off")), "{links}");
    // The pause runs in a kubelet-like cgroup named after the pod's UID.
    let pids = Command::new("ip")
        .args(["netns", "pids", &pods[0].netns])
        .output()
        .expect("ip netns pids");
    let pid = String::from_utf8_lossy(&pids.stdout)
        .split_whitespace()
        .next()
        .map(str::to_string)
        .expect("a process in the sandbox");
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    assert!(
        cgroup.contains(&format!("/kubepods/besteffort/pod{}", pods[0].uid)),
        "{cgroup}"
    );
    let out = curl_web(&lab, presets::CLIENT_POD);
    assert_page_from(&out, presets::BACKEND_POD);
    let client_ip = lab.pod_ip(presets::CLIENT_POD).unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!("client={client_ip}:")),
        "{}",
        text(&out)
    );
    let (id, netns) = (lab.id().to_string(), lab.netns_names());
    let dir = std::env::temp_dir().join(format!("{id}-{}-cri", presets::NODE_A));
    assert!(dir.is_dir());
    drop(lab);
    assert_gone(&id, &netns, &[], &links_before);
    assert!(!dir.exists(), "{} left behind", dir.display());
}

#[test]
fn root_cri_same_node_backend_fails_like_seed000_without_bridge_nf_call_iptables() {
    require_root!();
    require_containerd!();
    let lab = cri_seed000(false);
    let out = curl_web(&lab, presets::CLIENT_POD);
    assert_eq!(
        out.status.code(),
        Some(28),
        "curl should time out: {}",
        text(&out)
    );
}

#[test]
fn root_cri_pause_image_is_built_offline() {
    require_root!();
    require_containerd!();
    let archive = cri::pause_image_archive().expect("pause image");
    assert!(std::fs::metadata(&archive).unwrap().len() > 1000);
}
