use std::net::IpAddr;

use super::*;

const UID: &str = "3f1c2a9e-8d4b-4c1e-9a7f-0b5d6e7f8a9b";

#[test]
fn the_pod_uid_is_read_from_either_cgroup_driver() {
    // cgroupfs driver, cgroup v2 (kubeadm with cgroupDriver: cgroupfs).
    let v2 = format!("0::/kubepods/burstable/pod{UID}/0a1b2c3d4e5f");
    assert_eq!(pod_uid_of_cgroup(&v2).as_deref(), Some(UID));
    // systemd driver: the UID's dashes become underscores in the slice.
    let slice = UID.replace('-', "_");
    let systemd = format!(
        "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{slice}.slice/cri-containerd-0a1b.scope"
    );
    assert_eq!(pod_uid_of_cgroup(&systemd).as_deref(), Some(UID));
    // Guaranteed QoS has no QoS level; a kind node nests it all.
    let kind = format!(
        "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-pod{slice}.slice/cri-containerd-9f.scope"
    );
    assert_eq!(pod_uid_of_cgroup(&kind).as_deref(), Some(UID));
    // cgroup v1 line of one controller.
    let v1 = format!("4:memory:/kubepods/pod{UID}/abc");
    assert_eq!(pod_uid_of_cgroup(&v1).as_deref(), Some(UID));
    // Not a pod: kubelet itself, a system service, a "pod" outside kubepods.
    for line in [
        "0::/system.slice/kubelet.service",
        "0::/kubepods/burstable",
        "0::/user.slice/pod3f1c2a9e-8d4b-4c1e-9a7f-0b5d6e7f8a9b",
        "0::/",
    ] {
        assert_eq!(pod_uid_of_cgroup(line), None, "{line}");
    }
}

#[test]
fn kubelet_pod_directories_name_namespace_pod_and_uid() {
    assert_eq!(
        pod_of_log_dir(&format!("kube-system_coredns-5d78c9869d-x2x7q_{UID}")),
        Some(("kube-system/coredns-5d78c9869d-x2x7q".into(), UID.into()))
    );
    assert_eq!(pod_of_log_dir("kube-system_coredns"), None);
    assert_eq!(pod_of_log_dir("a_b_not-a-uid"), None);
}

#[test]
fn local_addresses_come_from_the_namespaces_proc_net() {
    // As 6.18 prints a pod namespace's fib_trie (Main and Local tables).
    let fib = "Main:\n  +-- 0.0.0.0/0 3 0 5\n     |-- 0.0.0.0\n        /0 universe UNICAST\n\
               \x20    +-- 100.96.54.0/24 2 0 2\n        |-- 100.96.54.0\n           /24 link UNICAST\n\
               \x20       |-- 100.96.54.240\n           /32 host LOCAL\n\
               \x20       |-- 100.96.54.255\n           /32 link BROADCAST\n\
               \x20    +-- 127.0.0.0/8 2 0 2\n        |-- 127.0.0.1\n           /32 host LOCAL\n\
               Local:\n  +-- 0.0.0.0/0 3 0 5\n        |-- 100.96.54.240\n           /32 host LOCAL\n";
    assert_eq!(
        local_v4(fib),
        vec!["100.96.54.240".parse::<IpAddr>().unwrap()]
    );
    let inet6 = "00000000000000000000000000000001 01 80 10 80       lo\n\
                 fd000000000000000000000000000002 04 40 00 82     eth0\n\
                 fe8000000000000000fc00fffe000001 04 40 20 80     eth0\n";
    assert_eq!(local_v6(inet6), vec!["fd00::2".parse::<IpAddr>().unwrap()]);
}

#[test]
fn an_address_is_named_only_after_a_pod_a_namespace_also_after_its_netns_name() {
    let index = PodIndex {
        pods: vec![
            PodEntry {
                netns: 7,
                addrs: vec!["100.96.54.240".parse().unwrap()],
                pod: Some("default/client".into()),
                uid: Some(UID.into()),
                netns_name: Some("lab-client".into()),
            },
            PodEntry {
                netns: 8,
                addrs: vec!["100.96.54.9".parse().unwrap()],
                pod: None,
                uid: None,
                netns_name: Some("lab-other".into()),
            },
        ],
    };
    assert_eq!(
        index.pod_of("100.96.54.240".parse().unwrap()),
        Some("default/client")
    );
    assert_eq!(index.pod_of("100.96.54.9".parse().unwrap()), None);
    assert_eq!(index.netns_label(7).as_deref(), Some("default/client"));
    assert_eq!(index.netns_label(8).as_deref(), Some("netns lab-other"));
    assert_eq!(index.netns_label(0), None);
}

/// This process's own namespace is found in /proc, with its addresses.
#[test]
fn the_scan_finds_this_process_namespace() {
    let own = std::fs::read_link("/proc/self/ns/net").unwrap();
    let own: u32 = own
        .to_str()
        .unwrap()
        .trim_start_matches("net:[")
        .trim_end_matches(']')
        .parse()
        .unwrap();
    let dir = std::env::temp_dir().join(format!("nattrace-pods-{}", std::process::id()));
    std::fs::create_dir_all(dir.join(scan::KUBELET_PODS_DIR)).unwrap();
    let roots = scan::Roots {
        proc: "/proc".into(),
        host: dir.clone(),
        run_netns: dir.join("no-such-dir"),
    };
    // Not a pod (no kubepods cgroup) and no netns name: left out.
    let index = scan::scan(&roots, 0);
    assert!(index.by_netns(own).is_none(), "{index:?}");
    let mut rescan = scan::Rescan::new(roots.clone(), 0);
    let now = rescan.scan();
    let line = rescan.source_line(&now);
    assert!(
        line.starts_with("pod names from kubelet's pod directories under"),
        "{line}"
    );
    let bare = scan::Roots {
        host: dir.join("no-kubelet-here"),
        ..roots.clone()
    };
    let rescan = scan::Rescan::new(bare, 0);
    let line = rescan.source_line(&PodIndex::default());
    assert!(
        line.starts_with("pods are not named: no kubelet pod directories"),
        "{line}"
    );
    assert!(line.contains("--host-root"), "{line}");
    // The node's own namespace is always left out.
    assert!(scan::scan(&roots, own).by_netns(own).is_none());
    std::fs::remove_dir_all(&dir).unwrap();
}
