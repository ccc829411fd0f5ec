//! Which RSTs and drops of an `ok` flow are failures (issue 21): a bare RST
//! from the backend's side (its socket gone) is `backend_restarted`; an
//! endpoint's own abort (RST|ACK) and what follows it are not.
use tracer_common::{PacketEvent, direction, event_flags, hook, tcp_flags};

use super::fixture;
use crate::collector::{fixtures::*, *};

const MS: u64 = 1_000_000;
const BACKEND: [u8; 4] = [100, 96, 54, 247];
/// The backend pod's namespace in the fixture's kernel.
const BACKEND_NS: u32 = 4026532999;

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

/// A RST reply `after` the opening with `flags`, seen leaving the backend's
/// veth, crossing the node and reaching the client reverse-NATed.
fn rst_reply(reply: &PacketEvent, after: u64, flags: u8) -> Vec<PacketEvent> {
    let at_client = PacketEvent {
        ts_ns: reply.ts_ns + after,
        skb: reply.skb + 0x20_0000 + after / MS,
        seq: reply.seq + 5_000,
        ip_id: 0,
        tcp_flags: flags,
        payload_head: 0,
        ip_len: 40,
        ..*reply
    };
    let from_backend = PacketEvent {
        saddr: tracer_common::v4_mapped(BACKEND),
        ..at_client
    };
    vec![
        PacketEvent {
            ts_ns: at_client.ts_ns - 20_000,
            hook: hook::DEV_TX,
            netns: BACKEND_NS,
            ifindex: 2,
            ..from_backend
        },
        PacketEvent {
            ts_ns: at_client.ts_ns - 10_000,
            hook: hook::TC_INGRESS,
            netns: NODE_NS,
            ifindex: VETH_BACKEND,
            ..from_backend
        },
        at_client,
    ]
}

/// The client's segment dropped at the backend with NO_SOCKET, as the
/// kernel's watch sends it.
fn no_socket_drop(reply: &PacketEvent, after: u64) -> PacketEvent {
    PacketEvent {
        ts_ns: reply.ts_ns + after,
        skb: reply.skb + 0x30_0000,
        direction: direction::REQUEST,
        saddr: reply.daddr,
        sport: reply.dport,
        daddr: tracer_common::v4_mapped(BACKEND),
        dport: reply.sport,
        seq: reply.ack,
        ack: reply.seq + 5_000,
        tcp_flags: tcp_flags::ACK | tcp_flags::PSH,
        hook: hook::DROP,
        netns: BACKEND_NS,
        ifindex: 2,
        drop_reason: DropReasons::default().code("NO_SOCKET").unwrap(),
        flags: event_flags::WATCH,
        good: 12,
        ..*reply
    }
}

fn decide(events: &[PacketEvent]) -> (Vec<FlowReport>, Summary) {
    let mut c = Collector::new(config(Some(true)));
    let mut out = Vec::new();
    let t0 = events[0].ts_ns;
    let mut sorted = events.to_vec();
    sorted.sort_by_key(|e| e.ts_ns);
    for ev in &sorted {
        c.push(*ev);
    }
    let last = sorted.iter().map(|e| e.ts_ns).max().unwrap_or(t0);
    out.extend(c.tick(last + 100 * MS));
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

/// A bare RST (no ACK) from the backend's side reaching the client of an
/// `ok` flow: `refused`, `backend_restarted`, phase established; with the
/// NO_SOCKET drop before it (no listener left) the detail names the drop.
#[test]
fn a_bare_rst_from_the_backend_mid_stream_is_backend_restarted() {
    for with_drop in [false, true] {
        let mut events = fixture("seed000_healthy.jsonl");
        let reply = client_reply(&events);
        if with_drop {
            events.push(no_socket_drop(&reply, 1_200 * MS));
        }
        events.extend(rst_reply(&reply, 1_200 * MS + 50_000, tcp_flags::RST));
        let (reports, summary) = decide(&events);
        let e = established(&reports);
        assert_eq!(e.len(), 1, "{reports:#?}");
        assert_eq!(e[0].verdict, Verdict::Refused, "{:#?}", e[0]);
        assert_eq!(
            e[0].cause.as_ref().map(|c| c.id),
            Some(CauseId::BackendRestarted),
            "{:#?}",
            e[0]
        );
        let text = &e[0].cause.as_ref().expect("a cause").text;
        assert_eq!(text.contains("NO_SOCKET"), with_drop, "{text}");
        assert!(e[0].detail.starts_with("mid-stream "), "{}", e[0].detail);
        assert_eq!(summary.established_failures, 1);
    }
}

/// The same bare RST after the backend's own FIN (the kernel flags it
/// AFTER_FIN): the backend's application had closed the connection and its
/// kernel reset the client's later data (net/ipv4/tcp_input.c
/// tcp_rcv_state_process, TCP_ABORT_ON_DATA) — `backend_closed`: the
/// socket was closed, not lost; still `refused`, the client got a reset.
#[test]
fn a_bare_rst_after_the_backends_fin_is_backend_closed() {
    let mut events = fixture("seed000_healthy.jsonl");
    let reply = client_reply(&events);
    let mut rst = rst_reply(&reply, 1_200 * MS, tcp_flags::RST);
    for e in &mut rst {
        e.flags |= tracer_common::event_flags::AFTER_FIN;
    }
    events.extend(rst);
    let (reports, summary) = decide(&events);
    let e = established(&reports);
    assert_eq!(e.len(), 1, "{reports:#?}");
    assert_eq!(e[0].verdict, Verdict::Refused, "{:#?}", e[0]);
    let cause = e[0].cause.as_ref().expect("a cause");
    assert_eq!(cause.id, CauseId::BackendClosed, "{cause:#?}");
    assert!(
        cause.text.contains("closed the connection (its FIN"),
        "{}",
        cause.text
    );
    assert!(cause.text.contains("process exited"), "{}", cause.text);
    assert!(
        e[0].detail.contains("the connection was reset"),
        "{}",
        e[0].detail
    );
    assert_eq!(summary.established_failures, 1);
}

/// An endpoint's own abort (RST|ACK, SO_LINGER 0) is a close, not a
/// failure; the client's segment that was on its way meets the closed
/// socket (NO_SOCKET, sent by the watch) and gets a bare RST back — the
/// abort's aftermath, not reported either. A normal close (FIN) costs
/// nothing to judge.
#[test]
fn an_abort_and_its_aftermath_are_no_failure() {
    let mut events = fixture("seed000_healthy.jsonl");
    let reply = client_reply(&events);
    events.extend(rst_reply(
        &reply,
        1_000 * MS,
        tcp_flags::RST | tcp_flags::ACK,
    ));
    events.push(no_socket_drop(&reply, 1_000 * MS + 200_000));
    events.extend(rst_reply(&reply, 1_000 * MS + 300_000, tcp_flags::RST));
    assert_ok_only(&events);
}

/// The one flow of `events` is `ok`, and nothing is reported after.
fn assert_ok_only(events: &[PacketEvent]) {
    let (reports, summary) = decide(events);
    assert!(established(&reports).is_empty(), "{reports:#?}");
    assert_eq!(summary.established_failures, 0);
    assert_eq!(summary.by_verdict.ok, 1);
}

/// A RST|ACK that was dropped (the backend's own reset lost on its way)
/// closed nothing for the client: the bare RST that follows is a failure.
#[test]
fn a_dropped_abort_does_not_excuse_what_follows() {
    let mut events = fixture("seed000_healthy.jsonl");
    let reply = client_reply(&events);
    let mut lost = rst_reply(&reply, 900 * MS, tcp_flags::RST | tcp_flags::ACK)[0];
    lost.hook = hook::DROP;
    lost.ifindex = 0;
    lost.drop_reason = DropReasons::default().code("NETFILTER_DROP").unwrap();
    events.push(lost);
    events.extend(rst_reply(&reply, 1_200 * MS, tcp_flags::RST));
    let (reports, _) = decide(&events);
    let e = established(&reports);
    assert_eq!(e.len(), 1, "{reports:#?}");
    assert_eq!(
        e[0].cause.as_ref().map(|c| c.id),
        Some(CauseId::BackendRestarted)
    );
}

/// A netfilter drop after FORWARD mid-stream: with a DROP rule of the
/// filter table that matches the dropped packet it is that rule's
/// (`dropped_by_rule`, named as written); with only kube-proxy's INVALID
/// rule it stays `conntrack_invalid`.
#[test]
fn a_netfilter_drop_mid_stream_is_named_after_the_rule_that_matches_it() {
    use crate::ruleset::firewall::parse_filter_drops;
    let base = fixture("seed000_healthy.jsonl");
    let reasons = DropReasons::default();
    let reply = client_reply(&base);
    let mut events = base.clone();
    for n in 0..2u32 {
        let p = PacketEvent {
            ts_ns: reply.ts_ns + 2_000 * MS + u64::from(n) * 300 * MS,
            skb: reply.skb + 0x40_0000 + u64::from(n) * 0x100,
            seq: reply.seq + 1 + n * 100,
            ip_id: 600 + n as u16,
            tcp_flags: tcp_flags::ACK | tcp_flags::PSH,
            saddr: tracer_common::v4_mapped(BACKEND),
            ..reply
        };
        events.push(PacketEvent {
            hook: hook::NETFILTER,
            nf_hook: tracer_common::nf_hook::FORWARD,
            netns: NODE_NS,
            ifindex: 0,
            ..p
        });
        events.push(PacketEvent {
            ts_ns: p.ts_ns + 3_000,
            hook: hook::DROP,
            netns: NODE_NS,
            ifindex: CNI0,
            drop_reason: reasons.code("NETFILTER_DROP").unwrap(),
            ..p
        });
    }
    let decide_with = |rules: &[&str]| {
        let mut cfg = config(Some(true));
        cfg.kube_proxy.filter_drops = parse_filter_drops(rules);
        let mut c = Collector::new(cfg);
        for ev in &events {
            c.push(*ev);
        }
        let t0 = events[0].ts_ns;
        let mut out = c.tick(t0 + 5_000 * MS);
        out.extend(c.finish(t0 + 10_000 * MS).0);
        out.into_iter()
            .filter(|r| r.phase == Phase::Established)
            .collect::<Vec<_>>()
    };
    let invalid = "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP";
    let policy = "-A KUBE-NWPLCY-web -s 100.96.54.247/32 -p tcp -m tcp --sport 80 -j DROP";
    let e = decide_with(&[invalid, policy]);
    assert_eq!(e.len(), 1, "{e:#?}");
    let cause = e[0].cause.as_ref().expect("a cause");
    assert_eq!(cause.id, CauseId::DroppedByRule, "{:#?}", e[0]);
    assert!(
        cause.text.contains(&format!("`{policy}`")),
        "{}",
        cause.text
    );
    let e = decide_with(&[invalid]);
    let cause = e[0].cause.as_ref().expect("a cause");
    assert_eq!(cause.id, CauseId::ConntrackInvalid, "{:#?}", e[0]);
    assert!(
        cause
            .text
            .contains(&format!("the node's `{invalid}` (chain KUBE-FORWARD)")),
        "kube-proxy's INVALID rule named as written: {}",
        cause.text
    );
    let e = decide_with(&[]);
    let text = &e[0].cause.as_ref().expect("a cause").text;
    assert!(text.contains("ct state invalid drop"), "{text}");
}

/// A bare RST from the backend's side 1 ms after the SYN-ACK reached the
/// client, while the opening still settles: a listener with a full accept
/// queue resetting the client's first segment. It was taken as the
/// opening's evidence and the flow reported `ok`; now the opening is `ok`
/// and the reset is the established connection's failure,
/// `listen_queue_overflow`. The same reset 3 s later, nothing answered
/// in between (a connection idle since its opening), stays
/// `backend_restarted`.
#[test]
fn a_bare_rst_right_after_the_handshake_is_listen_queue_overflow() {
    for (after, cause) in [
        (MS, CauseId::ListenQueueOverflow),
        (3_000 * MS, CauseId::BackendRestarted),
    ] {
        let mut events = fixture("seed000_healthy.jsonl");
        let reply = client_reply(&events);
        events.extend(rst_reply(&reply, after, tcp_flags::RST));
        let (reports, summary) = decide(&events);
        let e = established(&reports);
        assert_eq!(e.len(), 1, "after {after} ns: {reports:#?}");
        assert_eq!(e[0].verdict, Verdict::Refused, "{:#?}", e[0]);
        assert_eq!(
            e[0].cause.as_ref().map(|c| c.id),
            Some(cause),
            "{:#?}",
            e[0]
        );
        let openings: Vec<_> = reports
            .iter()
            .filter(|r| r.phase == Phase::Opening)
            .collect();
        assert_eq!(openings.len(), 1, "{reports:#?}");
        assert_eq!(openings[0].verdict, Verdict::Ok, "{:#?}", openings[0]);
        assert_eq!(summary.established_failures, 1);
    }
}

/// An endpoint's abort (RST|ACK) 1 ms after the opening, and the bare RST
/// its aftermath brings: a close, no failure, as later in the connection.
#[test]
fn an_abort_right_after_the_handshake_is_no_failure() {
    let mut events = fixture("seed000_healthy.jsonl");
    let reply = client_reply(&events);
    events.extend(rst_reply(&reply, MS, tcp_flags::RST | tcp_flags::ACK));
    events.extend(rst_reply(&reply, MS + 300_000, tcp_flags::RST));
    let (reports, summary) = decide(&events);
    assert!(established(&reports).is_empty(), "{reports:#?}");
    assert_eq!(summary.established_failures, 0);
    assert_eq!(summary.by_verdict.ok, 1);
}

/// An ICMP error about an `ok` flow fails the watch before the drop that
/// would too (neigh_invalidate reports each queued packet's error, then
/// frees it): the flow must ask for kube-proxy's rules and its conntrack
/// entry as a drop does, or a stale entry is judged on the rules of before
/// and left without a cause (a flake of tests/tests/established_more.rs's
/// stale TCP entry in nftables mode).
#[test]
fn an_icmp_error_mid_stream_asks_for_the_rules_and_the_entry() {
    let mut events = fixture("seed000_healthy.jsonl");
    events.sort_by_key(|e| e.ts_ns);
    let reply = client_reply(&events);
    let last = events.last().map_or(0, |e| e.ts_ns);
    let mut c = Collector::new(config(Some(true)));
    for ev in &events {
        c.push(*ev);
    }
    let reports = c.tick(last + 100 * MS);
    assert!(
        reports.iter().any(|r| r.verdict == Verdict::Ok),
        "{reports:#?}"
    );
    let _ = (c.take_rules_request(), c.take_ct_lookups());
    let error = PacketEvent {
        ts_ns: last + 2_000 * MS,
        skb: reply.skb + 0x40_0000,
        direction: direction::REQUEST,
        saddr: reply.daddr,
        sport: reply.dport,
        daddr: reply.saddr,
        dport: reply.sport,
        seq: reply.ack,
        ack: reply.seq + 1,
        tcp_flags: tcp_flags::ACK | tcp_flags::PSH,
        hook: hook::DEV_RX,
        icmp_type: 3,
        icmp_code: 1,
        ..reply
    };
    c.push(error);
    let _ = c.tick(error.ts_ns + 100 * MS);
    assert!(c.take_rules_request(), "the rules are read again");
    assert_eq!(
        c.take_ct_lookups().len(),
        1,
        "the flow's entry is looked up"
    );
}

/// The client's first segment after the handshake dropped at the backend
/// with TCP_LISTEN_OVERFLOW (the listener's accept queue full,
/// `tcp_abort_on_overflow=0`), and its retransmission the same way after
/// it was received: `dropped`, `listen_queue_overflow`.
#[test]
fn a_listen_overflow_drop_is_listen_queue_overflow() {
    let mut events = fixture("seed000_healthy.jsonl");
    let reply = client_reply(&events);
    let mut drop = no_socket_drop(&reply, 200 * MS);
    drop.drop_reason = DropReasons::default()
        .code("TCP_LISTEN_OVERFLOW")
        .expect("a reason of the built-in table");
    drop.good = 0;
    events.push(drop);
    // Its retransmission, no longer muted: sent by the node to the
    // backend's veth, received by the backend's eth0, dropped the same way.
    let again = PacketEvent {
        ts_ns: drop.ts_ns + 400 * MS,
        skb: drop.skb + 1,
        flags: 0,
        ..drop
    };
    events.push(PacketEvent {
        hook: hook::DEV_TX,
        netns: NODE_NS,
        ifindex: VETH_BACKEND,
        drop_reason: 0,
        ts_ns: again.ts_ns - 20_000,
        ..again
    });
    events.push(PacketEvent {
        hook: hook::DEV_RX,
        drop_reason: 0,
        ts_ns: again.ts_ns - 10_000,
        ..again
    });
    events.push(again);
    let (reports, _) = decide(&events);
    let e = established(&reports);
    assert_eq!(e.len(), 1, "{reports:#?}");
    assert_eq!(e[0].verdict, Verdict::Dropped, "{:#?}", e[0]);
    assert_eq!(
        e[0].cause.as_ref().map(|c| c.id),
        Some(CauseId::ListenQueueOverflow),
        "{:#?}",
        e[0]
    );
}

/// A SYN received in the backend's namespace and never answered, nothing
/// dropped (a listener whose accept queue is full drops a SYN without a
/// drop event): `no_reply`, `listen_queue_overflow` — it was
/// `no_reply_through_node`, which needs a reply that went another way.
#[test]
fn an_unanswered_syn_at_the_backend_is_listen_queue_overflow() {
    let events: Vec<PacketEvent> = fixture("seed000_healthy.jsonl")
        .into_iter()
        .filter(|e| e.tcp_flags == tcp_flags::SYN)
        .collect();
    let (reports, _) = decide(&events);
    assert_eq!(reports.len(), 1, "{reports:#?}");
    assert_eq!(reports[0].verdict, Verdict::NoReply, "{:#?}", reports[0]);
    assert_eq!(
        reports[0].cause.as_ref().map(|c| c.id),
        Some(CauseId::ListenQueueOverflow),
        "{:#?}",
        reports[0]
    );
}

/// A FIN|ACK of the fixture's connection `after` its opening: the
/// backend's at the client (reverse-NATed), or the client's leaving it.
fn fin(base: &[PacketEvent], dir: u8, after: u64) -> PacketEvent {
    let reply = client_reply(base);
    let template = if dir == direction::REPLY {
        reply
    } else {
        *base
            .iter()
            .find(|e| e.direction == direction::REQUEST && e.hook == hook::DEV_TX)
            .expect("the fixture's request leaving the client")
    };
    PacketEvent {
        ts_ns: reply.ts_ns + after,
        skb: template.skb + 0x40_0000 + after / MS,
        tcp_flags: tcp_flags::FIN | tcp_flags::ACK,
        payload_head: 0,
        ip_len: 52,
        flags: 0,
        ..template
    }
}

/// The close's last ACK, repeated (a retransmitted FIN answered again from
/// TIME_WAIT), reaching the client after its socket was freed: dropped
/// there with NO_SOCKET, sent per packet (`-v`); then the client's bare RST
/// for it, dropped at the backend's TIME_WAIT socket (NOT_SPECIFIED).
fn late_ack_at_the_client(base: &[PacketEvent], after: u64) -> Vec<PacketEvent> {
    let reply = client_reply(base);
    let ack = PacketEvent {
        ts_ns: reply.ts_ns + after,
        skb: reply.skb + 0x50_0000,
        tcp_flags: tcp_flags::ACK,
        payload_head: 0,
        ip_len: 52,
        hook: hook::DROP,
        ifindex: 2,
        drop_reason: DropReasons::default().code("NO_SOCKET").unwrap(),
        flags: 0,
        ..reply
    };
    // The client's segment at the backend, made a bare RST and dropped
    // there as a TIME_WAIT socket's end, sent per packet.
    let rst = PacketEvent {
        skb: ack.skb + 1,
        ack: 0,
        tcp_flags: tcp_flags::RST,
        drop_reason: DropReasons::default().code("NOT_SPECIFIED").unwrap(),
        flags: 0,
        good: 0,
        ..no_socket_drop(&reply, after + 100_000)
    };
    vec![ack, rst]
}

/// Both sides closed (each FIN seen, per packet), then the close's last
/// ACK came twice: at the client, NO_SOCKET and its bare RST (the server
/// closed first); at the backend's side, its bare RST reaching the client
/// (the client closed first). Found beside stress-ng in CI and reproduced
/// in tests/tests/established_more.rs with the late ACK held in the pod:
/// the close's aftermath, no failure. The kernel's watch counts the same
/// for a muted flow (tracer-ebpf/src/watch.rs `closing`).
#[test]
fn a_late_ack_after_both_fins_is_no_failure() {
    for server_first in [true, false] {
        let mut events = fixture("seed000_healthy.jsonl");
        let (first, second) = if server_first {
            (direction::REPLY, direction::REQUEST)
        } else {
            (direction::REQUEST, direction::REPLY)
        };
        events.push(fin(&events, first, 500 * MS));
        events.push(fin(&events, second, 510 * MS));
        if server_first {
            events.extend(late_ack_at_the_client(&events, 800 * MS));
        } else {
            events.extend(rst_reply(&client_reply(&events), 800 * MS, tcp_flags::RST));
        }
        assert_ok_only(&events);
    }
}

/// The same late segments with only the backend's FIN before them: the
/// client had not closed, so its socket gone (NO_SOCKET) is a failure, as
/// is data dropped by a rule after both FINs (a client that shut down its
/// writing still waits for the answer).
#[test]
fn without_both_fins_or_for_data_the_drop_is_still_a_failure() {
    let mut events = fixture("seed000_healthy.jsonl");
    events.push(fin(&events, direction::REPLY, 500 * MS));
    events.extend(late_ack_at_the_client(&events, 800 * MS));
    let (reports, summary) = decide(&events);
    assert_eq!(established(&reports).len(), 1, "{reports:#?}");
    assert_eq!(summary.established_failures, 1);

    let mut events = fixture("seed000_healthy.jsonl");
    events.push(fin(&events, direction::REQUEST, 500 * MS));
    events.push(fin(&events, direction::REPLY, 510 * MS));
    let mut data = late_ack_at_the_client(&events, 800 * MS)[0];
    data.tcp_flags = tcp_flags::ACK | tcp_flags::PSH;
    data.ip_len = 552;
    data.drop_reason = DropReasons::default().code("NETFILTER_DROP").unwrap();
    events.push(data);
    let (reports, summary) = decide(&events);
    let e = established(&reports);
    assert_eq!(e.len(), 1, "{reports:#?}");
    assert_ne!(e[0].verdict, Verdict::Ok, "{:#?}", e[0]);
    assert_eq!(summary.established_failures, 1);
}
