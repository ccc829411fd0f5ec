//! `nattrace doctor`, foreign namespaces, and the ruleset fixture's sync.
use super::*;

// ---------------------------------------------------------------- 7: doctor

pub(crate) fn doctor(lab: &Lab) -> (Option<i32>, Value) {
    lab::tracer::doctor(lab, presets::NODE_A)
}

pub(crate) fn finding<'a>(report: &'a Value, check: &str) -> &'a Value {
    report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["check"] == check)
        .unwrap_or_else(|| panic!("no {check} finding: {report}"))
}

#[test]
fn root_doctor_finds_bridge_nf_off_and_passes_a_healthy_node() {
    require_root!();
    let broken = build_lab(presets::seed000(presets::Seed000 {
        bridge_nf_call_iptables: false,
        backend: Backend::SameNode,
    }));
    let (code, report) = doctor(&broken);
    assert_eq!(code, Some(1), "{report}");
    assert_eq!(
        finding(&report, "bridge_nf_call_iptables")["severity"],
        "error"
    );
    assert!(finding(&report, "bridge_nf_call_iptables")["fix"].is_string());
    assert_eq!(finding(&report, "hairpin_mode")["severity"], "warning");
    assert_eq!(
        finding(&report, "kube_proxy_mode")["value"],
        "kube-proxy=iptables"
    );
    assert_eq!(
        finding(&report, "masquerade_all")["value"],
        "masqueradeAll=false"
    );
    drop(broken);

    let healthy = build_lab(presets::hairpin(presets::Hairpin::default()));
    let (code, report) = doctor(&healthy);
    assert_eq!(code, Some(0), "{report}");
    assert_eq!(
        finding(&report, "bridge_nf_call_iptables")["severity"],
        "ok"
    );
    assert_eq!(finding(&report, "hairpin_mode")["severity"], "ok");
    assert_eq!(finding(&report, "ip_forward")["severity"], "ok");
    assert!(
        finding(&report, "conntrack")["value"]
            .as_str()
            .unwrap()
            .starts_with("conntrack=")
    );
}

// ------------------------------------------------- foreign namespaces

#[test]
fn root_same_service_in_another_lab_is_foreign_not_a_flow() {
    require_root!();
    let _lock = tracing_lock();
    let traced = build_lab(presets::seed000(presets::Seed000::default()));
    let other = build_lab(presets::seed000(presets::Seed000::default()));
    let done = trace(&traced, presets::NODE_A, &web_svc(), &[], || {
        assert!(curl(&other, presets::CLIENT_POD));
    });
    assert!(flows(&done).is_empty(), "{}", done.describe());
    let summary = done.summary().unwrap();
    assert!(summary["foreign_flows"].as_u64().unwrap() >= 1, "{summary}");
    // No flow of this node's own to the traced Service: 4 (README).
    assert_eq!(done.status.code(), Some(4), "{}", done.describe());
}

// ----------------------------------------------- ruleset fixture in sync

/// tracer-userspace's ruleset parser is unit-tested against this lab's
/// rendered rules; the copy it reads must not drift from the renderer.
#[test]
fn ruleset_fixture_matches_the_lab_renderer() {
    let spec = presets::seed000(presets::Seed000::default()).service(
        lab::ServiceSpec::new(
            "kube-system",
            "kube-dns",
            "dns",
            presets::DNS_SERVICE_IP,
            53,
            Protocol::Udp,
        )
        .endpoint(presets::BACKEND_POD, 53),
    );
    let rendered = render(&spec);
    let path = lab::fixtures_dir().join("ruleset/lab_nat.txt");
    if std::env::var_os("NATTRACE_REGEN_FIXTURES").is_some() {
        std::fs::write(&path, &rendered).expect("writing the fixture");
    }
    let fixture = std::fs::read_to_string(&path).unwrap_or_default();
    assert_eq!(
        rendered, fixture,
        "regenerate with NATTRACE_REGEN_FIXTURES=1 cargo test -p nattrace-tests --test scenarios ruleset_fixture"
    );
}

/// The whole-node rendering (filter with a no-endpoints REJECT, nat, mangle,
/// flannel's chains) the ruleset reader's `parse_save` is tested against.
#[test]
fn node_ruleset_fixture_matches_the_lab_renderer() {
    let spec = presets::no_endpoints();
    let rendered = lab::kube_proxy::render_node(
        &spec.kube_proxy,
        &resolve(&spec),
        lab::kube_proxy::NodeNet {
            pod_cidr: spec.nodes[0].pod_cidr,
            cluster_network: presets::CLUSTER_CIDR,
        },
    );
    let path = lab::fixtures_dir().join("ruleset/lab_node.txt");
    if std::env::var_os("NATTRACE_REGEN_FIXTURES").is_some() {
        std::fs::write(&path, &rendered).expect("writing the fixture");
    }
    let fixture = std::fs::read_to_string(path).unwrap_or_default();
    assert_eq!(
        rendered, fixture,
        "regenerate with NATTRACE_REGEN_FIXTURES=1 cargo test -p nattrace-tests --test scenarios ruleset_fixture"
    );
}

fn render(spec: &LabSpec) -> String {
    lab::kube_proxy::render_nat(&spec.kube_proxy, &resolve(spec))
}

fn resolve(spec: &LabSpec) -> Vec<lab::kube_proxy::ResolvedService> {
    let ip = |pod: &str| {
        spec.nodes
            .iter()
            .flat_map(|n| &n.pods)
            .find(|p| p.name == pod)
            .map(|p| std::net::IpAddr::V4(p.ip))
            .unwrap()
    };
    spec.services
        .iter()
        .map(|s| lab::kube_proxy::ResolvedService {
            port_name: s.port_name_string(),
            cluster_ip: s.cluster_ip.into(),
            port: s.port,
            protocol: s.protocol,
            endpoints: s.endpoints.iter().map(|e| (ip(&e.pod), e.port)).collect(),
            pinned: s.pinned,
            node_port: s.node_port,
            external: Default::default(),
            local: Vec::new(),
        })
        .collect()
}
