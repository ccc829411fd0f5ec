//! `a.b.c.d:port` written without `core::fmt`. Every reported flow names
//! about nine addresses (its ends and each proving hop's); through
//! `Display` each cost ~950 instructions, 8.6k of a healthy connection's
//! ~116k (callgrind, BENCHMARKS.md). IPv6 keeps std's formatting (its
//! zero-run compression is not worth redoing).
use std::net::SocketAddr;

use serde::Serializer;

/// Each byte's decimal text, left-aligned in three bytes after its length:
/// an octet's divisions and a branch per digit made `AddrText::new` ~215
/// instructions per address (callgrind, BENCHMARKS.md "An ok line's
/// addresses").
const OCTETS: [[u8; 4]; 256] = {
    let mut t = [[0u8; 4]; 256];
    let mut o = 0;
    while o < 256 {
        let (h, d, u) = ((o / 100) as u8, (o / 10 % 10) as u8, (o % 10) as u8);
        t[o] = if o >= 100 {
            [3, b'0' + h, b'0' + d, b'0' + u]
        } else if o >= 10 {
            [2, b'0' + d, b'0' + u, 0]
        } else {
            [1, b'0' + u, 0, 0]
        };
        o += 1;
    }
    t
};

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
                let mut b = [0u8; V4_MAX];
                let n = v4(&mut b, a);
                t.buf[..V4_MAX].copy_from_slice(&b);
                t.len = n;
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

/// `a.b.c.d:port` is at most 21 bytes; the port is stored as a whole
/// eight-byte word after the colon (at most at 16).
const V4_MAX: usize = 24;

/// `a`'s text at the start of `buf`; its length. The length stays in a
/// local (kept in `AddrText` it was stored back after every byte).
fn v4(buf: &mut [u8; V4_MAX], a: &std::net::SocketAddrV4) -> usize {
    let mut n = 0;
    for (i, o) in a.ip().octets().into_iter().enumerate() {
        if i > 0 {
            buf[n] = b'.';
            n += 1;
        }
        // Three digits copied whatever the length, then the length
        // counted: no divisions, no branch per digit.
        let [len, d @ ..] = OCTETS[usize::from(o)];
        buf[n..n + 3].copy_from_slice(&d);
        n += usize::from(len);
    }
    buf[n] = b':';
    n += 1;
    let p = u64::from(a.port());
    let digits = match p {
        0..10 => 1,
        10..100 => 2,
        100..1000 => 3,
        1000..10000 => 4,
        _ => 5,
    };
    // All five digits in one little-endian word, the leading zeros shifted
    // out, stored in one go (a loop of a division per digit before).
    let five = [p / 10000, p / 1000 % 10, p / 100 % 10, p / 10 % 10, p % 10]
        .iter()
        .enumerate()
        .fold(0u64, |w, (i, d)| w | (u64::from(b'0') + d) << (8 * i));
    let word = five >> (8 * (5 - digits));
    buf[n..n + 8].copy_from_slice(&word.to_le_bytes());
    n + digits
}

/// `addr`'s text appended to `out`, as [`AddrText`] writes it: the JSON
/// lines name ~8 addresses per flow, and building an `AddrText` to copy
/// from cost its 72 bytes twice over.
pub fn push(out: &mut Vec<u8>, addr: &SocketAddr) {
    match addr {
        SocketAddr::V4(a) => {
            let mut b = [0u8; V4_MAX];
            let n = v4(&mut b, a);
            out.extend_from_slice(&b[..n]);
        }
        SocketAddr::V6(_) => out.extend_from_slice(AddrText::new(addr).as_bytes()),
    }
}

/// [`push`] for a sentence (the `ok` detail, the text line's head).
pub fn push_str(out: &mut String, addr: &SocketAddr) {
    match addr {
        SocketAddr::V4(a) => {
            let mut b = [0u8; V4_MAX];
            let n = v4(&mut b, a);
            // Digits, dots and a colon: always UTF-8.
            out.push_str(std::str::from_utf8(&b[..n]).unwrap_or_default());
        }
        SocketAddr::V6(_) => out.push_str(AddrText::new(addr).as_str()),
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

    /// Every octet value in every place, and ports of each length.
    #[test]
    fn every_octet_and_port_length() {
        for o in 0..=255u8 {
            for (i, port) in [0u16, 9, 10, 99, 100, 999, 1000, 9999, 10000, 65535]
                .into_iter()
                .enumerate()
            {
                let mut ip = [1, 22, 133, 4];
                ip[i % 4] = o;
                let addr = SocketAddr::from((ip, port));
                assert_eq!(AddrText::new(&addr).as_str(), addr.to_string());
                let mut pushed = b"x".to_vec();
                push(&mut pushed, &addr);
                assert_eq!(pushed[1..], *addr.to_string().as_bytes());
                let mut sentence = String::from("x");
                push_str(&mut sentence, &addr);
                assert_eq!(sentence[1..], addr.to_string());
            }
        }
    }
}
