//! A Service without endpoints on a bridged node (issue 10 item 5):
//! kube-proxy's filter REJECT drops the SYN and answers ICMP port
//! unreachable; nattrace names the Service and the rule, not "no reply".
use super::*;

fn empty_svc() -> String {
    format!("{}:{}", presets::EMPTY_SERVICE_IP, presets::WEB_PORT)
}

/// Traces the empty Service while the client curls it; the recording goes
/// to `write` when given (how `tracer-userspace/fixtures/no_endpoints.rec` was made).
pub(super) fn no_endpoints_trace(lab: &Lab, write: Option<&std::path::Path>) -> Finished {
    let write_arg = write.map(|p| p.display().to_string());
    let mut extra: Vec<&str> = Vec::new();
    if let Some(w) = &write_arg {
        extra.extend(["--write", w.as_str()]);
    }
    trace(lab, presets::NODE_A, &empty_svc(), &extra, || {
        let out = lab
            .http_get(
                presets::CLIENT_POD,
                presets::EMPTY_SERVICE_IP,
                presets::WEB_PORT,
                CLIENT_TIMEOUT,
            )
            .expect("curl");
        // curl: (7) Failed to connect ... Connection refused — at once.
        assert_eq!(
            out.status.code(),
            Some(7),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    })
}

fn service_without_endpoints(mode: ProxyMode) {
    let _lock = tracing_lock();
    let lab = build_in(mode, presets::no_endpoints());
    let record = std::env::var_os("NATTRACE_RECORD_NO_ENDPOINTS")
        .filter(|_| mode == ProxyMode::Iptables)
        .map(std::path::PathBuf::from);
    let done = no_endpoints_trace(&lab, record.as_deref());
    let f = done.only_flow();
    assert_common(&f, "dropped", Some("no_endpoints"), &done);
    // Named in both modes although no Service chain DNATs it (issue 28).
    assert_eq!(
        f["k8s_service"],
        "default/web-empty:http",
        "{}",
        done.describe()
    );
    let why = f["cause_text"].as_str().expect("cause text");
    // The rule as each mode shows it: iptables-save's REJECT line, or the
    // no-endpoint-services element of kube-proxy's nftables table.
    let rule: &[&str] = match mode {
        ProxyMode::Iptables => &["-A KUBE-SERVICES -d 100.67.30.140/32", "-j REJECT"],
        ProxyMode::Nftables => &["no-endpoint-services"],
    };
    for needle in [
        "default/web-empty:http",
        "ICMP port unreachable",
        "kubectl get endpointslices -n default -l kubernetes.io/service-name=web-empty",
    ]
    .iter()
    .chain(rule)
    {
        assert!(why.contains(needle), "{needle:?} missing: {why}");
    }
    assert!(f["backend"].is_null(), "{f}");
    assert_eq!(done.status.code(), Some(1), "{}", done.describe());
}

both_modes!(service_without_endpoints:
    root_service_without_endpoints_is_no_endpoints_naming_service_and_rule,
    root_service_without_endpoints_is_no_endpoints_naming_service_and_rule_nft);
