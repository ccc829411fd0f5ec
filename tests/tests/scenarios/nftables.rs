//! kube-proxy in nftables mode: the lab's ruleset really loads and really
//! forwards and rejects, nattrace's reader fixture is what `nft -j` prints for
//! it, and `doctor` reports the mode. The seed scenarios themselves run in
//! both modes from scenarios.rs.
use super::doctor::{doctor, finding};
use super::*;
use lab::ProxyMode;
use lab::kube_proxy_nft::{endpoint_chain, service_chain};

/// A Service without endpoints (kube-proxy rejects it).
pub(crate) const EMPTY_SVC_IP: Ipv4Addr = Ipv4Addr::new(100, 67, 40, 7);

/// The lab the reader fixture is captured from: seed 000, kube-dns and a
/// Service without endpoints, in nftables mode.
fn fixture_spec() -> LabSpec {
    let mut spec = presets::seed000(presets::Seed000::default())
        .service(
            lab::ServiceSpec::new(
                "kube-system",
                "kube-dns",
                "dns",
                presets::DNS_SERVICE_IP,
                53,
                Protocol::Udp,
            )
            .endpoint(presets::BACKEND_POD, 53),
        )
        .service(lab::ServiceSpec::new(
            "default",
            "empty",
            "http",
            EMPTY_SVC_IP,
            80,
            Protocol::Tcp,
        ));
    spec.kube_proxy.mode = ProxyMode::Nftables;
    spec
}

const FIXTURE: &str = "ruleset/lab_nft.json";
/// Set to rewrite the fixture from the live lab instead of comparing.
const WRITE_FIXTURE_ENV: &str = "NATTRACE_WRITE_FIXTURE";

/// `nft -j list ruleset` without the metainfo object (nft's version).
fn without_metainfo(mut v: Value) -> Value {
    if let Some(items) = v["nftables"].as_array_mut() {
        items.retain(|i| i.get("metainfo").is_none());
    }
    zero_counters(&mut v);
    v
}

/// Rule counters (iptables-nft adds one to every rule) count whatever the
/// lab's set-up sent, more or less of it on a busy machine: not the ruleset.
fn zero_counters(v: &mut Value) {
    match v {
        Value::Object(map) => {
            for (key, value) in map.iter_mut() {
                if key == "counter" && value.is_object() {
                    *value = serde_json::json!({"packets": 0, "bytes": 0});
                } else {
                    zero_counters(value);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(zero_counters),
        _ => {}
    }
}

/// tracer-userspace's nftables reader is unit-tested against this lab's
/// ruleset as `nft -j` prints it. Regenerate with
/// `NATTRACE_WRITE_FIXTURE=1 cargo test -p nattrace-tests --test scenarios root_nft_reader_fixture_is_the_labs_nft_json`.
#[test]
fn root_nft_reader_fixture_is_the_labs_nft_json() {
    require_root!();
    let lab = build_lab(fixture_spec());
    let live = lab
        .run(presets::NODE_A, &["nft", "-j", "list", "ruleset"])
        .expect("nft -j list ruleset");
    let path = lab::fixtures_dir().join(FIXTURE);
    if std::env::var_os(WRITE_FIXTURE_ENV).is_some() {
        let pretty = serde_json::to_string_pretty(&serde_json::from_str::<Value>(&live).unwrap());
        std::fs::write(&path, pretty.unwrap() + "\n").expect("writing the fixture");
        return;
    }
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(
        without_metainfo(serde_json::from_str(&live).unwrap()),
        without_metainfo(fixture),
        "regenerate {FIXTURE}: {WRITE_FIXTURE_ENV}=1 cargo test -p nattrace-tests --test scenarios root_nft_reader_fixture_is_the_labs_nft_json"
    );
}

/// The rendered ruleset loads, DNATs through kube-proxy's chains, and
/// rejects a Service without endpoints at once (connection refused).
#[test]
fn root_nft_lab_forwards_and_rejects_like_kube_proxy() {
    require_root!();
    let lab = build_lab(fixture_spec());
    let ruleset = lab
        .run(presets::NODE_A, &["nft", "list", "ruleset"])
        .unwrap();
    let name = "default/web:http";
    let backend = format!("{}:80", presets::BACKEND_IP);
    for want in [
        "table ip kube-proxy".to_string(),
        "type nat hook prerouting priority dstnat; policy accept;".to_string(),
        "type filter hook forward priority filter; policy accept;".to_string(),
        service_chain(name, Protocol::Tcp),
        endpoint_chain(name, Protocol::Tcp, &backend),
        r#"comment "default/empty:http" : goto reject-chain"#.to_string(),
    ] {
        assert!(ruleset.contains(&want), "{want} missing:\n{ruleset}");
    }
    // kube-proxy in nftables mode writes no iptables rules; kubelet's
    // canary and flannel's chains stay in iptables, as on a real node.
    let nat = lab.iptables_save(presets::NODE_A).unwrap_or_default();
    for theirs in [
        "KUBE-SERVICES",
        "KUBE-SVC-",
        "KUBE-SEP-",
        "KUBE-PROXY-CANARY",
    ] {
        assert!(!nat.contains(theirs), "{theirs} in:\n{nat}");
    }
    assert!(nat.contains("KUBE-KUBELET-CANARY"), "{nat}");
    assert!(nat.contains("FLANNEL-POSTRTG"), "{nat}");
    assert!(curl(&lab, presets::CLIENT_POD), "the Service answers");
    let refused = lab
        .http_get(
            presets::CLIENT_POD,
            EMPTY_SVC_IP,
            80,
            Duration::from_secs(3),
        )
        .unwrap();
    // curl exit 7: connection refused (ICMP port unreachable from reject-chain), not a timeout (28).
    assert_eq!(refused.status.code(), Some(7), "{refused:?}");
}

#[test]
fn root_nft_doctor_reports_mode_services_and_masquerade() {
    require_root!();
    let mut spec = presets::seed000(presets::Seed000::default());
    spec.kube_proxy.mode = ProxyMode::Nftables;
    let lab = build_lab(spec);
    let (_, report) = doctor(&lab);
    let mode = finding(&report, "kube_proxy_mode");
    assert_eq!(mode["value"], "kube-proxy=nftables", "{report}");
    assert!(
        mode["message"]
            .as_str()
            .unwrap()
            .contains("nftables mode (1 Services"),
        "{report}"
    );
    let masq = finding(&report, "masquerade_all");
    assert_eq!(masq["value"], "masqueradeAll=false", "{report}");
    assert!(
        masq["message"]
            .as_str()
            .unwrap()
            .contains(&presets::CLUSTER_CIDR.to_string()),
        "{report}"
    );
}
