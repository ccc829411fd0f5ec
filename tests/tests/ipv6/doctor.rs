//! `nattrace doctor` on a dual-stack node: bridge-nf-call-ip6tables, IPv6
//! forwarding, a default route learned from a real Router Advertisement
//! on a forwarding interface, and a Service whose pods have no IPv6
//! address.

use std::net::SocketAddr;
use std::time::Duration;

use super::*;
use lab::tracer::doctor;
use serde_json::Value;

fn finding<'a>(report: &'a Value, check: &str) -> &'a Value {
    report["findings"]
        .as_array()
        .and_then(|f| f.iter().find(|f| f["check"] == check))
        .unwrap_or_else(|| panic!("no {check} finding in {report}"))
}

fn severity(report: &Value, check: &str) -> String {
    finding(report, check)["severity"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The node's RA-learned default routes (`proto ra`), as `ip` shows them.
fn ra_routes(lab: &Lab) -> String {
    lab.run(
        presets::NODE_A,
        &["ip", "-6", "route", "show", "default", "proto", "ra"],
    )
    .unwrap()
}

/// The router namespace (the nodes' underlay) advertises itself on it.
fn advertise(lab: &Lab, lifetime: &str) {
    let server = lab::lab_server_path().expect("lab-server");
    lab.run(
        lab::ROUTER,
        &[&server.to_string_lossy(), "ra", "underlay0", lifetime],
    )
    .expect("sending a Router Advertisement");
}

fn set(lab: &Lab, key: &str, value: &str) {
    lab.run(
        presets::NODE_A,
        &["sh", "-c", &format!("echo {value} > /proc/sys/net/{key}")],
    )
    .expect("writing a sysctl in the lab node");
}

#[test]
fn root_ipv6_doctor_checks() {
    require_root!();
    let mut spec = presets::no_endpoints().dual_stack();
    // The backend pod gets no IPv6 address: `default/web:http` has an
    // endpoint over IPv4 and none over IPv6 (kube-proxy rejects it there).
    spec.nodes[0].pods[1].ip6 = None;
    let lab = build_lab(spec);

    let (status, report) = doctor(&lab, presets::NODE_A);
    assert_eq!(status, Some(0), "{report}");
    assert_eq!(
        severity(&report, "bridge_nf_call_ip6tables"),
        "ok",
        "{report}"
    );
    assert_eq!(severity(&report, "ipv6_forwarding"), "ok", "{report}");
    assert_eq!(severity(&report, "conntrack_ipv6"), "info", "{report}");
    let no_ep = finding(&report, "ipv6_no_endpoints");
    assert_eq!(no_ep["severity"], "warning", "{report}");
    let msg = no_ep["message"].as_str().unwrap();
    assert!(
        msg.contains("default/web:http has endpoints over IPv4 but none over IPv6")
            && msg.contains("default/web-empty:http"),
        "{msg}"
    );
    assert!(
        report["findings"]
            .as_array()
            .unwrap()
            .iter()
            .all(|f| f["check"] != "ipv6_accept_ra"),
        "no RA-learned route yet: {report}"
    );

    set(&lab, "bridge/bridge-nf-call-ip6tables", "0");
    set(&lab, "ipv6/conf/all/forwarding", "0");
    let (status, report) = doctor(&lab, presets::NODE_A);
    assert_eq!(status, Some(1), "{report}");
    assert_eq!(
        severity(&report, "bridge_nf_call_ip6tables"),
        "error",
        "{report}"
    );
    assert_eq!(severity(&report, "ipv6_forwarding"), "error", "{report}");
    set(&lab, "bridge/bridge-nf-call-ip6tables", "1");
    set(&lab, "ipv6/conf/all/forwarding", "1");

    // eth0 forwards (all.forwarding=1 set it); with accept_ra=2 it still
    // takes the router's RA and learns a default route from it.
    set(&lab, "ipv6/conf/eth0/accept_ra", "2");
    advertise(&lab, "1800");
    lab::wait::until_true("a default route from the RA", lab::wait::FAIL_AFTER, || {
        !ra_routes(&lab).is_empty()
    })
    .unwrap();
    let (_, report) = doctor(&lab, presets::NODE_A);
    assert_eq!(severity(&report, "ipv6_accept_ra"), "ok", "{report}");

    // accept_ra=1 on a forwarding interface: the kernel ignores the RA
    // (a lifetime of 0 would withdraw the route), so the route is never
    // refreshed again — the pitfall doctor names.
    set(&lab, "ipv6/conf/eth0/accept_ra", "1");
    let received = || lab::wait::snmp6(&lab, presets::NODE_A, "Icmp6InRouterAdvertisements");
    let before = received().unwrap();
    advertise(&lab, "0");
    // The node received it: icmpv6_rcv counts it, then hands it to
    // ndisc_rcv in the same softirq, which ignores it (accept_ra=1 while
    // forwarding) — the route is then as the RA left it.
    lab::wait::until_true("the node receiving the RA", lab::wait::FAIL_AFTER, || {
        received().unwrap() > before
    })
    .unwrap();
    assert!(
        !ra_routes(&lab).is_empty(),
        "the ignored RA withdrew the route"
    );
    let (status, report) = doctor(&lab, presets::NODE_A);
    assert_eq!(status, Some(1), "{report}");
    let ra = finding(&report, "ipv6_accept_ra");
    assert_eq!(ra["severity"], "error", "{report}");
    assert!(ra["message"].as_str().unwrap().contains("eth0"), "{ra}");
    // With accept_ra=2 the same RA is taken: lifetime 0 withdraws it.
    set(&lab, "ipv6/conf/eth0/accept_ra", "2");
    advertise(&lab, "0");
    lab::wait::until_true(
        "the accepted RA withdrawing the route",
        lab::wait::FAIL_AFTER,
        || ra_routes(&lab).is_empty(),
    )
    .unwrap();
}

/// What a dual-stack node could have changed by doctor or a trace on the
/// IPv6 side: both families' legacy tables (x_tables instantiates a table
/// when asked for it), the nf_tables ruleset, modules, IPv6 sysctls and
/// routes (stateless: counters move with traffic).
const SNAPSHOT6: &str = r##"
echo '# nft'; nft -s list ruleset
for f in ip_tables_names ip6_tables_names; do echo "# $f"; cat /proc/net/$f 2>/dev/null; done
if grep -q . /proc/net/ip6_tables_names 2>/dev/null; then
  echo '# legacy6'; ip6tables-legacy-save | grep -v '^#' | sed 's/\[[0-9]*:[0-9]*\]//'
fi
echo '# modules'; if [ -e /proc/modules ]; then cut -d' ' -f1 /proc/modules | sort; else echo none; fi
echo '# sysctls'
for f in /proc/sys/net/bridge/bridge-nf-call-ip6tables /proc/sys/net/ipv6/conf/*/forwarding \
         /proc/sys/net/ipv6/conf/*/accept_ra; do
  [ -e "$f" ] && echo "$f=$(cat "$f")"
done
# (a bridge's carrier, and so `linkdown`, settles on its own after the build)
echo '# routes'; ip -6 route show table all | grep -v expires | sed 's/ linkdown//'
"##;

#[test]
fn root_ipv6_doctor_and_trace_change_nothing_on_a_dual_stack_legacy_node() {
    require_root!();
    let _lock = lab::tracer::tracing_lock();
    let mut spec = presets::seed000(presets::Seed000::default());
    spec.kube_proxy.iptables = lab::IptablesBackend::Legacy;
    let lab = build(ProxyMode::Iptables, Datapath::Bridge, spec);
    let snapshot = || lab.run(presets::NODE_A, &["sh", "-c", SNAPSHOT6]).unwrap();
    let before = snapshot();
    assert!(
        before.contains("# legacy6") && before.contains("KUBE-SVC-"),
        "{before}"
    );
    let (status, report) = doctor(&lab, presets::NODE_A);
    assert_eq!(status, Some(0), "{report}");
    assert_eq!(snapshot(), before, "nattrace doctor changed the node");
    let svc = SocketAddr::new(web6(), presets::WEB_PORT).to_string();
    let ns = lab.node_netns(presets::NODE_A).unwrap().path();
    let args: Vec<String> = [
        "--svc",
        &svc,
        "--netns",
        &ns.display().to_string(),
        "--output",
        "json",
    ]
    .map(String::from)
    .to_vec();
    let mut tracer = lab::tracer::Nattrace::spawn(&lab::tracer::nattrace(), &args, &[], false)
        .expect("starting nattrace");
    tracer.wait_started(Duration::from_secs(30)).unwrap();
    assert!(curl(&lab, presets::CLIENT_POD, web6()).is_some());
    // Stopped once the connection is decided, not after a --duration it
    // could outlast on a loaded machine.
    tracer.wait_flows(1, lab::wait::FAIL_AFTER).unwrap();
    tracer.terminate();
    let done = tracer.wait(Duration::from_secs(30)).unwrap();
    assert_eq!(done.status.code(), Some(0), "{}", done.describe());
    assert_eq!(snapshot(), before, "a trace changed the node");
}
