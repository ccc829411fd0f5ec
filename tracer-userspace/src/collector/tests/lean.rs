//! `CollectorConfig::ok_report`: every recorded fixture decided whole and
//! lighter. Verdicts other than `ok` must be the same reports; an `ok` one
//! must agree on everything its outputs read (`OkReport::Counted`: the
//! summary, the metrics and the exit status; `OkReport::Line`: the text
//! line). And printed reports lend their vectors to later ones.
use crate::{
    collector::{CollectorConfig, FlowReport, OkReport, Verdict, testing::recordings},
    recording::{Reader, replay::replay},
};

fn decide(path: &std::path::Path, ok_report: OkReport) -> Vec<FlowReport> {
    let (mut reader, header) = Reader::open(path).unwrap();
    let config = CollectorConfig {
        ok_report,
        ..header.collector_config().unwrap()
    };
    let mut out = Vec::new();
    let Ok(_) = replay(config, &mut reader, None, |r| {
        out.append(r);
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

/// Every recorded fixture decided whole and as `kind`; `ok` reports are
/// handed to `ok` in pairs (whole, lighter), every other verdict must be
/// the same report. How many `ok` and other pairs there were.
fn each_fixture(
    kind: OkReport,
    mut ok: impl FnMut(&FlowReport, &FlowReport, &std::path::Path),
    mut fixture: impl FnMut(&[FlowReport], &[FlowReport], &std::path::Path),
) -> (usize, usize) {
    let files = recordings();
    assert!(files.len() > 10, "{files:?}");
    let (mut oks, mut others) = (0, 0);
    for f in &files {
        let whole = decide(f, OkReport::Whole);
        let light = decide(f, kind);
        assert_eq!(whole.len(), light.len(), "{}", f.display());
        for (w, l) in whole.iter().zip(&light) {
            if w.verdict == Verdict::Ok {
                oks += 1;
                ok(w, l, f);
            } else {
                others += 1;
                assert_eq!(w, l, "{}", f.display());
            }
        }
        fixture(&whole, &light, f);
    }
    (oks, others)
}

#[test]
fn lean_ok_reports_count_as_the_whole_ones() {
    let (ok, other) = each_fixture(
        OkReport::Counted,
        |w, l, f| {
            assert_eq!(counted(w), counted(l), "{}", f.display());
            assert!(l.packets.is_empty() && l.attempts.is_empty() && l.detail.is_empty());
            assert!(!w.packets.is_empty(), "{}", f.display());
        },
        |_, _, _| {},
    );
    assert!(ok > 10 && other > 10, "ok {ok}, other {other}");
}

/// `OkReport::Line` (text without `-v`, no pcapng): an `ok` report is the
/// whole one without its packets, any other the whole one, and the text
/// output prints the same from both, in either style.
#[test]
fn line_ok_reports_print_as_the_whole_ones() {
    use crate::output::text::{TextOutput, TextStyle};
    let text = |reports: &[FlowReport], wide: bool| {
        let style = TextStyle { color: false, wide };
        let mut out = TextOutput::new(Vec::new(), style, false);
        for r in reports {
            out.flow(r).unwrap();
        }
        String::from_utf8(out.into_inner()).unwrap()
    };
    let (ok, _) = each_fixture(
        OkReport::Line,
        |w, l, f| {
            assert!(l.packets.is_empty() && !w.packets.is_empty());
            let w = FlowReport {
                packets: Vec::new(),
                ..w.clone()
            };
            assert_eq!(&w, l, "{}", f.display());
        },
        |whole, line, f| {
            for wide in [false, true] {
                assert_eq!(text(whole, wide), text(line, wide), "{}", f.display());
            }
        },
    );
    assert!(ok > 10, "ok {ok}");
}

/// Reports the outputs leave to the collector (`Collector::recycle`) lend
/// their vectors to later ones: every recorded fixture decides the same
/// reports whether its printed reports were recycled or kept.
#[test]
fn recycled_reports_decide_as_fresh_ones() {
    let mut handed_back = 0;
    for f in &recordings() {
        for kind in [OkReport::Whole, OkReport::Line] {
            let kept = decide(f, kind);
            let (mut reader, header) = Reader::open(f).unwrap();
            let config = CollectorConfig {
                ok_report: kind,
                ..header.collector_config().unwrap()
            };
            let mut printed = Vec::new();
            let Ok(_) = replay(config, &mut reader, None, |r| {
                printed.extend(r.iter().cloned());
                handed_back += r.len();
                Ok::<_, std::convert::Infallible>(())
            });
            assert_eq!(kept, printed, "{}", f.display());
        }
    }
    // Most fixtures' reports come at the end (`finish`), which recycles
    // none: the test below makes every report reuse another's.
    assert!(handed_back > 50, "{handed_back}");
}

/// A healthy connection as the kernel reports it live, `shift` ns later
/// with its ISN moved by `isn` (the same client port, a new connection):
/// the SYN leaving the client, the SYN after DNAT, the SYN-ACK reaching
/// the client reverse-NATed (from `reply_from`), and with `ack` the
/// client's ACK leaving it.
fn healthy(
    shift: u64,
    isn: u32,
    reply_from: ([u8; 4], u16),
    ack: bool,
) -> Vec<tracer_common::PacketEvent> {
    use tracer_common::{
        direction::{REPLY, REQUEST},
        event_flags::{HOLDING, KEPT, VIA_NODE},
        nat_stage::AFTER,
        nf_hook::PRE_ROUTING,
        tcp_flags::{ACK, SYN},
    };

    use crate::collector::fixtures::*;
    let mut b = Builder::default();
    let syn = tcp(SYN, 1000 + isn, 0, 13831, 1 + u64::from(isn), REQUEST);
    let syn_hops = [
        (tx(CLIENT_NS, POD_ETH0), CLIENT, SVC),
        (nf(PRE_ROUTING, AFTER), CLIENT, BACKEND),
    ];
    b.path(syn, T0 + shift, &syn_hops);
    let syn_ack = tcp(SYN | ACK, 7000, 1001 + isn, 0, 2 + u64::from(isn), REPLY);
    let client_rx = [(rx(CLIENT_NS, POD_ETH0), reply_from, CLIENT)];
    b.path(syn_ack, T0 + shift + 140_000, &client_rx);
    // As the kernel marks them live: the held SYN, its event kept at the
    // NAT point, the reply that crossed the node muted.
    for (e, flags) in b.events.iter_mut().zip([HOLDING, KEPT, VIA_NODE]) {
        e.flags = flags;
    }
    if ack {
        let last = tcp(ACK, 1001 + isn, 7001, 13832, 3 + u64::from(isn), REQUEST);
        b.path(
            last,
            T0 + shift + 150_000,
            &[(tx(CLIENT_NS, POD_ETH0), CLIENT, SVC)],
        );
    }
    b.events
}

/// A healthy connection as the kernel reports it live (issue 25's three
/// events, from a connection-rate run of the bench). No event shows the
/// reply leaving the backend, yet the reverse NAT is the DNATed entry's:
/// the one attempt was answered. A flow whose reply came from the
/// backend's own address proves nothing of the kind.
#[test]
fn the_three_events_of_a_healthy_connection_answer_its_attempt() {
    use crate::collector::fixtures::{BACKEND, SVC};
    let decide = |reply_from| super::run(&healthy(0, 0, reply_from, false), Some(true)).0;

    let reports = decide(SVC);
    let r = &reports[0];
    assert_eq!(r.verdict, Verdict::Ok, "{r:#?}");
    assert_eq!(r.attempts.len(), 1, "{r:#?}");
    assert!(r.attempts[0].answered, "{r:#?}");
    assert_eq!(
        r.attempts[0].backend.map(|b| b.to_string()).as_deref(),
        Some("100.96.54.247:80")
    );

    let reports = decide(BACKEND);
    let r = &reports[0];
    assert_ne!(r.verdict, Verdict::Ok, "{r:#?}");
    assert_eq!(r.attempts.len(), 1, "{r:#?}");
}

/// Printed reports' vectors serve the next reports: an `ok` report of
/// three packets serves one of two (fewer), which serves a broken flow's
/// (more packets and hops than they hold); the broken one's are too large
/// to keep, and the next report is built afresh. Each report is the same
/// as when decided alone.
#[test]
fn a_printed_reports_vectors_serve_the_next_reports() {
    use crate::collector::{
        Collector,
        fixtures::SVC,
        testing::config,
        tests::{MS, fixture, later_connection, run_with},
    };
    let broken = later_connection(fixture("seed000_broken.jsonl"), 10_000 * MS);
    let flows = [
        healthy(0, 0, SVC, true),
        healthy(5_000 * MS, 10, SVC, false),
        broken,
        healthy(15_000 * MS, 20, SVC, false),
    ];
    let mut c = Collector::new(config(Some(true)));
    let (mut decided, mut kept) = (Vec::new(), Vec::new());
    for (i, events) in flows.iter().enumerate() {
        let until = events[0].ts_ns + 4_900 * MS;
        let (alone, _) = run_with(config(Some(true)), events, until);
        for ev in events {
            c.push(*ev);
        }
        let reports = c.tick(until);
        assert_eq!(reports, alone, "flow {i}");
        decided.push((reports[0].verdict, reports[0].packets.len()));
        c.recycle(reports);
        kept.push(c.spare_reports.len());
    }
    assert_eq!(
        decided,
        [
            (Verdict::Ok, 3),
            (Verdict::Ok, 2),
            (Verdict::ReplyNotReverseNated, 3),
            (Verdict::Ok, 2)
        ]
    );
    assert_eq!(kept, [1, 1, 0, 1]);
}

#[test]
fn the_outputs_decide_what_an_ok_report_carries() {
    // (hide_ok, pcap, text without hops)
    assert_eq!(OkReport::printed_by(false, false, false), OkReport::Whole);
    assert_eq!(OkReport::printed_by(false, false, true), OkReport::Line);
    assert_eq!(OkReport::printed_by(true, false, true), OkReport::Counted);
    assert_eq!(OkReport::printed_by(true, false, false), OkReport::Counted);
    assert_eq!(OkReport::printed_by(true, true, true), OkReport::Whole);
    assert_eq!(OkReport::printed_by(false, true, true), OkReport::Whole);
}
