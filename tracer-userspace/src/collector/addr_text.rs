//! `a.b.c.d:port` written without `core::fmt`. Every reported flow names
//! about nine addresses (its ends and each proving hop's); through
//! `Display` each cost ~950 instructions, 8.6k of a healthy connection's
//! ~116k (callgrind, BENCHMARKS.md). IPv6 keeps std's formatting (its
//! zero-run compression is not worth redoing).
use std::net::SocketAddr;

use serde::Serializer;

/// An address as text, on the stack.
#[derive(Clone, Copy, Debug)]
pub struct AddrText {
    buf: [u8; 64],
    len: usize,
}

impl AddrText {
    pub fn new(addr: &SocketAddr) -> Self {
        let mut t = AddrText {
            buf: [0; 64],
            len: 0,
        };
        match addr {
            SocketAddr::V4(a) => {
                // The length stays in a local: pushed through `self` it was
                // stored back after every byte.
                let (buf, mut n) = (&mut t.buf, 0);
                for (i, o) in a.ip().octets().into_iter().enumerate() {
                    if i > 0 {
                        buf[n] = b'.';
                        n += 1;
                    }
                    if o >= 100 {
                        buf[n] = b'0' + o / 100;
                        n += 1;
                    }
                    if o >= 10 {
                        buf[n] = b'0' + o / 10 % 10;
                        n += 1;
                    }
                    buf[n] = b'0' + o % 10;
                    n += 1;
                }
                buf[n] = b':';
                n += 1;
                let port = a.port();
                let digits = match port {
                    0..10 => 1,
                    10..100 => 2,
                    100..1000 => 3,
                    1000..10000 => 4,
                    _ => 5,
                };
                let mut p = port;
                for k in (0..digits).rev() {
                    buf[n + k] = b'0' + (p % 10) as u8;
                    p /= 10;
                }
                t.len = n + digits;
            }
            SocketAddr::V6(a) => {
                use std::io::Write as _;
                let mut cursor = std::io::Cursor::new(&mut t.buf[..]);
                // "[ffff:…:ffff%4294967295]:65535" is 54 bytes: it fits.
                let _ = write!(cursor, "{a}");
                t.len = cursor.position() as usize;
            }
        }
        t
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    pub fn as_str(&self) -> &str {
        // Only ASCII digits, dots, colons, brackets and hex were written.
        std::str::from_utf8(&self.buf[..self.len]).unwrap_or_default()
    }
}

/// `#[serde(serialize_with)]` for a `SocketAddr`: the same string as serde's.
pub fn serialize<S: Serializer>(addr: &SocketAddr, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(AddrText::new(addr).as_str())
}

/// The same for an `Option<SocketAddr>` (`null` when absent).
pub fn serialize_opt<S: Serializer>(addr: &Option<SocketAddr>, s: S) -> Result<S::Ok, S::Error> {
    match addr {
        Some(a) => serialize(a, s),
        None => s.serialize_none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_text_as_std() {
        for a in [
            "0.0.0.0:0",
            "100.67.30.133:80",
            "255.255.255.255:65535",
            "10.0.0.1:53",
            "1.9.99.109:1",
            "200.10.5.250:443",
            "[fd00:10:96::a]:53",
            "[::ffff:10.0.0.1]:8080",
            "[fe80::1%4294967295]:65535",
            "[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:65535",
        ] {
            let addr: SocketAddr = a.parse().unwrap();
            assert_eq!(AddrText::new(&addr).as_str(), addr.to_string(), "{a}");
            let json = serde_json::to_string(&addr).unwrap();
            let mut ours = serde_json::Serializer::new(Vec::new());
            serialize(&addr, &mut ours).unwrap();
            assert_eq!(String::from_utf8(ours.into_inner()).unwrap(), json);
        }
    }
}
