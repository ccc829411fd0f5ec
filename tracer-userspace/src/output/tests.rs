use super::{json::JsonOutput, text::TextOutput};
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

fn text(reports: &[FlowReport], summary: &Summary, color: bool, verbose: bool) -> String {
    let mut out = TextOutput::new(Vec::new(), color, verbose);
    for r in reports {
        out.flow(r).unwrap();
    }
    out.summary(summary).unwrap();
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
    assert!(out.contains("← judged here"));
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
    out.summary(&summary).unwrap();
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

/// Issue 11: a SYN retransmit load-balanced to another backend (a real lab
/// recording): JSON carries every attempt, the text line lists them.
#[test]
fn attempts_in_json_and_text() {
    let (reports, summary) = crate::collector::tests_stale::replay("retransmit", None);
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
