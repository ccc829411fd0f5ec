//! The `--svc IP[:PORT]` filter, IPv4 or IPv6 (`fd00:10:96::a`,
//! `[fd00:10:96::a]:80`).
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
    std::net::Ipv6Addr::from(tracer_common::addr_bytes(addr)).to_canonical()
}

const EXAMPLE: &str = "e.g. 100.67.30.133:80, fd00:10:96::a or [fd00:10:96::a]:80";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ServiceParseError {
    #[error("'{0}' is not an IPv4 or IPv6 address (expected IP or IP:PORT, {EXAMPLE})")]
    BadAddress(String),
    #[error("'{0}' is not a port number 1-65535 (expected IP or IP:PORT, {EXAMPLE})")]
    BadPort(String),
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

impl fmt::Display for Service {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.port {
            // SocketAddr writes IPv6 as [addr]:port.
            Some(port) => SocketAddr::new(self.addr, port).fmt(f),
            None => write!(f, "{}", self.addr),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

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
}
