//! nattrace against the lab: real namespaces, real kube-proxy rules, real
//! traffic, the real binary, JSON output. Needs root (tests are prefixed
//! `root_`); without it they print why they are skipped and pass.
//!
//! nattrace's raw tracepoints see every namespace, and labs reuse the seed's
//! addresses, so tests that trace take [`tracing_lock`] for the whole trace.

use std::collections::BTreeSet;
use std::time::Duration;

use lab::both_modes;
use lab::kube_proxy_nft::{endpoint_chain, service_chain};
use lab::presets::{self, Backend, Seed000, web_svc};
use lab::tracer::{Finished, Nattrace, curl_parallel, nattrace, tracing_lock};
use lab::{Lab, Protocol, ProxyMode, ServiceSpec, build_lab};
use serde_json::Value;

macro_rules! require_root {
    () => {
        if lab::skip_without_root(
            "tracer tests need root (network namespaces, eBPF); \
             run `sudo cargo test -p nattrace-tests --test tracer` or in CI",
        ) {
            return;
        }
    };
}
// Below the macro, so its textual scope reaches them.
#[path = "tracer/cleanup.rs"]
mod cleanup;
#[path = "tracer/cleanup_clsact.rs"]
mod cleanup_clsact;
#[path = "tracer/cut_by_stop.rs"]
mod cut_by_stop;
#[path = "tracer/input.rs"]
mod input;
#[path = "tracer/many.rs"]
mod many;
#[path = "tracer/metrics_clients.rs"]
mod metrics_clients;
#[path = "tracer/netns_denied.rs"]
mod netns_denied;
#[path = "tracer/netns_gone.rs"]
mod netns_gone;
#[path = "tracer/priorities.rs"]
mod priorities;
#[path = "tracer/receive.rs"]
mod receive;
#[path = "tracer/stalled.rs"]
mod stalled;
#[path = "tracer/status.rs"]
mod status;
#[path = "tracer/targets.rs"]
mod targets;
#[path = "tracer/under_traffic.rs"]
mod under_traffic;

/// Loading and attaching (BTF, verifier) on a busy 2-core CI machine.
pub(crate) const ATTACH_TIMEOUT: Duration = Duration::from_secs(30);
const CURL_MAX_TIME: Duration = Duration::from_secs(1);
const REPLY_TIMEOUT_MS: &str = "1000";

fn seed000(bridge_nf_call_iptables: bool, backend: Backend, mode: ProxyMode) -> Lab {
    let mut spec = presets::seed000(Seed000 {
        bridge_nf_call_iptables,
        backend,
    });
    spec.kube_proxy.mode = mode;
    build_lab(spec)
}

/// In nftables mode every flow names kube-proxy's nftables chains for the
/// web Service and `backend` (iptables mode is covered in the scenarios).
fn assert_nft_chains(done: &Finished, mode: ProxyMode, backend: std::net::Ipv4Addr) {
    if mode != ProxyMode::Nftables {
        return;
    }
    let name = "default/web:http";
    let endpoint = format!("{backend}:{}", presets::WEB_PORT);
    for f in flows(done) {
        assert_eq!(f["k8s_service"], name, "{f}");
        assert_eq!(f["svc_chain"], service_chain(name, Protocol::Tcp), "{f}");
        assert_eq!(
            f["sep_chain"],
            endpoint_chain(name, Protocol::Tcp, &endpoint),
            "{f}"
        );
    }
}

/// `--svc <svc> --netns <node-a> --output json` plus `extra`.
pub(crate) fn args(lab: &Lab, svcs: &[String], extra: &[&str]) -> Vec<String> {
    let node = lab.node_netns(presets::NODE_A).expect("node-a").path();
    let mut args: Vec<String> = svcs
        .iter()
        .flat_map(|s| ["--svc".into(), s.clone()])
        .collect();
    args.extend(["--netns".into(), node.display().to_string()]);
    args.extend(["--output".into(), "json".into()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

pub(crate) fn start(args: &[String], envs: &[(&str, &str)]) -> Nattrace {
    let mut tracer = Nattrace::spawn(&nattrace(), args, envs, false).expect("starting nattrace");
    let first = tracer
        .wait_started(ATTACH_TIMEOUT)
        .unwrap_or_else(|e| panic!("{e:#}"));
    let start: Value = serde_json::from_str(&first)
        .unwrap_or_else(|e| panic!("first line is not JSON ({e}): {first}"));
    assert_eq!(start["kind"], "start", "first line: {first}");
    tracer
}

/// Traces `svcs` on node-a while `traffic` runs, until its flows are decided.
fn trace(lab: &Lab, svcs: &[String], traffic: impl FnOnce()) -> Finished {
    trace_with(lab, svcs, lab::tracer::record_args(None), traffic)
}

/// [`trace`] with more nattrace arguments.
fn trace_with(lab: &Lab, svcs: &[String], more: Vec<String>, traffic: impl FnOnce()) -> Finished {
    let mut args = args(lab, svcs, &["--reply-timeout", REPLY_TIMEOUT_MS]);
    args.extend(more);
    let mut tracer = start(&args, &[]);
    traffic();
    tracer.finish().unwrap_or_else(|e| panic!("{e:#}"))
}

/// `curl` to `ip:port` from the client pod, one per source port; returns
/// how many got a page.
fn curls(lab: &Lab, ip: std::net::Ipv4Addr, port: u16, local_ports: &[u16]) -> usize {
    curl_parallel(
        lab,
        presets::CLIENT_POD,
        ip,
        port,
        local_ports,
        CURL_MAX_TIME,
    )
    .into_iter()
    .map(|r| r.expect("running curl"))
    .filter(|o| o.status.success())
    .count()
}

fn flows(done: &Finished) -> Vec<Value> {
    done.flows()
        .unwrap_or_else(|e| panic!("{e:#}\n{}", done.describe()))
}

fn summary(done: &Finished) -> Value {
    done.summary()
        .unwrap_or_else(|e| panic!("{e:#}\n{}", done.describe()))
}

fn client_ports(flows: &[Value]) -> BTreeSet<u16> {
    flows
        .iter()
        .map(|f| {
            let client = f["client"].as_str().expect("client is a string");
            client
                .rsplit(':')
                .next()
                .unwrap()
                .parse()
                .expect("client port")
        })
        .collect()
}

/// Every flow is `verdict` for the web Service, from the client pod to
/// `backend`, one flow per curl.
fn assert_web_flows(done: &Finished, ports: &[u16], verdict: &str, backend: std::net::Ipv4Addr) {
    let flows = flows(done);
    let all = done.describe();
    assert_eq!(flows.len(), ports.len(), "one flow per connection:\n{all}");
    assert_eq!(
        client_ports(&flows),
        ports.iter().copied().collect(),
        "flows for exactly the curls' source ports:\n{all}"
    );
    for f in &flows {
        assert_eq!(f["verdict"], verdict, "{f}\n{all}");
        assert_eq!(f["proto"], "tcp", "{f}");
        assert!(
            f["client"]
                .as_str()
                .unwrap()
                .starts_with(&format!("{}:", presets::CLIENT_IP)),
            "{f}"
        );
        assert_eq!(f["service"], web_svc(), "{f}");
        assert_eq!(
            f["backend"],
            format!("{backend}:{}", presets::WEB_PORT),
            "{f}"
        );
    }
    let summary = summary(done);
    assert_eq!(summary["flows"], ports.len() as u64, "{summary}");
    assert_eq!(summary["lost_events"], 0, "{summary}");
}

fn ports(base: u16, n: u16) -> Vec<u16> {
    (base..base + n).collect()
}

both_modes!(seed000_broken: root_seed000_broken_every_same_node_connection_is_not_reverse_nated, root_seed000_broken_every_same_node_connection_is_not_reverse_nated_nft);
fn seed000_broken(mode: ProxyMode) {
    let lab = seed000(false, Backend::SameNode, mode);
    let ports = ports(41000, 6);
    let _lock = tracing_lock();
    let done = trace(&lab, &[web_svc()], || {
        assert_eq!(
            curls(&lab, presets::WEB_SERVICE_IP, 80, &ports),
            0,
            "seed 000: curl fails"
        );
    });
    assert_eq!(done.status.code(), Some(1), "{}", done.describe());
    assert_web_flows(
        &done,
        &ports,
        "reply_not_reverse_nated",
        presets::BACKEND_IP,
    );
    assert_nft_chains(&done, mode, presets::BACKEND_IP);
    for f in flows(&done) {
        assert_eq!(f["cause"], "bridge_nf_call_iptables_off", "{f}");
        assert!(f["hint"].as_str().is_some_and(|h| !h.is_empty()), "{f}");
        assert!(
            f["packets"].as_array().is_some_and(|p| !p.is_empty()),
            "{f}"
        );
    }
}

both_modes!(seed000_healthy: root_seed000_healthy_every_connection_is_ok, root_seed000_healthy_every_connection_is_ok_nft);
fn seed000_healthy(mode: ProxyMode) {
    let lab = seed000(true, Backend::SameNode, mode);
    let ports = ports(42000, 5);
    let _lock = tracing_lock();
    let scratch = lab::Scratch::new(&format!("healthy-{mode:?}"));
    let rec = scratch.path("trace.rec");
    let write = vec!["--write".to_string(), rec.display().to_string()];
    let done = trace_with(&lab, &[web_svc()], write, || {
        assert_eq!(
            curls(&lab, presets::WEB_SERVICE_IP, 80, &ports),
            ports.len()
        );
    });
    assert_eq!(done.status.code(), Some(0), "{}", done.describe());
    assert_web_flows(&done, &ports, "ok", presets::BACKEND_IP);
    assert_nft_chains(&done, mode, presets::BACKEND_IP);
    for f in flows(&done) {
        assert!(f["cause"].is_null(), "{f}");
    }
    assert_event_budget(&lab, &rec, &ports, &done);
}

/// Issue 15's event budget: the kernel held each healthy handshake and,
/// once the reply reached the client reverse-NATed, sent only the SYN
/// (HOLDING), its DNAT (KEPT: the backend asserted above comes from it)
/// and that reply (VIA_NODE) — counted in the recording, per connection.
fn assert_event_budget(lab: &Lab, rec: &std::path::Path, ports: &[u16], done: &Finished) {
    use std::os::unix::fs::MetadataExt;
    let text = std::fs::read_to_string(rec).expect("the recording");
    // This lab's namespaces only: another lab on this kernel may use the
    // same addresses and ports (the tracepoints see every namespace).
    let node = lab.node_netns(presets::NODE_A).expect("node-a").path();
    let dir = node.parent().expect("the netns directory");
    let ours: BTreeSet<u64> = lab
        .netns_names()
        .iter()
        .filter_map(|n| std::fs::metadata(dir.join(n)).ok())
        .map(|m| m.ino())
        .collect();
    let mut per_port: std::collections::BTreeMap<u64, Vec<Value>> = Default::default();
    for ev in text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["kind"] == "event" && v["netns"].as_u64().is_some_and(|n| ours.contains(&n)))
    {
        let client = if ev["direction"] == 2 {
            &ev["dport"]
        } else {
            &ev["sport"]
        };
        let port = client.as_u64().unwrap();
        if ports.contains(&(port as u16)) {
            per_port.entry(port).or_default().push(ev);
        }
    }
    assert_eq!(per_port.len(), ports.len(), "{}", done.describe());
    for (port, events) in &per_port {
        let flags: Vec<u64> = events
            .iter()
            .map(|e| e["flags"].as_u64().unwrap_or(0))
            .collect();
        // The events themselves in the message: an extra one (seen once
        // beside stress-ng) says which packet escaped the budget.
        let shown: Vec<String> = events
            .iter()
            .map(|e| {
                format!(
                    "hook {} nf_hook {} tcp_flags {:#04x} flags {} {}:{}->{}:{} ts {}",
                    e["hook"],
                    e["nf_hook"],
                    e["tcp_flags"].as_u64().unwrap_or(0),
                    e["flags"],
                    e["saddr"],
                    e["sport"],
                    e["daddr"],
                    e["dport"],
                    e["ts_ns"]
                )
            })
            .collect();
        assert_eq!(
            flags,
            [1, 8, 16],
            "port {port}: ≤ 3 events per healthy connection:\n{}",
            shown.join("\n")
        );
    }
    let s = summary(done);
    assert!(
        s["held_discarded"].as_u64().unwrap() >= 10 * ports.len() as u64,
        "{s}"
    );
}

both_modes!(cross_node_both_settings: root_cross_node_backend_is_ok_with_both_settings, root_cross_node_backend_is_ok_with_both_settings_nft);
fn cross_node_both_settings(mode: ProxyMode) {
    for bridge_nf_call_iptables in [true, false] {
        let lab = seed000(bridge_nf_call_iptables, Backend::OtherNode, mode);
        let ports = ports(43000, 5);
        let _lock = tracing_lock();
        let done = trace(&lab, &[web_svc()], || {
            assert_eq!(
                curls(&lab, presets::WEB_SERVICE_IP, 80, &ports),
                ports.len()
            );
        });
        assert_eq!(
            done.status.code(),
            Some(0),
            "bridge-nf-call-iptables={bridge_nf_call_iptables}: {}",
            done.describe()
        );
        assert_web_flows(&done, &ports, "ok", presets::REMOTE_BACKEND_IP);
        assert_nft_chains(&done, mode, presets::REMOTE_BACKEND_IP);
    }
}

/// A Service nobody else's lab uses, next to seed 000's, with the same
/// same-node backend: traced alone while traffic goes elsewhere.
const OTHER_SVC_IP: std::net::Ipv4Addr = std::net::Ipv4Addr::new(100, 67, 99, 1);

fn two_services_lab() -> Lab {
    let spec = presets::seed000(Seed000 {
        bridge_nf_call_iptables: true,
        backend: Backend::SameNode,
    })
    .service(
        ServiceSpec::new("default", "other", "http", OTHER_SVC_IP, 80, Protocol::Tcp)
            .endpoint(presets::BACKEND_POD, presets::WEB_PORT),
    );
    build_lab(spec)
}

#[test]
fn root_filter_traffic_to_other_ips_produces_no_events() {
    require_root!();
    let lab = two_services_lab();
    let _lock = tracing_lock();
    let done = trace(&lab, &[format!("{OTHER_SVC_IP}:80")], || {
        // Seed 000's Service, the backend pod directly, and the node's
        // gateway address (refused): none of them is the traced Service.
        let to_web = curls(&lab, presets::WEB_SERVICE_IP, 80, &ports(44000, 3));
        let to_pod = curls(&lab, presets::BACKEND_IP, 80, &ports(44100, 3));
        let gateway = presets::NODE_A_POD_CIDR.host(1);
        let to_node = curls(&lab, gateway, 80, &ports(44200, 2));
        assert_eq!((to_web, to_pod, to_node), (3, 3, 0));
    });
    // Nothing failed, and the traced Service saw no connection: 4 (README).
    assert_eq!(done.status.code(), Some(4), "{}", done.describe());
    assert!(flows(&done).is_empty(), "{}", done.describe());
    let summary = summary(&done);
    for counter in ["flows", "events", "unmatched_events", "lost_events"] {
        assert_eq!(summary[counter], 0, "{counter}: {summary}");
    }
}

#[test]
fn root_filter_with_traffic_to_both_services_only_the_traced_one_appears() {
    require_root!();
    let lab = two_services_lab();
    let (traced, other) = (ports(45000, 4), ports(45100, 4));
    let _lock = tracing_lock();
    let done = trace(&lab, &[format!("{OTHER_SVC_IP}:80")], || {
        std::thread::scope(|s| {
            let a = s.spawn(|| curls(&lab, OTHER_SVC_IP, 80, &traced));
            let b = s.spawn(|| curls(&lab, presets::WEB_SERVICE_IP, 80, &other));
            assert_eq!((a.join().unwrap(), b.join().unwrap()), (4, 4));
        });
    });
    assert_eq!(done.status.code(), Some(0), "{}", done.describe());
    let flows = flows(&done);
    assert_eq!(
        client_ports(&flows),
        traced.iter().copied().collect(),
        "{}",
        done.describe()
    );
    assert_eq!(flows.len(), traced.len(), "{}", done.describe());
    for f in &flows {
        assert_eq!(f["service"], format!("{OTHER_SVC_IP}:80"), "{f}");
        assert_eq!(f["verdict"], "ok", "{f}");
    }
}
