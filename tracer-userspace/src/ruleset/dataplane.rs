//! Nodes whose Services are not translated by netfilter NAT: kube-proxy's
//! IPVS mode (every ClusterIP on the `kube-ipvs0` dummy device, an IPVS
//! virtual server per Service port) and eBPF load balancers (Cilium's
//! kube-proxy replacement, Calico's eBPF data plane) that pin their Service
//! maps in bpffs. There nattrace still sees the packets, but its NAT verdicts
//! would mislead, so the session and `doctor` say so. Read-only: files and
//! `ip -j addr show`; never loads ip_vs.
use std::{
    net::{IpAddr, Ipv4Addr, SocketAddrV4},
    path::Path,
    process::Command,
};

use serde::Serialize;

use super::{KubeProxyRules, ProxyMode};
use crate::probes::netns::Netns;

/// kube-proxy's IPVS mode binds every Service address to this dummy device.
pub const IPVS_DEVICE: &str = "kube-ipvs0";
/// Where tc programs (Cilium, Calico eBPF) pin their maps.
const BPF_GLOBALS: &str = "/sys/fs/bpf/tc/globals";
/// Service (frontend) maps of eBPF load balancers, by name prefix.
const EBPF_LB_MAPS: &[(&str, &str)] = &[
    ("cilium_lb4_services", "Cilium's kube-proxy replacement"),
    ("cali_v4_nat_fe", "Calico's eBPF data plane"),
];

/// What besides netfilter may load-balance Services on this node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Dataplane {
    /// IPv4 addresses on `kube-ipvs0`; None when the device does not exist.
    pub ipvs_device: Option<Vec<Ipv4Addr>>,
    /// IPVS virtual servers (protocol, address) from `/proc/net/ip_vs`, which
    /// exists only when ip_vs is loaded.
    pub ipvs_services: Vec<(String, SocketAddrV4)>,
    /// Pinned eBPF load-balancer maps (file names).
    pub ebpf_lb_maps: Vec<String>,
}

/// Parses `/proc/net/ip_vs`: `TCP  0A600001:0050 rr` lines (hex address and
/// port, net/netfilter/ipvs/ip_vs_ctl.c `ip_vs_info_seq_show`); the
/// `  -> RemoteAddress:Port` lines are real servers.
pub fn parse_ip_vs(text: &str) -> Vec<(String, SocketAddrV4)> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let proto = w.next()?;
            if !matches!(proto, "TCP" | "UDP" | "SCTP") {
                return None;
            }
            let (ip, port) = w.next()?.split_once(':')?;
            let ip = Ipv4Addr::from(u32::from_str_radix(ip, 16).ok()?);
            let port = u16::from_str_radix(port, 16).ok()?;
            Some((proto.to_ascii_lowercase(), SocketAddrV4::new(ip, port)))
        })
        .collect()
}

/// `ip -j -4 addr show dev kube-ipvs0` → its addresses.
fn parse_ip_addr_json(json: &str) -> Option<Vec<Ipv4Addr>> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    let links = v.as_array()?;
    let link = links.first()?;
    Some(
        link["addr_info"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a["local"].as_str()?.parse().ok())
            .collect(),
    )
}

impl Dataplane {
    /// Reads the facts of `ns`.
    pub fn detect(ns: &Netns) -> Dataplane {
        let (ipvs_device, ipvs_services) = ns
            .run(|| {
                let device = Command::new("ip")
                    .args(["-j", "-4", "addr", "show", "dev", IPVS_DEVICE])
                    // Not /dev/null, which a bare container root lacks (ruleset::run_in).
                    .stdin(std::process::Stdio::piped())
                    .output()
                    .ok()
                    .filter(|o| o.status.success())
                    .and_then(|o| parse_ip_addr_json(&String::from_utf8_lossy(&o.stdout)));
                // /proc/net is /proc/self/net, the netns of the thread-group
                // leader (fs/proc/proc_net.c get_proc_task_net looks up the
                // task of the pid directory); only thread-self shows the
                // namespace this thread entered.
                let services = std::fs::read_to_string("/proc/thread-self/net/ip_vs")
                    .map(|t| parse_ip_vs(&t))
                    .unwrap_or_default();
                (device, services)
            })
            .unwrap_or_default();
        Dataplane {
            ipvs_device,
            ipvs_services,
            ebpf_lb_maps: ebpf_maps(&crate::host::node_path(BPF_GLOBALS)),
        }
    }

    fn ipvs_carries(&self, ip: Ipv4Addr) -> bool {
        self.ipvs_device.iter().flatten().any(|a| *a == ip)
            || self.ipvs_services.iter().any(|(_, s)| *s.ip() == ip)
    }

    fn ebpf_owner(&self) -> Option<&'static str> {
        EBPF_LB_MAPS
            .iter()
            .find(|(prefix, _)| self.ebpf_lb_maps.iter().any(|m| m.starts_with(prefix)))
            .map(|(_, who)| *who)
    }

    /// Who translates Service `ip` instead of netfilter NAT, when kube-proxy
    /// has no NAT rule for it here. None: netfilter does (or nothing claims it).
    pub fn not_netfilter(&self, ip: Ipv4Addr, kube: &KubeProxyRules) -> Option<String> {
        let has_nat_rule = kube.services.iter().any(|s| s.cluster_ip == IpAddr::V4(ip))
            || kube.no_endpoints.iter().any(|r| r.ip == IpAddr::V4(ip));
        if has_nat_rule && kube.mode != ProxyMode::Ipvs {
            return None;
        }
        if self.ipvs_carries(ip) || (kube.mode == ProxyMode::Ipvs && self.ipvs_device.is_some()) {
            let mut why = Vec::new();
            if self.ipvs_device.iter().flatten().any(|a| *a == ip) {
                why.push(format!("{IPVS_DEVICE} holds {ip}"));
            }
            let servers = self
                .ipvs_services
                .iter()
                .filter(|(_, s)| *s.ip() == ip)
                .count();
            if servers > 0 {
                why.push(format!("{servers} IPVS virtual server(s) for {ip}"));
            }
            if why.is_empty() {
                why.push("kube-proxy's nat table is in IPVS mode".into());
            }
            return Some(format!(
                "IPVS (kube-proxy --proxy-mode=ipvs: {})",
                why.join(", ")
            ));
        }
        self.ebpf_owner().map(|who| {
            format!(
                "an eBPF load balancer ({who}: {} pinned in {BPF_GLOBALS})",
                self.ebpf_lb_maps.join(", ")
            )
        })
    }

    /// For `doctor`, which traces no particular IP: whether this node
    /// load-balances Services outside netfilter at all.
    pub fn summary(&self) -> Option<(&'static str, String)> {
        if let Some(ips) = &self.ipvs_device {
            return Some((
                "ipvs",
                format!(
                    "IPVS load-balances Services here ({IPVS_DEVICE} holds {} address(es), {} IPVS virtual server(s) visible)",
                    ips.len(),
                    self.ipvs_services.len()
                ),
            ));
        }
        if !self.ipvs_services.is_empty() {
            return Some((
                "ipvs",
                format!(
                    "IPVS load-balances Services here ({} IPVS virtual server(s))",
                    self.ipvs_services.len()
                ),
            ));
        }
        self.ebpf_owner().map(|who| {
            (
                "ebpf",
                format!(
                    "an eBPF load balancer translates Services here ({who}: {} pinned in {BPF_GLOBALS})",
                    self.ebpf_lb_maps.join(", ")
                ),
            )
        })
    }
}

fn ebpf_maps(dir: &Path) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| EBPF_LB_MAPS.iter().any(|(p, _)| n.starts_with(p)))
        .collect();
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ruleset::parse_nat;

    /// `/proc/net/ip_vs` with two Services (10.96.0.1:443, 10.96.0.10:53/udp).
    const IP_VS: &str = "IP Virtual Server version 1.2.1 (size=4096)\n\
        Prot LocalAddress:Port Scheduler Flags\n  -> RemoteAddress:Port Forward Weight ActiveConn InActConn\n\
        TCP  0A600001:01BB rr\n  -> AC120002:192B      Masq    1      0          0\n\
        UDP  0A60000A:0035 rr\n  -> 0AF40002:0035      Masq    1      0          0\n";

    #[test]
    fn ip_vs_virtual_servers_are_parsed() {
        assert_eq!(
            parse_ip_vs(IP_VS),
            vec![
                ("tcp".into(), "10.96.0.1:443".parse().unwrap()),
                ("udp".into(), "10.96.0.10:53".parse().unwrap()),
            ]
        );
    }

    #[test]
    fn kube_ipvs0_addresses_from_ip_json() {
        let json = r#"[{"ifindex":5,"ifname":"kube-ipvs0","flags":["BROADCAST","NOARP"],"addr_info":[{"family":"inet","local":"10.96.0.1","prefixlen":32},{"family":"inet","local":"10.96.0.10","prefixlen":32}]}]"#;
        assert_eq!(
            parse_ip_addr_json(json),
            Some(vec![
                "10.96.0.1".parse().unwrap(),
                "10.96.0.10".parse().unwrap()
            ])
        );
        assert_eq!(parse_ip_addr_json("[]"), None);
    }

    #[test]
    fn services_with_kube_proxy_nat_rules_are_netfilter() {
        let kube = parse_nat(include_str!("fixtures/lab_nat.txt"));
        let d = Dataplane {
            ebpf_lb_maps: vec!["cilium_lb4_services_v2".into()],
            ..Dataplane::default()
        };
        // kube-proxy DNATs it: netfilter, whatever else is pinned.
        assert_eq!(
            d.not_netfilter("100.67.30.133".parse().unwrap(), &kube),
            None
        );
        // An address kube-proxy does not know, with Cilium's maps pinned.
        let other = d
            .not_netfilter("10.96.0.1".parse().unwrap(), &kube)
            .unwrap();
        assert!(
            other.contains("Cilium") && other.contains("cilium_lb4_services_v2"),
            "{other}"
        );
        assert_eq!(d.summary().unwrap().0, "ebpf");
    }

    /// Only the load-balancer maps count, whatever else is pinned beside them.
    #[test]
    fn pinned_lb_maps_are_found_by_name() {
        let dir = std::env::temp_dir().join(format!("nattrace-bpffs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for name in [
            "cilium_lb4_services_v2",
            "cilium_ct4_global",
            "cali_v4_nat_fe3",
        ] {
            std::fs::write(dir.join(name), b"").unwrap();
        }
        let found = ebpf_maps(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(found, vec!["cali_v4_nat_fe3", "cilium_lb4_services_v2"]);
        assert!(ebpf_maps(Path::new("/nonexistent/bpffs")).is_empty());
    }

    #[test]
    fn ipvs_is_named_by_device_and_virtual_servers() {
        let d = Dataplane {
            ipvs_device: Some(vec!["10.96.0.1".parse().unwrap()]),
            ipvs_services: parse_ip_vs(IP_VS),
            ebpf_lb_maps: Vec::new(),
        };
        let none = KubeProxyRules::default();
        let why = d
            .not_netfilter("10.96.0.1".parse().unwrap(), &none)
            .unwrap();
        assert_eq!(
            why,
            "IPVS (kube-proxy --proxy-mode=ipvs: kube-ipvs0 holds 10.96.0.1, 1 IPVS virtual server(s) for 10.96.0.1)"
        );
        assert!(
            d.not_netfilter("10.1.2.3".parse().unwrap(), &none)
                .is_none()
        );
        let (kind, text) = d.summary().unwrap();
        assert_eq!(kind, "ipvs");
        assert!(
            text.contains("kube-ipvs0 holds 1 address(es), 2 IPVS virtual server(s)"),
            "{text}"
        );
        assert_eq!(Dataplane::default().summary(), None);
    }
}
