//! Continuous mode: a bounded flow table over a long run, and Services that
//! appear and disappear while tracing (`--all-services`).
use tracer_common::{PacketEvent, direction::REQUEST};

use super::fixture;
use crate::collector::{fixtures::*, *};
use crate::ruleset::SvcRule;

const MS: u64 = 1_000_000;

/// `base` again as connection `n`: another client port, other skbs, later.
fn nth_connection(base: &[PacketEvent], n: u16, gap_ns: u64) -> Vec<PacketEvent> {
    let mut out = base.to_vec();
    for e in &mut out {
        let port = if e.direction == REQUEST {
            &mut e.sport
        } else {
            &mut e.dport
        };
        if *port == CLIENT.1 {
            *port = CLIENT.1 + n;
        }
        e.skb += 0x1000 * u64::from(n);
        e.ts_ns += gap_ns * u64::from(n);
    }
    out
}

#[test]
fn a_long_run_keeps_at_most_max_flows_and_counts_evictions() {
    let base = fixture("seed000_healthy.jsonl");
    let cfg = CollectorConfig {
        max_live_flows: 8,
        ..config(Some(true))
    };
    let mut c = Collector::new(cfg);
    let mut decided = 0;
    let connections = 500u16;
    for n in 0..connections {
        for ev in nth_connection(&base, n, 5 * MS) {
            c.push(ev);
        }
        assert!(c.live_flows() <= 8, "{} live flows", c.live_flows());
        let now = base[0].ts_ns + 5 * MS * u64::from(n);
        decided += c.tick(now).len();
    }
    let (rest, summary) = c.finish(base[0].ts_ns + 5 * MS * u64::from(connections) + 10_000 * MS);
    decided += rest.len();
    // Every connection is reported once; the oldest went out to make room.
    assert_eq!(decided, usize::from(connections));
    assert_eq!(summary.flows, u64::from(connections));
    assert_eq!(summary.evicted_flows, u64::from(connections) - 8);
}

#[test]
fn decided_flows_do_not_accumulate() {
    let base = fixture("seed000_healthy.jsonl");
    let mut c = Collector::new(config(Some(true)));
    // One connection a second for ten minutes, well under the limit: the
    // decided ones are forgotten after the idle timeout.
    let secs = 600u16;
    for n in 0..secs {
        for ev in nth_connection(&base, n, 1_000 * MS) {
            c.push(ev);
        }
        c.tick(base[0].ts_ns + 1_000 * MS * u64::from(n) + 500 * MS);
    }
    let idle_s = (CollectorConfig::default().idle_timeout_ns / 1_000 / MS) as usize;
    assert!(
        c.live_flows() <= idle_s + 2,
        "{} flows still held",
        c.live_flows()
    );
    assert_eq!(c.summary().evicted_flows, 0);
    assert_eq!(c.summary().flows, u64::from(secs));
}

fn web_rule() -> KubeProxyRules {
    KubeProxyRules {
        services: vec![SvcRule {
            name: "default/web:http".into(),
            cluster_ip: SVC.0.into(),
            port: SVC.1,
            proto: "tcp".into(),
            chain: "KUBE-SVC-WEB".into(),
            masquerade_all: false,
            endpoints: vec![],
        }],
        ..KubeProxyRules::default()
    }
}

#[test]
fn all_services_follow_the_rules() {
    let base = fixture("seed000_healthy.jsonl");
    let cfg = CollectorConfig {
        services: Vec::new(),
        all_services: true,
        ..config(Some(true))
    };
    let mut c = Collector::new(cfg);
    assert_eq!(c.traced_services(), 0);
    // Not in the rules yet: nothing to follow.
    for ev in nth_connection(&base, 0, 0) {
        c.push(ev);
    }
    assert!(c.tick(base[0].ts_ns + 5_000 * MS).is_empty());
    // The Service appears in kube-proxy's rules: traced and named.
    c.update_rules(web_rule());
    assert_eq!(c.traced_services(), 1);
    for ev in nth_connection(&base, 1, 10_000 * MS) {
        c.push(ev);
    }
    let reports = c.tick(base[0].ts_ns + 15_000 * MS);
    assert_eq!(reports.len(), 1);
    assert_eq!(reports[0].verdict, Verdict::Ok);
    assert_eq!(
        reports[0].kube.as_ref().map(|k| &*k.service),
        Some("default/web:http")
    );
    // Gone again: new connections are not followed.
    c.update_rules(KubeProxyRules::default());
    for ev in nth_connection(&base, 2, 20_000 * MS) {
        c.push(ev);
    }
    let (rest, summary) = c.finish(base[0].ts_ns + 30_000 * MS);
    assert!(rest.is_empty());
    assert_eq!(summary.flows, 1);
}
