//! Issue 4's paths at the collector level: events of other namespaces,
//! seed 003 seen from either node, hairpin causes, and the README's table.
use tracer_common::{
    direction::{REPLY, REQUEST},
    nat_stage::{AFTER, BEFORE, NONE},
    nf_hook::{FORWARD, PRE_ROUTING},
    tcp_flags,
};

use super::{fixture, only, run};
use crate::collector::{fixtures::*, *};

const OTHER_NODE_NS: u32 = 4026539999;
const OUTSIDE_NS: u32 = 4026538888;
const OTHER_CLIENT_NS: u32 = 4026537777;

/// The same Service and addresses on another node of the same kernel (a
/// parallel lab, a kind cluster): only the global tracepoints see it.
fn foreign_connection(b: &mut Builder, t: u64) {
    let syn = tcp(tcp_flags::SYN, 7, 0, 9, 0x77, REQUEST);
    let t = b.path(
        syn,
        t,
        &[
            (tx(OTHER_CLIENT_NS, POD_ETH0), CLIENT, SVC),
            (rx(OTHER_NODE_NS, 9), CLIENT, SVC),
            (tx(OTHER_NODE_NS, 10), CLIENT, BACKEND),
        ],
    );
    let synack = tcp(tcp_flags::SYN | tcp_flags::ACK, 8, 8, 0, 0x78, REPLY);
    b.path(
        synack,
        t + 10_000,
        &[
            (rx(OTHER_NODE_NS, 10), BACKEND, CLIENT),
            (tx(OTHER_NODE_NS, 9), SVC, CLIENT),
            (rx(OTHER_CLIENT_NS, POD_ETH0), SVC, CLIENT),
        ],
    );
}

#[test]
fn flows_of_other_namespaces_are_counted_as_foreign_not_reported() {
    let mut b = Builder::default();
    foreign_connection(&mut b, T0);
    let (reports, summary) = run(&b.events, Some(true));
    assert!(reports.is_empty(), "{reports:#?}");
    assert_eq!(summary.foreign_flows, 1);
    assert_eq!(summary.flows, 0);

    // Next to a traced flow of the node, only the node's flow is reported.
    let mut events = fixture("seed000_healthy.jsonl");
    let mut b = Builder::default();
    foreign_connection(&mut b, T0 + 500 * 1_000_000);
    events.extend(b.events);
    events.sort_by_key(|e| e.ts_ns);
    let (reports, summary) = run(&events, Some(true));
    let r = only(&reports);
    assert_eq!(r.verdict, Verdict::Ok);
    assert_eq!(summary.foreign_flows, 1);
}

/// Seed 003 from node B (traced): the request is DNATed here and leaves by
/// flannel.1; the reply goes from node A straight to the office client,
/// which drops it and resets — all outside this node.
fn seed003_on_dnating_node() -> Vec<PacketEvent> {
    let mut b = Builder::default();
    let (c, s, be) = (OFFICE_CLIENT, SVC, REMOTE_BACKEND);
    let syn = tcp(tcp_flags::SYN, 42, 0, 300, 0x300, REQUEST);
    let t = b.route(
        syn,
        T0,
        &[
            &[(tx(OUTSIDE_NS, 2), c, s), (tc_in(ETH0), c, s)],
            &forwarded(c, s, be, c),
            &[(tc_out(FLANNEL), c, be)],
        ],
    );
    let synack = tcp(tcp_flags::SYN | tcp_flags::ACK, 77, 43, 0, 0x301, REPLY);
    b.path(
        synack,
        t + 100_000,
        &[
            (tx(OTHER_NODE_NS, 2), be, c),
            (rx(OUTSIDE_NS, 2), be, c),
            (drop(OUTSIDE_NS, 2, NO_SOCKET), be, c),
        ],
    );
    b.events
}

#[test]
fn seed003_reply_by_another_path_is_no_reply_through_this_node() {
    let (reports, _) = run(&seed003_on_dnating_node(), Some(true));
    let r = only(&reports);
    assert_eq!(r.verdict, Verdict::NoReply);
    let cause = r.cause.as_ref().unwrap();
    assert_eq!(cause.id, CauseId::NoReplyThroughNode);
    assert!(cause.text.contains("by another path"), "{}", cause.text);
    assert!(cause.hint.contains("masqueradeAll"));
}

#[test]
fn seed003_on_the_backend_node_reply_bypasses_the_dnating_node() {
    // Traced on node A: the request arrives by flannel.1 already DNATed,
    // the reply leaves by eth0 with the pod's source.
    let mut b = Builder::default();
    let (c, s, be) = (OFFICE_CLIENT, SVC, BACKEND);
    let syn = tcp(tcp_flags::SYN, 42, 0, 300, 0x400, REQUEST);
    let t = b.path(
        syn,
        T0,
        &[
            (tx(OUTSIDE_NS, 2), c, s),
            (rx(OTHER_NODE_NS, 2), c, s),
            (tx(OTHER_NODE_NS, 4), c, be),
            (tc_in(FLANNEL), c, be),
            (nf(PRE_ROUTING, BEFORE), c, be),
            (nf(PRE_ROUTING, AFTER), c, be),
            (nf(FORWARD, NONE), c, be),
            (tc_out(VETH_BACKEND), c, be),
        ],
    );
    let synack = tcp(tcp_flags::SYN | tcp_flags::ACK, 77, 43, 0, 0x401, REPLY);
    b.path(
        synack,
        t + 100_000,
        &[
            (tc_in(VETH_BACKEND), be, c),
            (nf(PRE_ROUTING, BEFORE), be, c),
            (nf(FORWARD, NONE), be, c),
            (tc_out(ETH0), be, c),
            (rx(OUTSIDE_NS, 2), be, c),
        ],
    );
    let (reports, _) = run(&b.events, Some(true));
    let r = only(&reports);
    assert_eq!(r.verdict, Verdict::ReplyNotReverseNated);
    let cause = r.cause.as_ref().unwrap();
    assert_eq!(cause.id, CauseId::ReplyBypassesDnatNode);
    assert!(
        cause
            .text
            .contains("by flannel.1 already DNATed to 100.96.54.247:80")
            && cause
                .text
                .contains("left by eth0 with source 100.96.54.247:80"),
        "{}",
        cause.text
    );
}

#[test]
fn hairpin_mode_off_names_the_bridge_port() {
    let b = hairpin_syn_not_sent_back();
    let (reports, _) = run(&b.events, Some(true));
    let r = only(&reports);
    assert_eq!(r.verdict, Verdict::NoReply);
    assert!(r.hairpin);
    let cause = r.cause.as_ref().unwrap();
    assert_eq!(cause.id, CauseId::HairpinModeOff);
    assert!(cause.text.contains("veth-client"), "{}", cause.text);
}

#[test]
fn hairpin_without_masquerade_reply_stays_in_the_pod() {
    let mut b = Builder::default();
    let me = CLIENT;
    let me_backend = (CLIENT.0, 80);
    let syn = tcp(tcp_flags::SYN, 10, 0, 1, 0x60, REQUEST);
    let t = b.route(
        syn,
        T0,
        &[
            &from_pod(CLIENT_NS, VETH_CLIENT, me, SVC),
            &forwarded(me, SVC, me_backend, me),
            &to_pod(VETH_CLIENT, CLIENT_NS, me, me_backend),
        ],
    );
    let synack = tcp(tcp_flags::SYN | tcp_flags::ACK, 20, 11, 0, 0x61, REPLY);
    b.path(
        synack,
        t + 20_000,
        &[
            (tx(CLIENT_NS, 1), me_backend, me),
            (rx(CLIENT_NS, 1), me_backend, me),
        ],
    );
    let (reports, _) = run(&b.events, Some(true));
    let r = only(&reports);
    assert_eq!(r.verdict, Verdict::ReplyNotReverseNated);
    assert_eq!(r.cause.as_ref().unwrap().id, CauseId::HairpinNotMasqueraded);
}

#[test]
fn every_cause_explains_a_verdict() {
    for id in CauseId::all() {
        assert!(!id.verdicts().is_empty(), "{id:?} has no rule");
        assert!(!id.incident().is_empty());
    }
    let _ = config(None);
}

/// README.md's "What nattrace recognises" table is this table: regenerate
/// it with `NATTRACE_README_TABLE=1 cargo test -p tracer-userspace readme -- --nocapture`.
#[test]
fn readme_table_matches_the_cause_table() {
    let table = markdown_table();
    if std::env::var_os("NATTRACE_README_TABLE").is_some() {
        println!("{table}");
    }
    let readme = include_str!("../../../../README.md");
    let section = readme
        .split("## What nattrace recognises")
        .nth(1)
        .expect("README.md has a '## What nattrace recognises' section");
    let rows: String = section
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(rows, table, "README.md's table is out of date");
}

/// Decides a recording the way `nattrace analyze` does.
fn decide_recording(text: &str) -> Vec<FlowReport> {
    let (mut reader, header) =
        crate::recording::Reader::new(std::io::BufReader::new(std::io::Cursor::new(text))).unwrap();
    let (out, _) = crate::recording::replay::decide_all(&mut reader, &header, None);
    assert!(reader.problem().is_none(), "{:?}", reader.problem());
    out
}

/// Recorded on a lab node (`nattrace --write`, scenario test
/// `root_service_without_endpoints_is_no_endpoints_naming_service_and_rule`
/// with NATTRACE_RECORD_NO_ENDPOINTS set): curl to a Service without
/// endpoints; kube-proxy's filter REJECT dropped the SYN after FORWARD.
#[test]
fn recorded_service_without_endpoints_is_no_endpoints() {
    let flows = decide_recording(include_str!(crate::fixture!("no_endpoints.rec")));
    assert_eq!(flows.len(), 1, "{flows:?}");
    let f = &flows[0];
    assert_eq!(f.verdict, Verdict::Dropped);
    let cause = f.cause.as_ref().expect("a cause");
    assert_eq!(cause.id, CauseId::NoEndpoints);
    assert_eq!(cause.clause, "default/web-empty:http has no endpoints");
    // Named although no KUBE-SVC chain names it (issue 28 item 4).
    assert!(f.kube.is_none());
    assert_eq!(f.k8s_service.as_deref(), Some("default/web-empty:http"));
    for needle in [
        "after netfilter FORWARD",
        "-A KUBE-SERVICES -d 100.67.30.140/32 -p tcp -m comment --comment \"default/web-empty:http has no endpoints\"",
        "kubectl get endpointslices -n default -l kubernetes.io/service-name=web-empty",
    ] {
        assert!(
            cause.text.contains(needle),
            "{needle:?} missing: {}",
            cause.text
        );
    }
}

/// The same events without the ruleset's REJECT: only the generic cause.
#[test]
fn netfilter_drop_without_a_no_endpoints_reject_stays_generic() {
    let text = include_str!(crate::fixture!("no_endpoints.rec"));
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let mut header: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
    header["kube_proxy"]["no_endpoints"] = serde_json::json!([]);
    lines[0] = header.to_string();
    let flows = decide_recording(&(lines.join("\n") + "\n"));
    assert_eq!(flows.len(), 1);
    let cause = flows[0].cause.as_ref().expect("a cause");
    assert_eq!(cause.id, CauseId::DroppedByNetfilter);
}
