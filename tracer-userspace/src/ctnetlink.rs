//! One conntrack entry looked up by its tuple over ctnetlink, when an
//! established flow fails the watch (issue 21): whether the connection's
//! entry is still there tells a packet marked INVALID because its entry
//! was deleted (flushed, expired, `conntrack -D`) from one marked INVALID
//! although its entry is in place (out of the TCP window).
//!
//! Hand-written because no maintained crate speaks ctnetlink
//! (netlink-packet-netfilter 0.4 has nflog and nftables only); the
//! attribute encoding and parsing are netlink-packet-core's. What is sent is
//! what `conntrack -G` sends: IPCTNL_MSG_CT_GET with CTA_TUPLE_ORIG
//! (include/uapi/linux/netfilter/nfnetlink_conntrack.h). The kernel finds
//! the entry whether the tuple is its original or its reply direction
//! (`ctnetlink_get_conntrack` → `nf_conntrack_find_get`, whose hash holds
//! both directions' tuples), and answers ENOENT when there is none.
//! conntrack entries are per network namespace: call inside the node's.
use std::net::{IpAddr, SocketAddr};

use netlink_packet_core::{
    DefaultNla, Emitable, NLA_F_NESTED, NLM_F_ACK, NLM_F_REQUEST, NlaBuffer, NlasIterator,
};
use netlink_sys::{Socket, SocketAddr as NlAddr, protocols::NETLINK_NETFILTER};
use serde::{Deserialize, Serialize};

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_NEW: u16 = 0;
const IPCTNL_MSG_CT_GET: u16 = 1;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;

const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_STATUS: u16 = 3;
const CTA_PROTOINFO: u16 = 4;
const CTA_TIMEOUT: u16 = 7;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;
const CTA_PROTOINFO_TCP: u16 = 1;
const CTA_PROTOINFO_TCP_STATE: u16 = 1;

/// `enum ip_conntrack_status` bit: the entry DNATs its original direction.
pub const IPS_DST_NAT: u32 = 1 << 5;

/// `enum tcp_conntrack`, as `conntrack -L` prints it.
const TCP_STATES: [&str; 10] = [
    "NONE",
    "SYN_SENT",
    "SYN_RECV",
    "ESTABLISHED",
    "FIN_WAIT",
    "CLOSE_WAIT",
    "LAST_ACK",
    "TIME_WAIT",
    "CLOSE",
    "SYN_SENT2",
];

/// One direction of a connection as conntrack keys it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CtTuple {
    pub proto: u8,
    pub src: SocketAddr,
    pub dst: SocketAddr,
}

/// The entry found, as `conntrack -G` would print it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CtEntry {
    pub orig: CtTuple,
    pub reply: CtTuple,
    /// `enum ip_conntrack_status` bits.
    pub status: u32,
    /// TCP only: the tracked state (`ESTABLISHED`, `CLOSE`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_state: Option<String>,
    /// Seconds left before it expires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<u32>,
}

impl CtEntry {
    pub fn dnat(&self) -> bool {
        self.status & IPS_DST_NAT != 0
    }
}

/// What conntrack held for a flow when it failed the watch: recorded as a
/// `ct_entry` line, so that `analyze` names the cause as the live run did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CtLookup {
    /// The flow as its client sent it (to the Service's address).
    pub tuple: CtTuple,
    /// The entry holding that tuple, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entry: Option<CtEntry>,
    /// Without one: an entry holding client ↔ backend un-NATed (made
    /// mid-stream from a packet of the connection with
    /// nf_conntrack_tcp_loose=1, after the first was lost).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unnated: Option<CtEntry>,
    /// `net.netfilter.nf_conntrack_tcp_loose` of the node namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_loose: Option<bool>,
    /// `net.netfilter.nf_conntrack_tcp_be_liberal` of the node namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_be_liberal: Option<bool>,
    /// Why nothing could be asked (no ctnetlink, no permission): then
    /// neither entry is known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Looks `tuple` up in the calling thread's network namespace, and, when
/// it has no entry, `unnated` (the client → backend direction) too.
pub fn lookup(tuple: CtTuple, unnated: CtTuple) -> CtLookup {
    let sysctl = |name: &str| {
        std::fs::read_to_string(format!("/proc/sys/net/netfilter/{name}"))
            .ok()
            .map(|s| s.trim() != "0")
    };
    let mut out = CtLookup {
        tuple,
        entry: None,
        unnated: None,
        tcp_loose: sysctl("nf_conntrack_tcp_loose"),
        tcp_be_liberal: sysctl("nf_conntrack_tcp_be_liberal"),
        error: None,
    };
    let found = socket().and_then(|socket| match get(&socket, &tuple)? {
        None => Ok((None, get(&socket, &unnated)?)),
        entry => Ok((entry, None)),
    });
    match found {
        Ok((entry, other)) => {
            out.entry = entry;
            out.unnated = other;
        }
        Err(e) => out.error = Some(e.to_string()),
    }
    out
}

/// A ctnetlink socket of the calling thread's network namespace.
fn socket() -> std::io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_NETFILTER)?;
    socket.bind_auto()?;
    socket.connect(&NlAddr::new(0, 0))?;
    Ok(socket)
}

/// IPCTNL_MSG_CT_GET for one tuple: the entry, or None on ENOENT. Each
/// request ends with its ACK or error, so the socket serves the next one.
fn get(socket: &Socket, tuple: &CtTuple) -> std::io::Result<Option<CtEntry>> {
    socket.send(&request(tuple), 0)?;
    let mut entry = None;
    let mut rx = Vec::with_capacity(16 * 1024);
    loop {
        rx.clear();
        let size = socket.recv(&mut rx, 0)?;
        let mut msgs = &rx[..size];
        while msgs.len() >= 16 {
            let len = u32::from_ne_bytes(msgs[0..4].try_into().unwrap_or_default()) as usize;
            let kind = u16::from_ne_bytes([msgs[4], msgs[5]]);
            if len < 16 || len > msgs.len() {
                return Err(std::io::Error::other("truncated ctnetlink reply"));
            }
            let body = &msgs[16..len];
            match kind {
                NLMSG_ERROR => {
                    let code = body
                        .get(0..4)
                        .map(|b| i32::from_ne_bytes(b.try_into().unwrap_or_default()))
                        .unwrap_or(0);
                    return match -code {
                        0 => Ok(entry),
                        libc::ENOENT => Ok(None),
                        e => Err(std::io::Error::from_raw_os_error(e)),
                    };
                }
                NLMSG_DONE => return Ok(entry),
                k if k == (NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_NEW) => {
                    // After the 4-byte nfgenmsg.
                    entry = body.get(4..).and_then(parse_entry);
                }
                _ => {}
            }
            msgs = &msgs[len.next_multiple_of(4).min(msgs.len())..];
        }
    }
}

fn nested(kind: u16, children: &[DefaultNla]) -> DefaultNla {
    let mut value = vec![0; children.buffer_len()];
    children.emit(&mut value);
    DefaultNla::new(kind | NLA_F_NESTED, value)
}

fn request(t: &CtTuple) -> Vec<u8> {
    let (family, ip) = match (t.src.ip(), t.dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => (
            libc::AF_INET as u8,
            [
                DefaultNla::new(CTA_IP_V4_SRC, s.octets().to_vec()),
                DefaultNla::new(CTA_IP_V4_DST, d.octets().to_vec()),
            ],
        ),
        (s, d) => {
            let v6 = |a: IpAddr| match a {
                IpAddr::V4(a) => a.to_ipv6_mapped().octets().to_vec(),
                IpAddr::V6(a) => a.octets().to_vec(),
            };
            (
                libc::AF_INET6 as u8,
                [
                    DefaultNla::new(CTA_IP_V6_SRC, v6(s)),
                    DefaultNla::new(CTA_IP_V6_DST, v6(d)),
                ],
            )
        }
    };
    let proto = [
        DefaultNla::new(CTA_PROTO_NUM, vec![t.proto]),
        DefaultNla::new(CTA_PROTO_SRC_PORT, t.src.port().to_be_bytes().to_vec()),
        DefaultNla::new(CTA_PROTO_DST_PORT, t.dst.port().to_be_bytes().to_vec()),
    ];
    let attrs = [nested(
        CTA_TUPLE_ORIG,
        &[nested(CTA_TUPLE_IP, &ip), nested(CTA_TUPLE_PROTO, &proto)],
    )];
    let attrs_len = attrs.as_slice().buffer_len();
    let len = 16 + 4 + attrs_len;
    let mut msg = vec![0u8; len];
    msg[0..4].copy_from_slice(&(len as u32).to_ne_bytes());
    msg[4..6].copy_from_slice(&(NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_GET).to_ne_bytes());
    msg[6..8].copy_from_slice(&(NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
    msg[8..12].copy_from_slice(&1u32.to_ne_bytes());
    // nfgenmsg: family, NFNETLINK_V0, res_id 0.
    msg[16] = family;
    attrs.as_slice().emit(&mut msg[20..]);
    msg
}

fn attrs(buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    NlasIterator::new(buf)
        .map_while(Result::ok)
        .map(|a: NlaBuffer<&[u8]>| {
            let kind = a.kind();
            let len = a.value_length();
            (kind, &a.into_inner()[4..4 + len])
        })
}

fn parse_tuple(buf: &[u8]) -> Option<CtTuple> {
    let (mut src, mut dst, mut proto, mut sport, mut dport) = (None, None, None, 0, 0);
    for (kind, value) in attrs(buf) {
        match kind {
            CTA_TUPLE_IP => {
                for (k, v) in attrs(value) {
                    let ip = match v.len() {
                        4 => IpAddr::from(<[u8; 4]>::try_from(v).ok()?),
                        16 => IpAddr::from(<[u8; 16]>::try_from(v).ok()?),
                        _ => continue,
                    };
                    match k {
                        CTA_IP_V4_SRC | CTA_IP_V6_SRC => src = Some(ip),
                        CTA_IP_V4_DST | CTA_IP_V6_DST => dst = Some(ip),
                        _ => {}
                    }
                }
            }
            CTA_TUPLE_PROTO => {
                for (k, v) in attrs(value) {
                    let port = || v.get(0..2).map(|b| u16::from_be_bytes([b[0], b[1]]));
                    match k {
                        CTA_PROTO_NUM => proto = v.first().copied(),
                        CTA_PROTO_SRC_PORT => sport = port().unwrap_or(0),
                        CTA_PROTO_DST_PORT => dport = port().unwrap_or(0),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some(CtTuple {
        proto: proto?,
        src: SocketAddr::new(src?, sport),
        dst: SocketAddr::new(dst?, dport),
    })
}

/// An IPCTNL_MSG_CT_NEW's attributes.
fn parse_entry(buf: &[u8]) -> Option<CtEntry> {
    let (mut orig, mut reply, mut status, mut tcp_state, mut timeout_s) =
        (None, None, 0, None, None);
    let be32 = |v: &[u8]| {
        v.get(0..4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    };
    for (kind, value) in attrs(buf) {
        match kind {
            CTA_TUPLE_ORIG => orig = parse_tuple(value),
            CTA_TUPLE_REPLY => reply = parse_tuple(value),
            CTA_STATUS => status = be32(value).unwrap_or(0),
            CTA_TIMEOUT => timeout_s = be32(value),
            CTA_PROTOINFO => {
                tcp_state = attrs(value)
                    .filter(|(k, _)| *k == CTA_PROTOINFO_TCP)
                    .flat_map(|(_, v)| attrs(v))
                    .find(|(k, _)| *k == CTA_PROTOINFO_TCP_STATE)
                    .and_then(|(_, v)| v.first())
                    .map(|&s| {
                        TCP_STATES
                            .get(s as usize)
                            .map_or_else(|| format!("state {s}"), |n| n.to_string())
                    });
            }
            _ => {}
        }
    }
    Some(CtEntry {
        orig: orig?,
        reply: reply?,
        status,
        tcp_state,
        timeout_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The request parsed back as the kernel would read it, and an entry
    /// written the way ctnetlink_fill_info writes one parsed.
    #[test]
    fn request_and_entry_round_trip() {
        let t = CtTuple {
            proto: 6,
            src: "10.244.1.5:41001".parse().unwrap(),
            dst: "100.67.30.133:80".parse().unwrap(),
        };
        let msg = request(&t);
        assert_eq!(
            u32::from_ne_bytes(msg[0..4].try_into().unwrap()) as usize,
            msg.len()
        );
        assert_eq!(msg[16], libc::AF_INET as u8);
        let (kind, orig) = attrs(&msg[20..]).next().unwrap();
        assert_eq!(kind, CTA_TUPLE_ORIG);
        assert_eq!(parse_tuple(orig), Some(t));

        let reply = CtTuple {
            proto: 6,
            src: "10.244.1.9:8080".parse().unwrap(),
            dst: t.src,
        };
        let tuple_nla = |kind, t: &CtTuple| {
            let ip = [
                DefaultNla::new(
                    CTA_IP_V4_SRC,
                    match t.src.ip() {
                        IpAddr::V4(a) => a.octets().to_vec(),
                        IpAddr::V6(_) => unreachable!(),
                    },
                ),
                DefaultNla::new(
                    CTA_IP_V4_DST,
                    match t.dst.ip() {
                        IpAddr::V4(a) => a.octets().to_vec(),
                        IpAddr::V6(_) => unreachable!(),
                    },
                ),
            ];
            let proto = [
                DefaultNla::new(CTA_PROTO_NUM, vec![6]),
                DefaultNla::new(CTA_PROTO_SRC_PORT, t.src.port().to_be_bytes().to_vec()),
                DefaultNla::new(CTA_PROTO_DST_PORT, t.dst.port().to_be_bytes().to_vec()),
            ];
            nested(
                kind,
                &[nested(CTA_TUPLE_IP, &ip), nested(CTA_TUPLE_PROTO, &proto)],
            )
        };
        let info = nested(
            CTA_PROTOINFO,
            &[nested(
                CTA_PROTOINFO_TCP,
                &[DefaultNla::new(CTA_PROTOINFO_TCP_STATE, vec![3])],
            )],
        );
        let all = [
            tuple_nla(CTA_TUPLE_ORIG, &t),
            tuple_nla(CTA_TUPLE_REPLY, &reply),
            DefaultNla::new(CTA_STATUS, (IPS_DST_NAT | 0xe).to_be_bytes().to_vec()),
            DefaultNla::new(CTA_TIMEOUT, 431_999u32.to_be_bytes().to_vec()),
            info,
        ];
        let mut buf = vec![0; all.as_slice().buffer_len()];
        all.as_slice().emit(&mut buf);
        let e = parse_entry(&buf).unwrap();
        assert_eq!((e.orig, e.reply), (t, reply));
        assert!(e.dnat());
        assert_eq!(e.tcp_state.as_deref(), Some("ESTABLISHED"));
        assert_eq!(e.timeout_s, Some(431_999));
    }
}
