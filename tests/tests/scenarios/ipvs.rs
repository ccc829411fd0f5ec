//! Item 7 of issue 10: a node whose Services are load-balanced by IPVS, not
//! netfilter NAT (kube-proxy `--proxy-mode=ipvs` binds every ClusterIP to the
//! `kube-ipvs0` dummy device). nattrace must say so at start and in
//! `doctor`, instead of verdicts about a NAT that never happens. This
//! machine has no ip_vs module (and the root namespace is not ours to change),
//! so the lab has the device and its address, not an IPVS virtual server.
use super::doctor::{doctor, finding};
use super::*;

/// kube-proxy's `default/kubernetes:https` address on an IPVS node.
const IPVS_SVC_IP: Ipv4Addr = Ipv4Addr::new(100, 64, 0, 1);
/// Its IPv6 ClusterIP when the cluster is dual-stack.
const IPVS_SVC_IP6: &str = "fd00:10:96::1";

fn ipvs_node() -> Lab {
    let lab = build_lab(presets::seed000(presets::Seed000::default()));
    // kube-proxy makes it a dummy device; kernels without the dummy driver
    // (this CI machine's) get a port-less bridge of the same name, which is
    // all detection looks at: the name and its addresses.
    let dummy = lab.exec(
        presets::NODE_A,
        &["ip", "link", "add", "kube-ipvs0", "type", "dummy"],
    );
    if !dummy.is_ok_and(|o| o.status.success()) {
        lab.run(
            presets::NODE_A,
            &["ip", "link", "add", "kube-ipvs0", "type", "bridge"],
        )
        .expect("kube-ipvs0");
    }
    let addr = format!("{IPVS_SVC_IP}/32");
    lab.run(
        presets::NODE_A,
        &["ip", "addr", "add", &addr, "dev", "kube-ipvs0"],
    )
    .expect("kube-ipvs0 address");
    lab
}

#[test]
fn root_ipvs_node_is_detected_at_start_and_in_doctor() {
    require_root!();
    let _lock = tracing_lock();
    let lab = ipvs_node();
    // doctor, which traces no IP, names IPVS for the node.
    let (_, report) = doctor(&lab);
    let f = finding(&report, "service_nat");
    assert_eq!(f["severity"], "warning", "{report}");
    assert_eq!(f["value"], "service_nat=ipvs", "{report}");
    assert!(
        f["message"]
            .as_str()
            .unwrap()
            .contains("kube-ipvs0 holds 1 address(es)"),
        "{report}"
    );
    // Dual-stack: kube-proxy binds the Service's IPv6 ClusterIP to
    // kube-ipvs0 too; tracing both addresses checks each.
    let addr6 = format!("{IPVS_SVC_IP6}/128");
    lab.run(
        presets::NODE_A,
        &["ip", "addr", "add", &addr6, "dev", "kube-ipvs0", "nodad"],
    )
    .expect("kube-ipvs0 IPv6 address");
    let svc = format!("{IPVS_SVC_IP}:443");
    let svc6 = format!("[{IPVS_SVC_IP6}]:443");
    let done = trace(&lab, presets::NODE_A, &svc, &["--svc", &svc6], || {
        // Nothing serves it here (no ip_vs): the connection fails either way.
        let _ = lab
            .http_get(presets::CLIENT_POD, IPVS_SVC_IP, 443, CLIENT_TIMEOUT)
            .expect("running curl");
    });
    let warning: Vec<&str> = done
        .stderr
        .lines()
        .filter(|l| l.contains("not by netfilter NAT"))
        .collect();
    assert_eq!(warning.len(), 1, "one line at start:\n{}", done.describe());
    assert!(
        warning[0].starts_with("nattrace: warning: 100.64.0.1 is translated by IPVS")
            && warning[0].contains("kube-ipvs0 holds 100.64.0.1"),
        "{}",
        done.describe()
    );
    assert!(
        warning[0].contains(
            "fd00:10:96::1 is translated by IPVS (kube-proxy --proxy-mode=ipvs: kube-ipvs0 holds fd00:10:96::1)"
        ),
        "{}",
        done.describe()
    );
    // The JSON start line carries it too, for a reader of stdout alone.
    let start: Value = serde_json::from_str(&done.stdout[0]).unwrap();
    assert_eq!(start["kind"], "start", "{}", done.describe());
    assert!(
        start["checks_line"]
            .as_str()
            .unwrap()
            .contains("service_nat=not-netfilter (warning)"),
        "{start}"
    );

    // Without ip_vs the node's own stack answers the address with a RST:
    // refused. The flow blames no netfilter NAT: it says that IPVS
    // translates this Service.
    let f = done.only_flow();
    assert_eq!(f["service"], svc, "{f}");
    assert_common(&f, "refused", Some("service_not_netfilter"), &done);
    let why = f["cause_text"].as_str().unwrap();
    assert!(why.contains("kube-ipvs0 holds 100.64.0.1"), "{f}");

    // doctor counts both families' addresses.
    let (_, report) = doctor(&lab);
    let f = finding(&report, "service_nat");
    assert!(
        f["message"]
            .as_str()
            .unwrap()
            .contains("kube-ipvs0 holds 2 address(es)"),
        "{report}"
    );
}

/// The same node traced at a Service kube-proxy's NAT rules do translate:
/// no IPVS warning, the flow is judged as usual.
#[test]
fn root_ipvs_device_does_not_mark_services_netfilter_translates() {
    require_root!();
    let _lock = tracing_lock();
    let lab = ipvs_node();
    let done = trace(&lab, presets::NODE_A, &web_svc(), &[], || {
        assert!(curl(&lab, presets::CLIENT_POD));
    });
    assert!(
        !done.stderr.contains("not by netfilter NAT"),
        "{}",
        done.describe()
    );
    let f = done.only_flow();
    assert_common(&f, "ok", None, &done);
}
