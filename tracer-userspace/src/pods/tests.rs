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
                named_by: Some(PodSource::Kubelet),
            },
            PodEntry {
                netns: 8,
                addrs: vec!["100.96.54.9".parse().unwrap()],
                pod: None,
                uid: None,
                netns_name: Some("lab-other".into()),
                named_by: None,
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
        line.starts_with("pods are not named: no container runtime socket"),
        "{line}"
    );
    assert!(line.contains("no kubelet pod directories"), "{line}");
    assert!(line.contains("--host-root"), "{line}");
    assert!(line.contains("--cri-socket"), "{line}");
    // The node's own namespace is always left out.
    assert!(scan::scan(&roots, own).by_netns(own).is_none());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// containerd 1.6's verbose `PodSandboxStatus` info (trimmed): the
/// sandbox's pid and its runtime spec, the netns path in it.
const CONTAINERD_INFO: &str = r#"{"pid":4242,"processStatus":"running","netNamespaceClosed":false,
  "image":"localhost/nattrace-lab-pause:1","snapshotKey":"5a1f","snapshotter":"native",
  "runtimeType":"io.containerd.runc.v2","config":{"metadata":{"name":"web-5d78c9869d-x2x7q",
  "uid":"3f1c2a9e-8d4b-4c1e-9a7f-0b5d6e7f8a9b","namespace":"default"}},
  "runtimeSpec":{"ociVersion":"1.0.2-dev","process":{"args":["/pause"]},
  "linux":{"namespaces":[{"type":"pid"},{"type":"ipc"},{"type":"uts"},{"type":"mount"},
  {"type":"network","path":"/var/run/netns/cni-1586079b-d06e-7e48-ec0e-52503ba6405e"}]}},
  "cniResult":{"Interfaces":{"eth0":{"IPConfigs":[{"IP":"10.244.1.12","Gateway":"10.244.1.1"}]}}}}"#;

/// CRI-O's: image, pid and runtime spec only; pid 0 when the sandbox has
/// no infra process, and a pinned namespace under /var/run/netns.
const CRIO_INFO: &str = r#"{"image":"registry.k8s.io/pause:3.9","pid":0,
  "runtimeSpec":{"ociVersion":"1.0.2-dev","linux":{"namespaces":[{"type":"pid"},
  {"type":"network","path":"/var/run/netns/6f0b1c2d-9e8f-4a3b-8c7d-6e5f4a3b2c1d"},
  {"type":"ipc","path":"/var/run/ipcns/6f0b1c2d-9e8f-4a3b-8c7d-6e5f4a3b2c1d"},
  {"type":"uts","path":"/var/run/utsns/6f0b1c2d-9e8f-4a3b-8c7d-6e5f4a3b2c1d"}]}}}"#;

fn info(json: &str) -> std::collections::HashMap<String, String> {
    [("info".to_owned(), json.to_owned())].into()
}

#[test]
fn the_runtimes_verbose_info_locates_the_sandboxes_netns() {
    assert_eq!(
        cri::parse_info(&info(CONTAINERD_INFO)),
        cri::SandboxInfo {
            pid: Some(4242),
            netns_path: Some("/var/run/netns/cni-1586079b-d06e-7e48-ec0e-52503ba6405e".into()),
            no_netns: false,
        }
    );
    assert_eq!(
        cri::parse_info(&info(CRIO_INFO)),
        cri::SandboxInfo {
            pid: None,
            netns_path: Some("/var/run/netns/6f0b1c2d-9e8f-4a3b-8c7d-6e5f4a3b2c1d".into()),
            no_netns: false,
        }
    );
    // hostNetwork: the spec has no network namespace of its own.
    let host =
        r#"{"pid":7,"runtimeSpec":{"linux":{"namespaces":[{"type":"pid"},{"type":"ipc"}]}}}"#;
    assert_eq!(
        cri::parse_info(&info(host)),
        cri::SandboxInfo {
            pid: Some(7),
            netns_path: None,
            no_netns: true,
        }
    );
    // Not verbose, not JSON, or another key: nothing known, nothing assumed.
    for odd in [info("not json"), info("{}"), Default::default()] {
        assert_eq!(cri::parse_info(&odd), cri::SandboxInfo::default());
    }
}

#[test]
fn a_status_answer_gives_the_pod_its_name_uid_and_every_address() {
    use k8s_cri::v1::{
        LinuxPodSandboxStatus, Namespace, NamespaceMode, NamespaceOption, PodIp,
        PodSandboxMetadata, PodSandboxNetworkStatus, PodSandboxStatus, PodSandboxStatusResponse,
    };
    let answer = |mode: NamespaceMode| PodSandboxStatusResponse {
        status: Some(PodSandboxStatus {
            metadata: Some(PodSandboxMetadata {
                name: "web-5d78c9869d-x2x7q".into(),
                uid: UID.into(),
                namespace: "default".into(),
                attempt: 0,
            }),
            network: Some(PodSandboxNetworkStatus {
                ip: "10.244.1.12".into(),
                additional_ips: vec![PodIp {
                    ip: "fd00:10:244:1::c".into(),
                }],
            }),
            linux: Some(LinuxPodSandboxStatus {
                namespaces: Some(Namespace {
                    options: Some(NamespaceOption {
                        network: mode as i32,
                        ..Default::default()
                    }),
                }),
            }),
            ..Default::default()
        }),
        info: info(CONTAINERD_INFO),
        ..Default::default()
    };
    let s = cri::sandbox_of(answer(NamespaceMode::Pod)).unwrap();
    assert_eq!(s.pod, "default/web-5d78c9869d-x2x7q");
    assert_eq!(s.uid, UID);
    assert_eq!(
        s.addrs,
        vec![
            "10.244.1.12".parse::<IpAddr>().unwrap(),
            "fd00:10:244:1::c".parse().unwrap()
        ]
    );
    assert!(!s.host_network);
    assert!(
        cri::sandbox_of(answer(NamespaceMode::Node))
            .unwrap()
            .host_network
    );
    // No netns found on this machine: kept, named by its addresses only;
    // hostNetwork pods are left out (the node's addresses are no pod's).
    let roots = scan::Roots {
        proc: "/nonexistent/proc".into(),
        host: "/nonexistent".into(),
        run_netns: "/nonexistent/netns".into(),
    };
    let listing = cri::Listing {
        runtime: "containerd 1.6.20".into(),
        sandboxes: vec![
            s.clone(),
            cri::Sandbox {
                host_network: true,
                pod: "kube-system/kube-proxy-x".into(),
                ..s
            },
        ],
    };
    let entries = listing.entries(&roots, 1);
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(entries[0].netns, 0);
    assert_eq!(entries[0].named_by, Some(PodSource::Cri));
}

#[test]
fn the_runtime_names_first_the_cgroups_and_kubelet_fill_in_netns_names_last() {
    let entry =
        |netns, addr: &str, pod: Option<&str>, uid: Option<&str>, name: Option<&str>| PodEntry {
            netns,
            addrs: vec![addr.parse().unwrap()],
            pod: pod.map(Into::into),
            uid: uid.map(Into::into),
            netns_name: name.map(Into::into),
            named_by: pod.map(|_| PodSource::Kubelet),
        };
    const OTHER: &str = "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d";
    let found = vec![
        // kubelet's directories say otherwise (a stale directory): the
        // runtime wins, the netns name stays.
        entry(
            7,
            "10.244.1.12",
            Some("default/old"),
            Some(UID),
            Some("cni-1"),
        ),
        // Not listed by the runtime: kubelet's name stays.
        entry(8, "10.244.1.13", Some("default/web2"), Some(OTHER), None),
        // No kubepods cgroup, only a netns name: the runtime names its inode.
        entry(9, "10.244.1.14", None, None, Some("cni-3")),
        entry(10, "10.0.0.9", None, None, Some("lab-other")),
    ];
    let cri = |netns, addrs: Vec<&str>, pod: &str, uid: &str| PodEntry {
        netns,
        addrs: addrs.into_iter().map(|a| a.parse().unwrap()).collect(),
        pod: Some(pod.into()),
        uid: Some(uid.into()),
        netns_name: None,
        named_by: Some(PodSource::Cri),
    };
    let from_cri = vec![
        cri(7, vec!["10.244.1.12"], "default/web-5d78c9869d-x2x7q", UID),
        // The runtime lists no address: the namespace's own are kept.
        cri(
            9,
            vec![],
            "default/web3",
            "5b6c7d8e-9f0a-4b1c-8d2e-3f4a5b6c7d8e",
        ),
        // Its netns not found here: an entry of its own, named by address.
        cri(
            0,
            vec!["10.244.1.20"],
            "default/web4",
            "6c7d8e9f-0a1b-4c2d-8e3f-4a5b6c7d8e9f",
        ),
    ];
    let mut merged = scan::merge(found, from_cri);
    merged.sort_by_key(|p| p.netns);
    let index = PodIndex { pods: merged };
    assert_eq!(
        index.netns_label(7).as_deref(),
        Some("default/web-5d78c9869d-x2x7q")
    );
    assert_eq!(
        index.by_netns(7).unwrap().netns_name.as_deref(),
        Some("cni-1")
    );
    assert_eq!(index.by_netns(7).unwrap().named_by, Some(PodSource::Cri));
    assert_eq!(index.netns_label(8).as_deref(), Some("default/web2"));
    assert_eq!(
        index.by_netns(8).unwrap().named_by,
        Some(PodSource::Kubelet)
    );
    assert_eq!(index.netns_label(9).as_deref(), Some("default/web3"));
    assert_eq!(
        index.pod_of("10.244.1.14".parse().unwrap()),
        Some("default/web3")
    );
    assert_eq!(index.netns_label(10).as_deref(), Some("netns lab-other"));
    assert_eq!(
        index.pod_of("10.244.1.20".parse().unwrap()),
        Some("default/web4")
    );
    assert_eq!(index.pod_of("10.0.0.9".parse().unwrap()), None);
    // A runtime sandbox without netns joins the namespace of its UID.
    let joined = scan::merge(
        vec![entry(11, "10.244.1.30", None, Some(OTHER), None)],
        vec![cri(0, vec![], "default/web5", OTHER)],
    );
    assert_eq!(joined.len(), 1, "{joined:?}");
    assert_eq!(joined[0].netns, 11);
    assert_eq!(joined[0].pod.as_deref(), Some("default/web5"));
}

/// The start line names the runtime when it answered, and keeps kubelet's
/// wording (which the lab's tests look for) when it did not.
#[test]
fn the_start_line_says_which_source_named_the_pods() {
    let dir = std::env::temp_dir().join(format!("nattrace-cri-{}", std::process::id()));
    std::fs::create_dir_all(dir.join(scan::KUBELET_PODS_DIR)).unwrap();
    let roots = scan::Roots {
        proc: "/nonexistent/proc".into(),
        host: dir.clone(),
        run_netns: dir.join("no-such-dir"),
    };
    // Nothing listens there: the runtime is named, and why it said nothing.
    let socket = dir.join("containerd.sock");
    let mut rescan = scan::Rescan::new(roots.clone(), 0).with_cri(Some(socket.clone()));
    let now = rescan.scan();
    let line = rescan.source_line(&now);
    let kubelet = format!(
        "pod names from kubelet's pod directories under {}",
        dir.display()
    );
    assert!(line.starts_with(&kubelet), "{line}");
    assert!(
        line.contains(&format!(
            "the container runtime at {} did not answer",
            socket.display()
        )),
        "{line}"
    );
    // And with no kubelet directories either: both options named.
    let bare = scan::Roots {
        host: dir.join("empty"),
        ..roots
    };
    let mut rescan = scan::Rescan::new(bare, 0).with_cri(Some(socket.clone()));
    let now = rescan.scan();
    let line = rescan.source_line(&now);
    assert!(
        line.starts_with("pods are not named: the container runtime at"),
        "{line}"
    );
    assert!(line.contains("--host-root"), "{line}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A runtime that takes the connection and never answers is given up on
/// in time: the session's event loop waits for this call.
#[test]
fn a_hung_runtime_is_given_up_on_within_the_timeout() {
    let dir = std::env::temp_dir().join(format!("nattrace-cri-hung-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("hung.sock");
    // Bound and listening: the kernel accepts the connection, nobody reads.
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let started = std::time::Instant::now();
    let err = cri::query(&socket, std::time::Duration::from_millis(300)).unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A rescan (on the event loop) waits for a runtime a quarter of the
/// start's budget: one that refused at start and hangs now holds the loop
/// [`scan::CRI_RESCAN_TIMEOUT`], then is left alone.
#[test]
fn a_rescan_waits_for_a_hung_runtime_less_than_the_start() {
    let dir = std::env::temp_dir().join(format!("nattrace-cri-rescan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("later.sock");
    let roots = scan::Roots {
        proc: dir.join("no-proc"),
        host: dir.clone(),
        run_netns: dir.join("no-netns"),
    };
    let mut rescan = scan::Rescan::new(roots, 1).with_cri(Some(socket.clone()));
    // Nothing listens yet: refused at once, so asked again next time.
    let started = std::time::Instant::now();
    rescan.scan();
    assert!(started.elapsed() < std::time::Duration::from_secs(1));
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let started = std::time::Instant::now();
    rescan.scan();
    let took = started.elapsed();
    assert!(
        took >= scan::CRI_RESCAN_TIMEOUT && took < cri::TIMEOUT,
        "{took:?}"
    );
    // Rested: the next rescan does not ask.
    let started = std::time::Instant::now();
    rescan.scan();
    assert!(
        started.elapsed() < scan::CRI_RESCAN_TIMEOUT,
        "{:?}",
        started.elapsed()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Against a live runtime (not run by default): `NATTRACE_TEST_CRI_SOCKET=
/// /run/containerd/containerd.sock cargo test -p tracer-userspace --lib
/// live_runtime -- --ignored --nocapture`, as root for the netns lookups.
#[test]
#[ignore = "needs a container runtime: NATTRACE_TEST_CRI_SOCKET"]
fn live_runtime_lists_its_ready_pods() {
    let socket = std::env::var_os("NATTRACE_TEST_CRI_SOCKET").expect("NATTRACE_TEST_CRI_SOCKET");
    let socket = std::path::PathBuf::from(socket);
    let listing = cri::query(&socket, cri::TIMEOUT).expect("the runtime answers");
    println!("{}: {} sandboxes", listing.runtime, listing.sandboxes.len());
    for s in &listing.sandboxes {
        println!("  {} {} {:?} {:?}", s.pod, s.uid, s.addrs, s.info);
    }
    let entries = cri::list(&socket).expect("the runtime answers");
    for e in &entries {
        println!("  netns {} {:?} {:?}", e.netns, e.pod, e.addrs);
    }
    assert_eq!(entries.len(), listing.sandboxes.len());
    let roots = scan::Roots::node(Some(std::path::Path::new("/")));
    let own = std::fs::read_link("/proc/self/ns/net").unwrap();
    let own: u32 = own
        .to_str()
        .unwrap()
        .trim_start_matches("net:[")
        .trim_end_matches(']')
        .parse()
        .unwrap();
    let mut rescan = scan::Rescan::new(roots, own).with_cri(Some(socket));
    let now = rescan.scan();
    println!("{}", rescan.source_line(&now));
    for p in now
        .pods
        .iter()
        .filter(|p| p.named_by == Some(PodSource::Cri))
    {
        println!("  {p:?}");
        assert_ne!(p.netns, 0, "every sandbox's netns found: {p:?}");
    }
}
