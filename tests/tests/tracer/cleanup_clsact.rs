//! A clsact qdisc that existed before nattrace (empty, made by someone
//! else) survives a SIGKILLed clsact-mode run and the cleanup after it
//! (issue 26 item 6); the clsact qdiscs nattrace added are removed.

use std::process::Command;
use std::time::{Duration, Instant};

use lab::presets;

use super::cleanup::node_state;
use super::{args, build_lab, start, tracing_lock, web_svc};

#[test]
fn root_cleanup_after_sigkill_keeps_a_clsact_that_existed_before() {
    require_root!();
    let lab = build_lab(presets::seed000(presets::Seed000::default()));
    let node = lab.node_netns(presets::NODE_A).expect("node-a").path();
    // The client pod's bridge port: nattrace attaches to it in clsact mode.
    let dev = "veth0";
    lab.run(
        presets::NODE_A,
        &["tc", "qdisc", "add", "dev", dev, "clsact"],
    )
    .expect("someone else's clsact");
    let before = node_state(&lab);
    assert!(before.contains("clsact"), "{before}");
    let _lock = tracing_lock();

    for next_start in [false, true] {
        let t = start(
            &args(&lab, &[web_svc()], &[]),
            &[("NATTRACE_FORCE_CLSACT", "1")],
        );
        // Attached: our filter is on the pre-existing clsact too.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !node_state(&lab).contains("tc_ingress") {
            assert!(Instant::now() < deadline, "no clsact filter of nattrace's");
            std::thread::sleep(Duration::from_millis(50));
        }
        t.signal(libc::SIGKILL);
        drop(t);
        let left = node_state(&lab);
        assert!(
            left.contains("tc_ingress"),
            "SIGKILL leaves filters:\n{left}"
        );
        if next_start {
            let mut t = start(
                &args(&lab, &[web_svc()], &["--duration", "1"]),
                &[("NATTRACE_FORCE_CLSACT", "1")],
            );
            let done = t
                .wait(super::ATTACH_TIMEOUT)
                .unwrap_or_else(|e| panic!("{e:#}"));
            assert!(
                done.stderr.contains("removed what a killed nattrace left"),
                "{}",
                done.describe()
            );
        } else {
            let out = Command::new(lab::tracer::nattrace())
                .args(["cleanup", "--netns"])
                .arg(&node)
                .env_remove("RUST_LOG")
                .output()
                .expect("nattrace cleanup");
            assert_eq!(out.status.code(), Some(0), "{out:?}");
        }
        let after = node_state(&lab);
        assert_eq!(
            after, before,
            "only what nattrace added is gone, the clsact on {dev} stays (next start: {next_start})"
        );
    }
}
