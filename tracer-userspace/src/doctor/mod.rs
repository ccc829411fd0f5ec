//! `nattrace doctor`: the static facts behind the seed incidents, read-only,
//! each judged with a severity and a fix. Gathering ([`gather`]) is the only
//! I/O; judging ([`assess`]) is pure, so every rule is unit-tested.
use std::fmt::Write as _;

use serde::Serialize;

use crate::{
    collector::CauseId,
    facts::Interface,
    probes::netns::{self, Netns, NetnsError},
    ruleset::{self, KubeProxyRules, OutsideNetfilter, ProxyMode, dataplane::Dataplane},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Ok,
    Info,
    Warning,
    /// Breaks Service traffic: `nattrace doctor` exits 1.
    Error,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Ok => "ok",
            Severity::Info => "info",
            Severity::Warning => "warning",
            Severity::Error => "error",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// Stable id, e.g. "bridge_nf_call_iptables".
    pub check: &'static str,
    pub severity: Severity,
    /// Short "key=value" form for the one-line preamble.
    pub value: String,
    pub message: String,
    pub fix: Option<&'static str>,
}

/// What [`gather`] read; everything [`assess`] judges.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Inputs {
    pub netns: String,
    pub br_netfilter_loaded: bool,
    pub bridge_nf_call_iptables: Option<bool>,
    pub interfaces: Vec<Interface>,
    pub ip_forward: Option<bool>,
    /// `all`, then each interface: the value in effect is the max of the two.
    pub rp_filter: Vec<(String, u8)>,
    pub conntrack_count: Option<u64>,
    pub conntrack_max: Option<u64>,
    /// `/proc/net/stat/nf_conntrack` summed over CPUs ([`conntrack_stats`]).
    pub conntrack_stats: Option<conntrack_stats::ConntrackStats>,
    pub kube_proxy: KubeProxyRules,
    /// IPVS / eBPF load balancers that may translate Services instead.
    pub dataplane: Dataplane,
    /// The Service IPs a trace follows, both families (empty for `doctor`).
    pub traced: Vec<std::net::IpAddr>,
    /// IPv6 sysctls, addresses and RA-learned routes ([`ipv6`]).
    pub ipv6: ipv6::Ipv6Facts,
    /// The uplink and the rules dropping ICMP errors ([`mtu`]).
    pub mtu: mtu::MtuFacts,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Report {
    pub netns: String,
    pub findings: Vec<Finding>,
}

impl Report {
    /// Whether a finding would break Service traffic (exit status 1).
    pub fn breaks_services(&self) -> bool {
        self.findings.iter().any(|f| f.severity == Severity::Error)
    }

    /// The trace preamble: every value, problems first, in one line.
    pub fn one_line(&self) -> String {
        let mut sorted: Vec<&Finding> = self.findings.iter().collect();
        sorted.sort_by_key(|f| std::cmp::Reverse(f.severity));
        let problems = sorted
            .iter()
            .filter(|f| f.severity >= Severity::Warning)
            .count();
        let values: Vec<String> = sorted
            .iter()
            .map(|f| match f.severity {
                Severity::Error | Severity::Warning => {
                    format!("{} ({})", f.value, f.severity.as_str())
                }
                _ => f.value.clone(),
            })
            .collect();
        format!("checks: {} problem(s): {}", problems, values.join(", "))
    }

    pub fn text(&self) -> String {
        let mut out = format!("nattrace doctor: netns {}\n", self.netns);
        for f in &self.findings {
            let _ = writeln!(out, "{:<7} {}: {}", f.severity.as_str(), f.check, f.message);
            if let Some(fix) = f.fix.filter(|_| f.severity >= Severity::Warning) {
                let _ = writeln!(out, "        fix: {fix}");
            }
        }
        let verdict = if self.breaks_services() {
            "Service traffic will break on this node"
        } else {
            "nothing found that breaks Service traffic"
        };
        let _ = writeln!(out, "{verdict}");
        out
    }
}

// Where a finding is the static side of a cause the collector names, its
// fix is that cause's (one wording, in `collector/causes.rs`).
const FIX_BR_NETFILTER: CauseId = CauseId::BridgeNfCallIptablesOff;
const FIX_HAIRPIN: CauseId = CauseId::HairpinModeOff;
const FIX_FORWARD: &str = "sysctl -w net.ipv4.ip_forward=1";
const FIX_RP_FILTER: CauseId = CauseId::DroppedByRpFilter;
/// At 90% and above a burst fills the table and new connections are
/// dropped (cause `conntrack_table_full`).
const FIX_CONNTRACK: &str = "raise net.netfilter.nf_conntrack_max (kube-proxy sets it at start from --conntrack-max-per-core / conntrack.maxPerCore × CPUs) or find what fills the table (conntrack -L | awk '{for (i = 1; i <= NF; i++) if ($i ~ /^dst=/) { print $1, $i; break }}' | sort | uniq -c | sort -rn | head; conntrack -S drop/early_drop) and shorten idle timeouts (nf_conntrack_tcp_timeout_established)";
const FIX_KUBE_PROXY: &str = "check that kube-proxy runs on this node and syncs its rules (its logs, iptables-save | grep KUBE-SERVICES)";
const FIX_DATAPLANE: CauseId = CauseId::ServiceNotNetfilter;
const FIX_MASQ_ALL: CauseId = CauseId::NoReplyThroughNode;

/// Interface names for a one-line summary: the first few and a count, so
/// the line stays readable on a node with hundreds of pods (the finding's
/// `message` keeps them all).
pub(crate) fn first_few(names: &[&str], separator: &str) -> String {
    const SHOWN: usize = 3;
    let mut out = names
        .iter()
        .take(SHOWN)
        .copied()
        .collect::<Vec<_>>()
        .join(separator);
    if names.len() > SHOWN {
        out.push_str(&format!(" and {} more", names.len() - SHOWN));
    }
    out
}

fn few(names: &[&str]) -> String {
    first_few(names, ",")
}

fn finding(
    check: &'static str,
    severity: Severity,
    value: String,
    message: String,
    fix: &'static str,
) -> Finding {
    Finding {
        check,
        severity,
        value,
        message,
        fix: Some(fix),
    }
}

/// Judges what [`gather`] read. Pure.
pub fn assess(i: &Inputs) -> Report {
    let mut out = Vec::new();
    bridge_findings(i, &mut out);
    out.push(ip_forward_finding(i));
    out.push(rp_filter_finding(i));
    out.extend(conntrack_finding(i));
    out.extend(conntrack_stats_finding(i));
    out.push(kube_proxy_finding(i));
    out.extend(service_nat(i));
    out.extend(masquerade_all_finding(i));
    out.extend(ipv6::findings(i));
    out.extend(north_south::findings(i));
    out.extend(mtu::findings(i));
    Report {
        netns: i.netns.clone(),
        findings: out,
    }
}

/// br_netfilter, bridge-nf-call-iptables and hairpin_mode: the seed
/// 000/001 and 004 facts, for the bridges of the namespace.
fn bridge_findings(i: &Inputs, out: &mut Vec<Finding>) {
    let bridges: Vec<&Interface> = i.interfaces.iter().filter(|x| x.kind == "bridge").collect();
    let names = |v: &[&Interface]| {
        v.iter()
            .map(|x| x.name.as_str())
            .collect::<Vec<_>>()
            .join(",")
    };
    let (sev, msg) = match (i.br_netfilter_loaded, bridges.is_empty()) {
        (true, _) => (Severity::Ok, "br_netfilter is loaded".to_string()),
        (false, true) => (
            Severity::Info,
            "br_netfilter is not loaded (no bridge in this namespace)".to_string(),
        ),
        (false, false) => (
            Severity::Error,
            format!(
                "br_netfilter is not loaded: replies bridged on {} skip Service reverse NAT (seed 000)",
                names(&bridges)
            ),
        ),
    };
    out.push(finding(
        "br_netfilter",
        sev,
        format!(
            "br_netfilter={}",
            if i.br_netfilter_loaded {
                "loaded"
            } else {
                "absent"
            }
        ),
        msg,
        FIX_BR_NETFILTER.hint(),
    ));
    if !bridges.is_empty() {
        let (sev, v, msg) = match i.bridge_nf_call_iptables {
            Some(true) => (
                Severity::Ok,
                "1",
                format!("bridged traffic on {} passes iptables", names(&bridges)),
            ),
            Some(false) => (
                Severity::Error,
                "0",
                format!(
                    "bridged traffic on {} skips iptables: same-node Service replies are not reverse-NATed (seed 000/001)",
                    names(&bridges)
                ),
            ),
            None => (
                Severity::Error,
                "absent",
                "net.bridge.bridge-nf-call-iptables does not exist (br_netfilter not loaded)"
                    .to_string(),
            ),
        };
        out.push(finding(
            "bridge_nf_call_iptables",
            sev,
            format!(
                "bridge-nf-call-iptables={v} on {}",
                few(&bridges.iter().map(|x| x.name.as_str()).collect::<Vec<_>>())
            ),
            msg,
            FIX_BR_NETFILTER.hint(),
        ));
        let ports: Vec<&Interface> = i.interfaces.iter().filter(|x| x.master.is_some()).collect();
        let off: Vec<&Interface> = ports
            .iter()
            .copied()
            .filter(|x| x.hairpin == Some(false))
            .collect();
        if !ports.is_empty() {
            let (sev, value, msg) = if off.is_empty() {
                (
                    Severity::Ok,
                    "hairpin=on".to_string(),
                    format!("hairpin_mode is on for all {} bridge ports", ports.len()),
                )
            } else {
                (
                    Severity::Warning,
                    format!(
                        "hairpin=off on {}",
                        few(&off.iter().map(|x| x.name.as_str()).collect::<Vec<_>>())
                    ),
                    format!(
                        "hairpin_mode is off on {} of {} bridge ports ({}): a pod there cannot reach itself through its Service (seed 004 case 3)",
                        off.len(),
                        ports.len(),
                        names(&off)
                    ),
                )
            };
            out.push(finding("hairpin_mode", sev, value, msg, FIX_HAIRPIN.hint()));
        }
    }
}

fn ip_forward_finding(i: &Inputs) -> Finding {
    let (sev, v) = match i.ip_forward {
        Some(true) => (Severity::Ok, "1"),
        Some(false) => (Severity::Error, "0"),
        None => (Severity::Warning, "unknown"),
    };
    finding(
        "ip_forward",
        sev,
        format!("ip_forward={v}"),
        match sev {
            Severity::Ok => "the node forwards IPv4".to_string(),
            _ => "the node does not forward IPv4: pod and Service traffic through it is dropped"
                .to_string(),
        },
        FIX_FORWARD,
    )
}

fn rp_filter_finding(i: &Inputs) -> Finding {
    let all = i
        .rp_filter
        .iter()
        .find(|(n, _)| n == "all")
        .map_or(0, |(_, v)| *v);
    let strict: Vec<&str> = i
        .rp_filter
        .iter()
        .filter(|(n, v)| n != "all" && n != "default" && (*v).max(all) == 1)
        .map(|(n, _)| n.as_str())
        .collect();
    if strict.is_empty() {
        finding(
            "rp_filter",
            Severity::Ok,
            "rp_filter=loose/off".into(),
            "no interface has strict reverse-path filtering".into(),
            FIX_RP_FILTER.hint(),
        )
    } else {
        finding(
            "rp_filter",
            Severity::Warning,
            format!("rp_filter=strict on {}", few(&strict)),
            format!(
                "strict reverse-path filtering on {}: packets of asymmetric paths are dropped",
                strict.join(", ")
            ),
            FIX_RP_FILTER.hint(),
        )
    }
}

fn conntrack_finding(i: &Inputs) -> Option<Finding> {
    let (Some(count), Some(max)) = (i.conntrack_count, i.conntrack_max) else {
        return None;
    };
    let pct = (count * 100).checked_div(max).unwrap_or(0);
    let sev = match pct {
        90.. => Severity::Error,
        75.. => Severity::Warning,
        _ => Severity::Ok,
    };
    Some(finding(
        "conntrack",
        sev,
        format!("conntrack={count}/{max}"),
        format!(
            "{count} of {max} conntrack entries in use ({pct}%); a full table drops new connections"
        ),
        FIX_CONNTRACK,
    ))
}

const FIX_CONNTRACK_STATS: &str = "insert_failed/drop count packets conntrack itself dropped since boot: watch whether they rise (conntrack -S, nattrace's summary and nattrace_conntrack_stat metric); a rising insert_failed is a clash (SNAT source-port collisions: masquerade with --random-fully; the DNS A/AAAA race: NodeLocal DNSCache, resolv.conf options single-request-reopen or use-vc), a rising drop/early_drop a full table (raise net.netfilter.nf_conntrack_max)";

/// conntrack's own counters: packets it dropped itself are a warning, since
/// boot (they do not say whether it still happens: the trace's summary does).
fn conntrack_stats_finding(i: &Inputs) -> Option<Finding> {
    let s = i.conntrack_stats?;
    let sev = if s.dropped() > 0 || s.early_drop.unwrap_or(0) > 0 {
        Severity::Warning
    } else {
        Severity::Ok
    };
    Some(finding(
        "conntrack_stats",
        sev,
        format!("conntrack_dropped={}", s.dropped()),
        format!(
            "conntrack's counters in this namespace since boot (all CPUs): {}",
            s.describe()
        ),
        FIX_CONNTRACK_STATS,
    ))
}

fn kube_proxy_finding(i: &Inputs) -> Finding {
    let mode = i.kube_proxy.mode;
    let (sev, msg) = match mode {
        ProxyMode::None if !i.kube_proxy.missing_tools.is_empty() => (
            Severity::Warning,
            format!(
                "kube-proxy's rules could not be read: {} (install iptables and nftables, or run the nattrace image, which carries them)",
                i.kube_proxy
                    .missing_tools
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        ),
        ProxyMode::None => (Severity::Warning, "no kube-proxy rules found in the nat table (not a node, kube-proxy down, or a kube-proxy replacement)".to_string()),
        m => (
            Severity::Info,
            format!(
                "kube-proxy runs in {} mode ({} Services{}{})",
                m.as_str(),
                i.kube_proxy.services.len(),
                match i.kube_proxy.no_endpoints.len() {
                    0 => String::new(),
                    n => format!(", {n} without endpoints, rejected"),
                },
                i.kube_proxy
                    .source
                    .map(|s| format!(", iptables-{s}"))
                    .unwrap_or_default()
            ),
        ),
    };
    let unread = mode == ProxyMode::None && !i.kube_proxy.missing_tools.is_empty();
    finding(
        "kube_proxy_mode",
        sev,
        format!(
            "kube-proxy={}",
            if unread { "unknown" } else { mode.as_str() }
        ),
        msg,
        FIX_KUBE_PROXY,
    )
}

fn masquerade_all_finding(i: &Inputs) -> Option<Finding> {
    let all = i.kube_proxy.masquerade_all()?;
    Some(finding(
            "masquerade_all",
            Severity::Info,
            format!("masqueradeAll={all}"),
            match (all, &i.kube_proxy.cluster_cidr) {
                (true, _) => "masqueradeAll is in effect: every Service packet is SNATed".into(),
                (false, Some(cidr)) => format!("masqueradeAll is off: Service traffic from outside the cluster CIDR {cidr} is masqueraded (kube-proxy --cluster-cidr), pods keep their address"),
                (false, None) => "masqueradeAll is off: clients outside the cluster CIDR keep their address (seed 003 if their replies can bypass this node)".into(),
            },
            FIX_MASQ_ALL.hint(),
        ))
}

/// Whether Services (the traced ones, or any for `doctor`) are translated by
/// something other than netfilter NAT, where nattrace's verdicts mislead.
fn service_nat(i: &Inputs) -> Option<Finding> {
    let traced: Vec<String> = outside_netfilter(i)
        .iter()
        .map(|o| format!("{} is translated by {}", o.ip, o.by))
        .collect();
    let (value, what) = if !traced.is_empty() {
        ("service_nat=not-netfilter".to_string(), traced.join("; "))
    } else if i.traced.is_empty() {
        let (kind, text) = i.dataplane.summary()?;
        (format!("service_nat={kind}"), text)
    } else {
        return None;
    };
    Some(finding(
        "service_nat",
        Severity::Warning,
        value,
        format!(
            "{what}, not by netfilter NAT: nattrace sees these packets, but its NAT verdicts and causes do not apply to them"
        ),
        FIX_DATAPLANE.hint(),
    ))
}

/// The traced Service IPs that IPVS or an eBPF data plane translates
/// instead of kube-proxy's netfilter NAT.
pub(crate) fn outside_netfilter(i: &Inputs) -> Vec<OutsideNetfilter> {
    i.traced
        .iter()
        .filter_map(|&ip| {
            let by = i.dataplane.not_netfilter(ip, &i.kube_proxy)?;
            Some(OutsideNetfilter { ip, by })
        })
        .collect()
}

fn read_u64(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Reads the facts of `netns` (None = current). Read-only.
pub fn gather(netns_spec: Option<&str>) -> Result<Inputs, NetnsError> {
    gather_with(netns_spec, None)
}

/// [`gather`], reusing an interface list the caller just read (a second
/// rtnetlink dump would wait for the RTNL lock behind nattrace's own tc
/// attachments at start-up).
pub fn gather_with(
    netns_spec: Option<&str>,
    interfaces: Option<Vec<crate::facts::Interface>>,
) -> Result<Inputs, NetnsError> {
    let ns = Netns::open(netns_spec)?;
    let mut inputs = ns.run(|| -> Result<Inputs, NetnsError> {
        let interfaces = match interfaces {
            Some(i) => i,
            None => netns::list_interfaces()?,
        };
        let mut rp_filter = Vec::new();
        for name in std::iter::once("all").chain(interfaces.iter().map(|i| i.name.as_str())) {
            if let Some(v) = read_u64(&format!("/proc/sys/net/ipv4/conf/{name}/rp_filter")) {
                rp_filter.push((name.to_string(), v as u8));
            }
        }
        Ok(Inputs {
            bridge_nf_call_iptables: netns::read_sysctl_bool(
                "/proc/sys/net/bridge/bridge-nf-call-iptables",
            ),
            ip_forward: netns::read_sysctl_bool("/proc/sys/net/ipv4/ip_forward"),
            conntrack_count: read_u64("/proc/sys/net/netfilter/nf_conntrack_count"),
            conntrack_max: read_u64("/proc/sys/net/netfilter/nf_conntrack_max"),
            conntrack_stats: conntrack_stats::ConntrackStats::read(),
            interfaces,
            rp_filter,
            ipv6: ipv6::gather(),
            ..Inputs::default()
        })
    })??;
    inputs.netns = netns_spec.unwrap_or("current").to_string();
    // Built in, it has no /sys/module entry; its per-namespace sysctls say it is there.
    inputs.br_netfilter_loaded = inputs.bridge_nf_call_iptables.is_some()
        || std::path::Path::new("/sys/module/br_netfilter").exists();
    let t = crate::timing::step("kube-proxy rules (iptables-save/nft)");
    inputs.kube_proxy = ruleset::read(netns_spec);
    drop(t);
    let _t = crate::timing::step("dataplane detect (ip addr kube-ipvs0, ip_vs)");
    inputs.dataplane = Dataplane::detect(&ns);
    inputs.mtu = mtu::gather(&ns);
    Ok(inputs)
}

/// `nattrace doctor`: prints the report, returns the exit status (0 fine,
/// 1 Service traffic breaks, 2 could not look).
pub fn run(netns: Option<&str>, json: bool) -> u8 {
    let inputs = match gather(netns) {
        Ok(i) => i,
        Err(err) => {
            crate::output::clean::say(err);
            return 2;
        }
    };
    let report = assess(&inputs);
    if json {
        println!(
            "{}",
            serde_json::json!({
                "kind": "doctor",
                "netns": report.netns,
                "breaks_services": report.breaks_services(),
                "findings": report.findings,
            })
        );
    } else {
        // Interface and Service names are the node's: sanitized.
        print!("{}", crate::output::clean::sanitize(&report.text()));
    }
    u8::from(report.breaks_services())
}

pub mod conntrack_stats;
pub mod ipv6;
pub mod mtu;
mod north_south;
#[cfg(test)]
mod tests;
