//! Minimal IPv4 and IPv6 prefix types; the lab only needs parsing, printing,
//! membership and "n-th host", which does not justify another dependency.

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

/// An IPv4 prefix such as `100.96.54.0/24`. The address may have host bits
/// set (`100.96.54.1/24` is an interface address in that prefix).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ipv4Cidr {
    addr: Ipv4Addr,
    prefix: u8,
}

impl Ipv4Cidr {
    /// `prefix` must be at most 32.
    pub const fn new(addr: Ipv4Addr, prefix: u8) -> Self {
        assert!(prefix <= 32, "IPv4 prefix length is at most 32");
        Ipv4Cidr { addr, prefix }
    }

    /// The address as given (host bits kept).
    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }

    /// The prefix length.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    fn mask(&self) -> u32 {
        if self.prefix == 0 {
            0
        } else {
            u32::MAX << (32 - self.prefix)
        }
    }

    /// The network address (host bits cleared).
    pub fn network(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.addr) & self.mask())
    }

    /// The network prefix itself, e.g. `100.96.54.0/24` for `100.96.54.1/24`.
    pub fn trunc(&self) -> Ipv4Cidr {
        Ipv4Cidr::new(self.network(), self.prefix)
    }

    /// The `n`-th address of the prefix (0 is the network address).
    pub fn host(&self, n: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network()).wrapping_add(n))
    }

    /// Whether `ip` lies inside this prefix.
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & self.mask() == u32::from(self.network())
    }

    /// The same address with another prefix length (e.g. a pod IP `/24` on its link).
    pub fn with_addr(&self, addr: Ipv4Addr) -> Ipv4Cidr {
        Ipv4Cidr::new(addr, self.prefix)
    }
}

impl fmt::Display for Ipv4Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl FromStr for Ipv4Cidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (addr, prefix) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?} is not an IPv4 prefix (expected a.b.c.d/n)"))?;
        let addr: Ipv4Addr = addr
            .parse()
            .map_err(|e| format!("{s:?}: bad address: {e}"))?;
        let prefix: u8 = prefix
            .parse()
            .ok()
            .filter(|p| *p <= 32)
            .ok_or_else(|| format!("{s:?}: prefix length must be 0..=32"))?;
        Ok(Ipv4Cidr::new(addr, prefix))
    }
}

/// An IPv6 prefix such as `fd00:10:244:36::/64` (host bits may be set,
/// as on an interface address).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ipv6Cidr {
    addr: Ipv6Addr,
    prefix: u8,
}

impl Ipv6Cidr {
    /// `prefix` must be at most 128.
    pub const fn new(addr: Ipv6Addr, prefix: u8) -> Self {
        assert!(prefix <= 128, "IPv6 prefix length is at most 128");
        Ipv6Cidr { addr, prefix }
    }

    /// The address as given (host bits kept).
    pub fn addr(&self) -> Ipv6Addr {
        self.addr
    }

    /// The prefix length.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    fn mask(&self) -> u128 {
        if self.prefix == 0 {
            0
        } else {
            u128::MAX << (128 - self.prefix)
        }
    }

    /// The network address (host bits cleared).
    pub fn network(&self) -> Ipv6Addr {
        Ipv6Addr::from(u128::from(self.addr) & self.mask())
    }

    /// The network prefix itself.
    pub fn trunc(&self) -> Ipv6Cidr {
        Ipv6Cidr::new(self.network(), self.prefix)
    }

    /// The `n`-th address of the prefix (0 is the subnet-router anycast address).
    pub fn host(&self, n: u128) -> Ipv6Addr {
        Ipv6Addr::from(u128::from(self.network()).wrapping_add(n))
    }

    /// Whether `ip` lies inside this prefix.
    pub fn contains(&self, ip: Ipv6Addr) -> bool {
        u128::from(ip) & self.mask() == u128::from(self.network())
    }
}

impl fmt::Display for Ipv6Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// Shorthand for tests and presets: panics on a malformed literal.
pub fn cidr(s: &str) -> Ipv4Cidr {
    s.parse().unwrap_or_else(|e| panic!("{e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_members() {
        let c = cidr("100.96.0.0/11");
        assert!(c.contains("100.96.54.240".parse().unwrap()));
        assert!(c.contains("100.127.255.255".parse().unwrap()));
        assert!(!c.contains("100.128.0.1".parse().unwrap()));
        assert!(!c.contains("100.67.30.133".parse().unwrap()));
        let p = cidr("100.96.54.7/24");
        assert_eq!(p.network(), Ipv4Addr::new(100, 96, 54, 0));
        assert_eq!(p.host(1), Ipv4Addr::new(100, 96, 54, 1));
        assert_eq!(p.trunc().to_string(), "100.96.54.0/24");
        assert!("1.2.3.4/33".parse::<Ipv4Cidr>().is_err());
        assert!("1.2.3.4".parse::<Ipv4Cidr>().is_err());
        assert_eq!(cidr("0.0.0.0/0").network(), Ipv4Addr::UNSPECIFIED);
        let v6 = Ipv6Cidr::new("fd00:10:244:36::f0".parse().unwrap(), 64);
        assert_eq!(v6.trunc().to_string(), "fd00:10:244:36::/64");
        assert_eq!(v6.host(1).to_string(), "fd00:10:244:36::1");
        assert!(v6.contains("fd00:10:244:36::1:2".parse().unwrap()));
        assert!(!v6.contains("fd00:10:244:37::1".parse().unwrap()));
    }
}
