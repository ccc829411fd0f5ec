//! doctor's IPv6 checks, for nodes that carry IPv6 (a global address here,
//! or kube-proxy's IPv6 proxier has Services): bridged IPv6 and ip6tables,
//! IPv6 forwarding, Router Advertisements ignored on forwarding interfaces,
//! the conntrack table both families share, and IPv6 Services without
//! endpoints. Gathering ([`gather`]) runs inside the node's namespace;
//! judging ([`findings`]) is pure.
use std::{collections::BTreeSet, net::IpAddr};

use serde::Serialize;

use super::{Finding, Inputs, Severity, few, finding};

/// The IPv6 facts of the node namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Ipv6Facts {
    /// Interfaces with a global (not link-local, not loopback) IPv6 address.
    pub global_on: Vec<String>,
    /// `net.bridge.bridge-nf-call-ip6tables`; None without br_netfilter.
    pub bridge_nf_call_ip6tables: Option<bool>,
    /// `net.ipv6.conf.all.forwarding`; None without IPv6.
    pub forwarding: Option<bool>,
    /// Per interface: `forwarding` and `accept_ra`.
    pub conf: Vec<RaConf>,
    /// Interfaces holding a default route learned from a Router
    /// Advertisement (RTF_ADDRCONF in /proc/net/ipv6_route).
    pub ra_default_via: Vec<String>,
}

/// One interface's RA-related sysctls.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RaConf {
    pub name: String,
    pub forwarding: bool,
    pub accept_ra: u8,
}

const FIX_BRIDGE_NF6: &str = "sysctl -w net.bridge.bridge-nf-call-ip6tables=1 in the namespace that owns the bridge (persist it in /etc/sysctl.d), with br_netfilter loaded";
const FIX_FORWARD6: &str = "sysctl -w net.ipv6.conf.all.forwarding=1";
const FIX_ACCEPT_RA: &str = "sysctl -w net.ipv6.conf.<interface>.accept_ra=2 (accept RAs although forwarding), or configure the default route statically";
const FIX_CONNTRACK6: &str =
    "size net.netfilter.nf_conntrack_max for the IPv4 and IPv6 connections together";
const FIX_NO_ENDPOINTS6: &str = "give the Service's pods IPv6 addresses (a dual-stack pod CIDR in the CNI) or make the Service single-stack (ipFamilyPolicy: SingleStack); kubectl get endpointslices -l kubernetes.io/service-name=<name> shows one slice per family";

/// `RTF_ADDRCONF`: the kernel marks routes it learned from a Router
/// Advertisement with it (net/ipv6/route.c `rt6_add_dflt_router`).
const RTF_ADDRCONF: u32 = 0x0004_0000;

/// Reads the IPv6 facts; call it on a thread inside the node namespace.
/// `/proc/thread-self/net` is this thread's namespace (see
/// `ruleset::legacy_tables_exist`).
pub(super) fn gather() -> Ipv6Facts {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let flag = |p: &str| crate::probes::netns::read_sysctl_bool(p);
    let mut global: BTreeSet<String> = BTreeSet::new();
    let mut names: BTreeSet<String> = BTreeSet::new();
    // addr ifindex prefixlen scope flags name; scope 0 = global.
    for line in read("/proc/thread-self/net/if_inet6").lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if let [_, _, _, scope, _, name] = f[..] {
            names.insert(name.to_string());
            if scope == "00" && name != "lo" {
                global.insert(name.to_string());
            }
        }
    }
    let conf = names
        .iter()
        .filter(|n| *n != "lo")
        .filter_map(|name| {
            let dir = format!("/proc/sys/net/ipv6/conf/{name}");
            Some(RaConf {
                name: name.clone(),
                forwarding: flag(&format!("{dir}/forwarding"))?,
                accept_ra: read(&format!("{dir}/accept_ra")).trim().parse().ok()?,
            })
        })
        .collect();
    Ipv6Facts {
        global_on: global.into_iter().collect(),
        bridge_nf_call_ip6tables: flag("/proc/sys/net/bridge/bridge-nf-call-ip6tables"),
        forwarding: flag("/proc/sys/net/ipv6/conf/all/forwarding"),
        conf,
        ra_default_via: ra_default_routes(&read("/proc/thread-self/net/ipv6_route")),
    }
}

/// Interfaces of `::/0` routes with RTF_ADDRCONF in /proc/net/ipv6_route
/// (dst dst_len src src_len next_hop metric refcnt use flags device).
fn ra_default_routes(table: &str) -> Vec<String> {
    let mut out: Vec<String> = table
        .lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let [dst, len, _, _, _, _, _, _, flags, dev] = f[..] else {
                return None;
            };
            let flags = u32::from_str_radix(flags, 16).ok()?;
            (dst.bytes().all(|b| b == b'0') && len == "00" && flags & RTF_ADDRCONF != 0)
                .then(|| dev.to_string())
        })
        .collect();
    out.dedup();
    out
}

/// Whether this node carries IPv6: an address, or IPv6 Services.
fn in_use(i: &Inputs) -> bool {
    !i.ipv6.global_on.is_empty()
        || i.kube_proxy.services.iter().any(|s| s.cluster_ip.is_ipv6())
        || i.kube_proxy.no_endpoints.iter().any(|r| r.ip.is_ipv6())
}

/// The IPv6 findings (none on a node without IPv6).
pub(super) fn findings(i: &Inputs) -> Vec<Finding> {
    if !in_use(i) {
        return Vec::new();
    }
    let mut out: Vec<Finding> = [
        bridge_nf_call_ip6tables(i),
        Some(forwarding(i)),
        accept_ra(i),
        conntrack_shared(i),
    ]
    .into_iter()
    .flatten()
    .collect();
    out.extend(services_without_ipv6_endpoints(i));
    out
}

fn bridge_nf_call_ip6tables(i: &Inputs) -> Option<Finding> {
    let bridges: Vec<&str> = i
        .interfaces
        .iter()
        .filter(|x| x.kind == "bridge")
        .map(|x| x.name.as_str())
        .collect();
    if bridges.is_empty() {
        return None;
    }
    let (sev, v, msg) = match i.ipv6.bridge_nf_call_ip6tables {
        Some(true) => (
            Severity::Ok,
            "1",
            format!(
                "bridged IPv6 traffic on {} passes ip6tables",
                bridges.join(",")
            ),
        ),
        Some(false) => (
            Severity::Error,
            "0",
            format!(
                "bridged IPv6 traffic on {} skips ip6tables: same-node IPv6 Service replies are not reverse-NATed (seed 000/001 over IPv6)",
                bridges.join(",")
            ),
        ),
        None => (
            Severity::Error,
            "absent",
            "net.bridge.bridge-nf-call-ip6tables does not exist (br_netfilter not loaded)".into(),
        ),
    };
    Some(finding(
        "bridge_nf_call_ip6tables",
        sev,
        format!("bridge-nf-call-ip6tables={v} on {}", few(&bridges)),
        msg,
        FIX_BRIDGE_NF6,
    ))
}

fn forwarding(i: &Inputs) -> Finding {
    let (sev, v, msg) = match i.ipv6.forwarding {
        Some(true) => (Severity::Ok, "1", "the node forwards IPv6"),
        Some(false) => (
            Severity::Error,
            "0",
            "the node does not forward IPv6: pod and Service traffic over IPv6 through it is dropped",
        ),
        None => (
            Severity::Warning,
            "unknown",
            "IPv6 forwarding could not be read (IPv6 disabled?)",
        ),
    };
    finding(
        "ipv6_forwarding",
        sev,
        format!("ipv6_forwarding={v}"),
        msg.into(),
        FIX_FORWARD6,
    )
}

/// Router Advertisements on a forwarding interface are dropped unless
/// `accept_ra` is 2: include/net/ipv6.h `ipv6_accept_ra()` returns
/// `accept_ra == 2` when `forwarding` is set, and ndisc_router_discovery
/// (net/ipv6/ndisc.c) then skips the RA (Documentation/networking/
/// ip-sysctl.rst, accept_ra: "1 - Accept Router Advertisements if
/// forwarding is disabled. 2 - Overrule forwarding behaviour"). A default
/// route learned before forwarding was turned on (by kubelet, the CNI or a
/// sysctl file) is then never refreshed and vanishes when its lifetime ends.
fn accept_ra(i: &Inputs) -> Option<Finding> {
    let all_fwd = i.ipv6.forwarding == Some(true);
    let stale: Vec<&str> = i
        .ipv6
        .ra_default_via
        .iter()
        .filter(|dev| {
            i.ipv6
                .conf
                .iter()
                .find(|c| &c.name == *dev)
                .is_some_and(|c| (c.forwarding || all_fwd) && c.accept_ra < 2)
        })
        .map(String::as_str)
        .collect();
    if stale.is_empty() {
        return (!i.ipv6.ra_default_via.is_empty()).then(|| {
            finding(
                "ipv6_accept_ra",
                Severity::Ok,
                "accept_ra=ok".into(),
                format!(
                    "the IPv6 default route via {} comes from Router Advertisements, which the kernel keeps accepting there",
                    i.ipv6.ra_default_via.join(",")
                ),
                FIX_ACCEPT_RA,
            )
        });
    }
    Some(finding(
        "ipv6_accept_ra",
        Severity::Error,
        format!("accept_ra<2 with forwarding on {}", few(&stale)),
        format!(
            "the IPv6 default route via {} was learned from a Router Advertisement, but forwarding is on and accept_ra is below 2 there, so the kernel ignores further RAs: the route is not refreshed and the node loses its IPv6 default route when it expires",
            stale.join(", ")
        ),
        FIX_ACCEPT_RA,
    ))
}

/// One conntrack table per namespace holds both families' entries
/// (`nf_conntrack_hash`, counted against one `nf_conntrack_max`,
/// net/netfilter/nf_conntrack_core.c `__nf_conntrack_alloc`).
fn conntrack_shared(i: &Inputs) -> Option<Finding> {
    let (count, max) = (i.conntrack_count?, i.conntrack_max?);
    Some(finding(
        "conntrack_ipv6",
        Severity::Info,
        "conntrack=shared by IPv4 and IPv6".into(),
        format!(
            "IPv4 and IPv6 connections share one conntrack table ({count} of {max} entries in use): IPv6 traffic fills the same nf_conntrack_max"
        ),
        FIX_CONNTRACK6,
    ))
}

/// IPv6 ClusterIPs kube-proxy rejects for having no endpoints; a Service
/// whose IPv4 half has endpoints but whose IPv6 half has none is a
/// dual-stack Service whose pods have no IPv6 address: its IPv6 clients are
/// refused while IPv4 works.
fn services_without_ipv6_endpoints(i: &Inputs) -> Option<Finding> {
    let v6: Vec<_> = i
        .kube_proxy
        .no_endpoints
        .iter()
        .filter(|r| r.ip.is_ipv6())
        .collect();
    if v6.is_empty() {
        return None;
    }
    let has_v4_endpoints = |name: &str| {
        i.kube_proxy.services.iter().any(|s| {
            &*s.name == name && matches!(s.cluster_ip, IpAddr::V4(_)) && !s.endpoints.is_empty()
        })
    };
    let half: Vec<&str> = v6
        .iter()
        .filter(|r| has_v4_endpoints(&r.port_name))
        .map(|r| r.port_name.as_str())
        .collect();
    let all: Vec<String> = v6
        .iter()
        .map(|r| format!("{} ([{}]:{})", r.port_name, r.ip, r.port))
        .collect();
    let (sev, msg) = if half.is_empty() {
        (
            Severity::Info,
            format!(
                "{} IPv6 Service port(s) without endpoints, rejected (ICMPv6 port unreachable): {}",
                v6.len(),
                all.join(", ")
            ),
        )
    } else {
        (
            Severity::Warning,
            format!(
                "{} has endpoints over IPv4 but none over IPv6: IPv6 clients are refused while IPv4 works (rejected: {})",
                half.join(", "),
                all.join(", ")
            ),
        )
    };
    Some(finding(
        "ipv6_no_endpoints",
        sev,
        format!("ipv6_no_endpoints={}", v6.len()),
        msg,
        FIX_NO_ENDPOINTS6,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ra_default_routes_are_the_addrconf_defaults() {
        // A static default (flags 0x0003: UP|GATEWAY), an RA-learned one
        // (0x00450003: +ADDRCONF|DEFAULT|EXPIRES) and a prefix route.
        let table = "\
00000000000000000000000000000000 00 00000000000000000000000000000000 00 fd000172002000000000000000000001 00000400 00000001 00000000 00000003     eth1
00000000000000000000000000000000 00 00000000000000000000000000000000 00 fe800000000000000000000000000001 00000400 00000001 00000000 00450003     eth0
fd000010024400360000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001     cni0
";
        assert_eq!(ra_default_routes(table), vec!["eth0".to_string()]);
        assert!(ra_default_routes("").is_empty());
    }
}
