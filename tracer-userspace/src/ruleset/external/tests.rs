//! kube-proxy's north-south rules in the shapes pkg/proxy/iptables and
//! pkg/proxy/nftables write them (iptables-save's option order).
use std::net::IpAddr;

use super::*;
use crate::ruleset::{nft, parse_save};

const NODE: &str = "192.168.50.2";

/// `ns/np:http` (Cluster policy, NodePort 30090, LB IP 203.0.113.10, external
/// IP 198.51.100.7) and `ns/loc:http` (Local policy, NodePort 30091, its only
/// endpoint on another node), iptables mode, default --nodeport-addresses.
pub(crate) const SAVE: &str = r#"*filter
:KUBE-EXTERNAL-SERVICES - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A KUBE-EXTERNAL-SERVICES -p tcp -m comment --comment "ns/loc:http has no local endpoints" -m addrtype --dst-type LOCAL -m tcp --dport 30091 -j DROP
-A KUBE-NODEPORTS -p tcp -m comment --comment "ns/loc:http health check node port" -m tcp --dport 32000 -j ACCEPT
COMMIT
*nat
:KUBE-EXT-NP - [0:0]
:KUBE-EXT-LOC - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-NP - [0:0]
:KUBE-SVC-LOC - [0:0]
:KUBE-SVL-LOC - [0:0]
-A KUBE-EXT-LOC -s 10.244.0.0/16 -m comment --comment "pod traffic for ns/loc:http external destinations" -j KUBE-SVC-LOC
-A KUBE-EXT-LOC -m comment --comment "masquerade LOCAL traffic for ns/loc:http external destinations" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ
-A KUBE-EXT-LOC -m comment --comment "route LOCAL traffic for ns/loc:http external destinations" -m addrtype --src-type LOCAL -j KUBE-SVC-LOC
-A KUBE-EXT-NP -m comment --comment "masquerade traffic for ns/np:http external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-NP -j KUBE-SVC-NP
-A KUBE-NODEPORTS -p tcp -m comment --comment "ns/np:http" -m tcp --dport 30090 -j KUBE-EXT-NP
-A KUBE-NODEPORTS -p tcp -m comment --comment "ns/loc:http" -m tcp --dport 30091 -j KUBE-EXT-LOC
-A KUBE-SERVICES -d 10.96.0.20/32 -p tcp -m comment --comment "ns/np:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-NP
-A KUBE-SERVICES -d 198.51.100.7/32 -p tcp -m comment --comment "ns/np:http external IP" -m tcp --dport 80 -j KUBE-EXT-NP
-A KUBE-SERVICES -d 203.0.113.10/32 -p tcp -m comment --comment "ns/np:http loadbalancer IP" -m tcp --dport 80 -j KUBE-EXT-NP
-A KUBE-SERVICES -d 10.96.0.21/32 -p tcp -m comment --comment "ns/loc:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-LOC
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-SVC-NP -m comment --comment "ns/np:http -> 10.244.1.5:8080" -j KUBE-SEP-A
-A KUBE-SEP-A -p tcp -m comment --comment "ns/np:http" -m tcp -j DNAT --to-destination 10.244.1.5:8080
-A KUBE-SVC-LOC -m comment --comment "ns/loc:http -> 10.244.2.5:8080" -j KUBE-SEP-B
-A KUBE-SEP-B -p tcp -m comment --comment "ns/loc:http" -m tcp -j DNAT --to-destination 10.244.2.5:8080
COMMIT
"#;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn with_node(mut rules: KubeProxyRules) -> KubeProxyRules {
    rules.north_south.node_addresses = vec![ip(NODE), ip("10.244.0.1")];
    rules
}

#[test]
fn iptables_nodeports_lb_and_external_ips_with_their_policy() {
    let rules = with_node(parse_save(SAVE));
    let ns = &rules.north_south;
    assert_eq!(ns.nodeport_addresses, vec![ADDRTYPE_LOCAL.to_string()]);
    let np = ns
        .find(ip(NODE), 30090, "tcp")
        .expect("NodePort on the node's address");
    assert_eq!(
        (np.name.as_str(), np.kind, np.policy, np.chain.as_deref()),
        (
            "ns/np:http",
            ExternalKind::NodePort,
            TrafficPolicy::Cluster,
            Some("KUBE-EXT-NP")
        )
    );
    assert!(
        ns.find(ip("192.168.50.9"), 30090, "tcp").is_none(),
        "not a node address"
    );
    assert!(ns.find(ip(NODE), 30090, "udp").is_none());
    let lb = ns.find(ip("203.0.113.10"), 80, "tcp").unwrap();
    assert_eq!(lb.kind, ExternalKind::LoadBalancer);
    assert_eq!(lb.policy, TrafficPolicy::Cluster);
    let ext = ns.find(ip("198.51.100.7"), 80, "tcp").unwrap();
    assert_eq!(ext.kind, ExternalKind::ExternalIp);
    let loc = ns.find(ip(NODE), 30091, "tcp").unwrap();
    assert_eq!(loc.name, "ns/loc:http");
    assert_eq!(loc.policy, TrafficPolicy::Local);
    assert_eq!(
        loc.no_local_endpoints.as_deref(),
        Some(
            r#"-A KUBE-EXTERNAL-SERVICES -p tcp -m comment --comment "ns/loc:http has no local endpoints" -m addrtype --dst-type LOCAL -m tcp --dport 30091 -j DROP"#
        )
    );
    assert_eq!(loc.health_check_node_port, Some(32000));
    assert_eq!(np.health_check_node_port, None);
    assert_eq!(ns.node_port_addrs(false), vec![ip("10.244.0.1"), ip(NODE)]);
}

#[test]
fn nodeport_addresses_flag_as_written() {
    let save = SAVE.replace(
        r#"-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"#,
        r#"-A KUBE-SERVICES -d 192.168.50.2/32 -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -j KUBE-NODEPORTS"#,
    );
    let mut rules = parse_save(&save);
    rules.north_south.node_addresses = vec![ip(NODE), ip("10.244.0.1")];
    let ns = &rules.north_south;
    assert_eq!(ns.nodeport_addresses, vec![NODE.to_string()]);
    assert!(ns.find(ip(NODE), 30090, "tcp").is_some());
    assert!(ns.find(ip("10.244.0.1"), 30090, "tcp").is_none());
    // IPv4 without --iptables-localhost-nodeports, as kube-proxy writes it.
    let save = SAVE.replace(
        "-m addrtype --dst-type LOCAL -j KUBE-NODEPORTS",
        "-m addrtype --dst-type LOCAL ! -d 127.0.0.0/8 -j KUBE-NODEPORTS",
    );
    let rules = parse_save(&save);
    assert_eq!(
        rules.north_south.nodeport_addresses,
        vec!["addrtype LOCAL ! -d 127.0.0.0/8".to_string()]
    );
}

/// The nftables proxier's JSON for the same two Services (`nft -j`).
pub(crate) fn nft_json(nodeport_ips: bool) -> String {
    let set = if nodeport_ips {
        format!(
            r#"{{"set": {{"family": "ip", "name": "nodeport-ips", "table": "kube-proxy", "type": "ipv4_addr", "elem": ["{NODE}"]}}}},"#
        )
    } else {
        String::new()
    };
    format!(
        r#"{{"nftables": [
 {{"table": {{"family": "ip", "name": "kube-proxy", "handle": 1}}}},
 {{"set": {{"family": "ip", "name": "cluster-ips", "table": "kube-proxy", "type": "ipv4_addr", "elem": ["10.96.0.20", "10.96.0.21"]}}}},
 {set}
 {{"chain": {{"family": "ip", "table": "kube-proxy", "name": "service-AAAA-ns/np/tcp/http"}}}},
 {{"chain": {{"family": "ip", "table": "kube-proxy", "name": "external-AAAA-ns/np/tcp/http"}}}},
 {{"chain": {{"family": "ip", "table": "kube-proxy", "name": "service-BBBB-ns/loc/tcp/http"}}}},
 {{"chain": {{"family": "ip", "table": "kube-proxy", "name": "external-BBBB-ns/loc/tcp/http"}}}},
 {{"rule": {{"family": "ip", "table": "kube-proxy", "chain": "external-AAAA-ns/np/tcp/http", "expr": [{{"jump": {{"target": "mark-for-masquerade"}}}}]}}}},
 {{"rule": {{"family": "ip", "table": "kube-proxy", "chain": "external-AAAA-ns/np/tcp/http", "expr": [{{"goto": {{"target": "service-AAAA-ns/np/tcp/http"}}}}]}}}},
 {{"rule": {{"family": "ip", "table": "kube-proxy", "chain": "external-BBBB-ns/loc/tcp/http", "comment": "masquerade local traffic", "expr": [{{"match": {{"op": "==", "left": {{"fib": {{"result": "type", "flags": ["saddr"]}}}}, "right": "local"}}}}, {{"jump": {{"target": "mark-for-masquerade"}}}}]}}}},
 {{"rule": {{"family": "ip", "table": "kube-proxy", "chain": "external-BBBB-ns/loc/tcp/http", "comment": "short-circuit local traffic", "expr": [{{"match": {{"op": "==", "left": {{"fib": {{"result": "type", "flags": ["saddr"]}}}}, "right": "local"}}}}, {{"goto": {{"target": "service-BBBB-ns/loc/tcp/http"}}}}]}}}},
 {{"map": {{"family": "ip", "name": "service-ips", "table": "kube-proxy", "type": ["ipv4_addr", "inet_proto", "inet_service"], "map": "verdict", "elem": [
   [{{"concat": ["10.96.0.20", "tcp", 80]}}, {{"goto": {{"target": "service-AAAA-ns/np/tcp/http"}}}}],
   [{{"concat": ["203.0.113.10", "tcp", 80]}}, {{"goto": {{"target": "external-AAAA-ns/np/tcp/http"}}}}],
   [{{"concat": ["10.96.0.21", "tcp", 80]}}, {{"goto": {{"target": "service-BBBB-ns/loc/tcp/http"}}}}],
   [{{"concat": ["198.51.100.8", "tcp", 80]}}, {{"goto": {{"target": "external-BBBB-ns/loc/tcp/http"}}}}]]}}}},
 {{"map": {{"family": "ip", "name": "service-nodeports", "table": "kube-proxy", "type": ["inet_proto", "inet_service"], "map": "verdict", "elem": [
   [{{"concat": ["tcp", 30090]}}, {{"goto": {{"target": "external-AAAA-ns/np/tcp/http"}}}}],
   [{{"concat": ["tcp", 30091]}}, {{"goto": {{"target": "external-BBBB-ns/loc/tcp/http"}}}}]]}}}},
 {{"map": {{"family": "ip", "name": "no-endpoint-services", "table": "kube-proxy", "type": ["ipv4_addr", "inet_proto", "inet_service"], "map": "verdict", "elem": [
   [{{"elem": {{"val": {{"concat": ["198.51.100.8", "tcp", 80]}}, "comment": "ns/loc:http"}}}}, {{"drop": null}}]]}}}},
 {{"map": {{"family": "ip", "name": "no-endpoint-nodeports", "table": "kube-proxy", "type": ["inet_proto", "inet_service"], "map": "verdict", "elem": [
   [{{"elem": {{"val": {{"concat": ["tcp", 30091]}}, "comment": "ns/loc:http"}}}}, {{"drop": null}}]]}}}}
]}}"#
    )
}

#[test]
fn nftables_nodeports_external_chains_and_drops() {
    let rules = with_node(nft::parse(&nft_json(false)).expect("kube-proxy table"));
    let ns = &rules.north_south;
    assert_eq!(ns.nodeport_addresses, vec![ADDRTYPE_LOCAL.to_string()]);
    let np = ns.find(ip(NODE), 30090, "tcp").unwrap();
    assert_eq!(np.name, "ns/np:http");
    assert_eq!(np.policy, TrafficPolicy::Cluster);
    assert_eq!(np.chain.as_deref(), Some("external-AAAA-ns/np/tcp/http"));
    let lb = ns.find(ip("203.0.113.10"), 80, "tcp").unwrap();
    assert_eq!(lb.kind, ExternalKind::LoadBalancerOrExternalIp);
    let loc = ns.find(ip(NODE), 30091, "tcp").unwrap();
    assert_eq!(loc.policy, TrafficPolicy::Local);
    assert_eq!(
        loc.no_local_endpoints.as_deref(),
        Some(
            "table ip kube-proxy map no-endpoint-nodeports element tcp . 30091 comment \"ns/loc:http\" : drop"
        )
    );
    let ext = ns.find(ip("198.51.100.8"), 80, "tcp").unwrap();
    assert_eq!(ext.policy, TrafficPolicy::Local);
    assert!(ext.no_local_endpoints.is_some());
    // A Local policy's drop is not "no endpoints".
    assert!(rules.no_endpoints.is_empty(), "{:?}", rules.no_endpoints);
    // With --nodeport-addresses, kube-proxy fills `nodeport-ips`.
    let rules = with_node(nft::parse(&nft_json(true)).unwrap());
    assert_eq!(rules.north_south.nodeport_addresses, vec![NODE.to_string()]);
    assert!(
        rules
            .north_south
            .find(ip("10.244.0.1"), 30090, "tcp")
            .is_none()
    );
}

/// The collector's indexed lookup answers every query as the rules' own
/// scan: cluster IPs, NodePorts on each node address, the LB and external
/// IPs, other protocols, unknown addresses, with and without backends.
#[test]
fn indexed_lookup_answers_as_the_scan() {
    let mut rules = with_node(parse_save(SAVE));
    // The same IP:port again under another protocol and, later, again:
    // the first match of the protocol must win in both.
    let mut udp = rules.services[0].clone();
    udp.proto = "udp".into();
    udp.name = "ns/np:dns".into();
    let mut dup = rules.services[0].clone();
    dup.chain = "KUBE-SVC-SECOND".into();
    rules.services.insert(0, udp);
    rules.services.push(dup);
    let index = crate::ruleset::ServiceIndex::new(&rules);
    let indexed = crate::ruleset::IndexedRules {
        rules: &rules,
        index: &index,
    };
    let mut matched = 0;
    for addr in [
        "10.96.0.20",
        "10.96.0.21",
        "198.51.100.7",
        "203.0.113.10",
        NODE,
        "10.244.0.1",
        "1.2.3.4",
    ] {
        for port in [80, 30090, 30091, 8080, 53] {
            for proto in ["tcp", "udp", "sctp"] {
                for backend in [None, Some("10.244.1.5:8080"), Some("10.244.2.5:8080")] {
                    let svc = std::net::SocketAddr::new(ip(addr), port);
                    let b = backend.map(|b| b.parse::<std::net::SocketAddr>().unwrap());
                    let scan = rules.lookup(svc, proto, b);
                    assert_eq!(indexed.lookup(svc, proto, b), scan, "{svc} {proto} {b:?}");
                    matched += usize::from(scan.is_some());
                }
            }
        }
    }
    // Not vacuous: cluster IPs, NodePorts and LB/external IPs matched.
    assert!(matched >= 20, "{matched}");
}
