//! The seed scenarios as this host's kernel (6.18, netfilter backend) showed
//! them: recordings made by the root lab tests with `--write`, each with the
//! golden `nattrace analyze NAME.rec --output json -v` it gave. Regenerate
//! both with `cargo xtask fixtures` (root; it lists the scenarios). The
//! collector must decide every recording exactly as it did then.
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::{
    output::json::JsonOutput,
    recording::{Reader, replay::decide_all},
};

fn recorded_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/collector/fixtures/recorded")
}

fn recordings() -> Vec<PathBuf> {
    let mut recs: Vec<PathBuf> = std::fs::read_dir(recorded_dir())
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "rec"))
                .collect()
        })
        .unwrap_or_default();
    recs.sort();
    recs
}

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
