//! Issue 22: a stale conntrack entry against a stale rule, from the real
//! recording of a request DNATed to a deleted pod (`stale_deleted_warm.rec`,
//! tests/tests/scenarios/stale.rs). The events are the same in both
//! incidents — the kernel DNATs to the gone address — and only kube-proxy's
//! rules tell them apart: with the pod's endpoint chain still in place the
//! rule is stale (`backend_unreachable`); with the rules already moved to
//! another pod, only the conntrack entry still sends packets there.
use std::net::SocketAddr;

use super::stale::DEAD;
use crate::collector::{CauseId, Verdict};
use crate::recording::Reader;
use crate::ruleset::KubeProxyRules;

const NEW: &str = "100.96.54.249:80";

/// The recording decided with its rules changed by `edit` (as re-read at
/// the decision), the way `analyze` would decide it.
fn decide_with(edit: impl FnOnce(&mut KubeProxyRules)) -> crate::collector::FlowReport {
    let bytes: &[u8] = include_bytes!(crate::fixture!("stale_deleted_warm.rec"));
    let (mut reader, mut header) = Reader::new(std::io::Cursor::new(bytes)).expect("recording");
    edit(&mut header.kube_proxy);
    let (reports, _) = crate::recording::replay::decide_all(&mut reader, &header, None);
    assert_eq!(reports.len(), 1, "{reports:#?}");
    reports.into_iter().next().unwrap()
}

fn move_endpoint(rules: &mut KubeProxyRules) {
    let dead: SocketAddr = DEAD.parse().unwrap();
    let svc = rules
        .services
        .iter_mut()
        .find(|s| s.endpoints.iter().any(|e| e.endpoint == dead))
        .expect("the recording's Service lists the dead pod");
    for e in &mut svc.endpoints {
        e.endpoint = NEW.parse().unwrap();
        e.chain = "KUBE-SEP-NEWPODNEWPODNEWP".into();
    }
}

#[test]
fn rule_still_in_place_is_a_stale_endpoint() {
    let r = decide_with(|_| {});
    assert_eq!(
        r.cause.as_ref().map(|c| c.id),
        Some(CauseId::BackendUnreachable),
        "{r:#?}"
    );
}

#[test]
fn rule_moved_elsewhere_is_a_stale_conntrack_entry_with_its_delete_command() {
    let r = decide_with(move_endpoint);
    assert_eq!(r.verdict, Verdict::Dropped, "{r:#?}");
    let cause = r.cause.as_ref().expect("a cause");
    assert_eq!(cause.id, CauseId::StaleConntrackEntry, "{r:#?}");
    assert!(
        cause.text.contains(DEAD) && cause.text.contains(NEW),
        "{}",
        cause.text
    );
    let client = r.client;
    let want = format!(
        "conntrack -D -p tcp --orig-src {} --orig-port-src {} --orig-dst 100.67.30.133 --orig-port-dst 80 --reply-src 100.96.54.247",
        client.ip(),
        client.port()
    );
    assert!(cause.hint.contains(&want), "{}", cause.hint);
    assert!(cause.text.contains(&want), "{}", cause.text);
    // TCP: kube-proxy never cleans these up itself.
    assert!(cause.hint.contains("never deletes TCP"), "{}", cause.hint);
}

#[test]
fn service_without_endpoints_now_is_a_stale_entry_too() {
    let r = decide_with(|rules| {
        let dead: SocketAddr = DEAD.parse().unwrap();
        let svc = rules
            .services
            .iter()
            .position(|s| s.endpoints.iter().any(|e| e.endpoint == dead))
            .unwrap();
        let svc = rules.services.remove(svc);
        rules.no_endpoints.push(crate::ruleset::RejectRule {
            ip: svc.cluster_ip,
            port: svc.port,
            protocol: svc.proto.clone(),
            port_name: svc.name.to_string(),
            rule: "-A KUBE-SERVICES ... -j REJECT".into(),
        });
    });
    let cause = r.cause.as_ref().expect("a cause");
    assert_eq!(cause.id, CauseId::StaleConntrackEntry, "{r:#?}");
    assert!(cause.text.contains("no endpoints now"), "{}", cause.text);
}

#[test]
fn rules_not_read_name_no_stale_entry() {
    let r = decide_with(|rules| *rules = KubeProxyRules::default());
    assert_ne!(
        r.cause.as_ref().map(|c| c.id),
        Some(CauseId::StaleConntrackEntry),
        "{r:#?}"
    );
}

/// The lab's recording (tests/tests/conntrack.rs, iptables mode): traced
/// from before the endpoint swap, so the header's rules still list the old
/// DNS pod and only the `rules` line the failing flow asked for tells the
/// stale entry from a stale rule.
#[test]
fn recorded_stale_udp_entry_beside_a_stale_rule_and_a_healthy_twin() {
    let bytes: &[u8] = include_bytes!(crate::fixture!("stale_entry_udp.rec"));
    let (mut reader, header) = Reader::new(std::io::Cursor::new(bytes)).expect("recording");
    let old: SocketAddr = "100.96.54.10:53".parse().unwrap();
    assert!(
        header
            .kube_proxy
            .services
            .iter()
            .any(|s| s.endpoints.iter().any(|e| e.endpoint == old)),
        "the header's rules are from before the swap"
    );
    let (reports, _) = crate::recording::replay::decide_all(&mut reader, &header, None);
    let by_port = |port: u16| {
        reports
            .iter()
            .find(|r| r.client.port() == port && r.service.port() == 53)
            .unwrap_or_else(|| panic!("no flow from port {port}: {reports:#?}"))
    };
    let stale = by_port(40053);
    let cause = stale.cause.as_ref().expect("a cause");
    assert_eq!(cause.id, CauseId::StaleConntrackEntry, "{stale:#?}");
    assert_eq!(stale.backend, Some(old));
    assert!(cause.text.contains("100.96.54.11:53"), "{}", cause.text);
    assert!(
        cause.hint.contains(
            "conntrack -D -p udp --orig-src 100.96.54.240 --orig-port-src 40053 --orig-dst 100.64.0.10 --orig-port-dst 53 --reply-src 100.96.54.10"
        ),
        "{}",
        cause.hint
    );
    assert!(cause.hint.contains("cleanup.go"), "{}", cause.hint);
    let fresh = by_port(40054);
    assert_eq!(fresh.verdict, Verdict::Ok, "{fresh:#?}");
    let web: Vec<_> = reports.iter().filter(|r| r.service.port() == 80).collect();
    assert!(!web.is_empty());
    for r in web {
        assert_eq!(
            r.cause.as_ref().map(|c| c.id),
            Some(CauseId::BackendUnreachable),
            "{r:#?}"
        );
    }
}
