//! Routed CNIs (Calico, kindnet, AWS VPC CNI): the pods' veths are ports of
//! no bridge, so the causes that speak of a bridge must never be named, even
//! when the evidence looks like seed 000's (a reply that passed no netfilter
//! hook) or seed 004's (a hairpin SYN that never came back).
use super::{fixture, only, run_with};
use crate::collector::{fixtures::*, *};
use crate::facts::Interface;

const MS: u64 = 1_000_000;
const VRF: u32 = 9;

const BRIDGE_CAUSES: &[CauseId] = &[
    CauseId::BridgeNfCallIptablesOff,
    CauseId::ReplyBridgedWithoutNetfilter,
    CauseId::HairpinModeOff,
];

/// The fixtures' node with its pod veths routed (no master), or enslaved to
/// a VRF (a master that is not a bridge).
fn facts(bridge_nf: Option<bool>, vrf: bool) -> NodeFacts {
    let mut facts = testing::facts(bridge_nf);
    facts.interfaces.retain(|i| i.kind != "bridge");
    for i in &mut facts.interfaces {
        if i.kind == "veth" {
            i.name = format!("cali{}", &i.name[5..]);
            i.master = vrf.then_some(VRF);
            i.hairpin = None;
        }
    }
    if vrf {
        facts.interfaces.push(Interface {
            ifindex: VRF,
            name: "vrf-pods".into(),
            kind: "vrf".into(),
            master: None,
            hairpin: None,
            mtu: 0,
        });
    }
    facts
}

fn run_routed(events: &[PacketEvent], bridge_nf: Option<bool>, vrf: bool) -> Vec<FlowReport> {
    let cfg = CollectorConfig {
        facts: facts(bridge_nf, vrf),
        ..testing::config(bridge_nf)
    };
    run_with(cfg, events, T0 + 10_000 * MS).0
}

#[test]
fn unreversed_reply_without_a_bridge_names_no_bridge_cause() {
    let events = fixture("seed000_broken.jsonl");
    for bridge_nf in [None, Some(false), Some(true)] {
        for vrf in [false, true] {
            let reports = run_routed(&events, bridge_nf, vrf);
            let r = only(&reports);
            assert_eq!(r.verdict, Verdict::ReplyNotReverseNated);
            let cause = r.cause.as_ref().map(|c| c.id);
            assert!(
                !cause.is_some_and(|c| BRIDGE_CAUSES.contains(&c)),
                "bridge_nf {bridge_nf:?}, vrf {vrf}: {cause:?}"
            );
        }
    }
    // The control: the same events on the bridged node do name it.
    let cfg = testing::config(Some(false));
    let (reports, _) = run_with(cfg, &events, T0 + 10_000 * MS);
    assert_eq!(
        only(&reports).cause.as_ref().map(|c| c.id),
        Some(CauseId::BridgeNfCallIptablesOff)
    );
}

#[test]
fn hairpin_without_a_bridge_is_not_hairpin_mode_off() {
    let b = hairpin_syn_not_sent_back();
    for vrf in [false, true] {
        let reports = run_routed(&b.events, Some(true), vrf);
        let r = only(&reports);
        assert_eq!(r.verdict, Verdict::NoReply);
        assert!(r.hairpin);
        let cause = r.cause.as_ref().map(|c| c.id);
        assert_ne!(cause, Some(CauseId::HairpinModeOff), "vrf {vrf}");
    }
}
