//! A whole node's iptables layout: kube-proxy's filter and nat tables, the
//! chains kubelet owns, both canaries, and the CNI's chains, as
//! `iptables-save` shows them on a kubeadm node (kube-proxy and kubelet
//! 1.29+, `pkg/proxy/iptables/proxier.go` `iptablesJumpChains` /
//! `iptablesKubeletJumpChains`, `pkg/kubelet/kubelet_network_linux.go`).
//!
//! Jump order in the built-in chains follows from who wrote them: kubelet
//! prepends `-j KUBE-FIREWALL` first; kube-proxy *prepends* its jumps in list
//! order (so the last one listed ends up first) and then re-prepends
//! kubelet's jump; flannel appends. The result is what real nodes show:
//! `FORWARD: KUBE-PROXY-FIREWALL, KUBE-FORWARD, KUBE-SERVICES,
//! KUBE-EXTERNAL-SERVICES, FLANNEL-FWD`.

use std::net::IpAddr;

use super::{MASQ_MARK, ResolvedService, Table, cni, host_cidr, nat_table_for};
use crate::cidr::{Ipv4Cidr, Ipv6Cidr};
use crate::spec::{CniChains, KubeProxyConfig, ProxyMode};

/// What the renderer needs to know about the node itself.
#[derive(Clone, Copy, Debug)]
pub struct NodeNet {
    /// This node's pod CIDR (flannel's lease).
    pub pod_cidr: Ipv4Cidr,
    /// The cluster's pod network (flannel's `Network`).
    pub cluster_network: Ipv4Cidr,
}

/// [`NodeNet`] for the IPv6 half of a dual-stack node.
#[derive(Clone, Copy, Debug)]
pub struct NodeNet6 {
    /// This node's IPv6 pod CIDR.
    pub pod_cidr: Ipv6Cidr,
    /// The cluster's IPv6 pod network.
    pub cluster_network: Ipv6Cidr,
}

/// What the renderers need of a node, whatever its family.
pub(super) struct Net {
    pub(super) pod_cidr: String,
    pub(super) cluster_network: String,
    /// flannel leaves multicast alone: `224.0.0.0/4` or `ff00::/8`.
    pub(super) multicast: &'static str,
}

const CT_NEW: &str = "-m conntrack --ctstate NEW";

/// kube-proxy's filter table plus kubelet's `KUBE-FIREWALL`. IPv6 has no `KUBE-FIREWALL`: kubelet
/// and kube-proxy write the localnet guard for IPv4 only ("ipv6 doesn't have
/// this issue", pkg/kubelet/kubelet_network_linux.go `syncIPTablesRules`;
/// proxier.go `if !isIPv6 && proxier.localhostNodePorts`).
fn filter_table_for(services: &[ResolvedService], v6: bool) -> Table {
    let mut t = Table::new("filter");
    if !v6 {
        t.chain("KUBE-FIREWALL");
    }
    for chain in [
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-FORWARD",
        "KUBE-NODEPORTS",
        "KUBE-PROXY-FIREWALL",
        "KUBE-SERVICES",
    ] {
        t.chain(chain);
    }
    let lb_fw = format!(
        r#"{CT_NEW} -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL"#
    );
    let portals =
        format!(r#"{CT_NEW} -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#);
    let external = format!(
        r#"{CT_NEW} -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES"#
    );
    if !v6 {
        t.rule("INPUT", "-j KUBE-FIREWALL");
    }
    t.rule("INPUT", &lb_fw);
    t.rule(
        "INPUT",
        r#"-m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS"#,
    );
    t.rule("INPUT", &external);
    t.rule("FORWARD", &lb_fw);
    t.rule(
        "FORWARD",
        r#"-m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD"#,
    );
    t.rule("FORWARD", &portals);
    t.rule("FORWARD", &external);
    if !v6 {
        t.rule("OUTPUT", "-j KUBE-FIREWALL");
    }
    t.rule("OUTPUT", &lb_fw);
    t.rule("OUTPUT", &portals);

    if !v6 {
        // kubelet's (and kube-proxy's copy of) the route_localnet guard.
        t.rule("KUBE-FIREWALL", LOCALNET_GUARD);
    }
    // Left out by kube-proxy only when nf_conntrack_tcp_be_liberal is set.
    t.rule("KUBE-FORWARD", "-m conntrack --ctstate INVALID -j DROP");
    t.rule(
        "KUBE-FORWARD",
        &format!(
            r#"-m comment --comment "kubernetes forwarding rules" -m mark --mark {MASQ_MARK} -j ACCEPT"#
        ),
    );
    t.rule(
        "KUBE-FORWARD",
        r#"-m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"#,
    );
    // externalTrafficPolicy: Local without an endpoint on this node: DROP
    // (proxier.go: `externalTrafficFilterTarget = "DROP"`), and the
    // health check node port is accepted whether or not there is one.
    for svc in services
        .iter()
        .filter(|s| s.external.local_policy && !s.endpoints.is_empty())
    {
        let proto = svc.protocol.as_str();
        let name = &svc.port_name;
        if let Some(hc) = svc.external.health_check_node_port {
            t.rule(
                "KUBE-NODEPORTS",
                &format!(
                    r#"-p tcp -m comment --comment "{name} health check node port" -m tcp --dport {hc} -j ACCEPT"#
                ),
            );
        }
        if svc.local.iter().any(|l| *l) {
            continue;
        }
        for ip in svc.external.external_ips.iter().chain(&svc.external.lb_ips) {
            t.rule(
                "KUBE-EXTERNAL-SERVICES",
                &format!(
                    r#"-d {ip}/32 -p {proto} -m comment --comment "{name} has no local endpoints" -m {proto} --dport {} -j DROP"#,
                    svc.port
                ),
            );
        }
        if let Some(node_port) = svc.node_port {
            t.rule(
                "KUBE-EXTERNAL-SERVICES",
                &format!(
                    r#"-p {proto} -m comment --comment "{name} has no local endpoints" -m addrtype --dst-type LOCAL -m {proto} --dport {node_port} -j DROP"#
                ),
            );
        }
    }
    // A Service port without endpoints: REJECT (ICMP port unreachable, so
    // clients fail fast with "connection refused" instead of timing out).
    for svc in services.iter().filter(|s| s.endpoints.is_empty()) {
        let proto = svc.protocol.as_str();
        t.rule(
            "KUBE-SERVICES",
            &no_endpoints_rule(svc.cluster_ip, svc.port, proto, &svc.port_name),
        );
        if let Some(node_port) = svc.node_port {
            t.rule(
                "KUBE-EXTERNAL-SERVICES",
                &format!(
                    r#"-p {proto} -m comment --comment "{} has no endpoints" -m addrtype --dst-type LOCAL -m {proto} --dport {node_port} -j REJECT --reject-with {}"#,
                    svc.port_name,
                    reject_with(svc.cluster_ip),
                ),
            );
        }
    }
    t
}

/// kubelet's own filter chain (`KUBE-FIREWALL`, the route_localnet guard):
/// what the filter table holds on a node whose kube-proxy runs in nftables
/// mode (nothing for IPv6, see [`filter_table_for`]).
fn kubelet_filter_table(v6: bool) -> Table {
    let mut t = Table::new("filter");
    if v6 {
        return t;
    }
    t.chain("KUBE-FIREWALL");
    t.rule("INPUT", "-j KUBE-FIREWALL");
    t.rule("OUTPUT", "-j KUBE-FIREWALL");
    t.rule("KUBE-FIREWALL", LOCALNET_GUARD);
    t
}

const LOCALNET_GUARD: &str = r#"! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP"#;

/// kube-proxy's REJECT for a Service port without endpoints, as
/// `iptables-save` prints it (without the leading `-A KUBE-SERVICES`).
pub fn no_endpoints_rule(ip: impl Into<IpAddr>, port: u16, proto: &str, port_name: &str) -> String {
    let ip = ip.into();
    format!(
        r#"-d {} -p {proto} -m comment --comment "{port_name} has no endpoints" -m {proto} --dport {port} -j REJECT --reject-with {}"#,
        host_cidr(ip),
        reject_with(ip)
    )
}

/// REJECT's default as iptables-save / ip6tables-save print it.
fn reject_with(ip: IpAddr) -> &'static str {
    if ip.is_ipv6() {
        "icmp6-port-unreachable"
    } else {
        "icmp-port-unreachable"
    }
}

/// The complete `iptables-restore` input for one node: mangle, filter, nat
/// (and raw with Calico). Table order is iptables-save's.
pub fn render_node(
    config: &KubeProxyConfig,
    services: &[ResolvedService],
    node: NodeNet,
) -> String {
    let net = Net {
        pod_cidr: node.pod_cidr.trunc().to_string(),
        cluster_network: node.cluster_network.trunc().to_string(),
        multicast: "224.0.0.0/4",
    };
    let cidr = config.cluster_cidr.map(|c| c.trunc().to_string());
    render_family(config, services, &net, cidr, false)
}

/// [`render_node`] for the `ip6tables-restore` of a dual-stack node: the
/// IPv6 proxier's tables (`services` are the IPv6 ClusterIPs), kubelet's
/// hint and canaries, and flannel's IPv6 chains. The IPv6 `--cluster-cidr`
/// is the cluster network whenever the IPv4 one is set.
pub fn render_node6(
    config: &KubeProxyConfig,
    services: &[ResolvedService],
    node: NodeNet6,
) -> String {
    let net = Net {
        pod_cidr: node.pod_cidr.trunc().to_string(),
        cluster_network: node.cluster_network.trunc().to_string(),
        multicast: "ff00::/8",
    };
    let cidr = config
        .cluster_cidr
        .map(|_| node.cluster_network.trunc().to_string());
    render_family(config, services, &net, cidr, true)
}

fn render_family(
    config: &KubeProxyConfig,
    services: &[ResolvedService],
    net: &Net,
    cluster_cidr: Option<String>,
    v6: bool,
) -> String {
    let mut mangle = Table::new("mangle");
    // kubelet's hint chain tells other tools which backend it uses.
    mangle.chain("KUBE-IPTABLES-HINT");
    // In nftables mode kube-proxy writes its own `table ip kube-proxy`
    // (crate::kube_proxy_nft); kubelet and the CNI still use iptables.
    let nftables_mode = config.mode == ProxyMode::Nftables;
    let (mut filter, mut nat) = if nftables_mode {
        (kubelet_filter_table(v6), Table::new("nat"))
    } else {
        (
            filter_table_for(services, v6),
            nat_table_for(config, services, cluster_cidr, v6),
        )
    };
    let mut raw = Table::new("raw");
    // The canaries: kube-proxy and kubelet re-sync when theirs vanishes.
    for t in [&mut mangle, &mut filter, &mut nat] {
        t.chain("KUBE-KUBELET-CANARY");
        if !nftables_mode {
            t.chain("KUBE-PROXY-CANARY");
        }
    }
    match config.cni_chains {
        CniChains::Flannel { ip_masq } => {
            cni::flannel(&mut filter, &mut nat, net, ip_masq);
        }
        CniChains::Calico => cni::calico(&mut raw, &mut mangle),
        CniChains::None => {}
    }
    let mut out = String::new();
    for t in [&raw, &mangle, &filter, &nat] {
        if !t.is_empty() {
            out.push_str(&t.render());
        }
    }
    out
}
