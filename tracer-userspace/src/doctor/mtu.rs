//! Path-MTU facts (issue 23): the MTUs of the node's pod interfaces,
//! bridges, overlay and uplink, and rules that drop the ICMP errors
//! path-MTU discovery needs. A pod MTU larger than the overlay (or the
//! uplink) carries makes every full-size packet too big for the path; if
//! the fragmentation-needed / packet-too-big then never reaches the pod,
//! large transfers stall (cause `pmtu_blackhole`).
use serde::Serialize;

use super::{Finding, Inputs, Severity, finding, first_few};
use crate::{collector::CauseId, facts::Interface};

const FIX_PMTU: CauseId = CauseId::PmtuBlackhole;

/// Encapsulation each overlay kind adds to a pod's packet (IPv4 outer):
/// vxlan 50 (outer IP 20 + UDP 8 + VXLAN 8 + inner Ethernet 14), geneve 50
/// without options, ipip 20, wireguard 60 (IPv4 + UDP + its 32-byte header).
fn overhead(kind: &str) -> Option<u32> {
    match kind {
        "vxlan" | "geneve" => Some(50),
        "ipip" => Some(20),
        "wireguard" => Some(60),
        _ => None,
    }
}

/// What [`super::gather`] read for these checks.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MtuFacts {
    /// ifindex of the IPv4 default route's device (the uplink), if any.
    pub uplink: Option<u32>,
    /// Rules of the node that drop or reject ICMP errors path-MTU discovery
    /// needs (as the save tools print them).
    pub icmp_drops: Vec<String>,
}

/// Reads the default route's device and the rules. Read-only.
pub(super) fn gather(ns: &crate::probes::netns::Netns) -> MtuFacts {
    let uplink = ns.run(default_route_dev).ok().flatten();
    let texts = crate::ruleset::ruleset_texts(ns);
    let mut icmp_drops: Vec<String> = Vec::new();
    for line in texts.iter().flat_map(|t| t.lines()) {
        let line = line.trim();
        if drops_pmtu_errors(line) && !icmp_drops.iter().any(|l| l == line) {
            icmp_drops.push(line.to_string());
        }
    }
    MtuFacts { uplink, icmp_drops }
}

fn default_route_dev() -> Option<u32> {
    use netlink_packet_core::{NLM_F_DUMP, NLM_F_REQUEST};
    use netlink_packet_route::{
        AddressFamily, RouteNetlinkMessage,
        route::{RouteAttribute, RouteMessage},
    };
    let mut msg = RouteMessage::default();
    msg.header.address_family = AddressFamily::Inet;
    let replies = crate::probes::netns::netlink_request(
        RouteNetlinkMessage::GetRoute(msg),
        NLM_F_DUMP | NLM_F_REQUEST,
    )
    .ok()?;
    replies.into_iter().find_map(|r| match r {
        RouteNetlinkMessage::NewRoute(route)
            if route.header.destination_prefix_length == 0 && route.header.table == 254 =>
        {
            route.attributes.iter().find_map(|a| match a {
                RouteAttribute::Oif(i) => Some(*i),
                _ => None,
            })
        }
        _ => None,
    })
}

/// A rule line that drops or rejects fragmentation-needed (ICMP type 3
/// code 4, or all of type 3, or all ICMP) or ICMPv6 packet-too-big (type
/// 2, or all ICMPv6), in iptables-save or nft syntax.
pub(crate) fn drops_pmtu_errors(line: &str) -> bool {
    let l = line.to_ascii_lowercase();
    let drops = l.contains("-j drop")
        || l.contains("-j reject")
        || l.ends_with(" drop")
        || l.contains(" drop ")
        || l.ends_with(" reject")
        || l.contains(" reject ");
    if !drops || l.starts_with('#') {
        return false;
    }
    // iptables: `-p icmp` alone (every ICMP), or the types that carry it.
    let ipt_v4 = l.contains("-p icmp ")
        && (!l.contains("--icmp-type")
            || l.contains("--icmp-type 3 ")
            || l.contains("--icmp-type 3/4")
            || l.contains("fragmentation-needed")
            || l.contains("destination-unreachable"));
    let ipt_v6 = (l.contains("-p ipv6-icmp ") || l.contains("-p icmpv6 "))
        && (!l.contains("--icmpv6-type")
            || l.contains("--icmpv6-type 2")
            || l.contains("packet-too-big"));
    // nft: `icmp type destination-unreachable … drop`, `meta l4proto icmp drop`.
    let nft_v4 = (l.contains("icmp type destination-unreachable")
        || l.contains("icmp code frag-needed")
        || l.contains("meta l4proto icmp ")
        || l.contains("ip protocol icmp "))
        && !l.contains("icmp type echo");
    let nft_v6 = l.contains("icmpv6 type packet-too-big")
        || l.contains("meta l4proto ipv6-icmp ")
        || l.contains("meta l4proto icmpv6 ");
    // A rule accepting these first does not drop them.
    (ipt_v4 || ipt_v6 || nft_v4 || nft_v6) && !l.contains("-j accept")
}

fn names(v: &[&Interface]) -> String {
    let n: Vec<&str> = v.iter().map(|i| i.name.as_str()).collect();
    first_few(&n, ",")
}

/// The MTU findings; none when the interfaces' MTUs are unknown.
pub(super) fn findings(i: &Inputs) -> Vec<Finding> {
    let mut out = Vec::new();
    out.extend(consistency(i));
    out.extend(icmp_rules(i));
    out
}

fn consistency(i: &Inputs) -> Option<Finding> {
    let known: Vec<&Interface> = i.interfaces.iter().filter(|x| x.mtu != 0).collect();
    if known.is_empty() {
        return None;
    }
    let uplink = i
        .mtu
        .uplink
        .and_then(|u| known.iter().copied().find(|x| x.ifindex == u));
    let overlays: Vec<&Interface> = known
        .iter()
        .copied()
        .filter(|x| overhead(&x.kind).is_some())
        .collect();
    // The pods' side: veths (bridge ports or routed) other than the uplink.
    let pods: Vec<&Interface> = known
        .iter()
        .copied()
        .filter(|x| x.kind == "veth" && Some(x.ifindex) != uplink.map(|u| u.ifindex))
        .collect();
    let bridges: Vec<&Interface> = known
        .iter()
        .copied()
        .filter(|x| x.kind == "bridge")
        .collect();
    // What a pod's packet may be through each overlay: the smaller of its
    // MTU and the uplink's less its header. With several overlays (a
    // dual-stack node's flannel.1 and flannel-v6.1, whose IPv6 outer header
    // is 20 bytes more) the largest is the bound: a pod MTU above every
    // overlay's is too big for certain.
    let mut limits: Vec<(u32, String)> = Vec::new();
    for o in &overlays {
        let own = (o.mtu, format!("{} ({}, MTU {})", o.name, o.kind, o.mtu));
        let through = match (uplink, overhead(&o.kind)) {
            (Some(u), Some(h)) if u.mtu.saturating_sub(h) < o.mtu => (
                u.mtu.saturating_sub(h),
                format!(
                    "uplink {} (MTU {}) less {}'s {h}-byte {} header",
                    u.name, u.mtu, o.name, o.kind
                ),
            ),
            _ => own,
        };
        limits.push(through);
    }
    if overlays.is_empty()
        && let Some(u) = uplink
    {
        limits.push((u.mtu, format!("uplink {} (MTU {})", u.name, u.mtu)));
    }
    let (limit, what) = limits.into_iter().max_by_key(|(m, _)| *m)?;
    let too_big: Vec<&Interface> = pods
        .iter()
        .chain(&bridges)
        .copied()
        .filter(|x| x.mtu > limit)
        .collect();
    if too_big.is_empty() {
        let pod_mtus: Vec<u32> = pods.iter().map(|p| p.mtu).collect();
        let max = pod_mtus.iter().max().copied().unwrap_or(limit);
        return Some(Finding {
            check: "mtu",
            severity: Severity::Ok,
            value: format!("mtu={max}<={limit}"),
            message: format!("pod interfaces carry at most {max} bytes, which {what} carries"),
            fix: None,
        });
    }
    let max = too_big.iter().map(|x| x.mtu).max().unwrap_or(0);
    Some(finding(
        "mtu",
        Severity::Error,
        format!("mtu={max}>{limit}"),
        format!(
            "{} MTU {max} is larger than the path carries: {what} leaves {limit} bytes for a pod's packet, so every full-size packet must be fragmented or answered with an ICMP fragmentation needed / packet too big — a black hole wherever that error is dropped",
            names(&too_big)
        ),
        FIX_PMTU.hint(),
    ))
}

fn icmp_rules(i: &Inputs) -> Option<Finding> {
    if i.mtu.icmp_drops.is_empty() {
        return None;
    }
    let n = i.mtu.icmp_drops.len();
    Some(finding(
        "icmp_frag_needed",
        Severity::Warning,
        format!("icmp_frag_needed_dropped={n}"),
        format!(
            "{n} rule(s) drop the ICMP errors path-MTU discovery needs (fragmentation needed / packet too big): {}",
            i.mtu.icmp_drops.join(" | ")
        ),
        FIX_PMTU.hint(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iface(ifindex: u32, name: &str, kind: &str, mtu: u32) -> Interface {
        Interface {
            ifindex,
            name: name.into(),
            kind: kind.into(),
            mtu,
            ..Interface::default()
        }
    }

    fn inputs(pod_mtu: u32, vxlan: u32, uplink: u32) -> Inputs {
        Inputs {
            interfaces: vec![
                iface(2, "eth0", "", uplink),
                iface(3, "cni0", "bridge", pod_mtu),
                iface(4, "veth0", "veth", pod_mtu),
                iface(5, "flannel.1", "vxlan", vxlan),
            ],
            mtu: MtuFacts {
                uplink: Some(2),
                icmp_drops: Vec::new(),
            },
            ..Inputs::default()
        }
    }

    #[test]
    fn flannel_defaults_are_consistent() {
        let f = consistency(&inputs(1450, 1450, 1500)).unwrap();
        assert_eq!(f.severity, Severity::Ok, "{f:?}");
    }

    #[test]
    fn a_pod_mtu_above_the_overlay_is_an_error_naming_both() {
        let f = consistency(&inputs(1500, 1450, 1500)).unwrap();
        assert_eq!(f.severity, Severity::Error);
        assert_eq!(f.value, "mtu=1500>1450");
        assert!(f.message.contains("veth0,cni0"), "{}", f.message);
        assert!(
            f.message.contains("flannel.1 (vxlan, MTU 1450)"),
            "{}",
            f.message
        );
    }

    #[test]
    fn an_uplink_too_small_for_the_overlay_is_named() {
        // The overlay says 1450 but the uplink carries 1400: 1350 is left.
        let f = consistency(&inputs(1450, 1450, 1400)).unwrap();
        assert_eq!(f.severity, Severity::Error);
        assert_eq!(f.value, "mtu=1450>1350");
        assert!(
            f.message.contains("uplink eth0 (MTU 1400)"),
            "{}",
            f.message
        );
    }

    #[test]
    fn routed_without_overlay_compares_with_the_uplink() {
        let mut i = inputs(1500, 0, 1400);
        i.interfaces
            .retain(|x| x.kind != "vxlan" && x.kind != "bridge");
        let f = consistency(&i).unwrap();
        assert_eq!(f.value, "mtu=1500>1400");
    }

    #[test]
    fn a_dual_stack_nodes_ipv6_overlay_does_not_lower_the_bound() {
        let mut i = inputs(1450, 1450, 1500);
        i.interfaces.push(iface(6, "flannel-v6.1", "vxlan", 1430));
        let f = consistency(&i).unwrap();
        assert_eq!(f.severity, Severity::Ok, "{f:?}");
    }

    #[test]
    fn unknown_mtus_say_nothing() {
        assert!(consistency(&inputs(0, 0, 0)).is_none());
    }

    #[test]
    fn rules_dropping_frag_needed_are_found() {
        for line in [
            "-A OUTPUT -p icmp -m icmp --icmp-type 3/4 -j DROP",
            "-A FORWARD -p icmp -m icmp --icmp-type fragmentation-needed -j DROP",
            "-A INPUT -p icmp -j DROP",
            "-A FORWARD -p ipv6-icmp -m icmp6 --icmpv6-type 2 -j DROP",
            "icmp type destination-unreachable drop",
            "icmpv6 type packet-too-big counter packets 0 bytes 0 drop",
        ] {
            assert!(drops_pmtu_errors(line), "{line}");
        }
        for line in [
            "-A INPUT -p icmp -m icmp --icmp-type 8 -j DROP",
            "-A INPUT -p icmp -j ACCEPT",
            "-A KUBE-SERVICES -d 10.0.0.1/32 -p tcp -j REJECT --reject-with icmp-port-unreachable",
            "icmp type echo-request drop",
        ] {
            assert!(!drops_pmtu_errors(line), "{line}");
        }
    }
}
