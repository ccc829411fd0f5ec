//! nattrace changes nothing on the node: after it exits (normally or by
//! SIGTERM) no tc qdisc/filter, link attachment or BPF object of its own is
//! left. BPF objects are checked by id through the bpf syscall (no bpftool).

use std::thread;
use std::time::{Duration, Instant};

use lab::Lab;
use lab::presets;
use lab::tracer::{BpfKind, Finished, Nattrace, bpf_object_exists, bpf_objects};

use super::{ATTACH_TIMEOUT, args, build_lab, start, tracing_lock, web_svc};

/// What nattrace could leave behind in the node namespace, as text to diff:
/// links (incl. XDP `prog/xdp`), qdiscs (clsact), tc filters per hook.
pub(super) fn node_state(lab: &Lab) -> String {
    let run = |args: &[&str]| {
        let out = lab.exec(presets::NODE_A, args).expect("running ip/tc");
        // stderr only when the command failed: `ip link` warns on stderr
        // ("Peer netns reference is invalid.") while it resolves peer
        // namespace names and another test deletes its namespaces.
        let stderr = if out.status.success() {
            std::borrow::Cow::Borrowed("")
        } else {
            String::from_utf8_lossy(&out.stderr)
        };
        format!(
            "$ {}\n{}{stderr}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
        )
    };
    // The bridge's operstate settles on its own (UNKNOWN → UP): not ours.
    let links: String = run(&["ip", "-o", "link", "show"])
        .lines()
        .map(|l| {
            let mut words: Vec<&str> = l.split(' ').collect();
            // Nor is the peer namespace's name, which ip resolves by
            // scanning /run/netns while other tests add and delete theirs.
            for key in ["state", "link-netns", "link-netnsid"] {
                if let Some(i) = words.iter().position(|w| *w == key) {
                    words.drain(i..(i + 2).min(words.len()));
                }
            }
            words.join(" ") + "\n"
        })
        .collect();
    let mut state = links.clone();
    state.push_str(&run(&["tc", "qdisc", "show"]));
    let names = links.lines().skip(1).filter_map(|l| {
        let name = l.split(':').nth(1)?.trim();
        Some(name.split('@').next()?.to_string())
    });
    for dev in names {
        for hook in ["ingress", "egress"] {
            state.push_str(&run(&["tc", "filter", "show", "dev", &dev, hook]));
        }
    }
    state
}

pub(super) fn assert_objects_gone(objects: &[(BpfKind, u32)], what: &str) {
    // Programs and maps are freed after an RCU grace period / from a workqueue.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left: Vec<_> = objects
            .iter()
            .filter(|(k, id)| bpf_object_exists(*k, *id))
            .collect();
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: BPF objects still exist: {left:?}"
        );
        thread::sleep(Duration::from_millis(100));
    }
}

enum Stop {
    Duration,
    Sigterm,
}

fn run_and_check(lab: &Lab, before: &str, stop: Stop, envs: &[(&str, &str)]) -> Finished {
    let what = match stop {
        Stop::Duration => "exit after --duration",
        Stop::Sigterm => "SIGTERM",
    };
    let what = format!("{what} {envs:?}");
    let extra: &[&str] = match stop {
        Stop::Duration => &["--duration", "2"],
        Stop::Sigterm => &[],
    };
    let mut tracer: Nattrace = start(&args(lab, &[web_svc()], extra), envs);
    // Looked at first: with --duration 2, a loaded machine's curl could
    // outlast the run.
    let objects = bpf_objects(tracer.pid());
    assert!(
        objects
            .iter()
            .any(|(k, _)| *k == BpfKind::Prog || *k == BpfKind::Link),
        "{what}: nattrace holds no BPF programs or links while tracing: {objects:?}"
    );
    let during = node_state(lab);
    if envs.iter().any(|(k, _)| *k == "NATTRACE_FORCE_CLSACT") {
        assert_ne!(
            during, before,
            "{what}: the clsact fallback should show in tc while tracing"
        );
    }
    // Some traffic, so the programs have run on real packets.
    let _ = lab.http_get(
        presets::CLIENT_POD,
        presets::WEB_SERVICE_IP,
        presets::WEB_PORT,
        Duration::from_secs(1),
    );
    if let Stop::Sigterm = stop {
        tracer.terminate();
    }
    let done = tracer
        .wait(ATTACH_TIMEOUT)
        .unwrap_or_else(|e| panic!("{what}: {e:#}"));
    assert_eq!(done.status.code(), Some(0), "{what}: {}", done.describe());
    assert_eq!(
        node_state(lab),
        before,
        "{what}: the node namespace changed"
    );
    assert_objects_gone(&objects, &what);
    done
}

#[test]
fn root_nothing_is_left_after_exit_or_sigterm() {
    require_root!();
    let lab = build_lab(presets::seed000(presets::Seed000::default()));
    let before = node_state(&lab);
    let _lock = tracing_lock();
    run_and_check(&lab, &before, Stop::Duration, &[]);
    let done = run_and_check(&lab, &before, Stop::Sigterm, &[]);
    let summary = done.summary().unwrap_or_else(|e| {
        panic!(
            "SIGTERM must still print the summary: {e:#}\n{}",
            done.describe()
        )
    });
    assert!(summary["flows"].as_u64().is_some(), "{summary}");
    // The pre-6.6 path (clsact qdisc + tc filters) must clean up as well.
    run_and_check(
        &lab,
        &before,
        Stop::Sigterm,
        &[("NATTRACE_FORCE_CLSACT", "1")],
    );
}
