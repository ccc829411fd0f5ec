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
}
