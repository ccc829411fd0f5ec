//! Traffic from outside the cluster (issue 24): the node's NodePorts (and
//! the addresses kube-proxy accepts them on, as its rules say), LoadBalancer
//! and external IPs, and the externalTrafficPolicy: Local Services that have
//! no endpoint here, whose traffic entering at this node is dropped.
use super::{Finding, Inputs, Severity, finding};
use crate::ruleset::external::{ExternalKind, ExternalRule, TrafficPolicy};

const FIX_ENTRY: &str = "nothing to fix: what kube-proxy accepts from outside the cluster on this node; trace one with nattrace --svc NAMESPACE/NAME";
const FIX_NO_LOCAL: &str = "run an endpoint of the Service on this node, or make sure the load balancer's health check on healthCheckNodePort keeps this node out of rotation, or set externalTrafficPolicy: Cluster";

fn policy(e: &ExternalRule) -> &'static str {
    match e.policy {
        TrafficPolicy::Cluster => "Cluster",
        TrafficPolicy::Local => "Local",
        TrafficPolicy::Unknown => "policy unknown",
    }
}

fn describe(e: &ExternalRule) -> String {
    match e.ip {
        Some(ip) => format!("{} {ip}:{}/{} ({})", e.name, e.port, e.proto, policy(e)),
        None => format!("{} {}/{} ({})", e.name, e.port, e.proto, policy(e)),
    }
}

pub(super) fn findings(i: &Inputs) -> Vec<Finding> {
    let ns = &i.kube_proxy.north_south;
    if ns.is_empty() {
        return Vec::new();
    }
    let of = |k: &[ExternalKind]| -> Vec<String> {
        let mut v: Vec<String> = ns
            .external
            .iter()
            .filter(|e| k.contains(&e.kind))
            .map(describe)
            .collect();
        v.sort();
        v.dedup();
        v
    };
    let nodeports = of(&[ExternalKind::NodePort]);
    let lb = of(&[
        ExternalKind::LoadBalancer,
        ExternalKind::LoadBalancerOrExternalIp,
    ]);
    let ext = of(&[ExternalKind::ExternalIp]);
    let at = if ns.nodeport_addresses.is_empty() {
        "no NodePort rule".to_string()
    } else {
        ns.nodeport_addresses.join(", ")
    };
    let mut msg = format!(
        "{} NodePorts, accepted on {at} (kube-proxy --nodeport-addresses as its rules show it)",
        nodeports.len()
    );
    for (what, list) in [
        ("NodePorts", &nodeports),
        ("LoadBalancer IPs", &lb),
        ("external IPs", &ext),
    ] {
        if !list.is_empty() {
            let names: Vec<&str> = list.iter().map(String::as_str).collect();
            msg.push_str(&format!("; {what}: {}", super::first_few(&names, ", ")));
        }
    }
    let mut out = vec![finding(
        "north_south",
        Severity::Info,
        format!(
            "nodeports={} lb_ips={} external_ips={} nodeport_addresses={}",
            nodeports.len(),
            lb.len(),
            ext.len(),
            at.replace(' ', "_")
        ),
        msg,
        FIX_ENTRY,
    )];
    let no_local: Vec<&ExternalRule> = ns
        .external
        .iter()
        .filter(|e| e.no_local_endpoints.is_some())
        .collect();
    if let Some(first) = no_local.first() {
        let list: Vec<String> = no_local.iter().map(|e| describe(e)).collect();
        let names: Vec<&str> = list.iter().map(String::as_str).collect();
        out.push(finding(
            "no_local_endpoints",
            Severity::Warning,
            format!("no_local_endpoints={}", no_local.len()),
            format!(
                "externalTrafficPolicy: Local with no endpoint on this node, traffic entering here is dropped (clients time out): {}; e.g. `{}`",
                super::first_few(&names, ", "),
                first.no_local_endpoints.as_deref().unwrap_or_default()
            ),
            FIX_NO_LOCAL,
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ruleset::{external::tests::SAVE, parse_save};

    #[test]
    fn lists_entries_and_warns_of_local_policy_without_local_endpoint() {
        let mut i = Inputs {
            kube_proxy: parse_save(SAVE),
            ..Inputs::default()
        };
        i.kube_proxy.north_south.node_addresses = vec!["192.168.50.2".parse().unwrap()];
        let f = findings(&i);
        assert_eq!(f.len(), 2, "{f:#?}");
        assert_eq!(
            f[0].value,
            "nodeports=2 lb_ips=1 external_ips=1 nodeport_addresses=addrtype_LOCAL"
        );
        assert!(
            f[0].message.contains("ns/loc:http 30091/tcp (Local)"),
            "{}",
            f[0].message
        );
        assert!(
            f[0].message
                .contains("ns/np:http 203.0.113.10:80/tcp (Cluster)"),
            "{}",
            f[0].message
        );
        assert_eq!(f[1].check, "no_local_endpoints");
        assert_eq!(f[1].severity, Severity::Warning);
        assert!(
            f[1].message.contains("has no local endpoints"),
            "{}",
            f[1].message
        );
        // No north-south rules: no finding.
        assert!(findings(&Inputs::default()).is_empty());
    }
}
