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

/// Not a test on its own: builds a containerd lab, says what it made and
/// waits to be killed (see the test below).
#[test]
#[ignore = "run by root_cri_lab_of_a_killed_test_is_removed_by_the_next"]
fn cri_lab_that_waits_to_be_killed() {
    if std::env::var_os("NATTRACE_CRI_KILLED").is_none() {
        return;
    }
    let lab = cri_seed000(true);
    let node = lab.cri(presets::NODE_A).expect("containerd node");
    let netns: Vec<String> = node.pods().into_iter().map(|p| p.netns).collect();
    println!("built {} {}", lab.id(), netns.join(" "));
    std::thread::sleep(Duration::from_secs(600));
}

/// A test process killed with SIGKILL runs no Drop: its containerd, the
/// pods' processes, their `cni-…` namespaces, containerd's directory and
/// the pods' cgroups stay. The next lab's `cleanup_stale` removes them.
#[test]
fn root_cri_lab_of_a_killed_test_is_removed_by_the_next() {
    require_root!();
    require_containerd!();
    use std::io::BufRead as _;
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "cri::cri_lab_that_waits_to_be_killed",
            "--ignored",
            "--nocapture",
        ])
        .env("NATTRACE_CRI_KILLED", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("the killed test process");
    let mut line = String::new();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    while !line.starts_with("built ") {
        line.clear();
        assert!(
            out.read_line(&mut line).expect("its output") > 0,
            "the child exited before building its lab"
        );
    }
    let words: Vec<&str> = line.split_whitespace().collect();
    let (id, netns) = (words[1].to_string(), words[2..].to_vec());
    assert_eq!(netns.len(), 2, "{line}");
    child.kill().unwrap();
    child.wait().unwrap();
    let dir = std::env::temp_dir().join(format!("{id}-{}-cri", presets::NODE_A));
    assert!(dir.is_dir(), "containerd's directory stays after SIGKILL");
    let socket = dir.join("containerd.sock");
    let state: Vec<(String, std::path::PathBuf)> = cri::ids_of(&dir)
        .into_iter()
        .flat_map(|id| cri::runtime_state(&socket, &id).map(|p| (id.clone(), p)))
        .collect();
    assert!(
        state.iter().any(|(_, p)| p.exists()),
        "a killed containerd leaves its shims' sockets and runc's state: {state:?}"
    );
    assert!(
        netns
            .iter()
            .all(|n| Path::new(lab::NETNS_DIR).join(n).exists())
    );
    lab::cleanup_stale();
    for n in &netns {
        assert!(
            !Path::new(lab::NETNS_DIR).join(n).exists(),
            "{n} left behind"
        );
    }
    assert!(!dir.exists(), "{} left behind", dir.display());
    assert!(!netns_list().contains(&id), "{}", netns_list());
    let dir_text = dir.display().to_string();
    let procs = Command::new("pgrep")
        .args(["-f", &dir_text])
        .output()
        .unwrap();
    assert!(
        procs.stdout.is_empty(),
        "containerd of the killed lab still runs: {procs:?}"
    );
    let cgroups: Vec<String> = std::fs::read_dir("/sys/fs/cgroup")
        .into_iter()
        .flatten()
        .flatten()
        .map(|c| c.path().join(&id))
        .chain([Path::new("/sys/fs/cgroup").join(&id)])
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect();
    assert!(cgroups.is_empty(), "cgroups left behind: {cgroups:?}");
    // containerd's state kept by id outside its directory: each shim's
    // socket and runc's state of each container.
    for (id, path) in &state {
        assert!(!path.exists(), "{} of {id} left behind", path.display());
    }
}
