//! kube-proxy's iptables-mode rules for ClusterIP Services, rendered in
//! `iptables-restore` format the way `iptables-save` shows what kube-proxy
//! (1.2x/1.3x) wrote, so the tracer sees the chain names, comments and match
//! order of a real node. [`render_node`] adds kube-proxy's filter table,
//! kubelet's chains, the canaries and the CNI's chains (`node`, `cni`).

mod cni;
mod node;

pub use node::{NodeNet, NodeNet6, render_node, render_node6};

use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};

use sha2::{Digest, Sha256};

use crate::spec::{KubeProxyConfig, Protocol};

/// `KUBE-SVL-<hash>`: kube-proxy's `serviceLocalChainName` (same hash as
/// the Service's `KUBE-SVC-` chain).
pub fn svl_chain(port_name: &str, protocol: Protocol) -> String {
    svc_chain(port_name, protocol).replacen("KUBE-SVC-", "KUBE-SVL-", 1)
}

/// kube-proxy's `KUBE-MARK-MASQ` mark bit.
pub const MASQ_MARK: &str = "0x4000/0x4000";

/// A Service port with its endpoints resolved to addresses.
#[derive(Clone, Debug)]
pub struct ResolvedService {
    /// `ns/name:port`.
    pub port_name: String,
    /// ClusterIP (an IPv6 one for the IPv6 proxier's rules).
    pub cluster_ip: IpAddr,
    /// Service port.
    pub port: u16,
    /// TCP or UDP.
    pub protocol: Protocol,
    /// `(ip, target port)` in kube-proxy's order, of the ClusterIP's family.
    pub endpoints: Vec<(IpAddr, u16)>,
    /// See [`crate::ServiceSpec::pinned`].
    pub pinned: Option<usize>,
    /// See [`crate::ServiceSpec::node_port`].
    pub node_port: Option<u16>,
    /// See [`crate::ServiceSpec::external`].
    pub external: crate::spec::ExternalSpec,
    /// Per endpoint: on the node these rules are for (Local policy).
    pub local: Vec<bool>,
}

/// `KUBE-SVC-<hash>`: kube-proxy's `servicePortChainName`.
pub fn svc_chain(port_name: &str, protocol: Protocol) -> String {
    format!(
        "KUBE-SVC-{}",
        hash16(&format!("{port_name}{}", protocol.as_str()))
    )
}

/// `KUBE-EXT-<hash>`: kube-proxy's `serviceExternalChainName` (same hash
/// as the Service's `KUBE-SVC-` chain).
pub fn ext_chain(port_name: &str, protocol: Protocol) -> String {
    svc_chain(port_name, protocol).replacen("KUBE-SVC-", "KUBE-EXT-", 1)
}

/// `KUBE-SEP-<hash>`: kube-proxy's `servicePortEndpointChainName`
/// (`endpoint` is `ip:port`).
pub fn sep_chain(port_name: &str, protocol: Protocol, endpoint: &str) -> String {
    format!(
        "KUBE-SEP-{}",
        hash16(&format!("{port_name}{}{endpoint}", protocol.as_str()))
    )
}

/// First 16 characters of base32(sha256(s)), as kube-proxy names its chains.
fn hash16(s: &str) -> String {
    let digest = Sha256::digest(s.as_bytes());
    base32_std(&digest)[..16].to_string()
}

/// RFC 4648 base32 (Go's `base32.StdEncoding`); padding is irrelevant since
/// only a prefix is used.
pub(crate) fn base32_std(data: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut out = String::with_capacity(data.len().div_ceil(5) * 8);
    let (mut buffer, mut bits) = (0u32, 0u32);
    for &byte in data {
        buffer = (buffer << 8) | u32::from(byte);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(ALPHABET[((buffer >> bits) & 31) as usize] as char);
        }
    }
    if bits > 0 {
        out.push(ALPHABET[((buffer << (5 - bits)) & 31) as usize] as char);
    }
    out
}

/// The `--probability` of endpoint `i` of `n`: kube-proxy's `1/(n-i)` with
/// `%0.10f`, or 0/1 around a pinned endpoint.
fn probability(i: usize, n: usize, pinned: Option<usize>) -> String {
    let p = match pinned {
        Some(k) if i < k => 0.0,
        Some(k) if i == k => 1.0,
        _ => 1.0 / (n - i) as f64,
    };
    format!("{p:.10}")
}

/// One table of an `iptables-restore` input, printed the way `iptables-save`
/// prints it: rules of the built-in chains first (in hook order), then the
/// user chains sorted by name, each chain's rules in the order they were
/// added. Only user chains are declared: with iptables-nft a built-in chain
/// (and so a netfilter hook) exists only once a rule is added to it, as when
/// kube-proxy, kubelet and the CNI add their jumps with `iptables -I/-A`.
#[derive(Debug)]
pub struct Table {
    name: &'static str,
    builtins: &'static [&'static str],
    chains: std::collections::BTreeSet<String>,
    rules: Vec<(String, String)>,
}

impl Table {
    /// An empty table; `name` is `filter`, `nat`, `mangle` or `raw`.
    pub fn new(name: &'static str) -> Table {
        let builtins: &'static [&'static str] = match name {
            "nat" => &["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"],
            "filter" => &["INPUT", "FORWARD", "OUTPUT"],
            "raw" => &["PREROUTING", "OUTPUT"],
            _ => &["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"],
        };
        Table {
            name,
            builtins,
            chains: Default::default(),
            rules: Vec::new(),
        }
    }

    /// Declares a user chain (idempotent).
    pub fn chain(&mut self, name: &str) {
        self.chains.insert(name.to_string());
    }

    /// Appends `-A chain rest` (`rest` starts with the matches).
    pub fn rule(&mut self, chain: &str, rest: &str) {
        self.rules.push((chain.to_string(), rest.to_string()));
    }

    /// Whether the table has anything to write.
    pub fn is_empty(&self) -> bool {
        self.chains.is_empty() && self.rules.is_empty()
    }

    /// The table in `iptables-restore` format, `*name` to `COMMIT`.
    pub fn render(&self) -> String {
        let mut out = format!("*{}\n", self.name);
        for chain in &self.chains {
            let _ = writeln!(out, ":{chain} - [0:0]");
        }
        let order = self
            .builtins
            .iter()
            .map(|b| b.to_string())
            .chain(self.chains.iter().cloned());
        for chain in order {
            for (_, rest) in self.rules.iter().filter(|(c, _)| *c == chain) {
                let _ = writeln!(out, "-A {chain} {rest}");
            }
        }
        out.push_str("COMMIT\n");
        out
    }
}

/// `ip/32` or `ip/128`, as iptables-save prints a host address.
pub(crate) fn host_cidr(ip: IpAddr) -> String {
    format!("{ip}/{}", if ip.is_ipv6() { 128 } else { 32 })
}

/// kube-proxy's endpoint string (Go's `net.JoinHostPort`): `ip:port`,
/// `[ip6]:port`. It names `KUBE-SEP-` chains and `--to-destination`.
pub(crate) fn endpoint_string(ip: IpAddr, port: u16) -> String {
    SocketAddr::new(ip, port).to_string()
}

/// kube-proxy's nat chains and rules (without the node's other writers).
pub(crate) fn nat_table(config: &KubeProxyConfig, services: &[ResolvedService]) -> Table {
    let cidr = config.cluster_cidr.map(|c| c.trunc().to_string());
    nat_table_for(config, services, cidr, false)
}

/// [`nat_table`] for one family's proxier: `cluster_cidr` is that family's
/// `--cluster-cidr`; `v6` selects the IPv6 proxier's differences.
pub(crate) fn nat_table_for(
    config: &KubeProxyConfig,
    services: &[ResolvedService],
    cluster_cidr: Option<String>,
    v6: bool,
) -> Table {
    let mut t = Table::new("nat");
    for chain in [
        "KUBE-MARK-MASQ",
        "KUBE-NODEPORTS",
        "KUBE-POSTROUTING",
        "KUBE-SERVICES",
    ] {
        t.chain(chain);
    }
    t.rule(
        "PREROUTING",
        r#"-m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#,
    );
    t.rule(
        "OUTPUT",
        r#"-m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#,
    );
    t.rule(
        "POSTROUTING",
        r#"-m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING"#,
    );
    t.rule(
        "KUBE-MARK-MASQ",
        &format!("-j MARK --set-xmark {MASQ_MARK}"),
    );
    t.rule(
        "KUBE-POSTROUTING",
        &format!("-m mark ! --mark {MASQ_MARK} -j RETURN"),
    );
    // Clears the bit so a packet re-entering the stack (e.g. after vxlan
    // encapsulation) is not masqueraded twice.
    t.rule("KUBE-POSTROUTING", "-j MARK --set-xmark 0x4000/0x0");
    t.rule(
        "KUBE-POSTROUTING",
        r#"-m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully"#,
    );

    // Services without endpoints get no nat rules at all: kube-proxy
    // REJECTs them in the filter table (see `node::filter_table`).
    for svc in services.iter().filter(|s| !s.endpoints.is_empty()) {
        let proto = svc.protocol.as_str();
        let name = &svc.port_name;
        let svc_chain = svc_chain(name, svc.protocol);
        t.chain(&svc_chain);
        let cluster_ip_match = format!(
            r#"-d {} -p {proto} -m comment --comment "{name} cluster IP" -m {proto} --dport {}"#,
            host_cidr(svc.cluster_ip),
            svc.port
        );
        t.rule(
            "KUBE-SERVICES",
            &format!("{cluster_ip_match} -j {svc_chain}"),
        );

        if config.masquerade_all {
            t.rule(&svc_chain, &format!("{cluster_ip_match} -j KUBE-MARK-MASQ"));
        } else if let Some(cidr) = &cluster_cidr {
            t.rule(
                &svc_chain,
                &format!("! -s {cidr} {cluster_ip_match} -j KUBE-MARK-MASQ"),
            );
        }

        external_nat(&mut t, svc, &svc_chain, cluster_cidr.as_deref());
        let n = svc.endpoints.len();
        for (i, (ip, port)) in svc.endpoints.iter().enumerate() {
            let endpoint = endpoint_string(*ip, *port);
            let sep = sep_chain(name, svc.protocol, &endpoint);
            t.chain(&sep);
            let comment = format!(r#"-m comment --comment "{name} -> {endpoint}""#);
            if i + 1 < n {
                t.rule(
                    &svc_chain,
                    &format!(
                        "{comment} -m statistic --mode random --probability {} -j {sep}",
                        probability(i, n, svc.pinned)
                    ),
                );
            } else {
                t.rule(&svc_chain, &format!("{comment} -j {sep}"));
            }
            // Hairpin: a pod reaching itself through its Service must be
            // SNATed, or its reply would never come back through the node.
            if !config.omit_hairpin_masquerade {
                t.rule(
                    &sep,
                    &format!(
                        r#"-s {} -m comment --comment "{name}" -j KUBE-MARK-MASQ"#,
                        host_cidr(*ip)
                    ),
                );
            }
            t.rule(
                &sep,
                &format!(
                    r#"-p {proto} -m comment --comment "{name}" -m {proto} -j DNAT --to-destination {endpoint}"#
                ),
            );
        }
    }
    // kube-proxy always ends KUBE-SERVICES with the NodePort jump; the IPv6
    // proxier excludes ::1, where NodePorts never work (proxier.go:
    // `if isIPv6 { destinations = append(destinations, "!", "-d", "::1/128") }`).
    let not_loopback = if v6 { "! -d ::1/128 " } else { "" };
    t.rule("KUBE-SERVICES", &format!(r#"{not_loopback}-m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"#));
    t
}

/// NodePort, LoadBalancer and external IP capture and the `KUBE-EXT-`
/// chain (pkg/proxy/iptables/proxier.go): Cluster policy masquerades and
/// goes on to `KUBE-SVC-`; Local policy short-circuits pod and node traffic
/// to `KUBE-SVC-` and sends the rest to `KUBE-SVL-` (this node's endpoints),
/// or nowhere when there is none here (the filter table DROPs it then).
fn external_nat(t: &mut Table, svc: &ResolvedService, svc_chain: &str, cluster_cidr: Option<&str>) {
    let ext_spec = &svc.external;
    if svc.node_port.is_none() && ext_spec.external_ips.is_empty() && ext_spec.lb_ips.is_empty() {
        return;
    }
    let proto = svc.protocol.as_str();
    let name = &svc.port_name;
    let ext = ext_chain(name, svc.protocol);
    t.chain(&ext);
    for (ips, what) in [
        (&ext_spec.external_ips, "external IP"),
        (&ext_spec.lb_ips, "loadbalancer IP"),
    ] {
        for ip in ips {
            t.rule(
                "KUBE-SERVICES",
                &format!(
                    r#"-d {}/32 -p {proto} -m comment --comment "{name} {what}" -m {proto} --dport {} -j {ext}"#,
                    ip, svc.port
                ),
            );
        }
    }
    if let Some(node_port) = svc.node_port {
        t.rule(
            "KUBE-NODEPORTS",
            &format!(
                r#"-p {proto} -m comment --comment "{name}" -m {proto} --dport {node_port} -j {ext}"#
            ),
        );
    }
    if !ext_spec.local_policy {
        // externalTrafficPolicy: Cluster — traffic from outside is
        // masqueraded, then load-balanced like the ClusterIP.
        t.rule(
            &ext,
            &format!(
                r#"-m comment --comment "masquerade traffic for {name} external destinations" -j KUBE-MARK-MASQ"#
            ),
        );
        t.rule(&ext, &format!("-j {svc_chain}"));
        return;
    }
    if let Some(cidr) = cluster_cidr {
        t.rule(
            &ext,
            &format!(
                r#"-s {cidr} -m comment --comment "pod traffic for {name} external destinations" -j {svc_chain}"#
            ),
        );
    }
    t.rule(
        &ext,
        &format!(
            r#"-m comment --comment "masquerade LOCAL traffic for {name} external destinations" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ"#
        ),
    );
    t.rule(
        &ext,
        &format!(
            r#"-m comment --comment "route LOCAL traffic for {name} external destinations" -m addrtype --src-type LOCAL -j {svc_chain}"#
        ),
    );
    let local: Vec<usize> = (0..svc.endpoints.len())
        .filter(|i| svc.local.get(*i).copied().unwrap_or(false))
        .collect();
    if local.is_empty() {
        return;
    }
    let svl = svl_chain(name, svc.protocol);
    t.chain(&svl);
    t.rule(&ext, &format!("-j {svl}"));
    let n = local.len();
    for (k, &i) in local.iter().enumerate() {
        let (ip, port) = svc.endpoints[i];
        let endpoint = endpoint_string(ip, port);
        let sep = sep_chain(name, svc.protocol, &endpoint);
        let comment = format!(r#"-m comment --comment "{name} -> {endpoint}""#);
        if k + 1 < n {
            t.rule(
                &svl,
                &format!(
                    "{comment} -m statistic --mode random --probability {} -j {sep}",
                    probability(k, n, None)
                ),
            );
        } else {
            t.rule(&svl, &format!("{comment} -j {sep}"));
        }
    }
}

/// kube-proxy's own `*nat` table for `iptables-restore`, in `iptables-save` order.
pub fn render_nat(config: &KubeProxyConfig, services: &[ResolvedService]) -> String {
    nat_table(config, services).render()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cidr::cidr;

    #[test]
    fn chain_names_match_real_kube_proxy() {
        // Chain names seen on every real cluster.
        assert_eq!(
            svc_chain("kube-system/kube-dns:dns", Protocol::Udp),
            "KUBE-SVC-TCOU7JCQXEZGVUNU"
        );
        assert_eq!(
            svc_chain("kube-system/kube-dns:dns-tcp", Protocol::Tcp),
            "KUBE-SVC-ERIFXISQEP7F7OF4"
        );
        assert_eq!(
            svc_chain("default/kubernetes:https", Protocol::Tcp),
            "KUBE-SVC-NPX46M4PTMTKRN6Y"
        );
        assert!(sep_chain("default/web:http", Protocol::Tcp, "100.96.54.247:80").len() == 25);
    }

    #[test]
    fn ext_chain_shares_the_service_hash() {
        // From a real node's iptables-save (an unnamed port prints no `:port`).
        assert_eq!(
            svc_chain("default/jtest", Protocol::Tcp),
            "KUBE-SVC-FXJ34XFJ55FJZHFP"
        );
        assert_eq!(
            ext_chain("default/jtest", Protocol::Tcp),
            "KUBE-EXT-FXJ34XFJ55FJZHFP"
        );
    }

    #[test]
    fn base32_matches_rfc4648() {
        assert_eq!(base32_std(b"foobar"), "MZXW6YTBOI");
        assert_eq!(base32_std(b"f"), "MY");
    }

    fn web(pinned: Option<usize>) -> ResolvedService {
        ResolvedService {
            port_name: "default/web:http".into(),
            cluster_ip: "100.67.30.133".parse().unwrap(),
            port: 80,
            protocol: Protocol::Tcp,
            endpoints: vec![
                ("100.96.54.247".parse().unwrap(), 80),
                ("100.96.55.21".parse().unwrap(), 80),
                ("100.96.55.22".parse().unwrap(), 8080),
            ],
            pinned,
            node_port: None,
            external: Default::default(),
            local: Vec::new(),
        }
    }

    #[test]
    fn ruleset_has_kube_proxy_shape() {
        let config = KubeProxyConfig {
            cluster_cidr: Some(cidr("100.96.0.0/11")),
            masquerade_all: false,
            omit_hairpin_masquerade: false,
            ..Default::default()
        };
        let nat = render_nat(&config, &[web(None)]);
        let svc = svc_chain("default/web:http", Protocol::Tcp);
        assert!(nat.contains(&format!(
            r#"-A KUBE-SERVICES -d 100.67.30.133/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j {svc}"#
        )));
        assert!(nat.contains(&format!("-A {svc} ! -s 100.96.0.0/11 -d 100.67.30.133/32")));
        assert!(nat.contains(r#"--comment "default/web:http -> 100.96.54.247:80" -m statistic --mode random --probability 0.3333333333 -j KUBE-SEP-"#));
        assert!(nat.contains(r#"--comment "default/web:http -> 100.96.55.21:80" -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-"#));
        let last = format!(
            r#"-A {svc} -m comment --comment "default/web:http -> 100.96.55.22:8080" -j KUBE-SEP-"#
        );
        assert!(nat.contains(&last));
        assert!(nat.contains("-j DNAT --to-destination 100.96.55.22:8080"));
        assert!(nat.contains(
            "-s 100.96.54.247/32 -m comment --comment \"default/web:http\" -j KUBE-MARK-MASQ"
        ));
        assert!(nat.ends_with("COMMIT\n"));
    }

    #[test]
    fn pinning_and_masquerade_all() {
        let config = KubeProxyConfig {
            cluster_cidr: Some(cidr("100.96.0.0/11")),
            masquerade_all: true,
            omit_hairpin_masquerade: false,
            ..Default::default()
        };
        let nat = render_nat(&config, &[web(Some(1))]);
        assert!(
            nat.contains(
                "100.96.54.247:80\" -m statistic --mode random --probability 0.0000000000"
            )
        );
        assert!(
            nat.contains("100.96.55.21:80\" -m statistic --mode random --probability 1.0000000000")
        );
        assert!(!nat.contains("! -s"));
        let svc = svc_chain("default/web:http", Protocol::Tcp);
        assert!(nat.contains(&format!("-A {svc} -d 100.67.30.133/32 -p tcp")));
    }

    #[test]
    fn ipv6_node_rules_read_like_ip6tables_save() {
        let v6 = ResolvedService {
            cluster_ip: "fd00:10:96::1e85".parse().unwrap(),
            endpoints: vec![("fd00:10:244:36::f7".parse().unwrap(), 80)],
            ..web(None)
        };
        let empty = ResolvedService {
            port_name: "default/web-empty:http".into(),
            cluster_ip: "fd00:10:96::1e8c".parse().unwrap(),
            endpoints: vec![],
            ..web(None)
        };
        let config = KubeProxyConfig {
            cluster_cidr: Some(cidr("100.96.0.0/11")),
            ..Default::default()
        };
        let net = NodeNet6 {
            pod_cidr: crate::Ipv6Cidr::new("fd00:10:244:36::".parse().unwrap(), 64),
            cluster_network: crate::dual_stack::POD_NETWORK6,
        };
        let out = render_node6(&config, &[v6, empty], net);
        let sep = sep_chain("default/web:http", Protocol::Tcp, "[fd00:10:244:36::f7]:80");
        for want in [
            format!("-A {sep} -s fd00:10:244:36::f7/128 -m comment --comment \"default/web:http\" -j KUBE-MARK-MASQ"),
            format!("-A {sep} -p tcp -m comment --comment \"default/web:http\" -m tcp -j DNAT --to-destination [fd00:10:244:36::f7]:80"),
            "-A KUBE-SERVICES ! -d ::1/128 -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS".into(),
            "-A KUBE-SERVICES -d fd00:10:96::1e8c/128 -p tcp -m comment --comment \"default/web-empty:http has no endpoints\" -m tcp --dport 80 -j REJECT --reject-with icmp6-port-unreachable".into(),
            "-A FLANNEL-POSTRTG -s fd00:10:244::/56 ! -d ff00::/8 -m comment --comment \"flanneld masq\" -j MASQUERADE --random-fully".into(),
        ] {
            assert!(out.lines().any(|l| l == want), "missing {want}\n{out}");
        }
        assert!(
            out.contains("! -s fd00:10:244::/56 -d fd00:10:96::1e85/128"),
            "{out}"
        );
        // kubelet and kube-proxy write KUBE-FIREWALL for IPv4 only.
        assert!(!out.contains("KUBE-FIREWALL"), "{out}");
    }
}
