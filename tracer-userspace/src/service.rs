//! The `--svc IP[:PORT]` filter.
use std::{fmt, net::Ipv4Addr, str::FromStr};

/// A Service to trace: its cluster IP and optionally one port (none = every port), TCP and UDP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct Service {
    pub addr: Ipv4Addr,
    pub port: Option<u16>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ServiceParseError {
    #[error("'{0}' is not an IPv4 address (expected IP or IP:PORT, e.g. 100.67.30.133:80)")]
    BadAddress(String),
    #[error("'{0}' is not a port number 1-65535 (expected IP or IP:PORT, e.g. 100.67.30.133:80)")]
    BadPort(String),
}

impl FromStr for Service {
    type Err = ServiceParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (addr, port) = match s.rsplit_once(':') {
            Some((addr, port)) => (addr, Some(port)),
            None => (s, None),
        };
        let addr: Ipv4Addr = addr
            .parse()
            .map_err(|_| ServiceParseError::BadAddress(addr.to_string()))?;
        let port = match port {
            None => None,
            Some(p) => match p.parse::<u16>() {
                Ok(0) | Err(_) => return Err(ServiceParseError::BadPort(p.to_string())),
                Ok(n) => Some(n),
            },
        };
        Ok(Service { addr, port })
    }
}

impl fmt::Display for Service {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.port {
            Some(port) => write!(f, "{}:{port}", self.addr),
            None => write!(f, "{}", self.addr),
        }
    }
}

/// One entry of the kernel's Service filter: a Service IP, one port (0 =
/// every port) and one protocol (`tracer_common::proto`). `--svc` gives
/// both protocols; kube-proxy's rules give each Service port its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePort {
    pub addr: Ipv4Addr,
    pub port: u16,
    pub proto: u8,
}

/// What to trace: the `--svc` Services and, with `--all-services`, every
/// Service port in kube-proxy's rules (those with endpoints and those it
/// REJECTs for having none).
pub fn traced_ports(
    services: &[Service],
    rules: Option<&crate::ruleset::KubeProxyRules>,
) -> std::collections::BTreeSet<ServicePort> {
    use tracer_common::proto;
    let proto_of = |p: &str| match p {
        "tcp" => Some(proto::TCP),
        "udp" => Some(proto::UDP),
        _ => None,
    };
    let mut out = std::collections::BTreeSet::new();
    for s in services {
        for proto in [proto::TCP, proto::UDP] {
            out.insert(ServicePort {
                addr: s.addr,
                port: s.port.unwrap_or(0),
                proto,
            });
        }
    }
    let Some(rules) = rules else { return out };
    let from_rules = rules
        .services
        .iter()
        .map(|s| (s.cluster_ip, s.port, s.proto.as_str()))
        .chain(
            rules
                .no_endpoints
                .iter()
                .map(|r| (r.ip, r.port, r.protocol.as_str())),
        );
    for (addr, port, p) in from_rules {
        if let Some(proto) = proto_of(p) {
            out.insert(ServicePort { addr, port, proto });
        }
    }
    out
}

/// The collector's question per unmatched packet, "is this a traced
/// Service?", in O(1) however many Services are traced (the protocol is
/// the kernel's concern).
#[derive(Clone, Debug, Default)]
pub struct ServiceSet {
    set: std::collections::HashSet<Service>,
}

impl ServiceSet {
    pub fn new(ports: impl IntoIterator<Item = ServicePort>) -> Self {
        let set = ports
            .into_iter()
            .map(|p| Service {
                addr: p.addr,
                port: (p.port != 0).then_some(p.port),
            })
            .collect();
        Self { set }
    }

    pub fn contains(&self, addr: Ipv4Addr, port: u16) -> bool {
        self.set.contains(&Service {
            addr,
            port: Some(port),
        }) || self.set.contains(&Service { addr, port: None })
    }

    pub fn len(&self) -> usize {
        self.set.len()
    }

    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ip_and_ip_port() {
        assert_eq!(
            "100.67.30.133".parse(),
            Ok(Service {
                addr: Ipv4Addr::new(100, 67, 30, 133),
                port: None
            })
        );
        assert_eq!(
            "10.0.0.1:53".parse(),
            Ok(Service {
                addr: Ipv4Addr::new(10, 0, 0, 1),
                port: Some(53)
            })
        );
    }

    #[test]
    fn rejects_bad_input() {
        assert!(matches!(
            "300.1.1.1".parse::<Service>(),
            Err(ServiceParseError::BadAddress(_))
        ));
        assert!(matches!(
            "1.2.3.4:0".parse::<Service>(),
            Err(ServiceParseError::BadPort(_))
        ));
        assert!(matches!(
            "1.2.3.4:99999".parse::<Service>(),
            Err(ServiceParseError::BadPort(_))
        ));
        assert!(matches!(
            "svc".parse::<Service>(),
            Err(ServiceParseError::BadAddress(_))
        ));
    }

    #[test]
    fn traced_ports_join_svc_and_the_rules() {
        use crate::ruleset::{KubeProxyRules, RejectRule, SvcRule};
        let ip = |d| Ipv4Addr::new(10, 0, 0, d);
        let rules = KubeProxyRules {
            services: vec![SvcRule {
                name: "ns/a:http".into(),
                cluster_ip: ip(1),
                port: 80,
                proto: "tcp".into(),
                chain: "KUBE-SVC-A".into(),
                masquerade_all: false,
                endpoints: vec![],
            }],
            no_endpoints: vec![RejectRule {
                ip: ip(2),
                port: 53,
                protocol: "udp".into(),
                port_name: "ns/b:dns".into(),
                rule: String::new(),
            }],
            ..Default::default()
        };
        let svc: Service = "10.0.0.9".parse().unwrap();
        let ports = traced_ports(&[svc], Some(&rules));
        let tcp = tracer_common::proto::TCP;
        let udp = tracer_common::proto::UDP;
        let expect = [
            (ip(1), 80, tcp),
            (ip(2), 53, udp),
            (ip(9), 0, tcp),
            (ip(9), 0, udp),
        ];
        let got: Vec<_> = ports.iter().map(|p| (p.addr, p.port, p.proto)).collect();
        assert_eq!(got, expect);
        let set = ServiceSet::new(ports);
        assert!(set.contains(ip(1), 80));
        assert!(!set.contains(ip(1), 81));
        assert!(set.contains(ip(9), 12345));
        assert!(!set.contains(ip(3), 80));
        assert_eq!(traced_ports(&[svc], None).len(), 2);
    }
}
