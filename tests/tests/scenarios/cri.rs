//! Issue 29: the seed incidents on pods that containerd's CRI created and
//! the CNI bridge plugin wired (lab::cri), each beside its healthy twin.
//! The pods' addresses are host-local's, so every address is read from the
//! lab, never taken from the presets.
use lab::Runtime;

use super::*;

/// Skips (with the reason) where containerd is not installed.
macro_rules! require_containerd {
    () => {
        if !std::path::Path::new("/usr/bin/containerd").is_file() {
            lab::tracer::say(
                "skipped: containerd is not installed (`cargo xtask setup` installs it)",
            );
            return;
        }
    };
}

fn cri_lab(spec: LabSpec) -> Lab {
    build_lab(spec.with_runtime(Runtime::Containerd))
}

fn ip(lab: &Lab, pod: &str) -> Ipv4Addr {
    lab.pod_ip(pod).expect("a pod of the lab")
}

fn seed000(bridge_nf_call_iptables: bool) -> Lab {
    cri_lab(presets::seed000(presets::Seed000 {
        bridge_nf_call_iptables,
        backend: Backend::SameNode,
    }))
}

fn web_backend(lab: &Lab) -> String {
    format!("{}:{}", ip(lab, presets::BACKEND_POD), presets::WEB_PORT)
}

fn assert_web_flow(f: &Value, lab: &Lab) {
    assert_eq!(ip_of(&f["client"]), ip(lab, presets::CLIENT_POD), "{f}");
    assert_eq!(f["backend"], web_backend(lab), "{f}");
    assert_chains(
        f,
        ProxyMode::Iptables,
        "default/web:http",
        Protocol::Tcp,
        &web_backend(lab),
    );
}

#[test]
fn root_cri_seed000_broken_is_not_reverse_nated() {
    require_root!();
    require_containerd!();
    let _lock = tracing_lock();
    let lab = seed000(false);
    let mut worked = true;
    let done = trace(&lab, presets::NODE_A, &web_svc(), &[], || {
        worked = curl(&lab, presets::CLIENT_POD);
    });
    assert!(!worked, "seed 000: curl times out");
    let f = done.only_flow();
    assert_common(
        &f,
        "reply_not_reverse_nated",
        Some("bridge_nf_call_iptables_off"),
        &done,
    );
    assert_web_flow(&f, &lab);
    assert_eq!(done.status.code(), Some(1), "{}", done.describe());
}

/// Also issue 29 item 2: the pods named from the runtime's CRI. No kubelet
/// directories exist for these pods (the machine's /var/log/pods is not
/// theirs), so the names can come from the CRI only.
#[test]
fn root_cri_seed000_healthy_is_ok_and_names_the_pods_from_the_cri() {
    require_root!();
    require_containerd!();
    let _lock = tracing_lock();
    let lab = seed000(true);
    let socket = lab.cri(presets::NODE_A).expect("containerd node").socket();
    let socket = socket.display().to_string();
    let done = trace(
        &lab,
        presets::NODE_A,
        &web_svc(),
        &["--cri-socket", &socket],
        || {
            assert!(curl(&lab, presets::CLIENT_POD), "the Service answers");
        },
    );
    let f = done.only_flow();
    assert_common(&f, "ok", None, &done);
    assert_web_flow(&f, &lab);
    assert_eq!(done.status.code(), Some(0), "{}", done.describe());
    let source = "pod names from the container runtime (containerd ";
    assert!(done.stderr.contains(source), "{}", done.describe());
    assert!(done.stderr.contains(&socket), "{}", done.describe());
    let k8s = |pod: &str| lab::kubelet::k8s_name(pod);
    assert_eq!(
        f["client_pod"],
        k8s(presets::CLIENT_POD),
        "{}",
        done.describe()
    );
    assert_eq!(
        f["backend_pod"],
        k8s(presets::BACKEND_POD),
        "{}",
        done.describe()
    );
    let hops: Vec<&str> = f["packets"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|p| p["hops"].as_array().into_iter().flatten())
        .filter_map(|h| h["pod"].as_str())
        .collect();
    assert!(
        hops.contains(&k8s(presets::CLIENT_POD).as_str()),
        "{hops:?}"
    );
    assert!(
        hops.contains(&k8s(presets::BACKEND_POD).as_str()),
        "{hops:?}"
    );
}

fn dns_trace(bridge_nf_call_iptables: bool) -> (Lab, Finished, bool) {
    let lab = cri_lab(presets::dns(presets::Dns {
        bridge_nf_call_iptables,
        backend: Backend::SameNode,
    }));
    let (done, answered) = dns_trace_on(&lab);
    (lab, done, answered)
}

fn assert_dns_flow(f: &Value, lab: &Lab) {
    assert_eq!(f["proto"], "udp", "{f}");
    assert_eq!(ip_of(&f["client"]), ip(lab, presets::CLIENT_POD), "{f}");
    let backend = format!("{}:53", ip(lab, presets::DNS_POD));
    assert_eq!(f["backend"], backend, "{f}");
    assert_chains(
        f,
        ProxyMode::Iptables,
        "kube-system/kube-dns:dns",
        Protocol::Udp,
        &backend,
    );
}

#[test]
fn root_cri_dns_seed001_broken_reply_from_unexpected_source() {
    require_root!();
    require_containerd!();
    let _lock = tracing_lock();
    let (lab, done, answered) = dns_trace(false);
    assert!(!answered, "seed 001: dig gets no usable answer");
    let f = done.only_flow();
    assert_common(
        &f,
        "reply_not_reverse_nated",
        Some("bridge_nf_call_iptables_off"),
        &done,
    );
    assert_dns_flow(&f, &lab);
    assert_eq!(done.status.code(), Some(1), "{}", done.describe());
}

#[test]
fn root_cri_dns_seed001_healthy_is_ok() {
    require_root!();
    require_containerd!();
    let _lock = tracing_lock();
    let (lab, done, answered) = dns_trace(true);
    assert!(answered, "{}", done.describe());
    let f = done.only_flow();
    assert_common(&f, "ok", None, &done);
    assert_dns_flow(&f, &lab);
    assert_eq!(done.status.code(), Some(0), "{}", done.describe());
}

/// Seed 004 case 3 with the bridge plugin's `hairpinMode` as the switch.
fn hairpin_trace(hairpin_mode: bool) -> (Lab, Finished, bool) {
    let lab = cri_lab(presets::hairpin(presets::Hairpin {
        hairpin_mode,
        masquerade: true,
    }));
    assert_eq!(
        lab.cri(presets::NODE_A).expect("containerd node").hairpin(),
        hairpin_mode
    );
    let mut worked = false;
    let done = trace(&lab, presets::NODE_A, &web_svc(), &[], || {
        worked = curl(&lab, presets::BACKEND_POD);
    });
    (lab, done, worked)
}

fn assert_hairpin_flow(f: &Value, lab: &Lab) {
    assert_eq!(ip_of(&f["client"]), ip(lab, presets::BACKEND_POD), "{f}");
    assert_eq!(f["backend"], web_backend(lab), "{f}");
    assert_eq!(f["hairpin"], true, "{f}");
}

#[test]
fn root_cri_hairpin_mode_off_is_named() {
    require_root!();
    require_containerd!();
    let _lock = tracing_lock();
    let (lab, done, worked) = hairpin_trace(false);
    assert!(!worked, "a pod cannot reach itself through its Service");
    let f = done.only_flow();
    assert!(
        f["verdict"] == "no_reply" || f["verdict"] == "dropped",
        "{}",
        done.describe()
    );
    assert_eq!(f["cause"], "hairpin_mode_off", "{}", done.describe());
    assert_hairpin_flow(&f, &lab);
}

#[test]
fn root_cri_hairpin_mode_on_is_ok() {
    require_root!();
    require_containerd!();
    let _lock = tracing_lock();
    let (lab, done, worked) = hairpin_trace(true);
    assert!(worked, "{}", done.describe());
    let f = done.only_flow();
    assert_common(&f, "ok", None, &done);
    assert_hairpin_flow(&f, &lab);
}

/// The backend's sandbox removed as kubelet removes a deleted pod
/// (StopPodSandbox: the CNI DEL takes its veth; RemovePodSandbox) while
/// its endpoint is still programmed.
#[test]
fn root_cri_removed_sandbox_backend_is_unreachable() {
    require_root!();
    require_containerd!();
    let _lock = tracing_lock();
    let mut lab = cri_lab(presets::single_node(true));
    let backend = web_backend(&lab);
    lab.delete_pod(presets::BACKEND_POD)
        .expect("removing the sandbox");
    assert!(
        lab.cri(presets::NODE_A)
            .expect("containerd node")
            .pods()
            .iter()
            .all(|p| p.target != presets::BACKEND_POD)
    );
    let mut worked = true;
    let done = trace(
        &lab,
        presets::NODE_A,
        &web_svc(),
        &["--output=json"],
        || {
            worked = curl(&lab, presets::CLIENT_POD);
        },
    );
    assert!(!worked, "curl to a removed backend fails");
    let f = done.only_flow();
    assert_eq!(f["verdict"], "dropped", "{}", done.describe());
    assert_eq!(f["cause"], "backend_unreachable", "{}", done.describe());
    assert_eq!(f["backend"], backend, "{}", done.describe());
    let sep = sep_chain("default/web:http", Protocol::Tcp, &backend);
    let text = f["cause_text"].as_str().unwrap_or_default();
    assert!(text.contains(&sep), "{}", done.describe());
    assert!(text.contains("NEIGH_FAILED"), "{}", done.describe());
}

/// A pod the runtime starts while nattrace runs: its first flow comes from
/// a namespace no named pod had, so the node is read again (the CRI asked
/// within the rescan's budget) before that flow is decided.
#[test]
fn root_cri_a_pod_started_while_tracing_is_named_from_the_cri() {
    require_root!();
    require_containerd!();
    let _lock = tracing_lock();
    let lab = cri_lab(presets::single_node(true));
    let node = lab.cri(presets::NODE_A).expect("containerd node");
    let socket = node.socket().display().to_string();
    let mut late = None;
    let done = trace(
        &lab,
        presets::NODE_A,
        &web_svc(),
        &["--cri-socket", &socket],
        || {
            let pod = node
                .run_pod("late-client")
                .expect("a pod started through the CRI");
            let url = format!("http://{}:{}/", presets::WEB_SERVICE_IP, presets::WEB_PORT);
            let out = std::process::Command::new("ip")
                .args(["netns", "exec", &pod.netns, "curl", "-sS", "-m", "5", &url])
                .output()
                .expect("running curl in the new pod");
            assert!(out.status.success(), "{out:?}");
            late = Some(pod);
        },
    );
    let late = late.expect("the pod was started");
    let f = done.only_flow();
    assert_common(&f, "ok", None, &done);
    assert_eq!(ip_of(&f["client"]), late.ip, "{}", done.describe());
    assert_eq!(f["client_pod"], late.k8s_name, "{}", done.describe());
    assert_eq!(
        f["backend_pod"],
        lab::kubelet::k8s_name(presets::BACKEND_POD),
        "{}",
        done.describe()
    );
}
