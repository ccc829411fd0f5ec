use super::{
    json::JsonOutput,
    text::{TextOutput, TextStyle},
};
use crate::collector::{Collector, CollectorConfig, FlowReport, Summary, fixtures};

fn decide(events: &[tracer_common::PacketEvent], bridge_nf: bool) -> (Vec<FlowReport>, Summary) {
    let mut c = Collector::new(CollectorConfig {
        services: fixtures::services(),
        facts: fixtures::facts(Some(bridge_nf)),
        ..CollectorConfig::default()
    });
    for ev in events {
        c.push(*ev);
    }
    c.finish(fixtures::T0 + 10_000_000_000)
}

/// The one-line form (`--wide`), as the tests below read it.
fn text(reports: &[FlowReport], summary: &Summary, color: bool, verbose: bool) -> String {
    styled(reports, summary, TextStyle { color, wide: true }, verbose)
}

fn styled(reports: &[FlowReport], summary: &Summary, style: TextStyle, verbose: bool) -> String {
    let mut out = TextOutput::new(Vec::new(), style, verbose);
    for r in reports {
        out.flow(r).unwrap();
    }
    out.summary(summary, 0).unwrap();
    String::from_utf8(out.into_inner()).unwrap()
}

#[test]
fn text_line_for_seed000() {
    let (reports, summary) = decide(&fixtures::seed000_same_node(false), false);
    let out = text(&reports, &summary, false, false);
    let mut lines = out.lines();
    assert_eq!(
        lines.next().unwrap(),
        "✗ reply_not_reverse_nated tcp 100.96.54.240:43534 → 100.67.30.133:80 DNAT→ 100.96.54.247:80 — \
         SYN-ACK reached the client with source 100.96.54.247:80 instead of 100.67.30.133:80; it crossed cni0 \
         without passing netfilter; the client dropped it (no socket) and sent RST. cause: bridge_nf_call_iptables_off \
         — fix: load br_netfilter and set net.bridge.bridge-nf-call-iptables=1 in the node namespace (before kubelet starts)"
    );
    assert_eq!(
        lines.next().unwrap(),
        "summary: 1 flows (ok 0, reply_not_reverse_nated 1, no_reply 0, dropped 0); lost events: 0"
    );
    assert!(!out.contains('\x1b'));
}

#[test]
fn text_verbose_lists_every_hop_and_colour_is_optional() {
    let (reports, summary) = decide(&fixtures::seed000_same_node(false), false);
    let out = text(&reports, &summary, true, true);
    if std::env::var_os("NATTRACE_SHOW").is_some() {
        eprintln!("{}", text(&reports, &summary, false, true));
    }
    assert!(out.contains('\x1b'));
    assert!(
        out.contains("why: the SYN-ACK crossed the bridge cni0 from veth-backend to veth-client")
    );
    assert!(out.contains("netfilter PREROUTING after-nat"));
    assert!(out.contains("tc-egress veth-client"));
    assert!(out.contains("drop: NO_SOCKET"));
    assert!(out.contains("← the reply as the client gets it: the verdict is read here"));
    let (ok, s) = decide(&fixtures::seed000_same_node(true), true);
    let out = text(&ok, &s, false, false);
    assert!(
        out.starts_with(
            "✓ ok tcp 100.96.54.240:43534 → 100.67.30.133:80 DNAT→ 100.96.54.247:80 — "
        ),
        "{out}"
    );
}

#[test]
fn json_lines_have_the_documented_fields() {
    let (reports, summary) = decide(&fixtures::seed000_same_node(false), false);
    let mut out = JsonOutput::new(Vec::new(), true);
    for r in &reports {
        out.flow(r).unwrap();
    }
    out.summary(&summary, 0).unwrap();
    let text = String::from_utf8(out.into_inner()).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    let f = &lines[0];
    assert_eq!(f["kind"], "flow");
    assert_eq!(f["verdict"], "reply_not_reverse_nated");
    assert_eq!(f["proto"], "tcp");
    assert_eq!(f["client"], "100.96.54.240:43534");
    assert_eq!(f["service"], "100.67.30.133:80");
    assert_eq!(f["backend"], "100.96.54.247:80");
    assert_eq!(f["cause"], "bridge_nf_call_iptables_off");
    assert!(f["hint"].as_str().unwrap().contains("br_netfilter"));
    assert_eq!(f["incomplete"], false);
    let packets = f["packets"].as_array().unwrap();
    assert_eq!(packets[1]["kind"], "SYN-ACK");
    assert!(
        packets[1]["hops"]
            .as_array()
            .unwrap()
            .iter()
            .any(|h| h["drop_reason"] == "NO_SOCKET")
    );
    let s = &lines[1];
    assert_eq!(s["kind"], "summary");
    assert_eq!(s["flows"], 1);
    assert_eq!(s["by_verdict"]["reply_not_reverse_nated"], 1);
    assert_eq!(s["lost_events"], 0);
}

#[test]
fn json_backend_is_null_when_unknown() {
    let mut b = fixtures::Builder::default();
    let syn = fixtures::tcp(
        tracer_common::tcp_flags::SYN,
        1,
        0,
        1,
        0x10,
        tracer_common::direction::REQUEST,
    );
    b.path(
        syn,
        fixtures::T0,
        &[(
            fixtures::tc_in(fixtures::VETH_CLIENT),
            fixtures::CLIENT,
            fixtures::SVC,
        )],
    );
    let (reports, _) = decide(&b.events, true);
    let mut out = JsonOutput::new(Vec::new(), true);
    out.flow(&reports[0]).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.into_inner()).unwrap();
    assert_eq!(v["backend"], serde_json::Value::Null);
    assert_eq!(v["cause"], serde_json::Value::Null);
    assert_eq!(v["verdict"], "no_reply");
}

#[test]
fn json_ok_flows_are_abridged_without_verbose_and_problems_never_are() {
    let json_of = |events: &[tracer_common::PacketEvent], bridge_nf: bool, verbose: bool| {
        let (reports, _) = decide(events, bridge_nf);
        let mut out = JsonOutput::new(Vec::new(), verbose);
        out.flow(&reports[0]).unwrap();
        serde_json::from_slice::<serde_json::Value>(&out.into_inner()).unwrap()
    };
    let hop_count = |f: &serde_json::Value| -> usize {
        f["packets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["hops"].as_array().unwrap().len())
            .sum()
    };

    let healthy = fixtures::seed000_same_node(true);
    let full = json_of(&healthy, true, true);
    let abridged = json_of(&healthy, true, false);
    assert_eq!(full["verdict"], "ok");
    assert_eq!(full["packets_abridged"], false);
    assert_eq!(abridged["packets_abridged"], true);
    assert!(hop_count(&abridged) < hop_count(&full), "{abridged}");
    // What proves `ok` stays: the DNAT to the backend and the judged reply.
    let hops: Vec<&serde_json::Value> = abridged["packets"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["hops"].as_array().unwrap())
        .collect();
    assert!(hops.iter().any(|h| h["client_side"] == true), "{abridged}");
    assert!(
        hops.iter()
            .any(|h| h["nat_stage"] == "after-nat" && h["dst"] == "100.96.54.247:80"),
        "{abridged}"
    );

    let broken = fixtures::seed000_same_node(false);
    assert_eq!(
        hop_count(&json_of(&broken, false, false)),
        hop_count(&json_of(&broken, false, true))
    );
}

/// Interfaces are named in every namespace: a pod's `eth0` (the same
/// ifindex as the node's cni0 means another device there) and a node
/// interface that appeared after start, once learned; `if<N>` only for what
/// could not be resolved.
#[test]
fn text_names_interfaces_of_pods_and_new_ones() {
    let verbose_text = |learn: bool| {
        let mut facts = fixtures::facts(Some(false));
        // veth-client appeared after start: not in the facts.
        facts
            .interfaces
            .retain(|i| i.ifindex != fixtures::VETH_CLIENT);
        let mut c = Collector::new(CollectorConfig {
            services: fixtures::services(),
            facts,
            ..CollectorConfig::default()
        });
        if learn {
            c.learn_interface(fixtures::CLIENT_NS, fixtures::POD_ETH0, "eth0");
            c.learn_interface(fixtures::BACKEND_NS, fixtures::POD_ETH0, "eth0");
            c.learn_interface(0, fixtures::VETH_CLIENT, "veth-late");
        }
        for ev in fixtures::seed000_same_node(false) {
            c.push(ev);
        }
        let (reports, summary) = c.finish(fixtures::T0 + 10_000_000_000);
        text(&reports, &summary, false, true)
    };
    let named = verbose_text(true);
    let hop_lines = |out: &str| -> Vec<String> {
        out.lines()
            .filter(|l| l.starts_with("      "))
            .map(str::to_owned)
            .collect()
    };
    let pod_hops: Vec<String> = hop_lines(&named)
        .into_iter()
        .filter(|l| l.contains(&format!("ns {}", fixtures::CLIENT_NS)))
        .collect();
    assert!(!pod_hops.is_empty(), "{named}");
    for l in &pod_hops {
        assert!(l.contains(" eth0 "), "{l}");
    }
    assert!(named.contains("tc-egress veth-late"), "{named}");
    assert!(
        !hop_lines(&named).iter().any(|l| l.contains(" if")),
        "every interface named:\n{named}"
    );
    // Unresolved: the ifindex, never a wrong name.
    let bare = verbose_text(false);
    assert!(
        bare.contains(&format!("tc-egress if{}", fixtures::VETH_CLIENT)),
        "{bare}"
    );
    assert!(!bare.contains(" eth0 "), "{bare}");
}

mod queue {
    use std::{
        io::{self, Write},
        sync::mpsc,
        time::{Duration, Instant},
    };

    use crate::output::queue::{Overflow, QueueWriter, WriteQueue};

    /// A reader that reads nothing until told to: every write blocks.
    struct Stalled(mpsc::Receiver<()>, mpsc::Sender<Vec<u8>>);

    impl Write for Stalled {
        fn write(&mut self, data: &[u8]) -> io::Result<usize> {
            let _ = self.0.recv();
            let _ = self.1.send(data.to_vec());
            Ok(data.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn stalled(
        limit: usize,
        overflow: Overflow,
    ) -> (QueueWriter, mpsc::Sender<()>, mpsc::Receiver<Vec<u8>>) {
        let (go, wait) = mpsc::channel();
        let (tx, written) = mpsc::channel();
        let q = WriteQueue::spawn("test", Box::new(Stalled(wait, tx)), limit, overflow).unwrap();
        (QueueWriter::new(q), go, written)
    }

    /// A tick's few lines are queued in a vector of their size, not in the
    /// chunk-sized buffer lines are gathered in: the queue's limit counts
    /// bytes, so a stalled reader would otherwise hold a mostly empty
    /// 320 KiB buffer per tick.
    #[test]
    fn flushed_lines_queue_what_they_take() {
        let (mut out, _go, _written) = stalled(1 << 20, Overflow::Drop);
        for i in 0..200 {
            writeln!(out, "flow line {i:04} with some text to take room").unwrap();
            out.flush().unwrap();
        }
        let (capacity, queued) = out.queue().queued_capacity();
        assert!(queued > 150 * 40, "{queued}");
        assert!(
            capacity <= 2 * queued,
            "{capacity} allocated for {queued} bytes"
        );
    }

    #[test]
    fn a_stalled_reader_never_blocks_the_writer_and_drops_are_counted() {
        let (mut out, go, written) = stalled(1000, Overflow::Drop);
        let started = Instant::now();
        for i in 0..1000 {
            writeln!(out, "flow line {i:04} with some text to take room").unwrap();
            out.flush().unwrap();
        }
        assert!(started.elapsed() < Duration::from_secs(1));
        // The first line is being written (blocked), ~20 more fit, the rest is dropped.
        let dropped = out.queue().dropped_lines();
        assert!((950..1000).contains(&dropped), "{dropped}");
        let d = out.queue().drain(
            Instant::now() + Duration::from_millis(100),
            Duration::from_secs(5),
        );
        assert!(!d.done);
        assert_eq!(d.unwritten_lines + dropped, 1000);
        // Once the reader reads, what was kept arrives whole and in order.
        drop(go);
        let d = out.queue().drain(
            Instant::now() + Duration::from_secs(5),
            Duration::from_secs(5),
        );
        assert!(d.done);
        let text: Vec<u8> = written.try_iter().flatten().collect();
        let text = String::from_utf8(text).unwrap();
        assert!(text.starts_with("flow line 0000 "));
        assert!(
            text.lines()
                .all(|l| l.starts_with("flow line ") && l.ends_with("room"))
        );
        assert_eq!(text.lines().count() as u64, 1000 - dropped);
    }

    #[test]
    fn a_stall_ends_draining_without_a_deadline() {
        let (mut out, _go, _written) = stalled(1 << 20, Overflow::Drop);
        writeln!(out, "one").unwrap();
        writeln!(out, "two").unwrap();
        out.flush().unwrap();
        let started = Instant::now();
        let d = out.queue().drain(
            Instant::now() + Duration::from_secs(3600),
            Duration::from_millis(200),
        );
        assert!(!d.done);
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn abandon_gives_the_target_up_and_block_waits() {
        let (mut out, _go, _written) = stalled(100, Overflow::Abandon);
        let mut failed = false;
        for _ in 0..20 {
            if writeln!(out, "0123456789012345678901234567890123456789")
                .and_then(|()| out.flush())
                .is_err()
            {
                failed = true;
                break;
            }
        }
        assert!(failed, "a pcap that falls behind is given up");
        assert!(out.queue().check().is_err());

        let (mut out, go, written) = stalled(100, Overflow::Block);
        let writer = std::thread::spawn(move || {
            for i in 0..50 {
                writeln!(out, "line {i:02} 0123456789012345678901234567890").unwrap();
                out.flush().unwrap();
            }
            out
        });
        std::thread::sleep(Duration::from_millis(100));
        assert!(!writer.is_finished(), "blocks while the reader stalls");
        drop(go);
        let out = writer.join().unwrap();
        assert!(
            out.queue()
                .drain(
                    Instant::now() + Duration::from_secs(5),
                    Duration::from_secs(5)
                )
                .done
        );
        assert_eq!(out.queue().dropped_lines(), 0);
        let text: Vec<u8> = written.try_iter().flatten().collect();
        assert_eq!(String::from_utf8(text).unwrap().lines().count(), 50);
    }

    #[test]
    fn a_write_error_is_reported_on_the_next_flush() {
        struct Broken;
        impl Write for Broken {
            fn write(&mut self, _: &[u8]) -> io::Result<usize> {
                Err(io::Error::from(io::ErrorKind::BrokenPipe))
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let q = WriteQueue::spawn("broken", Box::new(Broken), 1000, Overflow::Drop).unwrap();
        let mut out = QueueWriter::new(q);
        writeln!(out, "x").unwrap();
        out.flush().unwrap();
        out.queue().drain(
            Instant::now() + Duration::from_secs(5),
            Duration::from_secs(5),
        );
        writeln!(out, "y").unwrap();
        assert_eq!(out.flush().unwrap_err().kind(), io::ErrorKind::BrokenPipe);
    }
}

#[test]
fn dropped_output_lines_are_in_the_summary() {
    let (reports, summary) = decide(&fixtures::seed000_same_node(true), true);
    let mut out = TextOutput::new(Vec::new(), TextStyle::default(), false);
    out.summary(&summary, 0).unwrap();
    out.summary(&summary, 42).unwrap();
    let text = String::from_utf8(out.into_inner()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert!(!lines[0].contains("output lines dropped"), "{}", lines[0]);
    assert!(
        lines[1].ends_with("; output lines dropped (stdout not read fast enough): 42"),
        "{}",
        lines[1]
    );
    let mut out = JsonOutput::new(Vec::new(), false);
    out.summary(&summary, 42).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.into_inner()).unwrap();
    assert_eq!(v["kind"], "summary");
    assert_eq!(v["dropped_output_lines"], 42);
    assert_eq!(v["flows"], reports.len());
}

/// Runs the kernel skipped are shown beside the lost events, in text and
/// JSON, and absent from both when there were none.
#[test]
fn skipped_program_runs_are_in_the_summary() {
    let (_, mut summary) = decide(&fixtures::seed000_same_node(true), true);
    let render = |s: &Summary| {
        let mut out = TextOutput::new(Vec::new(), TextStyle::default(), false);
        out.summary(s, 0).unwrap();
        let text = String::from_utf8(out.into_inner()).unwrap();
        let mut out = JsonOutput::new(Vec::new(), false);
        out.summary(s, 0).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.into_inner()).unwrap();
        (text, v)
    };
    let (text, v) = render(&summary);
    assert!(!text.contains("skipped"), "{text}");
    assert!(v.get("skipped_runs").is_none(), "{v}");
    summary.skipped_runs = 5;
    let (text, v) = render(&summary);
    assert!(
        text.contains(
            "lost events: 0 (and 5 program runs the kernel skipped: an event may be missing)"
        ),
        "{text}"
    );
    assert_eq!(v["skipped_runs"], 5);
}

/// Issue 11: a SYN retransmit load-balanced to another backend (a real lab
/// recording): JSON carries every attempt, the text line lists them.
#[test]
fn attempts_in_json_and_text() {
    let (reports, summary) = crate::collector::tests::stale::replay("retransmit", None);
    let mut json = JsonOutput::new(Vec::new(), false);
    json.flow(&reports[0]).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&json.into_inner()).unwrap();
    assert_eq!(v["backend"], "100.96.54.248:80");
    let attempts = v["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{v}");
    assert_eq!(attempts[0]["backend"], "100.96.54.247:80");
    assert_eq!(attempts[0]["sep_chain"], "KUBE-SEP-QCNXID34Z55D2JC7");
    assert_eq!(attempts[0]["answered"], false);
    assert_eq!(attempts[1]["backend"], "100.96.54.248:80");
    assert_eq!(attempts[1]["answered"], true);
    assert!(attempts[1]["at_ns"].as_u64() > attempts[0]["at_ns"].as_u64());
    let out = text(&reports, &summary, false, false);
    let line = out.lines().next().unwrap();
    assert!(
        line.contains(". Attempts: +0 ms → 100.96.54.247:80 no answer, +"),
        "{line}"
    );
    assert!(line.ends_with(" ms → 100.96.54.248:80 answered."), "{line}");
}

/// A flow cut by the stop is marked `?` like an unseen one, and the
/// summary lists `undecided` only when some were.
#[test]
fn text_line_for_a_flow_cut_by_the_stop() {
    let events: Vec<_> = fixtures::no_reply().into_iter().take(8).collect();
    let mut c = Collector::new(CollectorConfig {
        services: fixtures::services(),
        facts: fixtures::facts(Some(true)),
        ..CollectorConfig::default()
    });
    for ev in &events {
        c.push(*ev);
    }
    let (reports, summary) = c.finish(fixtures::T0 + 1_000_000);
    let out = text(&reports, &summary, false, false);
    let mut lines = out.lines();
    let line = lines.next().unwrap();
    assert!(
        line.starts_with("? undecided tcp 192.168.50.10:51000 → 100.67.30.133:80"),
        "{line}"
    );
    assert!(
        line.contains("1 ms before tracing stopped, within the 3000 ms reply timeout"),
        "{line}"
    );
    assert_eq!(
        lines.next().unwrap(),
        "summary: 1 flows (ok 0, reply_not_reverse_nated 0, no_reply 0, dropped 0, undecided 1); lost events: 0"
    );
}

/// One frame as tshark reads it: its comment, its expert-info messages.
type Frame = (String, String);

/// Issue 28 item 5: a recording's flows as pcapng, read back by tshark.
fn pcapng_in_tshark(recording: &'static str) -> Option<(Vec<FlowReport>, Vec<Frame>)> {
    use crate::recording::{Reader, replay::decide_all};
    let (mut reader, header) =
        Reader::new(std::io::Cursor::new(recording.as_bytes())).expect("a recording");
    let (reports, _) = decide_all(&mut reader, &header, None);
    let mut pcap = super::pcapng::PcapngOutput::new(Vec::new(), None, "test").unwrap();
    for r in &reports {
        pcap.flow(r).unwrap();
    }
    let path = std::env::temp_dir().join(format!(
        "nattrace-sightings-{}-{}.pcapng",
        std::process::id(),
        reports.len()
    ));
    std::fs::write(&path, pcap.into_inner()).unwrap();
    let out = std::process::Command::new("tshark")
        .arg("-r")
        .arg(&path)
        .args(["-T", "fields", "-E", "separator=/t", "-e", "frame.comment"])
        .args(["-e", "_ws.expert.message"])
        .output();
    let _ = std::fs::remove_file(&path);
    let Ok(out) = out else {
        eprintln!("tshark not installed: pcapng not checked");
        return None;
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let frames = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let (comment, expert) = l.split_once('\t').unwrap_or((l, ""));
            (comment.to_string(), expert.to_string())
        })
        .collect();
    Some((reports, frames))
}

fn retransmissions(frames: &[Frame]) -> usize {
    frames
        .iter()
        .filter(|(_, expert)| expert.contains("retransmission"))
        .count()
}

/// The same segment at each of its hops is one frame per address pair (the
/// packet before and after NAT), every hop named in its comment: Wireshark
/// no longer takes the hops for retransmissions. Before, seed 000's healthy
/// recording read as 18 retransmissions in tshark 4.0.
#[test]
fn every_hop_of_a_packet_is_one_frame_per_address_pair_not_a_retransmission() {
    let rec = include_str!(crate::fixture!(
        "recorded/root_seed000_healthy_every_connection_is_ok.rec"
    ));
    let Some((reports, frames)) = pcapng_in_tshark(rec) else {
        return;
    };
    assert_eq!(retransmissions(&frames), 0, "{frames:#?}");
    let hops: usize = reports
        .iter()
        .flat_map(|r| &r.packets)
        .map(|p| p.hops.len())
        .sum();
    let named: usize = frames
        .iter()
        .map(|(c, _)| {
            let at = c.split(" at ").nth(1).unwrap_or_default();
            let points = at.split(';').next().unwrap_or_default();
            points.split(", ").count()
        })
        .sum();
    assert_eq!(named, hops, "every hop named once: {frames:#?}");
    assert!(
        frames.len() < hops,
        "{} frames for {hops} hops",
        frames.len()
    );
    assert!(
        frames
            .iter()
            .any(|(c, _)| c.contains("before-nat") && c.contains("after-nat")),
        "{frames:#?}"
    );
}

/// Real retransmissions still are: the deleted backend's three SYN
/// retransmits, each seen to the Service and to the backend after DNAT.
#[test]
fn a_real_retransmission_is_still_one_in_wireshark() {
    let rec = include_str!(crate::fixture!("stale_deleted_cold.rec"));
    let Some((_, frames)) = pcapng_in_tshark(rec) else {
        return;
    };
    assert_eq!(retransmissions(&frames), 6, "{frames:#?}");
    assert_eq!(frames.len(), 8, "{frames:#?}");
}

/// Issue 28 item 3: a headline within 100 columns (mark, verdict, client →
/// Service DNAT→ backend), then indented lines wrapped at 80 for the
/// evidence, the cause and the fix; every word of the one-line form is
/// there, none cut; `--wide` keeps one line.
#[test]
fn text_is_a_headline_and_indented_lines_that_fit_a_terminal() {
    let (reports, summary) = decide(&fixtures::seed000_same_node(false), false);
    let out = styled(&reports, &summary, TextStyle::default(), false);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[0],
        "✗ reply_not_reverse_nated tcp 100.96.54.240:43534 → 100.67.30.133:80 DNAT→ 100.96.54.247:80"
    );
    let flow: Vec<&str> = lines
        .iter()
        .skip(1)
        .take_while(|l| l.starts_with("    "))
        .copied()
        .collect();
    assert!(flow.len() >= 4, "{out}");
    for l in &flow {
        assert!(
            l.chars().count() <= 80,
            "{} columns: {l}",
            l.chars().count()
        );
    }
    assert!(
        flow.contains(&"    cause: bridge_nf_call_iptables_off"),
        "{out}"
    );
    assert!(
        flow.iter()
            .any(|l| l.starts_with("    fix: load br_netfilter")),
        "{out}"
    );
    // A continuation sits under the text after its label.
    let fix = flow
        .iter()
        .position(|l| l.starts_with("    fix: "))
        .unwrap();
    assert!(
        flow[fix + 1].starts_with("         node namespace"),
        "{out}"
    );
    assert!(
        out.contains("net.bridge.bridge-nf-call-iptables=1"),
        "{out}"
    );
    let words = |s: &str| {
        s.split_whitespace()
            .filter(|w| *w != "—" && *w != "fix:" && *w != "cause:")
            .map(|w| w.trim_end_matches('.').to_string())
            .collect::<std::collections::BTreeSet<_>>()
    };
    let wide = text(&reports, &summary, false, false);
    let one = wide.lines().next().unwrap();
    assert_eq!(words(one), words(&lines[..=flow.len()].join(" ")), "{out}");
    assert_eq!(wide.lines().count(), 2, "{wide}");
    // -v: the cause's full text is wrapped the same way.
    let verbose = styled(&reports, &summary, TextStyle::default(), true);
    let lines: Vec<&str> = verbose.lines().collect();
    let why = lines
        .iter()
        .position(|l| l.starts_with("    why: "))
        .unwrap_or_else(|| panic!("{verbose}"));
    let block: Vec<&str> = std::iter::once(lines[why])
        .chain(
            lines[why + 1..]
                .iter()
                .copied()
                .take_while(|l| l.starts_with("         ")),
        )
        .collect();
    assert!(block.len() > 1, "{verbose}");
    assert!(block.iter().all(|l| l.chars().count() <= 80), "{verbose}");
}
