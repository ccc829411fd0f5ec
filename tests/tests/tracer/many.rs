//! A node with ~300 pods (their veths on cni0, the other ends in a pod
//! namespace): the preamble's checks line and the leftover-cleanup line stay
//! short, seed 000 on that node gets the same verdict and cause as on a small
//! one although its pod veths are watched by the device tracepoints instead
//! of tc, and Ctrl-C exits within a second with nothing left attached.

use std::time::{Duration, Instant};

use lab::presets::{self, Backend, Seed000};
use lab::tracer::{Nattrace, bpf_objects, curl_parallel, nattrace};
use lab::{Lab, build_lab};

use super::cleanup::assert_objects_gone;
use super::{ATTACH_TIMEOUT, CURL_MAX_TIME, REPLY_TIMEOUT_MS, tracing_lock, web_svc};

const EXTRA: usize = 300;
/// Long enough for any real finding, far below a list of 300 names.
const SHORT: usize = 400;
/// Ctrl-C to exit (issue 11: 6.5-11 s with a tcx link pair per pod veth).
const EXIT_MAX: Duration = Duration::from_secs(1);

/// Every qdisc and tc filter of the node namespace, as text to diff (one
/// `tc -batch` run: one exec per interface would take seconds here).
fn tc_state(lab: &Lab, names: &[String]) -> String {
    let batch: String = names
        .iter()
        .flat_map(|dev| ["ingress", "egress"].map(|hook| format!("filter show dev {dev} {hook}\n")))
        .collect();
    let file = std::env::temp_dir().join(format!("nattrace-many-{}.tc", std::process::id()));
    std::fs::write(&file, batch).expect("batch file");
    let filters = lab
        .run(presets::NODE_A, &["tc", "-b", file.to_str().unwrap()])
        .expect("tc -batch");
    let _ = std::fs::remove_file(&file);
    let qdiscs = lab
        .run(presets::NODE_A, &["tc", "qdisc", "show"])
        .expect("tc qdisc show");
    format!("{qdiscs}\n{filters}")
}

fn node_interfaces(lab: &Lab) -> Vec<String> {
    lab.run(presets::NODE_A, &["ip", "-o", "link", "show"])
        .expect("ip link")
        .lines()
        .filter_map(|l| {
            let name = l.split(':').nth(1)?.trim();
            Some(name.split('@').next()?.to_string())
        })
        .collect()
}

#[test]
fn root_300_pods_short_lines_same_seed000_verdict_and_ctrl_c_within_a_second() {
    require_root!();
    // Seed 000 broken: the same-node backend's SYN-ACK crosses cni0 without
    // netfilter. Its client's and backend's veths are pod veths like the 300.
    let lab = build_lab(presets::seed000(Seed000 {
        bridge_nf_call_iptables: false,
        backend: Backend::SameNode,
    }));
    // Bridge ports with hairpin off and strict rp_filter, like a node whose
    // CNI left both at their defaults: each check then names every port.
    lab.run(
        presets::NODE_A,
        &["sysctl", "-qw", "net.ipv4.conf.default.rp_filter=1"],
    )
    .expect("sysctl in the lab's node");
    // Pods' veth pairs (the dummy module may not be loaded, and the host's
    // modules are not ours to load): one end on the bridge, the other in a
    // pod namespace of the lab (one for all: a namespace each would only
    // make the lab slower to build).
    let pods = lab
        .netns(presets::REMOTE_BACKEND_POD)
        .expect("a pod namespace")
        .name()
        .to_string();
    let batch: String = (0..EXTRA)
        .map(|i| {
            format!(
                "link add vm{i} type veth peer name vp{i} netns {pods}\nlink set vm{i} master cni0\nlink set vm{i} up\n"
            )
        })
        .collect();
    let batch_file =
        std::env::temp_dir().join(format!("nattrace-many-{}.batch", std::process::id()));
    std::fs::write(&batch_file, batch).expect("batch file");
    lab.run(presets::NODE_A, &["ip", "-b", batch_file.to_str().unwrap()])
        .expect("adding interfaces");
    let _ = std::fs::remove_file(&batch_file);
    let names = node_interfaces(&lab);
    assert!(names.len() > EXTRA, "{names:?}");
    let node = lab
        .node_netns(presets::NODE_A)
        .expect("node-a")
        .path()
        .display()
        .to_string();
    let args: Vec<String> = [
        "--svc",
        &web_svc(),
        "--netns",
        &node,
        "--output",
        "text",
        // One line per flow: the verdict, cause and backend read off it.
        "--wide",
        "--color",
        "never",
        "--reply-timeout",
        REPLY_TIMEOUT_MS,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let _lock = tracing_lock();
    let before = tc_state(&lab, &names);

    // A SIGKILLed run on pre-6.6 kernels with tc everywhere (as before
    // pod veths were left to the tracepoints) leaves clsact filters on
    // every interface.
    let mut killed = Nattrace::spawn(
        &nattrace(),
        &args,
        &[
            ("NATTRACE_FORCE_CLSACT", "1"),
            ("NATTRACE_TC_EVERYWHERE", "1"),
        ],
        false,
    )
    .expect("starting nattrace");
    killed
        .wait_started(ATTACH_TIMEOUT * 2)
        .unwrap_or_else(|e| panic!("{e:#}"));
    killed.signal(libc::SIGKILL);
    let _ = killed.wait(ATTACH_TIMEOUT);

    let mut tracer = Nattrace::spawn(&nattrace(), &args, &[], false).expect("starting nattrace");
    let first = tracer
        .wait_started(ATTACH_TIMEOUT * 2)
        .unwrap_or_else(|e| panic!("{e:#}"));
    let checks = tracer
        .wait_line(Duration::from_secs(10), |l| {
            l.starts_with("nattrace: checks:")
        })
        .expect("a checks line");
    assert!(
        checks.len() < SHORT,
        "checks line of {} chars: {checks}",
        checks.len()
    );
    assert!(checks.contains("more"), "summarised: {checks}");
    let objects = bpf_objects(tracer.pid());
    assert!(!objects.is_empty(), "nattrace holds no BPF objects");

    // Seed 000 on the big node: every connection reply_not_reverse_nated,
    // bridge_nf_call_iptables_off, from the device tracepoints' evidence on
    // the pod veths.
    let ports: Vec<u16> = (44000..44004).collect();
    let got = curl_parallel(
        &lab,
        presets::CLIENT_POD,
        presets::WEB_SERVICE_IP,
        presets::WEB_PORT,
        &ports,
        CURL_MAX_TIME,
    )
    .into_iter()
    .map(|r| r.expect("running curl"))
    .filter(|o| o.status.success())
    .count();
    assert_eq!(got, 0, "seed 000: curl fails");
    let mut flows = Vec::new();
    for _ in &ports {
        let line = tracer
            .wait_line(Duration::from_secs(10), |l| {
                l.contains(&format!(" tcp {}:", presets::CLIENT_IP))
            })
            .unwrap_or_else(|| panic!("a flow line per connection, got {flows:#?}"));
        flows.push(line);
    }
    for f in &flows {
        assert!(
            f.contains("reply_not_reverse_nated")
                && f.contains("cause: bridge_nf_call_iptables_off")
                && f.contains(&format!("DNAT→ {}:", presets::BACKEND_IP)),
            "{f}"
        );
    }

    let sent = Instant::now();
    tracer.signal(libc::SIGINT);
    let done = tracer
        .wait(ATTACH_TIMEOUT * 2)
        .unwrap_or_else(|e| panic!("{e:#}"));
    let took = sent.elapsed();

    // "tc on N node interfaces; M pod veths watched by device tracepoints"
    let split = done
        .stderr
        .lines()
        .find(|l| l.contains("watched by device tracepoints"))
        .unwrap_or_else(|| panic!("no tc/tracepoint line: {}", done.describe()));
    let number_before = |marker: &str| -> usize {
        split
            .split(marker)
            .next()
            .and_then(|head| head.rsplit(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no '{marker}' count: {split}"))
    };
    let with_tc = number_before(" node interfaces");
    let pod_veths = number_before(" pod veths watched by device tracepoints");
    // The 300 and the lab's own pods (client, backend, coredns).
    assert!(pod_veths >= EXTRA + 2, "{split}");
    // lo, eth0, cni0, the overlay device; nothing per pod.
    assert!((1..=8).contains(&with_tc), "{split}");
    eprintln!(
        "SIGINT -> exit with {} interfaces ({with_tc} with tc, {pod_veths} pod veths by tracepoints): {took:?}",
        names.len()
    );
    assert_eq!(done.status.code(), Some(1), "{}", done.describe());
    assert!(took <= EXIT_MAX, "exit took {took:?}\n{}", done.describe());
    let cleanup = done
        .stderr
        .lines()
        .find(|l| l.contains("left behind"))
        .unwrap_or_else(|| panic!("no cleanup line: {}", done.describe()));
    assert!(
        cleanup.len() < SHORT,
        "cleanup line of {} chars: {cleanup}",
        cleanup.len()
    );
    assert!(cleanup.contains("more"), "summarised: {cleanup}");
    eprintln!("{first}\n{split}\n{checks}\n{cleanup}");
    for line in done.stderr.lines() {
        assert!(line.len() < SHORT, "long stderr line: {line}");
    }
    // Nothing left: no link, program or map of it, no qdisc or filter
    // (neither the killed run's nor its own).
    assert_objects_gone(&objects, "after SIGINT");
    assert_eq!(
        tc_state(&lab, &names),
        before,
        "tc state of the node changed"
    );
}
