//! kube-proxy's nftables mode (`table ip kube-proxy`, and `table ip6
//! kube-proxy` from the IPv6 proxier of a dual-stack or IPv6 node), read from
//! `nft -j list ruleset` into the same [`KubeProxyRules`] the iptables reader
//! fills, so flows name their Service and chains whichever mode wrote them.
//!
//! kube-proxy's layout (pkg/proxy/nftables/proxier.go): the `service-ips`
//! verdict map sends `ip . proto . port` to `service-HASH-ns/name/proto/port`
//! (or `local-…` for internalTrafficPolicy Local), whose `numgen random mod N
//! vmap` picks an `endpoint-HASH-ns/name/proto/port__ip/port` chain that DNATs.
//! Services without endpoints are elements of `no-endpoint-services`.
use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
};

use serde_json::Value;

use super::{KubeProxyRules, ProxyMode, RejectRule, SepRule, SvcRule};

mod external;

/// kube-proxy's table name (family `ip`; `ip6` holds the IPv6 half).
const TABLE: &str = "kube-proxy";
/// The families kube-proxy writes a table for (one proxier per family).
const FAMILIES: [&str; 2] = ["ip", "ip6"];
const MARK_MASQ: &str = "mark-for-masquerade";

/// One rule: its chain and its statements.
struct Rule<'a> {
    chain: &'a str,
    expr: &'a [Value],
}

/// The parts of `nft -j` output that belong to one `table <family> kube-proxy`.
struct Table<'a> {
    family: &'a str,
    rules: Vec<Rule<'a>>,
    maps: BTreeMap<&'a str, &'a Value>,
    chains: Vec<&'a str>,
}

fn table<'a>(items: &'a [Value], family: &'a str) -> Option<Table<'a>> {
    let ours = |o: &Value| o["family"] == family && o["table"] == TABLE;
    if !items
        .iter()
        .any(|i| i["table"]["family"] == family && i["table"]["name"] == TABLE)
    {
        return None;
    }
    let mut t = Table {
        family,
        rules: Vec::new(),
        maps: BTreeMap::new(),
        chains: Vec::new(),
    };
    for item in items {
        if let Some(r) = item.get("rule").filter(|r| ours(r))
            && let (Some(chain), Some(expr)) = (r["chain"].as_str(), r["expr"].as_array())
        {
            t.rules.push(Rule { chain, expr });
        } else if let Some(m) = item.get("map").filter(|m| ours(m))
            && let Some(name) = m["name"].as_str()
        {
            t.maps.insert(name, m);
        } else if let Some(c) = item.get("chain").filter(|c| ours(c))
            && let Some(name) = c["name"].as_str()
        {
            t.chains.push(name);
        }
    }
    Some(t)
}

/// `HASH-ns/name/proto/port` → ("ns/name:port", "proto").
fn port_name(base: &str) -> Option<(String, String)> {
    let (_hash, rest) = base.split_once('-')?;
    let mut parts = rest.split('/');
    let (ns, name, proto, port) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    Some((format!("{ns}/{name}:{port}"), proto.to_string()))
}

/// The `ns/name/proto/port` part of a service or endpoint chain name, which
/// ties an endpoint chain to its Service (the hash differs, this does not).
fn service_part(chain: &str) -> Option<&str> {
    let base = chain
        .strip_prefix("service-")
        .or_else(|| chain.strip_prefix("local-"))
        .or_else(|| chain.strip_prefix("endpoint-"))?;
    let rest = base.split_once('-')?.1;
    Some(rest.split("__").next().unwrap_or(rest))
}

/// `{"match": {"left": {"payload": {"protocol": "ip"|"ip6", "field": F}}, "op": OP, "right": R}}`.
fn ip_match<'a>(expr: &'a Value, field: &str) -> Option<(&'a str, &'a Value)> {
    let m = expr.get("match")?;
    let p = &m["left"]["payload"];
    ((p["protocol"] == "ip" || p["protocol"] == "ip6") && p["field"] == field)
        .then_some((m["op"].as_str()?, &m["right"]))
}

fn jumps_to(expr: &[Value], target: &str) -> bool {
    expr.iter().any(|e| e["jump"]["target"] == target)
}

/// A rule that marks for masquerade: (daddr matched, saddr (op, value) matched).
fn masq_rule<'a>(r: &Rule<'a>) -> Option<(bool, Option<(&'a str, &'a Value)>)> {
    if !jumps_to(r.expr, MARK_MASQ) {
        return None;
    }
    let daddr = r.expr.iter().any(|e| ip_match(e, "daddr").is_some());
    let saddr = r.expr.iter().find_map(|e| ip_match(e, "saddr"));
    Some((daddr, saddr))
}

fn prefix_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        v => Some(format!(
            "{}/{}",
            v["prefix"]["addr"].as_str()?,
            v["prefix"]["len"].as_u64()?
        )),
    }
}

/// `[{"concat": [ip, proto, port]}` or `{"elem": {"val": {"concat": …}, "comment": …}}, verdict]`.
fn element(e: &Value) -> Option<(IpAddr, String, u16, Option<&str>, &Value)> {
    let (key, verdict) = (e.get(0)?, e.get(1)?);
    let (val, comment) = match key.get("elem") {
        Some(inner) => (&inner["val"], inner["comment"].as_str()),
        None => (key, None),
    };
    let c = val["concat"].as_array()?;
    Some((
        c.first()?.as_str()?.parse().ok()?,
        c.get(1)?.as_str()?.to_string(),
        u16::try_from(c.get(2)?.as_u64()?).ok()?,
        comment,
        verdict,
    ))
}

fn verdict_target(v: &Value) -> Option<&str> {
    v["goto"]["target"]
        .as_str()
        .or_else(|| v["jump"]["target"].as_str())
}

fn verdict_text(v: &Value) -> String {
    match verdict_target(v) {
        Some(t) if v.get("goto").is_some() => format!("goto {t}"),
        Some(t) => format!("jump {t}"),
        None => v
            .as_object()
            .and_then(|o| o.keys().next().cloned())
            .unwrap_or_default(),
    }
}

fn endpoint(chain: &str, rules: &[&Rule<'_>]) -> Option<SepRule> {
    let dnat = rules
        .iter()
        .find_map(|r| r.expr.iter().find_map(|e| e.get("dnat")))?;
    let ip: IpAddr = dnat["addr"].as_str()?.parse().ok()?;
    let port = u16::try_from(dnat["port"].as_u64()?).ok()?;
    let hairpin_masq = rules.iter().any(|r| {
        matches!(masq_rule(r), Some((_, Some(("==", v)))) if v.as_str() == Some(&ip.to_string()))
    });
    Some(SepRule {
        chain: chain.into(),
        endpoint: SocketAddr::new(ip, port),
        hairpin_masq,
    })
}

/// Parses `nft -j list ruleset`; None when it is not nft JSON or holds no
/// `table ip kube-proxy` and no `table ip6 kube-proxy`. Both halves of a
/// dual-stack node come back as one set of rules.
pub fn parse(json: &str) -> Option<KubeProxyRules> {
    let root: Value = serde_json::from_str(json).ok()?;
    let items = root["nftables"].as_array()?;
    let mut out: Option<KubeProxyRules> = None;
    for family in FAMILIES {
        let Some(t) = table(items, family) else {
            continue;
        };
        let mut rules = parse_table(&t);
        external::parse(items, &t, &mut rules);
        match &mut out {
            Some(o) => o.merge(rules),
            None => out = Some(rules),
        }
    }
    out
}

fn parse_table(t: &Table<'_>) -> KubeProxyRules {
    let mut by_chain: BTreeMap<&str, Vec<&Rule<'_>>> = BTreeMap::new();
    for r in &t.rules {
        by_chain.entry(r.chain).or_default().push(r);
    }
    let mut out = KubeProxyRules {
        mode: ProxyMode::Nftables,
        ..KubeProxyRules::default()
    };
    let elems = |map: &str| {
        t.maps
            .get(map)
            .and_then(|m| m["elem"].as_array())
            .map(Vec::as_slice)
            .unwrap_or(&[])
    };
    for e in elems("service-ips") {
        let Some((ip, proto, port, _, verdict)) = element(e) else {
            continue;
        };
        // `external-…` chains serve ExternalIPs / LoadBalancer IPs; only
        // ClusterIPs go straight to the policy chain.
        let Some(chain) = verdict_target(verdict)
            .filter(|c| c.starts_with("service-") || c.starts_with("local-"))
        else {
            continue;
        };
        let Some(part) = service_part(chain) else {
            continue;
        };
        let Some((name, _)) = chain.split_once('-').and_then(|(_, b)| port_name(b)) else {
            continue;
        };
        let rules = by_chain.get(chain).map(Vec::as_slice).unwrap_or(&[]);
        let mut masquerade_all = false;
        for r in rules {
            match masq_rule(r) {
                Some((true, None)) => masquerade_all = true,
                Some((true, Some(("!=", cidr)))) => out.cluster_cidr = prefix_text(cidr),
                _ => {}
            }
        }
        // The vmap's order first, then endpoint chains it does not (or no
        // longer) name, matched by their `ns/name/proto/port` part.
        let mut chains: Vec<&str> = rules
            .iter()
            .flat_map(|r| r.expr.iter())
            .filter_map(|e| e["vmap"]["data"]["set"].as_array())
            .flatten()
            .filter_map(|pair| verdict_target(pair.get(1)?))
            .collect();
        chains.extend(
            t.chains
                .iter()
                .filter(|c| c.starts_with("endpoint-") && service_part(c) == Some(part)),
        );
        let mut endpoints: Vec<SepRule> = Vec::new();
        for c in chains {
            if endpoints.iter().any(|e| *e.chain == *c) {
                continue;
            }
            let rules = by_chain.get(c).map(Vec::as_slice).unwrap_or(&[]);
            endpoints.extend(endpoint(c, rules));
        }
        out.services.push(SvcRule {
            name: super::port_label(&name, port).into(),
            cluster_ip: ip,
            port,
            proto,
            chain: chain.into(),
            masquerade_all,
            endpoints,
        });
    }
    for e in elems("no-endpoint-services") {
        let Some((ip, protocol, port, comment, verdict)) = element(e) else {
            continue;
        };
        // `drop`: endpoints exist, none on this node (a Local traffic
        // policy): not "no endpoints" (external.rs).
        if verdict.get("drop").is_some() {
            continue;
        }
        let port_name = super::port_label(comment.unwrap_or_default(), port);
        out.no_endpoints.push(RejectRule {
            rule: format!(
                "table {} {TABLE} map no-endpoint-services element {ip} . {protocol} . {port}{} : {}",
                t.family,
                comment
                    .map(|c| format!(" comment \"{c}\""))
                    .unwrap_or_default(),
                verdict_text(verdict)
            ),
            ip,
            port,
            protocol,
            port_name,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `nft -j list ruleset` on a lab node (seed 000 + kube-dns + a Service
    /// without endpoints, nftables mode). The scenarios test
    /// `root_nft_reader_fixture_is_the_labs_nft_json` checks it against the
    /// lab; regenerate it (as root) with
    /// `NATTRACE_WRITE_FIXTURE=1 cargo test -p nattrace-tests --test scenarios root_nft_reader_fixture_is_the_labs_nft_json`.
    const LAB_NFT: &str = include_str!(crate::fixture!("ruleset/lab_nft.json"));

    fn ep(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    /// Issue 26 item 12: the nftables proxier names an unnamed port's
    /// chains `.../tcp/` (empty port name): labelled with the number.
    #[test]
    fn unnamed_port_is_labelled_with_its_number() {
        let nft = LAB_NFT.replace("default/web/tcp/http", "prod/export/tcp/");
        let rules = parse(&nft).expect("kube-proxy table");
        let m = rules
            .lookup(ep("100.67.30.133:80"), "tcp", Some(ep("100.96.54.247:80")))
            .unwrap();
        assert_eq!(&*m.service, "prod/export:80");
    }

    #[test]
    fn lab_ruleset_names_service_and_chains() {
        let rules = parse(LAB_NFT).expect("kube-proxy table");
        assert_eq!(rules.mode, ProxyMode::Nftables);
        assert_eq!(rules.source, None);
        assert_eq!(rules.services.len(), 2, "{rules:#?}");
        let m = rules
            .lookup(ep("100.67.30.133:80"), "tcp", Some(ep("100.96.54.247:80")))
            .unwrap();
        assert_eq!(&*m.service, "default/web:http");
        assert_eq!(&*m.svc_chain, "service-SUSTUHLJ-default/web/tcp/http");
        assert_eq!(
            m.sep_chain.as_deref(),
            Some("endpoint-G4WC27HT-default/web/tcp/http__100.96.54.247/80")
        );
        assert_eq!(m.hairpin_masq, Some(true));
        // Pinned away from the vmap, the other endpoint's chain is still known.
        let other = rules
            .lookup(ep("100.67.30.133:80"), "tcp", Some(ep("100.96.55.21:80")))
            .unwrap();
        assert_eq!(
            other.sep_chain.as_deref(),
            Some("endpoint-2TPY5KYF-default/web/tcp/http__100.96.55.21/80")
        );
        let dns = rules
            .lookup(ep("100.64.0.10:53"), "udp", Some(ep("100.96.54.247:53")))
            .unwrap();
        assert_eq!(&*dns.service, "kube-system/kube-dns:dns");
        assert_eq!(
            &*dns.svc_chain,
            "service-FY5PMXPG-kube-system/kube-dns/udp/dns"
        );
        assert!(rules.lookup(ep("100.64.0.10:53"), "tcp", None).is_none());
        assert_eq!(rules.masquerade_all(), Some(false));
        assert_eq!(rules.cluster_cidr.as_deref(), Some("100.96.0.0/11"));
    }

    #[test]
    fn services_without_endpoints_are_reject_rules() {
        let rules = parse(LAB_NFT).unwrap();
        assert_eq!(
            rules.no_endpoints,
            vec![RejectRule {
                ip: "100.67.40.7".parse().unwrap(),
                port: 80,
                protocol: "tcp".into(),
                port_name: "default/empty:http".into(),
                rule: "table ip kube-proxy map no-endpoint-services element 100.67.40.7 . tcp . 80 comment \"default/empty:http\" : goto reject-chain".into(),
            }]
        );
        assert!(rules.lookup(ep("100.67.40.7:80"), "tcp", None).is_none());
    }

    /// The fixture edited the way kube-proxy writes `masqueradeAll: true` and a
    /// ruleset without the hairpin rule.
    #[test]
    fn masquerade_all_and_missing_hairpin_masquerade() {
        let mut v: Value = serde_json::from_str(LAB_NFT).unwrap();
        let items = v["nftables"].as_array_mut().unwrap();
        items.retain(|i| {
            let r = &i["rule"];
            !(r["chain"]
                .as_str()
                .is_some_and(|c| c.starts_with("endpoint-"))
                && jumps_to(r["expr"].as_array().unwrap(), MARK_MASQ))
        });
        for i in items.iter_mut() {
            if let Some(expr) = i["rule"]["expr"].as_array_mut() {
                expr.retain(|e| ip_match(e, "saddr").is_none_or(|(op, _)| op != "!="));
            }
        }
        let rules = parse(&v.to_string()).unwrap();
        assert_eq!(rules.masquerade_all(), Some(true));
        assert_eq!(rules.cluster_cidr, None);
        let m = rules
            .lookup(ep("100.67.30.133:80"), "tcp", Some(ep("100.96.54.247:80")))
            .unwrap();
        assert_eq!(m.hairpin_masq, Some(false));
    }

    #[test]
    fn no_kube_proxy_table_or_not_json() {
        assert!(parse("not json").is_none());
        assert!(
            parse(r#"{"nftables": [{"metainfo": {"version": "1.0.6"}}, {"table": {"family": "inet", "name": "filter", "handle": 1}}]}"#)
                .is_none()
        );
        // Another family's table of that name is not kube-proxy's.
        assert!(
            parse(
                r#"{"nftables": [{"table": {"family": "inet", "name": "kube-proxy", "handle": 1}}]}"#
            )
            .is_none()
        );
        // An IPv6-only node has only the ip6 half.
        let v6 = parse(
            r#"{"nftables": [{"table": {"family": "ip6", "name": "kube-proxy", "handle": 1}}]}"#,
        )
        .expect("ip6 table");
        assert_eq!(v6.mode, ProxyMode::Nftables);
    }

    #[test]
    fn chain_names_give_the_service_port_name() {
        assert_eq!(
            port_name("ULMVA6XW-ns1/svc1/tcp/p80"),
            Some(("ns1/svc1:p80".into(), "tcp".into()))
        );
        assert_eq!(
            service_part("endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"),
            Some("ns1/svc1/tcp/p80")
        );
        assert_eq!(
            service_part("service-ULMVA6XW-ns1/svc1/tcp/p80"),
            Some("ns1/svc1/tcp/p80")
        );
    }

    /// `nft -j list table ip6 kube-proxy` of a dual-stack lab node (the
    /// ipv6 test `root_ipv6_reader_fixtures_are_the_labs` keeps it in sync).
    const LAB_NFT6: &str = include_str!(crate::fixture!("ruleset/lab_nft6.json"));

    #[test]
    fn ip6_table_names_ipv6_services_and_chains() {
        let rules = parse(LAB_NFT6).expect("table ip6 kube-proxy");
        assert_eq!(rules.mode, ProxyMode::Nftables);
        let m = rules
            .lookup(
                ep("[fd00:10:96::1e85]:80"),
                "tcp",
                Some(ep("[fd00:10:244:36::f7]:80")),
            )
            .unwrap();
        assert_eq!(&*m.service, "default/web:http");
        assert_eq!(&*m.svc_chain, "service-SUSTUHLJ-default/web/tcp/http");
        assert_eq!(
            m.sep_chain.as_deref(),
            Some("endpoint-MSP7NJV3-default/web/tcp/http__fd00.10.244.36..f7/80")
        );
        assert_eq!(m.hairpin_masq, Some(true));
        assert_eq!(rules.cluster_cidr.as_deref(), Some("fd00:10:244::/56"));
        assert_eq!(
            rules.no_endpoints,
            vec![RejectRule {
                ip: "fd00:10:96::1e8c".parse().unwrap(),
                port: 80,
                protocol: "tcp".into(),
                port_name: "default/empty:http".into(),
                rule: "table ip6 kube-proxy map no-endpoint-services element fd00:10:96::1e8c . tcp . 80 comment \"default/empty:http\" : goto reject-chain".into(),
            }]
        );
    }

    /// One `nft -j list ruleset` holding both tables, as on a dual-stack node.
    #[test]
    fn dual_stack_ruleset_gives_both_families() {
        let mut v4: Value = serde_json::from_str(LAB_NFT).unwrap();
        let v6: Value = serde_json::from_str(LAB_NFT6).unwrap();
        let items = v4["nftables"].as_array_mut().unwrap();
        items.extend(v6["nftables"].as_array().unwrap().iter().cloned());
        let rules = parse(&v4.to_string()).unwrap();
        assert_eq!(rules.services.len(), 4, "{rules:#?}");
        let a = rules.lookup(ep("100.67.30.133:80"), "tcp", None).unwrap();
        let b = rules
            .lookup(ep("[fd00:10:96::1e85]:80"), "tcp", None)
            .unwrap();
        assert_eq!((a.service, a.svc_chain), (b.service, b.svc_chain));
        // The IPv4 half's cluster CIDR is kept.
        assert_eq!(rules.cluster_cidr.as_deref(), Some("100.96.0.0/11"));
        assert_eq!(rules.no_endpoints.len(), 2);
    }
}
