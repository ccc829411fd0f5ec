//! Dual-stack labs: every node, pod and Service of a spec also gets an IPv6
//! address derived from its IPv4 one, so one lab serves the IPv4 and the
//! IPv6 case of a scenario and tests can name both without tables.
//!
//! The plan (ULA space, lab-internal like the IPv4 addresses):
//! - cluster pod network `fd00:10:244::/56`; a node whose IPv4 pod CIDR is
//!   `a.b.C.0/24` gets `fd00:10:244:<C in hex>::/64`, and a pod keeps its
//!   host number: `100.96.54.240` → `fd00:10:244:36::f0`, the gateway `.1`
//!   → `::1`;
//! - Service CIDR `fd00:10:96::/112`: a ClusterIP keeps its low 16 bits,
//!   `100.67.30.133` → `fd00:10:96::1e85`, `100.64.0.10` → `fd00:10:96::a`;
//! - underlay `fd00:172:20::/64`, the router at `::1`, node `i` at `::10+i`
//!   (hex), like the IPv4 underlay;
//! - the outside client (with [`LabSpec::outside`]) `fd00:10:8::a/64`
//!   behind the router's `::1`, as `10.8.0.10/24` behind `.1`.

use std::net::{Ipv4Addr, Ipv6Addr};

use crate::cidr::{Ipv4Cidr, Ipv6Cidr};
use crate::spec::LabSpec;

/// The cluster's IPv6 pod network (kube-proxy's second `--cluster-cidr`).
pub const POD_NETWORK6: Ipv6Cidr =
    Ipv6Cidr::new(Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 0), 56);
/// The IPv6 Service CIDR.
pub const SERVICE_CIDR6: Ipv6Cidr =
    Ipv6Cidr::new(Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0), 112);
/// The nodes' IPv6 underlay.
pub const UNDERLAY6: Ipv6Cidr =
    Ipv6Cidr::new(Ipv6Addr::new(0xfd00, 0x172, 0x20, 0, 0, 0, 0, 0), 64);
/// The outside client's IPv6 address on its LAN; the router is `::1` there.
pub const OUTSIDE_CLIENT6: Ipv6Cidr =
    Ipv6Cidr::new(Ipv6Addr::new(0xfd00, 0x10, 0x8, 0, 0, 0, 0, 0xa), 64);
/// flannel's IPv6 vxlan device (`flannel-v6.<VNI>`).
pub const VXLAN6_DEV: &str = "flannel-v6.1";
/// The link-local address of every routed host veth (EUI-64 of
/// [`crate::ROUTED_HOST_MAC`]): Calico's IPv6 pods route `default via` it.
pub const ROUTED_GATEWAY6: Ipv6Addr =
    Ipv6Addr::new(0xfe80, 0, 0, 0, 0xecee, 0xeeff, 0xfeee, 0xeeee);

/// A node's IPv6 pod CIDR from its IPv4 one.
pub fn pod_cidr6(v4: Ipv4Cidr) -> Ipv6Cidr {
    let c = v4.network().octets()[2];
    Ipv6Cidr::new(
        Ipv6Addr::new(0xfd00, 0x10, 0x244, u16::from(c), 0, 0, 0, 0),
        64,
    )
}

/// A pod's (or gateway's) IPv6 address from its IPv4 one in `v4_cidr`.
pub fn pod_ip6(v4_cidr: Ipv4Cidr, ip: Ipv4Addr) -> Ipv6Addr {
    let host = u32::from(ip) - u32::from(v4_cidr.network());
    pod_cidr6(v4_cidr).host(u128::from(host))
}

/// A ClusterIP's IPv6 twin.
pub fn service_ip6(ip: Ipv4Addr) -> Ipv6Addr {
    SERVICE_CIDR6.host(u128::from(u32::from(ip) & 0xffff))
}

/// The router's IPv6 underlay address.
pub fn router_underlay_ip6() -> Ipv6Addr {
    UNDERLAY6.host(1)
}

/// Node `index`'s IPv6 underlay address.
pub fn node_underlay_ip6(index: usize) -> Ipv6Addr {
    UNDERLAY6.host(0x10 + index as u128)
}

/// MAC of node `index`'s `flannel-v6.1` (distinct from its `flannel.1`).
pub fn vxlan6_mac(index: usize) -> String {
    crate::topology::node_mac(0x76, index)
}

impl LabSpec {
    /// Makes every node, pod and Service dual-stack (addresses as in the
    /// module docs). Turns any preset into its dual-stack variant.
    pub fn dual_stack(mut self) -> Self {
        for node in &mut self.nodes {
            node.pod_cidr6 = Some(pod_cidr6(node.pod_cidr));
            for pod in &mut node.pods {
                pod.ip6 = Some(pod_ip6(node.pod_cidr, pod.ip));
            }
        }
        for svc in &mut self.services {
            svc.cluster_ip6 = Some(service_ip6(svc.cluster_ip));
        }
        self
    }

    /// Whether the lab's nodes carry IPv6 ([`LabSpec::dual_stack`]).
    pub fn is_dual_stack(&self) -> bool {
        self.nodes.iter().any(|n| n.pod_cidr6.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets;

    #[test]
    fn addresses_follow_the_ipv4_plan() {
        let spec = presets::seed000(Default::default()).dual_stack();
        assert!(spec.is_dual_stack());
        let a = &spec.nodes[0];
        assert_eq!(a.pod_cidr6.unwrap().to_string(), "fd00:10:244:36::/64");
        assert_eq!(a.gateway6().unwrap().to_string(), "fd00:10:244:36::1");
        assert_eq!(a.pods[0].ip6.unwrap().to_string(), "fd00:10:244:36::f0");
        assert_eq!(
            spec.services[0].cluster_ip6.unwrap().to_string(),
            "fd00:10:96::1e85"
        );
        assert_eq!(
            service_ip6(presets::DNS_SERVICE_IP).to_string(),
            "fd00:10:96::a"
        );
        assert!(POD_NETWORK6.contains(spec.nodes[1].pods[0].ip6.unwrap()));
        assert_eq!(node_underlay_ip6(1).to_string(), "fd00:172:20::11");
        assert!(!presets::seed000(Default::default()).is_dual_stack());
    }
}
