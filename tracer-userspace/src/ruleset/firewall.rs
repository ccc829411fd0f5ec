//! The node's own DROP/REJECT rules in the iptables filter table (a
//! firewall, a NetworkPolicy agent's KUBE-NWPLCY-… chains, kube-proxy's
//! INVALID rule), as written, so a packet dropped by netfilter mid-stream
//! can be named with the rule that matches it (issue 21). Only the matches
//! a rule is usually written with are understood; a rule with any other
//! match (an ipset, a mark) is kept as one that may match.
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use super::words;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FilterDrop {
    pub chain: String,
    /// The rule as iptables-save wrote it.
    pub rule: String,
    /// `-m conntrack --ctstate INVALID` (or `-m state --state INVALID`):
    /// kube-proxy's rule for packets conntrack does not track.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub invalid: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub src: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dst: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proto: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sport: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dport: Option<u16>,
    /// It has matches not understood here (negations, sets, marks, other
    /// states): it may match a packet the fields above allow.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub other_matches: bool,
}

/// The DROP and REJECT rules of a filter table's `-A` lines.
pub fn parse_filter_drops(filter_lines: &[&str]) -> Vec<FilterDrop> {
    filter_lines.iter().filter_map(|l| parse(l)).collect()
}

fn parse(line: &str) -> Option<FilterDrop> {
    let w = words(line.strip_prefix("-A ")?);
    let mut d = FilterDrop {
        chain: w.first()?.clone(),
        rule: line.to_string(),
        ..FilterDrop::default()
    };
    let mut jump = None;
    let mut i = 1;
    while i < w.len() {
        let next = w.get(i + 1).cloned();
        let mut took = true;
        match w[i].as_str() {
            "-s" | "--source" => d.src = next,
            "-d" | "--destination" => d.dst = next,
            "-p" | "--protocol" => d.proto = next,
            "--sport" | "--source-port" => d.sport = next.and_then(|p| p.parse().ok()),
            "--dport" | "--destination-port" => d.dport = next.and_then(|p| p.parse().ok()),
            "-j" | "--jump" => jump = next,
            "--ctstate" | "--state" => {
                if next.as_deref() == Some("INVALID") {
                    d.invalid = true;
                } else {
                    d.other_matches = true;
                }
            }
            // The match modules themselves, and the comment.
            "-m" | "--match" | "--comment" => {}
            // Counters (`iptables-save -c`) and what the rule does to
            // the packet after the match.
            "--reject-with" => {}
            _ => {
                took = false;
                d.other_matches = true;
            }
        }
        i += if took { 2 } else { 1 };
    }
    matches!(jump.as_deref(), Some("DROP" | "REJECT")).then_some(d)
}

impl FilterDrop {
    /// Whether the rule's understood matches allow a packet `src:sport →
    /// dst:dport` of protocol `proto` ("tcp"/"udp").
    pub fn allows(&self, src: IpAddr, sport: u16, dst: IpAddr, dport: u16, proto: &str) -> bool {
        let addr_ok =
            |cidr: &Option<String>, ip: IpAddr| cidr.as_deref().is_none_or(|c| contains(c, ip));
        addr_ok(&self.src, src)
            && addr_ok(&self.dst, dst)
            && self.proto.as_deref().is_none_or(|p| p == proto)
            && self.sport.is_none_or(|p| p == sport)
            && self.dport.is_none_or(|p| p == dport)
    }
}

/// Whether `cidr` (`a.b.c.d/n`, `x::y/n`, or a bare address) holds `ip`.
fn contains(cidr: &str, ip: IpAddr) -> bool {
    let (addr, len) = cidr.split_once('/').unwrap_or((cidr, ""));
    let Ok(net) = addr.parse::<IpAddr>() else {
        return false;
    };
    let ip = ip.to_canonical();
    match (net, ip) {
        (IpAddr::V4(n), IpAddr::V4(a)) => {
            let len: u32 = len.parse().unwrap_or(32).min(32);
            let mask = u32::MAX.checked_shl(32 - len).unwrap_or(0);
            u32::from(n) & mask == u32::from(a) & mask
        }
        (IpAddr::V6(n), IpAddr::V6(a)) => {
            let len: u32 = len.parse().unwrap_or(128).min(128);
            let mask = u128::MAX.checked_shl(128 - len).unwrap_or(0);
            u128::from(n) & mask == u128::from(a) & mask
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drop_rules_are_kept_as_written_with_their_matches() {
        let lines = [
            "-A FORWARD -j KUBE-NWPLCY-web",
            "-A KUBE-NWPLCY-web -s 100.96.54.240/32 -p tcp -m tcp --sport 41021 -m comment --comment \"deny web\" -j DROP",
            "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP",
            "-A KUBE-FORWARD -m mark --mark 0x4000/0x4000 -j ACCEPT",
            "-A INPUT -m set --match-set bad src -j REJECT --reject-with icmp-port-unreachable",
        ];
        let d = parse_filter_drops(&lines);
        assert_eq!(d.len(), 3, "{d:#?}");
        assert_eq!(d[0].chain, "KUBE-NWPLCY-web");
        assert_eq!(d[0].rule, lines[1]);
        assert!(!d[0].invalid && !d[0].other_matches);
        let client: IpAddr = "100.96.54.240".parse().unwrap();
        let backend: IpAddr = "100.96.54.247".parse().unwrap();
        assert!(d[0].allows(client, 41021, backend, 80, "tcp"));
        assert!(!d[0].allows(client, 41022, backend, 80, "tcp"));
        assert!(!d[0].allows(backend, 80, client, 41021, "tcp"));
        assert!(d[1].invalid);
        assert!(d[2].other_matches);
    }

    #[test]
    fn cidrs_hold_their_addresses() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(contains("100.96.0.0/16", ip("100.96.54.240")));
        assert!(!contains("100.97.0.0/16", ip("100.96.54.240")));
        assert!(contains("0.0.0.0/0", ip("1.2.3.4")));
        assert!(contains("fd00::/8", ip("fd00::1")));
        assert!(contains("100.96.54.240", ip("::ffff:100.96.54.240")));
    }
}
