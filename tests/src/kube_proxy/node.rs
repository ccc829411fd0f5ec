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

use super::{MASQ_MARK, ResolvedService, Table, cni, nat_table};
use crate::cidr::Ipv4Cidr;
use crate::spec::{CniChains, KubeProxyConfig, ProxyMode};

/// What the renderer needs to know about the node itself.
#[derive(Clone, Copy, Debug)]
pub struct NodeNet {
    /// This node's pod CIDR (flannel's lease).
    pub pod_cidr: Ipv4Cidr,
    /// The cluster's pod network (flannel's `Network`).
    pub cluster_network: Ipv4Cidr,
}

const CT_NEW: &str = "-m conntrack --ctstate NEW";

/// kube-proxy's filter table plus kubelet's `KUBE-FIREWALL`.
pub(crate) fn filter_table(services: &[ResolvedService]) -> Table {
    let mut t = Table::new("filter");
    for chain in [
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-FIREWALL",
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
    t.rule("INPUT", "-j KUBE-FIREWALL");
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
    t.rule("OUTPUT", "-j KUBE-FIREWALL");
    t.rule("OUTPUT", &lb_fw);
    t.rule("OUTPUT", &portals);

    // kubelet's (and kube-proxy's copy of) the route_localnet guard.
    t.rule("KUBE-FIREWALL", LOCALNET_GUARD);
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
                    r#"-p {proto} -m comment --comment "{} has no endpoints" -m addrtype --dst-type LOCAL -m {proto} --dport {node_port} -j REJECT --reject-with icmp-port-unreachable"#,
                    svc.port_name
                ),
            );
        }
    }
    t
}

/// kubelet's own filter chain (`KUBE-FIREWALL`, the route_localnet guard):
/// what the filter table holds on a node whose kube-proxy runs in nftables mode.
fn kubelet_filter_table() -> Table {
    let mut t = Table::new("filter");
    t.chain("KUBE-FIREWALL");
    t.rule("INPUT", "-j KUBE-FIREWALL");
    t.rule("OUTPUT", "-j KUBE-FIREWALL");
    t.rule("KUBE-FIREWALL", LOCALNET_GUARD);
    t
}

const LOCALNET_GUARD: &str = r#"! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP"#;

/// kube-proxy's REJECT for a Service port without endpoints, as
/// `iptables-save` prints it (without the leading `-A KUBE-SERVICES`).
pub fn no_endpoints_rule(
    ip: std::net::Ipv4Addr,
    port: u16,
    proto: &str,
    port_name: &str,
) -> String {
    format!(
        r#"-d {ip}/32 -p {proto} -m comment --comment "{port_name} has no endpoints" -m {proto} --dport {port} -j REJECT --reject-with icmp-port-unreachable"#
    )
}

/// The complete `iptables-restore` input for one node: mangle, filter, nat
/// (and raw with Calico). Table order is iptables-save's.
pub fn render_node(
    config: &KubeProxyConfig,
    services: &[ResolvedService],
    node: NodeNet,
) -> String {
    let mut mangle = Table::new("mangle");
    // kubelet's hint chain tells other tools which backend it uses.
    mangle.chain("KUBE-IPTABLES-HINT");
    // In nftables mode kube-proxy writes its own `table ip kube-proxy`
    // (crate::kube_proxy_nft); kubelet and the CNI still use iptables.
    let nftables_mode = config.mode == ProxyMode::Nftables;
    let (mut filter, mut nat) = if nftables_mode {
        (kubelet_filter_table(), Table::new("nat"))
    } else {
        (filter_table(services), nat_table(config, services))
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
            cni::flannel(&mut filter, &mut nat, node, ip_masq);
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
