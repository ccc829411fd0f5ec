//! Routed CNIs (issue 10 item 4): the seed scenarios on nodes without a
//! bridge, where every pod sits on a point-to-point veth (`cali<hash>`, a
//! /32 route, proxy ARP for 169.254.1.1), traced by the real nattrace.
//! Needs root (tests are prefixed `root_`); without it they print why they
//! are skipped and pass.

use std::net::Ipv4Addr;
use std::time::Duration;

use lab::presets::{self, Backend, web_svc};
use lab::tracer::{Finished, Nattrace, ip_of, nattrace, tracing_lock};
use lab::{Datapath, Lab, LabSpec, build_lab, host_veth};
use serde_json::Value;

macro_rules! require_root {
    () => {
        if lab::skip_without_root(
            "routed-CNI tests need root (network namespaces, eBPF); \
             run `sudo cargo test -p nattrace-tests --test routed` or in CI",
        ) {
            return;
        }
    };
}

const ATTACH_TIMEOUT: Duration = Duration::from_secs(30);
const REPLY_TIMEOUT_MS: &str = "1000";
const CLIENT_TIMEOUT: Duration = Duration::from_secs(1);

/// The causes that speak of a bridge: none may ever fire on a routed node.
const BRIDGE_CAUSES: &[&str] = &[
    "bridge_nf_call_iptables_off",
    "reply_bridged_without_netfilter",
    "hairpin_mode_off",
];

fn routed(spec: LabSpec) -> Lab {
    build_lab(spec.with_datapath(Datapath::Routed))
}

fn seed000(backend: Backend, bridge_nf_call_iptables: bool) -> Lab {
    routed(presets::seed000(presets::Seed000 {
        bridge_nf_call_iptables,
        backend,
    }))
}

/// The host veth of `pod` in its node's namespace.
fn veth_of(lab: &Lab, pod: &str) -> String {
    let node = lab
        .spec()
        .nodes
        .iter()
        .find(|n| n.pods.iter().any(|p| p.name == pod))
        .expect("pod exists");
    let index = node.pods.iter().position(|p| p.name == pod).unwrap();
    host_veth(node, index)
}

/// Traces `svc` on `node` while `traffic` runs; JSON with every hop unless
/// `extra` asks for text.
fn trace(lab: &Lab, node: &str, svc: &str, extra: &[&str], traffic: impl FnOnce()) -> Finished {
    let ns = lab.node_netns(node).expect("node").path();
    let mut args: Vec<String> = [
        "--svc",
        svc,
        "--netns",
        &ns.display().to_string(),
        "--reply-timeout",
        REPLY_TIMEOUT_MS,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if !extra.contains(&"text") {
        args.extend(["--output", "json", "-v"].map(String::from));
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let mut tracer = Nattrace::spawn(&nattrace(), &args, &[], false).expect("starting nattrace");
    tracer
        .wait_started(ATTACH_TIMEOUT)
        .unwrap_or_else(|e| panic!("{e:#}"));
    traffic();
    tracer.finish().unwrap_or_else(|e| panic!("{e:#}"))
}

fn curl_exit(lab: &Lab, from: &str, ip: Ipv4Addr) -> Option<i32> {
    lab.http_get(from, ip, presets::WEB_PORT, CLIENT_TIMEOUT)
        .expect("running curl")
        .status
        .code()
}

fn has_hop(flow: &Value, kind: &str, place: &str) -> bool {
    lab::tracer::has_hop(flow, kind, place, |_, _| true)
}

fn assert_verdict(f: &Value, verdict: &str, cause: Option<&str>, done: &Finished) {
    lab::tracer::assert_verdict_and_cause(f, verdict, cause, done);
    let cause = f["cause"].as_str().unwrap_or("");
    assert!(
        !BRIDGE_CAUSES.contains(&cause),
        "a bridge cause on a routed node: {}",
        done.describe()
    );
}

// ------------------------------------------------------------ the topology

/// The lab itself, before any tracing: no bridge, Calico's veths, routes and
/// proxy ARP, and Service traffic works to a backend on either node.
#[test]
fn root_routed_lab_has_no_bridge_and_serves_both_nodes() {
    require_root!();
    let lab = seed000(Backend::SameNode, true);
    let node = presets::NODE_A;
    let bridges = lab
        .run(node, &["ip", "-o", "link", "show", "type", "bridge"])
        .unwrap();
    assert!(
        bridges.trim().is_empty(),
        "no bridge on a routed node: {bridges}"
    );

    let veth = veth_of(&lab, presets::CLIENT_POD);
    assert!(veth.starts_with("cali") && veth.len() == 15, "{veth}");
    let link = lab.run(node, &["ip", "-o", "link", "show", &veth]).unwrap();
    assert!(link.contains(lab::ROUTED_HOST_MAC), "{link}");
    assert!(!link.contains("master"), "{link}");
    let routes = lab.run(node, &["ip", "route", "show"]).unwrap();
    assert!(
        routes.contains(&format!("{} dev {veth} scope link", presets::CLIENT_IP)),
        "{routes}"
    );
    let proxy_arp = lab
        .run(
            node,
            &["cat", &format!("/proc/sys/net/ipv4/conf/{veth}/proxy_arp")],
        )
        .unwrap();
    assert_eq!(proxy_arp.trim(), "1");

    let pod_routes = lab
        .run(presets::CLIENT_POD, &["ip", "route", "show"])
        .unwrap();
    assert!(
        pod_routes.contains("default via 169.254.1.1 dev eth0"),
        "{pod_routes}"
    );
    let pod_addr = lab
        .run(
            presets::CLIENT_POD,
            &["ip", "-o", "-4", "addr", "show", "eth0"],
        )
        .unwrap();
    assert!(
        pod_addr.contains(&format!("{}/32", presets::CLIENT_IP)),
        "{pod_addr}"
    );

    // Same node (routed from one cali veth to another), then the other
    // node's pod directly (host-gw routes over the underlay).
    assert_eq!(
        curl_exit(&lab, presets::CLIENT_POD, presets::WEB_SERVICE_IP),
        Some(0)
    );
    assert_eq!(
        curl_exit(&lab, presets::CLIENT_POD, presets::REMOTE_BACKEND_IP),
        Some(0)
    );
    // The gateway was resolved by proxy ARP, to the host veth's MAC.
    let neigh = lab
        .run(presets::CLIENT_POD, &["ip", "neigh", "show", "169.254.1.1"])
        .unwrap();
    assert!(neigh.contains(lab::ROUTED_HOST_MAC), "{neigh}");
}

// ------------------------------------------------------- a healthy Service

fn assert_same_node_ok(lab: &Lab, done: &Finished) {
    let f = done.only_flow();
    assert_verdict(&f, "ok", None, done);
    assert_eq!(ip_of(&f["client"]), presets::CLIENT_IP, "{f}");
    assert_eq!(f["backend"], format!("{}:80", presets::BACKEND_IP), "{f}");
    assert!(f["snat"].is_null(), "pod → pod is not masqueraded: {f}");
    assert_eq!(f["k8s_service"], "default/web:http", "{f}");
    // Routed, not bridged: in by the client's veth, through FORWARD, out by
    // the backend's veth; the reply the same way back, reverse-NATed.
    let client_veth = veth_of(lab, presets::CLIENT_POD);
    let backend_veth = veth_of(lab, presets::BACKEND_POD);
    // The pods' own devices are named too (learned while tracing).
    for p in f["packets"].as_array().unwrap() {
        for h in p["hops"].as_array().unwrap() {
            if h["node_ns"] == false && h["hook"] != "netfilter" {
                assert_eq!(h["ifname"], "eth0", "{h}");
            }
        }
    }
    for (kind, place) in [
        // Pod veths are seen by the device tracepoints, not tc (probes/tc.rs).
        ("SYN", format!("dev-rx {client_veth}")),
        ("SYN", "netfilter FORWARD".to_string()),
        ("SYN", format!("dev-tx {backend_veth}")),
        ("SYN-ACK", format!("dev-rx {backend_veth}")),
        ("SYN-ACK", "netfilter FORWARD".to_string()),
        ("SYN-ACK", format!("dev-tx {client_veth}")),
    ] {
        assert!(has_hop(&f, kind, &place), "{kind} at {place}: {f}");
    }
    assert_eq!(done.status.code(), Some(0), "{}", done.describe());
}

#[test]
fn root_routed_healthy_service_same_node_is_ok() {
    require_root!();
    let _lock = tracing_lock();
    let lab = seed000(Backend::SameNode, true);
    let done = trace(&lab, presets::NODE_A, &web_svc(), &[], || {
        assert_eq!(
            curl_exit(&lab, presets::CLIENT_POD, presets::WEB_SERVICE_IP),
            Some(0)
        );
    });
    assert_same_node_ok(&lab, &done);
}

/// bridge-nf-call-iptables=0 breaks a bridged node (seed 000) but means
/// nothing without a bridge: the reply is routed, so it is reverse-NATed,
/// and no bridge cause may be named.
#[test]
fn root_routed_bridge_nf_call_iptables_off_is_harmless_and_ok() {
    require_root!();
    let _lock = tracing_lock();
    let lab = seed000(Backend::SameNode, false);
    let done = trace(&lab, presets::NODE_A, &web_svc(), &[], || {
        assert_eq!(
            curl_exit(&lab, presets::CLIENT_POD, presets::WEB_SERVICE_IP),
            Some(0)
        );
    });
    assert_same_node_ok(&lab, &done);
}

#[test]
fn root_routed_cross_node_service_is_ok() {
    require_root!();
    let _lock = tracing_lock();
    let lab = seed000(Backend::OtherNode, true);
    let done = trace(&lab, presets::NODE_A, &web_svc(), &[], || {
        assert_eq!(
            curl_exit(&lab, presets::CLIENT_POD, presets::WEB_SERVICE_IP),
            Some(0)
        );
    });
    let f = done.only_flow();
    assert_verdict(&f, "ok", None, &done);
    let backend = format!("{}:80", presets::REMOTE_BACKEND_IP);
    assert_eq!(f["backend"], backend, "{f}");
    // host-gw: straight out of eth0 to node-b, no tunnel.
    assert!(has_hop(&f, "SYN", "tc-egress eth0"), "{f}");
    assert!(has_hop(&f, "SYN-ACK", "tc-ingress eth0"), "{f}");
}

/// `doctor` on a routed node with bridge-nf-call-iptables=0 (which breaks a
/// bridged node, seed 000) finds nothing to complain about: no bridge, so
/// neither that sysctl nor hairpin_mode is a finding, and it exits 0.
#[test]
fn root_routed_doctor_names_no_bridge_problem() {
    require_root!();
    let lab = seed000(Backend::SameNode, false);
    let (code, report) = lab::tracer::doctor(&lab, presets::NODE_A);
    assert_eq!(code, Some(0), "{report}");
    for f in report["findings"].as_array().expect("findings") {
        assert!(
            f["check"] != "bridge_nf_call_iptables" && f["check"] != "hairpin_mode",
            "a bridge finding on a routed node: {f}"
        );
        assert!(f["severity"] == "ok" || f["severity"] == "info", "{f}");
    }
}

/// Seed 001 on a routed node: the same-node DNS reply is routed, so it is
/// reverse-NATed whatever bridge-nf-call-iptables says.
#[test]
fn root_routed_dns_same_node_is_ok_with_bridge_nf_off() {
    require_root!();
    let _lock = tracing_lock();
    let lab = routed(presets::dns(presets::Dns {
        bridge_nf_call_iptables: false,
        backend: Backend::SameNode,
    }));
    let svc = format!("{}:53", presets::DNS_SERVICE_IP);
    let mut answer = String::new();
    let done = trace(&lab, presets::NODE_A, &svc, &[], || {
        let out = lab
            .dig(
                presets::CLIENT_POD,
                presets::DNS_SERVICE_IP,
                presets::DNS_NAME,
                CLIENT_TIMEOUT,
            )
            .expect("running dig");
        answer = String::from_utf8_lossy(&out.stdout).into_owned();
    });
    assert!(
        answer.contains(&presets::WEB_SERVICE_IP.to_string()),
        "{answer}"
    );
    let f = done.only_flow();
    assert_verdict(&f, "ok", None, &done);
    assert_eq!(f["proto"], "udp", "{f}");
    assert_eq!(f["backend"], format!("{}:53", presets::DNS_POD_IP), "{f}");
}

/// Seed 003 with routed nodes: the asymmetric return path does not depend
/// on the CNI's data path, and both nodes name it as on bridged nodes.
#[test]
fn root_routed_seed003_is_named_from_both_nodes() {
    require_root!();
    let _lock = tracing_lock();
    let lab = routed(presets::seed003(presets::Seed003::default()));
    for (node, verdict, cause) in [
        (presets::NODE_B, "no_reply", "no_reply_through_node"),
        (
            presets::NODE_A,
            "reply_not_reverse_nated",
            "reply_bypasses_dnat_node",
        ),
    ] {
        let done = trace(&lab, node, &web_svc(), &[], || {
            assert_ne!(
                curl_exit(&lab, lab::OUTSIDE, presets::WEB_SERVICE_IP),
                Some(0)
            );
        });
        let f = done.only_flow();
        assert_verdict(&f, verdict, Some(cause), &done);
        assert_eq!(ip_of(&f["client"]), presets::OUTSIDE_CLIENT.addr(), "{f}");
        assert_eq!(f["backend"], format!("{}:80", presets::BACKEND_IP), "{f}");
    }
}

// ------------------------------------------------------------------ hairpin

fn hairpin_trace(masquerade: bool, accept_local: bool) -> (Lab, Finished, Option<i32>) {
    let mut spec = presets::hairpin(presets::Hairpin {
        // A bridge-port setting: meaningless here, off to prove it.
        hairpin_mode: false,
        masquerade,
    });
    if accept_local {
        for key in [
            "net.ipv4.conf.all.accept_local",
            "net.ipv4.conf.eth0.accept_local",
        ] {
            spec.nodes[0].pods[0].sysctls.push((key.into(), "1".into()));
        }
    }
    let lab = routed(spec);
    let mut exit = None;
    let done = trace(&lab, presets::NODE_A, &web_svc(), &[], || {
        exit = curl_exit(&lab, presets::BACKEND_POD, presets::WEB_SERVICE_IP);
    });
    (lab, done, exit)
}

fn assert_hairpin(f: &Value) {
    assert_eq!(ip_of(&f["client"]), presets::BACKEND_IP, "{f}");
    assert_eq!(f["backend"], format!("{}:80", presets::BACKEND_IP), "{f}");
    assert_eq!(f["hairpin"], true, "{f}");
}

/// No bridge, so no hairpin_mode to need: the node routes the DNATed SYN
/// back out of the veth it came in by (no ICMP redirect either: the cali
/// veth has no address, so `inet_addr_onlink` in `__mkroute_input` never
/// sets IPSKB_DOREDIRECT), and KUBE-SEP's masquerade makes the pod see the
/// node as the client. Which node address: MASQUERADE takes
/// `inet_select_addr(out, nh, RT_SCOPE_UNIVERSE)`
/// (net/netfilter/nf_nat_masquerade.c), and the cali veth has none, so
/// net/ipv4/devinet.c falls back to the first device of the namespace with
/// a universe-scope address ("Not loopback addresses on loopback should be
/// preferred"): eth0's underlay address, not a pod-CIDR gateway as on cni0.
#[test]
fn root_routed_hairpin_with_masquerade_is_ok() {
    require_root!();
    let _lock = tracing_lock();
    let (lab, done, exit) = hairpin_trace(true, false);
    assert_eq!(exit, Some(0), "{}", done.describe());
    let f = done.only_flow();
    assert_verdict(&f, "ok", None, &done);
    assert_hairpin(&f);
    assert_eq!(ip_of(&f["snat"]), lab::node_underlay_ip(0), "{f}");
    let veth = veth_of(&lab, presets::BACKEND_POD);
    assert!(has_hop(&f, "SYN", &format!("dev-rx {veth}")), "{f}");
    assert!(has_hop(&f, "SYN", &format!("dev-tx {veth}")), "{f}");
}

/// Without KUBE-SEP's masquerade the routed node delivers the SYN back with
/// the pod's own address as source, and the pod drops it exactly as on a
/// bridge node: `__fib_validate_source` (net/ipv4/fib_frontend.c) finds the
/// source RTN_LOCAL and, without accept_local on eth0, returns
/// SKB_DROP_REASON_IP_LOCAL_SOURCE.
#[test]
fn root_routed_hairpin_without_masquerade_is_dropped() {
    require_root!();
    let _lock = tracing_lock();
    let (_lab, done, exit) = hairpin_trace(false, false);
    assert_ne!(exit, Some(0), "{}", done.describe());
    let f = done.only_flow();
    assert_verdict(&f, "dropped", Some("hairpin_not_masqueraded"), &done);
    assert_hairpin(&f);
    assert!(f["snat"].is_null(), "{f}");
    assert!(
        f["cause_text"].as_str().unwrap().contains("KUBE-SEP-"),
        "{f}"
    );
}

/// With accept_local the pod takes its own SYN, and its SYN-ACK to its own
/// address never leaves the pod: not reverse-NATed.
#[test]
fn root_routed_hairpin_without_masquerade_accept_local_is_not_reverse_nated() {
    require_root!();
    let _lock = tracing_lock();
    let (_lab, done, exit) = hairpin_trace(false, true);
    assert_ne!(exit, Some(0), "{}", done.describe());
    let f = done.only_flow();
    assert_verdict(
        &f,
        "reply_not_reverse_nated",
        Some("hairpin_not_masqueraded"),
        &done,
    );
    assert_hairpin(&f);
}

// ------------------------------------------------ NetworkPolicy-style DROP

/// A NetworkPolicy that isolates the backend, as a DROP in filter FORWARD of
/// the node namespace (kube-router and Calico's iptables data plane put
/// theirs there). Needs branch `prio`: the filter table's FORWARD hook sits
/// at priority 0, where nattrace's FORWARD link used to be (EBUSY).
#[test]
fn root_routed_network_policy_drop_in_forward() {
    require_root!();
    let _lock = tracing_lock();
    let lab = seed000(Backend::SameNode, true);
    lab.deny_forward_to(
        presets::NODE_A,
        presets::BACKEND_IP,
        presets::WEB_PORT,
        "netpol: deny all ingress to backend",
    )
    .expect("inserting the DROP rule");
    let done = trace(&lab, presets::NODE_A, &web_svc(), &[], || {
        assert_eq!(
            curl_exit(&lab, presets::CLIENT_POD, presets::WEB_SERVICE_IP),
            Some(28),
            "the DROP makes curl time out"
        );
    });
    let f = done.only_flow();
    assert_verdict(&f, "dropped", Some("dropped_by_netfilter"), &done);
    assert_eq!(f["backend"], format!("{}:80", presets::BACKEND_IP), "{f}");
    assert!(
        f["cause_text"].as_str().unwrap().contains("FORWARD"),
        "the drop is placed at FORWARD: {f}"
    );
    assert_eq!(done.status.code(), Some(1), "{}", done.describe());
}

// ------------------------------------------------ Service without endpoints

/// kube-proxy REJECTs a Service without endpoints (the lab renders its
/// filter `KUBE-SERVICES` REJECT as kube-proxy does): the client gets ICMP
/// port-unreachable (curl: connection refused, exit 7) at once, and
/// nattrace names the Service and the rule.
#[test]
fn root_routed_service_without_endpoints_is_refused() {
    require_root!();
    let _lock = tracing_lock();
    let lab = routed(presets::no_endpoints());
    let svc = format!("{}:{}", presets::EMPTY_SERVICE_IP, presets::WEB_PORT);
    let done = trace(&lab, presets::NODE_A, &svc, &[], || {
        assert_eq!(
            curl_exit(&lab, presets::CLIENT_POD, presets::EMPTY_SERVICE_IP),
            Some(7),
            "connection refused"
        );
    });
    let f = done.only_flow();
    assert!(f["backend"].is_null(), "never DNATed: {f}");
    assert_verdict(&f, "dropped", Some("no_endpoints"), &done);
    assert!(
        f["cause_text"]
            .as_str()
            .unwrap()
            .contains("default/web-empty:http"),
        "names the Service: {f}"
    );
    assert_eq!(done.status.code(), Some(1), "{}", done.describe());
}

// ------------------------------------------------------- interface names

/// `-v` text names every interface a packet passed, in every namespace: the
/// node's `cali…` veths and the pods' `eth0` (device tracepoints in the pod
/// namespaces), never `if<N>`; and `analyze` of the recording names them
/// the same way.
#[test]
fn root_routed_text_output_names_every_interface() {
    require_root!();
    let _lock = tracing_lock();
    let lab = seed000(Backend::SameNode, true);
    let dir = lab::Scratch::new("routed");
    let rec = dir.path("names.rec");
    let rec_arg = rec.display().to_string();
    let done = trace(
        &lab,
        presets::NODE_A,
        &web_svc(),
        &["--output", "text", "-v", "--write", &rec_arg],
        || {
            assert_eq!(
                curl_exit(&lab, presets::CLIENT_POD, presets::WEB_SERVICE_IP),
                Some(0)
            );
        },
    );
    let hop_lines = |out: &str| -> Vec<String> {
        out.lines()
            .filter(|l| l.contains(" ms  "))
            .map(str::to_owned)
            .collect()
    };
    let live = done.stdout.join("\n");
    let hops = hop_lines(&live);
    assert!(!hops.is_empty(), "{}", done.describe());
    let client_veth = veth_of(&lab, presets::CLIENT_POD);
    let backend_veth = veth_of(&lab, presets::BACKEND_POD);
    for want in [
        format!("dev-rx {client_veth}"),
        format!("dev-tx {backend_veth}"),
    ] {
        assert!(hops.iter().any(|l| l.contains(&want)), "{want}:\n{live}");
    }
    // A pod's namespace: its pod, its `ip netns` name, or its inode.
    let in_pods: Vec<&String> = hops
        .iter()
        .filter(|l| l.contains(" ns ") || l.contains(" netns "))
        .collect();
    assert!(!in_pods.is_empty(), "the pods' device tracepoints: {live}");
    for l in &in_pods {
        assert!(l.contains(" eth0 "), "a pod hop names the pod's eth0: {l}");
    }
    let unnamed = regex_if(&hops);
    assert!(
        unnamed.is_empty(),
        "unnamed interfaces: {unnamed:?}\n{live}"
    );

    let analyzed = std::process::Command::new(nattrace())
        .args(["analyze", &rec_arg, "-v"])
        .output()
        .expect("running nattrace analyze");
    let offline = String::from_utf8_lossy(&analyzed.stdout);
    assert_eq!(
        hop_lines(&offline),
        hops,
        "analyze names the interfaces as the live run did:\n{offline}"
    );
}

/// Hop lines that show an interface as `if<N>`.
fn regex_if(lines: &[String]) -> Vec<&String> {
    lines
        .iter()
        .filter(|l| {
            l.split_whitespace().any(|w| {
                w.strip_prefix("if")
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            })
        })
        .collect()
}
