//! The watch of established flows (issue 21) from events: a recorded
//! healthy connection, then what the kernel's watch sends when it breaks
//! later (or, with every packet sent, what the collector sees itself).
use tracer_common::{PacketEvent, direction, event_flags, hook, nf_hook, tcp_flags};

use super::fixture;
use crate::collector::{fixtures::*, *};

const MS: u64 = 1_000_000;
const BACKEND: [u8; 4] = [100, 96, 54, 247];

/// The healthy fixture's reply as it reached the client's namespace.
fn client_reply(base: &[PacketEvent]) -> PacketEvent {
    *base
        .iter()
        .rev()
        .find(|e| {
            e.hook == hook::DEV_RX
                && e.direction == direction::REPLY
                && e.netns != NODE_NS
                && e.saddr == tracer_common::v4_mapped(SVC.0)
        })
        .expect("the fixture's reply at the client")
}

/// A later data packet of the same connection, `after` the opening.
fn later(template: &PacketEvent, after: u64, n: u32) -> PacketEvent {
    PacketEvent {
        ts_ns: template.ts_ns + after,
        skb: template.skb + 0x10_0000 + u64::from(n) * 0x100,
        seq: template.seq + 1 + n * 100,
        ip_id: 500 + n as u16,
        tcp_flags: tcp_flags::ACK | tcp_flags::PSH,
        payload_head: 0x6c696e65,
        ip_len: 140,
        ..*template
    }
}

/// The kernel's watch event for a later reply from the backend's address
/// at the client, after `good` replies it counted as fine.
fn unnated_watch(reply: &PacketEvent, after: u64, n: u32, good: u32) -> PacketEvent {
    PacketEvent {
        saddr: tracer_common::v4_mapped(BACKEND),
        flags: event_flags::WATCH,
        good,
        ..later(reply, after, n)
    }
}

fn decide(
    events: &[PacketEvent],
    sysctls: Option<crate::facts::Sysctls>,
) -> (Vec<FlowReport>, Summary) {
    let mut c = Collector::new(config(Some(true)));
    let mut out = Vec::new();
    let t0 = events[0].ts_ns;
    for ev in events {
        c.push(*ev);
    }
    // As the live session: a tick soon after the events, then the sysctls
    // read again before the next one.
    let last = events.iter().map(|e| e.ts_ns).max().unwrap_or(t0);
    out.extend(c.tick(last + 100 * MS));
    if c.take_sysctls_request()
        && let Some(s) = sysctls
    {
        c.update_sysctls(s);
    }
    out.extend(c.tick(t0 + 5_000 * MS));
    let (rest, summary) = c.finish(t0 + 10_000 * MS);
    out.extend(rest);
    (out, summary)
}

fn established(reports: &[FlowReport]) -> Vec<&FlowReport> {
    reports
        .iter()
        .filter(|r| r.phase == Phase::Established)
        .collect()
}

/// The kernel's watch event: a reply from the backend's address at the
/// client, 57 good replies before. Reported once, 1 s later, as
/// `reply_not_reverse_nated` mid-stream; the opening stays `ok`.
#[test]
fn a_watch_event_after_an_ok_opening_is_reported_mid_stream() {
    let mut events = fixture("seed000_healthy.jsonl");
    let reply = client_reply(&events);
    let bad = unnated_watch(&reply, 1_400 * MS, 0, 57);
    events.push(bad);
    let (reports, summary) = decide(&events, None);
    assert_eq!(reports.len(), 2, "{reports:#?}");
    assert_eq!(reports[0].verdict, Verdict::Ok);
    assert_eq!(reports[0].phase, Phase::Opening);
    let e = established(&reports);
    assert_eq!(e.len(), 1);
    let r = e[0];
    assert_eq!(r.verdict, Verdict::ReplyNotReverseNated, "{r:#?}");
    let info = r.established.expect("established info");
    assert_eq!(info.good_replies, 57);
    assert_eq!(info.failed_ts_ns, bad.ts_ns);
    assert!(
        r.detail
            .starts_with("mid-stream after 1.4 s and 57 good replies: "),
        "{}",
        r.detail
    );
    assert!(
        r.detail
            .contains("100.96.54.247:80 instead of 100.67.30.133:80"),
        "{}",
        r.detail
    );
    assert_eq!(r.decided_ts_ns, bad.ts_ns + WATCH_WAIT_NS);
    assert_eq!(summary.established_failures, 1);
    assert_eq!(summary.by_verdict.ok, 1);
    assert_eq!(summary.by_verdict.reply_not_reverse_nated, 1);
}

/// Replies read before the opening was decided (a busy node's batch held
/// the second and third exchanges too) are good replies: the kernel never
/// muted them, so its count at the failure is 0 (seen as a flaky
/// tests/tests/established_more.rs `root_udp_later_exchange_fails_*`).
#[test]
fn good_replies_read_before_the_ok_count_at_a_later_failure() {
    let mut events = fixture("seed000_healthy.jsonl");
    let reply = client_reply(&events);
    events.push(later(&reply, 10 * MS, 1));
    events.push(later(&reply, 20 * MS, 2));
    events.push(unnated_watch(&reply, 1_400 * MS, 3, 0));
    let (reports, _) = decide(&events, None);
    let e = established(&reports);
    assert_eq!(e.len(), 1, "{reports:#?}");
    let info = e[0].established.expect("established info");
    assert_eq!(info.good_replies, 2, "{:#?}", e[0]);
}

/// The client's RST to the backend (its answer to the un-NATed reply)
/// crossed the bridge without netfilter; the sysctls read again say
/// bridge-nf-call-iptables is now 0: the cause of the seed 000 opening,
/// mid-stream.
#[test]
fn bridge_nf_switched_off_mid_stream_is_named_from_the_sysctls_read_again() {
    let mut events = fixture("seed000_healthy.jsonl");
    let reply = client_reply(&events);
    let bad = unnated_watch(&reply, 1_400 * MS, 0, reply.good);
    events.push(bad);
    // The client's RST, client → backend, bridged from its port to the backend's.
    let rst = PacketEvent {
        direction: direction::REQUEST,
        saddr: bad.daddr,
        sport: bad.dport,
        daddr: bad.saddr,
        dport: bad.sport,
        seq: bad.ack,
        ack: 0,
        tcp_flags: tcp_flags::RST,
        ip_id: 0,
        ip_len: 40,
        payload_head: 0,
        flags: 0,
        good: 0,
        skb: bad.skb + 0x1000,
        ..bad
    };
    for (i, (h, netns, ifindex)) in [
        (hook::DEV_TX, bad.netns, bad.ifindex),
        (hook::TC_INGRESS, NODE_NS, VETH_CLIENT),
        (hook::TC_EGRESS, NODE_NS, VETH_BACKEND),
    ]
    .into_iter()
    .enumerate()
    {
        events.push(PacketEvent {
            ts_ns: bad.ts_ns + 30_000 + i as u64 * 3_000,
            hook: h,
            netns,
            ifindex,
            ..rst
        });
    }
    let off = crate::facts::Sysctls {
        bridge_nf_call_iptables: Some(false),
        ..Default::default()
    };
    let (reports, _) = decide(&events, Some(off));
    let e = established(&reports);
    assert_eq!(e.len(), 1, "{reports:#?}");
    assert_eq!(
        e[0].cause.as_ref().map(|c| c.id),
        Some(CauseId::BridgeNfCallIptablesOff),
        "{:#?}",
        e[0]
    );
    // Without the sysctls read again, the same evidence has the cause for
    // a bridge crossing although the sysctl was 1.
    let (reports, _) = decide(&events, None);
    assert_eq!(
        established(&reports)[0].cause.as_ref().map(|c| c.id),
        Some(CauseId::ReplyBridgedWithoutNetfilter)
    );
}

/// With every packet sent (no WATCH flag), a reply dropped by netfilter
/// after FORWARD mid-stream is seen by the collector itself: `dropped`,
/// `conntrack_invalid`. A drop a healthy socket has of its own
/// (TCP_OLD_DATA) reports nothing.
#[test]
fn drops_mid_stream_failure_or_a_healthy_sockets_own() {
    let base = fixture("seed000_healthy.jsonl");
    let reasons = DropReasons::default();
    let reply = client_reply(&base);
    let at_forward = |reason: &str, n: u32| {
        let mut p = later(&reply, 2_000 * MS, n);
        p.saddr = tracer_common::v4_mapped(BACKEND);
        let nf = PacketEvent {
            hook: hook::NETFILTER,
            nf_hook: nf_hook::FORWARD,
            netns: NODE_NS,
            ifindex: 0,
            ..p
        };
        let drop = PacketEvent {
            ts_ns: p.ts_ns + 3_000,
            hook: hook::DROP,
            netns: NODE_NS,
            ifindex: CNI0,
            drop_reason: reasons.code(reason).unwrap(),
            ..p
        };
        [nf, drop]
    };
    let mut benign = base.clone();
    benign.extend(at_forward("TCP_OLD_DATA", 0));
    let (reports, summary) = decide(&benign, None);
    assert!(established(&reports).is_empty(), "{reports:#?}");
    assert_eq!(summary.established_failures, 0);

    let mut failed = base.clone();
    failed.extend(at_forward("NETFILTER_DROP", 0));
    failed.extend(at_forward("NETFILTER_DROP", 1).map(|mut e| {
        e.ts_ns += 300 * MS;
        e
    }));
    let (reports, _) = decide(&failed, None);
    let e = established(&reports);
    assert_eq!(e.len(), 1, "{reports:#?}");
    assert_eq!(e[0].verdict, Verdict::Dropped, "{:#?}", e[0]);
    assert_eq!(
        e[0].cause.as_ref().map(|c| c.id),
        Some(CauseId::ConntrackInvalid),
        "{:#?}",
        e[0]
    );
}

/// A drop for a failure reason, then the retransmission's reply reaches
/// the client reverse-NATed within the wait: a lost packet the connection
/// got over; nothing is reported and the flow is watched on.
#[test]
fn a_drop_followed_by_a_good_reply_reports_nothing() {
    let mut events = fixture("seed000_healthy.jsonl");
    let reply = client_reply(&events);
    let mut drop = later(&reply, 1_400 * MS, 0);
    drop.saddr = tracer_common::v4_mapped(BACKEND);
    drop.hook = hook::DROP;
    drop.netns = NODE_NS;
    drop.ifindex = CNI0;
    drop.drop_reason = DropReasons::default().code("NETFILTER_DROP").unwrap();
    drop.flags = event_flags::WATCH;
    events.push(drop);
    // The kernel sends the flow per packet after a failure: the next reply
    // is seen reverse-NATed at the client.
    let good = later(&reply, 1_700 * MS, 1);
    events.push(PacketEvent {
        ts_ns: good.ts_ns - 10_000,
        hook: hook::TC_EGRESS,
        netns: NODE_NS,
        ifindex: VETH_CLIENT,
        ..good
    });
    events.push(good);
    let (reports, summary) = decide(&events, None);
    assert!(established(&reports).is_empty(), "{reports:#?}");
    assert_eq!(summary.by_verdict.ok, 1);
    assert_eq!(summary.established_failures, 0);
}

/// A request dropped in the node mid-stream while replies still reach the
/// client reverse-NATed (the backend retransmitting what the client
/// already had, its ACKs being what is dropped): `dropped`. The same drop
/// followed by a request leaving the node toward the backend is one the
/// connection got over: nothing reported.
#[test]
fn replies_at_the_client_clear_a_request_drop_only_once_a_request_leaves_the_node() {
    let base = fixture("seed000_healthy.jsonl");
    let reply = client_reply(&base);
    let egress = *base
        .iter()
        .find(|e| e.hook == hook::TC_EGRESS && e.direction == direction::REQUEST)
        .expect("the fixture's request leaving the node");
    let mut drop = later(&egress, 1_400 * MS, 0);
    drop.hook = hook::DROP;
    drop.ifindex = VETH_CLIENT;
    drop.drop_reason = DropReasons::default().code("NETFILTER_DROP").unwrap();
    drop.flags = event_flags::WATCH;
    let retransmitted = later(&reply, 1_600 * MS, 1);
    let run = |extra: &[PacketEvent]| {
        let mut events = base.clone();
        events.push(drop);
        events.extend_from_slice(extra);
        // Per packet after the failure: the reply's hop in the node too.
        events.push(PacketEvent {
            ts_ns: retransmitted.ts_ns - 10_000,
            hook: hook::TC_EGRESS,
            netns: NODE_NS,
            ifindex: VETH_CLIENT,
            ..retransmitted
        });
        events.push(retransmitted);
        events.sort_by_key(|e| e.ts_ns);
        decide(&events, None)
    };
    let (reports, summary) = run(&[]);
    let e = established(&reports);
    assert_eq!(e.len(), 1, "{reports:#?}");
    assert_eq!(e[0].verdict, Verdict::Dropped, "{:#?}", e[0]);
    assert!(
        e[0].detail.contains("replies still reached the client"),
        "{}",
        e[0].detail
    );
    assert_eq!(summary.established_failures, 1);

    let (reports, summary) = run(&[later(&egress, 1_500 * MS, 2)]);
    assert!(established(&reports).is_empty(), "{reports:#?}");
    assert_eq!(summary.established_failures, 0);
}

/// The sentence's head says how long the connection lived in the unit a
/// person reads at that length, and a connection that broke before any
/// reply says so instead of "0 good replies".
#[test]
fn the_mid_stream_prefix_reads_at_every_length() {
    for (after_ms, good_replies, head) in [
        (1400, 57, "mid-stream after 1.4 s and 57 good replies: "),
        (1000, 1, "mid-stream after 1.0 s and 1 good reply: "),
        (999, 2, "mid-stream after 999 ms and 2 good replies: "),
        (3, 0, "mid-stream after 3 ms, before any reply: "),
        (0, 0, "mid-stream within 1 ms, before any reply: "),
    ] {
        let e = Established {
            ok_ts_ns: 0,
            failed_ts_ns: 0,
            after_ms,
            good_replies,
        };
        assert_eq!(established::prefix(&e), head);
    }
}
