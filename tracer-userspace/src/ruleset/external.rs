//! Traffic that enters the cluster at this node (issue 24): NodePorts,
//! LoadBalancer ingress IPs and externalIPs, as kube-proxy's rules show them,
//! with their externalTrafficPolicy and the filter rule that drops a
//! Local-policy Service's traffic when this node has no endpoint of it.
//!
//! kube-proxy's shapes (pkg/proxy/iptables/proxier.go, syncProxyRules):
//! - nat `KUBE-SERVICES`: `-d LBIP ... --comment "ns/name:port loadbalancer IP"
//!   --dport P -j KUBE-EXT-…` (or `KUBE-FW-…` with loadBalancerSourceRanges),
//!   `... "ns/name:port external IP" ... -j KUBE-EXT-…`, and last
//!   `... "kubernetes service nodeports; NOTE: ..." -m addrtype --dst-type LOCAL
//!   -j KUBE-NODEPORTS` (one `-d NODEIP` rule per address instead with
//!   `--nodeport-addresses`);
//! - nat `KUBE-NODEPORTS`: `--comment ns/name:port ... --dport NP -j KUBE-EXT-…`;
//! - nat `KUBE-EXT-…`: Cluster policy `"masquerade traffic for … external
//!   destinations" -j KUBE-MARK-MASQ` then `-j KUBE-SVC-…`; Local policy
//!   `"pod traffic for …"`, `"masquerade LOCAL traffic for …"`, `"route LOCAL
//!   traffic for …"` and, only with local endpoints, `-j KUBE-SVL-…`;
//! - filter `KUBE-EXTERNAL-SERVICES`: `"ns/name:port has no local endpoints"
//!   ... -j DROP` (`-d IP` for LB/external IPs, `-m addrtype --dst-type LOCAL`
//!   for the NodePort), `"… has no endpoints" -j REJECT` without any endpoint.
//!   It is jumped to from filter INPUT and FORWARD for `--ctstate NEW`.
//!
//! The nftables proxier (pkg/proxy/nftables/proxier.go) writes the same into
//! `service-ips` (LB/external IP → `goto external-…`), `service-nodeports`
//! (`proto . port → goto external-…`), the `nodeport-ips` set (absent when
//! every local address accepts NodePorts: `fib daddr type local`), and
//! `no-endpoint-services` / `no-endpoint-nodeports` (`drop` for a Local policy
//! without local endpoints, `goto reject-chain` without any): see `nft/external.rs`.
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use super::{KubeProxyRules, Rule, host, parse_rule, port_label};

/// How traffic reaches a Service from outside the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExternalKind {
    NodePort,
    LoadBalancer,
    ExternalIp,
    /// nftables mode sends both to the same `external-…` chain from
    /// `service-ips`: its rules do not say which the address is.
    LoadBalancerOrExternalIp,
}

impl ExternalKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ExternalKind::NodePort => "NodePort",
            ExternalKind::LoadBalancer => "LoadBalancer IP",
            ExternalKind::ExternalIp => "externalIP",
            ExternalKind::LoadBalancerOrExternalIp => "LoadBalancer IP or externalIP",
        }
    }
}

/// externalTrafficPolicy as the Service's external chain shows it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrafficPolicy {
    /// Masqueraded (SNAT to the node) and balanced over every endpoint.
    Cluster,
    /// The client's address is kept; only this node's endpoints are used.
    Local,
    #[default]
    Unknown,
}

/// One external address (or NodePort) of a Service port.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExternalRule {
    /// kube-proxy's `namespace/name:port`.
    pub name: String,
    pub kind: ExternalKind,
    /// The LB or external IP; None for a NodePort (accepted on the
    /// addresses in [`NorthSouth::nodeport_addresses`]).
    #[serde(default)]
    pub ip: Option<IpAddr>,
    /// The proxier's family (a NodePort has no address to say it).
    #[serde(default)]
    pub ipv6: bool,
    /// The NodePort, or the Service port for LB/external IPs.
    pub port: u16,
    /// "tcp" / "udp".
    pub proto: String,
    /// `KUBE-EXT-…` / `external-…`; None when kube-proxy wrote no nat rule
    /// (no endpoints at all).
    #[serde(default)]
    pub chain: Option<String>,
    #[serde(default)]
    pub policy: TrafficPolicy,
    /// The filter rule (or map element) that drops this traffic because
    /// the Service has endpoints, but none on this node (Local policy).
    #[serde(default)]
    pub no_local_endpoints: Option<String>,
    /// The filter rule that rejects it because the Service has no endpoints.
    #[serde(default)]
    pub no_endpoints: Option<String>,
    /// `healthCheckNodePort` of a Local-policy Service (iptables filter
    /// `KUBE-NODEPORTS "ns/name:port health check node port" ... -j ACCEPT`).
    #[serde(default)]
    pub health_check_node_port: Option<u16>,
}

impl ExternalRule {
    /// `namespace/name` of the Service.
    pub fn service(&self) -> &str {
        self.name.rsplit_once(':').map_or(&self.name, |(s, _)| s)
    }

    /// Whether this entry is a packet's destination `addr:port`/`proto`,
    /// `addr` being one of the node's NodePort addresses for a NodePort.
    pub fn matches(&self, addr: IpAddr, port: u16, proto: &str, ns: &NorthSouth) -> bool {
        if self.port != port || self.proto != proto {
            return false;
        }
        match self.ip {
            Some(ip) => ip == addr,
            None => addr.is_ipv6() == self.ipv6 && ns.accepts_node_port(addr),
        }
    }
}

/// What kube-proxy's rules say about traffic from outside the cluster.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NorthSouth {
    #[serde(default)]
    pub external: Vec<ExternalRule>,
    /// Where NodePorts are accepted, as kube-proxy wrote it: `addrtype
    /// LOCAL` (every local address; iptables `-m addrtype --dst-type LOCAL`,
    /// nftables without a `nodeport-ips` set) or the addresses of
    /// `--nodeport-addresses` (iptables `-d IP -j KUBE-NODEPORTS`, nftables
    /// `nodeport-ips`), with the exclusions kube-proxy added (`! -d 127.0.0.0/8`).
    #[serde(default)]
    pub nodeport_addresses: Vec<String>,
    /// The node's own addresses (read at start), for NodePorts on `addrtype LOCAL`.
    #[serde(default)]
    pub node_addresses: Vec<IpAddr>,
}

/// The `nodeport_addresses` entry for kube-proxy's default (every local address).
pub const ADDRTYPE_LOCAL: &str = "addrtype LOCAL";

impl NorthSouth {
    pub fn is_empty(&self) -> bool {
        self.external.is_empty() && self.nodeport_addresses.is_empty()
    }

    /// Whether kube-proxy accepts NodePort traffic to `addr`.
    pub fn accepts_node_port(&self, addr: IpAddr) -> bool {
        if self.nodeport_addresses.is_empty() {
            return false;
        }
        let explicit = self
            .nodeport_addresses
            .iter()
            .filter_map(|a| a.parse::<IpAddr>().ok())
            .any(|a| a == addr);
        explicit || (self.every_local_address() && self.is_local(addr))
    }

    fn every_local_address(&self) -> bool {
        self.nodeport_addresses
            .iter()
            .any(|a| a.starts_with(ADDRTYPE_LOCAL))
    }

    fn is_local(&self, addr: IpAddr) -> bool {
        // kube-proxy excludes loopback (IPv6 always, IPv4 without
        // --iptables-localhost-nodeports); nattrace never traces loopback.
        !addr.is_loopback() && self.node_addresses.contains(&addr)
    }

    /// The addresses a NodePort of this family is accepted on.
    pub fn node_port_addrs(&self, ipv6: bool) -> Vec<IpAddr> {
        let mut out: Vec<IpAddr> = self
            .node_addresses
            .iter()
            .copied()
            .chain(
                self.nodeport_addresses
                    .iter()
                    .filter_map(|a| a.parse::<IpAddr>().ok()),
            )
            .filter(|a| a.is_ipv6() == ipv6 && self.accepts_node_port(*a))
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// The entry a flow to `addr:port` belongs to.
    pub fn find(&self, addr: IpAddr, port: u16, proto: &str) -> Option<&ExternalRule> {
        self.external
            .iter()
            .find(|e| e.ip.is_some() && e.matches(addr, port, proto, self))
            .or_else(|| {
                self.external
                    .iter()
                    .find(|e| e.ip.is_none() && e.matches(addr, port, proto, self))
            })
    }

    /// Adds the other family's half.
    pub fn merge(&mut self, other: NorthSouth) {
        self.external.extend(other.external);
        for a in other.nodeport_addresses {
            if !self.nodeport_addresses.contains(&a) {
                self.nodeport_addresses.push(a);
            }
        }
        for a in other.node_addresses {
            if !self.node_addresses.contains(&a) {
                self.node_addresses.push(a);
            }
        }
    }
}

/// A match `parse_rule` does not keep (`-m addrtype`), read from the line.
fn has(line: &str, needle: &str) -> bool {
    line.contains(needle)
}

/// The external entries of an iptables nat table (rule lines), with each
/// external chain's policy.
pub(super) fn from_nat(lines: &[&str], rules: &mut KubeProxyRules) {
    let parsed: Vec<(Rule, &str)> = lines
        .iter()
        .filter_map(|l| parse_rule(l).map(|r| (r, *l)))
        .collect();
    let ipv6 = rules.services.iter().any(|s| s.cluster_ip.is_ipv6())
        || lines.iter().any(|l| l.contains("::1/128"));
    fn chain_rules<'a>(
        parsed: &'a [(Rule, &'a str)],
        chain: &'a str,
    ) -> impl Iterator<Item = (&'a Rule, &'a str)> {
        parsed
            .iter()
            .filter(move |(r, _)| r.chain == chain)
            .map(|(r, l)| (r, *l))
    }
    let policy_of = |chain: &str| {
        let mut policy = TrafficPolicy::Unknown;
        for (r, line) in chain_rules(&parsed, chain) {
            let jump = r.jump.as_deref().unwrap_or_default();
            if jump == "KUBE-MARK-MASQ" && r.src.is_none() && !has(line, "--src-type") {
                return TrafficPolicy::Cluster;
            }
            if jump.starts_with("KUBE-SVL-") || has(line, "--src-type LOCAL") {
                policy = TrafficPolicy::Local;
            }
        }
        // A KUBE-FW- chain (loadBalancerSourceRanges) jumps on to KUBE-EXT-.
        policy
    };
    let resolve_chain = |jump: &str| -> String {
        if jump.starts_with("KUBE-FW-") {
            chain_rules(&parsed, jump)
                .find_map(|(r, _)| r.jump.clone().filter(|j| j.starts_with("KUBE-EXT-")))
                .unwrap_or_else(|| jump.to_string())
        } else {
            jump.to_string()
        }
    };
    let ns = &mut rules.north_south;
    for (r, line) in &parsed {
        let (Some(jump), Some(comment)) = (&r.jump, &r.comment) else {
            continue;
        };
        match r.chain.as_str() {
            "KUBE-SERVICES" if jump == "KUBE-NODEPORTS" => {
                let at = match (&r.dst, has(line, "--dst-type LOCAL")) {
                    (Some(d), false) => host(d).map_or_else(|| d.clone(), |ip| ip.to_string()),
                    _ => {
                        let except = line
                            .split_once("! -d ")
                            .and_then(|(_, rest)| rest.split_whitespace().next())
                            .map(|c| format!(" ! -d {c}"))
                            .unwrap_or_default();
                        format!("{ADDRTYPE_LOCAL}{except}")
                    }
                };
                if !ns.nodeport_addresses.contains(&at) {
                    ns.nodeport_addresses.push(at);
                }
            }
            "KUBE-SERVICES" => {
                let kind = if comment.ends_with(" loadbalancer IP") {
                    ExternalKind::LoadBalancer
                } else if comment.ends_with(" external IP") {
                    ExternalKind::ExternalIp
                } else {
                    continue;
                };
                let (Some(dst), Some(port), Some(proto)) = (&r.dst, r.dport, &r.proto) else {
                    continue;
                };
                let Some(ip) = host(dst) else { continue };
                let name = comment
                    .trim_end_matches(" loadbalancer IP")
                    .trim_end_matches(" external IP");
                let chain = resolve_chain(jump);
                ns.external.push(ExternalRule {
                    name: port_label(name, port),
                    kind,
                    ip: Some(ip),
                    ipv6: ip.is_ipv6(),
                    port,
                    proto: proto.clone(),
                    policy: policy_of(&chain),
                    chain: Some(chain),
                    no_local_endpoints: None,
                    no_endpoints: None,
                    health_check_node_port: None,
                });
            }
            "KUBE-NODEPORTS" if jump.starts_with("KUBE-EXT-") => {
                let (Some(port), Some(proto)) = (r.dport, &r.proto) else {
                    continue;
                };
                // The name is the Service's (port label from its ClusterIP rule).
                let svc_chain = jump.replacen("KUBE-EXT-", "KUBE-SVC-", 1);
                let name = rules
                    .services
                    .iter()
                    .find(|s| *s.chain == *svc_chain)
                    .map_or_else(|| port_label(comment, 0), |s| s.name.to_string());
                ns.external.push(ExternalRule {
                    name,
                    kind: ExternalKind::NodePort,
                    ip: None,
                    ipv6,
                    port,
                    proto: proto.clone(),
                    policy: policy_of(jump),
                    chain: Some(jump.clone()),
                    no_local_endpoints: None,
                    no_endpoints: None,
                    health_check_node_port: None,
                });
            }
            _ => {}
        }
    }
}

/// kube-proxy's filter `KUBE-EXTERNAL-SERVICES` DROPs ("has no local
/// endpoints") and NodePort REJECTs ("has no endpoints"), joined to the
/// entries the nat table gave (a Service without endpoints has none there).
pub(super) fn from_filter(lines: &[&str], ns: &mut NorthSouth, ipv6: bool) {
    let mut health: Vec<(String, u16)> = Vec::new();
    for line in lines {
        let Some(r) = parse_rule(line) else { continue };
        if r.chain == "KUBE-NODEPORTS"
            && let (Some(c), Some(port)) = (&r.comment, r.dport)
            && let Some(name) = c.strip_suffix(" health check node port")
        {
            health.push((name.to_string(), port));
            continue;
        }
        if r.chain != "KUBE-EXTERNAL-SERVICES" {
            continue;
        }
        let (Some(jump), Some(comment), Some(port), Some(proto)) =
            (&r.jump, &r.comment, r.dport, &r.proto)
        else {
            continue;
        };
        let (name, drop) = match (
            comment.strip_suffix(" has no local endpoints"),
            jump.as_str(),
        ) {
            (Some(n), "DROP") => (n, true),
            (None, "REJECT") => match comment.strip_suffix(" has no endpoints") {
                Some(n) => (n, false),
                None => continue,
            },
            _ => continue,
        };
        let ip = r.dst.as_deref().and_then(host);
        if ip.is_none() && !has(line, "--dst-type LOCAL") {
            continue;
        }
        let name = name.to_string();
        let svc = name.rsplit_once(':').map_or(name.as_str(), |(s, _)| s);
        let found = ns
            .external
            .iter_mut()
            .find(|e| e.ip == ip && e.port == port && e.proto == *proto && e.service() == svc);
        let entry = match found {
            Some(e) => e,
            None => {
                ns.external.push(ExternalRule {
                    name: name.clone(),
                    kind: if ip.is_some() {
                        ExternalKind::LoadBalancerOrExternalIp
                    } else {
                        ExternalKind::NodePort
                    },
                    ip,
                    ipv6: ip.map_or(ipv6, |i| i.is_ipv6()),
                    port,
                    proto: proto.clone(),
                    chain: None,
                    policy: if drop {
                        TrafficPolicy::Local
                    } else {
                        TrafficPolicy::Unknown
                    },
                    no_local_endpoints: None,
                    no_endpoints: None,
                    health_check_node_port: None,
                });
                ns.external.last_mut().expect("just pushed")
            }
        };
        if drop {
            entry.policy = TrafficPolicy::Local;
            entry.no_local_endpoints = Some(line.to_string());
        } else {
            entry.no_endpoints = Some(line.to_string());
        }
    }
    for (name, port) in health {
        for e in ns.external.iter_mut().filter(|e| e.name == name) {
            e.health_check_node_port = Some(port);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
