//! The IPv6 half of a dual-stack lab's links and routes ([`crate::dual_stack`]
//! has the address plan). Each function adds `ip -batch` lines beside the
//! IPv4 ones `topology` writes; none runs for an IPv4-only lab.
//!
//! Global addresses are added `nodad` and every lab namespace turns DAD off
//! before its links exist: a tentative address can be neither a source nor
//! answer neighbour solicitations for the ~1 s DAD takes, and the host veths'
//! link-local addresses (Calico's IPv6 gateway) are created by the kernel.

use std::fmt::Write as _;

use crate::dual_stack::{
    OUTSIDE_CLIENT6, ROUTED_GATEWAY6, UNDERLAY6, VXLAN6_DEV, node_underlay_ip6,
    router_underlay_ip6, vxlan6_mac,
};
use crate::error::Result;
use crate::lab::Lab;
use crate::spec::{Datapath, LabSpec, NodeSpec, Overlay, PodSpec};
use crate::topology::{VXLAN_ID, VXLAN_PORT, host_veth, kv, set_sysctls};

/// DAD off in every namespace (`all` and `default`, so links created later
/// inherit it), before any link is created.
pub(crate) fn prepare(lab: &Lab) -> Result<()> {
    let off = [
        kv("net.ipv6.conf.all.accept_dad", "0"),
        kv("net.ipv6.conf.default.accept_dad", "0"),
    ];
    for target in lab.targets() {
        set_sysctls(lab.netns(target)?, &off, None)?;
    }
    Ok(())
}

/// The router's address on `underlay0`.
pub(crate) fn router(cmds: &mut String) {
    let _ = writeln!(
        cmds,
        "addr add {}/{} dev underlay0 nodad",
        router_underlay_ip6(),
        UNDERLAY6.prefix()
    );
}

/// The outside client's IPv6 LAN: the router's side (`lan0`) and the
/// client's address and default route. Reaches the nodes' IPv6 addresses
/// (NodePorts); nodes answer through their default route, the router.
pub(crate) fn outside(router: &mut String, client: &mut String) {
    let gw = OUTSIDE_CLIENT6.host(1);
    let _ = writeln!(
        router,
        "addr add {gw}/{} dev lan0 nodad",
        OUTSIDE_CLIENT6.prefix()
    );
    let _ = writeln!(
        client,
        "addr add {OUTSIDE_CLIENT6} dev eth0 nodad\nroute add ::/0 via {gw}"
    );
}

/// The router's "VPC route table" for the IPv6 pod CIDRs.
pub(crate) fn vpc_routes(spec: &LabSpec, cmds: &mut String) {
    for (i, node) in spec.nodes.iter().enumerate() {
        if let Some(c) = node.pod_cidr6 {
            let _ = writeln!(cmds, "route add {} via {}", c.trunc(), node_underlay_ip6(i));
        }
    }
}

/// IPv6 forwarding for a node or the router. Set on `all`, which the
/// kernel copies to `default` and every existing interface
/// (net/ipv6/addrconf.c, `addrconf_fixup_forwarding`).
pub(crate) fn forwarding() -> (String, String) {
    kv("net.ipv6.conf.all.forwarding", "1")
}

/// A node's underlay address, default route, and its pod gateway on `cni0`.
pub(crate) fn node(index: usize, node: &NodeSpec, cmds: &mut String) {
    if node.pod_cidr6.is_none() {
        return;
    }
    let _ = write!(
        cmds,
        "addr add {}/{} dev eth0 nodad\nroute add ::/0 via {}\n",
        node_underlay_ip6(index),
        UNDERLAY6.prefix(),
        router_underlay_ip6(),
    );
    if let (Datapath::Bridge, Some(c)) = (node.datapath, node.pod_cidr6) {
        let _ = writeln!(cmds, "addr add {}/{} dev cni0 nodad", c.host(1), c.prefix());
    }
}

/// The pod's side: the address and its default route (via the `cni0`
/// gateway, or Calico's via the host veth's link-local address).
pub(crate) fn pod(node: &NodeSpec, pod: &PodSpec, cmds: &mut String) {
    let (Some(ip), Some(c)) = (pod.ip6, node.pod_cidr6) else {
        return;
    };
    match node.datapath {
        Datapath::Bridge => {
            let _ = write!(
                cmds,
                "addr add {ip}/{} dev eth0 nodad\nroute add ::/0 via {}\n",
                c.prefix(),
                c.host(1)
            );
        }
        Datapath::Routed => {
            let _ = write!(
                cmds,
                "addr add {ip}/128 dev eth0 nodad\nroute add ::/0 via {ROUTED_GATEWAY6} dev eth0\n"
            );
        }
    }
}

/// The routed node's host routes to its pods and the block's blackhole.
pub(crate) fn routed_host(node: &NodeSpec, cmds: &mut String) {
    let Some(c) = node.pod_cidr6.filter(|_| node.datapath == Datapath::Routed) else {
        return;
    };
    for (j, pod) in node.pods.iter().enumerate() {
        if let Some(ip) = pod.ip6 {
            let _ = writeln!(cmds, "route add {ip}/128 dev {}", host_veth(node, j));
        }
    }
    let _ = writeln!(cmds, "route add blackhole {}", c.trunc());
}

/// What Calico writes for each IPv6 host veth: forwarding and proxy NDP.
pub(crate) fn routed_sysctls(node: &NodeSpec) -> Vec<(String, String)> {
    if node.datapath != Datapath::Routed || node.pod_cidr6.is_none() {
        return Vec::new();
    }
    (0..node.pods.len())
        .flat_map(|j| {
            let veth = host_veth(node, j);
            [
                kv(&format!("net.ipv6.conf.{veth}.forwarding"), "1"),
                kv(&format!("net.ipv6.conf.{veth}.proxy_ndp"), "1"),
            ]
        })
        .collect()
}

/// flannel's IPv6 vxlan backend (`flannel-v6.1` over the IPv6 underlay,
/// static neighbours and fdb entries) or host-gw routes, for node `i`.
pub(crate) fn overlay(spec: &LabSpec, i: usize, cmds: &mut String, fdb: &mut String) {
    let Some(own) = spec.nodes[i].pod_cidr6 else {
        return;
    };
    if spec.overlay == Overlay::Vxlan {
        let _ = write!(
            cmds,
            "link add {VXLAN6_DEV} address {} type vxlan id {VXLAN_ID} local {} dev eth0 dstport {VXLAN_PORT} nolearning\n\
             addr add {}/128 dev {VXLAN6_DEV} nodad\nlink set {VXLAN6_DEV} up\n",
            vxlan6_mac(i),
            node_underlay_ip6(i),
            own.network(),
        );
    }
    for (j, other) in spec.nodes.iter().enumerate().filter(|(j, _)| *j != i) {
        let Some(cidr) = other.pod_cidr6.map(|c| c.trunc()) else {
            continue;
        };
        match spec.overlay {
            Overlay::Vxlan => {
                let gw = cidr.network();
                let _ = write!(
                    cmds,
                    "route add {cidr} via {gw} dev {VXLAN6_DEV} onlink\nneigh add {gw} lladdr {} dev {VXLAN6_DEV} nud permanent\n",
                    vxlan6_mac(j),
                );
                let _ = writeln!(
                    fdb,
                    "fdb append {} dev {VXLAN6_DEV} dst {}",
                    vxlan6_mac(j),
                    node_underlay_ip6(j)
                );
            }
            Overlay::HostGw => {
                let _ = writeln!(cmds, "route add {cidr} via {}", node_underlay_ip6(j));
            }
        }
    }
}
