//! Issue 22: a real SNAT source-port collision. The node masquerades pod
//! traffic to the web backend onto one address:port (a port range of one,
//! the extreme of a small or exhausted range); a first connection holds
//! it, and a second client's SYN gets the same SNAT tuple, so conntrack's
//! confirmation finds the reply tuple taken, counts `insert_failed` and
//! drops the SYN after every rule (nf_conntrack_core.c
//! `__nf_conntrack_confirm`; TCP clashes are never resolved). nattrace names
//! it `conntrack_insert_failed`, its summary shows insert_failed's rise,
//! and with a wide, fully random range (the fix) the same client is `ok`.
use std::path::Path;
use std::time::Duration;

use lab::presets::{self, web_svc};
use lab::tracer::{Finished, Nattrace, nattrace, tracing_lock};
use lab::{KubeProxyConfig, Lab, LabSpec, NodeSpec, PodSpec, Protocol, ServiceSpec, build_lab};
use serde_json::Value;

macro_rules! require_root {
    () => {
        if lab::skip_without_root(
            "conntrack tests need root (network namespaces, eBPF); \
             run `sudo cargo test -p nattrace-tests --test conntrack_snat` or in CI",
        ) {
            return;
        }
    };
}

const CLIENT_2_POD: &str = "client-2";
const CLIENT_2_IP: std::net::Ipv4Addr = std::net::Ipv4Addr::new(100, 96, 54, 241);
const SNAT_PORT: u16 = 40000;

fn spec() -> LabSpec {
    let node = NodeSpec::new(presets::NODE_A, presets::NODE_A_POD_CIDR)
        .pod(PodSpec::new(presets::CLIENT_POD, presets::CLIENT_IP))
        .pod(PodSpec::new(CLIENT_2_POD, CLIENT_2_IP))
        .pod(PodSpec::new(presets::BACKEND_POD, presets::BACKEND_IP).http(presets::WEB_PORT));
    let web = ServiceSpec::new(
        "default",
        "web",
        "http",
        presets::WEB_SERVICE_IP,
        presets::WEB_PORT,
        Protocol::Tcp,
    )
    .endpoint(presets::BACKEND_POD, presets::WEB_PORT);
    let mut spec = LabSpec::new(vec![node]).service(web);
    spec.kube_proxy = KubeProxyConfig {
        cluster_cidr: Some(presets::CLUSTER_CIDR),
        ..KubeProxyConfig::default()
    };
    spec
}

/// The node's SNAT of traffic to the backend: `to` as `--to-source`.
fn snat(lab: &Lab, op: &str, to: &str, extra: &[&str]) {
    let backend = presets::BACKEND_IP.to_string();
    let mut args = vec!["iptables-nft", "-w", "5", "-t", "nat", op, "POSTROUTING"];
    if op == "-I" {
        args.push("1");
    }
    args.extend([
        "-p",
        "tcp",
        "-d",
        &backend,
        "--dport",
        "80",
        "-j",
        "SNAT",
        "--to-source",
        to,
    ]);
    args.extend(extra);
    lab.run(presets::NODE_A, &args).expect("the SNAT rule");
}

fn curl(lab: &Lab, from: &str) -> bool {
    lab.http_get(
        from,
        presets::WEB_SERVICE_IP,
        presets::WEB_PORT,
        Duration::from_secs(2),
    )
    .expect("running curl")
    .status
    .success()
}

fn trace(lab: &Lab, rec: &Path, traffic: impl FnOnce()) -> Finished {
    let ns = lab.node_netns(presets::NODE_A).expect("node").path();
    let args: Vec<String> = [
        "--svc",
        &web_svc(),
        "--netns",
        &ns.display().to_string(),
        "--reply-timeout",
        "1000",
        "--output",
        "json",
        "--write",
        rec.to_str().expect("utf-8 path"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut tracer = Nattrace::spawn(&nattrace(), &args, &[], false).expect("starting nattrace");
    tracer
        .wait_started(Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{e:#}"));
    traffic();
    tracer.finish().unwrap_or_else(|e| panic!("{e:#}"))
}

fn from_client(flows: &[Value], ip: std::net::Ipv4Addr) -> Vec<Value> {
    flows
        .iter()
        .filter(|f| {
            f["client"]
                .as_str()
                .is_some_and(|c| c.starts_with(&format!("{ip}:")))
        })
        .cloned()
        .collect()
}

#[test]
fn root_snat_port_collision_is_an_insert_failure() {
    require_root!();
    let _lock = tracing_lock();
    let lab = build_lab(spec());
    let dir = std::env::temp_dir().join(format!("nattrace-snat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let gw = lab.spec().nodes[0].gateway();
    let one_port = format!("{gw}:{SNAT_PORT}");
    snat(&lab, "-I", &one_port, &[]);
    // The first connection takes the only SNAT port and holds it.
    let hold = format!(
        "import socket,time; s=socket.create_connection(('{}',{})); time.sleep(120)",
        presets::WEB_SERVICE_IP,
        presets::WEB_PORT
    );
    lab.spawn(presets::CLIENT_POD, &["python3", "-c", &hold])
        .expect("holding a connection");
    lab::wait::until(
        "the first connection established through the SNAT port",
        Duration::from_secs(10),
        || {
            let ct = lab.conntrack(presets::NODE_A).ok()?;
            ct.lines()
                .any(|l| l.contains("ESTABLISHED") && l.contains(&format!("dport={SNAT_PORT}")))
                .then_some(())
        },
    )
    .expect("the first connection");
    let rec = dir.join("collision.rec");
    let mut worked = true;
    let done = trace(&lab, &rec, || worked = curl(&lab, CLIENT_2_POD));
    assert!(!worked, "the second client's connection must fail");
    let describe = done.describe();
    let flows = done.flows().unwrap_or_else(|e| panic!("{e:#}\n{describe}"));
    let mine = from_client(&flows, CLIENT_2_IP);
    assert!(!mine.is_empty(), "{describe}");
    for f in &mine {
        assert_eq!(f["verdict"], "dropped", "{describe}");
        assert_eq!(f["cause"], "conntrack_insert_failed", "{describe}");
        assert!(
            f["cause_text"]
                .as_str()
                .is_some_and(|t| t.contains(&format!("SNATed to {one_port}"))),
            "{describe}"
        );
        assert!(
            f["hint"]
                .as_str()
                .is_some_and(|h| h.contains("--random-fully")),
            "{describe}"
        );
    }
    let summary = done.summary().expect("summary");
    assert!(
        summary["conntrack"]["insert_failed"].as_u64() >= Some(1),
        "insert_failed rose over the run: {describe}"
    );

    // `NATTRACE_RECORD_DIR=dir` keeps the recording: run alone, it is
    // tracer-userspace/fixtures/conntrack/ (18 KB, `cargo xtask fixtures`; beside
    // the other labs' traffic on this kernel it grows to megabytes).
    if let Ok(keep) = std::env::var(lab::tracer::RECORD_DIR_ENV) {
        let name = "root_snat_port_collision_is_an_insert_failure.rec";
        std::fs::copy(&rec, Path::new(&keep).join(name)).expect("keeping the recording");
    }

    // The fix: a wide, fully random SNAT range; the same client is ok.
    snat(&lab, "-D", &one_port, &[]);
    let range = format!("{gw}:{SNAT_PORT}-{}", SNAT_PORT + 1000);
    snat(&lab, "-I", &range, &["--random-fully"]);
    let rec2 = dir.join("fixed.rec");
    let mut worked = false;
    let fixed = trace(&lab, &rec2, || worked = curl(&lab, CLIENT_2_POD));
    assert!(worked, "with a wide random range the connection works");
    let describe = fixed.describe();
    let flows = fixed
        .flows()
        .unwrap_or_else(|e| panic!("{e:#}\n{describe}"));
    let mine = from_client(&flows, CLIENT_2_IP);
    assert_eq!(mine.len(), 1, "{describe}");
    assert_eq!(mine[0]["verdict"], "ok", "{describe}");
    let _ = std::fs::remove_dir_all(&dir);
}
