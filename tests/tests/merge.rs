//! One story across nodes (issue 14): two nattraces record seed 003's two
//! nodes at once (`--write`), and `nattrace analyze b.rec a.rec` decides
//! each flow from both halves. One lab serves both cases: the broken
//! connection first, then kube-proxy's masqueradeAll rule is added on node-b
//! (what kube-proxy writes with `masqueradeAll: true`) and the next
//! connection must be `ok` with the SNAT shown. Needs root.
//!
//! `NATTRACE_WRITE_FIXTURE=1` also copies the two recordings to
//! `tracer-userspace/src/merge/fixtures/` (the merge unit tests' input).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use lab::kube_proxy::svc_chain;
use lab::presets::{self, Seed003, web_svc};
use lab::tracer::{Nattrace, ip_of, nattrace, tracing_lock};
use lab::{Lab, Protocol, build_lab};
use serde_json::Value;

const ATTACH_TIMEOUT: Duration = Duration::from_secs(30);
const CLIENT_TIMEOUT: Duration = Duration::from_secs(1);
/// After the broken request: long enough for node-b's collector to name
/// its cause (it waits ~3.5 s for a neighbour failure before routing causes).
const SETTLE: Duration = Duration::from_millis(4000);

fn outside_curl(lab: &Lab) -> bool {
    lab.http_get(
        lab::OUTSIDE,
        presets::WEB_SERVICE_IP,
        presets::WEB_PORT,
        CLIENT_TIMEOUT,
    )
    .expect("running curl")
    .status
    .success()
}

/// kube-proxy's masqueradeAll rule (iptables mode), first in the Service's chain.
fn masquerade_all(lab: &Lab, node: &str) {
    let chain = svc_chain("default/web:http", Protocol::Tcp);
    let svc = format!("{}/32", presets::WEB_SERVICE_IP);
    let port = presets::WEB_PORT.to_string();
    lab.run(
        node,
        &[
            "iptables",
            "-w",
            "5",
            "-t",
            "nat",
            "-I",
            &chain,
            "1",
            "-d",
            &svc,
            "-p",
            "tcp",
            "-m",
            "tcp",
            "--dport",
            &port,
            "-j",
            "KUBE-MARK-MASQ",
        ],
    )
    .expect("adding the masqueradeAll rule");
}

fn record(lab: &Lab, node: &str, svc: &str, out: &Path, name: Option<&str>) -> Nattrace {
    let ns = lab.node_netns(node).expect("node").path();
    let mut args: Vec<String> = [
        "--svc",
        svc,
        "--netns",
        &ns.display().to_string(),
        "--reply-timeout",
        "1000",
        "--output",
        "json",
        "--write",
        &out.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if let Some(n) = name {
        args.extend(["--node-name".to_string(), n.to_string()]);
    }
    Nattrace::spawn(&nattrace(), &args, &[], false).expect("starting nattrace")
}

fn analyze(args: &[&str]) -> std::process::Output {
    Command::new(nattrace())
        .arg("analyze")
        .args(args)
        .output()
        .expect("running nattrace analyze")
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn root_merge_seed003_recordings_of_both_nodes() {
    if lab::skip_without_root(
        "the merge test needs root (network namespaces, eBPF); \
         run `sudo cargo test -p nattrace-tests --test merge` or in CI",
    ) {
        return;
    }
    let started = Instant::now();
    let _lock = tracing_lock();
    let dir = TempDir(std::env::temp_dir().join(format!("nattrace-merge-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).expect("temp dir");
    let (b_rec, a_rec) = (dir.0.join("node-b.rec"), dir.0.join("node-a.rec"));
    let a_backend_rec = dir.0.join("node-a-backend.rec");
    let backend_svc = format!("{}:{}", presets::BACKEND_IP, presets::WEB_PORT);

    let lab = build_lab(presets::seed003(Seed003::default()));
    // node-b named explicitly, node-a by its --netns name (the default).
    let svc = web_svc();
    let mut b = record(&lab, presets::NODE_B, &svc, &b_rec, Some(presets::NODE_B));
    let mut a = record(&lab, presets::NODE_A, &svc, &a_rec, None);
    // How a separate backend node is traced: the backend's address, which
    // the requests DNATed elsewhere arrive with (README, "One story across nodes").
    let mut a_backend = record(
        &lab,
        presets::NODE_A,
        &backend_svc,
        &a_backend_rec,
        Some(presets::NODE_A),
    );
    for t in [&mut b, &mut a, &mut a_backend] {
        t.wait_started(ATTACH_TIMEOUT)
            .unwrap_or_else(|e| panic!("{e:#}"));
    }
    assert!(!outside_curl(&lab), "seed 003: the connection fails");
    std::thread::sleep(SETTLE);
    masquerade_all(&lab, presets::NODE_B);
    assert!(outside_curl(&lab), "masqueradeAll fixes seed 003");
    std::thread::sleep(Duration::from_millis(500));
    for t in [&b, &a, &a_backend] {
        t.terminate();
    }
    let done_b = b.wait(ATTACH_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    let done_a = a.wait(ATTACH_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    a_backend
        .wait(ATTACH_TIMEOUT)
        .unwrap_or_else(|e| panic!("{e:#}"));

    if std::env::var_os("NATTRACE_WRITE_FIXTURE").is_some() {
        let fixtures =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../tracer-userspace/src/merge/fixtures");
        std::fs::create_dir_all(&fixtures).expect("fixtures dir");
        for (from, to) in [
            (&b_rec, "seed003_node_b.rec"),
            (&a_rec, "seed003_node_a.rec"),
            (&a_backend_rec, "seed003_node_a_backend.rec"),
        ] {
            std::fs::copy(from, fixtures.join(to)).expect("copying the fixture");
        }
    }

    // Each node alone tells half of it.
    let cause_of = |done: &lab::tracer::Finished| {
        done.flows()
            .unwrap_or_else(|e| panic!("{e:#}"))
            .first()
            .map(|f| f["cause"].clone())
    };
    assert_eq!(
        cause_of(&done_b),
        Some("no_reply_through_node".into()),
        "{}",
        done_b.describe()
    );
    assert_eq!(
        cause_of(&done_a),
        Some("reply_bypasses_dnat_node".into()),
        "{}",
        done_a.describe()
    );

    let node_a = lab
        .node_netns(presets::NODE_A)
        .expect("node-a")
        .path()
        .file_name()
        .expect("a name")
        .to_string_lossy()
        .into_owned();
    let b_path = b_rec.display().to_string();
    let a_path = a_rec.display().to_string();
    let pcap = dir.0.join("merged.pcapng");
    let pcap_path = pcap.display().to_string();
    let out = analyze(&[
        "--output", "json", "-v", "--pcap", &pcap_path, &b_path, &a_path,
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let describe = format!(
        "exit {}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let flows: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .filter(|v: &Value| v["kind"] == "flow")
        .collect();
    assert_eq!(flows.len(), 2, "one flow per connection: {describe}");
    assert_eq!(out.status.code(), Some(1), "{describe}");

    // Seed 003: one flow, the cause names the asymmetric return path.
    let f = &flows[0];
    assert_eq!(f["verdict"], "reply_not_reverse_nated", "{describe}");
    assert_eq!(f["cause"], "asymmetric_return_path", "{describe}");
    assert!(
        f["hint"].as_str().unwrap_or("").contains("masqueradeAll"),
        "{f}"
    );
    assert_eq!(ip_of(&f["client"]), presets::OUTSIDE_CLIENT.addr(), "{f}");
    let backend = format!("{}:80", presets::BACKEND_IP);
    assert_eq!(f["backend"], backend, "{f}");
    let syn = node_hops(f, "SYN");
    assert_eq!(syn.first().map(|h| h.0.as_str()), Some("node-b"), "{syn:?}");
    for (node, place) in [
        ("node-b", "tc-ingress eth0"),
        ("node-b", "netfilter PREROUTING after-nat"),
        ("node-b", "netfilter FORWARD"),
        ("node-b", "tc-egress flannel.1"),
        (node_a.as_str(), "tc-ingress flannel.1"),
        (node_a.as_str(), "tc-egress veth0"),
    ] {
        assert!(
            syn.contains(&(node.to_string(), place.to_string())),
            "{node} {place}: {syn:?}"
        );
    }
    let first_a = syn.iter().position(|h| h.0 == node_a).expect("node-a hops");
    assert!(
        syn[..first_a].iter().all(|h| h.0 == "node-b"),
        "node-b, then node-a: {syn:?}"
    );
    let reply = node_hops(f, "SYN-ACK");
    assert!(
        !reply.is_empty() && reply.iter().all(|h| h.0 == node_a),
        "the reply never passes node-b: {reply:?}"
    );
    assert_eq!(
        reply.last().map(|h| h.1.as_str()),
        Some("tc-egress eth0"),
        "{reply:?}"
    );

    // masqueradeAll: ok, with node-b's SNAT shown.
    let f = &flows[1];
    assert_eq!(f["verdict"], "ok", "{describe}");
    assert!(f["cause"].is_null(), "{f}");
    assert_eq!(ip_of(&f["snat"]), presets::NODE_B_POD_CIDR.network(), "{f}");

    // pcapng: an interface per node and point.
    let bytes = std::fs::read(&pcap).expect("the pcapng");
    assert_eq!(bytes[..4], [0x0a, 0x0d, 0x0d, 0x0a], "a pcapng section");
    for name in [
        "node-b: tc-egress flannel.1".to_string(),
        format!("{node_a}: tc-egress eth0"),
    ] {
        assert!(
            bytes.windows(name.len()).any(|w| w == name.as_bytes()),
            "no interface {name} in the pcapng"
        );
    }

    // tshark reads it: node-a's SYN-ACK leaves by eth0 with the pod's source.
    let out = Command::new("tshark")
        .args(["-r", &pcap_path, "-T", "fields", "-E", "separator=/t"])
        .args([
            "-e",
            "frame.interface_name",
            "-e",
            "ip.src",
            "-e",
            "tcp.flags",
        ])
        .output()
        .expect("running tshark");
    let frames = String::from_utf8_lossy(&out.stdout).to_string();
    let want = format!("{node_a}: tc-egress eth0\t{}\t0x0012", presets::BACKEND_IP);
    assert!(
        frames.lines().any(|l| l == want),
        "{want} not in:\n{frames}"
    );

    // node-a traced by the backend's address: the same two stories.
    let a_backend_path = a_backend_rec.display().to_string();
    let out = analyze(&["--output", "json", "-v", &b_path, &a_backend_path]);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let flows: Vec<Value> = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["kind"] == "flow")
        .collect();
    let verdicts: Vec<(String, String)> = flows
        .iter()
        .map(|f| (f["verdict"].to_string(), f["cause"].to_string()))
        .collect();
    assert_eq!(
        verdicts,
        [
            (
                r#""reply_not_reverse_nated""#.into(),
                r#""asymmetric_return_path""#.into()
            ),
            (r#""ok""#.into(), "null".into())
        ],
        "{stdout}"
    );
    assert!(
        node_hops(&flows[1], "SYN").contains(&("node-a".into(), "tc-egress veth0".into())),
        "node-a's own half of the masqueraded flow: {}",
        flows[1]
    );

    // Text: the same story in one line per flow.
    let text = analyze(&["--color", "never", &b_path, &a_path]);
    let text = String::from_utf8_lossy(&text.stdout).to_string();
    assert!(text.contains("cause: asymmetric_return_path"), "{text}");
    assert!(text.contains("SNAT→ 100.96.55.0:"), "{text}");
    eprintln!("merge test took {:?}", started.elapsed());
}

/// (node, place) of every hop in a node's own namespace of packet `kind`.
fn node_hops(flow: &Value, kind: &str) -> Vec<(String, String)> {
    let p = flow["packets"]
        .as_array()
        .expect("packets")
        .iter()
        .find(|p| p["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind}: {flow}"));
    p["hops"]
        .as_array()
        .expect("hops")
        .iter()
        .filter(|h| h["node_ns"] == true)
        .map(|h| {
            let mut place = vec![h["hook"].as_str().unwrap_or("")];
            for k in ["nf_hook", "nat_stage"] {
                if let Some(v) = h[k].as_str() {
                    place.push(v);
                }
            }
            if h["hook"] != "netfilter"
                && let Some(n) = h["ifname"].as_str()
            {
                place.push(n);
            }
            let node = h["node"]
                .as_str()
                .unwrap_or_else(|| panic!("hop without node: {h}"));
            (node.to_string(), place.join(" "))
        })
        .collect()
}
