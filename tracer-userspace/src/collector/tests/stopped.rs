//! Flows cut by the trace's end (issue 26, found on a fresh-clone CI run):
//! a request sent shortly before the stop, within the reply timeout, has
//! no reply yet because nattrace stopped waiting, not because none came.
//! Such a flow is `undecided`, never `no_reply`; positive evidence seen
//! before the stop still decides it, and a flow whose deadline had passed
//! is `no_reply` as ever.
use super::{fixture, only, run_with};
use crate::collector::{fixtures::*, *};

const MS: u64 = 1_000_000;

/// The no_reply fixture's first SYN only (sent at T0, to a remote backend).
fn first_syn() -> Vec<tracer_common::PacketEvent> {
    let mut events = fixture("no_reply.jsonl");
    events.truncate(8);
    assert!(events.iter().all(|e| e.ts_ns < T0 + MS));
    events
}

#[test]
fn a_request_without_reply_cut_by_the_stop_is_undecided() {
    let (reports, summary) = run_with(config(Some(true)), &first_syn(), T0 + 500 * MS);
    let r = only(&reports);
    assert_eq!(r.verdict, Verdict::Undecided, "{}", r.detail);
    assert_eq!(r.verdict.as_str(), "undecided");
    assert_eq!(
        r.detail,
        "SYN DNATed to 100.96.12.5:80 500 ms before tracing stopped, within the 3000 ms \
         reply timeout: no reply yet and no failure seen, cut by the stop"
    );
    assert_eq!(r.cause, None);
    assert!(!r.incomplete);
    assert_eq!(summary.by_verdict.undecided, 1);
    assert_eq!(summary.by_verdict.no_reply, 0);
    let json = serde_json::to_value(r).unwrap();
    assert_eq!(json["verdict"], "undecided");
    let json = serde_json::to_value(summary).unwrap();
    assert_eq!(json["by_verdict"]["undecided"], 1);
}

#[test]
fn a_request_whose_deadline_had_passed_at_the_stop_is_no_reply() {
    // 3 s reply timeout; the stop 3.2 s after the SYN (before the neighbour
    // wait ends: decided at the stop, its deadline passed).
    for stop in [3_000 * MS, 3_200 * MS, 10_000 * MS] {
        let (reports, summary) = run_with(config(Some(true)), &first_syn(), T0 + stop);
        let r = only(&reports);
        assert_eq!(r.verdict, Verdict::NoReply, "stop at +{stop}: {}", r.detail);
        assert_eq!(summary.by_verdict.undecided, 0);
        assert!(!summary_json_has_undecided(&summary));
    }
}

fn summary_json_has_undecided(s: &Summary) -> bool {
    serde_json::to_value(s).unwrap()["by_verdict"]
        .get("undecided")
        .is_some()
}

#[test]
fn a_drop_before_the_stop_still_decides_the_flow() {
    let events = fixture("reply_dropped.jsonl");
    let last = events.iter().map(|e| e.ts_ns).max().unwrap();
    assert!(last < T0 + 100 * MS);
    let (reports, _) = run_with(config(Some(true)), &events, last + MS);
    assert_eq!(only(&reports).verdict, Verdict::Dropped);
}

#[test]
fn a_reply_not_reverse_nated_before_the_stop_still_decides_the_flow() {
    let events = seed000_same_node(false);
    let last = events.iter().map(|e| e.ts_ns).max().unwrap();
    let (reports, _) = run_with(config(Some(false)), &events, last + MS);
    assert_eq!(only(&reports).verdict, Verdict::ReplyNotReverseNated);
}

#[test]
fn a_reply_on_its_way_to_the_client_at_the_stop_is_undecided() {
    // The SYN-ACK was reverse-NATed in the node; the stop came before it
    // reached the client's veth.
    let mut events = cross_node_ok();
    let at_client = events
        .iter()
        .position(|e| e.hook == tracer_common::hook::TC_EGRESS && e.ifindex == VETH_CLIENT)
        .unwrap();
    events.truncate(at_client);
    let last = events.iter().map(|e| e.ts_ns).max().unwrap();
    let (reports, summary) = run_with(config(Some(true)), &events, last + MS);
    let r = only(&reports);
    assert_eq!(r.verdict, Verdict::Undecided, "{}", r.detail);
    assert_eq!(summary.by_verdict.undecided, 1);
    // The whole flow stops as `ok`.
    let (reports, _) = run_with(config(Some(true)), &cross_node_ok(), last + MS);
    assert_eq!(only(&reports).verdict, Verdict::Ok);
}

#[test]
fn a_tick_never_decides_a_flow_undecided() {
    // Undecided is the stop's state only: the running trace waits.
    let mut c = Collector::new(config(Some(true)));
    for ev in first_syn() {
        c.push(ev);
    }
    assert!(c.tick(T0 + 500 * MS).is_empty());
    let mut reports = c.tick(T0 + 4_000 * MS);
    let (rest, _) = c.finish(T0 + 4_000 * MS);
    reports.extend(rest);
    assert_eq!(only(&reports).verdict, Verdict::NoReply);
}
