//! The merge over two real recordings of seed 003's lab (node-b DNATs,
//! node-a runs the backend), made by the root test
//! `tests/tests/merge.rs`; regenerate them (as root) with
//! `NATTRACE_WRITE_FIXTURE=1 cargo test -p nattrace-tests --test merge`.
//! The first connection is the incident, the second ran after kube-proxy's
//! masqueradeAll rule was added on node-b.
use std::io::Cursor;

use super::*;
use crate::{
    collector::{CauseId, Verdict},
    recording::{Reader, Record, replay::InMemory},
};

const NODE_B: &str = include_str!(crate::fixture!("merge/seed003_node_b.rec"));
const NODE_A: &str = include_str!(crate::fixture!("merge/seed003_node_a.rec"));

/// One node's flows; `shift` moves its clock (another machine's).
fn node(text: &str, name: &str, shift: u64) -> NodeFlows {
    let (reader, header) = Reader::new(Cursor::new(text.as_bytes())).expect("recording");
    let records = reader.map(|r| match r {
        Record::Event(mut ev) => {
            ev.ts_ns += shift;
            Record::Event(ev)
        }
        Record::Stats(mut s) => {
            s.now_ns += shift;
            Record::Stats(s)
        }
        Record::End(mut s) => {
            s.now_ns += shift;
            Record::End(s)
        }
        other => other,
    });
    decide_node(name, &header, &mut InMemory(records)).expect("decided")
}

fn merged(shift_a: u64) -> Vec<FlowReport> {
    merge(&[node(NODE_B, "node-b", 0), node(NODE_A, "node-a", shift_a)]).0
}

/// (node, place) of each hop of the packet `kind`.
fn path(f: &FlowReport, kind: &str) -> Vec<(String, String)> {
    let p = f.packets.iter().find(|p| p.kind == kind).expect(kind);
    p.hops
        .iter()
        .filter(|h| h.node_ns)
        .map(|h| {
            let place = [Some(h.hook), h.nf_hook, h.nat_stage]
                .into_iter()
                .flatten()
                .chain(
                    h.ifname
                        .as_ref()
                        .map(|n| n.as_str())
                        .filter(|_| h.hook != "netfilter"),
                )
                .collect::<Vec<_>>()
                .join(" ");
            (h.node.as_ref().expect("labelled").to_string(), place)
        })
        .collect()
}

#[test]
fn each_node_alone_tells_half_of_seed_003() {
    let b = node(NODE_B, "node-b", 0);
    let a = node(NODE_A, "node-a", 0);
    let cause = |n: &NodeFlows| n.reports[0].cause.as_ref().map(|c| c.id);
    assert_eq!(cause(&b), Some(CauseId::NoReplyThroughNode));
    assert_eq!(cause(&a), Some(CauseId::ReplyBypassesDnatNode));
}

#[test]
fn seed_003_is_one_flow_with_the_asymmetric_return_path() {
    let flows = merged(0);
    assert_eq!(flows.len(), 2, "{flows:#?}");
    let f = &flows[0];
    assert_eq!(f.verdict, Verdict::ReplyNotReverseNated);
    let cause = f.cause.as_ref().expect("cause");
    assert_eq!(cause.id, CauseId::AsymmetricReturnPath);
    assert!(cause.hint.contains("masqueradeAll"), "{}", cause.hint);
    assert!(
        cause.text.starts_with("node-b DNATed the SYN to 100.96.54.247:80 at PREROUTING and sent it to node-a by flannel.1; node-a received it by flannel.1"),
        "{}",
        cause.text
    );
    assert!(
        cause.text.contains("the SYN-ACK left node-a by eth0"),
        "{}",
        cause.text
    );
    let syn = path(f, "SYN");
    let want_syn = [
        ("node-b", "tc-ingress eth0"),
        ("node-b", "netfilter PREROUTING before-nat"),
        ("node-b", "netfilter PREROUTING after-nat"),
        ("node-b", "netfilter FORWARD"),
        ("node-b", "netfilter POSTROUTING before-nat"),
        ("node-b", "netfilter POSTROUTING after-nat"),
        ("node-b", "tc-egress flannel.1"),
        ("node-a", "tc-ingress flannel.1"),
    ];
    for (i, (n, place)) in want_syn.iter().enumerate() {
        assert_eq!(syn[i], (n.to_string(), place.to_string()), "{syn:#?}");
    }
    assert_eq!(syn.last().expect("hops").1, "tc-egress veth0", "{syn:#?}");
    // The reply: node-a to the router, never node-b.
    let reply = path(f, "SYN-ACK");
    assert!(reply.iter().all(|(n, _)| n == "node-a"), "{reply:#?}");
    assert_eq!(reply.first().expect("hops").1, "tc-ingress veth0");
    assert_eq!(reply.last().expect("hops").1, "tc-egress eth0");
}

#[test]
fn a_hop_recorded_by_both_nodes_is_listed_once() {
    let f = &merged(0)[0];
    for p in &f.packets {
        for (i, h) in p.hops.iter().enumerate() {
            assert!(
                !p.hops[i + 1..]
                    .iter()
                    .any(|x| same_event(x, h, SAME_EVENT_NS)),
                "{} twice: {h:?}",
                p.kind
            );
        }
    }
    // The backend pod's receive is node-a's, the outside client's send node-b's.
    let syn = f.packets.iter().find(|p| p.kind == "SYN").expect("SYN");
    let at_backend = syn
        .hops
        .iter()
        .find(|h| !h.node_ns && h.dst.to_string() == "100.96.54.247:80" && h.hook == "dev-rx")
        .expect("backend pod's receive");
    assert_eq!(at_backend.node.as_ref().expect("node").as_str(), "node-a");
}

#[test]
fn masquerade_all_is_ok_with_the_snat_shown() {
    let f = &merged(0)[1];
    assert_eq!(f.verdict, Verdict::Ok, "{}", f.detail);
    assert!(f.cause.is_none());
    let snat = f.snat.expect("SNAT");
    assert_eq!(
        snat.ip().to_string(),
        "100.96.55.0",
        "node-b's flannel.1 address"
    );
    assert!(f.detail.contains("client masqueraded to"), "{}", f.detail);
}

#[test]
fn the_nodes_clocks_are_not_compared() {
    // node-a's clock an hour and a bit ahead: same flows, same story.
    let flows = merged(3_600_123_456_789);
    assert_eq!(flows.len(), 2);
    let f = flows
        .iter()
        .find(|f| f.verdict != Verdict::Ok)
        .expect("the incident");
    assert_eq!(f.verdict, Verdict::ReplyNotReverseNated);
    assert_eq!(
        f.cause.as_ref().map(|c| c.id),
        Some(CauseId::AsymmetricReturnPath)
    );
    let syn = path(f, "SYN");
    assert_eq!(syn[0].0, "node-b");
    assert_eq!(syn.last().expect("hops").0, "node-a");
}

#[test]
fn recordings_order_on_the_command_line_does_not_matter() {
    let ab = merge(&[node(NODE_A, "node-a", 0), node(NODE_B, "node-b", 0)]).0;
    let ba = merged(0);
    let key = |fs: &[FlowReport]| -> Vec<_> {
        fs.iter()
            .map(|f| (f.verdict, f.cause.as_ref().map(|c| c.id), f.client))
            .collect()
    };
    assert_eq!(key(&ab), key(&ba));
}

#[test]
fn a_node_without_its_own_report_still_shows_its_hops() {
    // node-a's nattrace could not follow the masqueraded connection (its
    // kernel filter never saw the client's new address), but node-b's
    // tracepoints saw node-a's devices: they are labelled node-a.
    let f = &merged(0)[1];
    let syn = path(f, "SYN");
    assert_eq!(syn.first().expect("hops").0, "node-b", "{syn:#?}");
    assert!(
        syn.contains(&("node-a".to_string(), "dev-rx flannel.1".to_string())),
        "{syn:#?}"
    );
    let reply = path(f, "SYN-ACK");
    assert_eq!(reply.first().expect("hops").0, "node-a", "{reply:#?}");
    assert_eq!(
        reply.last().expect("hops"),
        &("node-b".to_string(), "tc-egress eth0".to_string())
    );
}

#[test]
fn a_recording_cut_short_marks_its_open_flows_incomplete() {
    // node-b's file cut 300 ms after its first event: after the incident's
    // SYN, before its 1 s reply timeout, and without an end line.
    let first_event = |l: &str| -> Option<u64> {
        let v: serde_json::Value = serde_json::from_str(l).ok()?;
        (v["kind"] == "event")
            .then(|| v["ts_ns"].as_u64())
            .flatten()
    };
    let t0 = NODE_B.lines().find_map(first_event).expect("an event");
    let cut: String = NODE_B
        .lines()
        .take_while(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json");
            v["kind"] != "stats" || v["now_ns"].as_u64() < Some(t0 + 300_000_000)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    let b = node(&cut, "node-b", 0);
    assert_eq!(b.reports.len(), 1, "{:#?}", b.reports);
    assert!(b.reports[0].incomplete);
    let port = b.reports[0].client.port();
    let flows = merge(&[b, node(NODE_A, "node-a", 0)]).0;
    let incident: Vec<_> = flows.iter().filter(|f| f.client.port() == port).collect();
    assert_eq!(incident.len(), 1, "{flows:#?}");
    assert!(incident[0].incomplete, "{:#?}", incident[0]);
}

/// An unreadable line is an event missing from the flows around it, on one
/// node of several as in `analyze` of one file.
#[test]
fn an_unreadable_line_in_one_nodes_recording_is_counted_as_loss() {
    let garbled: String = NODE_B
        .lines()
        .enumerate()
        .map(|(i, l)| {
            if i == 5 {
                "\0\0\0 not a record\n".to_owned()
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    let clean = node(NODE_B, "node-b", 0);
    assert!(
        clean.reports.iter().all(|r| !r.incomplete),
        "{:#?}",
        clean.reports
    );
    let (mut reader, header) = Reader::new(Cursor::new(garbled.as_bytes())).expect("recording");
    let b = decide_node("node-b", &header, &mut reader).expect("decided");
    assert_eq!(reader.skipped_lines, 1);
    assert_eq!(b.reports.len(), clean.reports.len());
    // The flow open at the cut (the incident); later ones were traced whole.
    let first = &b.reports[0];
    assert!(first.incomplete, "{first:#?}");
    assert!(
        first.detail.contains("events were lost"),
        "{}",
        first.detail
    );
    // The kernel lost nothing: the skipped line is the reader's to report.
    assert_eq!(b.summary.lost_events, 0);
}

#[test]
fn older_recordings_without_a_node_name_still_read() {
    let old = include_str!(crate::fixture!("no_endpoints.rec"));
    assert!(!old.lines().next().expect("header").contains("\"node\""));
    let (_, header) = Reader::new(Cursor::new(old.as_bytes())).expect("recording");
    assert_eq!(header.node, None);
    let (_, header) = Reader::new(Cursor::new(NODE_B.as_bytes())).expect("recording");
    assert_eq!(header.node.as_deref(), Some("node-b"));
}

const NODE_A_BACKEND: &str = include_str!(crate::fixture!("merge/seed003_node_a_backend.rec"));

/// A recording reduced to what a separate machine records: its own
/// namespace (tc, netfilter, its devices), none of the router's, the
/// client's or the other node's (the lab's nodes share one kernel).
fn separate(text: &str, name: &str) -> NodeFlows {
    let (reader, header) = Reader::new(Cursor::new(text.as_bytes())).expect("recording");
    let own = header.facts.netns_inode;
    let records =
        reader.filter(|r| !matches!(r, Record::Event(ev) if ev.netns != 0 && ev.netns != own));
    decide_node(name, &header, &mut InMemory(records)).expect("decided")
}

#[test]
fn a_separate_backend_node_traced_by_the_backend_address_completes_the_story() {
    // node-a traced with `--svc <backend pod>:80` (README).
    let (flows, _) = merge(&[
        separate(NODE_B, "node-b"),
        separate(NODE_A_BACKEND, "node-a"),
    ]);
    assert_eq!(flows.len(), 2, "{flows:#?}");
    let f = &flows[0];
    // Nothing recorded the client's namespace: what it got is unknown,
    // and no reply came back through node-b.
    assert_eq!(f.verdict, Verdict::NoReply, "{}", f.detail);
    assert_eq!(
        f.cause.as_ref().map(|c| c.id),
        Some(CauseId::AsymmetricReturnPath)
    );
    let reply = path(f, "SYN-ACK");
    assert!(reply.iter().all(|(n, _)| n == "node-a"), "{reply:#?}");
    assert_eq!(reply.last().expect("hops").1, "tc-egress eth0");
    // masqueradeAll: ok, and node-a's own half of the path.
    let ok = &flows[1];
    assert_eq!(ok.verdict, Verdict::Ok);
    assert!(ok.snat.is_some());
    let syn = path(ok, "SYN");
    assert_eq!(syn.first().expect("hops").0, "node-b");
    assert!(
        syn.contains(&("node-a".to_string(), "tc-egress veth0".to_string())),
        "{syn:#?}"
    );
}

#[test]
fn one_node_alone_is_its_own_story() {
    // Through the merge, one node's flows keep their verdicts and causes.
    let alone = node(NODE_B, "node-b", 0);
    let want: Vec<_> = alone
        .reports
        .iter()
        .map(|r| (r.verdict, r.cause.as_ref().map(|c| c.id), r.client))
        .collect();
    let (flows, summary) = merge(&[alone]);
    let got: Vec<_> = flows
        .iter()
        .map(|r| (r.verdict, r.cause.as_ref().map(|c| c.id), r.client))
        .collect();
    assert_eq!(got, want);
    assert_eq!(summary.flows, want.len() as u64);
    assert!(
        flows
            .iter()
            .flat_map(|f| &f.packets)
            .flat_map(|p| &p.hops)
            .all(|h| h.node.is_some())
    );
}

#[test]
fn packets_without_an_identity_join_nothing() {
    // A UDP datagram with IP id 0 and no DNS id could be anyone's.
    let p = PacketEvidence {
        kind: "request",
        dir: Dir::Request,
        tcp_flags: 0,
        seq: 0,
        ack: 0,
        ip_id: 0,
        dns_id: None,
        hops: Vec::new(),
    };
    assert!(!Key::of(&p).is_distinctive());
    assert!(
        Key::of(&PacketEvidence {
            dns_id: Some(0x1234),
            ..p
        })
        .is_distinctive()
    );
}
