//! ICMP errors across the NAT and path-MTU black holes (issue 23), with
//! real traffic: two routed nodes whose underlay (`eth0`) carries 1400
//! bytes while the pods' interfaces carry 1500, a client pod on node-a
//! and the Service's backend on node-b. A large upload through the Service
//! makes node-a drop the client's full-size packets (PKT_TOO_BIG) and send
//! the client an ICMP fragmentation needed, which conntrack translates
//! back to the Service's address on the way (POSTROUTING,
//! nf_nat_icmp_reply_translation). With that error dropped by a rule the
//! upload stalls (black hole); with it allowed, path-MTU discovery works.
//! Needs root (tests are prefixed `root_`); without it they print why
//! they are skipped and pass.

use std::io::Write as _;
use std::time::Duration;

use lab::presets::{self, Backend};
use lab::tracer::{Finished, Nattrace, nattrace, tracing_lock};
use lab::{Datapath, Lab, ProxyMode, build_lab};
use serde_json::Value;

macro_rules! require_root {
    () => {
        if lab::skip_without_root(
            "ICMP/PMTU tests need root (network namespaces, eBPF); \
             run `sudo cargo test -p nattrace-tests --test icmp` or in CI",
        ) {
            return;
        }
    };
}

const ATTACH_TIMEOUT: Duration = Duration::from_secs(30);
/// The underlay's MTU, below the pods' 1500.
const UNDERLAY_MTU: &str = "1400";
/// The upload: far more than one window of full-size segments.
const UPLOAD_BYTES: usize = 512 * 1024;
/// curl's own limit: a black-holed upload stalls until it (exit 28).
const CURL_TIMEOUT_S: &str = "4";

/// seed 000's routed two-node lab, backend on the other node, with the
/// underlay shrunk to [`UNDERLAY_MTU`] on both nodes.
fn mtu_lab(mode: ProxyMode) -> Lab {
    let mut spec = presets::seed000(presets::Seed000 {
        bridge_nf_call_iptables: true,
        backend: Backend::OtherNode,
    })
    .with_datapath(Datapath::Routed);
    spec.kube_proxy.mode = mode;
    let lab = build_lab(spec);
    for node in [presets::NODE_A, presets::NODE_B] {
        lab.run(node, &["ip", "link", "set", "eth0", "mtu", UNDERLAY_MTU])
            .expect("setting the underlay MTU");
    }
    lab
}

/// A rule on `node` dropping the fragmentation-needed errors the node
/// itself sends (OUTPUT: they are locally generated, icmp_send).
fn drop_frag_needed(lab: &Lab, node: &str) {
    lab.run(
        node,
        &[
            "iptables-nft",
            "-I",
            "OUTPUT",
            "-p",
            "icmp",
            "--icmp-type",
            "fragmentation-needed",
            "-j",
            "DROP",
        ],
    )
    .expect("adding the ICMP DROP rule");
}

/// A file of `UPLOAD_BYTES` for curl to PUT; removed when dropped.
struct Upload(std::path::PathBuf);

impl Upload {
    fn new(tag: &str) -> Upload {
        let path =
            std::env::temp_dir().join(format!("nattrace-icmp-{tag}-{}.bin", std::process::id()));
        let mut f = std::fs::File::create(&path).expect("creating the upload");
        f.write_all(&vec![b'u'; UPLOAD_BYTES]).unwrap();
        Upload(path)
    }
}

impl Drop for Upload {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// PUTs the upload to the Service from the client pod: curl's exit status
/// and what the server answered.
fn upload(lab: &Lab, file: &Upload) -> (Option<i32>, String) {
    let url = format!(
        "http://{}:{}/up",
        presets::WEB_SERVICE_IP,
        presets::WEB_PORT
    );
    upload_to(lab, file, &url)
}

fn upload_to(lab: &Lab, file: &Upload, url: &str) -> (Option<i32>, String) {
    let path = file.0.display().to_string();
    let out = lab
        .exec_timeout(
            presets::CLIENT_POD,
            &[
                "curl",
                "-sS",
                "-m",
                CURL_TIMEOUT_S,
                "-H",
                "Expect:",
                "-T",
                &path,
                url,
            ],
            Duration::from_secs(20),
        )
        .expect("running curl");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// Traces the web Service on node-a (JSON, every packet, recorded) while
/// `traffic` runs.
fn trace(lab: &Lab, rec: &std::path::Path, traffic: impl FnOnce()) -> Finished {
    let svc = format!("{}:{}", presets::WEB_SERVICE_IP, presets::WEB_PORT);
    trace_svc(lab, &svc, rec, traffic)
}

fn trace_svc(lab: &Lab, svc: &str, rec: &std::path::Path, traffic: impl FnOnce()) -> Finished {
    let ns = lab.node_netns(presets::NODE_A).expect("node").path();
    let args: Vec<String> = [
        "--svc",
        svc,
        "--netns",
        &ns.display().to_string(),
        "--reply-timeout",
        "1000",
        "--output",
        "json",
        "-v",
        "--write",
        &rec.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut tracer = Nattrace::spawn(&nattrace(), &args, &[], false).expect("starting nattrace");
    tracer
        .wait_started(ATTACH_TIMEOUT)
        .unwrap_or_else(|e| panic!("{e:#}"));
    traffic();
    tracer.finish().unwrap_or_else(|e| panic!("{e:#}"))
}

/// The recording's ICMP error events.
fn icmp_events(rec: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(rec)
        .expect("reading the recording")
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["kind"] == "event" && v["icmp_type"].as_u64().is_some_and(|t| t != 0))
        .collect()
}

/// `nattrace analyze` of the recording, JSON flows.
fn analyze(rec: &std::path::Path) -> Vec<Value> {
    let out = std::process::Command::new(nattrace())
        .args([
            "analyze",
            &rec.display().to_string(),
            "--output",
            "json",
            "-v",
        ])
        .output()
        .expect("running analyze");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["kind"] == "flow")
        .collect()
}

/// Verdict, cause and ICMP errors of each flow: what live and analyze
/// must agree on.
fn decisions(flows: &[Value]) -> Vec<String> {
    let mut d: Vec<String> = flows
        .iter()
        .map(|f| {
            format!(
                "{} {} {} {}",
                f["client"], f["verdict"], f["cause"], f["icmp_errors"]
            )
        })
        .collect();
    d.sort();
    d
}

fn black_hole(mode: ProxyMode) {
    let _guard = tracing_lock();
    let lab = mtu_lab(mode);
    drop_frag_needed(&lab, presets::NODE_A);
    // doctor sees both halves statically: the pods' MTU above the
    // uplink's, and the rule dropping the error.
    let (code, doctor) = lab::tracer::doctor(&lab, presets::NODE_A);
    assert_eq!(code, Some(1), "{doctor}");
    let finding = |check: &str| {
        doctor["findings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["check"] == check)
            .cloned()
            .unwrap_or_else(|| panic!("no {check}: {doctor}"))
    };
    let mtu = finding("mtu");
    assert_eq!(mtu["severity"], "error", "{mtu}");
    assert_eq!(mtu["value"], "mtu=1500>1400", "{mtu}");
    assert!(
        mtu["message"]
            .as_str()
            .unwrap()
            .contains("uplink eth0 (MTU 1400)"),
        "{mtu}"
    );
    let rule = finding("icmp_frag_needed");
    assert_eq!(rule["severity"], "warning", "{rule}");
    assert!(
        rule["message"].as_str().unwrap().contains("OUTPUT"),
        "{rule}"
    );
    let file = Upload::new("blackhole");
    // The client's symptom first, untraced: the handshake works, the
    // upload stalls until curl gives up.
    let (code, _) = upload(&lab, &file);
    assert_eq!(code, Some(28), "a black-holed upload times out");

    let rec = std::env::temp_dir().join(format!("nattrace-icmp-bh-{}.rec", lab.id()));
    let done = trace(&lab, &rec, || {
        let (code, _) = upload(&lab, &file);
        assert_eq!(code, Some(28), "a black-holed upload times out");
    });
    let flows = done.flows().expect("JSON flows");
    let f = flows
        .iter()
        .find(|f| f["cause"] == "pmtu_blackhole")
        .unwrap_or_else(|| panic!("a pmtu_blackhole flow: {}", done.describe()));
    assert_eq!(f["verdict"], "dropped", "{}", done.describe());
    assert_eq!(f["k8s_service"], "default/web:http", "{f}");
    let text = f["cause_text"].as_str().unwrap();
    // Named with the two MTUs and where the error died.
    assert!(text.contains("1400-byte link"), "{text}");
    assert!(text.contains("PKT_TOO_BIG"), "{text}");
    assert!(text.contains("ICMP fragmentation needed"), "{text}");
    assert!(text.contains("NETFILTER_DROP"), "{text}");
    assert!(text.contains("after netfilter OUTPUT"), "{text}");
    let errors = f["icmp_errors"].as_array().expect("icmp_errors");
    let e = &errors[0];
    assert_eq!(e["type"], 3, "{e}");
    assert_eq!(e["code"], 4, "{e}");
    assert_eq!(e["mtu"], 1400, "{e}");
    assert_eq!(e["about"], "request", "{e}");
    assert_eq!(e["reached_sender"], false, "{e}");
    assert_eq!(e["dropped"], "NETFILTER_DROP", "{e}");

    // The recording decides the same.
    let again = analyze(&rec);
    assert_eq!(decisions(&again), decisions(&flows));
    let _ = std::fs::remove_file(&rec);
}

#[test]
fn root_pmtu_black_hole_upload_is_named_iptables() {
    require_root!();
    black_hole(ProxyMode::Iptables);
}

#[test]
fn root_pmtu_black_hole_upload_is_named_nftables() {
    require_root!();
    black_hole(ProxyMode::Nftables);
}

/// The healthy twin: the same lab without the rule. The error reaches the
/// client translated back to the Service (its quote names the Service, so
/// the client's socket finds it), the client sends smaller packets, the
/// upload completes: every flow `ok`.
#[test]
fn root_pmtu_discovery_through_the_service_is_ok() {
    require_root!();
    let _guard = tracing_lock();
    let lab = mtu_lab(ProxyMode::Iptables);
    let file = Upload::new("pmtu");
    let rec = std::env::temp_dir().join(format!("nattrace-icmp-ok-{}.rec", lab.id()));
    let done = trace(&lab, &rec, || {
        let (code, body) = upload(&lab, &file);
        assert_eq!(code, Some(0), "the upload completes: {body}");
        assert!(
            body.contains(&format!("got {UPLOAD_BYTES} bytes")),
            "{body}"
        );
    });
    let flows = done.flows().expect("JSON flows");
    assert!(!flows.is_empty(), "{}", done.describe());
    for f in &flows {
        assert_eq!(f["verdict"], "ok", "{}", done.describe());
    }
    // The kernel saw the error at the client translated back: its quote
    // names the Service there, the backend before POSTROUTING's NAT.
    let events = icmp_events(&rec);
    let svc = presets::WEB_SERVICE_IP.to_string();
    let backend = presets::REMOTE_BACKEND_IP.to_string();
    let frag = |e: &&Value| e["icmp_type"] == 3 && e["icmp_code"] == 4 && e["icmp_mtu"] == 1400;
    assert!(
        events
            .iter()
            .filter(frag)
            .any(|e| e["hook"] == 4 && e["daddr"] == svc.as_str()),
        "a fragmentation needed quoting the Service at the client's receive: {events:?}"
    );
    assert!(
        events
            .iter()
            .filter(frag)
            .any(|e| e["hook"] == 3 && e["nat_stage"] == 1 && e["daddr"] == backend.as_str()),
        "the same error quoting the backend before NAT: {events:?}"
    );
    // Where the flow report carries it, it reached the client translated.
    for f in &flows {
        for e in f["icmp_errors"].as_array().into_iter().flatten() {
            assert_eq!(e["reached_sender"], true, "{e}");
            assert_eq!(e["translated"], true, "{e}");
        }
    }
    let again = analyze(&rec);
    assert_eq!(decisions(&again), decisions(&flows));
    let _ = std::fs::remove_file(&rec);
}

/// The large response: the backend's full-size reply packets do not fit
/// node-b's underlay; node-b's fragmentation needed to the backend is
/// dropped by a rule there. The handshake and request work, the response
/// never arrives: the connection, `ok` at its opening, is named a black
/// hole about the reply packets mid-stream.
#[test]
fn root_pmtu_black_hole_of_a_large_response_is_named() {
    require_root!();
    let _guard = tracing_lock();
    let lab = mtu_lab(ProxyMode::Iptables);
    drop_frag_needed(&lab, presets::NODE_B);
    let get = || {
        let url = format!(
            "http://{}:{}/big",
            presets::WEB_SERVICE_IP,
            presets::WEB_PORT
        );
        lab.exec_timeout(
            presets::CLIENT_POD,
            &["curl", "-sS", "-m", CURL_TIMEOUT_S, "-o", "/dev/null", &url],
            Duration::from_secs(20),
        )
        .expect("running curl")
        .status
        .code()
    };
    assert_eq!(get(), Some(28), "a black-holed response times out");
    let rec = std::env::temp_dir().join(format!("nattrace-icmp-big-{}.rec", lab.id()));
    let done = trace(&lab, &rec, || {
        assert_eq!(get(), Some(28), "a black-holed response times out");
    });
    let flows = done.flows().expect("JSON flows");
    let f = flows
        .iter()
        .find(|f| f["cause"] == "pmtu_blackhole")
        .unwrap_or_else(|| panic!("a pmtu_blackhole flow: {}", done.describe()));
    let text = f["cause_text"].as_str().unwrap();
    assert!(text.contains("reply packets"), "{text}");
    assert!(text.contains("1400-byte link"), "{text}");
    assert!(
        text.contains("never at the backend") || text.contains("NETFILTER_DROP"),
        "{text}"
    );
    let e = &f["icmp_errors"][0];
    assert_eq!(e["about"], "reply", "{e}");
    assert_eq!(e["mtu"], 1400, "{e}");
    assert_eq!(e["reached_sender"], false, "{e}");
    let again = analyze(&rec);
    assert_eq!(decisions(&again), decisions(&flows));
    let _ = std::fs::remove_file(&rec);
}

/// kube-proxy's REJECT of a Service without endpoints, seen as the ICMP
/// port unreachable it is: the error reached the client, quoting the
/// Service (so curl's connect fails at once, "connection refused").
fn reject_reaches_client(mode: ProxyMode) {
    let _guard = tracing_lock();
    let mut spec = presets::no_endpoints();
    spec.kube_proxy.mode = mode;
    let lab = build_lab(spec);
    let svc = format!("{}:{}", presets::EMPTY_SERVICE_IP, presets::WEB_PORT);
    let rec = std::env::temp_dir().join(format!("nattrace-icmp-reject-{}.rec", lab.id()));
    let done = trace_svc(&lab, &svc, &rec, || {
        let out = lab
            .http_get(
                presets::CLIENT_POD,
                presets::EMPTY_SERVICE_IP,
                presets::WEB_PORT,
                Duration::from_secs(2),
            )
            .expect("curl");
        assert_eq!(out.status.code(), Some(7), "connection refused at once");
    });
    let f = done.only_flow();
    assert_eq!(f["cause"], "no_endpoints", "{}", done.describe());
    let text = f["cause_text"].as_str().unwrap();
    assert!(
        text.contains("the client received the ICMP port unreachable"),
        "{text}"
    );
    let e = &f["icmp_errors"][0];
    assert_eq!(e["type"], 3, "{e}");
    assert_eq!(e["code"], 3, "{e}");
    assert_eq!(e["reached_sender"], true, "{e}");
    assert_eq!(e["translated"], true, "{e}");
    let again = analyze(&rec);
    assert_eq!(decisions(&again), decisions(&[f]));
    let _ = std::fs::remove_file(&rec);
}

#[test]
fn root_no_endpoints_reject_reaches_the_client_iptables() {
    require_root!();
    reject_reaches_client(ProxyMode::Iptables);
}

#[test]
fn root_no_endpoints_reject_reaches_the_client_nftables() {
    require_root!();
    reject_reaches_client(ProxyMode::Nftables);
}

/// IPv6: the node sends the client an ICMPv6 packet too big (routers do
/// not fragment IPv6), dropped by an ip6tables rule: the same black hole,
/// named with the ICMPv6 error.
#[test]
fn root_pmtu_black_hole_over_ipv6_is_named() {
    require_root!();
    let _guard = tracing_lock();
    let mut spec = presets::seed000(presets::Seed000 {
        bridge_nf_call_iptables: true,
        backend: Backend::OtherNode,
    })
    .with_datapath(Datapath::Routed)
    .dual_stack();
    spec.kube_proxy.mode = ProxyMode::Iptables;
    let lab = build_lab(spec);
    for node in [presets::NODE_A, presets::NODE_B] {
        lab.run(node, &["ip", "link", "set", "eth0", "mtu", UNDERLAY_MTU])
            .expect("setting the underlay MTU");
    }
    lab.run(
        presets::NODE_A,
        &[
            "ip6tables-nft",
            "-I",
            "OUTPUT",
            "-p",
            "ipv6-icmp",
            "--icmpv6-type",
            "packet-too-big",
            "-j",
            "DROP",
        ],
    )
    .expect("adding the ICMPv6 DROP rule");
    let web6 = lab::dual_stack::service_ip6(presets::WEB_SERVICE_IP);
    let url = format!("http://[{web6}]:{}/up", presets::WEB_PORT);
    let file = Upload::new("v6");
    let (code, _) = upload_to(&lab, &file, &url);
    assert_eq!(code, Some(28), "a black-holed upload times out");
    let svc = format!("[{web6}]:{}", presets::WEB_PORT);
    let rec = std::env::temp_dir().join(format!("nattrace-icmp-v6-{}.rec", lab.id()));
    let done = trace_svc(&lab, &svc, &rec, || {
        let (code, _) = upload_to(&lab, &file, &url);
        assert_eq!(code, Some(28), "a black-holed upload times out");
    });
    let flows = done.flows().expect("JSON flows");
    let f = flows
        .iter()
        .find(|f| f["cause"] == "pmtu_blackhole")
        .unwrap_or_else(|| panic!("a pmtu_blackhole flow: {}", done.describe()));
    let text = f["cause_text"].as_str().unwrap();
    assert!(text.contains("ICMPv6 packet too big"), "{text}");
    assert!(text.contains("1400-byte link"), "{text}");
    let e = &f["icmp_errors"][0];
    assert_eq!(e["family"], "icmpv6", "{e}");
    assert_eq!(e["type"], 2, "{e}");
    assert_eq!(e["mtu"], 1400, "{e}");
    assert_eq!(e["reached_sender"], false, "{e}");
    let again = analyze(&rec);
    assert_eq!(decisions(&again), decisions(&flows));
    let _ = std::fs::remove_file(&rec);
}

/// An ICMP error not translated back (cause `icmp_error_not_reverse_nated`):
/// seed 001's node (bridge-nf-call-iptables=0, same-node DNS backend)
/// with the DNS server stopped. The backend's kernel answers the DNATed
/// query with ICMP port unreachable; bridged past netfilter, conntrack
/// never translates its quote, so it reaches the client quoting the
/// backend's address, which the client's stack discards: dig times out
/// instead of failing at once.
#[test]
fn root_icmp_error_bridged_past_netfilter_is_not_reverse_nated() {
    require_root!();
    let _guard = tracing_lock();
    let lab = build_lab(presets::dns(presets::Dns {
        bridge_nf_call_iptables: false,
        backend: Backend::SameNode,
    }));
    lab.stop_pod_servers(presets::DNS_POD)
        .expect("stopping the DNS server");
    let svc = format!("{}:53", presets::DNS_SERVICE_IP);
    let rec = std::env::temp_dir().join(format!("nattrace-icmp-unrev-{}.rec", lab.id()));
    let done = trace_svc(&lab, &svc, &rec, || {
        let out = lab
            .dig(
                presets::CLIENT_POD,
                presets::DNS_SERVICE_IP,
                presets::DNS_NAME,
                Duration::from_secs(1),
            )
            .expect("dig");
        // dig: "connection timed out; no servers could be reached".
        assert_eq!(out.status.code(), Some(9), "{out:?}");
    });
    let f = done.only_flow();
    assert_eq!(
        f["cause"],
        "icmp_error_not_reverse_nated",
        "{}",
        done.describe()
    );
    let backend = presets::DNS_POD_IP.to_string();
    let e = &f["icmp_errors"][0];
    assert_eq!(e["code"], 3, "{e}");
    assert_eq!(e["reached_sender"], true, "{e}");
    assert_eq!(e["translated"], false, "{e}");
    assert!(
        e["quoted_dst"].as_str().unwrap().starts_with(&backend),
        "{e}"
    );
    let again = analyze(&rec);
    assert_eq!(decisions(&again), decisions(&[f]));
    let _ = std::fs::remove_file(&rec);
}
