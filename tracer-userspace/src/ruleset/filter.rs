//! The filter side of kube-proxy's iptables rules: REJECTs for Service
//! ports without endpoints, and splitting a whole `iptables-save` dump into
//! its tables.
use super::{KubeProxyRules, RejectRule, host, parse_nat, parse_rule};

/// The `*table` section of an `iptables-save` dump (empty if absent).
fn section<'a>(text: &'a str, table: &str) -> Vec<&'a str> {
    let header = format!("*{table}");
    let mut inside = false;
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim_end();
        if line.starts_with('*') {
            inside = line == header;
        } else if line == "COMMIT" {
            inside = false;
        } else if inside {
            out.push(line);
        }
    }
    out
}

/// kube-proxy's `"<ns/name:port> has no endpoints"` REJECTs in filter
/// `KUBE-SERVICES` (ClusterIPs and external IPs; NodePort rejects in
/// `KUBE-EXTERNAL-SERVICES` match no address and are left out).
pub fn parse_filter_rejects(filter_lines: &[&str]) -> Vec<RejectRule> {
    let mut out = Vec::new();
    for line in filter_lines {
        let Some(r) = parse_rule(line) else { continue };
        if !matches!(r.chain.as_str(), "KUBE-SERVICES" | "KUBE-EXTERNAL-SERVICES")
            || r.jump.as_deref() != Some("REJECT")
        {
            continue;
        }
        let (Some(dst), Some(port), Some(proto), Some(comment)) =
            (&r.dst, r.dport, &r.proto, &r.comment)
        else {
            continue;
        };
        let Some(port_name) = comment.strip_suffix(" has no endpoints") else {
            continue;
        };
        let Some(ip) = host(dst) else { continue };
        out.push(RejectRule {
            ip,
            port,
            protocol: proto.clone(),
            port_name: super::port_label(port_name, port),
            rule: line.to_string(),
        });
    }
    out
}

/// Parses a whole `iptables-save` dump (either backend): Services from the
/// nat table, no-endpoint REJECTs from the filter table. A dump of only
/// `-A` lines (no `*table` headers) is read as a nat table.
pub fn parse_save(text: &str) -> KubeProxyRules {
    if !text.lines().any(|l| l.starts_with('*')) {
        return parse_nat(text);
    }
    let nat = section(text, "nat").join("\n");
    let mut rules = parse_nat(&nat);
    let filter = section(text, "filter");
    rules.no_endpoints = parse_filter_rejects(&filter);
    let ipv6 = rules.services.iter().any(|s| s.cluster_ip.is_ipv6()) || text.contains("::1/128");
    super::external::from_filter(&filter, &mut rules.north_south, ipv6);
    rules.filter_drops = super::firewall::parse_filter_drops(&filter);
    if rules.mode == super::ProxyMode::None && !rules.no_endpoints.is_empty() {
        rules.mode = super::ProxyMode::Iptables;
    }
    rules
}
