use std::io::{BufReader, Cursor};

use proptest::prelude::*;

use super::*;
use crate::collector::{Collector, fixtures};

fn header() -> Header {
    Header {
        format: FORMAT.into(),
        version: VERSION,
        nattrace_version: "test".into(),
        kernel: "6.18".into(),
        backend: "netfilter".into(),
        backend_reason: String::new(),
        services: fixtures::services()
            .iter()
            .map(ToString::to_string)
            .collect(),
        facts: fixtures::facts(Some(false)),
        reply_timeout_ms: 3000,
        drop_reasons: Vec::new(),
        clock: Some(Clock {
            monotonic_ns: 1,
            realtime_ns: 1_700_000_000_000_000_000,
        }),
        skipped: Vec::new(),
        kube_proxy: Default::default(),
        checks: serde_json::Value::Null,
        checks_line: None,
        nf_priorities: Vec::new(),
        node: None,
        all_services: false,
        max_flows: None,
        run_id: None,
        file_seq: None,
        traced_since_ns: None,
    }
}

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("nattrace-rec-{}-{name}", std::process::id()))
}

/// Records the seed-000 fixture like a live session would (events, a stats
/// line, end) and returns the file's bytes.
fn record(limit: Option<u64>) -> (Vec<u8>, Option<String>) {
    // Tests run in parallel: one file each.
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = temp(&format!("rec-{limit:?}-{n}"));
    let mut w = RecordingWriter::create(&path, &header(), limit).unwrap();
    let events = fixtures::seed000_same_node(false);
    let last = events.iter().map(|e| e.ts_ns).max().unwrap();
    for ev in &events {
        w.event(ev);
    }
    w.stats(StatsLine {
        now_ns: last + 1,
        ..Default::default()
    });
    w.end(StatsLine {
        now_ns: fixtures::T0 + 10_000_000_000,
        ..Default::default()
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    assert!(w.drain(deadline, std::time::Duration::from_secs(10)));
    let warning = w.take_warning();
    let bytes = std::fs::read(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    (bytes, warning)
}

fn decide(bytes: &[u8]) -> (Vec<crate::collector::FlowReport>, Option<ReadProblem>) {
    let (mut reader, header) = Reader::new(BufReader::new(Cursor::new(bytes))).unwrap();
    let (out, _) = super::replay::decide_all(&mut reader, &header, None);
    (out, reader.problem().cloned())
}

#[test]
fn a_recording_decides_like_the_events_it_holds() {
    let (bytes, warning) = record(None);
    assert_eq!(warning, None);
    let text = String::from_utf8(bytes.clone()).unwrap();
    assert!(text.starts_with("{\"kind\":\"header\""));
    assert!(
        text.contains("\"saddr\":\"100.96.54.240\""),
        "greppable addresses"
    );
    let (reports, problem) = decide(&bytes);
    assert_eq!(problem, None);
    let mut direct = Collector::new(header().collector_config().unwrap());
    for ev in fixtures::seed000_same_node(false) {
        direct.push(ev);
    }
    let (expected, _) = direct.finish(fixtures::T0 + 10_000_000_000);
    assert_eq!(reports, expected);
    assert_eq!(
        reports[0].verdict,
        crate::collector::Verdict::ReplyNotReverseNated
    );
}

#[test]
fn events_round_trip_exactly() {
    for ev in fixtures::seed000_same_node(false) {
        let line = serde_json::to_string(&Line::Event(ev)).unwrap();
        let Line::Event(back) = serde_json::from_str(&line).unwrap() else {
            panic!("{line}");
        };
        assert_eq!(back, ev);
    }
}

#[test]
fn a_cut_file_reads_up_to_the_cut_and_says_so() {
    let (bytes, _) = record(None);
    let header_len = bytes.iter().position(|&b| b == b'\n').unwrap() + 1;
    for cut in (header_len..bytes.len() - 1).step_by(37) {
        let (_, problem) = decide(&bytes[..cut]);
        assert!(problem.is_some(), "cut at {cut} must be reported");
    }
}

#[test]
fn the_size_cap_stops_recording_with_a_warning() {
    let (bytes, warning) = record(Some(4096));
    assert!(warning.unwrap().contains("--write-max-mb"));
    assert!(bytes.len() <= 4096 + 64);
    let text = String::from_utf8(bytes).unwrap();
    assert!(text.trim_end().ends_with("}"));
    assert!(text.lines().last().unwrap().contains("\"capped\""));
}

#[test]
fn unknown_kinds_from_newer_versions_are_skipped() {
    let (bytes, _) = record(None);
    let mut text = String::from_utf8(bytes).unwrap();
    let at = text.find('\n').unwrap() + 1;
    text.insert_str(at, "{\"kind\":\"future_thing\",\"x\":1}\n");
    let (reports, problem) = decide(text.as_bytes());
    assert_eq!(problem, None);
    assert_eq!(reports.len(), 1);
}

#[test]
fn not_a_recording_is_refused_in_one_line() {
    for input in [
        "",
        "hello\n",
        "{\"kind\":\"event\"}\n",
        "{\"kind\":\"header\"}",
    ] {
        let err = Reader::new(BufReader::new(Cursor::new(input.as_bytes())))
            .err()
            .unwrap();
        assert!(!err.contains('\n'), "{err}");
    }
}

/// Lines a crafted or corrupt recording may hold: valid records with
/// extreme values, near-misses, and junk.
fn line_strategy() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<(u64, u64, u32, u32, u8, u8, u8, u8, u8, u32)>().prop_map(
            |(ts, skb, netns, ifindex, hook, nf, stage, proto, flags, reason)| {
                format!(
                    "{{\"kind\":\"event\",\"ts_ns\":{ts},\"skb\":{skb},\"netns\":{netns},\"ifindex\":{ifindex},\
                     \"saddr\":\"100.96.54.240\",\"daddr\":\"100.67.30.133\",\"sport\":43534,\"dport\":80,\
                     \"seq\":{reason},\"ack\":0,\"drop_reason\":{reason},\"payload_head\":0,\"ip_len\":60,\
                     \"ip_id\":1,\"hook\":{hook},\"nf_hook\":{nf},\"nat_stage\":{stage},\"proto\":{proto},\
                     \"tcp_flags\":{flags},\"direction\":1,\"svc\":0}}"
                )
            }
        ),
        (0u64..(1 << 40), any::<u64>())
            .prop_map(|(t, l)| format!("{{\"kind\":\"stats\",\"now_ns\":{t},\"lost_events\":{l}}}")),
        any::<u64>().prop_map(|t| format!("{{\"kind\":\"end\",\"now_ns\":{t},\"lost_events\":0}}")),
        "[ -~]{0,80}",
        proptest::collection::vec(any::<u8>(), 0..120)
            .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
        Just("{\"kind\":\"capped\",\"bytes\":1}".to_owned()),
        Just("{\"kind\":".to_owned()),
    ]
}

proptest! {
    // Bounded so the normal `cargo test` stays fast; raise with PROPTEST_CASES.
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
        let mut input = serde_json::to_vec(&Line::Header(Box::new(header()))).unwrap();
        input.push(b'\n');
        input.extend_from_slice(&bytes);
        let _ = decide(&input);
        // And without a header in front.
        let _ = Reader::new(BufReader::new(Cursor::new(&bytes[..]))).map(|(r, _)| r.count());
    }

    #[test]
    fn arbitrary_lines_never_panic(lines in proptest::collection::vec(line_strategy(), 0..64)) {
        let mut input = serde_json::to_string(&Line::Header(Box::new(header()))).unwrap();
        for l in &lines {
            input.push('\n');
            input.push_str(l);
        }
        let _ = decide(input.as_bytes());
    }
}

#[test]
fn an_overlong_line_is_skipped_without_buffering_it_all() {
    let (bytes, _) = record(None);
    let at = bytes.iter().position(|&b| b == b'\n').unwrap() + 1;
    let mut input = bytes[..at].to_vec();
    input.extend(std::iter::repeat_n(b'x', MAX_LINE_BYTES + 10));
    input.push(b'\n');
    input.extend_from_slice(&bytes[at..]);
    let (reader, reports) = read_all(&input);
    assert_eq!(reader.skipped_lines, 1);
    assert!(
        reader
            .first_skipped
            .as_ref()
            .unwrap()
            .why
            .contains("longer")
    );
    assert_eq!(reader.problem(), None, "the end record was still read");
    assert_eq!(reports.len(), 1);
}

type SliceReader<'a> = Reader<BufReader<Cursor<&'a [u8]>>>;

/// Reads `input` to the end; the reader (for its counters) and the flows.
fn read_all(input: &[u8]) -> (SliceReader<'_>, Vec<crate::collector::FlowReport>) {
    let (mut reader, header) = Reader::new(BufReader::new(Cursor::new(input))).unwrap();
    let (out, _) = super::replay::decide_all(&mut reader, &header, None);
    (reader, out)
}

#[test]
fn a_block_of_nul_bytes_mid_file_is_skipped_and_reading_goes_on() {
    let (bytes, _) = record(None);
    let text = String::from_utf8(bytes.clone()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.len() > 6, "{}", lines.len());
    // What a crash leaves: the middle of a line through the middle of the
    // next one zeroed, in place (the file keeps its length).
    let start = text.find(lines[3]).unwrap() + 10;
    let end = text.find(lines[5]).unwrap() + 7;
    let mut corrupt = bytes.clone();
    corrupt[start..end].fill(0);
    let (reader, reports) = read_all(&corrupt);
    assert_eq!(reader.problem(), None, "read to the end record");
    // The newlines between are zeroed too: lines[3..=5] are one line now.
    assert_eq!(reader.skipped_lines, 1, "{:?}", reader.first_skipped);
    assert_eq!(reader.first_skipped.as_ref().unwrap().line, 4);
    assert_eq!(reports.len(), 1);
    // A whole line of NULs before a record on the same line: the record is kept.
    let mut padded = bytes[..text.find(lines[3]).unwrap()].to_vec();
    padded.extend(std::iter::repeat_n(0u8, 4096));
    padded.extend_from_slice(&bytes[text.find(lines[3]).unwrap()..]);
    let (reader, reports) = read_all(&padded);
    assert_eq!(reader.skipped_lines, 0);
    let (_, expected) = read_all(&bytes);
    assert_eq!(reports, expected);
}

#[test]
fn lines_with_wrong_types_are_skipped_and_counted() {
    let (bytes, _) = record(None);
    let mut text = String::from_utf8(bytes).unwrap();
    let at = text.find('\n').unwrap() + 1;
    text.insert_str(
        at,
        "{\"kind\":\"event\",\"ts_ns\":\"yesterday\"}\n{\"kind\":\"stats\",\"now_ns\":-1}\n[1,2]\n",
    );
    let (reader, reports) = read_all(text.as_bytes());
    assert_eq!(reader.skipped_lines, 3);
    assert_eq!(reader.problem(), None);
    assert_eq!(reports.len(), 1);
}

#[test]
fn interface_lines_name_pod_interfaces_in_analyze() {
    let path = temp("rec-ifnames");
    let mut w = RecordingWriter::create(&path, &header(), None).unwrap();
    let events = fixtures::seed000_same_node(false);
    w.interface(fixtures::CLIENT_NS, fixtures::POD_ETH0, "eth0");
    for ev in &events {
        w.event(ev);
    }
    w.end(StatsLine {
        now_ns: fixtures::T0 + 10_000_000_000,
        ..Default::default()
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    assert!(w.drain(deadline, std::time::Duration::from_secs(10)));
    let bytes = std::fs::read(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let text = String::from_utf8(bytes.clone()).unwrap();
    assert!(text.contains(r#"{"kind":"interface","netns":"#), "{text}");
    let (reports, problem) = decide(&bytes);
    assert_eq!(problem, None);
    let hops: Vec<_> = reports[0].packets.iter().flat_map(|p| &p.hops).collect();
    let in_client = hops
        .iter()
        .filter(|h| h.netns == fixtures::CLIENT_NS && h.ifindex == fixtures::POD_ETH0);
    assert!(in_client.clone().count() > 0);
    for h in in_client {
        assert_eq!(h.ifname.as_ref().map(|n| n.as_str()), Some("eth0"), "{h:?}");
    }
    // The same ifindex in the node namespace is another interface.
    assert!(
        hops.iter()
            .filter(|h| h.node_ns && h.ifindex == fixtures::POD_ETH0)
            .all(|h| h.ifname.as_ref().map(|n| n.as_str()) != Some("eth0")),
        "{hops:?}"
    );
}

#[test]
fn missing_tools_survive_the_recording() {
    let rules = crate::ruleset::KubeProxyRules {
        missing_tools: vec![crate::ruleset::MissingTool {
            program: "nft".into(),
            path: "/usr/bin".into(),
        }],
        ..Default::default()
    };
    let json = serde_json::to_value(&rules).unwrap();
    assert_eq!(super::kube::deserialize(json).unwrap(), rules);
    // Recordings from before the field read as "nothing missing".
    let old = serde_json::json!({"mode": "none"});
    assert!(
        super::kube::deserialize(old)
            .unwrap()
            .missing_tools
            .is_empty()
    );
}

#[test]
fn rotation_keeps_n_files_each_readable_on_its_own() {
    let path = temp("rotate");
    let limit = 48 * 1024;
    let mut w = RecordingWriter::create(&path, &header(), Some(limit)).unwrap();
    w.keep_files(3);
    w.interface(4026532300, 7, "eth0");
    let events = fixtures::seed000_same_node(false);
    let mut now = 0;
    // Enough for several files: every file but the newest is rotated.
    for round in 0..40u64 {
        for ev in &events {
            let mut ev = *ev;
            ev.ts_ns += round * 10_000_000_000;
            // A new connection each round (another client port).
            for port in [&mut ev.sport, &mut ev.dport] {
                if *port == fixtures::CLIENT.1 {
                    *port += round as u16;
                }
            }
            ev.skb += round * 0x1000;
            now = now.max(ev.ts_ns);
            w.event(&ev);
        }
        w.stats(StatsLine {
            now_ns: now + 1,
            lost_events: round,
            ..Default::default()
        });
    }
    w.end(StatsLine {
        now_ns: now + 1,
        lost_events: 40,
        ..Default::default()
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    assert!(w.drain(deadline, std::time::Duration::from_secs(10)));
    assert_eq!(w.take_warning(), None);
    assert!(w.files_written() > 3, "{} files", w.files_written());
    let mut run_ids = std::collections::HashSet::new();
    for i in 0..3 {
        let name = rotate::rotated_name(&path, i);
        let bytes = std::fs::read(&name).unwrap();
        assert!(bytes.len() as u64 <= limit + 4096, "{} bytes", bytes.len());
        let (mut reader, mut h) = Reader::new(BufReader::new(Cursor::new(&bytes))).unwrap();
        // One run: one id, and each file's place in it (newest = FILE).
        assert!(h.run_id.is_some());
        run_ids.insert(h.run_id.take());
        assert_eq!(h.file_seq.take(), Some(w.files_written() - i as u64));
        assert_eq!(h, header());
        let records: Vec<Record> = reader.by_ref().collect();
        assert_eq!(reader.skipped_lines, 0);
        assert!(records.contains(&Record::Interface(InterfaceName {
            netns: 4026532300,
            ifindex: 7,
            name: "eth0".into()
        })));
        let last = records.last().unwrap();
        if i == 0 {
            assert!(matches!(last, Record::End(_)), "{last:?}");
        } else {
            assert!(matches!(last, Record::Rotated { .. }), "{last:?}");
        }
        // Each file counts losses from its own start.
        let lost: Vec<u64> = records
            .iter()
            .filter_map(|r| match r {
                Record::Stats(s) => Some(s.lost_events),
                _ => None,
            })
            .collect();
        assert!(lost.first().is_some_and(|&l| l <= 1), "{lost:?}");
        let (reports, _) = decide(&bytes);
        let events = records
            .iter()
            .filter(|r| matches!(r, Record::Event(_)))
            .count();
        // The newest file may hold only the tail of a connection.
        assert!(
            i == 0 || !reports.is_empty(),
            "file {i}: {events} events, {} bytes",
            bytes.len()
        );
    }
    assert_eq!(run_ids.len(), 1, "{run_ids:?}");
    assert!(!rotate::rotated_name(&path, 3).exists());
    for i in 0..3 {
        let _ = std::fs::remove_file(rotate::rotated_name(&path, i));
    }
}

#[test]
fn rules_lines_rename_and_retrace_in_analyze() {
    use crate::ruleset::{KubeProxyRules, SvcRule};
    let mut h = header();
    h.services.clear();
    h.all_services = true;
    let path = temp("rules");
    let mut w = RecordingWriter::create(&path, &h, None).unwrap();
    let svc = fixtures::SVC;
    w.rules(&KubeProxyRules {
        services: vec![SvcRule {
            name: "default/web:http".into(),
            cluster_ip: svc.0.into(),
            port: svc.1,
            proto: "tcp".into(),
            chain: "KUBE-SVC-WEB".into(),
            masquerade_all: false,
            endpoints: vec![],
        }],
        ..KubeProxyRules::default()
    });
    let events = fixtures::seed000_same_node(false);
    for ev in &events {
        w.event(ev);
    }
    w.end(StatsLine {
        now_ns: fixtures::T0 + 10_000_000_000,
        ..Default::default()
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    assert!(w.drain(deadline, std::time::Duration::from_secs(10)));
    let bytes = std::fs::read(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let (reports, problem) = decide(&bytes);
    assert_eq!(problem, None);
    assert_eq!(reports.len(), 1);
    assert_eq!(
        reports[0].kube.as_ref().map(|k| &*k.service),
        Some("default/web:http")
    );
}

/// Issue 26 item 11: a flood fills the default `--write-max-mb` in about
/// 36 s, after which nothing more is recorded: the rate that predicts the
/// cap within minutes is warned about once; rotating or a slow rate is not.
#[test]
fn a_rate_that_will_reach_the_cap_is_warned_about_ahead() {
    let warnings = |per_tick: usize, keep: usize| {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = temp(&format!("rate-{n}"));
        let mut w = RecordingWriter::create(&path, &header(), Some(10 << 20)).unwrap();
        w.keep_files(keep);
        let ev = fixtures::seed000_same_node(false)[0];
        let mut said = Vec::new();
        for tick in 0..40u64 {
            for _ in 0..per_tick {
                w.event(&ev);
            }
            w.stats(StatsLine {
                now_ns: fixtures::T0 + tick * 200_000_000,
                ..Default::default()
            });
            said.extend(w.take_warning());
        }
        let _ = std::fs::remove_file(&path);
        said
    };
    let flood = warnings(100, 1);
    assert_eq!(flood.len(), 1, "{flood:?}");
    assert!(
        flood[0].contains("reaches --write-max-mb (10 MiB) in about"),
        "{flood:?}"
    );
    assert_eq!(warnings(100, 3), Vec::<String>::new());
    assert_eq!(warnings(1, 1), Vec::<String>::new());
}

/// A recording ended (its `end` line) within a request's reply timeout
/// decides the flow as the live session did at that stop: `undecided`.
#[test]
fn a_recording_stopped_within_the_reply_timeout_is_undecided_as_live() {
    let path = temp("stopped-early");
    let mut w = RecordingWriter::create(&path, &header(), None).unwrap();
    let events: Vec<_> = fixtures::no_reply().into_iter().take(8).collect();
    for ev in &events {
        w.event(ev);
    }
    let stop = fixtures::T0 + 700_000_000;
    w.end(StatsLine {
        now_ns: stop,
        ..Default::default()
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    assert!(w.drain(deadline, std::time::Duration::from_secs(10)));
    let bytes = std::fs::read(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let (reports, problem) = decide(&bytes);
    assert_eq!(problem, None);
    let mut live = Collector::new(header().collector_config().unwrap());
    for ev in events {
        live.push(ev);
    }
    let (expected, _) = live.finish(stop);
    assert_eq!(reports, expected);
    assert_eq!(reports[0].verdict, crate::collector::Verdict::Undecided);
    assert!(reports[0].detail.contains("700 ms before tracing stopped"));
}

/// The kernel's skipped program runs reach `analyze`'s summary from the
/// `end` line, as the live summary had them; older files have none.
#[test]
fn skipped_runs_are_read_back_into_the_summary() {
    let rec = include_str!(crate::fixture!("stale_dns.rec"));
    let read = |text: &str| {
        let (mut reader, header) = Reader::new(Cursor::new(text.as_bytes())).unwrap();
        super::replay::decide_all(&mut reader, &header, None).1
    };
    assert_eq!(read(rec).skipped_runs, 0);
    let with = rec.replace(r#"{"kind":"end","#, r#"{"kind":"end","skipped_runs":7,"#);
    assert_eq!(read(&with).skipped_runs, 7);
}

/// A `pods` line names the client by its address and its namespace's hops
/// by its namespace: `analyze` shows the names the live run had.
#[test]
fn a_pods_line_names_clients_and_hops() {
    let rec = include_str!(crate::fixture!("stale_dns.rec"));
    let (header, rest) = rec.split_once('\n').unwrap();
    let pods = r#"{"kind":"pods","pods":[{"netns":4026532316,"addrs":["100.96.54.240"],"pod":"default/client-7d9f","uid":"3f1c2a9e-8d4b-4c1e-9a7f-0b5d6e7f8a9b"}]}"#;
    let named = format!("{header}\n{pods}\n{rest}");
    let (reports, problem) = decide(named.as_bytes());
    assert_eq!(problem, None);
    let r = &reports[0];
    assert_eq!(
        r.client_pod.as_ref().map(|n| n.as_str()),
        Some("default/client-7d9f")
    );
    // The DNS pod was deleted: no pod has its address any more.
    assert_eq!(r.backend_pod, None);
    let client_hops: Vec<_> = r
        .packets
        .iter()
        .flat_map(|p| &p.hops)
        .filter(|h| h.netns == 4026532316)
        .collect();
    assert!(!client_hops.is_empty());
    assert!(
        client_hops
            .iter()
            .all(|h| h.pod.as_ref().map(|p| p.as_str()) == Some("default/client-7d9f"))
    );
    assert!(
        r.packets
            .iter()
            .flat_map(|p| &p.hops)
            .filter(|h| h.node_ns)
            .all(|h| h.pod.is_none())
    );
    // Without the line: no names.
    let (reports, _) = decide(rec.as_bytes());
    assert_eq!(reports[0].client_pod, None);
}
