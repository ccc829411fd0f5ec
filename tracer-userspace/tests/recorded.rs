//! The seed scenarios as real kernels showed them: recordings made with
//! `--write`, each with the golden `nattrace analyze NAME.rec --output json
//! -v` it gave. The collector must decide every recording exactly as it did
//! then.
//! - `root_*`: this host's kernel (6.18, netfilter backend), made by the root
//!   lab tests; regenerate with `cargo xtask fixtures` (root; it lists them).
//! - `vm*_kprobe_*`: seed 000 in the Debian 6.1/6.12 guests with the kprobe
//!   backend, the one this host cannot run; regenerate with `cargo xtask
//!   vm-test --kernel 6.12 --kernel 6.1 --record-fixtures
//!   tracer-userspace/fixtures/recorded` (QEMU, several minutes).
use std::path::Path;

use serde_json::Value;

use tracer_common::{direction, hook};

use nattrace::{
    collector::testing::{recorded_dir, recordings},
    output::json::JsonOutput,
    recording::{Reader, replay::decide_all},
};

/// The flow and summary lines the collector gives for a recording, the way
/// `analyze --output json -v` writes them (its preamble aside).
fn decide(rec: &Path) -> Vec<Value> {
    let (mut reader, header) = Reader::open(rec).expect("a nattrace recording");
    let (reports, summary) = decide_all(&mut reader, &header, None);
    let text = std::fs::read_to_string(rec).unwrap();
    let end: Value = serde_json::from_str(text.lines().last().unwrap_or_default()).unwrap();
    assert_eq!(end["kind"], "end", "{}: no end line", rec.display());
    // The kernel's count of muted packets is not an event: it comes from
    // the end line, as in analyze.
    assert_eq!(Some(summary.muted_packets), end["muted_packets"].as_u64());
    let mut out = JsonOutput::new(Vec::new(), true);
    for r in &reports {
        out.flow(r).unwrap();
    }
    out.summary(&summary, 0).unwrap();
    lines(&String::from_utf8(out.into_inner()).unwrap())
}

fn lines(text: &str) -> Vec<Value> {
    text.lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .filter(|v: &Value| v["kind"] != "start")
        .collect()
}

#[test]
fn every_seed_recording_is_decided_as_when_it_was_recorded() {
    let recs = recordings();
    assert!(
        recs.len() >= 10,
        "the seed recordings are missing from {}: cargo xtask fixtures",
        recorded_dir().display()
    );
    for rec in recs {
        let golden = rec.with_extension("json");
        let want = lines(&std::fs::read_to_string(&golden).unwrap_or_else(|e| {
            panic!("{}: {e} (cargo xtask fixtures writes it)", golden.display())
        }));
        let got = decide(&rec);
        assert_eq!(got.len(), want.len(), "{}", rec.display());
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g, w, "{}", rec.display());
        }
    }
}

/// What the seeds must show, checked on the recordings themselves (the
/// golden files could be regenerated wrong; these cannot drift with them).
#[test]
fn seed_recordings_show_their_incident() {
    let expect: &[(&str, &[&str], Option<&str>)] = &[
        (
            "root_seed000_broken_every_same_node_connection_is_not_reverse_nated",
            &["reply_not_reverse_nated"],
            Some("bridge_nf_call_iptables_off"),
        ),
        ("root_seed000_healthy_every_connection_is_ok", &["ok"], None),
        (
            "root_dns_seed001_broken_reply_from_unexpected_source",
            &["reply_not_reverse_nated"],
            Some("bridge_nf_call_iptables_off"),
        ),
        ("root_dns_seed001_healthy_is_ok", &["ok"], None),
        (
            "root_seed003_on_the_dnating_node_no_reply_through_node",
            &["no_reply"],
            Some("no_reply_through_node"),
        ),
        (
            "root_seed003_with_masquerade_all_is_ok_and_snated",
            &["ok"],
            None,
        ),
        (
            "root_seed003_on_the_backend_node_reply_bypasses_the_dnating_node",
            &["reply_not_reverse_nated"],
            Some("reply_bypasses_dnat_node"),
        ),
        ("root_hairpin_with_masquerade_is_ok", &["ok"], None),
        (
            "vm6_12_kprobe_seed000_broken",
            &["reply_not_reverse_nated"],
            Some("bridge_nf_call_iptables_off"),
        ),
        ("vm6_12_kprobe_seed000_healthy", &["ok"], None),
        (
            "vm6_1_kprobe_seed000_broken",
            &["reply_not_reverse_nated"],
            Some("bridge_nf_call_iptables_off"),
        ),
        ("vm6_1_kprobe_seed000_healthy", &["ok"], None),
        (
            "root_hairpin_mode_off_is_named",
            // The kernel may or may not report the bridge's drop in time.
            &["no_reply", "dropped"],
            Some("hairpin_mode_off"),
        ),
        (
            "root_hairpin_without_masquerade_is_dropped_as_local_source",
            &["dropped"],
            Some("hairpin_not_masqueraded"),
        ),
    ];
    for (name, verdict, cause) in expect {
        let rec = recorded_dir().join(format!("{name}.rec"));
        let flows: Vec<Value> = decide(&rec)
            .into_iter()
            .filter(|v| v["kind"] == "flow")
            .collect();
        assert!(!flows.is_empty(), "{name}: no flow");
        for f in &flows {
            assert!(verdict.iter().any(|v| f["verdict"] == *v), "{name}: {f}");
            assert_eq!(f["cause"].as_str(), *cause, "{name}: {f}");
        }
    }
}

/// The recording's events, as JSON.
fn events(rec: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(rec).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["kind"] == "event")
        .collect()
}

/// The kprobe backend's own observation point, from a real kernel: in seed
/// 000 the reply crosses the node's bridge from the backend's port to the
/// client's, and br_forward sees it in both runs with the backend's source.
/// Healthy too: br_netfilter reverse-NATs it only after br_forward, at the
/// bridge's POST_ROUTING (net/bridge/br_forward.c: __br_forward runs
/// NF_BR_FORWARD, then br_forward_finish NF_BR_POST_ROUTING, where
/// br_nf_post_routing runs the IPv4 POST_ROUTING hooks and nf_nat its SRC
/// manip). The broken run differs later: no reverse NAT at all.
#[test]
fn guest_kprobe_recordings_see_the_reply_at_br_forward() {
    for series in ["vm6_12", "vm6_1"] {
        for scenario in ["seed000_broken", "seed000_healthy"] {
            let rec = recorded_dir().join(format!("{series}_kprobe_{scenario}.rec"));
            let header = std::fs::read_to_string(&rec).unwrap();
            let header: Value = serde_json::from_str(header.lines().next().unwrap()).unwrap();
            assert_eq!(header["backend"], "kprobe", "{}", rec.display());
            let bridged: Vec<Value> = events(&rec)
                .into_iter()
                .filter(|e| e["hook"] == hook::BR_FORWARD && e["direction"] == direction::REPLY)
                .collect();
            assert!(
                !bridged.is_empty(),
                "{}: no reply at br_forward",
                rec.display()
            );
            let service = header["services"][0].as_str().unwrap();
            for e in &bridged {
                let from = format!("{}:{}", e["saddr"].as_str().unwrap(), e["sport"]);
                assert_ne!(from, service, "{}: {e}", rec.display());
            }
        }
    }
}

/// `nattrace analyze -` reads the recording from stdin (issue 28), with
/// the output and exit status of `analyze FILE`; `-` twice is refused.
#[test]
fn analyze_reads_a_recording_from_stdin() {
    use std::process::{Command, Stdio};
    let rec = recordings()
        .into_iter()
        .find(|r| {
            r.file_stem()
                .is_some_and(|s| s.to_string_lossy().starts_with("root_seed000_broken"))
        })
        .expect("seed 000's broken recording");
    let analyze = |args: &[&str], stdin: Stdio| {
        Command::new(env!("CARGO_BIN_EXE_nattrace"))
            .arg("analyze")
            .args(args)
            .args(["--output", "json"])
            .env_remove("RUST_LOG")
            .stdin(stdin)
            .output()
            .expect("running nattrace analyze")
    };
    let from_file = analyze(&[rec.to_str().unwrap()], Stdio::null());
    let file = std::fs::File::open(&rec).unwrap();
    let from_stdin = analyze(&["-"], Stdio::from(file));
    assert_eq!(from_file.status.code(), Some(1), "{from_file:?}");
    assert_eq!(
        from_stdin.status.code(),
        from_file.status.code(),
        "{from_stdin:?}"
    );
    assert!(!from_stdin.stdout.is_empty(), "{from_stdin:?}");
    assert_eq!(
        lines(&String::from_utf8_lossy(&from_stdin.stdout)),
        lines(&String::from_utf8_lossy(&from_file.stdout))
    );
    // A pipe, not only a file on stdin.
    let mut cat = Command::new("cat")
        .arg(&rec)
        .stdout(Stdio::piped())
        .spawn()
        .expect("cat");
    let piped = analyze(&["-"], Stdio::from(cat.stdout.take().unwrap()));
    let _ = cat.wait();
    assert_eq!(
        lines(&String::from_utf8_lossy(&piped.stdout)),
        lines(&String::from_utf8_lossy(&from_file.stdout))
    );
    let twice = analyze(&["-", "-"], Stdio::null());
    assert_eq!(twice.status.code(), Some(2), "{twice:?}");
    assert_eq!(
        String::from_utf8_lossy(&twice.stderr).lines().count(),
        1,
        "{twice:?}"
    );
}
