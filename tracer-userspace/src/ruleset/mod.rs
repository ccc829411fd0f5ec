//! kube-proxy's rules, read-only: which Service, `KUBE-SVC-…` and
//! `KUBE-SEP-…` chain sent a flow to its backend (nat), and which Service
//! ports kube-proxy REJECTs for having no endpoints (filter), for both
//! families: kube-proxy runs one proxier per IP family, writing the IPv6
//! half with `ip6tables` or into `table ip6 kube-proxy` under the same
//! Service port names. Parsing is pure; the only I/O is [`read`], which runs
//! `*-save` commands in the traced namespace, and only those that change
//! nothing there (see [`read`]).
use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    process::Command,
    sync::Arc,
};

use serde::Serialize;

use crate::probes::netns::Netns;

/// How kube-proxy programs Services on this node, judged from the rules present.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ProxyMode {
    Iptables,
    Ipvs,
    Nftables,
    /// No kube-proxy rules found (not a node, or another proxy such as Cilium's).
    #[default]
    None,
}

impl ProxyMode {
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyMode::Iptables => "iptables",
            ProxyMode::Ipvs => "ipvs",
            ProxyMode::Nftables => "nftables",
            ProxyMode::None => "none",
        }
    }
}

/// One `KUBE-SEP-…` chain: an endpoint of a Service port.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SepRule {
    pub chain: Arc<str>,
    pub endpoint: SocketAddr,
    /// `-s <endpoint ip> -j KUBE-MARK-MASQ`: a pod reaching itself is masqueraded.
    pub hairpin_masq: bool,
}

/// One Service port: `KUBE-SERVICES -d ip -p proto --dport port -j KUBE-SVC-…`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SvcRule {
    /// kube-proxy's comment, `namespace/name:port`. Shared, not copied,
    /// into each decided flow's report (`KubeMatch`).
    pub name: Arc<str>,
    pub cluster_ip: IpAddr,
    pub port: u16,
    /// "tcp" / "udp".
    pub proto: String,
    pub chain: Arc<str>,
    /// The KUBE-SVC chain marks every packet for masquerade (`masqueradeAll`).
    pub masquerade_all: bool,
    pub endpoints: Vec<SepRule>,
}

impl SvcRule {
    /// A NodePort, LB or external IP's Service port: the one of the same
    /// name, protocol and family.
    fn same_port_name(&self, ext: &external::ExternalRule, proto: &str) -> bool {
        *self.name == *ext.name && self.proto == proto && self.cluster_ip.is_ipv6() == ext.ipv6
    }

    fn matched(&self, backend: Option<SocketAddr>) -> KubeMatch {
        let sep = backend.and_then(|b| self.endpoints.iter().find(|e| e.endpoint == b));
        KubeMatch {
            service: self.name.clone(),
            svc_chain: self.chain.clone(),
            sep_chain: sep.map(|e| e.chain.clone()),
            hairpin_masq: sep.map(|e| e.hairpin_masq),
        }
    }
}

/// The Service ports of a [`KubeProxyRules`] by address and by name, for
/// the collector, which looks one up per decided flow: the scan of
/// [`KubeProxyRules::lookup`] cost ~100k instructions per connection with
/// 10,000 Services (callgrind, BENCHMARKS.md), against ~800 with three.
/// Built once per read of the rules.
#[derive(Debug, Default)]
pub struct ServiceIndex {
    /// (cluster IP, port) → positions in `services`, in order.
    by_port: HashMap<(IpAddr, u16), Vec<u32>, foldhash::fast::RandomState>,
    /// Service port name → positions, in order.
    by_name: HashMap<Arc<str>, Vec<u32>, foldhash::fast::RandomState>,
}

impl ServiceIndex {
    pub fn new(rules: &KubeProxyRules) -> Self {
        let mut index = ServiceIndex::default();
        for (i, s) in rules.services.iter().enumerate() {
            let i = i as u32;
            index
                .by_port
                .entry((s.cluster_ip, s.port))
                .or_default()
                .push(i);
            index.by_name.entry(s.name.clone()).or_default().push(i);
        }
        index
    }
}

/// kube-proxy's rules with their [`ServiceIndex`]: everything of the rules
/// (by `Deref`), and a `lookup` that answers as theirs without the scan.
#[derive(Clone, Copy, Debug)]
pub struct IndexedRules<'a> {
    pub rules: &'a KubeProxyRules,
    pub index: &'a ServiceIndex,
}

impl std::ops::Deref for IndexedRules<'_> {
    type Target = KubeProxyRules;
    fn deref(&self) -> &KubeProxyRules {
        self.rules
    }
}

impl<'a> IndexedRules<'a> {
    /// The first Service port at this cluster IP, port and protocol.
    pub fn service_port(&self, ip: IpAddr, port: u16, proto: &str) -> Option<&'a SvcRule> {
        let services = &self.rules.services;
        self.index
            .by_port
            .get(&(ip, port))?
            .iter()
            .map(|i| &services[*i as usize])
            .find(|s| s.proto == proto)
    }

    /// [`KubeProxyRules::lookup`], through the index (the same first match).
    pub fn lookup(
        &self,
        service: SocketAddr,
        proto: &str,
        backend: Option<SocketAddr>,
    ) -> Option<KubeMatch> {
        let at = |i: &u32| &self.rules.services[*i as usize];
        let svc = self
            .service_port(service.ip(), service.port(), proto)
            .or_else(|| {
                let ext = self
                    .rules
                    .north_south
                    .find(service.ip(), service.port(), proto)?;
                self.index
                    .by_name
                    .get(ext.name.as_str())?
                    .iter()
                    .map(at)
                    .find(|s| s.same_port_name(ext, proto))
            })?;
        Some(svc.matched(backend))
    }
}

/// A Service port without endpoints, which kube-proxy rejects (ICMP port
/// unreachable: the client's connect fails at once).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RejectRule {
    pub ip: IpAddr,
    pub port: u16,
    /// "tcp" / "udp".
    pub protocol: String,
    /// kube-proxy's `namespace/name:port`.
    pub port_name: String,
    /// The rule (or map element) that rejects it, as the node shows it.
    pub rule: String,
}

/// kube-proxy's name of a Service port as `namespace/name:port`
/// (docs/METRICS.md). kube-proxy itself writes an unnamed port as
/// `namespace/name` (ServicePortName.String() leaves the `:port` out) and
/// the nftables proxier's chain names end `.../tcp/` for it: both become
/// `namespace/name:NUMBER` here, so a label never ends in a bare colon.
pub fn port_label(name: &str, port: u16) -> String {
    if name.is_empty() {
        return String::new();
    }
    match name.rsplit_once('/').map(|(_, n)| n.rsplit_once(':')) {
        Some(Some((_, ""))) => format!("{name}{port}"),
        Some(Some(_)) => name.to_owned(),
        _ => format!("{name}:{port}"),
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct KubeProxyRules {
    pub mode: ProxyMode,
    /// Which iptables backend held the rules: "legacy" / "nft".
    pub source: Option<&'static str>,
    pub services: Vec<SvcRule>,
    pub no_endpoints: Vec<RejectRule>,
    /// `--cluster-cidr` as the Service chains show it: traffic from outside
    /// it is masqueraded. None when unknown or not set.
    pub cluster_cidr: Option<String>,
    /// Traced Service IPs that IPVS or an eBPF data plane translates instead
    /// (see [`dataplane`]); filled by the session, recorded with the rules.
    pub outside_netfilter: Vec<OutsideNetfilter>,
    /// Programs needed to read the rules that are not installed (a
    /// `FROM scratch` image without iptables): with these, an empty ruleset
    /// means "could not look", never "no rules".
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing_tools: Vec<MissingTool>,
    /// The filter table's DROP/REJECT rules (either iptables backend), to
    /// name the rule that drops a flow mid-stream (issue 21).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub filter_drops: Vec<firewall::FilterDrop>,
    /// NodePorts, LoadBalancer and external IPs (issue 24).
    #[serde(default, skip_serializing_if = "NorthSouth::is_empty")]
    pub north_south: NorthSouth,
}

/// A program [`read`] needed and could not start because it is not installed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct MissingTool {
    pub program: String,
    /// `$PATH` as nattrace searched it.
    pub path: String,
}

impl std::fmt::Display for MissingTool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} not found in PATH: {}", self.program, self.path)
    }
}

/// A Service IP translated outside netfilter, and by what.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OutsideNetfilter {
    pub ip: IpAddr,
    /// e.g. "IPVS (kube-proxy --proxy-mode=ipvs: kube-ipvs0 holds 10.96.0.1)".
    pub by: String,
}

/// What a flow's Service and backend map to in the ruleset.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KubeMatch {
    pub service: Arc<str>,
    pub svc_chain: Arc<str>,
    /// None when the backend is unknown or no KUBE-SEP chain DNATs to it.
    pub sep_chain: Option<Arc<str>>,
    /// The SEP chain masquerades the endpoint reaching itself (hairpin).
    pub hairpin_masq: Option<bool>,
}

impl KubeProxyRules {
    /// The Service port (either family) a flow to `service` belongs to,
    /// and the endpoint chain that DNATs to `backend`.
    pub fn lookup<A: Into<SocketAddr>>(
        &self,
        service: A,
        proto: &str,
        backend: Option<A>,
    ) -> Option<KubeMatch> {
        let service = service.into();
        let svc = self
            .services
            .iter()
            .find(|s| s.cluster_ip == service.ip() && s.port == service.port() && s.proto == proto)
            .or_else(|| {
                let ext = self.north_south.find(service.ip(), service.port(), proto)?;
                self.services.iter().find(|s| s.same_port_name(ext, proto))
            })?;
        Some(svc.matched(backend.map(Into::into)))
    }

    /// kube-proxy's no-endpoints REJECT for this Service IP:port, if any.
    pub fn no_endpoints_for(
        &self,
        service: impl Into<SocketAddr>,
        proto: &str,
    ) -> Option<&RejectRule> {
        let service = service.into();
        self.no_endpoints
            .iter()
            .find(|r| r.ip == service.ip() && r.port == service.port() && r.protocol == proto)
    }

    /// Adds the other family's half (the IPv6 proxier's rules beside the
    /// IPv4 ones): Services and rejects are joined; mode, source and
    /// cluster CIDR stay this half's unless it has none.
    pub fn merge(&mut self, other: KubeProxyRules) {
        if self.mode == ProxyMode::None {
            self.mode = other.mode;
            self.source = other.source;
        }
        if self.cluster_cidr.is_none() {
            self.cluster_cidr = other.cluster_cidr;
        }
        self.services.extend(other.services);
        self.no_endpoints.extend(other.no_endpoints);
        self.outside_netfilter.extend(other.outside_netfilter);
        self.filter_drops.extend(other.filter_drops);
        self.north_south.merge(other.north_south);
    }

    /// Whether every Service's chain masquerades all traffic (`masqueradeAll: true`).
    pub fn masquerade_all(&self) -> Option<bool> {
        if self.services.is_empty() {
            return None;
        }
        Some(self.services.iter().all(|s| s.masquerade_all))
    }
}

/// Splits an `iptables-save` rule into words, honouring double quotes
/// (kube-proxy's comments contain spaces).
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let (mut quoted, mut escaped, mut any) = (false, false, false);
    for c in line.chars() {
        if escaped {
            cur.push(c);
            escaped = false;
            continue;
        }
        match c {
            '\\' => escaped = true,
            '"' => {
                quoted = !quoted;
                any = true;
            }
            c if c.is_whitespace() && !quoted => {
                if any || !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
                any = false;
            }
            c => cur.push(c),
        }
    }
    if any || !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// A rule as the options kube-proxy uses. A `!` before an option negates it.
#[derive(Default)]
struct Rule {
    chain: String,
    dst: Option<String>,
    src: Option<String>,
    src_negated: bool,
    proto: Option<String>,
    dport: Option<u16>,
    comment: Option<String>,
    jump: Option<String>,
    to_destination: Option<String>,
}

fn parse_rule(line: &str) -> Option<Rule> {
    let w = words(line.strip_prefix("-A ")?);
    let mut r = Rule {
        chain: w.first()?.clone(),
        ..Rule::default()
    };
    let mut negate = false;
    let mut i = 1;
    while i < w.len() {
        let next = w.get(i + 1).cloned();
        let mut took = true;
        match w[i].as_str() {
            "!" => {
                negate = true;
                i += 1;
                continue;
            }
            "-d" | "--destination" => r.dst = next,
            "-s" | "--source" => {
                r.src = next;
                r.src_negated = negate;
            }
            "-p" | "--protocol" => r.proto = next,
            "--dport" | "--destination-port" => r.dport = next.and_then(|p| p.parse().ok()),
            "--comment" => r.comment = next,
            "-j" | "--jump" | "-g" | "--goto" => r.jump = next,
            "--to-destination" => r.to_destination = next,
            _ => took = false,
        }
        negate = false;
        i += if took { 2 } else { 1 };
    }
    Some(r)
}

/// A host address as iptables-save prints it: `a.b.c.d/32`, `x::y/128`.
fn host(cidr: &str) -> Option<IpAddr> {
    let ip: IpAddr = cidr
        .strip_suffix("/32")
        .or_else(|| cidr.strip_suffix("/128"))
        .unwrap_or(cidr)
        .parse()
        .ok()?;
    // A /32 suffix on an IPv6 address is a prefix, not a host.
    (!(ip.is_ipv6() && cidr.ends_with("/32"))).then_some(ip)
}

/// Parses `iptables-save -t nat` output (either backend's: the text format is the same).
pub fn parse_nat(text: &str) -> KubeProxyRules {
    let rules: Vec<Rule> = text.lines().filter_map(parse_rule).collect();
    let mut out = KubeProxyRules::default();
    let mut by_chain: HashMap<&str, Vec<&Rule>> = HashMap::new();
    for r in &rules {
        by_chain.entry(r.chain.as_str()).or_default().push(r);
    }
    for r in by_chain.get("KUBE-SERVICES").into_iter().flatten() {
        let (Some(jump), Some(dst), Some(port), Some(proto)) = (&r.jump, &r.dst, r.dport, &r.proto)
        else {
            continue;
        };
        if !jump.starts_with("KUBE-SVC-") {
            continue;
        }
        let Some(ip) = host(dst) else { continue };
        let name = r
            .comment
            .as_deref()
            .map(|c| port_label(c.trim_end_matches(" cluster IP"), port))
            .unwrap_or_default();
        let chain_rules = by_chain
            .get(jump.as_str())
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        let masquerade_all = chain_rules.iter().any(|c| {
            c.jump.as_deref() == Some("KUBE-MARK-MASQ") && c.src.is_none() && c.dst.is_some()
        });
        let endpoints = chain_rules
            .iter()
            .filter_map(|c| c.jump.as_deref())
            .filter(|j| j.starts_with("KUBE-SEP-"))
            .filter_map(|sep| endpoint(sep, by_chain.get(sep)?))
            .collect();
        out.services.push(SvcRule {
            name: name.into(),
            cluster_ip: ip,
            port,
            proto: proto.clone(),
            chain: jump.as_str().into(),
            masquerade_all,
            endpoints,
        });
    }
    let lines: Vec<&str> = text.lines().collect();
    external::from_nat(&lines, &mut out);
    out.mode = if !out.services.is_empty() || by_chain.contains_key("KUBE-SERVICES") {
        if text.contains("KUBE-CLUSTER-IP") || by_chain.contains_key("KUBE-LOAD-BALANCER") {
            ProxyMode::Ipvs
        } else {
            ProxyMode::Iptables
        }
    } else {
        ProxyMode::None
    };
    out
}

fn endpoint(chain: &str, rules: &[&Rule]) -> Option<SepRule> {
    let to = rules.iter().find_map(|r| r.to_destination.as_deref())?;
    // `ip:port`, or `[ip6]:port` in ip6tables-save.
    let endpoint: SocketAddr = to.parse().ok()?;
    let hairpin_masq = rules.iter().any(|r| {
        r.jump.as_deref() == Some("KUBE-MARK-MASQ")
            && !r.src_negated
            && r.src.as_deref().and_then(host) == Some(endpoint.ip())
    });
    Some(SepRule {
        chain: chain.into(),
        endpoint,
        hairpin_masq,
    })
}

/// Why [`run_in`] produced no output.
#[derive(Debug, PartialEq, Eq)]
enum RunError {
    /// Not installed (spawn failed with ENOENT).
    Missing,
    /// It ran and failed, or the namespace could not be entered.
    Failed,
}

/// Runs `program args` in the namespace and returns its stdout.
fn run_in(netns: &Netns, program: &str, args: &[&str]) -> Result<String, RunError> {
    // stdin piped (closed at once by `output`), not the default /dev/null:
    // a bare container root has no /dev, and failing to open it would look
    // like a missing program (ENOENT).
    let output = || {
        Command::new(program)
            .args(args)
            .stdin(std::process::Stdio::piped())
            .output()
    };
    match netns.run(output) {
        Ok(Ok(o)) if o.status.success() => Ok(String::from_utf8_lossy(&o.stdout).into_owned()),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => Err(RunError::Missing),
        _ => Err(RunError::Failed),
    }
}

/// Collects the programs [`read`] found missing.
struct Missing {
    tools: Vec<MissingTool>,
    path: String,
}

impl Missing {
    fn new() -> Missing {
        Missing {
            tools: Vec::new(),
            path: std::env::var("PATH").unwrap_or_default(),
        }
    }

    /// `result`'s output; a missing program is noted (once).
    fn note(&mut self, program: &str, result: Result<String, RunError>) -> Option<String> {
        if result == Err(RunError::Missing) && !self.tools.iter().any(|t| t.program == program) {
            self.tools.push(MissingTool {
                program: program.to_string(),
                path: self.path.clone(),
            });
        }
        result.ok()
    }
}

/// Whether x_tables (legacy) tables of a family exist in the namespace
/// (`names`: `ip_tables_names` or `ip6_tables_names`). Read through
/// `thread-self`: `/proc/net` follows `/proc/self`, the thread-group
/// leader, whose namespace is not the one this thread entered
/// (fs/proc/proc_net.c, get_proc_task_net).
fn legacy_tables_exist(netns: &Netns, names: &str) -> bool {
    netns
        .run(|| std::fs::read_to_string(format!("/proc/thread-self/net/{names}")))
        .ok()
        .and_then(Result::ok)
        .is_some_and(|names| !names.trim().is_empty())
}

/// The save commands and legacy table list of one IP family.
struct Family {
    nft: &'static str,
    legacy: &'static str,
    /// The unsuffixed name some distributions ship one backend as.
    plain: &'static str,
    legacy_names: &'static str,
}

const IPV4: Family = Family {
    nft: "iptables-nft-save",
    legacy: "iptables-legacy-save",
    plain: "iptables-save",
    legacy_names: "ip_tables_names",
};
const IPV6: Family = Family {
    nft: "ip6tables-nft-save",
    legacy: "ip6tables-legacy-save",
    plain: "ip6tables-save",
    legacy_names: "ip6_tables_names",
};

/// Whether nf_tables is there without loading anything: asking nfnetlink
/// for nf_tables otherwise loads the module (nfnetlink autoloads missing
/// subsystems), a change to the node. True when the kernel cannot load
/// modules at all (no /proc/modules), when it is loaded, or built in.
fn nf_tables_loaded() -> bool {
    let Ok(modules) = std::fs::read_to_string("/proc/modules") else {
        return true;
    };
    if modules.lines().any(|l| l.starts_with("nf_tables ")) {
        return true;
    }
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    // In a container, the node's /lib/modules (mounted, or under /host).
    std::fs::read_to_string(crate::host::node_path(&format!(
        "/lib/modules/{}/modules.builtin",
        release.trim()
    )))
    .is_ok_and(|b| b.lines().any(|l| l.ends_with("/nf_tables.ko")))
}

/// Reads kube-proxy's rules (nat and filter tables) in `netns` (None =
/// current) from whichever iptables backend holds them. Strictly read-only:
/// `iptables-nft-save` only when nf_tables is loaded; `iptables-legacy-save`
/// only when legacy tables already exist in that namespace, since asking
/// x_tables for a table that is not there instantiates it (and loads its
/// module: `iptables-legacy-save -t nat` on an nft node creates a legacy nat
/// table with every hook). Without `-t`, a save lists only existing tables.
pub fn read(netns: Option<&str>) -> KubeProxyRules {
    let Ok(ns) = Netns::open(netns) else {
        return KubeProxyRules::default();
    };
    read_in(&ns)
}

/// [`read`] in a namespace already open (the traced node's).
pub fn read_in(ns: &Netns) -> KubeProxyRules {
    let nf_tables = nf_tables_loaded();
    let mut missing = Missing::new();
    let mut best = read_family(ns, nf_tables, &IPV4, &mut missing);
    best.merge(read_family(ns, nf_tables, &IPV6, &mut missing));
    if best.mode == ProxyMode::None
        && nf_tables
        && let Some(rules) = missing
            .note("nft", run_in(ns, "nft", &["-j", "list", "ruleset"]))
            .and_then(|j| nft::parse(&j))
    {
        // A node firewall's iptables rules beside kube-proxy's nftables.
        let drops = std::mem::take(&mut best.filter_drops);
        best = rules;
        best.filter_drops.extend(drops);
    }
    if best.mode == ProxyMode::None {
        best.missing_tools = missing.tools;
    }
    if !best.north_south.nodeport_addresses.is_empty() {
        best.north_south.node_addresses = local_addresses(ns);
    }
    best
}

/// The namespace's own addresses (getifaddrs there: netlink, read-only), for
/// the NodePorts kube-proxy accepts on `addrtype LOCAL`. Link-local IPv6
/// addresses are left out: a NodePort is never reached through them.
fn local_addresses(ns: &Netns) -> Vec<IpAddr> {
    let read = || -> Vec<IpAddr> {
        let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
            return Vec::new();
        };
        let mut out: Vec<IpAddr> = addrs
            .filter_map(|a| {
                let sa = a.address?;
                if let Some(v4) = sa.as_sockaddr_in() {
                    return Some(IpAddr::V4(v4.ip()));
                }
                sa.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
            })
            .filter(|ip| {
                !ip.is_loopback() && !matches!(ip, IpAddr::V6(v6) if v6.is_unicast_link_local())
            })
            .collect();
        out.sort();
        out.dedup();
        out
    };
    ns.run(read).unwrap_or_default()
}

/// [`read`] for one family's iptables: the backend holding the most rules.
fn read_family(
    ns: &Netns,
    nf_tables: bool,
    family: &Family,
    missing: &mut Missing,
) -> KubeProxyRules {
    let mut sources: Vec<(&str, &'static str)> = Vec::new();
    if nf_tables {
        sources.push((family.nft, "nft"));
    }
    if legacy_tables_exist(ns, family.legacy_names) {
        sources.push((family.legacy, "legacy"));
    }
    let mut best = KubeProxyRules::default();
    let mut drops = Vec::new();
    for (program, source) in sources {
        // Distributions without the -nft/-legacy names ship one of them as
        // plain `iptables-save`; its --version says which.
        let named = run_in(ns, program, &[]);
        let text = match named {
            Err(RunError::Missing) => {
                let backend = if source == "nft" {
                    "nf_tables"
                } else {
                    "legacy"
                };
                let plain = run_in(ns, family.plain, &["--version"]).and_then(|v| {
                    if v.contains(backend) {
                        run_in(ns, family.plain, &[])
                    } else {
                        Err(RunError::Failed)
                    }
                });
                // Only when neither name exists is the tool missing.
                if plain == Err(RunError::Missing) {
                    missing.note(program, Err(RunError::Missing));
                }
                plain.ok()
            }
            other => other.ok(),
        };
        let Some(text) = text else { continue };
        let mut rules = parse_save(&text);
        drops.append(&mut rules.filter_drops);
        let size = |r: &KubeProxyRules| r.services.len() + r.no_endpoints.len();
        if size(&rules) > size(&best)
            || (best.mode == ProxyMode::None && rules.mode != ProxyMode::None)
        {
            best = KubeProxyRules {
                source: Some(source),
                ..rules
            };
        }
    }
    best.filter_drops = drops;
    best
}

pub mod external;
mod filter;
pub use external::NorthSouth;
pub use filter::{parse_filter_rejects, parse_save};
pub mod firewall;

pub mod dataplane;
pub mod nft;
#[cfg(test)]
mod tests;

/// Every ruleset text of `netns` as its save tools print it, both families
/// and both iptables backends, plus `nft list ruleset`: for `doctor`'s
/// search for rules that drop ICMP errors (doctor/mtu.rs). The same
/// read-only guards as [`read`]: a backend is asked only when it is there.
pub(crate) fn ruleset_texts(netns: &Netns) -> Vec<String> {
    let nf_tables = nf_tables_loaded();
    let mut out = Vec::new();
    for family in [&IPV4, &IPV6] {
        if nf_tables && let Ok(t) = run_in(netns, family.nft, &[]) {
            out.push(t);
        }
        if legacy_tables_exist(netns, family.legacy_names)
            && let Ok(t) = run_in(netns, family.legacy, &[])
        {
            out.push(t);
        }
    }
    if nf_tables && let Ok(t) = run_in(netns, "nft", &["list", "ruleset"]) {
        out.push(t);
    }
    out
}
