//! Turns a [`LabSpec`] into namespaces and links. Everything is created from
//! the root namespace with `ip -n <ns>` (veth peers are created directly in
//! their target namespace with `peer ... netns <other>`), so no interface,
//! route, rule or sysctl ever exists in the root namespace, even briefly.
//!
//! Shape (names are per namespace, so every node has the same ones):
//! ```text
//!  outside ns         router ns                      node ns (one per node)          pod ns
//!  eth0 ──veth── lan0   underlay0 (bridge) ──veth── eth0   cni0 (bridge) ──veth── eth0
//!                       172.20.0.1/24          172.20.0.10+i   gateway/pod prefix
//!                                                          flannel.1 (vxlan, Overlay::Vxlan)
//! ```
//! On a [`Datapath::Routed`] node there is no `cni0`: each pod's host veth
//! `cali<hash>` is a routed point-to-point link (`<pod ip>/32 dev cali<hash>`,
//! proxy ARP for the pods' gateway 169.254.1.1), as Calico builds it.

use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::path::Path;

use crate::cidr::Ipv4Cidr;
use crate::error::{LabError, Result};
use crate::lab::Lab;
use crate::netns::{self, Netns};
use crate::spec::{Datapath, LabSpec, NodeSpec, Overlay, ROUTED_GATEWAY, Runtime};
use crate::topology6;

/// Name of the router namespace (always present: it is the nodes' underlay
/// and default gateway, so node-local clients have a route to Service IPs).
pub const ROUTER: &str = "router";
/// Name of the outside client namespace (present with [`LabSpec::outside`]).
pub const OUTSIDE: &str = "outside";

/// The nodes' underlay network (the "VPC"), lab-internal.
pub const UNDERLAY: Ipv4Cidr = Ipv4Cidr::new(Ipv4Addr::new(172, 20, 0, 0), 24);
/// flannel's VXLAN id and port.
pub const VXLAN_ID: u32 = 1;
/// flannel's VXLAN UDP port (not IANA's 4789).
pub const VXLAN_PORT: u16 = 8472;
/// Pod-side MTU with the vxlan overlay (1500 minus the 50-byte encapsulation),
/// as flannel configures it.
pub const VXLAN_MTU: u32 = 1450;

/// The router's address on the underlay.
pub fn router_underlay_ip() -> Ipv4Addr {
    UNDERLAY.host(1)
}

/// Node `index`'s `eth0` address on the underlay.
pub fn node_underlay_ip(index: usize) -> Ipv4Addr {
    UNDERLAY.host(10 + index as u32)
}

/// Deterministic MAC of node `index`'s `flannel.1` (locally administered).
pub fn vxlan_mac(index: usize) -> String {
    node_mac(0x74, index)
}

/// A locally administered MAC `02:6e:<tag>:00:<index>`: `tag` tells the
/// node's devices apart (flannel.1, flannel-v6.1), `index` the nodes.
pub(crate) fn node_mac(tag: u8, index: usize) -> String {
    format!(
        "02:6e:{tag:02x}:00:{:02x}:{:02x}",
        (index >> 8) & 0xff,
        index & 0xff
    )
}

/// MAC of every routed host veth: Calico gives all of them this one, since
/// the pod only ever talks to its proxy-ARPed gateway through it.
pub const ROUTED_HOST_MAC: &str = "ee:ee:ee:ee:ee:ee";

/// The name of pod `index`'s veth in its node's namespace: `veth<index>` on
/// a bridge node, and on a routed node Calico's `VethNameForWorkload`:
/// `cali` + the first 11 hex digits of sha1("<k8s namespace>.<pod>") (lab
/// pods are all in `default`).
pub fn host_veth(node: &NodeSpec, index: usize) -> String {
    match node.datapath {
        Datapath::Bridge => format!("veth{index}"),
        Datapath::Routed => {
            use sha1::{Digest, Sha1};
            let digest = Sha1::digest(format!("default.{}", node.pods[index].name).as_bytes());
            let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
            format!("cali{}", &hex[..11])
        }
    }
}

/// Checks everything that would otherwise fail half-way through building.
pub(crate) fn validate(spec: &LabSpec) -> Result<()> {
    let err = |m: String| Err(LabError::Spec(m));
    if spec.nodes.is_empty() {
        return err("a lab needs at least one node".into());
    }
    if spec.nodes.len() > 200 {
        return err("at most 200 nodes fit the underlay".into());
    }
    let mut names = vec![ROUTER.to_string(), OUTSIDE.to_string()];
    let mut pods = Vec::new();
    for node in &spec.nodes {
        names.push(node.name.clone());
        if node.rp_filter > 2 {
            return err(format!("node {}: rp_filter must be 0, 1 or 2", node.name));
        }
        for (key, value) in &node.sysctls {
            sysctl_path(key)?;
            check_value(value)?;
        }
        if let Some(other) = spec
            .nodes
            .iter()
            .find(|o| o.name != node.name && o.pod_cidr.trunc() == node.pod_cidr.trunc())
        {
            return err(format!(
                "nodes {} and {} share a pod CIDR",
                node.name, other.name
            ));
        }
        if node.runtime == Runtime::Containerd {
            if node.datapath != Datapath::Bridge || node.pod_cidr6.is_some() {
                return err(format!(
                    "node {}: containerd pods are wired by the bridge plugin, IPv4 only",
                    node.name
                ));
            }
            if node.pods.iter().any(|p| p.hairpin != node.pods[0].hairpin) {
                return err(format!(
                    "node {}: the bridge plugin's hairpinMode is one setting for all of a node's pods",
                    node.name
                ));
            }
        }
        for pod in &node.pods {
            names.push(pod.name.clone());
            let cidr = node.pod_cidr;
            if !cidr.contains(pod.ip) || pod.ip == cidr.network() || pod.ip == node.gateway() {
                return err(format!(
                    "pod {} ip {} is not a free host address of node {}'s pod CIDR {}",
                    pod.name, pod.ip, node.name, cidr
                ));
            }
            for (key, value) in &pod.sysctls {
                sysctl_path(key)?;
                check_value(value)?;
            }
            pods.push(pod);
        }
    }
    for name in &names {
        let ok = !name.is_empty()
            && name.len() <= 24
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !ok {
            return err(format!("name {name:?}: use 1-24 characters of [a-z0-9-]"));
        }
        if names.iter().filter(|n| *n == name).count() > 1 {
            return err(format!(
                "name {name:?} is used twice (node and pod names are unique; {ROUTER:?} and {OUTSIDE:?} are reserved)"
            ));
        }
    }
    for svc in &spec.services {
        let what = svc.port_name_string();
        for ep in &svc.endpoints {
            if !pods.iter().any(|p| p.name == ep.pod) {
                return err(format!(
                    "service {what}: endpoint pod {:?} does not exist",
                    ep.pod
                ));
            }
        }
        if svc.pinned.is_some_and(|k| k >= svc.endpoints.len()) {
            return err(format!(
                "service {what}: pinned endpoint index out of range"
            ));
        }
    }
    if let Some(outside) = &spec.outside {
        if !spec
            .nodes
            .iter()
            .any(|n| n.name == outside.service_route_via)
        {
            return err(format!(
                "outside: service_route_via {:?} is not a node",
                outside.service_route_via
            ));
        }
        if outside.client.addr() == outside.client.host(1) || outside.client.prefix() > 30 {
            return err("outside: the client prefix must leave .1 for the router".into());
        }
    }
    Ok(())
}

/// `net.ipv4.ip_forward` → `/proc/sys/net/ipv4/ip_forward`. Keys containing
/// `/` are taken as paths below /proc/sys, so interface names with dots
/// (`net/ipv4/conf/flannel.1/rp_filter`) can be written.
fn sysctl_path(key: &str) -> Result<String> {
    let ok = !key.is_empty()
        && !key.contains("..")
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-/".contains(&b));
    if !ok || !key.starts_with("net") {
        return Err(LabError::Spec(format!(
            "sysctl {key:?}: only per-namespace net.* keys of [A-Za-z0-9._-/] are allowed"
        )));
    }
    Ok(if key.contains('/') {
        format!("/proc/sys/{key}")
    } else {
        format!("/proc/sys/{}", key.replace('.', "/"))
    })
}

fn check_value(value: &str) -> Result<()> {
    if value
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b" ._:-".contains(&b))
    {
        Ok(())
    } else {
        Err(LabError::Spec(format!(
            "sysctl value {value:?} has unexpected characters"
        )))
    }
}

/// Writes sysctls inside `ns` with one shell. The shell runs *in* the
/// namespace (setns), and /proc/sys/net resolves per namespace, so this can
/// never reach the root namespace's values.
pub(crate) fn set_sysctls(
    ns: &Netns,
    pairs: &[(String, String)],
    rp_filter_all: Option<u8>,
) -> Result<()> {
    let mut script = String::from("set -e\n");
    for (key, value) in pairs {
        check_value(value)?;
        let _ = writeln!(script, "echo '{value}' > '{}'", sysctl_path(key)?);
    }
    if let Some(v) = rp_filter_all {
        // Effective rp_filter is max(all, interface): every entry must be set.
        let _ = writeln!(
            script,
            "for f in /proc/sys/net/ipv4/conf/*/rp_filter; do echo {v} > \"$f\"; done"
        );
    }
    netns::run_checked(Some(ns), &["sh", "-c", &script], None).map(drop)
}

/// Runs iproute2 `tool` (`ip` or `bridge`) in batch mode against `ns`.
fn batch(tool: &str, ns: &Netns, commands: &str) -> Result<()> {
    netns::run_checked(
        None,
        &[tool, "-n", ns.name(), "-batch", "-"],
        Some(commands.as_bytes()),
    )
    .map(drop)
}

/// bridge-nf-call-iptables only exists once br_netfilter is loaded. Loading a
/// module is global but changes no setting of the root namespace; the value
/// itself is then written in each node namespace only.
fn ensure_br_netfilter() -> Result<()> {
    let knob = "/proc/sys/net/bridge/bridge-nf-call-iptables";
    if Path::new(knob).exists() {
        return Ok(());
    }
    netns::run_checked(None, &["modprobe", "br_netfilter"], None)?;
    if Path::new(knob).exists() {
        Ok(())
    } else {
        Err(LabError::Spec(format!(
            "modprobe br_netfilter succeeded but {knob} does not exist"
        )))
    }
}

/// Creates every namespace and link of the lab. Namespaces are registered in
/// `lab` as soon as they exist, so a failure part-way leaves nothing behind
/// once the caller drops the lab.
pub(crate) fn create(lab: &mut Lab) -> Result<()> {
    ensure_br_netfilter()?;
    let spec = lab.spec().clone();
    let vxlan = spec.overlay == Overlay::Vxlan;
    let mtu = if vxlan { VXLAN_MTU } else { 1500 };

    lab.add_netns(ROUTER)?;
    for node in &spec.nodes {
        lab.add_netns(&node.name)?;
        // A containerd node's pods get their namespaces from the CRI.
        if node.runtime == Runtime::HandWired {
            for pod in &node.pods {
                lab.add_netns(&pod.name)?;
            }
        }
    }
    if spec.outside.is_some() {
        lab.add_netns(OUTSIDE)?;
    }
    let dual = spec.is_dual_stack();
    if dual {
        topology6::prepare(lab)?;
    }

    let router = lab.netns(ROUTER)?;
    let mut cmds = format!(
        "link set lo up\nlink add underlay0 type bridge\naddr add {}/{} dev underlay0\nlink set underlay0 up\n",
        router_underlay_ip(),
        UNDERLAY.prefix()
    );
    if dual {
        topology6::router(&mut cmds);
    }
    for (i, node) in spec.nodes.iter().enumerate() {
        let _ = write!(
            cmds,
            "link add n{i} type veth peer name eth0 netns {}\nlink set n{i} master underlay0\nlink set n{i} up\n",
            lab.netns(&node.name)?.name()
        );
    }
    batch("ip", router, &cmds)?;
    let mut forward = vec![kv("net.ipv4.ip_forward", "1")];
    if dual {
        forward.push(topology6::forwarding());
    }
    set_sysctls(router, &forward, Some(0))?;

    for (i, node) in spec.nodes.iter().enumerate() {
        let ns = lab.netns(&node.name)?;
        // Before any pod link exists, so new interfaces inherit `default`.
        let flag = |on: bool| if on { "1" } else { "0" };
        let mut sysctls = vec![
            kv("net.ipv4.ip_forward", "1"),
            kv(
                "net.bridge.bridge-nf-call-iptables",
                flag(node.bridge_nf_call_iptables),
            ),
            kv(
                "net.bridge.bridge-nf-call-ip6tables",
                flag(node.bridge_nf_call_ip6tables),
            ),
        ];
        if dual {
            sysctls.push(topology6::forwarding());
        }
        set_sysctls(ns, &sysctls, Some(node.rp_filter))?;
        let mut cmds = format!(
            "link set lo up\naddr add {}/{} dev eth0\nlink set eth0 up\nroute add default via {}\n",
            node_underlay_ip(i),
            UNDERLAY.prefix(),
            router_underlay_ip(),
        );
        match (node.runtime, node.datapath) {
            // The bridge plugin makes cni0 and the veths (crate::cri).
            (Runtime::Containerd, _) => {}
            (_, Datapath::Bridge) => bridge_pods(lab, node, mtu, &mut cmds)?,
            (_, Datapath::Routed) => routed_pods(lab, node, mtu, &mut cmds)?,
        }
        topology6::node(i, node, &mut cmds);
        topology6::routed_host(node, &mut cmds);
        batch("ip", ns, &cmds)?;

        for pod in node
            .pods
            .iter()
            .filter(|_| node.runtime == Runtime::HandWired)
        {
            let mut cmds = match node.datapath {
                Datapath::Bridge => format!(
                    "link set lo up\naddr add {}/{} dev eth0\nlink set eth0 up\nroute add default via {}\n",
                    pod.ip,
                    node.pod_cidr.prefix(),
                    node.gateway()
                ),
                // Calico's container side: a /32 and a link-scope route to
                // the link-local gateway, which only proxy ARP answers.
                Datapath::Routed => format!(
                    "link set lo up\naddr add {}/32 dev eth0\nlink set eth0 up\n\
                     route add {ROUTED_GATEWAY} dev eth0 scope link\nroute add default via {ROUTED_GATEWAY} dev eth0\n",
                    pod.ip,
                ),
            };
            topology6::pod(node, pod, &mut cmds);
            batch("ip", lab.netns(&pod.name)?, &cmds)?;
        }
    }

    create_overlay(lab, &spec)?;

    let mut cmds = String::new();
    for (i, node) in spec.nodes.iter().enumerate() {
        // Like a VPC route table: each pod CIDR lives behind its node.
        let _ = writeln!(
            cmds,
            "route add {} via {}",
            node.pod_cidr.trunc(),
            node_underlay_ip(i)
        );
    }
    topology6::vpc_routes(&spec, &mut cmds);
    if let Some(outside) = &spec.outside {
        let (i, _) = spec
            .nodes
            .iter()
            .enumerate()
            .find(|(_, n)| n.name == outside.service_route_via)
            .expect("validated");
        let _ = write!(
            cmds,
            "route add {} via {}\nlink add lan0 type veth peer name eth0 netns {}\n\
             addr add {}/{} dev lan0\nlink set lan0 up\n",
            outside.service_cidr.trunc(),
            node_underlay_ip(i),
            lab.netns(OUTSIDE)?.name(),
            outside.client.host(1),
            outside.client.prefix(),
        );
        let mut client_cmds = format!(
            "link set lo up\naddr add {} dev eth0\nlink set eth0 up\nroute add default via {}\n",
            outside.client,
            outside.client.host(1)
        );
        if spec.is_dual_stack() {
            topology6::outside(&mut cmds, &mut client_cmds);
        }
        batch("ip", lab.netns(ROUTER)?, &cmds)?;
        batch("ip", lab.netns(OUTSIDE)?, &client_cmds)?;
    } else {
        batch("ip", lab.netns(ROUTER)?, &cmds)?;
    }

    for node in &spec.nodes {
        // Again now that all links exist (a moved veth does not always take
        // the namespace's `default`), then the scenario's own sysctls.
        let mut sysctls = routed_sysctls(node);
        sysctls.extend(topology6::routed_sysctls(node));
        sysctls.extend(node.sysctls.iter().cloned());
        set_sysctls(lab.netns(&node.name)?, &sysctls, Some(node.rp_filter))?;
        if node.runtime == Runtime::Containerd {
            continue;
        }
        for pod in node.pods.iter().filter(|p| !p.sysctls.is_empty()) {
            set_sysctls(lab.netns(&pod.name)?, &pod.sysctls, None)?;
        }
    }
    Ok(())
}

/// `cni0` holding the gateway, and one bridge port per pod.
fn bridge_pods(lab: &Lab, node: &NodeSpec, mtu: u32, cmds: &mut String) -> Result<()> {
    let _ = write!(
        cmds,
        "link add cni0 mtu {mtu} type bridge\naddr add {}/{} dev cni0\nlink set cni0 up\n",
        node.gateway(),
        node.pod_cidr.prefix(),
    );
    for (j, pod) in node.pods.iter().enumerate() {
        let port = host_veth(node, j);
        let _ = write!(
            cmds,
            "link add {port} mtu {mtu} type veth peer name eth0 mtu {mtu} netns {}\n\
             link set {port} master cni0\nlink set {port} type bridge_slave hairpin {}\nlink set {port} up\n",
            lab.netns(&pod.name)?.name(),
            if pod.hairpin { "on" } else { "off" },
        );
    }
    Ok(())
}

/// Calico's host side: per pod a veth without address and a /32 route to
/// the pod through it, and a blackhole for the rest of the node's block (so
/// an unassigned pod address is not sent back to the router).
fn routed_pods(lab: &Lab, node: &NodeSpec, mtu: u32, cmds: &mut String) -> Result<()> {
    for (j, pod) in node.pods.iter().enumerate() {
        let veth = host_veth(node, j);
        let _ = write!(
            cmds,
            "link add {veth} mtu {mtu} address {ROUTED_HOST_MAC} type veth peer name eth0 mtu {mtu} netns {}\n\
             link set {veth} up\nroute add {}/32 dev {veth} scope link\n",
            lab.netns(&pod.name)?.name(),
            pod.ip,
        );
    }
    let _ = writeln!(cmds, "route add blackhole {}", node.pod_cidr.trunc());
    Ok(())
}

/// What Calico's CNI plugin writes for each host veth: proxy ARP (the pod's
/// gateway 169.254.1.1 exists nowhere), answered at once (the default
/// proxy_delay holds replies back up to 0.8 s), and forwarding.
fn routed_sysctls(node: &NodeSpec) -> Vec<(String, String)> {
    if node.datapath != Datapath::Routed {
        return Vec::new();
    }
    (0..node.pods.len())
        .flat_map(|j| {
            let veth = host_veth(node, j);
            [
                kv(&format!("net.ipv4.conf.{veth}.proxy_arp"), "1"),
                kv(&format!("net.ipv4.neigh.{veth}.proxy_delay"), "0"),
                kv(&format!("net.ipv4.conf.{veth}.forwarding"), "1"),
            ]
        })
        .collect()
}

pub(crate) fn kv(k: &str, v: &str) -> (String, String) {
    (k.to_string(), v.to_string())
}

/// flannel's vxlan backend (static neighbours and fdb entries, as flanneld
/// programs them from the node annotations) or host-gw routes.
fn create_overlay(lab: &Lab, spec: &LabSpec) -> Result<()> {
    for (i, node) in spec.nodes.iter().enumerate() {
        let ns = lab.netns(&node.name)?;
        let mut cmds = String::new();
        let mut fdb = String::new();
        if spec.overlay == Overlay::Vxlan {
            let _ = write!(
                cmds,
                "link add flannel.1 address {} type vxlan id {VXLAN_ID} local {} dev eth0 dstport {VXLAN_PORT} nolearning\n\
                 addr add {}/32 dev flannel.1\nlink set flannel.1 up\n",
                vxlan_mac(i),
                node_underlay_ip(i),
                node.pod_cidr.network(),
            );
        }
        for (j, other) in spec.nodes.iter().enumerate().filter(|(j, _)| *j != i) {
            let cidr = other.pod_cidr.trunc();
            match spec.overlay {
                Overlay::Vxlan => {
                    let _ = write!(
                        cmds,
                        "route add {cidr} via {gw} dev flannel.1 onlink\nneigh add {gw} lladdr {mac} dev flannel.1 nud permanent\n",
                        gw = cidr.network(),
                        mac = vxlan_mac(j),
                    );
                    let _ = writeln!(
                        fdb,
                        "fdb append {} dev flannel.1 dst {}",
                        vxlan_mac(j),
                        node_underlay_ip(j)
                    );
                }
                Overlay::HostGw => {
                    let _ = writeln!(cmds, "route add {cidr} via {}", node_underlay_ip(j));
                }
            }
        }
        topology6::overlay(spec, i, &mut cmds, &mut fdb);
        if !cmds.is_empty() {
            batch("ip", ns, &cmds)?;
        }
        if !fdb.is_empty() {
            batch("bridge", ns, &fdb)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets;

    #[test]
    fn sysctl_keys() {
        assert_eq!(
            sysctl_path("net.bridge.bridge-nf-call-iptables").unwrap(),
            "/proc/sys/net/bridge/bridge-nf-call-iptables"
        );
        assert_eq!(
            sysctl_path("net/ipv4/conf/flannel.1/rp_filter").unwrap(),
            "/proc/sys/net/ipv4/conf/flannel.1/rp_filter"
        );
        assert!(sysctl_path("kernel.panic").is_err());
        assert!(sysctl_path("net/../kernel/panic").is_err());
        assert!(check_value("1; reboot").is_err());
    }

    #[test]
    fn host_veth_names_follow_the_cni() {
        let spec = presets::seed000(Default::default());
        assert_eq!(host_veth(&spec.nodes[0], 1), "veth1");
        let routed = spec.with_datapath(Datapath::Routed);
        // `printf default.client | sha1sum` = a7a3e029a7bc51bf…
        let name = host_veth(&routed.nodes[0], 0);
        assert_eq!(name.len(), 15, "{name}: must fit IFNAMSIZ");
        assert_eq!(name, "calia7a3e029a7b");
        assert_ne!(name, host_veth(&routed.nodes[0], 1));
    }

    #[test]
    fn presets_validate_and_bad_specs_do_not() {
        use presets::{Backend, Seed000};
        for backend in [Backend::SameNode, Backend::OtherNode] {
            let spec = presets::seed000(Seed000 {
                bridge_nf_call_iptables: false,
                backend,
            });
            validate(&spec).unwrap();
        }
        validate(&presets::dns(Default::default())).unwrap();
        validate(&presets::seed003(Default::default())).unwrap();

        let routed = presets::seed000(Default::default()).with_datapath(Datapath::Routed);
        validate(&routed).unwrap();
        assert_eq!(routed.overlay, Overlay::HostGw);

        let mut spec = presets::seed000(Default::default());
        spec.nodes[1].pods[0].name = "client".into();
        assert!(validate(&spec).is_err());
        let mut spec = presets::seed000(Default::default());
        spec.services[0].endpoints[0].pod = "nope".into();
        assert!(validate(&spec).is_err());
        let mut spec = presets::seed000(Default::default());
        spec.nodes[0].pods[0].ip = "100.96.55.3".parse().unwrap();
        assert!(validate(&spec).is_err());
    }
}
