//! One story across nodes (issue 14): two nattraces record seed 003's two
//! nodes at once (`--write`), and `nattrace analyze b.rec a.rec` decides
//! each flow from both halves. One lab serves both cases: the broken
//! connection first, then kube-proxy's masqueradeAll rule is added on node-b
//! (what kube-proxy writes with `masqueradeAll: true`) and the next
//! connection must be `ok` with the SNAT shown. Then the same on routed
//! nodes with flannel host-gw. About 20 s. Needs root.
//!
//! `NATTRACE_WRITE_FIXTURE=1` also copies the vxlan run's three recordings to
//! `tracer-userspace/fixtures/merge/` (the merge unit tests' input).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use lab::kube_proxy::svc_chain;
use lab::presets::{self, Seed003, web_svc};
use lab::tracer::{Finished, Nattrace, ip_of, nattrace, tracing_lock};
use lab::{Datapath, Lab, LabSpec, Protocol, build_lab};
use serde_json::Value;

const ATTACH_TIMEOUT: Duration = Duration::from_secs(30);
const CLIENT_TIMEOUT: Duration = Duration::from_secs(1);

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
        // Every packet: the merged `ok` flow below is asserted hop by hop
        // on both nodes, and without -v the kernel keeps only 3 events of
        // a healthy connection per node (docs/DESIGN.md, "Event budget").
        "-v",
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

/// The three recordings of one run: node-b, node-a by the cluster IP,
/// node-a by the backend's address.
struct Recordings {
    b: String,
    a: String,
    a_backend: String,
    /// node-a's name in its recording (its --netns name, the default).
    node_a: String,
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
    let dir = lab::Scratch::new("merge");
    let rec = record_seed003(dir.dir(), presets::seed003(Seed003::default()), true);
    let pcap = dir.path("merged.pcapng").display().to_string();
    let out = analyze(&["--output", "json", "-v", "--pcap", &pcap, &rec.b, &rec.a]);
    let flows = flows_of(&out);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    assert_incident(&flows[0], &rec.node_a);
    // masqueradeAll: ok, with node-b's SNAT shown.
    let f = &flows[1];
    assert_eq!(f["verdict"], "ok", "{f}");
    assert!(f["cause"].is_null(), "{f}");
    assert_eq!(ip_of(&f["snat"]), presets::NODE_B_POD_CIDR.network(), "{f}");
    assert_pcapng(&pcap, &rec.node_a);

    // node-a traced by the backend's address: the same two stories, and
    // node-a's own half of the masqueraded flow.
    let flows = flows_of(&analyze(&[
        "--output",
        "json",
        "-v",
        &rec.b,
        &rec.a_backend,
    ]));
    let verdicts: Vec<(&Value, &Value)> =
        flows.iter().map(|f| (&f["verdict"], &f["cause"])).collect();
    assert_eq!(
        verdicts,
        [
            (
                &Value::from("reply_not_reverse_nated"),
                &Value::from("asymmetric_return_path")
            ),
            (&Value::from("ok"), &Value::Null)
        ]
    );
    assert!(
        node_hops(&flows[1], "SYN").contains(&("node-a".into(), "dev-tx veth0".into())),
        "{}",
        flows[1]
    );

    // Text: the same story in one line per flow.
    let text = analyze(&["--color", "never", &rec.b, &rec.a]);
    let text = String::from_utf8_lossy(&text.stdout).to_string();
    assert!(text.contains("cause: asymmetric_return_path"), "{text}");
    assert!(text.contains("SNAT→ 100.96.55.0:"), "{text}");

    // The same on routed nodes with flannel host-gw (no overlay device):
    // node-b forwards the request by eth0, node-a's reply leaves by eth0.
    let routed_dir = dir.path("routed");
    std::fs::create_dir_all(&routed_dir).expect("temp dir");
    let spec = presets::seed003(Seed003::default()).with_datapath(Datapath::Routed);
    let rec = record_seed003(&routed_dir, spec, false);
    let flows = flows_of(&analyze(&["--output", "json", "-v", &rec.b, &rec.a]));
    let f = &flows[0];
    assert_eq!(f["verdict"], "reply_not_reverse_nated", "{f}");
    assert_eq!(f["cause"], "asymmetric_return_path", "{f}");
    let syn = node_hops(f, "SYN");
    assert!(
        syn.contains(&("node-b".into(), "tc-egress eth0".into())),
        "{syn:?}"
    );
    assert!(
        syn.contains(&(rec.node_a.clone(), "tc-ingress eth0".into())),
        "{syn:?}"
    );
    let reply = node_hops(f, "SYN-ACK");
    assert!(
        !reply.is_empty() && reply.iter().all(|h| h.0 == rec.node_a),
        "the reply never passes node-b: {reply:?}"
    );
    assert_eq!(flows[1]["verdict"], "ok", "{}", flows[1]);
    assert!(flows[1]["snat"].is_string(), "{}", flows[1]);
    eprintln!("merge test took {:?}", started.elapsed());
}

/// Builds the seed 003 lab, records it on both nodes at once while the
/// outside client fails, then succeeds with masqueradeAll; checks that each
/// node alone tells its half.
fn record_seed003(dir: &Path, spec: LabSpec, fixtures: bool) -> Recordings {
    let (b_rec, a_rec) = (dir.join("node-b.rec"), dir.join("node-a.rec"));
    let a_backend_rec = dir.join("node-a-backend.rec");
    let backend_svc = format!("{}:{}", presets::BACKEND_IP, presets::WEB_PORT);
    let lab = build_lab(spec);
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
    // node-b decides the broken request (after its ~3.5 s wait for a
    // neighbour failure) before masqueradeAll changes its rules.
    b.wait_flows(1, lab::wait::FAIL_AFTER)
        .unwrap_or_else(|e| panic!("node-b's first flow: {e:#}"));
    masquerade_all(&lab, presets::NODE_B);
    assert!(outside_curl(&lab), "masqueradeAll fixes seed 003");
    // Its `ok` decided on node-b: the reply has passed both nodes, so
    // every event of it is in their ring buffers, which exit drains.
    b.wait_flows(2, lab::wait::FAIL_AFTER)
        .unwrap_or_else(|e| panic!("node-b's second flow: {e:#}"));
    for t in [&b, &a, &a_backend] {
        t.terminate();
    }
    let mut done: Vec<Finished> = [b, a, a_backend]
        .into_iter()
        .map(|mut t| t.wait(ATTACH_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}")))
        .collect();
    // node-a by the backend's address judges the backend as its Service:
    // alone it says nothing about seed 003.
    done.truncate(2);
    if fixtures && std::env::var_os("NATTRACE_WRITE_FIXTURE").is_some() {
        let fixtures = lab::fixtures_dir().join("merge");
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
    for (d, cause) in done
        .iter()
        .zip(["no_reply_through_node", "reply_bypasses_dnat_node"])
    {
        let flows = d.flows().unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!(
            flows.first().map(|f| &f["cause"]),
            Some(&Value::from(cause)),
            "{}",
            d.describe()
        );
    }
    let node_a = lab.node_netns(presets::NODE_A).expect("node-a").path();
    Recordings {
        b: b_rec.display().to_string(),
        a: a_rec.display().to_string(),
        a_backend: a_backend_rec.display().to_string(),
        node_a: node_a
            .file_name()
            .expect("a name")
            .to_string_lossy()
            .into_owned(),
    }
}

fn describe(out: &std::process::Output) -> String {
    format!(
        "exit {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The flows of `analyze --output json`: one per connection.
fn flows_of(out: &std::process::Output) -> Vec<Value> {
    let flows: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .filter(|v: &Value| v["kind"] == "flow")
        .collect();
    assert_eq!(flows.len(), 2, "one flow per connection: {}", describe(out));
    flows
}

/// Seed 003: one flow, the cause names the asymmetric return path, and the
/// path goes node-b → node-a, the reply node-a → router, never node-b.
fn assert_incident(f: &Value, node_a: &str) {
    assert_eq!(f["verdict"], "reply_not_reverse_nated", "{f}");
    assert_eq!(f["cause"], "asymmetric_return_path", "{f}");
    assert!(
        f["hint"].as_str().unwrap_or("").contains("masqueradeAll"),
        "{f}"
    );
    assert_eq!(ip_of(&f["client"]), presets::OUTSIDE_CLIENT.addr(), "{f}");
    assert_eq!(f["backend"], format!("{}:80", presets::BACKEND_IP), "{f}");
    let syn = node_hops(f, "SYN");
    assert_eq!(syn.first().map(|h| h.0.as_str()), Some("node-b"), "{syn:?}");
    for (node, place) in [
        ("node-b", "tc-ingress eth0"),
        ("node-b", "netfilter PREROUTING after-nat"),
        ("node-b", "netfilter FORWARD"),
        ("node-b", "tc-egress flannel.1"),
        (node_a, "tc-ingress flannel.1"),
        (node_a, "dev-tx veth0"),
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
}

/// Read back by tshark: node-a's SYN-ACK leaves by eth0 with the pod's
/// source (a hop named in the comment of the frame for that address pair,
/// on that node), and the client's SYN crosses node-b's flannel.1.
fn assert_pcapng(pcap: &str, node_a: &str) {
    let bytes = std::fs::read(pcap).expect("the pcapng");
    assert_eq!(bytes[..4], [0x0a, 0x0d, 0x0d, 0x0a], "a pcapng section");
    let out = Command::new("tshark")
        .args(["-r", pcap, "-T", "fields", "-E", "separator=/t"])
        .args(["-e", "ip.src", "-e", "tcp.flags", "-e", "frame.comment"])
        .output()
        .expect("running tshark");
    let frames = String::from_utf8_lossy(&out.stdout).to_string();
    for (hop, src, flags) in [
        (
            format!("{node_a}: tc-egress eth0"),
            presets::BACKEND_IP.to_string(),
            "0x0012",
        ),
        (
            "node-b: tc-egress flannel.1".to_string(),
            presets::OUTSIDE_CLIENT.addr().to_string(),
            "0x0002",
        ),
    ] {
        let found = frames.lines().any(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            f.len() == 3 && f[0] == src && f[1] == flags && f[2].contains(&hop)
        });
        assert!(found, "{hop} ({src} {flags}) not in:\n{frames}");
    }
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
