//! The `--svc IP[:PORT]` filter, IPv4 or IPv6 (`fd00:10:96::a`,
//! `[fd00:10:96::a]:80`).
use crate::ruleset::{KubeProxyRules, external::ExternalKind};
use std::{
    fmt,
    net::{IpAddr, SocketAddr},
    str::FromStr,
};

/// A Service to trace: its cluster IP and optionally one port (none = every port), TCP and UDP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct Service {
    pub addr: IpAddr,
    pub port: Option<u16>,
}

impl Service {
    /// The address as the kernel filter keys it (IPv4-mapped for IPv4).
    pub fn kernel_addr(&self) -> tracer_common::Addr {
        kernel_addr(self.addr)
    }
}

/// An address in the kernel's 128-bit form (tracer_common::Addr).
pub fn kernel_addr(addr: IpAddr) -> tracer_common::Addr {
    match addr {
        IpAddr::V4(v4) => tracer_common::v4_mapped(v4.octets()),
        IpAddr::V6(v6) => tracer_common::addr_from_bytes(v6.octets()),
    }
}

/// The address of a kernel [`tracer_common::Addr`]: IPv4 for IPv4-mapped ones.
pub fn ip_of(addr: tracer_common::Addr) -> IpAddr {
    // By words, as the kernel side tells them: `Ipv6Addr::to_canonical`
    // matched the bytes one by one, and the collector converts each
    // event's two addresses several times (~1k instructions a healthy
    // connection, issue 25, callgrind).
    match tracer_common::as_v4(&addr) {
        Some(v4) => IpAddr::V4(v4.into()),
        None => IpAddr::V6(tracer_common::addr_bytes(addr).into()),
    }
}

const EXAMPLE: &str = "e.g. 100.67.30.133:80, fd00:10:96::a or [fd00:10:96::a]:80";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ServiceParseError {
    #[error("'{0}' is not an IPv4 or IPv6 address (expected IP or IP:PORT, {EXAMPLE})")]
    BadAddress(String),
    #[error("'{0}' is not a port number 1-65535 (expected IP or IP:PORT, {EXAMPLE})")]
    BadPort(String),
    #[error(
        "{0}, not a Service's unicast cluster IP (e.g. 100.67.30.133:80 or [fd00:10:96::a]:80)"
    )]
    NotUnicast(&'static str),
}

impl FromStr for Service {
    type Err = ServiceParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // A bare address first: an IPv6 one is full of colons.
        if let Ok(addr) = s.parse::<IpAddr>() {
            return Ok(Service { addr, port: None });
        }
        // `[v6]:port` or `v4:port`. A bracketed address without a port is
        // accepted too (`[fd00::a]`), as URLs write it.
        let (addr, port) = match s.strip_prefix('[') {
            Some(rest) => match rest.split_once(']') {
                Some((addr, "")) => (addr, None),
                Some((addr, tail)) => match tail.strip_prefix(':') {
                    Some(port) => (addr, Some(port)),
                    None => return Err(ServiceParseError::BadAddress(s.to_string())),
                },
                None => return Err(ServiceParseError::BadAddress(s.to_string())),
            },
            None => match s.rsplit_once(':') {
                Some((addr, port)) => (addr, Some(port)),
                None => (s, None),
            },
        };
        let addr: IpAddr = match (addr.parse(), s.starts_with('[')) {
            (Ok(IpAddr::V6(v6)), true) => IpAddr::V6(v6),
            // `v6:port` without brackets is ambiguous, and `[v4]` is not an address form.
            (Ok(IpAddr::V4(v4)), false) => IpAddr::V4(v4),
            _ => return Err(ServiceParseError::BadAddress(addr.to_string())),
        };
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

impl Service {
    /// A Service given on the command line: parsed as [`FromStr`] does, and
    /// a cluster IP is a unicast address: the unspecified, "this network",
    /// broadcast, multicast and reserved (240/4) ranges are mistakes; for
    /// IPv6 also link-local and IPv4-mapped ones (give the IPv4 address).
    /// (Recordings' services are read with plain [`FromStr`].)
    pub fn cluster_ip(s: &str) -> Result<Service, ServiceParseError> {
        let svc: Service = s.parse()?;
        let why = match svc.addr {
            IpAddr::V4(a) => {
                if a.is_unspecified() || a.octets()[0] == 0 {
                    Some("an unspecified (0.0.0.0/8) address")
                } else if a.is_broadcast() {
                    Some("the broadcast address")
                } else if a.is_multicast() {
                    Some("a multicast address")
                } else if a.octets()[0] >= 240 {
                    Some("a reserved (240.0.0.0/4) address")
                } else {
                    None
                }
            }
            IpAddr::V6(a) => {
                if a.is_unspecified() {
                    Some("the unspecified address ::")
                } else if a.is_multicast() {
                    Some("a multicast (ff00::/8) address")
                } else if a.is_unicast_link_local() {
                    Some("a link-local (fe80::/10) address")
                } else if a.to_ipv4_mapped().is_some() {
                    Some("an IPv4-mapped address (give the IPv4 address itself)")
                } else {
                    None
                }
            }
        };
        match why {
            Some(why) => Err(ServiceParseError::NotUnicast(why)),
            None => Ok(svc),
        }
    }
}

impl fmt::Display for Service {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.port {
            // SocketAddr writes IPv6 as [addr]:port.
            Some(port) => SocketAddr::new(self.addr, port).fmt(f),
            None => write!(f, "{}", self.addr),
        }
    }
}

/// One entry of the kernel's Service filter: a Service IP, one port (0 =
/// every port) and one protocol (`tracer_common::proto`). `--svc` gives
/// both protocols; kube-proxy's rules give each Service port its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePort {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: u8,
}

/// What to trace: the `--svc` Services and, with `--all-services`, every
/// Service port in kube-proxy's rules (those with endpoints and those it
/// REJECTs for having none).
pub fn traced_ports(
    services: &[Service],
    rules: Option<&KubeProxyRules>,
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
    // ClusterIPs, rejects, NodePorts on the node's addresses, LB and
    // external IPs (issue 24).
    for t in all_targets(rules) {
        if let Some(proto) = proto_of(&t.proto) {
            out.insert(ServicePort {
                addr: t.addr,
                port: t.port,
                proto,
            });
        }
    }
    out
}

/// The collector's question per unmatched packet, "is this a traced
/// Service?", in O(1) however many Services are traced (the protocol is
/// the kernel's concern).
#[derive(Clone, Debug, Default)]
pub struct ServiceSet {
    // foldhash: looked up for each new flow; SipHash here and in the
    // outputs' set of Services seen cost ~450 instructions per connection
    // (callgrind).
    set: std::collections::HashSet<Service, foldhash::fast::RandomState>,
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

    pub fn contains(&self, addr: IpAddr, port: u16) -> bool {
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

/// What kind of address of a Service a [`Target`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum AddrKind {
    ClusterIp,
    External(ExternalKind),
}

impl AddrKind {
    pub fn as_str(self) -> &'static str {
        match self {
            AddrKind::ClusterIp => "ClusterIP",
            AddrKind::External(k) => k.as_str(),
        }
    }
}

/// One address:port a Service port is reached at.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Target {
    pub addr: IpAddr,
    pub port: u16,
    /// "tcp" / "udp".
    pub proto: String,
    pub kind: AddrKind,
    /// kube-proxy's `namespace/name:port`.
    pub port_name: String,
}

impl Target {
    pub fn service(&self) -> Service {
        Service {
            addr: self.addr,
            port: Some(self.port),
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({} {}/{})",
            self.service(),
            self.port_name,
            self.kind.as_str(),
            self.proto
        )
    }
}

/// Every address of every Service port in the rules (NodePorts once per
/// address kube-proxy accepts them on).
pub fn all_targets(rules: &KubeProxyRules) -> Vec<Target> {
    let mut out: Vec<Target> = rules
        .services
        .iter()
        .map(|s| (s.cluster_ip, s.port, s.proto.as_str(), &*s.name))
        .chain(
            rules
                .no_endpoints
                .iter()
                .map(|r| (r.ip, r.port, r.protocol.as_str(), r.port_name.as_str())),
        )
        .map(|(addr, port, proto, name)| Target {
            addr,
            port,
            proto: proto.to_string(),
            kind: AddrKind::ClusterIp,
            port_name: name.to_owned(),
        })
        .collect();
    let ns = &rules.north_south;
    for e in &ns.external {
        let addrs = match e.ip {
            Some(ip) => vec![ip],
            None => ns.node_port_addrs(e.ipv6),
        };
        for addr in addrs {
            out.push(Target {
                addr,
                port: e.port,
                proto: e.proto.clone(),
                kind: AddrKind::External(e.kind),
                port_name: e.name.clone(),
            });
        }
    }
    // A no-endpoints reject of an external IP is listed as the external
    // entry too: one target per address and port.
    out.sort();
    out.dedup_by(|a, b| a.addr == b.addr && a.port == b.port && a.proto == b.proto);
    out
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

    /// The word test gives what `Ipv6Addr::to_canonical` gives: IPv4 for
    /// `::ffff:a.b.c.d` only, not for the deprecated `::a.b.c.d` or
    /// anything one word off.
    #[test]
    fn ip_of_is_the_canonical_address() {
        let cases = [
            "::ffff:100.67.30.133",
            "::ffff:0.0.0.0",
            "::ffff:255.255.255.255",
            "::100.67.30.133",
            "::fffe:100.67.30.133",
            "1::ffff:100.67.30.133",
            "0:0:0:1:0:ffff:6443:1e85",
            "fd00:10:96::a",
            "::",
            "::1",
        ];
        for c in cases {
            let v6: Ipv6Addr = c.parse().unwrap();
            let addr = tracer_common::addr_from_bytes(v6.octets());
            assert_eq!(ip_of(addr), v6.to_canonical(), "{c}");
            assert_eq!(kernel_addr(ip_of(addr)), addr, "{c}");
        }
    }

    #[test]
    fn parses_ip_and_ip_port() {
        assert_eq!(
            "100.67.30.133".parse(),
            Ok(Service {
                addr: Ipv4Addr::new(100, 67, 30, 133).into(),
                port: None
            })
        );
        assert_eq!(
            "10.0.0.1:53".parse(),
            Ok(Service {
                addr: Ipv4Addr::new(10, 0, 0, 1).into(),
                port: Some(53)
            })
        );
    }

    #[test]
    fn parses_ipv6_bare_and_bracketed() {
        let a: IpAddr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0xa).into();
        assert_eq!(
            "fd00:10:96::a".parse(),
            Ok(Service {
                addr: a,
                port: None
            })
        );
        assert_eq!(
            "[fd00:10:96::a]:80".parse(),
            Ok(Service {
                addr: a,
                port: Some(80)
            })
        );
        assert_eq!(
            "[fd00:10:96::a]".parse(),
            Ok(Service {
                addr: a,
                port: None
            })
        );
        // Display round-trips.
        for s in ["fd00:10:96::a", "[fd00:10:96::a]:80", "10.0.0.1:53"] {
            assert_eq!(s.parse::<Service>().unwrap().to_string(), s);
        }
    }

    #[test]
    fn kernel_form_is_ipv4_mapped() {
        let s: Service = "100.67.30.133:80".parse().unwrap();
        assert_eq!(
            s.kernel_addr(),
            tracer_common::v4_mapped([100, 67, 30, 133])
        );
        assert_eq!(ip_of(s.kernel_addr()), s.addr);
        let s: Service = "[fd00:10:96::a]:80".parse().unwrap();
        assert_eq!(ip_of(s.kernel_addr()), s.addr);
    }

    #[test]
    fn rejects_bad_input() {
        for (input, port) in [
            ("300.1.1.1", false),
            ("1.2.3.4:0", true),
            ("1.2.3.4:99999", true),
            ("svc", false),
            ("[fd00::a]:0", true),
            ("[fd00::a]:http", true),
            ("[fd00::a", false),
            ("[fd00::a]80", false),
            ("[1.2.3.4]:80", false),
            ("fd00::zz", false),
            ("[]:80", false),
        ] {
            let r = input.parse::<Service>();
            if port {
                assert!(
                    matches!(r, Err(ServiceParseError::BadPort(_))),
                    "{input}: {r:?}"
                );
            } else {
                assert!(
                    matches!(r, Err(ServiceParseError::BadAddress(_))),
                    "{input}: {r:?}"
                );
            }
        }
    }

    #[test]
    fn traced_ports_join_svc_and_the_rules() {
        use crate::ruleset::{KubeProxyRules, RejectRule, SvcRule};
        let ip = |d| std::net::IpAddr::V4(Ipv4Addr::new(10, 0, 0, d));
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
