//! `enum skb_drop_reason` names. The numbering changes between kernels (6.1
//! has no `SKB_CONSUMED`, so `NO_SOCKET` is 2 there and 3 on 6.18), so the
//! loader should build the table from the running kernel (BTF enum or the
//! `skb:kfree_skb` tracefs format) and recordings should carry it; the
//! built-in table is only a fallback.
use std::sync::Arc;

use super::types::Name;

/// `enum skb_drop_reason` of Linux 6.18 (this project's dev kernel), from value 0 on.
const BUILTIN_6_18: &[&str] = &[
    "NOT_DROPPED_YET",
    "CONSUMED",
    "NOT_SPECIFIED",
    "NO_SOCKET",
    "SOCKET_CLOSE",
    "SOCKET_FILTER",
    "SOCKET_RCVBUFF",
    "UNIX_DISCONNECT",
    "UNIX_SKIP_OOB",
    "PKT_TOO_SMALL",
    "TCP_CSUM",
    "UDP_CSUM",
    "NETFILTER_DROP",
    "OTHERHOST",
    "IP_CSUM",
    "IP_INHDR",
    "IP_RPFILTER",
    "UNICAST_IN_L2_MULTICAST",
    "XFRM_POLICY",
    "IP_NOPROTO",
    "PROTO_MEM",
    "TCP_AUTH_HDR",
    "TCP_MD5NOTFOUND",
    "TCP_MD5UNEXPECTED",
    "TCP_MD5FAILURE",
    "TCP_AONOTFOUND",
    "TCP_AOUNEXPECTED",
    "TCP_AOKEYNOTFOUND",
    "TCP_AOFAILURE",
    "SOCKET_BACKLOG",
    "TCP_FLAGS",
    "TCP_ABORT_ON_DATA",
    "TCP_ZEROWINDOW",
    "TCP_OLD_DATA",
    "TCP_OVERWINDOW",
    "TCP_OFOMERGE",
    "TCP_RFC7323_PAWS",
    "TCP_RFC7323_PAWS_ACK",
    "TCP_RFC7323_TW_PAWS",
    "TCP_RFC7323_TSECR",
    "TCP_LISTEN_OVERFLOW",
    "TCP_OLD_SEQUENCE",
    "TCP_INVALID_SEQUENCE",
    "TCP_INVALID_END_SEQUENCE",
    "TCP_INVALID_ACK_SEQUENCE",
    "TCP_RESET",
    "TCP_INVALID_SYN",
    "TCP_CLOSE",
    "TCP_FASTOPEN",
    "TCP_OLD_ACK",
    "TCP_TOO_OLD_ACK",
    "TCP_ACK_UNSENT_DATA",
    "TCP_OFO_QUEUE_PRUNE",
    "TCP_OFO_DROP",
    "IP_OUTNOROUTES",
    "BPF_CGROUP_EGRESS",
    "IPV6DISABLED",
    "NEIGH_CREATEFAIL",
    "NEIGH_FAILED",
    "NEIGH_QUEUEFULL",
    "NEIGH_DEAD",
    "NEIGH_HH_FILLFAIL",
    "TC_EGRESS",
    "SECURITY_HOOK",
    "QDISC_DROP",
    "QDISC_OVERLIMIT",
    "QDISC_CONGESTED",
    "CAKE_FLOOD",
    "FQ_BAND_LIMIT",
    "FQ_HORIZON_LIMIT",
    "FQ_FLOW_LIMIT",
    "CPU_BACKLOG",
    "XDP",
    "TC_INGRESS",
    "UNHANDLED_PROTO",
    "SKB_CSUM",
    "SKB_GSO_SEG",
    "SKB_UCOPY_FAULT",
    "DEV_HDR",
    "DEV_READY",
    "FULL_RING",
    "NOMEM",
    "HDR_TRUNC",
    "TAP_FILTER",
    "TAP_TXFILTER",
    "ICMP_CSUM",
    "INVALID_PROTO",
    "IP_INADDRERRORS",
    "IP_INNOROUTES",
    "IP_LOCAL_SOURCE",
    "IP_INVALID_SOURCE",
    "IP_LOCALNET",
    "IP_INVALID_DEST",
    "PKT_TOO_BIG",
    "DUP_FRAG",
    "FRAG_REASM_TIMEOUT",
    "FRAG_TOO_FAR",
    "TCP_MINTTL",
    "IPV6_BAD_EXTHDR",
    "IPV6_NDISC_FRAG",
    "IPV6_NDISC_HOP_LIMIT",
    "IPV6_NDISC_BAD_CODE",
    "IPV6_NDISC_BAD_OPTIONS",
    "IPV6_NDISC_NS_OTHERHOST",
    "QUEUE_PURGE",
    "TC_COOKIE_ERROR",
    "PACKET_SOCK_ERROR",
    "TC_CHAIN_NOTFOUND",
    "TC_RECLASSIFY_LOOP",
    "VXLAN_INVALID_HDR",
    "VXLAN_VNI_NOT_FOUND",
    "MAC_INVALID_SOURCE",
    "VXLAN_ENTRY_EXISTS",
    "NO_TX_TARGET",
    "IP_TUNNEL_ECN",
    "TUNNEL_TXINFO",
    "LOCAL_MAC",
    "ARP_PVLAN_DISABLE",
    "MAC_IEEE_MAC_CONTROL",
    "BRIDGE_INGRESS_STP_STATE",
    "CAN_RX_INVALID_FRAME",
    "CANFD_RX_INVALID_FRAME",
    "CANXL_RX_INVALID_FRAME",
    "PFMEMALLOC",
    "DUALPI2_STEP_DROP",
    "PSP_INPUT",
    "PSP_OUTPUT",
    "RECURSION_LIMIT",
    "MAX",
];

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DropReasonsError {
    #[error("no __print_symbolic table of drop reasons in the kfree_skb format text")]
    NoTable,
}

/// Value → name of the running kernel's `enum skb_drop_reason`, without the
/// `SKB_DROP_REASON_` prefix (`NO_SOCKET`, `NETFILTER_DROP`, ...).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DropReasons {
    names: Vec<Option<Name>>,
}

impl Default for DropReasons {
    fn default() -> Self {
        Self::from_pairs(BUILTIN_6_18.iter().enumerate().map(|(v, n)| (v as u32, *n)))
    }
}

/// Reasons whose meaning the verdict rules depend on, resolved once so the
/// per-event path compares integers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct KnownReasons {
    pub not_dropped: Option<u32>,
    pub consumed: Option<u32>,
    pub no_socket: Option<u32>,
    pub netfilter_drop: Option<u32>,
    pub rp_filter: Option<u32>,
    /// Neighbour (ARP) resolution gave up: NEIGH_FAILED, NEIGH_QUEUEFULL,
    /// NEIGH_DEAD, NEIGH_CREATEFAIL.
    pub neigh: [Option<u32>; 4],
    /// The bridge had no port to send the frame to (unknown destination MAC).
    pub no_tx_target: Option<u32>,
    /// A frame for another MAC reached a host (e.g. flooded by a bridge).
    pub otherhost: Option<u32>,
    /// A queue was flushed, e.g. a neighbour entry's packets when its
    /// device lost carrier or changed address (neigh_flush_dev).
    pub queue_purge: Option<u32>,
    /// Dropped at a failed route lookup: `ip_error` (net/ipv4/route.c) for
    /// a blackhole route keeps NOT_SPECIFIED; no route at all is
    /// IP_INNOROUTES / IP_OUTNOROUTES.
    pub no_route: [Option<u32>; 3],
    /// A listener had no room in its accept queue for a connection whose
    /// handshake completed (net/ipv4/tcp_minisocks.c `tcp_check_req`).
    pub listen_overflow: Option<u32>,
}

impl DropReasons {
    /// From (value, enumerator name) pairs, e.g. a BTF `enum skb_drop_reason`:
    /// the `SKB_DROP_REASON_` prefix is stripped, and `SKB_` from
    /// `SKB_NOT_DROPPED_YET` and `SKB_CONSUMED`. Values above 4096
    /// (subsystem-encoded reasons) are ignored to keep the table small.
    pub fn from_pairs<S: AsRef<str>>(pairs: impl IntoIterator<Item = (u32, S)>) -> Self {
        let mut names: Vec<Option<Name>> = Vec::new();
        for (value, name) in pairs {
            if value > 4096 {
                continue;
            }
            let name = name.as_ref();
            // Only the two enumerators outside the SKB_DROP_REASON_ family
            // lose "SKB_": tracefs prints SKB_DROP_REASON_SKB_CSUM as
            // "SKB_CSUM" (include/net/dropreason-core.h `FN(SKB_CSUM)`),
            // which BTF and tracefs must name alike.
            let name = name
                .strip_prefix("SKB_DROP_REASON_")
                .or_else(|| {
                    matches!(name, "SKB_NOT_DROPPED_YET" | "SKB_CONSUMED").then(|| &name[4..])
                })
                .unwrap_or(name);
            let i = value as usize;
            if names.len() <= i {
                names.resize(i + 1, None);
            }
            names[i] = Some(Name(Arc::from(name)));
        }
        Self { names }
    }

    /// From `/sys/kernel/tracing/events/skb/kfree_skb/format`, whose print
    /// format lists `{ 3, "NO_SOCKET" }` pairs. Values 0 and 1 are absent
    /// there (never traced as drops), which is fine.
    pub fn parse_tracefs_format(text: &str) -> Result<Self, DropReasonsError> {
        let table = text
            .split_once("__print_symbolic")
            .ok_or(DropReasonsError::NoTable)?
            .1;
        let mut pairs = Vec::new();
        for item in table.split('{').skip(1) {
            let Some((body, _)) = item.split_once('}') else {
                continue;
            };
            let Some((value, name)) = body.split_once(',') else {
                continue;
            };
            let (Ok(value), name) = (value.trim().parse::<u32>(), name.trim().trim_matches('"'))
            else {
                continue;
            };
            pairs.push((value, name.to_string()));
        }
        if pairs.is_empty() {
            return Err(DropReasonsError::NoTable);
        }
        Ok(Self::from_pairs(pairs))
    }

    pub fn name(&self, value: u32) -> Option<&Name> {
        self.names.get(value as usize).and_then(Option::as_ref)
    }

    /// Every (value, name) known, for recordings to carry the table.
    pub fn pairs(&self) -> impl Iterator<Item = (u32, &str)> {
        self.names
            .iter()
            .enumerate()
            .filter_map(|(v, n)| Some((v as u32, n.as_ref()?.as_str())))
    }

    pub fn code(&self, name: &str) -> Option<u32> {
        self.names
            .iter()
            .position(|n| n.as_ref().is_some_and(|n| &*n.0 == name))
            .map(|i| i as u32)
    }

    pub(crate) fn known(&self) -> KnownReasons {
        KnownReasons {
            not_dropped: self.code("NOT_DROPPED_YET"),
            consumed: self.code("CONSUMED"),
            no_socket: self.code("NO_SOCKET"),
            netfilter_drop: self.code("NETFILTER_DROP"),
            rp_filter: self.code("IP_RPFILTER"),
            neigh: [
                self.code("NEIGH_FAILED"),
                self.code("NEIGH_QUEUEFULL"),
                self.code("NEIGH_DEAD"),
                self.code("NEIGH_CREATEFAIL"),
            ],
            no_tx_target: self.code("NO_TX_TARGET"),
            otherhost: self.code("OTHERHOST"),
            queue_purge: self.code("QUEUE_PURGE"),
            no_route: [
                self.code("NOT_SPECIFIED"),
                self.code("IP_INNOROUTES"),
                self.code("IP_OUTNOROUTES"),
            ],
            listen_overflow: self.code("TCP_LISTEN_OVERFLOW"),
        }
    }
}

/// Drop reasons a healthy TCP socket has of its own, never a sign that the
/// network path broke (include/net/dropreason-core.h): data it already had
/// or that falls outside its window (TCP_OLD_DATA, TCP_OVERWINDOW,
/// TCP_OFOMERGE, PAWS, old ACKs and sequences), flow control and memory
/// (TCP_ZEROWINDOW, SOCKET_RCVBUFF, SOCKET_BACKLOG, PROTO_MEM), a closing
/// socket (TCP_CLOSE, SOCKET_CLOSE, TCP_ABORT_ON_DATA, a RST it received:
/// TCP_RESET, QUEUE_PURGE, NOT_SPECIFIED from `tcp_done` and its purge on
/// 6.1). Everything else the kernel names (NETFILTER_DROP, NO_SOCKET,
/// NEIGH_FAILED, IP_NOROUTE, PKT_TOO_BIG, IP_INHDR, OTHERHOST, ...) is a
/// failure when it hits an established flow. The kernel's watch counts
/// these instead of sending them (`Config::benign_drops`).
pub const BENIGN_DROPS: &[&str] = &[
    "NOT_DROPPED_YET",
    "CONSUMED",
    "NOT_SPECIFIED",
    "SOCKET_CLOSE",
    "SOCKET_FILTER",
    "SOCKET_RCVBUFF",
    "SOCKET_BACKLOG",
    "PROTO_MEM",
    "TCP_FLAGS",
    "TCP_ZEROWINDOW",
    "TCP_OLD_DATA",
    "TCP_OVERWINDOW",
    "TCP_OFOMERGE",
    "TCP_RFC7323_PAWS",
    "TCP_RFC7323_PAWS_ACK",
    "TCP_RFC7323_TSECR",
    "TCP_OLD_SEQUENCE",
    "TCP_INVALID_SEQUENCE",
    "TCP_INVALID_ACK_SEQUENCE",
    "TCP_RESET",
    "TCP_INVALID_SYN",
    "TCP_CLOSE",
    "TCP_FASTOPEN",
    "TCP_OLD_ACK",
    "TCP_TOO_OLD_ACK",
    "TCP_ACK_UNSENT_DATA",
    "TCP_OFO_QUEUE_PRUNE",
    "TCP_OFO_DROP",
    "TCP_ABORT_ON_DATA",
    "TCP_ZEROWINDOW",
    "QUEUE_PURGE",
    "DUP_FRAG",
    "SKB_UCOPY_FAULT",
];

/// Drop reasons that end a late segment of a connection whose two sides
/// had both closed (both FINs passed): the segment's socket is gone. A
/// close's last ACK that comes twice (a retransmitted FIN answered again
/// from TIME_WAIT, net/ipv4/tcp_minisocks.c `tcp_timewait_state_process`)
/// finds the socket that closed second freed by the first (LAST_ACK →
/// `tcp_done`, net/ipv4/tcp_input.c) and is dropped with NO_SOCKET. No
/// application is left to see it; mid-stream (one FIN or none) the same
/// drop is a failure.
pub const CLOSED_DROPS: &[&str] = &["NO_SOCKET"];

impl DropReasons {
    /// [`BENIGN_DROPS`] in this kernel's numbering, as the bitmap the
    /// kernel's watch reads (`Config::benign_drops`; reasons ≥ 256 left out).
    pub fn benign_bitmap(&self) -> [u64; 4] {
        self.bitmap(BENIGN_DROPS)
    }

    /// [`CLOSED_DROPS`] as `Config::closed_drops`.
    pub fn closed_bitmap(&self) -> [u64; 4] {
        self.bitmap(CLOSED_DROPS)
    }

    fn bitmap(&self, names: &[&str]) -> [u64; 4] {
        let mut bits = [0u64; 4];
        for code in names.iter().filter_map(|n| self.code(n)) {
            if code < 256 {
                bits[(code / 64) as usize] |= 1 << (code % 64);
            }
        }
        bits
    }

    /// A healthy socket's own drop ([`BENIGN_DROPS`]).
    pub fn is_benign(&self, reason: u32) -> bool {
        self.is_in(BENIGN_DROPS, reason)
    }

    /// A late segment's end once both sides closed ([`CLOSED_DROPS`]).
    pub fn ends_closed(&self, reason: u32) -> bool {
        self.is_in(CLOSED_DROPS, reason)
    }

    fn is_in(&self, names: &[&str], reason: u32) -> bool {
        self.name(reason)
            .is_some_and(|n| names.contains(&n.as_str()))
    }
}

impl KnownReasons {
    /// `kfree_skb` also fires for packets that were consumed, not dropped.
    pub fn is_drop(&self, reason: u32) -> bool {
        Some(reason) != self.not_dropped && Some(reason) != self.consumed
    }

    /// The packet waited for the next hop's MAC and the kernel gave up.
    pub fn is_neigh_failure(&self, reason: u32) -> bool {
        self.neigh.contains(&Some(reason))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_matches_6_18() {
        let t = DropReasons::default();
        assert_eq!(t.code("NO_SOCKET"), Some(3));
        assert_eq!(t.code("NETFILTER_DROP"), Some(12));
        assert_eq!(t.name(2).map(|n| &*n.0), Some("NOT_SPECIFIED"));
    }

    #[test]
    fn parses_tracefs_and_btf_names() {
        let fmt = r#"print fmt: "reason: %s", __print_symbolic(REC->reason, { 2, "NOT_SPECIFIED" }, { 3, "NO_SOCKET" }, { 12, "NETFILTER_DROP" })"#;
        let t = DropReasons::parse_tracefs_format(fmt).unwrap();
        assert_eq!(t.code("NETFILTER_DROP"), Some(12));
        assert_eq!(
            DropReasons::parse_tracefs_format("nothing"),
            Err(DropReasonsError::NoTable)
        );
        // 6.1 numbering: no SKB_CONSUMED, so NO_SOCKET is 2.
        let t = DropReasons::from_pairs([
            (1, "SKB_DROP_REASON_NOT_SPECIFIED"),
            (2, "SKB_DROP_REASON_NO_SOCKET"),
        ]);
        assert_eq!(t.known().no_socket, Some(2));
    }

    #[test]
    fn benign_drops_are_a_healthy_sockets_own() {
        let t = DropReasons::default();
        let bits = t.benign_bitmap();
        let has = |name: &str| {
            let c = t.code(name).unwrap();
            bits[(c / 64) as usize] & (1 << (c % 64)) != 0
        };
        assert!(has("TCP_OLD_DATA") && has("TCP_OFOMERGE") && has("NOT_SPECIFIED"));
        for failure in ["NETFILTER_DROP", "NO_SOCKET", "NEIGH_FAILED", "IP_INHDR"] {
            assert!(!has(failure), "{failure}");
            assert!(!t.is_benign(t.code(failure).unwrap()), "{failure}");
        }
        assert!(t.is_benign(t.code("TCP_OLD_DATA").unwrap()));
    }
}
