//! `CollectorConfig::lean_ok` (`--hide-ok` without a pcapng): every
//! recorded fixture decided both ways. Verdicts other than `ok` must be
//! the same reports; an `ok` one must agree on everything the summary, the
//! metrics and the exit status read.
use crate::{
    collector::{CollectorConfig, FlowReport, Verdict, testing::recordings},
    recording::{Reader, replay::replay},
};

fn decide(path: &std::path::Path, lean_ok: bool) -> Vec<FlowReport> {
    let (mut reader, header) = Reader::open(path).unwrap();
    let config = CollectorConfig {
        lean_ok,
        ..header.collector_config().unwrap()
    };
    let mut out = Vec::new();
    let Ok(_) = replay(config, &mut reader, None, |r| {
        out.extend(r);
        Ok::<_, std::convert::Infallible>(())
    });
    out
}

/// What [`crate::continuous::metrics`], the summary and the exit status read.
fn counted(r: &FlowReport) -> impl PartialEq + std::fmt::Debug + '_ {
    (
        (r.verdict, r.proto, r.client, r.service, r.backend, r.snat),
        (
            &r.k8s_service,
            &r.client_pod,
            &r.cause,
            r.phase,
            r.incomplete,
        ),
        (
            r.hairpin,
            &r.kube,
            r.opening_seen,
            r.first_ts_ns,
            r.decided_ts_ns,
        ),
    )
}

#[test]
fn lean_ok_reports_count_as_the_whole_ones() {
    let files = recordings();
    assert!(files.len() > 10, "{files:?}");
    let (mut ok, mut other) = (0, 0);
    for f in &files {
        let whole = decide(f, false);
        let lean = decide(f, true);
        assert_eq!(whole.len(), lean.len(), "{}", f.display());
        for (w, l) in whole.iter().zip(&lean) {
            if w.verdict == Verdict::Ok {
                ok += 1;
                assert_eq!(counted(w), counted(l), "{}", f.display());
                assert!(l.packets.is_empty() && l.attempts.is_empty() && l.detail.is_empty());
                assert!(!w.packets.is_empty(), "{}", f.display());
            } else {
                other += 1;
                assert_eq!(w, l, "{}", f.display());
            }
        }
    }
    assert!(ok > 10 && other > 10, "ok {ok}, other {other}");
}
