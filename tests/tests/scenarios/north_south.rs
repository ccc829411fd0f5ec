//! Traffic from outside the cluster (issue 24): the seed 003 lab's outside
//! client, behind the router, reaches `default/web:http` at node-b's
//! address on its NodePort, or at a LoadBalancer / external IP the router
//! sends to node-b. Traced on node-b by name (`--svc default/web`), in
//! kube-proxy's iptables mode with its exact NodePort / KUBE-EXT- /
//! KUBE-SVL- / "has no local endpoints" shapes.
use std::net::Ipv4Addr;

use lab::{ExternalSpec, node_underlay_ip};

use super::*;

const NODE_PORT: u16 = 30090;
const HEALTH_CHECK_NODE_PORT: u16 = 32090;
/// Inside the Service CIDR the router sends to node-b (seed 003's route).
const LB_IP: Ipv4Addr = Ipv4Addr::new(100, 67, 30, 200);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(100, 67, 30, 201);

#[derive(Clone, Copy, PartialEq)]
enum Endpoints {
    /// Only BACKEND_POD, on node-a.
    Remote,
    /// Only REMOTE_BACKEND_POD, on node-b (the traced node).
    Local,
}

fn lab(mode: ProxyMode, local_policy: bool, endpoints: Endpoints) -> Lab {
    build_in(mode, spec(local_policy, endpoints, true))
}

/// Seed 003 with `default/web` as a NodePort (and, with `outside_ips`, a
/// LoadBalancer IP and an external IP) whose only endpoint is `endpoints`.
fn spec(local_policy: bool, endpoints: Endpoints, outside_ips: bool) -> lab::LabSpec {
    let mut spec = presets::seed003(presets::Seed003::default());
    let web = &mut spec.services[0];
    let keep = match endpoints {
        Endpoints::Remote => presets::BACKEND_POD,
        Endpoints::Local => presets::REMOTE_BACKEND_POD,
    };
    web.endpoints.retain(|e| e.pod == keep);
    web.pinned = None;
    web.node_port = Some(NODE_PORT);
    web.external = ExternalSpec {
        local_policy,
        external_ips: if outside_ips {
            vec![EXTERNAL_IP]
        } else {
            Vec::new()
        },
        lb_ips: if outside_ips { vec![LB_IP] } else { Vec::new() },
        health_check_node_port: local_policy.then_some(HEALTH_CHECK_NODE_PORT),
    };
    spec
}

fn node_b() -> Ipv4Addr {
    node_underlay_ip(1)
}

/// curl from the outside client; Some(exit code).
fn outside_get(lab: &Lab, ip: Ipv4Addr, port: u16) -> Option<i32> {
    lab.http_get(lab::OUTSIDE, ip, port, CLIENT_TIMEOUT)
        .expect("running curl")
        .status
        .code()
}

fn by_name(mode: ProxyMode, lab: &Lab, to: Ipv4Addr, port: u16, expect_code: i32) -> Finished {
    let done = trace(lab, presets::NODE_B, "default/web", &[], || {
        assert_eq!(
            outside_get(lab, to, port),
            Some(expect_code),
            "curl {to}:{port}"
        );
    });
    // The start says what the name resolved to: every address of the Service.
    let line = done
        .stderr
        .lines()
        .find(|l| l.contains("--svc default/web resolves to"))
        .unwrap_or_else(|| panic!("no resolution line: {}", done.describe()));
    // nftables mode sends both to one `external-` chain from `service-ips`:
    // its rules do not say which kind an address is.
    let (lb, ext) = match mode {
        ProxyMode::Iptables => ("LoadBalancer IP", "externalIP"),
        ProxyMode::Nftables => (
            "LoadBalancer IP or externalIP",
            "LoadBalancer IP or externalIP",
        ),
    };
    for want in [
        format!(
            "{}:80 (default/web:http ClusterIP/tcp)",
            presets::WEB_SERVICE_IP
        ),
        format!("{}:{NODE_PORT} (default/web:http NodePort/tcp)", node_b()),
        format!("{LB_IP}:80 (default/web:http {lb}/tcp)"),
        format!("{EXTERNAL_IP}:80 (default/web:http {ext}/tcp)"),
    ] {
        assert!(line.contains(&want), "{want} missing: {line}");
    }
    done
}

fn assert_outside_client(f: &Value) {
    assert_eq!(ip_of(&f["client"]), presets::OUTSIDE_CLIENT.addr(), "{f}");
    assert_eq!(f["k8s_service"], "default/web:http", "{f}");
}

both_modes!(nodeport_local_no_local: root_nodeport_local_policy_without_local_endpoint_is_no_local_endpoints, root_nodeport_local_policy_without_local_endpoint_is_no_local_endpoints_nft);
fn nodeport_local_no_local(mode: ProxyMode) {
    let _lock = tracing_lock();
    let lab = lab(mode, true, Endpoints::Remote);
    // The client's symptom first: kube-proxy's DROP answers nothing, curl
    // times out (28), it is not refused (7).
    let done = by_name(mode, &lab, node_b(), NODE_PORT, 28);
    let f = done.only_flow();
    assert_common(&f, "dropped", Some("no_local_endpoints"), &done);
    assert_outside_client(&f);
    assert_eq!(f["service"], format!("{}:{NODE_PORT}", node_b()), "{f}");
    assert!(f["backend"].is_null(), "never DNATed: {f}");
    let all = f.to_string();
    assert!(all.contains("has no local endpoints"), "{all}");
    assert!(all.contains("filter INPUT"), "the hook: {all}");
    // iptables mode writes the health check node port's ACCEPT; the
    // nftables proxier has no rule for it, so the fix says how to find it.
    let health = match mode {
        ProxyMode::Iptables => format!("healthCheckNodePort {HEALTH_CHECK_NODE_PORT}"),
        ProxyMode::Nftables => ".spec.healthCheckNodePort".to_string(),
    };
    assert!(all.contains(&health), "{all}");
    assert!(all.contains("externalTrafficPolicy: Cluster"), "{all}");
    assert_eq!(done.status.code(), Some(1), "{}", done.describe());
}

both_modes!(lb_local_no_local: root_lb_ip_local_policy_without_local_endpoint_is_dropped_in_forward, root_lb_ip_local_policy_without_local_endpoint_is_dropped_in_forward_nft);
fn lb_local_no_local(mode: ProxyMode) {
    let _lock = tracing_lock();
    let lab = lab(mode, true, Endpoints::Remote);
    let done = by_name(mode, &lab, LB_IP, 80, 28);
    let f = done.only_flow();
    assert_common(&f, "dropped", Some("no_local_endpoints"), &done);
    assert_outside_client(&f);
    assert!(f.to_string().contains("filter FORWARD"), "{f}");
}

both_modes!(nodeport_local_with_local: root_nodeport_local_policy_with_local_endpoint_keeps_the_client_address, root_nodeport_local_policy_with_local_endpoint_keeps_the_client_address_nft);
fn nodeport_local_with_local(mode: ProxyMode) {
    let _lock = tracing_lock();
    let lab = lab(mode, true, Endpoints::Local);
    let done = by_name(mode, &lab, node_b(), NODE_PORT, 0);
    let f = done.only_flow();
    assert_common(&f, "ok", None, &done);
    assert_outside_client(&f);
    assert_eq!(
        f["backend"],
        format!("{}:80", presets::REMOTE_BACKEND_IP),
        "{f}"
    );
    assert!(f["snat"].is_null(), "Local policy is not masqueraded: {f}");
}

both_modes!(nodeport_cluster_remote: root_nodeport_cluster_policy_remote_backend_is_dnated_and_snated, root_nodeport_cluster_policy_remote_backend_is_dnated_and_snated_nft);
fn nodeport_cluster_remote(mode: ProxyMode) {
    let _lock = tracing_lock();
    let lab = lab(mode, false, Endpoints::Remote);
    let done = by_name(mode, &lab, node_b(), NODE_PORT, 0);
    let f = done.only_flow();
    assert_common(&f, "ok", None, &done);
    assert_outside_client(&f);
    assert_eq!(f["backend"], format!("{}:80", presets::BACKEND_IP), "{f}");
    assert!(f["snat"].is_string(), "Cluster policy masquerades: {f}");
}

both_modes!(external_ip_cluster_local: root_external_ip_cluster_policy_local_backend_is_ok, root_external_ip_cluster_policy_local_backend_is_ok_nft);
fn external_ip_cluster_local(mode: ProxyMode) {
    let _lock = tracing_lock();
    let lab = lab(mode, false, Endpoints::Local);
    let done = by_name(mode, &lab, EXTERNAL_IP, 80, 0);
    let f = done.only_flow();
    assert_common(&f, "ok", None, &done);
    assert_outside_client(&f);
    assert_eq!(
        f["backend"],
        format!("{}:80", presets::REMOTE_BACKEND_IP),
        "{f}"
    );
}

#[test]
fn root_unknown_service_name_names_the_nearest_and_exits_2() {
    require_root!();
    let lab = lab(ProxyMode::Iptables, false, Endpoints::Local);
    let ns = lab.node_netns(presets::NODE_B).expect("node").path();
    let out = std::process::Command::new(nattrace())
        .args(["--svc", "default/wbe", "--netns"])
        .arg(ns)
        .output()
        .expect("nattrace");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(
        err.contains("no Service default/wbe") && err.contains("nearest: default/web"),
        "{err}"
    );
}

both_modes!(doctor_lists: root_doctor_lists_north_south_and_local_policy_without_local_endpoint, root_doctor_lists_north_south_and_local_policy_without_local_endpoint_nft);
fn doctor_lists(mode: ProxyMode) {
    let lab = lab(mode, true, Endpoints::Remote);
    let ns = lab.node_netns(presets::NODE_B).expect("node").path();
    let out = std::process::Command::new(nattrace())
        .args(["doctor", "--output", "json", "--netns"])
        .arg(ns)
        .output()
        .expect("nattrace doctor");
    let text = String::from_utf8_lossy(&out.stdout);
    let report: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let find = |check: &str| {
        report["findings"]
            .as_array()
            .and_then(|a| a.iter().find(|f| f["check"] == check).cloned())
            .unwrap_or_else(|| panic!("no {check} finding: {report:#}"))
    };
    let entries = find("north_south");
    let msg = entries["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!("default/web:http {NODE_PORT}/tcp (Local)")),
        "{msg}"
    );
    let at = match mode {
        ProxyMode::Iptables => "accepted on addrtype LOCAL".to_string(),
        ProxyMode::Nftables => format!("accepted on {}", node_b()),
    };
    assert!(msg.contains(&at), "{msg}");
    let warn = find("no_local_endpoints");
    assert_eq!(warn["severity"], "warning", "{warn}");
    assert!(
        warn["message"]
            .as_str()
            .unwrap()
            .contains("default/web:http"),
        "{warn}"
    );
}

/// Cluster policy, the backend on node-a, and node-b's masquerade rule gone
/// (as after a half-applied restore): the request is DNATed but not SNATed,
/// node-a's backend answers the outside client directly, and node-b names
/// the missing SNAT rather than an asymmetric route.
#[test]
fn root_nodeport_cluster_policy_without_snat_is_external_not_masqueraded() {
    require_root!();
    let _lock = tracing_lock();
    let lab = lab(ProxyMode::Iptables, false, Endpoints::Remote);
    let save = lab
        .iptables_save_table(presets::NODE_B, "nat")
        .expect("iptables-save");
    // Deleted by its number in the chain (the lab's iptables backend).
    let n = save
        .lines()
        .filter(|l| l.starts_with("-A KUBE-POSTROUTING "))
        .position(|l| l.contains("-j MASQUERADE"))
        .unwrap_or_else(|| panic!("no masquerade rule: {save}"))
        + 1;
    let iptables = lab::IptablesBackend::default()
        .save()
        .trim_end_matches("-save");
    let n = n.to_string();
    let out = lab
        .exec(
            presets::NODE_B,
            &[iptables, "-t", "nat", "-D", "KUBE-POSTROUTING", &n],
        )
        .expect("iptables -D");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let after = lab.iptables_save_table(presets::NODE_B, "nat").unwrap();
    assert!(
        !after
            .lines()
            .any(|l| l.starts_with("-A KUBE-POSTROUTING ") && l.contains("MASQUERADE")),
        "{after}"
    );
    let done = by_name(ProxyMode::Iptables, &lab, node_b(), NODE_PORT, 28);
    let f = done.only_flow();
    assert_common(&f, "no_reply", Some("external_not_masqueraded"), &done);
    assert_outside_client(&f);
    assert_eq!(f["backend"], format!("{}:80", presets::BACKEND_IP), "{f}");
    assert!(f["snat"].is_null(), "{f}");
}

/// `--all-services` traces the NodePorts, LB and external IPs too, not only
/// the ClusterIPs (issue 24: it saw none of these flows).
#[test]
fn root_all_services_sees_the_nodeport_flow() {
    require_root!();
    let _lock = tracing_lock();
    let lab = lab(ProxyMode::Iptables, true, Endpoints::Remote);
    let ns = lab.node_netns(presets::NODE_B).expect("node").path();
    let mut args: Vec<String> = [
        "--all-services",
        "--netns",
        &ns.display().to_string(),
        "--reply-timeout",
        REPLY_TIMEOUT_MS,
        "--output",
        "json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(lab::tracer::record_args(None));
    let mut tracer = Nattrace::spawn(&nattrace(), &args, &[], false).expect("starting nattrace");
    tracer
        .wait_started(ATTACH_TIMEOUT)
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(outside_get(&lab, node_b(), NODE_PORT), Some(28));
    let done = tracer.finish().unwrap_or_else(|e| panic!("{e:#}"));
    let f = done.only_flow();
    assert_common(&f, "dropped", Some("no_local_endpoints"), &done);
    assert_eq!(f["service"], format!("{}:{NODE_PORT}", node_b()), "{f}");
}

/// The IPv6 half (issue 24: both families): the lab made dual-stack, the
/// outside client at `fd00:10:8::a` behind the router, node-b's NodePort
/// on its IPv6 underlay address (kube-proxy's ip6tables `KUBE-NODEPORTS`
/// behind `addrtype LOCAL`, nftables' `table ip6 kube-proxy` `nodeport-ips`).
fn lab6(mode: ProxyMode, endpoints: Endpoints) -> Lab {
    build_in(mode, spec(true, endpoints, false).dual_stack())
}

/// `--svc default/web` on node-b while the outside client curls node-b's
/// IPv6 NodePort; the flow of that address.
fn nodeport6(lab: &Lab, expect_code: i32) -> (Finished, Value) {
    let node6 = lab::dual_stack::node_underlay_ip6(1);
    let done = trace(lab, presets::NODE_B, "default/web", &[], || {
        let code = lab
            .http_get(lab::OUTSIDE, node6, NODE_PORT, CLIENT_TIMEOUT)
            .expect("running curl")
            .status
            .code();
        assert_eq!(code, Some(expect_code), "curl [{node6}]:{NODE_PORT}");
    });
    let service = format!("[{node6}]:{NODE_PORT}");
    let line = done
        .stderr
        .lines()
        .find(|l| l.contains("--svc default/web resolves to"))
        .unwrap_or_else(|| panic!("no resolution line: {}", done.describe()));
    assert!(
        line.contains(&format!("{service} (default/web:http NodePort/tcp)")),
        "the IPv6 NodePort is resolved by name: {line}"
    );
    let f = done
        .flows()
        .expect("JSON flows")
        .into_iter()
        .find(|f| f["service"] == service.as_str())
        .unwrap_or_else(|| panic!("no flow to {service}: {}", done.describe()));
    let client = format!("[{}]:", lab::dual_stack::OUTSIDE_CLIENT6.addr());
    assert!(
        f["client"].as_str().is_some_and(|c| c.starts_with(&client)),
        "the outside client's address: {f}"
    );
    (done, f)
}

both_modes!(nodeport6_local_no_local: root_ipv6_nodeport_local_policy_without_local_endpoint_is_no_local_endpoints, root_ipv6_nodeport_local_policy_without_local_endpoint_is_no_local_endpoints_nft);
fn nodeport6_local_no_local(mode: ProxyMode) {
    let _lock = tracing_lock();
    let lab = lab6(mode, Endpoints::Remote);
    // kube-proxy's DROP: curl times out (28).
    let (done, f) = nodeport6(&lab, 28);
    assert_common(&f, "dropped", Some("no_local_endpoints"), &done);
    assert!(f["backend"].is_null(), "never DNATed: {f}");
    assert!(f.to_string().contains("has no local endpoints"), "{f}");
    assert_eq!(done.status.code(), Some(1), "{}", done.describe());
}

both_modes!(nodeport6_local_with_local: root_ipv6_nodeport_local_policy_with_local_endpoint_is_ok, root_ipv6_nodeport_local_policy_with_local_endpoint_is_ok_nft);
fn nodeport6_local_with_local(mode: ProxyMode) {
    let _lock = tracing_lock();
    let lab = lab6(mode, Endpoints::Local);
    let (done, f) = nodeport6(&lab, 0);
    assert_common(&f, "ok", None, &done);
    let backend = lab::dual_stack::pod_ip6(presets::NODE_B_POD_CIDR, presets::REMOTE_BACKEND_IP);
    assert_eq!(f["backend"], format!("[{backend}]:80"), "{f}");
    assert!(f["snat"].is_null(), "Local policy is not masqueraded: {f}");
    assert_eq!(done.status.code(), Some(0), "{}", done.describe());
}
