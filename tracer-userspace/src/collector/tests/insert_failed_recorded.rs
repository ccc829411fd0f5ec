//! `conntrack_insert_failed` as the kernel showed it (issue 22): a real
//! SNAT source-port collision on 6.18, recorded by
//! `tests/tests/conntrack_snat.rs` run alone with `NATTRACE_RECORD_DIR`
//! (masquerade to one port, two clients to one backend: the second's SYN
//! dies at confirm with NETFILTER_DROP and `insert_failed` rises), with its
//! golden `analyze --output json -v` in `fixtures/conntrack/`.
use std::io::Cursor;

use serde_json::Value;

use super::*;
use crate::output::json::JsonOutput;
use crate::recording::{Reader, replay::decide_all};

const RECORDING: &str = include_str!(crate::fixture!(
    "conntrack/root_snat_port_collision_is_an_insert_failure.rec"
));
const GOLDEN: &str = include_str!(crate::fixture!(
    "conntrack/root_snat_port_collision_is_an_insert_failure.json"
));

fn decide() -> (Vec<FlowReport>, Summary) {
    let (mut reader, header) = Reader::new(Cursor::new(RECORDING.as_bytes())).expect("a recording");
    decide_all(&mut reader, &header, None)
}

#[test]
fn a_real_snat_collision_is_an_insert_failure() {
    let (reports, summary) = decide();
    assert_eq!(reports.len(), 1, "{reports:#?}");
    let r = &reports[0];
    assert_eq!(r.verdict, Verdict::Dropped, "{}", r.detail);
    assert_eq!(
        r.cause.as_ref().map(|c| c.id.as_str()),
        Some("conntrack_insert_failed"),
        "{}",
        r.detail
    );
    // Masqueraded to the one port the other client holds.
    assert_eq!(r.snat.map(|s| s.port()), Some(40000));
    let rose = summary.conntrack.and_then(|c| c.insert_failed).unwrap_or(0);
    assert!(rose >= 1, "{:?}", summary.conntrack);
}

/// Decided as `analyze` decided it when it was recorded (the start line
/// aside).
#[test]
fn the_snat_collision_is_decided_as_its_golden() {
    let (reports, summary) = decide();
    let mut out = JsonOutput::new(Vec::new(), true);
    for r in &reports {
        out.flow(r).unwrap();
    }
    out.summary(&summary, 0).unwrap();
    let parse = |text: &str| -> Vec<Value> {
        text.lines()
            .map(|l| serde_json::from_str::<Value>(l).expect("JSON line"))
            .filter(|v| v["kind"] != "start")
            .collect()
    };
    assert_eq!(
        parse(&String::from_utf8(out.into_inner()).unwrap()),
        parse(GOLDEN)
    );
}
