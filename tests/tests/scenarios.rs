//! Every seed incident as a lab scenario, traced by the real nattrace
//! (issue 4): DNS (001), the asymmetric return path (003), hairpin,
//! node-local and cross-node clients and the kube-proxy chains (004), and
//! `nattrace doctor`. Needs root (tests are prefixed `root_`); without it
//! they print why they are skipped and pass.
//!
//! Raw tracepoints see every namespace and labs reuse the seeds' addresses,
//! so tests that trace hold [`tracing_lock`] for the whole lab + trace.

use std::net::Ipv4Addr;
use std::time::Duration;

use lab::both_modes;
use lab::kube_proxy::{sep_chain, svc_chain};
use lab::kube_proxy_nft::{endpoint_chain, service_chain};
use lab::presets::{self, Backend, web_svc};
use lab::tracer::{
    Finished, Nattrace, assert_verdict_and_cause, has_hop, hops, ip_of, nattrace, tracing_lock,
};
use lab::{Lab, LabSpec, Protocol, ProxyMode, build_lab};
use serde_json::Value;

macro_rules! require_root {
    () => {
        if lab::skip_without_root(
            "scenario tests need root (network namespaces, eBPF); \
             run `sudo cargo test -p nattrace-tests --test scenarios` or in CI",
        ) {
            return;
        }
    };
}

// Below require_root!, so its textual scope reaches them.
#[path = "scenarios/cri.rs"]
mod cri;
#[path = "scenarios/doctor.rs"]
mod doctor;
#[path = "scenarios/ipvs.rs"]
mod ipvs;
#[path = "scenarios/nftables.rs"]
mod nftables;
#[path = "scenarios/no_endpoints.rs"]
mod no_endpoints;
#[path = "scenarios/north_south.rs"]
mod north_south;
#[path = "scenarios/pods.rs"]
mod pods;
#[path = "scenarios/readonly.rs"]
mod readonly;
#[path = "scenarios/stale.rs"]
mod stale;

/// Builds `spec` with kube-proxy in `mode`.
fn build_in(mode: ProxyMode, mut spec: LabSpec) -> Lab {
    spec.kube_proxy.mode = mode;
    build_lab(spec)
}

/// The Service and endpoint chain names kube-proxy gives `name` in `mode`.
fn chain_names(mode: ProxyMode, name: &str, proto: Protocol, endpoint: &str) -> (String, String) {
    match mode {
        ProxyMode::Iptables => (svc_chain(name, proto), sep_chain(name, proto, endpoint)),
        ProxyMode::Nftables => (
            service_chain(name, proto),
            endpoint_chain(name, proto, endpoint),
        ),
    }
}

/// The flow names the Service and the chains that DNATed it.
fn assert_chains(f: &Value, mode: ProxyMode, name: &str, proto: Protocol, endpoint: &str) {
    let (svc, sep) = chain_names(mode, name, proto, endpoint);
    assert_eq!(f["k8s_service"], name, "{f}");
    assert_eq!(f["svc_chain"], svc, "{f}");
    assert_eq!(f["sep_chain"], sep, "{f}");
}

const ATTACH_TIMEOUT: Duration = Duration::from_secs(30);
const REPLY_TIMEOUT_MS: &str = "1000";
const CLIENT_TIMEOUT: Duration = Duration::from_secs(1);

/// Traces `svc` on `node` (JSON, plus `extra`) while `traffic` runs, until
/// its flows are decided ([`Nattrace::finish`]).
fn trace(lab: &Lab, node: &str, svc: &str, extra: &[&str], traffic: impl FnOnce()) -> Finished {
    let bin = nattrace();
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
    if !extra
        .iter()
        .any(|a| *a == "text" || a.starts_with("--output="))
    {
        // -v: these tests assert the whole hop path, which `ok` flows carry
        // only with -v (which also sends every packet: no kernel buffer).
        args.extend(["--output".to_string(), "json".to_string(), "-v".to_string()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    if !extra.contains(&"--write") {
        args.extend(lab::tracer::record_args(None));
    }
    let mut tracer = Nattrace::spawn(&bin, &args, &[], false).expect("starting nattrace");
    tracer
        .wait_started(ATTACH_TIMEOUT)
        .unwrap_or_else(|e| panic!("{e:#}"));
    traffic();
    tracer.finish().unwrap_or_else(|e| panic!("{e:#}"))
}

fn flows(done: &Finished) -> Vec<Value> {
    done.flows()
        .unwrap_or_else(|e| panic!("{e:#}\n{}", done.describe()))
}

fn curl(lab: &Lab, from: &str) -> bool {
    lab.http_get(
        from,
        presets::WEB_SERVICE_IP,
        presets::WEB_PORT,
        CLIENT_TIMEOUT,
    )
    .expect("running curl")
    .status
    .success()
}

fn assert_common(f: &Value, verdict: &str, cause: Option<&str>, done: &Finished) {
    assert_verdict_and_cause(f, verdict, cause, done);
}

// ---------------------------------------------------------------- 1: DNS

fn dns_trace(bridge_nf_call_iptables: bool, mode: ProxyMode) -> (Finished, bool) {
    let lab = build_in(
        mode,
        presets::dns(presets::Dns {
            bridge_nf_call_iptables,
            backend: Backend::SameNode,
        }),
    );
    dns_trace_on(&lab)
}

/// Traces the cluster DNS Service on node-a while the client digs it once:
/// the trace, and whether the answer came.
fn dns_trace_on(lab: &Lab) -> (Finished, bool) {
    let svc = format!("{}:53", presets::DNS_SERVICE_IP);
    let mut answered = false;
    let done = trace(lab, presets::NODE_A, &svc, &[], || {
        let out = lab
            .dig(
                presets::CLIENT_POD,
                presets::DNS_SERVICE_IP,
                presets::DNS_NAME,
                CLIENT_TIMEOUT,
            )
            .expect("running dig");
        answered =
            String::from_utf8_lossy(&out.stdout).contains(&presets::WEB_SERVICE_IP.to_string());
    });
    (done, answered)
}

fn assert_dns_flow(f: &Value, mode: ProxyMode) {
    assert_eq!(f["proto"], "udp", "{f}");
    assert_eq!(ip_of(&f["client"]), presets::CLIENT_IP, "{f}");
    assert_eq!(
        f["service"],
        format!("{}:53", presets::DNS_SERVICE_IP),
        "{f}"
    );
    let backend = format!("{}:53", presets::DNS_POD_IP);
    assert_eq!(f["backend"], backend, "{f}");
    assert_chains(f, mode, "kube-system/kube-dns:dns", Protocol::Udp, &backend);
}

both_modes!(dns_broken: root_dns_seed001_broken_reply_from_unexpected_source, root_dns_seed001_broken_reply_from_unexpected_source_nft);
fn dns_broken(mode: ProxyMode) {
    let _lock = tracing_lock();
    let (done, answered) = dns_trace(false, mode);
    assert!(!answered, "seed 001: dig gets no usable answer");
    let f = done.only_flow();
    assert_common(
        &f,
        "reply_not_reverse_nated",
        Some("bridge_nf_call_iptables_off"),
        &done,
    );
    assert_dns_flow(&f, mode);
    assert_eq!(done.status.code(), Some(1), "{}", done.describe());
}

both_modes!(dns_healthy: root_dns_seed001_healthy_is_ok, root_dns_seed001_healthy_is_ok_nft);
fn dns_healthy(mode: ProxyMode) {
    let _lock = tracing_lock();
    let (done, answered) = dns_trace(true, mode);
    assert!(answered, "{}", done.describe());
    let f = done.only_flow();
    assert_common(&f, "ok", None, &done);
    assert_dns_flow(&f, mode);
    assert_eq!(done.status.code(), Some(0), "{}", done.describe());
}

// ------------------------------------------------------ 4: node-local client

both_modes!(node_local: root_node_local_client_shows_output_dnat_and_masquerade, root_node_local_client_shows_output_dnat_and_masquerade_nft);
fn node_local(mode: ProxyMode) {
    let _lock = tracing_lock();
    let lab = build_in(mode, presets::seed000(presets::Seed000::default()));
    let done = trace(&lab, presets::NODE_A, &web_svc(), &[], || {
        assert!(curl(&lab, presets::NODE_A), "curl from the node works");
    });
    let f = done.only_flow();
    assert_common(&f, "ok", None, &done);
    assert_eq!(ip_of(&f["client"]), lab::node_underlay_ip(0), "{f}");
    let backend = format!("{}:80", presets::BACKEND_IP);
    assert_eq!(f["backend"], backend, "{f}");
    assert_chains(&f, mode, "default/web:http", Protocol::Tcp, &backend);
    let gateway = presets::NODE_A_POD_CIDR.host(1);
    assert_eq!(
        ip_of(&f["snat"]),
        gateway,
        "masqueraded to cni0's address: {f}"
    );
    assert!(
        has_hop(&f, "SYN", "netfilter OUTPUT before-nat", |_, d| d
            == web_svc()),
        "{f}"
    );
    assert!(
        has_hop(&f, "SYN", "netfilter OUTPUT after-nat", |_, d| d == backend),
        "{f}"
    );
    assert!(
        has_hop(&f, "SYN", "netfilter POSTROUTING after-nat", |s, _| s
            .starts_with(&format!("{gateway}:"))),
        "{f}"
    );
}

// ---------------------------------------------------------- 5: cross-node

both_modes!(cross_node: root_cross_node_path_shows_prerouting_forward_postrouting_and_overlay, root_cross_node_path_shows_prerouting_forward_postrouting_and_overlay_nft);
fn cross_node(mode: ProxyMode) {
    let _lock = tracing_lock();
    let lab = build_in(
        mode,
        presets::seed000(presets::Seed000 {
            bridge_nf_call_iptables: true,
            backend: Backend::OtherNode,
        }),
    );
    let done = trace(&lab, presets::NODE_A, &web_svc(), &[], || {
        assert!(curl(&lab, presets::CLIENT_POD));
    });
    let f = done.only_flow();
    assert_common(&f, "ok", None, &done);
    assert_eq!(ip_of(&f["client"]), presets::CLIENT_IP, "{f}");
    let backend = format!("{}:80", presets::REMOTE_BACKEND_IP);
    assert_eq!(f["backend"], backend, "{f}");
    assert_chains(&f, mode, "default/web:http", Protocol::Tcp, &backend);
    assert!(f["snat"].is_null(), "pod → pod is not masqueraded: {f}");
    for place in [
        "netfilter PREROUTING after-nat",
        "netfilter FORWARD",
        "netfilter POSTROUTING after-nat",
        "tc-egress flannel.1",
    ] {
        assert!(
            has_hop(&f, "SYN", place, |_, d| d == backend),
            "{place}: {f}"
        );
    }
    assert!(
        has_hop(&f, "SYN", "netfilter PREROUTING before-nat", |_, d| d
            == web_svc()),
        "{f}"
    );
}

// -------------------------------------------------- 2: asymmetric return path

fn seed003(masquerade_all: bool, mode: ProxyMode) -> Lab {
    build_in(
        mode,
        presets::seed003(presets::Seed003 {
            masquerade_all,
            backend: Backend::OtherNode,
        }),
    )
}

fn outside_curl(lab: &Lab) -> bool {
    curl(lab, lab::OUTSIDE)
}

fn assert_outside_flow(f: &Value) {
    assert_eq!(ip_of(&f["client"]), presets::OUTSIDE_CLIENT.addr(), "{f}");
    assert_eq!(f["service"], web_svc(), "{f}");
    assert_eq!(f["backend"], format!("{}:80", presets::BACKEND_IP), "{f}");
}

both_modes!(seed003_dnating_node: root_seed003_on_the_dnating_node_no_reply_through_node, root_seed003_on_the_dnating_node_no_reply_through_node_nft);
fn seed003_dnating_node(mode: ProxyMode) {
    let _lock = tracing_lock();
    let lab = seed003(false, mode);
    let done = trace(&lab, presets::NODE_B, &web_svc(), &[], || {
        assert!(!outside_curl(&lab), "seed 003: the connection fails");
    });
    let f = done.only_flow();
    assert_common(&f, "no_reply", Some("no_reply_through_node"), &done);
    assert_outside_flow(&f);
    assert!(f["hint"].as_str().unwrap().contains("masqueradeAll"), "{f}");
    assert_eq!(done.status.code(), Some(1), "{}", done.describe());
}

both_modes!(seed003_masquerade_all: root_seed003_with_masquerade_all_is_ok_and_snated, root_seed003_with_masquerade_all_is_ok_and_snated_nft);
fn seed003_masquerade_all(mode: ProxyMode) {
    let _lock = tracing_lock();
    let lab = seed003(true, mode);
    let done = trace(&lab, presets::NODE_B, &web_svc(), &[], || {
        assert!(outside_curl(&lab), "masqueradeAll fixes seed 003");
    });
    let f = done.only_flow();
    assert_common(&f, "ok", None, &done);
    assert_outside_flow(&f);
    assert!(f["snat"].is_string(), "the flow shows the SNAT: {f}");
    assert_eq!(
        ip_of(&f["snat"]),
        presets::NODE_B_POD_CIDR.network(),
        "masqueraded to node-b's flannel.1 address: {f}"
    );
}

both_modes!(seed003_backend_node: root_seed003_on_the_backend_node_reply_bypasses_the_dnating_node, root_seed003_on_the_backend_node_reply_bypasses_the_dnating_node_nft);
fn seed003_backend_node(mode: ProxyMode) {
    let _lock = tracing_lock();
    let lab = seed003(false, mode);
    let done = trace(&lab, presets::NODE_A, &web_svc(), &[], || {
        assert!(!outside_curl(&lab));
    });
    let f = done.only_flow();
    assert_common(
        &f,
        "reply_not_reverse_nated",
        Some("reply_bypasses_dnat_node"),
        &done,
    );
    assert_outside_flow(&f);
    let backend = format!("{}:80", presets::BACKEND_IP);
    assert!(
        has_hop(&f, "SYN-ACK", "tc-egress eth0", |s, d| s == backend
            && ip_of(&Value::from(d)) == presets::OUTSIDE_CLIENT.addr()),
        "the reply leaves node-a by eth0 with the pod's source: {f}"
    );
}

// --------------------------------------------------------------- 3: hairpin

fn hairpin_trace(
    hairpin_mode: bool,
    masquerade: bool,
    accept_local: bool,
    mode: ProxyMode,
) -> (Finished, bool) {
    let mut spec = presets::hairpin(presets::Hairpin {
        hairpin_mode,
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
    let lab = build_in(mode, spec);
    let mut worked = false;
    let done = trace(&lab, presets::NODE_A, &web_svc(), &[], || {
        worked = curl(&lab, presets::BACKEND_POD);
    });
    (done, worked)
}

fn assert_hairpin_flow(f: &Value) {
    assert_eq!(ip_of(&f["client"]), presets::BACKEND_IP, "{f}");
    assert_eq!(f["backend"], format!("{}:80", presets::BACKEND_IP), "{f}");
    assert_eq!(f["hairpin"], true, "{f}");
}

both_modes!(hairpin_masquerade: root_hairpin_with_masquerade_is_ok, root_hairpin_with_masquerade_is_ok_nft);
fn hairpin_masquerade(mode: ProxyMode) {
    let _lock = tracing_lock();
    let (done, worked) = hairpin_trace(true, true, false, mode);
    assert!(worked, "{}", done.describe());
    let f = done.only_flow();
    assert_common(&f, "ok", None, &done);
    assert_hairpin_flow(&f);
    let backend = format!("{}:80", presets::BACKEND_IP);
    assert_chains(&f, mode, "default/web:http", Protocol::Tcp, &backend);
    assert_eq!(ip_of(&f["snat"]), presets::NODE_A_POD_CIDR.host(1), "{f}");
    let detail = f["detail"].as_str().unwrap();
    assert!(
        detail.contains("hairpin") && detail.contains("masqueraded"),
        "{f}"
    );
}

both_modes!(hairpin_off: root_hairpin_mode_off_is_named, root_hairpin_mode_off_is_named_nft);
fn hairpin_off(mode: ProxyMode) {
    let _lock = tracing_lock();
    let (done, worked) = hairpin_trace(false, true, false, mode);
    assert!(!worked);
    let f = done.only_flow();
    assert!(
        f["verdict"] == "no_reply" || f["verdict"] == "dropped",
        "{}",
        done.describe()
    );
    assert_eq!(f["cause"], "hairpin_mode_off", "{}", done.describe());
    assert_hairpin_flow(&f);
}

/// Hairpin through the node's own NodePort (issue 24): the backend pod
/// curls node-a's address on the NodePort; kube-proxy's `KUBE-EXT-` sends
/// pod traffic to the Service chain, DNAT picks the pod itself and the
/// endpoint chain's hairpin mark masquerades it. With the bridge port's
/// hairpin mode on it is `ok`; off, the bridge never sends the frame back
/// out of the port it came in by: `hairpin_mode_off`.
fn nodeport_hairpin(mode: ProxyMode, hairpin_mode: bool) {
    const NODE_PORT: u16 = 30090;
    let _lock = tracing_lock();
    let mut spec = presets::hairpin(presets::Hairpin {
        hairpin_mode,
        masquerade: true,
    });
    spec.services[0].node_port = Some(NODE_PORT);
    let lab = build_in(mode, spec);
    let node_ip = lab::node_underlay_ip(0);
    let svc = format!("{node_ip}:{NODE_PORT}");
    let mut worked = false;
    let done = trace(&lab, presets::NODE_A, &svc, &[], || {
        worked = lab
            .http_get(presets::BACKEND_POD, node_ip, NODE_PORT, CLIENT_TIMEOUT)
            .expect("running curl")
            .status
            .success();
    });
    assert_eq!(worked, hairpin_mode, "{}", done.describe());
    let f = done.only_flow();
    assert_eq!(f["service"], svc.as_str(), "{f}");
    assert_hairpin_flow(&f);
    if hairpin_mode {
        assert_common(&f, "ok", None, &done);
        assert!(f["snat"].is_string(), "the hairpin is masqueraded: {f}");
    } else {
        assert_eq!(f["cause"], "hairpin_mode_off", "{}", done.describe());
    }
}

both_modes!(nodeport_hairpin_ok: root_nodeport_hairpin_with_hairpin_mode_is_ok, root_nodeport_hairpin_with_hairpin_mode_is_ok_nft);
fn nodeport_hairpin_ok(mode: ProxyMode) {
    nodeport_hairpin(mode, true);
}

both_modes!(nodeport_hairpin_off: root_nodeport_hairpin_mode_off_is_named, root_nodeport_hairpin_mode_off_is_named_nft);
fn nodeport_hairpin_off(mode: ProxyMode) {
    nodeport_hairpin(mode, false);
}

both_modes!(hairpin_unmasqueraded: root_hairpin_without_masquerade_is_dropped_as_local_source, root_hairpin_without_masquerade_is_dropped_as_local_source_nft);
/// Without masquerade the pod receives its own SYN with its own address as
/// source: Linux drops it (IP_LOCAL_SOURCE) unless accept_local is set.
fn hairpin_unmasqueraded(mode: ProxyMode) {
    let _lock = tracing_lock();
    let (done, worked) = hairpin_trace(true, false, false, mode);
    assert!(!worked);
    let f = done.only_flow();
    assert_common(&f, "dropped", Some("hairpin_not_masqueraded"), &done);
    assert_hairpin_flow(&f);
    assert!(f["snat"].is_null(), "{f}");
    // The cause names the endpoint chain that lacks the hairpin mark.
    let backend = format!("{}:80", presets::BACKEND_IP);
    let (_, sep) = chain_names(mode, "default/web:http", Protocol::Tcp, &backend);
    assert!(f["cause_text"].as_str().unwrap().contains(&sep), "{f}");
}

both_modes!(hairpin_accept_local: root_hairpin_without_masquerade_accept_local_is_not_reverse_nated, root_hairpin_without_masquerade_accept_local_is_not_reverse_nated_nft);
/// With accept_local the SYN is accepted and the SYN-ACK goes straight back
/// inside the pod: the reply is not reverse-NATed (the description).
fn hairpin_accept_local(mode: ProxyMode) {
    let _lock = tracing_lock();
    let (done, worked) = hairpin_trace(true, false, true, mode);
    assert!(!worked);
    let f = done.only_flow();
    assert_common(
        &f,
        "reply_not_reverse_nated",
        Some("hairpin_not_masqueraded"),
        &done,
    );
    assert_hairpin_flow(&f);
    assert!(f["snat"].is_null(), "{f}");
}

// ------------------------------------------------ 6: hook path and chains

both_modes!(chains_and_path: root_chains_and_full_hook_path_are_reported, root_chains_and_full_hook_path_are_reported_nft);
fn chains_and_path(mode: ProxyMode) {
    let _lock = tracing_lock();
    let lab = build_in(mode, presets::seed000(presets::Seed000::default()));
    let done = trace(&lab, presets::NODE_A, &web_svc(), &[], || {
        assert!(curl(&lab, presets::CLIENT_POD));
    });
    let f = done.only_flow();
    assert_common(&f, "ok", None, &done);
    let name = "default/web:http";
    let backend = format!("{}:80", presets::BACKEND_IP);
    assert_chains(&f, mode, name, Protocol::Tcp, &backend);
    let (svc, _) = chain_names(mode, name, Protocol::Tcp, &backend);
    // Every packet until the verdict (an `ok` flow is then muted in the
    // kernel), each with its whole path through the node.
    let packets = f["packets"].as_array().unwrap();
    assert!(packets.len() >= 2, "{f}");
    // The kernel mutes an `ok` flow once decided, so a packet in flight at
    // that moment may be cut short: the handshake is complete for sure.
    for p in packets
        .iter()
        .filter(|p| p["kind"] == "SYN" || p["kind"] == "SYN-ACK")
    {
        let places: Vec<String> = hops(&serde_json::json!({ "packets": [p] }))
            .into_iter()
            .map(|h| h.place)
            .collect();
        // Into the node by one pod's veth, out by the other's (device
        // tracepoints there, not tc: probes/tc.rs).
        for want in [
            "dev-rx veth",
            "netfilter PREROUTING",
            "netfilter POSTROUTING",
            "dev-tx veth",
        ] {
            assert!(
                places.iter().any(|pl| pl.starts_with(want)),
                "{want} missing for {}: {places:?}",
                p["kind"]
            );
        }
    }

    // The text form names the same chains on the flow line, and -v lists the hops.
    let text = trace(
        &lab,
        presets::NODE_A,
        &web_svc(),
        &["--output", "text", "-v"],
        || {
            assert!(curl(&lab, presets::CLIENT_POD));
        },
    );
    let out = text.stdout.join("\n");
    assert!(out.contains(&format!("[{name} {svc}")), "{out}");
    assert!(out.contains("netfilter PREROUTING after-nat"), "{out}");
    assert!(out.contains("nattrace: checks: "), "{out}");
}
