//! Services by name (issue 24), from kube-proxy's rules on the node: every
//! address a Service port is reached at (ClusterIPs, NodePorts on the
//! addresses kube-proxy accepts them on, LoadBalancer ingress IPs,
//! externalIPs), and, for a name or address no Service has, the nearest
//! ones. Pure: the rules (with the node's addresses) come from
//! `ruleset::read`. Also what target checks at start use (issue 28).
use std::{collections::BTreeSet, fmt, net::IpAddr};

use crate::{ruleset::KubeProxyRules, service::Service};

/// `--svc NAMESPACE/NAME[:PORT]`; the port by name or number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceName {
    pub namespace: String,
    pub name: String,
    pub port: Option<PortRef>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PortRef {
    Number(u16),
    Name(String),
}

impl fmt::Display for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)?;
        match &self.port {
            Some(PortRef::Number(n)) => write!(f, ":{n}"),
            Some(PortRef::Name(n)) => write!(f, ":{n}"),
            None => Ok(()),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "'{0}' is not NAMESPACE/NAME[:PORT] (a Kubernetes name is lower-case letters, digits, '-' and '.', e.g. prod/export or prod/export:http)"
)]
pub struct NameParseError(String);

/// RFC 1123 label/subdomain characters, as namespaces and Service names use.
fn dns_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

impl std::str::FromStr for ServiceName {
    type Err = NameParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || NameParseError(s.to_string());
        let (namespace, rest) = s.split_once('/').ok_or_else(err)?;
        let (name, port) = match rest.split_once(':') {
            Some((n, p)) => (n, Some(p)),
            None => (rest, None),
        };
        if !dns_name(namespace) || !dns_name(name) {
            return Err(err());
        }
        let port = match port {
            None => None,
            Some(p) => match p.parse::<u16>() {
                Ok(0) => return Err(err()),
                Ok(n) => Some(PortRef::Number(n)),
                Err(_) if dns_name(p) => Some(PortRef::Name(p.to_string())),
                Err(_) => return Err(err()),
            },
        };
        Ok(ServiceName {
            namespace: namespace.to_string(),
            name: name.to_string(),
            port,
        })
    }
}

/// What `--svc` names: an address (with an optional port) or a Service by name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SvcArg {
    Addr(Service),
    Name(ServiceName),
}

impl SvcArg {
    /// A name has a `/` and no `[`/`:` before it; everything else is an address.
    pub fn parse(s: &str) -> Result<SvcArg, String> {
        let looks_like_name = s
            .split_once('/')
            .is_some_and(|(ns, _)| !ns.contains([':', '[']) && ns.parse::<IpAddr>().is_err());
        if looks_like_name {
            return s
                .parse()
                .map(SvcArg::Name)
                .map_err(|e: NameParseError| e.to_string());
        }
        Service::cluster_ip(s).map(SvcArg::Addr).map_err(|e| {
            if s.contains('/') {
                format!("{e}; a Service by name is NAMESPACE/NAME[:PORT]")
            } else {
                e.to_string()
            }
        })
    }
}

pub use crate::service::{AddrKind, Target, all_targets};

/// `namespace/name` of a port label.
fn service_of(port_name: &str) -> &str {
    port_name.rsplit_once(':').map_or(port_name, |(s, _)| s)
}

/// The Service port's number (ClusterIP port) and name of a port label.
fn port_matches(rules: &KubeProxyRules, port_name: &str, want: &PortRef) -> bool {
    let label_port = port_name.rsplit_once(':').map(|(_, p)| p);
    match want {
        PortRef::Name(n) => label_port == Some(n.as_str()),
        PortRef::Number(n) => {
            label_port == Some(n.to_string().as_str())
                || rules
                    .services
                    .iter()
                    .map(|s| (&*s.name, s.port))
                    .chain(
                        rules
                            .no_endpoints
                            .iter()
                            .map(|r| (r.port_name.as_str(), r.port)),
                    )
                    .any(|(name, port)| name == port_name && port == *n)
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LookupError {
    #[error(
        "no Service {wanted} in kube-proxy's rules on this node{near} (list them: nattrace doctor)"
    )]
    UnknownService { wanted: String, near: String },
    #[error("Service {service} has no port {port} in kube-proxy's rules (its ports: {ports})")]
    UnknownPort {
        service: String,
        port: String,
        ports: String,
    },
    #[error(
        "cannot look up Service {0}: no kube-proxy rules were readable on this node (give its ClusterIP with --svc IP[:PORT])"
    )]
    NoRules(String),
}

/// Every address of the Service (or of its one port).
pub fn resolve(rules: &KubeProxyRules, wanted: &ServiceName) -> Result<Vec<Target>, LookupError> {
    let targets = all_targets(rules);
    if targets.is_empty() {
        return Err(LookupError::NoRules(wanted.to_string()));
    }
    let svc = format!("{}/{}", wanted.namespace, wanted.name);
    let of_service: Vec<Target> = targets
        .into_iter()
        .filter(|t| service_of(&t.port_name) == svc)
        .collect();
    if of_service.is_empty() {
        let near = nearest_names(rules, &svc, 3);
        return Err(LookupError::UnknownService {
            wanted: svc,
            near: if near.is_empty() {
                String::new()
            } else {
                format!("; nearest: {}", near.join(", "))
            },
        });
    }
    let Some(port) = &wanted.port else {
        return Ok(of_service);
    };
    let chosen: Vec<Target> = of_service
        .iter()
        .filter(|t| port_matches(rules, &t.port_name, port))
        .cloned()
        .collect();
    if chosen.is_empty() {
        let ports: BTreeSet<&str> = of_service.iter().map(|t| t.port_name.as_str()).collect();
        return Err(LookupError::UnknownPort {
            service: svc,
            port: match port {
                PortRef::Name(n) => n.clone(),
                PortRef::Number(n) => n.to_string(),
            },
            ports: ports.into_iter().collect::<Vec<_>>().join(", "),
        });
    }
    Ok(chosen)
}

/// The Service names (`namespace/name`) in the rules, nearest to `wanted`
/// first: by edit distance over the whole name and over the name alone
/// (a Service asked for in the wrong namespace is found by its name).
pub fn nearest_names(rules: &KubeProxyRules, wanted: &str, n: usize) -> Vec<String> {
    let names: BTreeSet<String> = all_targets(rules)
        .iter()
        .map(|t| service_of(&t.port_name).to_owned())
        .collect();
    let bare = |s: &str| s.rsplit_once('/').map_or(s, |(_, n)| n).to_owned();
    let wanted_bare = bare(wanted);
    let mut scored: Vec<(usize, String)> = names
        .into_iter()
        .map(|name| {
            let d = strsim::levenshtein(wanted, &name)
                .min(strsim::levenshtein(&wanted_bare, &bare(&name)));
            (d, name)
        })
        .collect();
    scored.sort();
    let limit = wanted.len().max(4) / 2 + 2;
    scored
        .into_iter()
        .filter(|(d, _)| *d <= limit)
        .take(n)
        .map(|(_, s)| s)
        .collect()
}

/// The Service port an address:port belongs to (for `--svc IP:PORT`).
pub fn target_at(rules: &KubeProxyRules, addr: IpAddr, port: u16) -> Vec<Target> {
    all_targets(rules)
        .into_iter()
        .filter(|t| t.addr == addr && t.port == port)
        .collect()
}

/// An unbracketed IPv6 address whose last group reads as a port
/// (`fd00::1:80`): `FromStr` takes it as an address with no port (a bare
/// address is parsed first), which the user may not have meant. The other
/// reading, `[fd00::1]:80`, when there is one.
pub fn ambiguous_v6(svc: &Service) -> Option<(Service, String)> {
    let (IpAddr::V6(_), None) = (svc.addr, svc.port) else {
        return None;
    };
    let text = svc.addr.to_string();
    let (head, tail) = text.rsplit_once(':')?;
    if tail.is_empty() || !tail.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let port: u16 = tail.parse().ok().filter(|p| *p != 0)?;
    let addr: std::net::Ipv6Addr = head.parse().ok()?;
    let other = Service {
        addr: IpAddr::V6(addr),
        port: Some(port),
    };
    Some((other, text))
}

/// How to list the Services in rules of this mode (and family).
pub fn list_command(mode: crate::ruleset::ProxyMode, ipv6: bool) -> &'static str {
    match (mode, ipv6) {
        (crate::ruleset::ProxyMode::Nftables, false) => "nft list table ip kube-proxy",
        (crate::ruleset::ProxyMode::Nftables, true) => "nft list table ip6 kube-proxy",
        (_, false) => "iptables-save -t nat | grep KUBE-SVC",
        (_, true) => "ip6tables-save -t nat | grep KUBE-SVC",
    }
}

/// The addresses of the rules' Services nearest to `addr` (same family,
/// by numeric distance: a typo in the last octet lands next to the real
/// one), each with the Services at it.
pub fn nearest_addrs(rules: &KubeProxyRules, addr: IpAddr, n: usize) -> Vec<(IpAddr, Vec<String>)> {
    let key = |a: IpAddr| -> u128 {
        match a {
            IpAddr::V4(v4) => u128::from(u32::from(v4)),
            IpAddr::V6(v6) => u128::from(v6),
        }
    };
    let mut by_addr: std::collections::BTreeMap<IpAddr, BTreeSet<String>> = Default::default();
    for t in all_targets(rules) {
        if t.addr.is_ipv4() == addr.is_ipv4() {
            by_addr
                .entry(t.addr)
                .or_default()
                .insert(service_of(&t.port_name).to_owned());
        }
    }
    let mut near: Vec<(u128, IpAddr, Vec<String>)> = by_addr
        .into_iter()
        .map(|(a, names)| (key(a).abs_diff(key(addr)), a, names.into_iter().collect()))
        .collect();
    near.sort();
    near.into_iter().take(n).map(|(_, a, s)| (a, s)).collect()
}

/// The one warning line for a `--svc IP[:PORT]` that no Service of the
/// rules has (None when one has it). Not an error: kube-proxy may not
/// have written the Service's rules yet, so it is traced anyway.
pub fn check_addr(rules: &KubeProxyRules, svc: &Service) -> Option<String> {
    let targets = all_targets(rules);
    let ambiguous = ambiguous_v6(svc);
    let read_as = |why: &str| match &ambiguous {
        Some((other, text)) => format!(
            "--svc {text} is read as the address {text} (every port){why}; for port {} of {} write {other}",
            other.port.unwrap_or_default(),
            other.addr
        ),
        None => format!("--svc {svc}{why}"),
    };
    if targets.is_empty() {
        return Some(read_as(
            ": cannot check it, no kube-proxy rules were readable on this node; tracing it anyway",
        ));
    }
    let at_addr: Vec<&Target> = targets.iter().filter(|t| t.addr == svc.addr).collect();
    let list = list_command(rules.mode, svc.addr.is_ipv6());
    if at_addr.is_empty() {
        // The other reading of an ambiguous address may be a Service.
        if let Some((other, _)) = &ambiguous
            && targets
                .iter()
                .any(|t| t.addr == other.addr && Some(t.port) == other.port)
        {
            return Some(read_as(&format!(
                ", which no Service has ({other} is a Service's)"
            )));
        }
        let near: Vec<String> = nearest_addrs(rules, svc.addr, 3)
            .into_iter()
            .map(|(a, names)| format!("{a} ({})", names.join(", ")))
            .collect();
        let near = if near.is_empty() {
            String::new()
        } else {
            format!("; nearest: {}", near.join(", "))
        };
        return Some(read_as(&format!(
            ": no Service has this address in kube-proxy's rules{near}; list them: {list}; tracing it anyway"
        )));
    }
    let port = svc.port?;
    if at_addr.iter().any(|t| t.port == port) {
        return None;
    }
    let services: BTreeSet<&str> = at_addr.iter().map(|t| service_of(&t.port_name)).collect();
    let ports: BTreeSet<String> = at_addr
        .iter()
        .map(|t| {
            let name = t.port_name.rsplit_once(':').map_or("", |(_, p)| p);
            format!(
                "{}/{}{}",
                t.port,
                t.proto,
                if name.is_empty() {
                    String::new()
                } else {
                    format!(" ({name})")
                }
            )
        })
        .collect();
    Some(format!(
        "--svc {svc}: {} at {} has no port {port} in kube-proxy's rules (its ports: {}); list them: {list}; tracing it anyway",
        services.into_iter().collect::<Vec<_>>().join(", "),
        svc.addr,
        ports.into_iter().collect::<Vec<_>>().join(", ")
    ))
}

/// [`check_addr`] for every `--svc IP[:PORT]`: with no rules readable,
/// one line for all of them (an ambiguous IPv6 one keeps its own).
pub fn check_addrs(rules: &KubeProxyRules, services: &[Service]) -> Vec<String> {
    if !all_targets(rules).is_empty() {
        return services
            .iter()
            .filter_map(|s| check_addr(rules, s))
            .collect();
    }
    let (ambiguous, plain): (Vec<&Service>, Vec<&Service>) =
        services.iter().partition(|s| ambiguous_v6(s).is_some());
    let mut out: Vec<String> = ambiguous
        .into_iter()
        .filter_map(|s| check_addr(rules, s))
        .collect();
    if !plain.is_empty() {
        let list: Vec<String> = plain.iter().map(ToString::to_string).collect();
        out.push(format!(
            "--svc {}: cannot check, no kube-proxy rules were readable on this node; tracing anyway",
            list.join(", ")
        ));
    }
    out
}

#[cfg(test)]
mod tests;
