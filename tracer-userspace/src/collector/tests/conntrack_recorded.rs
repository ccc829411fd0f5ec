//! conntrack's own failures as the kernel showed them (issue 22), each with
//! its golden `analyze --output json -v` in `fixtures/conntrack/`:
//! - `conntrack_insert_failed`: a real SNAT source-port collision on 6.18,
//!   recorded by `tests/tests/conntrack_snat.rs` run alone (`cargo xtask
//!   fixtures`): masquerade to one port, two clients to one backend, the
//!   second's SYN dies at confirm with NETFILTER_DROP and `insert_failed`
//!   rises;
//! - `stale_conntrack_entry` on UDP: `stale_entry_udp.rec` (its golden
//!   beside it, `cargo xtask fixtures` does not remake it: recorded from
//!   tests/tests/conntrack.rs in iptables mode);
//! - `conntrack_table_full`: the 6.1 and 6.12 guests' table filled with
//!   `nf_conntrack_max` lowered in their own root namespace
//!   (tests/src/bin/vm-guest/table_full.rs, kprobe backend; `cargo xtask
//!   vm-test --record-fixtures DIR`): the next SYN dropped at conntrack's
//!   hook, the healthy twin after the limit is raised back.
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
/// tests/tests/conntrack.rs's stale UDP entry beside a stale rule
/// (iptables mode), also checked by assertions in stale_entry.rs.
const STALE_UDP: (&str, &str) = (
    include_str!(crate::fixture!("stale_entry_udp.rec")),
    include_str!(crate::fixture!("stale_entry_udp.json")),
);
/// (name, recording, golden) of the guests' table-full runs.
const TABLE_FULL: [(&str, &str, &str); 2] = [
    (
        "vm6_1_kprobe_table_full",
        include_str!(crate::fixture!("conntrack/vm6_1_kprobe_table_full.rec")),
        include_str!(crate::fixture!("conntrack/vm6_1_kprobe_table_full.json")),
    ),
    (
        "vm6_12_kprobe_table_full",
        include_str!(crate::fixture!("conntrack/vm6_12_kprobe_table_full.rec")),
        include_str!(crate::fixture!("conntrack/vm6_12_kprobe_table_full.json")),
    ),
];
/// table_full.rs's client ports: the connection that meets the full table
/// and the one after the limit is raised back.
const FULL_PORT: u16 = 30_001;
const OK_PORT: u16 = 30_002;

fn decide_text(text: &str) -> (Vec<FlowReport>, Summary) {
    let (mut reader, header) = Reader::new(Cursor::new(text.as_bytes())).expect("a recording");
    decide_all(&mut reader, &header, None)
}

fn decide() -> (Vec<FlowReport>, Summary) {
    decide_text(RECORDING)
}

/// The reports as `analyze --output json -v` writes them and the golden's
/// lines, the start line aside.
fn as_golden(reports: &[FlowReport], summary: &Summary, golden: &str) -> (Vec<Value>, Vec<Value>) {
    let mut out = JsonOutput::new(Vec::new(), true);
    for r in reports {
        out.flow(r).unwrap();
    }
    out.summary(summary, 0).unwrap();
    let parse = |text: &str| -> Vec<Value> {
        text.lines()
            .map(|l| serde_json::from_str::<Value>(l).expect("JSON line"))
            .filter(|v| v["kind"] != "start")
            .collect()
    };
    (
        parse(&String::from_utf8(out.into_inner()).unwrap()),
        parse(golden),
    )
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

/// Decided as `analyze` decided it when it was recorded.
#[test]
fn the_snat_collision_is_decided_as_its_golden() {
    let (reports, summary) = decide();
    let (got, want) = as_golden(&reports, &summary, GOLDEN);
    assert_eq!(got, want);
}

#[test]
fn the_stale_udp_entry_is_decided_as_its_golden() {
    let (reports, summary) = decide_text(STALE_UDP.0);
    assert!(
        reports.iter().any(|r| r
            .cause
            .as_ref()
            .is_some_and(|c| c.id.as_str() == "stale_conntrack_entry")),
        "{reports:#?}"
    );
    let (got, want) = as_golden(&reports, &summary, STALE_UDP.1);
    assert_eq!(got, want);
}

/// The guests' full table: the connection that met it is `dropped` /
/// `conntrack_table_full`, the one after the limit was raised and the
/// streams that filled the table are `ok`; each as its golden.
#[test]
fn the_guests_full_table_is_named_and_decided_as_its_golden() {
    for (name, rec, golden) in TABLE_FULL {
        let (reports, summary) = decide_text(rec);
        let port = |p: u16| {
            reports
                .iter()
                .find(|r| r.client.port() == p)
                .unwrap_or_else(|| panic!("{name}: no flow from port {p}"))
        };
        let full = port(FULL_PORT);
        assert_eq!(full.verdict, Verdict::Dropped, "{name}: {}", full.detail);
        assert_eq!(
            full.cause.as_ref().map(|c| c.id.as_str()),
            Some("conntrack_table_full"),
            "{name}: {}",
            full.detail
        );
        assert_eq!(port(OK_PORT).verdict, Verdict::Ok, "{name}");
        let others: Vec<&FlowReport> = reports
            .iter()
            .filter(|r| ![FULL_PORT, OK_PORT].contains(&r.client.port()))
            .collect();
        assert!(others.len() >= 3, "{name}: the streams filling it");
        assert!(others.iter().all(|r| r.verdict == Verdict::Ok), "{name}");
        let (got, want) = as_golden(&reports, &summary, golden);
        assert_eq!(got, want, "{name}");
    }
}
