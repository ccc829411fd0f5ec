//! A big node's pod veths have no tc: the device tracepoints report their
//! packets instead (probes/tc.rs). Every fixture, with its pod-veth tc events
//! replaced by the tracepoint events the kernel reports there then, must give
//! the same verdicts, causes and backends.
use tracer_common::hook;

use super::run;
use crate::collector::testing::{NODE_NS, VETH_BACKEND, VETH_CLIENT, VETH_DNS};
use crate::collector::{fixtures, *};

/// tc on a pod veth → `netif_receive_skb`/`net_dev_start_xmit` on the same
/// device; device events carry the device's namespace, tc events 0.
fn without_tc_on_pod_veths(events: &[PacketEvent]) -> Vec<PacketEvent> {
    events
        .iter()
        .map(|e| {
            let mut e = *e;
            let on_pod_veth = [VETH_CLIENT, VETH_BACKEND, VETH_DNS].contains(&e.ifindex);
            if on_pod_veth && (e.hook == hook::TC_INGRESS || e.hook == hook::TC_EGRESS) {
                e.hook = if e.hook == hook::TC_INGRESS {
                    hook::DEV_RX
                } else {
                    hook::DEV_TX
                };
                e.netns = NODE_NS;
            }
            e
        })
        .collect()
}

fn outcome(r: &FlowReport) -> String {
    format!(
        "{:?} {} {:?} {:?} hairpin={} cause={:?}",
        r.verdict,
        r.client,
        r.backend,
        r.snat,
        r.hairpin,
        r.cause.as_ref().map(|c| c.id)
    )
}

#[test]
fn pod_veths_by_tracepoints_give_the_same_verdicts_and_causes() {
    let mut compared = Vec::new();
    for (name, events) in fixtures::all() {
        let converted = without_tc_on_pod_veths(&events);
        if converted.iter().zip(&events).all(|(a, b)| a.hook == b.hook) {
            // No pod veth on this node's path (e.g. the backend elsewhere).
            continue;
        }
        compared.push(name);
        for bridge_nf in [Some(true), Some(false), None] {
            let (with_tc, _) = run(&events, bridge_nf);
            let (without, _) = run(&converted, bridge_nf);
            assert!(!with_tc.is_empty(), "{name}");
            let a: Vec<String> = with_tc.iter().map(outcome).collect();
            let b: Vec<String> = without.iter().map(outcome).collect();
            assert_eq!(a, b, "{name}, bridge-nf-call-iptables {bridge_nf:?}");
        }
    }
    for name in ["seed000_broken.jsonl", "seed000_healthy.jsonl"] {
        assert!(
            compared.contains(&name),
            "{name} not compared: {compared:?}"
        );
    }
}
