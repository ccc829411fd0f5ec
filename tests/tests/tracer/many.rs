//! A node with ~300 interfaces (a busy node's pod veths): the preamble's
//! checks line and the leftover-cleanup line stay short, and detaching
//! them all still happens before exit.

use std::time::{Duration, Instant};

use lab::presets;
use lab::tracer::{Nattrace, nattrace};

use super::{ATTACH_TIMEOUT, build_lab, tracing_lock, web_svc};

const EXTRA: usize = 300;
/// Long enough for any real finding, far below a list of 300 names.
const SHORT: usize = 400;

#[test]
fn root_300_interfaces_keep_the_checks_and_cleanup_lines_short() {
    require_root!();
    let lab = build_lab(presets::seed000(presets::Seed000 {
        bridge_nf_call_iptables: true,
        ..Default::default()
    }));
    // Bridge ports with hairpin off and strict rp_filter, like a node whose
    // CNI left both at their defaults: each check then names every port.
    lab.run(
        presets::NODE_A,
        &["sysctl", "-qw", "net.ipv4.conf.default.rp_filter=1"],
    )
    .expect("sysctl in the lab's node");
    // veth pairs (the dummy module may not be loaded, and the host's
    // modules are not ours to load): one end on the bridge, both up.
    let batch: String = (0..EXTRA / 2)
        .map(|i| {
            format!(
                "link add vm{i} type veth peer name vp{i}\nlink set vm{i} master cni0\nlink set vm{i} up\nlink set vp{i} up\n"
            )
        })
        .collect();
    let batch_file =
        std::env::temp_dir().join(format!("nattrace-many-{}.batch", std::process::id()));
    std::fs::write(&batch_file, batch).expect("batch file");
    lab.run(presets::NODE_A, &["ip", "-b", batch_file.to_str().unwrap()])
        .expect("adding interfaces");
    let _ = std::fs::remove_file(&batch_file);
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
        "--color",
        "never",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let _lock = tracing_lock();

    // A SIGKILLed run on pre-6.6 kernels leaves clsact filters on every interface.
    let mut killed = Nattrace::spawn(&nattrace(), &args, &[("NATTRACE_FORCE_CLSACT", "1")], false)
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
    let count: usize = first
        .split(" interfaces")
        .next()
        .and_then(|head| head.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no interface count: {first}"));
    assert!(count > EXTRA, "{first}");
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
    let sent = Instant::now();
    tracer.terminate();
    let done = tracer
        .wait(ATTACH_TIMEOUT * 2)
        .unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!(
        "SIGTERM -> exit with {EXTRA}+ interfaces: {:?}",
        sent.elapsed()
    );
    assert_eq!(done.status.code(), Some(0), "{}", done.describe());
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
    eprintln!("{checks}\n{cleanup}");
    for line in done.stderr.lines() {
        assert!(line.len() < SHORT, "long stderr line: {line}");
    }
}
