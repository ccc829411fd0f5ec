//! The established-flow cases as the kernel showed them (issue 21):
//! recordings of `tests/tests/established.rs` on 6.18 (netfilter backend,
//! both kube-proxy modes), made by `cargo xtask fixtures` in the default
//! mode (kernel buffer on, healthy flows muted and watched in the kernel),
//! in `fixtures/established/` with their golden `analyze --output json -v`.
//! Two long-lived streams each: client port 41001 broken mid-stream, 41002
//! its healthy twin. The stale TCP entry's (issue 22) come from
//! `tests/tests/established_more.rs` run with `NATTRACE_RECORD_DIR` (ports
//! 41011 and 41012).
use std::io::Cursor;

use serde_json::Value;
use tracer_common::event_flags;

use super::*;
use crate::output::json::JsonOutput;
use crate::recording::{Reader, replay::decide_all};

/// The broken stream's and its twin's client ports: established.rs's, or
/// established_more.rs's for the stale TCP entry.
fn ports(name: &str) -> (u16, u16) {
    if name.starts_with("root_stale_tcp_entry") {
        (41011, 41012)
    } else {
        (41001, 41002)
    }
}

/// (fixture, the established verdict, its cause, whether the twin's
/// backend is on the client's node).
const CASES: [(&str, &str, &str, bool); 7] = [
    (
        "root_bridge_nf_off_mid_stream_iptables",
        "reply_not_reverse_nated",
        "bridge_nf_call_iptables_off",
        false,
    ),
    (
        "root_bridge_nf_off_mid_stream_nftables",
        "reply_not_reverse_nated",
        "bridge_nf_call_iptables_off",
        false,
    ),
    // kube-proxy's iptables mode renders `KUBE-FORWARD -m conntrack
    // --ctstate INVALID -j DROP` (the lab's layout): the INVALID data is
    // dropped after FORWARD.
    (
        "root_conntrack_entry_deleted_mid_stream_iptables",
        "dropped",
        "conntrack_invalid",
        true,
    ),
    // The lab's nftables-mode node drops nothing INVALID: the backend's
    // data, not reverse-NATed, reaches the client, which resets.
    (
        "root_conntrack_entry_deleted_mid_stream_nftables",
        "reply_not_reverse_nated",
        "conntrack_invalid",
        true,
    ),
    // A segment out of the TCP window with the entry in place (looked up
    // over ctnetlink when the flow failed: the recording's `ct_entry` line):
    // NAT skips it, the client resets.
    (
        "root_conntrack_out_of_window_mid_stream_nftables",
        "reply_not_reverse_nated",
        "conntrack_invalid",
        true,
    ),
    // established_more.rs: the endpoint moved and the old pod cut off
    // mid-connection; the entry still DNATs the client's data to it, which
    // the bridge has no port for (NO_TX_TARGET). The twin's Service has its
    // backend on the other node.
    (
        "root_stale_tcp_entry_mid_flow_iptables",
        "dropped",
        "stale_conntrack_entry",
        false,
    ),
    (
        "root_stale_tcp_entry_mid_flow_nftables",
        "dropped",
        "stale_conntrack_entry",
        false,
    ),
];

fn recording(name: &str) -> &'static str {
    match name {
        "root_stale_tcp_entry_mid_flow_iptables" => include_str!(crate::fixture!(
            "established/root_stale_tcp_entry_mid_flow_iptables.rec"
        )),
        "root_stale_tcp_entry_mid_flow_nftables" => include_str!(crate::fixture!(
            "established/root_stale_tcp_entry_mid_flow_nftables.rec"
        )),
        "root_bridge_nf_off_mid_stream_iptables" => include_str!(crate::fixture!(
            "established/root_bridge_nf_off_mid_stream_iptables.rec"
        )),
        "root_bridge_nf_off_mid_stream_nftables" => include_str!(crate::fixture!(
            "established/root_bridge_nf_off_mid_stream_nftables.rec"
        )),
        "root_conntrack_entry_deleted_mid_stream_iptables" => include_str!(crate::fixture!(
            "established/root_conntrack_entry_deleted_mid_stream_iptables.rec"
        )),
        "root_conntrack_entry_deleted_mid_stream_nftables" => include_str!(crate::fixture!(
            "established/root_conntrack_entry_deleted_mid_stream_nftables.rec"
        )),
        "root_conntrack_out_of_window_mid_stream_nftables" => include_str!(crate::fixture!(
            "established/root_conntrack_out_of_window_mid_stream_nftables.rec"
        )),
        _ => unreachable!("{name}"),
    }
}

fn golden(name: &str) -> &'static str {
    match name {
        "root_stale_tcp_entry_mid_flow_iptables" => include_str!(crate::fixture!(
            "established/root_stale_tcp_entry_mid_flow_iptables.json"
        )),
        "root_stale_tcp_entry_mid_flow_nftables" => include_str!(crate::fixture!(
            "established/root_stale_tcp_entry_mid_flow_nftables.json"
        )),
        "root_bridge_nf_off_mid_stream_iptables" => include_str!(crate::fixture!(
            "established/root_bridge_nf_off_mid_stream_iptables.json"
        )),
        "root_bridge_nf_off_mid_stream_nftables" => include_str!(crate::fixture!(
            "established/root_bridge_nf_off_mid_stream_nftables.json"
        )),
        "root_conntrack_entry_deleted_mid_stream_iptables" => include_str!(crate::fixture!(
            "established/root_conntrack_entry_deleted_mid_stream_iptables.json"
        )),
        "root_conntrack_entry_deleted_mid_stream_nftables" => include_str!(crate::fixture!(
            "established/root_conntrack_entry_deleted_mid_stream_nftables.json"
        )),
        "root_conntrack_out_of_window_mid_stream_nftables" => include_str!(crate::fixture!(
            "established/root_conntrack_out_of_window_mid_stream_nftables.json"
        )),
        _ => unreachable!("{name}"),
    }
}

fn decide(text: &str) -> (Vec<FlowReport>, Summary) {
    let (mut reader, header) = Reader::new(Cursor::new(text.as_bytes())).expect("a recording");
    decide_all(&mut reader, &header, None)
}

fn lines(text: &str) -> Vec<Value> {
    text.lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("JSON line"))
        .collect()
}

fn established(reports: &[FlowReport]) -> Vec<&FlowReport> {
    reports
        .iter()
        .filter(|r| r.phase == Phase::Established)
        .collect()
}

/// The recording's lines up to (not including) the first event the
/// kernel's watch sent, and everything after it left out.
fn before_the_watch(text: &str) -> String {
    let mut out = String::new();
    for l in text.lines() {
        let v: Value = serde_json::from_str(l).unwrap();
        if v["kind"] == "event"
            && v["flags"].as_u64().unwrap_or(0) & u64::from(event_flags::WATCH) != 0
        {
            break;
        }
        out.push_str(l);
        out.push('\n');
    }
    out
}

/// Each recording is decided as `analyze` decided it when it was recorded
/// (its golden, the start line aside): flows, phases, `established`, summary.
#[test]
fn established_recordings_are_decided_as_their_goldens() {
    for (name, ..) in CASES {
        let (reports, summary) = decide(recording(name));
        let mut out = JsonOutput::new(Vec::new(), true);
        for r in &reports {
            out.flow(r).unwrap();
        }
        out.summary(&summary, 0).unwrap();
        let got = lines(&String::from_utf8(out.into_inner()).unwrap());
        let want: Vec<Value> = lines(golden(name))
            .into_iter()
            .filter(|v| v["kind"] != "start")
            .collect();
        assert_eq!(got.len(), want.len(), "{name}");
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g, w, "{name}");
        }
    }
}

/// What each case must show, on the recording itself (a golden could be
/// regenerated wrong): both openings `ok`, one established report for the
/// broken stream with its cause, after good replies, from an event the
/// kernel's watch sent; the twin never flagged.
#[test]
fn established_recordings_show_the_break_and_a_healthy_twin() {
    for (name, verdict, cause, _) in CASES {
        let (broken, healthy) = ports(name);
        let text = recording(name);
        let (reports, summary) = decide(text);
        for port in [broken, healthy] {
            let openings: Vec<&FlowReport> = reports
                .iter()
                .filter(|r| r.client.port() == port && r.phase == Phase::Opening)
                .collect();
            assert_eq!(openings.len(), 1, "{name}: port {port}");
            assert_eq!(openings[0].verdict, Verdict::Ok, "{name}: port {port}");
        }
        assert!(
            reports
                .iter()
                .filter(|r| r.client.port() == healthy)
                .all(|r| r.verdict == Verdict::Ok),
            "{name}: the healthy twin was flagged"
        );
        let e = established(&reports);
        assert_eq!(e.len(), 1, "{name}");
        assert_eq!(e[0].client.port(), broken, "{name}");
        assert_eq!(e[0].verdict.as_str(), verdict, "{name}: {}", e[0].detail);
        assert_eq!(
            e[0].cause.as_ref().map(|c| c.id.as_str()),
            Some(cause),
            "{name}"
        );
        let info = e[0].established.as_ref().expect("established info");
        // The test read 4 lines before the break: each a reply that
        // reached the client reverse-NATed (counted in the kernel).
        assert!(info.good_replies >= 3, "{name}: {info:?}");
        assert!(info.failed_ts_ns > info.ok_ts_ns, "{name}: {info:?}");
        assert!(
            e[0].detail.starts_with("mid-stream "),
            "{name}: {}",
            e[0].detail
        );
        assert_eq!(summary.established_failures, 1, "{name}");
        let watched = lines(text)
            .into_iter()
            .filter(|v| v["kind"] == "event")
            .filter(|v| v["flags"].as_u64().unwrap_or(0) & u64::from(event_flags::WATCH) != 0)
            .filter(|v| v["sport"] == broken || v["dport"] == broken)
            .count();
        assert!(watched >= 1, "{name}: no event from the kernel's watch");
    }
}

/// The report comes from the kernel's watch event: the same recording cut
/// just before it has two `ok` streams and nothing else, although the
/// broken stream's data went on being counted in the kernel until then.
#[test]
fn without_the_watch_event_both_streams_are_ok() {
    for (name, ..) in CASES {
        let (reports, _) = decide(&before_the_watch(recording(name)));
        assert!(established(&reports).is_empty(), "{name}");
        assert_eq!(reports.len(), 2, "{name}");
        assert!(reports.iter().all(|r| r.verdict == Verdict::Ok), "{name}");
    }
}

/// br_netfilter switched off while running: the node's sysctls are read
/// again when the flow goes wrong, and the recording carries them (a
/// `sysctls` line after the watch event). Without that line the same
/// evidence cannot name `bridge_nf_call_iptables_off`: the facts at the
/// start said 1.
#[test]
fn the_bridge_cause_comes_from_the_sysctls_read_again() {
    for (name, _, cause, _) in CASES
        .iter()
        .filter(|c| c.2 == "bridge_nf_call_iptables_off")
    {
        let text = recording(name);
        let all = lines(text);
        let watch = first_watch_event(&all);
        let sysctls = all
            .iter()
            .position(|v| v["kind"] == "sysctls")
            .expect("a sysctls line");
        assert!(sysctls > watch, "{name}: re-read after the watch event");
        assert_eq!(all[sysctls]["bridge_nf_call_iptables"], false, "{name}");
        let without = without_kind(text, "sysctls");
        let (reports, _) = decide(&without);
        let e = established(&reports);
        assert_eq!(e.len(), 1, "{name}");
        assert_ne!(
            e[0].cause.as_ref().map(|c| c.id.as_str()),
            Some(*cause),
            "{name}"
        );
    }
}

/// The line of the first event the kernel's watch sent.
fn first_watch_event(all: &[Value]) -> usize {
    all.iter()
        .position(|v| {
            v["kind"] == "event"
                && v["flags"].as_u64().unwrap_or(0) & u64::from(event_flags::WATCH) != 0
        })
        .expect("a watch event")
}

/// The recording without its lines of one kind (as a reader of an older
/// version, which skips them, sees it).
fn without_kind(text: &str, kind: &str) -> String {
    let tag = format!("\"kind\":\"{kind}\"");
    text.lines()
        .filter(|l| !l.contains(&tag))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// conntrack_invalid's two kinds come from the entry looked up over
/// ctnetlink when the flow failed (the `ct_entry` line, after the watch
/// event): gone for the deleted entry, in place for the out-of-window
/// segment. Without the line (a version-5 recording) the cause is the same
/// and its text says it could be either.
#[test]
fn the_conntrack_cause_comes_from_the_entry_looked_up() {
    for (name, _, cause, _) in CASES.iter().filter(|c| c.2 == "conntrack_invalid") {
        let text = recording(name);
        let all = lines(text);
        let watch = first_watch_event(&all);
        let ct = all
            .iter()
            .position(|v| v["kind"] == "ct_entry")
            .expect("a ct_entry line");
        assert!(ct > watch, "{name}: looked up after the watch event");
        let in_place = !all[ct]["entry"].is_null();
        assert_eq!(
            in_place,
            name.contains("out_of_window"),
            "{name}: {}",
            all[ct]
        );
        let detail = |text: &str| {
            let (reports, _) = decide(text);
            let e = established(&reports);
            assert_eq!(e.len(), 1, "{name}");
            assert_eq!(
                e[0].cause.as_ref().map(|c| c.id.as_str()),
                Some(*cause),
                "{name}"
            );
            e[0].detail.clone()
        };
        let want = if in_place {
            "with the connection's entry in place (out of the TCP window)"
        } else {
            "entry for the connection was gone"
        };
        assert!(detail(text).contains(want), "{name}");
        let without = without_kind(text, "ct_entry");
        let generic = detail(&without);
        assert!(
            generic.contains("entry gone or INVALID")
                || generic.contains("conntrack no longer tracked the connection"),
            "{name}: {generic}"
        );
    }
}

/// The healthy twin's cost in events: nothing after its handshake (its
/// data and the ACKs checked in the kernel), and with the backend on the
/// client's node at most the 3 of docs/DESIGN.md "Event budget". A backend
/// on the other node costs its handshake per packet in a lab: that node's
/// namespace is on the same kernel, and the SYN-ACK leaving it from the
/// backend's address is not a reply at the client, so the held events go.
#[test]
fn the_healthy_twin_costs_no_event_after_its_handshake() {
    for (name, _, _, same_node) in CASES {
        let (_, healthy) = ports(name);
        let events: Vec<Value> = lines(recording(name))
            .into_iter()
            .filter(|v| v["kind"] == "event")
            .filter(|v| v["sport"] == healthy || v["dport"] == healthy)
            .collect();
        let after_handshake = events
            .iter()
            .filter(|v| v["tcp_flags"].as_u64().unwrap_or(0) & 2 == 0)
            .count();
        assert_eq!(after_handshake, 0, "{name}");
        if same_node {
            assert!(events.len() <= 3, "{name}: {} events", events.len());
        }
    }
}

/// A run of tests/tests/established_more.rs (routed node, nftables mode,
/// 6.18) in which the policy DROP rule went in before the client's delayed
/// ACK of its last echo: the client's ACKs and its next line are dropped
/// after FORWARD while the backend retransmits that echo, and each copy
/// reaches the client reverse-NATed. Before the fix this was decided `ok`
/// at every reopening (a drop the connection got over) and never
/// reported; the client's line was never echoed. Captured from the failing
/// run, not made by `cargo xtask fixtures`.
#[test]
fn a_policy_drop_with_the_backend_retransmitting_is_dropped_by_the_rule() {
    let text = include_str!(crate::fixture!(
        "established/policy_drop_acks_dropped_backend_retransmits.rec"
    ));
    let (reports, summary) = decide(text);
    let established: Vec<&FlowReport> = reports
        .iter()
        .filter(|r| r.phase == Phase::Established)
        .collect();
    assert_eq!(established.len(), 1, "{reports:#?}");
    let e = established[0];
    assert_eq!(e.client.port(), 41011, "{e:#?}");
    assert_eq!(e.verdict, Verdict::Dropped, "{e:#?}");
    assert_eq!(e.cause.as_ref().map(|c| c.id), Some(CauseId::DroppedByRule));
    assert!(
        e.detail.contains(
            "replies still reached the client, but nothing the client sent after it left the node"
        ),
        "{}",
        e.detail
    );
    // The twin on 41012, to the same backend, stays `ok`.
    assert_eq!(summary.by_verdict.ok, 2, "{summary:#?}");
    assert_eq!(summary.established_failures, 1);
}

/// The listen queue's overflow as the kernel showed it
/// (`tests/tests/established_more.rs`, iptables mode, recorded by `cargo
/// xtask fixtures`): a never-accepting listener with four connections
/// queued; of three opened next, one took the last place and the listener
/// reset the other two as their requests came, ~1 ms after the SYN-ACK.
/// Those two are `ok` openings, then `refused` / `listen_queue_overflow`,
/// phase established; every other flow (the queued ones, the one to the
/// other node's backend) is only `ok`; `analyze -v` says what the golden
/// says.
#[test]
fn the_listen_queue_overflow_recording() {
    const REC: &str = include_str!(crate::fixture!(
        "established/root_listen_queue_overflow_resets_after_the_handshake_iptables.rec"
    ));
    const GOLDEN: &str = include_str!(crate::fixture!(
        "established/root_listen_queue_overflow_resets_after_the_handshake_iptables.json"
    ));
    let (reports, summary) = decide(REC);
    let broken = established(&reports);
    assert_eq!(broken.len(), 2, "{reports:#?}");
    for b in &broken {
        assert_eq!(b.verdict, Verdict::Refused, "{b:#?}");
        assert_eq!(
            b.cause.as_ref().map(|c| c.id),
            Some(CauseId::ListenQueueOverflow),
            "{b:#?}"
        );
        assert!(
            reports.iter().any(|r| r.phase == Phase::Opening
                && r.client == b.client
                && r.verdict == Verdict::Ok),
            "{:?}'s opening is ok",
            b.client
        );
    }
    let openings: Vec<_> = reports
        .iter()
        .filter(|r| r.phase == Phase::Opening)
        .collect();
    assert_eq!(
        openings.len(),
        8,
        "4 queued, 1 took the last place, 2 reset, the twin"
    );
    assert!(
        openings.iter().all(|r| r.verdict == Verdict::Ok),
        "{openings:#?}"
    );
    assert_eq!(summary.established_failures, 2);
    let mut out = JsonOutput::new(Vec::new(), true);
    for r in &reports {
        out.flow(r).unwrap();
    }
    out.summary(&summary, 0).unwrap();
    let got = lines(&String::from_utf8(out.into_inner()).unwrap());
    let want: Vec<Value> = lines(GOLDEN)
        .into_iter()
        .filter(|v| v["kind"] != "start")
        .collect();
    assert_eq!(got, want);
}
