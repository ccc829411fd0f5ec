//! Nodes whose Services are not translated by netfilter NAT: kube-proxy's
//! IPVS mode (every ClusterIP on the `kube-ipvs0` dummy device, an IPVS
//! virtual server per Service port) and eBPF load balancers (Cilium's
//! kube-proxy replacement, Calico's eBPF data plane) that pin their Service
//! maps in bpffs. There nattrace still sees the packets, but its NAT verdicts
//! would mislead, so the session and `doctor` say so. Both families: an
//! IPv6 ClusterIP sits on `kube-ipvs0` and in `/proc/net/ip_vs` like an
//! IPv4 one, and the eBPF load balancers keep one Service map per family.
//! Read-only: files and `ip -j addr show`; never loads ip_vs.
use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
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
/// Service (frontend) maps of eBPF load balancers, by name prefix, with
/// the family of the Service addresses each holds (Cilium's
/// `Service6MapV2Name`, Calico's `cali_v6_nat_fe` for IPv6).
const EBPF_LB_MAPS: &[(&str, Family, &str)] = &[
    (
        "cilium_lb4_services",
        Family::V4,
        "Cilium's kube-proxy replacement",
    ),
    (
        "cilium_lb6_services",
        Family::V6,
        "Cilium's kube-proxy replacement",
    ),
    ("cali_v4_nat_fe", Family::V4, "Calico's eBPF data plane"),
    ("cali_v6_nat_fe", Family::V6, "Calico's eBPF data plane"),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}

impl Family {
    fn of(ip: IpAddr) -> Family {
        if ip.is_ipv4() { Family::V4 } else { Family::V6 }
    }
}

/// What besides netfilter may load-balance Services on this node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Dataplane {
    /// Addresses on `kube-ipvs0` (IPv6 link-local ones aside: the kernel
    /// gives every device one, no Service has it); None when the device
    /// does not exist.
    pub ipvs_device: Option<Vec<IpAddr>>,
    /// IPVS virtual servers (protocol, address) from `/proc/net/ip_vs`, which
    /// exists only when ip_vs is loaded.
    pub ipvs_services: Vec<(String, SocketAddr)>,
    /// Pinned eBPF load-balancer maps (file names).
    pub ebpf_lb_maps: Vec<String>,
}

/// Parses `/proc/net/ip_vs`: `TCP  0A600001:0050 rr` lines for IPv4 (hex
/// address and port), `TCP  [fd00:10:96::1]:0050 rr` for IPv6
/// (net/netfilter/ipvs/ip_vs_ctl.c `ip_vs_info_seq_show`: `%08X:%04X` and
/// `[%pI6]:%04X`); the `  -> RemoteAddress:Port` lines are real servers.
pub fn parse_ip_vs(text: &str) -> Vec<(String, SocketAddr)> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let proto = w.next()?;
            if !matches!(proto, "TCP" | "UDP" | "SCTP") {
                return None;
            }
            let (ip, port) = w.next()?.rsplit_once(':')?;
            let ip = match ip.strip_prefix('[') {
                Some(v6) => IpAddr::V6(v6.strip_suffix(']')?.parse::<Ipv6Addr>().ok()?),
                None => IpAddr::V4(Ipv4Addr::from(u32::from_str_radix(ip, 16).ok()?)),
            };
            let port = u16::from_str_radix(port, 16).ok()?;
            Some((proto.to_ascii_lowercase(), SocketAddr::new(ip, port)))
        })
        .collect()
}

/// `ip -j addr show dev kube-ipvs0` → its addresses, IPv6 link-local aside.
fn parse_ip_addr_json(json: &str) -> Option<Vec<IpAddr>> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    let links = v.as_array()?;
    let link = links.first()?;
    Some(
        link["addr_info"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a["local"].as_str()?.parse().ok())
            .filter(|a: &IpAddr| !matches!(a, IpAddr::V6(v6) if v6.is_unicast_link_local()))
            .collect(),
    )
}

impl Dataplane {
    /// Reads the facts of `ns`.
    pub fn detect(ns: &Netns) -> Dataplane {
        let (ipvs_device, ipvs_services) = ns
            .run(|| {
                let device = Command::new("ip")
                    .args(["-j", "addr", "show", "dev", IPVS_DEVICE])
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

    fn ipvs_carries(&self, ip: IpAddr) -> bool {
        self.ipvs_device.iter().flatten().any(|a| *a == ip)
            || self.ipvs_services.iter().any(|(_, s)| s.ip() == ip)
    }

    /// The pinned load-balancer maps (of one family, or all).
    fn lb_maps(&self, family: Option<Family>) -> Vec<&str> {
        self.ebpf_lb_maps
            .iter()
            .filter(|m| {
                EBPF_LB_MAPS
                    .iter()
                    .any(|(p, f, _)| m.starts_with(p) && family.is_none_or(|x| x == *f))
            })
            .map(String::as_str)
            .collect()
    }

    /// Who load-balances with the first of those maps.
    fn ebpf_owner(&self, family: Option<Family>) -> Option<&'static str> {
        let maps = self.lb_maps(family);
        EBPF_LB_MAPS
            .iter()
            .find(|(prefix, f, _)| {
                family.is_none_or(|x| x == *f) && maps.iter().any(|m| m.starts_with(prefix))
            })
            .map(|(_, _, who)| *who)
    }

    /// Who translates Service `ip` instead of netfilter NAT, when kube-proxy
    /// has no NAT rule for it here. None: netfilter does (or nothing claims it).
    pub fn not_netfilter(&self, ip: IpAddr, kube: &KubeProxyRules) -> Option<String> {
        let has_nat_rule = kube.services.iter().any(|s| s.cluster_ip == ip)
            || kube.no_endpoints.iter().any(|r| r.ip == ip);
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
                .filter(|(_, s)| s.ip() == ip)
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
        let family = Some(Family::of(ip));
        self.ebpf_owner(family).map(|who| {
            format!(
                "an eBPF load balancer ({who}: {} pinned in {BPF_GLOBALS})",
                self.lb_maps(family).join(", ")
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
        self.ebpf_owner(None).map(|who| {
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
        .filter(|n| EBPF_LB_MAPS.iter().any(|(p, _, _)| n.starts_with(p)))
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
        let kube = parse_nat(include_str!(crate::fixture!("ruleset/lab_nat.txt")));
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

    /// A dual-stack IPVS node: `/proc/net/ip_vs` with an IPv6 virtual
    /// server beside the IPv4 ones (kernel format `[%pI6]:%04X`).
    const IP_VS6: &str = "IP Virtual Server version 1.2.1 (size=4096)\n\
        Prot LocalAddress:Port Scheduler Flags\n  -> RemoteAddress:Port Forward Weight ActiveConn InActConn\n\
        TCP  0A600001:01BB rr\n  -> AC120002:192B      Masq    1      0          0\n\
        TCP  [fd00:10:96::1]:01BB rr\n  -> [fd00:10:244::2]:192B      Masq    1      0          0\n";

    #[test]
    fn ipv6_virtual_servers_and_kube_ipvs0_addresses_are_read() {
        assert_eq!(
            parse_ip_vs(IP_VS6),
            vec![
                ("tcp".into(), "10.96.0.1:443".parse().unwrap()),
                ("tcp".into(), "[fd00:10:96::1]:443".parse().unwrap()),
            ]
        );
        // `ip -j addr show dev kube-ipvs0` on a dual-stack node: the
        // kernel's link-local address on the device is no Service.
        let json = r#"[{"ifindex":5,"ifname":"kube-ipvs0","addr_info":[{"family":"inet","local":"10.96.0.1","prefixlen":32},{"family":"inet6","local":"fd00:10:96::1","prefixlen":128},{"family":"inet6","local":"fe80::a0b1:c2ff:fed3:e4f5","prefixlen":64}]}]"#;
        assert_eq!(
            parse_ip_addr_json(json),
            Some(vec![
                "10.96.0.1".parse().unwrap(),
                "fd00:10:96::1".parse().unwrap()
            ])
        );
    }

    #[test]
    fn an_ipv6_service_on_kube_ipvs0_is_ipvs() {
        let d = Dataplane {
            ipvs_device: Some(vec!["fd00:10:96::1".parse().unwrap()]),
            ipvs_services: parse_ip_vs(IP_VS6),
            ebpf_lb_maps: Vec::new(),
        };
        let none = KubeProxyRules::default();
        assert_eq!(
            d.not_netfilter("fd00:10:96::1".parse().unwrap(), &none)
                .as_deref(),
            Some(
                "IPVS (kube-proxy --proxy-mode=ipvs: kube-ipvs0 holds fd00:10:96::1, 1 IPVS virtual server(s) for fd00:10:96::1)"
            )
        );
        // An IPv6 address on neither: not IPVS's.
        assert_eq!(
            d.not_netfilter("fd00:10:96::2".parse().unwrap(), &none),
            None
        );
    }

    #[test]
    fn ebpf_service_maps_count_for_their_own_family() {
        let v6_nat =
            crate::ruleset::parse_save(include_str!(crate::fixture!("ruleset/lab_node6.txt")));
        let svc6: IpAddr = "fd00:10:96::1e85".parse().unwrap();
        assert!(v6_nat.services.iter().any(|s| s.cluster_ip == svc6));
        let other6: IpAddr = "fd00:10:96::1".parse().unwrap();
        // An IPv4-only Cilium: IPv6 Services are not its.
        let v4_only = Dataplane {
            ebpf_lb_maps: vec!["cilium_lb4_services_v2".into()],
            ..Dataplane::default()
        };
        assert_eq!(v4_only.not_netfilter(other6, &v6_nat), None);
        assert!(
            v4_only
                .not_netfilter("10.96.0.1".parse().unwrap(), &v6_nat)
                .is_some()
        );
        // Dual-stack Calico eBPF: an IPv6 address kube-proxy does not NAT is
        // its, named by its IPv6 map only; one kube-proxy NATs is not.
        let dual = Dataplane {
            ebpf_lb_maps: vec!["cali_v4_nat_fe3".into(), "cali_v6_nat_fe3".into()],
            ..Dataplane::default()
        };
        let why = dual.not_netfilter(other6, &v6_nat).unwrap();
        assert_eq!(
            why,
            "an eBPF load balancer (Calico's eBPF data plane: cali_v6_nat_fe3 pinned in /sys/fs/bpf/tc/globals)"
        );
        assert_eq!(dual.not_netfilter(svc6, &v6_nat), None);
        let v4 = dual
            .not_netfilter("10.96.0.1".parse().unwrap(), &v6_nat)
            .unwrap();
        assert!(v4.contains("cali_v4_nat_fe3") && !v4.contains("v6"), "{v4}");
        // An IPv6-only Cilium is found by `doctor` too.
        let v6_only = Dataplane {
            ebpf_lb_maps: vec!["cilium_lb6_services_v2".into()],
            ..Dataplane::default()
        };
        assert_eq!(v6_only.summary().unwrap().0, "ebpf");
    }
}
