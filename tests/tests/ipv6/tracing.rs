//! The seed incidents over IPv6, traced by the real nattrace: seed 000
//! (HTTP) and 001 (DNS) healthy and with `bridge-nf-call-ip6tables=0`, a
//! dual-stack Service traced by both ClusterIPs in one run, hairpin and a
//! Service without endpoints, on bridged and routed nodes, in both
//! kube-proxy modes. Each lab serves several cases in turn.

use std::net::SocketAddr;

use super::*;
use lab::dual_stack::service_ip6;
use lab::kube_proxy::{sep_chain, svc_chain};
use lab::kube_proxy_nft::{endpoint_chain, service_chain};
use lab::tracer::{Finished, Nattrace, assert_verdict_and_cause, nattrace, tracing_lock};
use lab::{PodSpec, Protocol, ServiceSpec};
use serde_json::Value;

const ATTACH_TIMEOUT: Duration = Duration::from_secs(30);

fn dns6() -> IpAddr {
    service_ip6(presets::DNS_SERVICE_IP).into()
}

fn empty6() -> IpAddr {
    service_ip6(presets::EMPTY_SERVICE_IP).into()
}

/// `ip:port` as nattrace prints and takes it (`[ip6]:port`).
fn sock(ip: impl Into<IpAddr>, port: u16) -> String {
    SocketAddr::new(ip.into(), port).to_string()
}

/// The address of a flow's `"ip:port"` / `"[ip6]:port"` field.
fn ip_of(v: &Value) -> IpAddr {
    v.as_str()
        .and_then(|s| s.parse::<SocketAddr>().ok())
        .map(|s| s.ip())
        .unwrap_or_else(|| panic!("not an ip:port: {v}"))
}

/// Traces every `svcs` on `node` (JSON, every hop) while `traffic` runs.
fn trace(lab: &Lab, node: &str, svcs: &[String], traffic: impl FnOnce()) -> Finished {
    let ns = lab.node_netns(node).expect("node").path();
    let mut args: Vec<String> = Vec::new();
    for s in svcs {
        args.extend(["--svc".to_string(), s.clone()]);
    }
    args.extend(
        [
            "--netns",
            &ns.display().to_string(),
            "--reply-timeout",
            "1000",
            "--output",
            "json",
            "-v",
        ]
        .map(String::from),
    );
    let mut tracer = Nattrace::spawn(&nattrace(), &args, &[], false).expect("starting nattrace");
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

/// The one flow whose Service is `svc`.
fn flow_to(done: &Finished, svc: &str) -> Value {
    let all = flows(done);
    let mut matching = all.iter().filter(|f| f["service"] == svc);
    let f = matching
        .next()
        .unwrap_or_else(|| panic!("no flow to {svc}\n{}", done.describe()))
        .clone();
    assert!(
        matching.next().is_none(),
        "several flows to {svc}\n{}",
        done.describe()
    );
    f
}

/// The flow names kube-proxy's Service and endpoint chain (of `mode`).
fn assert_chains(f: &Value, mode: ProxyMode, name: &str, proto: Protocol, endpoint: &str) {
    let (svc, sep) = match mode {
        ProxyMode::Iptables => (svc_chain(name, proto), sep_chain(name, proto, endpoint)),
        ProxyMode::Nftables => (
            service_chain(name, proto),
            endpoint_chain(name, proto, endpoint),
        ),
    };
    assert_eq!(f["k8s_service"], name, "{f}");
    assert_eq!(f["svc_chain"], svc, "{f}");
    assert_eq!(f["sep_chain"], sep, "{f}");
}

fn dig(lab: &Lab, server: IpAddr) -> bool {
    let out = lab
        .dig(
            presets::CLIENT_POD,
            server,
            presets::DNS_NAME,
            CLIENT_TIMEOUT,
        )
        .expect("running dig");
    String::from_utf8_lossy(&out.stdout).contains(&presets::WEB_SERVICE_IP.to_string())
}

/// Seed 000's node with kube-dns beside the web Service (seed 001), both
/// backed by pods on the client's node, dual-stack.
fn seed_lab(mode: ProxyMode, datapath: Datapath) -> Lab {
    let mut spec = presets::seed000(presets::Seed000::default());
    spec.nodes[0]
        .pods
        .push(PodSpec::new(presets::DNS_POD, presets::DNS_POD_IP).dns(
            53,
            presets::DNS_NAME,
            presets::WEB_SERVICE_IP,
        ));
    let spec = spec.service(
        ServiceSpec::new(
            "kube-system",
            "kube-dns",
            "dns",
            presets::DNS_SERVICE_IP,
            53,
            Protocol::Udp,
        )
        .endpoint(presets::DNS_POD, 53),
    );
    build(mode, datapath, spec)
}

/// Seed 000 and 001 over IPv6 and a dual-stack Service traced by both
/// ClusterIPs in one run: healthy, every flow `ok`; then with only
/// `bridge-nf-call-ip6tables=0` (bridged nodes), the IPv6 flows are
/// `reply_not_reverse_nated` naming it while IPv4 stays `ok`.
fn seeds_over_ipv6(mode: ProxyMode, datapath: Datapath) {
    let _lock = tracing_lock();
    let lab = seed_lab(mode, datapath);
    let web4 = sock(presets::WEB_SERVICE_IP, presets::WEB_PORT);
    let web6_svc = sock(web6(), presets::WEB_PORT);
    let dns = sock(dns6(), 53);
    let svcs = [web4.clone(), web6_svc.clone(), dns.clone()];
    let client6: IpAddr = lab.pod_ip6(presets::CLIENT_POD).unwrap().into();
    let backend6 = sock(
        lab.pod_ip6(presets::BACKEND_POD).unwrap(),
        presets::WEB_PORT,
    );
    let dns_backend6 = sock(lab.pod_ip6(presets::DNS_POD).unwrap(), 53);

    let done = trace(&lab, presets::NODE_A, &svcs, || {
        assert!(curl(&lab, presets::CLIENT_POD, presets::WEB_SERVICE_IP).is_some());
        assert!(curl(&lab, presets::CLIENT_POD, web6()).is_some());
        assert!(dig(&lab, dns6()), "dig over IPv6 answers");
    });
    assert_eq!(flows(&done).len(), 3, "{}", done.describe());
    for svc in &svcs {
        assert_verdict_and_cause(&flow_to(&done, svc), "ok", None, &done);
    }
    let f = flow_to(&done, &web6_svc);
    assert_eq!(ip_of(&f["client"]), client6, "{f}");
    assert_eq!(f["backend"], backend6, "{f}");
    assert_chains(&f, mode, "default/web:http", Protocol::Tcp, &backend6);
    let v4 = flow_to(&done, &web4);
    assert_eq!(
        ip_of(&v4["client"]),
        IpAddr::from(presets::CLIENT_IP),
        "{v4}"
    );
    assert_eq!(v4["k8s_service"], "default/web:http", "{v4}");
    let d = flow_to(&done, &dns);
    assert_eq!(d["proto"], "udp", "{d}");
    assert_eq!(d["backend"], dns_backend6, "{d}");
    assert_chains(
        &d,
        mode,
        "kube-system/kube-dns:dns",
        Protocol::Udp,
        &dns_backend6,
    );
    assert_eq!(done.status.code(), Some(0), "{}", done.describe());

    if datapath == Datapath::Routed {
        // No bridge: every reply is routed through netfilter.
        return;
    }
    set_bridge_nf_ip6(&lab, presets::NODE_A, false);
    let done = trace(&lab, presets::NODE_A, &svcs, || {
        assert!(curl(&lab, presets::CLIENT_POD, presets::WEB_SERVICE_IP).is_some());
        assert!(
            curl(&lab, presets::CLIENT_POD, web6()).is_none(),
            "seed 000 over IPv6"
        );
        assert!(!dig(&lab, dns6()), "seed 001 over IPv6");
    });
    assert_verdict_and_cause(&flow_to(&done, &web4), "ok", None, &done);
    for svc in [&web6_svc, &dns] {
        let f = flow_to(&done, svc);
        assert_eq!(
            f["verdict"],
            "reply_not_reverse_nated",
            "{}",
            done.describe()
        );
        let cause = f["cause"].as_str().unwrap_or_default();
        let text = f["cause_text"].as_str().unwrap_or_default();
        assert!(
            cause.contains("ip6tables") && text.contains("bridge-nf-call-ip6tables"),
            "{f}"
        );
        assert_eq!(ip_of(&f["client"]), client6, "{f}");
    }
    assert_eq!(done.status.code(), Some(1), "{}", done.describe());
}

both_modes!(bridged: root_ipv6_seed000_001_dual_stack_bridged, root_ipv6_seed000_001_dual_stack_bridged_nft);
fn bridged(mode: ProxyMode) {
    seeds_over_ipv6(mode, Datapath::Bridge);
}

both_modes!(routed: root_ipv6_seed000_001_dual_stack_routed, root_ipv6_seed000_001_dual_stack_routed_nft);
fn routed(mode: ProxyMode) {
    seeds_over_ipv6(mode, Datapath::Routed);
}

/// A pod reaching itself through its Service over IPv6 (hairpin, masqueraded
/// by KUBE-SEP's rule) is `ok`; a Service without endpoints over IPv6 is
/// rejected with ICMPv6 port unreachable: `dropped`, `no_endpoints`.
fn hairpin_and_no_endpoints(mode: ProxyMode, datapath: Datapath) {
    let _lock = tracing_lock();
    let mut spec = presets::no_endpoints();
    if datapath == Datapath::Bridge {
        spec.nodes[0].pods[1].hairpin = true;
    }
    let lab = build(mode, datapath, spec);
    let web6_svc = sock(web6(), presets::WEB_PORT);
    let empty = sock(empty6(), presets::WEB_PORT);
    let backend6: IpAddr = lab.pod_ip6(presets::BACKEND_POD).unwrap().into();
    let done = trace(
        &lab,
        presets::NODE_A,
        &[web6_svc.clone(), empty.clone()],
        || {
            let body = curl(&lab, presets::BACKEND_POD, web6()).expect("hairpin over IPv6 works");
            assert!(body.contains("pod=backend"), "{body}");
            // The first ICMPv6 error can arrive while connect() still holds
            // the socket (the REJECT answers within the SYN's own softirq):
            // TCP keeps it as a soft error (tcp_v6_err,
            // LINUX_MIB_LOCKDROPPEDICMPS) and the SYN retransmitted 1 s
            // later is refused. Hence 3 s, as the IPv4 scenario allows.
            let refused = lab
                .http_get(
                    presets::CLIENT_POD,
                    empty6(),
                    presets::WEB_PORT,
                    Duration::from_secs(3),
                )
                .expect("curl");
            // curl (7): connection refused, by kube-proxy's REJECT.
            assert_eq!(refused.status.code(), Some(7), "{refused:?}");
        },
    );
    let f = flow_to(&done, &web6_svc);
    assert_verdict_and_cause(&f, "ok", None, &done);
    assert_eq!(ip_of(&f["client"]), backend6, "{f}");
    assert_eq!(f["hairpin"], true, "{f}");
    assert_eq!(f["backend"], sock(backend6, presets::WEB_PORT), "{f}");
    let e = flow_to(&done, &empty);
    assert_verdict_and_cause(&e, "dropped", Some("no_endpoints"), &done);
    let why = e["cause_text"].as_str().unwrap_or_default();
    assert!(why.contains("default/web-empty:http"), "{why}");
    assert!(e["backend"].is_null(), "{e}");
    assert_eq!(done.status.code(), Some(1), "{}", done.describe());
}

both_modes!(hairpin_bridged: root_ipv6_hairpin_and_no_endpoints_bridged, root_ipv6_hairpin_and_no_endpoints_bridged_nft);
fn hairpin_bridged(mode: ProxyMode) {
    hairpin_and_no_endpoints(mode, Datapath::Bridge);
}

#[test]
fn root_ipv6_hairpin_and_no_endpoints_routed() {
    require_root!();
    hairpin_and_no_endpoints(ProxyMode::Iptables, Datapath::Routed);
}

/// kube-proxy writing through iptables-legacy: nattrace reads the IPv6 half
/// with `ip6tables-legacy-save` (only because legacy IPv6 tables exist in
/// that namespace) and names the IPv6 flow's Service and chains.
#[test]
fn root_ipv6_iptables_legacy_names_service_and_chains() {
    require_root!();
    let _lock = tracing_lock();
    let mut spec = presets::seed000(presets::Seed000::default());
    spec.kube_proxy.iptables = lab::IptablesBackend::Legacy;
    let lab = build(ProxyMode::Iptables, Datapath::Bridge, spec);
    let web6_svc = sock(web6(), presets::WEB_PORT);
    let backend6 = sock(
        lab.pod_ip6(presets::BACKEND_POD).unwrap(),
        presets::WEB_PORT,
    );
    let done = trace(
        &lab,
        presets::NODE_A,
        std::slice::from_ref(&web6_svc),
        || {
            assert!(curl(&lab, presets::CLIENT_POD, web6()).is_some());
        },
    );
    let f = flow_to(&done, &web6_svc);
    assert_verdict_and_cause(&f, "ok", None, &done);
    assert_eq!(f["backend"], backend6, "{f}");
    assert_chains(
        &f,
        ProxyMode::Iptables,
        "default/web:http",
        Protocol::Tcp,
        &backend6,
    );
}
