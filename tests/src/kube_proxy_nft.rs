//! kube-proxy's nftables-mode ruleset (`--proxy-mode=nftables`, GA since 1.33)
//! for ClusterIP Services, as `nft -f` input in the order and wording of
//! kube-proxy's own expected output (`pkg/proxy/nftables/proxier_test.go`,
//! `baseRules` + `TestOverallNFTablesRules`), so the tracer sees the table,
//! base-chain priorities, maps and chain names of a real node.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use sha2::{Digest, Sha256};

use crate::kube_proxy::{ResolvedService, base32_std, endpoint_string};
use crate::spec::{KubeProxyConfig, Protocol};

/// kube-proxy's table (`ip` family: one table per IP family).
pub const TABLE: &str = "kube-proxy";
/// The masquerade bit (`--masquerade-bit=14`), as kube-proxy formats it.
pub const MASQ_MARK: &str = "0x4000";

/// `HASH-ns/name/proto/port`: `servicePortChainNameBase` (the first 8
/// characters of base32(sha256) of the rest, then the rest).
fn hash_and_prefix(name: &str) -> String {
    let digest = Sha256::digest(name.as_bytes());
    format!("{}-{name}", &base32_std(&digest)[..8])
}

/// `ns/name/proto/port` from kube-proxy's `ns/name:port` and the protocol.
fn base(port_name: &str, protocol: Protocol) -> String {
    let (svc, port) = port_name.rsplit_once(':').unwrap_or((port_name, ""));
    format!("{svc}/{}/{port}", protocol.as_str())
}

/// `service-HASH-ns/name/proto/port`: the Cluster traffic policy chain.
pub fn service_chain(port_name: &str, protocol: Protocol) -> String {
    format!("service-{}", hash_and_prefix(&base(port_name, protocol)))
}

/// `external-HASH-ns/name/proto/port`: NodePort, LB and external IP traffic.
pub fn external_chain(port_name: &str, protocol: Protocol) -> String {
    format!("external-{}", hash_and_prefix(&base(port_name, protocol)))
}

/// `local-HASH-ns/name/proto/port`: the Local traffic policy chain.
pub fn local_chain(port_name: &str, protocol: Protocol) -> String {
    format!("local-{}", hash_and_prefix(&base(port_name, protocol)))
}

/// `endpoint-HASH-ns/name/proto/port__ip/port` (`endpoint` is `ip:port` or
/// `[ip6]:port`; an IPv6 address's colons become dots, as chain names allow
/// no colons: `servicePortEndpointChainNameBase`).
pub fn endpoint_chain(port_name: &str, protocol: Protocol, endpoint: &str) -> String {
    let (ip, port) = endpoint.rsplit_once(':').unwrap_or((endpoint, ""));
    let ip = ip
        .trim_start_matches('[')
        .trim_end_matches(']')
        .replace(':', ".");
    format!(
        "endpoint-{}",
        hash_and_prefix(&format!("{}__{ip}/{port}", base(port_name, protocol)))
    )
}

/// The whole `table ip kube-proxy` for one node. `node_ip` fills
/// `nodeport-ips` (kube-proxy's default `--nodeport-addresses=primary`).
pub fn render(config: &KubeProxyConfig, services: &[ResolvedService], node_ip: Ipv4Addr) -> String {
    let cidr = config.cluster_cidr.map(|c| c.trunc().to_string());
    render_family(config, services, node_ip.into(), cidr)
}

/// `table ip6 kube-proxy`: the IPv6 proxier's table on a dual-stack node
/// (kube-proxy runs one proxier, and so one table, per family; the rules
/// differ only in `ip6`/`ipv6_addr`). `cluster_cidr` is the IPv6
/// `--cluster-cidr`.
pub fn render6(
    config: &KubeProxyConfig,
    services: &[ResolvedService],
    node_ip: Ipv6Addr,
    cluster_cidr: Option<String>,
) -> String {
    render_family(config, services, node_ip.into(), cluster_cidr)
}

fn render_family(
    config: &KubeProxyConfig,
    services: &[ResolvedService],
    node_ip: IpAddr,
    cluster_cidr: Option<String>,
) -> String {
    // proxier.go: `ipX := "ip"; ipvX_addr := "ipv4_addr"` (ip6 / ipv6_addr for IPv6).
    let (ipx, addr_type) = if node_ip.is_ipv6() {
        ("ip6", "ipv6_addr")
    } else {
        ("ip", "ipv4_addr")
    };
    let mut out = String::new();
    // `writeln!` to a String cannot fail.
    let mut line = |l: String| {
        let _ = writeln!(out, "{l}");
    };
    let t = format!("{ipx} {TABLE}");
    line(format!(
        r#"add table {t} {{ comment "rules for kube-proxy" ; }}"#
    ));
    line(format!(
        r#"add set {t} cluster-ips {{ type {addr_type} ; comment "Active ClusterIPs" ; }}"#
    ));
    line(format!(
        r#"add set {t} nodeport-ips {{ type {addr_type} ; comment "IPs that accept NodePort traffic" ; }}"#
    ));
    let addr_key = format!("{addr_type} . inet_proto . inet_service");
    for (map, key, comment) in [
        (
            "firewall-ips",
            addr_key.as_str(),
            "destinations that are subject to LoadBalancerSourceRanges",
        ),
        (
            "no-endpoint-nodeports",
            "inet_proto . inet_service",
            "vmap to drop or reject packets to service nodeports with no endpoints",
        ),
        (
            "no-endpoint-services",
            addr_key.as_str(),
            "vmap to drop or reject packets to services with no endpoints",
        ),
        (
            "service-ips",
            addr_key.as_str(),
            "ClusterIP, ExternalIP and LoadBalancer IP traffic",
        ),
        (
            "service-nodeports",
            "inet_proto . inet_service",
            "NodePort traffic",
        ),
    ] {
        line(format!(
            r#"add map {t} {map} {{ type {key} : verdict ; comment "{comment}" ; }}"#
        ));
    }
    // Filter chains run before DNAT (-110) to see the Service address, or at
    // the filter priority (0); nat chains at dstnat (-100) and srcnat (100).
    for chain in [
        "cluster-ips-check",
        "filter-prerouting-pre-dnat { type filter hook prerouting priority -110 ; }",
        "filter-output-pre-dnat { type filter hook output priority -110 ; }",
        "filter-forward { type filter hook forward priority 0 ; }",
        "filter-input { type filter hook input priority 0 ; }",
        "filter-output { type filter hook output priority 0 ; }",
        "firewall-check",
        "mark-for-masquerade",
        "masquerading",
        "nat-output { type nat hook output priority -100 ; }",
        "nat-postrouting { type nat hook postrouting priority 100 ; }",
        "nat-prerouting { type nat hook prerouting priority -100 ; }",
        "nodeport-endpoints-check",
        r#"reject-chain { comment "helper for @no-endpoint-services / @no-endpoint-nodeports" ; }"#,
        "services",
        "service-endpoints-check",
    ] {
        line(format!("add chain {t} {chain}"));
    }
    let rules = [
        r#"cluster-ips-check ip daddr @cluster-ips reject comment "Reject traffic to invalid ports of ClusterIPs""#,
        "filter-prerouting-pre-dnat ct state new jump firewall-check",
        "filter-forward ct state new jump service-endpoints-check",
        "filter-forward ct state new jump cluster-ips-check",
        "filter-input ct state new jump nodeport-endpoints-check",
        "filter-input ct state new jump service-endpoints-check",
        "filter-output ct state new jump service-endpoints-check",
        "filter-output-pre-dnat ct state new jump firewall-check",
        "filter-output ct state new jump cluster-ips-check",
        "firewall-check ip daddr . meta l4proto . th dport vmap @firewall-ips",
    ];
    for rule in rules {
        line(format!("add rule {t} {}", family(rule, ipx)));
    }
    line(format!(
        "add rule {t} mark-for-masquerade mark set mark or {MASQ_MARK}"
    ));
    line(format!(
        "add rule {t} masquerading mark and {MASQ_MARK} == 0 return"
    ));
    // Clears the bit so a packet re-entering the stack (e.g. after vxlan
    // encapsulation) is not masqueraded twice.
    line(format!(
        "add rule {t} masquerading mark set mark xor {MASQ_MARK}"
    ));
    let rules = [
        "masquerading masquerade fully-random",
        "nat-output jump services",
        "nat-postrouting jump masquerading",
        "nat-prerouting jump services",
        "nodeport-endpoints-check ip daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports",
        "reject-chain reject",
        "services ip daddr . meta l4proto . th dport vmap @service-ips",
        "services ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports",
    ];
    for rule in rules {
        line(format!("add rule {t} {}", family(rule, ipx)));
    }
    line(format!("add element {t} nodeport-ips {{ {node_ip} }}"));
    line(format!(
        "add rule {t} service-endpoints-check {ipx} daddr . meta l4proto . th dport vmap @no-endpoint-services"
    ));

    for svc in services {
        let proto = svc.protocol.as_str();
        let name = &svc.port_name;
        let key = format!("{} . {proto} . {}", svc.cluster_ip, svc.port);
        if svc.endpoints.is_empty() {
            // No chains in nat, only the filter-side reject (REJECT in the
            // client's eyes: ICMP port unreachable / connection refused).
            line(format!(
                "add element {t} cluster-ips {{ {} }}",
                svc.cluster_ip
            ));
            line(format!(
                r#"add element {t} no-endpoint-services {{ {key} comment "{name}" : goto reject-chain }}"#
            ));
            continue;
        }
        let chain = service_chain(name, svc.protocol);
        let endpoints: Vec<(String, IpAddr, u16)> = svc
            .endpoints
            .iter()
            .map(|(ip, port)| {
                (
                    endpoint_chain(name, svc.protocol, &endpoint_string(*ip, *port)),
                    *ip,
                    *port,
                )
            })
            .collect();
        // Like kube-proxy's transaction: the endpoint chains exist before the
        // service chain's vmap refers to them.
        for (ep_chain, _, _) in &endpoints {
            line(format!("add chain {t} {ep_chain}"));
        }
        line(format!("add chain {t} {chain}"));
        if config.masquerade_all {
            line(format!(
                "add rule {t} {chain} {ipx} daddr {} jump mark-for-masquerade",
                svc.cluster_ip
            ));
        } else if let Some(cidr) = &cluster_cidr {
            line(format!(
                "add rule {t} {chain} {ipx} daddr {} {ipx} saddr != {cidr} jump mark-for-masquerade",
                svc.cluster_ip,
            ));
        }
        // Pinned: every slot of the random vmap goes to the pinned endpoint,
        // so the shape stays kube-proxy's while tests are deterministic.
        let slots: Vec<String> = (0..endpoints.len())
            .map(|i| {
                let target = &endpoints[svc.pinned.unwrap_or(i)].0;
                format!("{i} : goto {target}")
            })
            .collect();
        line(format!(
            "add rule {t} {chain} numgen random mod {} vmap {{ {} }}",
            endpoints.len(),
            slots.join(" , ")
        ));
        for (ep_chain, ip, port) in &endpoints {
            // Hairpin: a pod reaching itself through its Service must be
            // SNATed, or its reply would never come back through the node.
            if !config.omit_hairpin_masquerade {
                line(format!(
                    "add rule {t} {ep_chain} {ipx} saddr {ip} jump mark-for-masquerade"
                ));
            }
            line(format!(
                "add rule {t} {ep_chain} meta l4proto {proto} dnat to {}",
                endpoint_string(*ip, *port)
            ));
        }
        line(format!(
            "add element {t} cluster-ips {{ {} }}",
            svc.cluster_ip
        ));
        line(format!(
            "add element {t} service-ips {{ {key} : goto {chain} }}"
        ));
        external(
            &mut line,
            &t,
            svc,
            &chain,
            &endpoints,
            ipx,
            cluster_cidr.as_deref(),
        );
    }
    out
}

/// NodePort, LB and external IP traffic (pkg/proxy/nftables/proxier.go):
/// `service-ips` / `service-nodeports` elements to the `external-` chain,
/// which masquerades (Cluster policy) or short-circuits local and pod
/// traffic and goes on to the `local-` chain of this node's endpoints
/// (Local policy); without one, `drop` elements in `no-endpoint-services` /
/// `no-endpoint-nodeports`.
fn external(
    line: &mut impl FnMut(String),
    t: &str,
    svc: &ResolvedService,
    chain: &str,
    endpoints: &[(String, IpAddr, u16)],
    ipx: &str,
    cluster_cidr: Option<&str>,
) {
    let spec = &svc.external;
    let ips: Vec<IpAddr> = spec
        .external_ips
        .iter()
        .chain(&spec.lb_ips)
        .map(|ip| IpAddr::V4(*ip))
        .filter(|ip| ip.is_ipv6() == svc.cluster_ip.is_ipv6())
        .collect();
    if svc.node_port.is_none() && ips.is_empty() {
        return;
    }
    let proto = svc.protocol.as_str();
    let name = &svc.port_name;
    let ext = external_chain(name, svc.protocol);
    let local: Vec<&(String, IpAddr, u16)> = endpoints
        .iter()
        .enumerate()
        .filter(|(i, _)| svc.local.get(*i).copied().unwrap_or(false))
        .map(|(_, e)| e)
        .collect();
    let has_local = !local.is_empty();
    if spec.local_policy && has_local {
        let lc = local_chain(name, svc.protocol);
        line(format!("add chain {t} {lc}"));
        let slots: Vec<String> = local
            .iter()
            .enumerate()
            .map(|(i, (c, _, _))| format!("{i} : goto {c}"))
            .collect();
        line(format!(
            "add rule {t} {lc} numgen random mod {} vmap {{ {} }}",
            local.len(),
            slots.join(" , ")
        ));
    }
    line(format!("add chain {t} {ext}"));
    if !spec.local_policy {
        line(format!("add rule {t} {ext} jump mark-for-masquerade"));
        line(format!("add rule {t} {ext} goto {chain}"));
    } else {
        if let Some(cidr) = cluster_cidr {
            line(format!(
                r#"add rule {t} {ext} {ipx} saddr {cidr} goto {chain} comment "short-circuit pod traffic""#
            ));
        }
        line(format!(
            r#"add rule {t} {ext} fib saddr type local jump mark-for-masquerade comment "masquerade local traffic""#
        ));
        line(format!(
            r#"add rule {t} {ext} fib saddr type local goto {chain} comment "short-circuit local traffic""#
        ));
        if has_local {
            line(format!(
                "add rule {t} {ext} goto {}",
                local_chain(name, svc.protocol)
            ));
        }
    }
    let drop = spec.local_policy && !has_local;
    for ip in &ips {
        line(format!(
            "add element {t} service-ips {{ {ip} . {proto} . {} : goto {ext} }}",
            svc.port
        ));
        if drop {
            line(format!(
                r#"add element {t} no-endpoint-services {{ {ip} . {proto} . {} comment "{name}" : drop }}"#,
                svc.port
            ));
        }
    }
    if let Some(np) = svc.node_port {
        line(format!(
            "add element {t} service-nodeports {{ {proto} . {np} : goto {ext} }}"
        ));
        if drop {
            line(format!(
                r#"add element {t} no-endpoint-nodeports {{ {proto} . {np} comment "{name}" : drop }}"#
            ));
        }
    }
}

/// A rule written for the `ip` family, in `ipx`'s words.
fn family(rule: &str, ipx: &str) -> String {
    rule.replace("ip daddr", &format!("{ipx} daddr"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cidr::cidr;

    #[test]
    fn chain_names_match_kube_proxys_tests() {
        // Expected names from proxier_test.go's TestOverallNFTablesRules.
        assert_eq!(
            service_chain("ns1/svc1:p80", Protocol::Tcp),
            "service-ULMVA6XW-ns1/svc1/tcp/p80"
        );
        assert_eq!(
            endpoint_chain("ns1/svc1:p80", Protocol::Tcp, "10.180.0.1:80"),
            "endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
        );
        assert_eq!(
            endpoint_chain("ns4/svc4:p80", Protocol::Tcp, "10.180.0.5:80"),
            "endpoint-5RFCDDV7-ns4/svc4/tcp/p80__10.180.0.5/80"
        );
    }

    fn svc(endpoints: Vec<(IpAddr, u16)>, pinned: Option<usize>) -> ResolvedService {
        ResolvedService {
            port_name: "ns1/svc1:p80".into(),
            cluster_ip: "172.30.0.41".parse().unwrap(),
            port: 80,
            protocol: Protocol::Tcp,
            endpoints,
            pinned,
            node_port: None,
            external: Default::default(),
            local: Vec::new(),
        }
    }

    #[test]
    fn service_rules_read_like_kube_proxys() {
        let config = KubeProxyConfig {
            cluster_cidr: Some(cidr("10.0.0.0/8")),
            ..KubeProxyConfig::default()
        };
        let ep = ("10.180.0.1".parse().unwrap(), 80);
        let out = render(
            &config,
            &[svc(vec![ep], None)],
            "192.168.0.2".parse().unwrap(),
        );
        for want in [
            "add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 ip daddr 172.30.0.41 ip saddr != 10.0.0.0/8 jump mark-for-masquerade",
            "add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 numgen random mod 1 vmap { 0 : goto endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 }",
            "add rule ip kube-proxy endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 ip saddr 10.180.0.1 jump mark-for-masquerade",
            "add rule ip kube-proxy endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 meta l4proto tcp dnat to 10.180.0.1:80",
            "add element ip kube-proxy cluster-ips { 172.30.0.41 }",
            "add element ip kube-proxy service-ips { 172.30.0.41 . tcp . 80 : goto service-ULMVA6XW-ns1/svc1/tcp/p80 }",
            "add element ip kube-proxy nodeport-ips { 192.168.0.2 }",
            "add chain ip kube-proxy nat-prerouting { type nat hook prerouting priority -100 ; }",
        ] {
            assert!(out.lines().any(|l| l == want), "missing {want}\n{out}");
        }
    }

    #[test]
    fn no_endpoints_pinning_and_masquerade_all() {
        let config = KubeProxyConfig {
            masquerade_all: true,
            omit_hairpin_masquerade: true,
            ..KubeProxyConfig::default()
        };
        let empty = render(&config, &[svc(vec![], None)], Ipv4Addr::LOCALHOST);
        assert!(empty.contains(
            r#"add element ip kube-proxy no-endpoint-services { 172.30.0.41 . tcp . 80 comment "ns1/svc1:p80" : goto reject-chain }"#
        ));
        assert!(!empty.contains("service-ULMVA6XW"));
        let eps = vec![
            ("10.180.0.1".parse().unwrap(), 80),
            ("10.180.0.2".parse().unwrap(), 80),
        ];
        let out = render(&config, &[svc(eps, Some(1))], Ipv4Addr::LOCALHOST);
        let ep1 = endpoint_chain("ns1/svc1:p80", Protocol::Tcp, "10.180.0.2:80");
        assert!(out.contains(&format!(
            "numgen random mod 2 vmap {{ 0 : goto {ep1} , 1 : goto {ep1} }}"
        )));
        assert!(out.contains("ip daddr 172.30.0.41 jump mark-for-masquerade"));
        assert!(!out.contains("ip saddr 10.180.0.1 jump"));
    }

    #[test]
    fn ipv6_table_uses_ip6_words_and_dotted_endpoint_chains() {
        let config = KubeProxyConfig::default();
        let v6 = ResolvedService {
            cluster_ip: "fd00:10:96::1e85".parse().unwrap(),
            endpoints: vec![("fd00:10:244:36::f7".parse().unwrap(), 80)],
            ..svc(vec![], None)
        };
        let out = render6(
            &config,
            &[v6],
            "fd00:172:20::10".parse().unwrap(),
            Some("fd00:10:244::/56".into()),
        );
        let ep = "endpoint-AAAAAAAA-ns1/svc1/tcp/p80__fd00.10.244.36..f7/80";
        let chain = endpoint_chain("ns1/svc1:p80", Protocol::Tcp, "[fd00:10:244:36::f7]:80");
        assert_eq!(chain[..9], ep[..9]);
        assert!(
            chain.ends_with("-ns1/svc1/tcp/p80__fd00.10.244.36..f7/80"),
            "{chain}"
        );
        for want in [
            r#"add set ip6 kube-proxy cluster-ips { type ipv6_addr ; comment "Active ClusterIPs" ; }"#.to_string(),
            "add rule ip6 kube-proxy services ip6 daddr . meta l4proto . th dport vmap @service-ips".into(),
            format!("add rule ip6 kube-proxy {chain} meta l4proto tcp dnat to [fd00:10:244:36::f7]:80"),
            format!("add rule ip6 kube-proxy {chain} ip6 saddr fd00:10:244:36::f7 jump mark-for-masquerade"),
            "add rule ip6 kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 ip6 daddr fd00:10:96::1e85 ip6 saddr != fd00:10:244::/56 jump mark-for-masquerade".into(),
        ] {
            assert!(out.lines().any(|l| l == want), "missing {want}\n{out}");
        }
        assert!(!out.contains(" ip daddr"), "{out}");
    }
}
