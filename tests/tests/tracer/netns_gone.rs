//! `ip netns del` of the traced node while nattrace runs: nattrace notices
//! within a second, says so in one line, lets the namespace go (its
//! netfilter links and fds would keep it alive) and exits 2.

use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use lab::presets;
use lab::tracer::bpf_objects;

use super::cleanup::assert_objects_gone;
use super::{args, build_lab, start, tracing_lock, web_svc};

#[test]
fn root_deleted_node_namespace_is_released_and_exits_2() {
    require_root!();
    let lab = build_lab(presets::seed000(presets::Seed000 {
        bridge_nf_call_iptables: true,
        ..Default::default()
    }));
    let node = lab
        .node_netns(presets::NODE_A)
        .expect("node-a")
        .name()
        .to_string();
    let _lock = tracing_lock();
    let mut tracer = start(&args(&lab, &[web_svc()], &[]), &[]);
    let page = lab
        .http_get(
            presets::CLIENT_POD,
            presets::WEB_SERVICE_IP,
            presets::WEB_PORT,
            Duration::from_secs(1),
        )
        .expect("curl");
    assert!(
        page.status.success(),
        "the Service works before the deletion"
    );
    let objects = bpf_objects(tracer.pid());
    // The client pod's eth0 is a veth whose peer lives in the node.
    let pod_eth0 = || {
        lab.exec(presets::CLIENT_POD, &["ip", "link", "show", "eth0"])
            .expect("ip link")
            .status
            .success()
    };
    assert!(pod_eth0());

    let deleted = Instant::now();
    let out = Command::new("ip")
        .args(["netns", "del", &node])
        .output()
        .expect("ip netns del");
    assert!(out.status.success(), "{out:?}");
    let done = tracer
        .wait(Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let took = deleted.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "exit {took:?} after the deletion\n{}",
        done.describe()
    );
    assert_eq!(done.status.code(), Some(2), "{}", done.describe());
    // One line about the deletion, after the start's lines: "waiting for
    // connections", where pod names come from (issue 28) and which
    // interfaces tc covers.
    let stderr: Vec<&str> = done
        .stderr
        .lines()
        .filter(|l| !l.starts_with("nattrace: waiting for connections to "))
        .filter(|l| {
            !l.starts_with("nattrace: pods are not named")
                && !l.starts_with("nattrace: pod names from")
                && !l.contains("watched by device tracepoints")
        })
        .collect();
    assert_eq!(stderr.len(), 1, "one line:\n{}", done.describe());
    assert!(
        stderr[0].contains("was deleted") && stderr[0].contains(&node),
        "{}",
        done.describe()
    );
    // The flows decided so far and the summary are still printed.
    let summary = done
        .summary()
        .unwrap_or_else(|e| panic!("{e:#}\n{}", done.describe()));
    assert!(summary["flows"].as_u64() >= Some(1), "{summary}");

    // Released: the kernel dismantles the namespace, taking the node's
    // end of every pod veth (and so the pod's eth0) with it.
    let deadline = Instant::now() + Duration::from_secs(10);
    while pod_eth0() {
        assert!(
            Instant::now() < deadline,
            "the deleted node namespace is still alive 10 s after nattrace exited"
        );
        thread::sleep(Duration::from_millis(100));
    }
    assert_objects_gone(&objects, "after the node namespace was deleted");
}
