//! The nftables proxier's NodePorts, LoadBalancer and external IPs (see
//! `ruleset/external.rs` for the shapes): `service-ips` elements that go to
//! an `external-…` chain, `service-nodeports`, the `nodeport-ips` set, and the
//! `drop` / `goto reject-chain` elements of `no-endpoint-services` and
//! `no-endpoint-nodeports`.
use std::net::IpAddr;

use serde_json::Value;

use super::{TABLE, Table, element, jumps_to, verdict_target, verdict_text};
use crate::ruleset::{
    KubeProxyRules,
    external::{ADDRTYPE_LOCAL, ExternalKind, ExternalRule, NorthSouth, TrafficPolicy},
    port_label,
};

/// `proto . port` elements (the NodePort maps), with their comment.
fn port_element(e: &Value) -> Option<(String, u16, Option<&str>, &Value)> {
    let (key, verdict) = (e.get(0)?, e.get(1)?);
    let (val, comment) = match key.get("elem") {
        Some(inner) => (&inner["val"], inner["comment"].as_str()),
        None => (key, None),
    };
    let c = val["concat"].as_array()?;
    Some((
        c.first()?.as_str()?.to_string(),
        u16::try_from(c.get(1)?.as_u64()?).ok()?,
        comment,
        verdict,
    ))
}

/// `external-HASH-ns/name/proto/port` → `ns/name/proto/port`.
fn external_part(chain: &str) -> Option<&str> {
    Some(chain.strip_prefix("external-")?.split_once('-')?.1)
}

/// The Service port's label from the ClusterIP's chain of the same
/// `ns/name/proto/port`, else from the chain name itself.
fn name_of(chain: &str, rules: &KubeProxyRules) -> String {
    let part = external_part(chain).unwrap_or_default();
    if let Some(s) = rules.services.iter().find(|s| {
        s.chain
            .split_once('-')
            .and_then(|(_, b)| b.split_once('-'))
            .map(|(_, p)| p)
            == Some(part)
    }) {
        return s.name.to_string();
    }
    let mut p = part.split('/');
    match (p.next(), p.next(), p.nth(1)) {
        (Some(ns), Some(name), Some(port)) => format!("{ns}/{name}:{port}"),
        _ => part.to_string(),
    }
}

/// Cluster: an unconditional `jump mark-for-masquerade`; Local: the
/// `fib saddr type local` short-circuits or a `goto local-…`.
fn policy(t: &Table<'_>, chain: &str) -> TrafficPolicy {
    let mut policy = TrafficPolicy::Unknown;
    for r in t.rules.iter().filter(|r| r.chain == chain) {
        if r.expr.len() == 1 && jumps_to(r.expr, "mark-for-masquerade") {
            return TrafficPolicy::Cluster;
        }
        let local_goto = r.expr.iter().any(|e| {
            e["goto"]["target"]
                .as_str()
                .is_some_and(|c| c.starts_with("local-"))
        });
        let fib_saddr = r.expr.iter().any(|e| e["match"]["left"]["fib"].is_object());
        if local_goto || fib_saddr {
            policy = TrafficPolicy::Local;
        }
    }
    policy
}

fn set_elems<'a>(items: &'a [Value], family: &str, name: &str) -> Option<Vec<&'a Value>> {
    items
        .iter()
        .filter_map(|i| i.get("set"))
        .find(|s| s["family"] == family && s["table"] == TABLE && s["name"] == name)
        .map(|s| {
            s["elem"]
                .as_array()
                .map(|a| a.iter().collect())
                .unwrap_or_default()
        })
}

/// This family's north-south entries, added to `rules` (which holds the
/// table's ClusterIP Services already).
pub(super) fn parse(items: &[Value], t: &Table<'_>, rules: &mut KubeProxyRules) {
    let ipv6 = t.family == "ip6";
    let elems = |map: &str| {
        t.maps
            .get(map)
            .and_then(|m| m["elem"].as_array())
            .map(Vec::as_slice)
            .unwrap_or(&[])
    };
    let mut ns = NorthSouth::default();
    // No `nodeport-ips` set: kube-proxy deletes it when every local address
    // accepts NodePorts (`nodePortAddresses.MatchAll()`), and checks with
    // `fib daddr type local` instead.
    match set_elems(items, t.family, "nodeport-ips") {
        Some(ips) => ns
            .nodeport_addresses
            .extend(ips.iter().filter_map(|v| v.as_str().map(str::to_string))),
        None => ns.nodeport_addresses.push(ADDRTYPE_LOCAL.to_string()),
    }
    for e in elems("service-ips") {
        let Some((ip, proto, port, _, verdict)) = element(e) else {
            continue;
        };
        let Some(chain) = verdict_target(verdict).filter(|c| c.starts_with("external-")) else {
            continue;
        };
        ns.external.push(ExternalRule {
            name: name_of(chain, rules),
            kind: ExternalKind::LoadBalancerOrExternalIp,
            ip: Some(ip),
            ipv6: ip.is_ipv6(),
            port,
            proto,
            chain: Some(chain.to_string()),
            policy: policy(t, chain),
            no_local_endpoints: None,
            no_endpoints: None,
            health_check_node_port: None,
        });
    }
    for e in elems("service-nodeports") {
        let Some((proto, port, _, verdict)) = port_element(e) else {
            continue;
        };
        let Some(chain) = verdict_target(verdict) else {
            continue;
        };
        ns.external.push(ExternalRule {
            name: name_of(chain, rules),
            kind: ExternalKind::NodePort,
            ip: None,
            ipv6,
            port,
            proto,
            chain: Some(chain.to_string()),
            policy: policy(t, chain),
            no_local_endpoints: None,
            no_endpoints: None,
            health_check_node_port: None,
        });
    }
    let mut filtered = |ip: Option<IpAddr>,
                        proto: String,
                        port: u16,
                        comment: Option<&str>,
                        verdict: &Value,
                        text: String| {
        let drop = verdict.get("drop").is_some();
        let name = comment.map_or_else(String::new, |c| {
            port_label(c, 0).trim_end_matches(":0").to_string()
        });
        let svc = name
            .rsplit_once(':')
            .map_or(name.as_str(), |(s, _)| s)
            .to_string();
        let entry = match ns.external.iter_mut().position(|e| {
            e.ip == ip
                && e.port == port
                && e.proto == proto
                && (svc.is_empty() || e.service() == svc)
        }) {
            Some(i) => &mut ns.external[i],
            None => {
                ns.external.push(ExternalRule {
                    name,
                    kind: if ip.is_some() {
                        ExternalKind::LoadBalancerOrExternalIp
                    } else {
                        ExternalKind::NodePort
                    },
                    ip,
                    ipv6: ip.map_or(ipv6, |i| i.is_ipv6()),
                    port,
                    proto,
                    chain: None,
                    policy: TrafficPolicy::Unknown,
                    no_local_endpoints: None,
                    no_endpoints: None,
                    health_check_node_port: None,
                });
                ns.external.last_mut().expect("just pushed")
            }
        };
        if drop {
            entry.policy = TrafficPolicy::Local;
            entry.no_local_endpoints = Some(text);
        } else {
            entry.no_endpoints = Some(text);
        }
    };
    let cluster_ips: Vec<IpAddr> = set_elems(items, t.family, "cluster-ips")
        .unwrap_or_default()
        .iter()
        .filter_map(|v| v.as_str()?.parse().ok())
        .collect();
    let comment_text = |c: Option<&str>| c.map(|c| format!(" comment \"{c}\"")).unwrap_or_default();
    for e in elems("no-endpoint-services") {
        let Some((ip, proto, port, comment, verdict)) = element(e) else {
            continue;
        };
        // A ClusterIP's element (reject, or drop for internalTrafficPolicy
        // Local) is not external traffic.
        if cluster_ips.contains(&ip) {
            continue;
        }
        let text = format!(
            "table {} {TABLE} map no-endpoint-services element {ip} . {proto} . {port}{} : {}",
            t.family,
            comment_text(comment),
            verdict_text(verdict)
        );
        filtered(Some(ip), proto, port, comment, verdict, text);
    }
    for e in elems("no-endpoint-nodeports") {
        let Some((proto, port, comment, verdict)) = port_element(e) else {
            continue;
        };
        let text = format!(
            "table {} {TABLE} map no-endpoint-nodeports element {proto} . {port}{} : {}",
            t.family,
            comment_text(comment),
            verdict_text(verdict)
        );
        filtered(None, proto, port, comment, verdict, text);
    }
    rules.north_south.merge(ns);
}
