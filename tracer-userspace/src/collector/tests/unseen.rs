//! Flows whose opening nattrace did not see (issue 26 item 5): started
//! before tracing (first event older than every program's attachment) or
//! caught mid-way (first event a SYN-ACK, an RST, a mid-stream segment).
//! Never `no_reply` on absent evidence; positive evidence still decides.
use tracer_common::{PacketEvent, tcp_flags};

use super::run_with;
use crate::collector::{fixtures::*, *};

const MS: u64 = 1_000_000;

fn only(reports: &[FlowReport]) -> &FlowReport {
    assert_eq!(reports.len(), 1, "{reports:#?}");
    &reports[0]
}

/// The no_reply fixture's flow with its first transmission rewritten.
fn no_reply_with_first(flags: u8) -> Vec<PacketEvent> {
    let mut events = no_reply();
    let first_skb = events[0].skb;
    for e in events.iter_mut().filter(|e| e.skb == first_skb) {
        e.tcp_flags = flags;
    }
    // Only the rewritten packet: the SYN retransmits would open the flow
    // again, seen.
    events.retain(|e| e.skb == first_skb);
    events
}

#[test]
fn a_flow_seen_opening_after_attach_is_still_no_reply() {
    let events = no_reply();
    let cfg = CollectorConfig {
        traced_since_ns: events[0].ts_ns,
        ..config(Some(true))
    };
    let (reports, summary) = run_with(cfg, &events, T0 + 10_000 * MS);
    let r = only(&reports);
    assert_eq!(r.verdict, Verdict::NoReply, "{}", r.detail);
    assert!(r.opening_seen);
    assert_eq!(summary.by_verdict.no_reply, 1);
}

#[test]
fn a_syn_from_before_every_program_was_attached_is_unseen_not_no_reply() {
    let events = no_reply();
    let cfg = CollectorConfig {
        traced_since_ns: events[0].ts_ns + 1,
        ..config(Some(true))
    };
    let (reports, summary) = run_with(cfg, &events, T0 + 10_000 * MS);
    let r = only(&reports);
    assert_eq!(r.verdict, Verdict::Unseen, "{}", r.detail);
    assert!(!r.opening_seen);
    assert_eq!(summary.by_verdict.no_reply, 0);
    assert_eq!(summary.by_verdict.unseen, 1);
}

#[test]
fn a_flow_first_seen_at_an_rst_or_mid_stream_is_unseen_not_no_reply() {
    for flags in [
        tcp_flags::RST,
        tcp_flags::RST | tcp_flags::ACK,
        tcp_flags::ACK,
        tcp_flags::ACK | tcp_flags::PSH,
        tcp_flags::SYN | tcp_flags::ACK,
    ] {
        let (reports, _) = run_with(
            config(Some(true)),
            &no_reply_with_first(flags),
            T0 + 10_000 * MS,
        );
        for r in &reports {
            assert_ne!(
                r.verdict,
                Verdict::NoReply,
                "flags {flags:#x}: {}",
                r.detail
            );
            assert!(!r.opening_seen, "flags {flags:#x}");
        }
    }
}

#[test]
fn an_unseen_opening_still_gets_a_verdict_on_positive_evidence() {
    // Seed 000: the SYN-ACK reaches the client un-reverse-NATed.
    let events = seed000_same_node(false);
    let cfg = CollectorConfig {
        traced_since_ns: events.iter().map(|e| e.ts_ns).min().unwrap() + 1,
        ..config(Some(false))
    };
    let (reports, _) = run_with(cfg, &events, T0 + 10_000 * MS);
    let r = reports
        .iter()
        .find(|r| !r.opening_seen)
        .unwrap_or_else(|| panic!("{reports:#?}"));
    assert_eq!(r.verdict, Verdict::ReplyNotReverseNated, "{}", r.detail);
}
