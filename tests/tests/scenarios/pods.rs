//! Issue 28 item 4: clients, backends and hops named after their pods, from
//! what a node has without an API server: the pod's cgroup (its UID) and
//! kubelet's `var/log/pods/NAMESPACE_NAME_UID` under the host root
//! (lab::kubelet builds both for the lab's pods). The lab's `ip netns`
//! names are the last resort, and never taken for a pod's name.
use lab::kubelet::{KubeletLayout, cgroup2_mount};

use super::*;

/// Skips (with the reason) where the lab cannot give pods a cgroup.
macro_rules! require_cgroup2 {
    () => {
        if cgroup2_mount().is_none() {
            lab::tracer::say(
                "skipped: no cgroup2 hierarchy is mounted, so the lab's pods cannot be put in kubelet-like cgroups",
            );
            return;
        }
    };
}

/// The `pod` of every hop of the flow that has one.
fn hop_pods(f: &Value) -> Vec<&str> {
    f["packets"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|p| p["hops"].as_array().into_iter().flatten())
        .filter_map(|h| h["pod"].as_str())
        .collect()
}

/// The client and backend pods' names, on the flow and on the hops seen
/// in each pod's namespace.
fn assert_named(f: &Value, layout: &KubeletLayout, done: &Finished) {
    let (client, backend) = (
        layout.pod(presets::CLIENT_POD),
        layout.pod(presets::BACKEND_POD),
    );
    assert_eq!(f["client_pod"], client, "{}", done.describe());
    assert_eq!(f["backend_pod"], backend, "{}", done.describe());
    let pods = hop_pods(f);
    assert!(pods.contains(&client), "{pods:?}\n{}", done.describe());
    assert!(pods.contains(&backend), "{pods:?}\n{}", done.describe());
}

/// Pods running before nattrace starts: named at start, in JSON, in text,
/// and in `analyze` of the recording (its `pods` line).
#[test]
fn root_pods_are_named_from_the_kubelet_layout() {
    require_root!();
    require_cgroup2!();
    let _lock = tracing_lock();
    let lab = build_lab(presets::single_node(true));
    let mut layout = KubeletLayout::empty(&lab).expect("host root");
    layout.start_pods(&lab).expect("kubelet-like pods");
    let root = layout.host_root().display().to_string();
    let rec = layout.host_root().join("trace.rec");
    let rec_arg = rec.display().to_string();
    let done = trace(
        &lab,
        presets::NODE_A,
        &web_svc(),
        &["--host-root", &root, "--write", &rec_arg],
        || assert!(curl(&lab, presets::CLIENT_POD), "the Service answers"),
    );
    let f = done.only_flow();
    assert_eq!(f["verdict"], "ok", "{}", done.describe());
    assert_named(&f, &layout, &done);
    // Where the names come from is said at start.
    let source = format!("pod names from kubelet's pod directories under {root}");
    assert!(done.stderr.contains(&source), "{}", done.describe());
    // The same names from the recording, on a machine without the pods.
    let out = std::process::Command::new(nattrace())
        .args(["analyze", "--output", "json", "-v", &rec_arg])
        .output()
        .expect("running nattrace analyze");
    let text = String::from_utf8_lossy(&out.stdout);
    let again: Value = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["kind"] == "flow")
        .unwrap_or_else(|| panic!("no flow in analyze's output: {text}"));
    assert_named(&again, &layout, &done);
    // Text: the pods on a line of their own under the headline.
    let out = std::process::Command::new(nattrace())
        .args(["analyze", &rec_arg])
        .output()
        .expect("running nattrace analyze");
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.starts_with("    pods: "))
        .unwrap_or_else(|| panic!("no pods line in:\n{text}"));
    // Wrapped at 80 columns, continuations under the text.
    let block: Vec<&str> = std::iter::once(lines[at])
        .chain(
            lines[at + 1..]
                .iter()
                .copied()
                .take_while(|l| l.starts_with("          ")),
        )
        .flat_map(str::split_whitespace)
        .collect();
    let want = format!(
        "pods: {} → {}",
        layout.pod(presets::CLIENT_POD),
        layout.pod(presets::BACKEND_POD)
    );
    assert_eq!(block.join(" "), want, "{text}");
}

/// A pod that starts while nattrace runs: its first flow names an address
/// no pod had, and the node is read again before that flow is decided.
#[test]
fn root_a_pod_started_while_tracing_is_named() {
    require_root!();
    require_cgroup2!();
    let _lock = tracing_lock();
    let lab = build_lab(presets::single_node(true));
    let mut layout = KubeletLayout::empty(&lab).expect("host root");
    let root = layout.host_root().display().to_string();
    let done = trace(
        &lab,
        presets::NODE_A,
        &web_svc(),
        &["--host-root", &root],
        || {
            layout.start_pods(&lab).expect("kubelet-like pods");
            assert!(curl(&lab, presets::CLIENT_POD), "the Service answers");
        },
    );
    let f = done.only_flow();
    assert_named(&f, &layout, &done);
}

/// No kubelet traces of the pods (an empty host root): no pod names, and
/// the hops in the pods' namespaces say their `ip netns` names instead.
#[test]
fn root_without_kubelet_traces_hops_carry_the_netns_name_only() {
    require_root!();
    let _lock = tracing_lock();
    let lab = build_lab(presets::single_node(true));
    let layout = KubeletLayout::empty(&lab).expect("host root");
    let root = layout.host_root().display().to_string();
    let done = trace(
        &lab,
        presets::NODE_A,
        &web_svc(),
        &["--host-root", &root],
        || assert!(curl(&lab, presets::CLIENT_POD), "the Service answers"),
    );
    let f = done.only_flow();
    assert!(f.get("client_pod").is_none(), "{}", done.describe());
    assert!(f.get("backend_pod").is_none(), "{}", done.describe());
    let client_ns = format!("netns {}", lab.netns(presets::CLIENT_POD).unwrap().name());
    let labels = hop_pods(&f);
    assert!(
        labels.contains(&client_ns.as_str()),
        "{labels:?}\n{}",
        done.describe()
    );
    assert!(labels.iter().all(|l| l.starts_with("netns ")), "{labels:?}");
}
