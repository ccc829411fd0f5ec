//! The kind workflow's checks, run here (issue 14 item 2): the same
//! `ci/kind/check-seed000.sh` that `.github/workflows/kind.yml` runs against
//! a kind node through `docker exec`, run against the seed 000 lab node
//! through `ip netns exec`; and the offline validation of the workflow and
//! its kind configs and manifests (`kind_check/configs.rs`).
//!
//! Root tests (`root_`) need network namespaces and eBPF; without root they
//! print why they are skipped and pass.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use lab::presets::{self, BACKEND_IP, CLIENT_IP, CLIENT_POD, NODE_A, web_svc};
use lab::tracer::{nattrace, tracing_lock};
use lab::{Datapath, Lab, LabSpec, OutsideSpec, ProxyMode, build_lab, node_underlay_ip};

#[path = "kind_check/configs.rs"]
mod configs;

macro_rules! require_root {
    () => {
        if lab::skip_without_root(
            "the kind check script traces a lab node and needs root; \
             run `sudo cargo test -p nattrace-tests --test kind_check` or in CI",
        ) {
            return;
        }
    };
}

const SYSCTL: &str = "/proc/sys/net/bridge/bridge-nf-call-iptables";

/// The repository root (tests/ is one level below it).
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives in the workspace")
        .to_path_buf()
}

fn script() -> PathBuf {
    repo().join("ci/kind/check-seed000.sh")
}

/// The kind workload's NodePort (ci/kind/workload.yaml).
const NODE_PORT: u16 = 30090;

/// Seed 000's lab, whose `web` Service is also a NodePort (Cluster policy)
/// reached by the outside client behind the router, as the kind runner
/// reaches its node container.
fn seed000_lab(mode: ProxyMode, datapath: Datapath) -> Lab {
    let mut spec: LabSpec = presets::seed000(presets::Seed000::default()).with_datapath(datapath);
    spec.kube_proxy.mode = mode;
    spec.services[0].node_port = Some(NODE_PORT);
    spec.outside = Some(OutsideSpec {
        client: presets::OUTSIDE_CLIENT,
        service_cidr: presets::SERVICE_CIDR,
        service_route_via: NODE_A.to_string(),
    });
    build_lab(spec)
}

/// Runs the script against `lab`'s node-a, expecting the data path
/// `datapath` ("bridge" or "routed"); bounded by coreutils `timeout`, since
/// a hung script must fail the test, not hang the suite.
/// `outside_ip`: the outside client's address the NodePort step expects
/// (None: the lab's real one).
fn run_script(lab: &Lab, datapath: &str, outside_ip: Option<&str>) -> Output {
    let node = lab.node_netns(NODE_A).expect("node-a").name().to_string();
    let client = lab
        .netns(CLIENT_POD)
        .expect("client pod")
        .name()
        .to_string();
    let outside = lab
        .netns(lab::OUTSIDE)
        .expect("outside client")
        .name()
        .to_string();
    let workdir = std::env::temp_dir().join(format!("nattrace-kind-check-{}-{datapath}", lab.id()));
    let out = Command::new("timeout")
        .args(["--kill-after=10", "240", "bash"])
        .arg(script())
        .env("NODE_EXEC", format!("ip netns exec {node}"))
        .env("CLIENT_EXEC", format!("ip netns exec {client}"))
        .env("SVC", web_svc())
        .env("CLIENT_IP", CLIENT_IP.to_string())
        .env("BACKEND_IP", BACKEND_IP.to_string())
        .env("NATTRACE", nattrace())
        .env("DATAPATH", datapath)
        // Short steps: the lab answers in microseconds, and seed 000's
        // curls each cost CURL_MAX_TIME.
        .env("TRACE_SECS", "4")
        .env("CURL_MAX_TIME", "2")
        .env("WORKDIR", &workdir)
        // Step 3: node-a's NodePort from the outside client.
        .env("NODEPORT", format!("{}:{NODE_PORT}", node_underlay_ip(0)))
        .env("OUTSIDE_EXEC", format!("ip netns exec {outside}"))
        .env(
            "OUTSIDE_IP",
            outside_ip.map_or_else(|| presets::OUTSIDE_CLIENT.addr().to_string(), String::from),
        )
        .output()
        .expect("running ci/kind/check-seed000.sh");
    let _ = std::fs::remove_dir_all(&workdir);
    eprintln!(
        "--- check-seed000.sh DATAPATH={datapath}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The script restores the sysctl whether its assertions held or not.
fn assert_sysctl_restored(lab: &Lab) {
    let value = lab
        .run(NODE_A, &["cat", SYSCTL])
        .expect("reading the sysctl");
    assert_eq!(value.trim(), "1", "{SYSCTL} was not restored on node-a");
}

/// Bridged node (cni0), kube-proxy in `mode`: the script passes. With
/// `negative`, told the node is routed it must fail, because the broken step
/// then sees seed 000 where it expects `ok`: the proof that its assertions
/// can fail (once is enough; the proxy mode does not change that logic).
fn bridge_case(mode: ProxyMode, negative: bool) {
    let _serial = tracing_lock();
    let lab = seed000_lab(mode, Datapath::Bridge);

    let out = run_script(&lab, "bridge", None);
    assert!(
        out.status.success(),
        "the check failed on a seed 000 lab node"
    );
    assert!(stderr(&out).contains("all assertions held"));
    assert_sysctl_restored(&lab);
    if !negative {
        return;
    }

    // And a NodePort client the flows do not show must fail step 3 too.
    let out = run_script(&lab, "routed", Some("192.0.2.1"));
    assert_eq!(
        out.status.code(),
        Some(1),
        "expecting `ok` with bridge-nf-call-iptables=0 on a bridged node must fail"
    );
    let err = stderr(&out);
    assert!(
        err.contains("FAIL: nattrace exited 1, wanted 0"),
        "the failure must be the broken step's: {err}"
    );
    assert!(err.contains("FAIL: flows that are not ok"), "{err}");
    assert!(
        err.contains("FAIL: flows that are not ok (cause -) from 192.0.2.1"),
        "the NodePort step checks the client's address: {err}"
    );
    assert_sysctl_restored(&lab);
}

#[test]
fn root_kind_check_script_bridge_iptables() {
    require_root!();
    bridge_case(ProxyMode::Iptables, true);
}

#[test]
fn root_kind_check_script_bridge_nftables() {
    require_root!();
    bridge_case(ProxyMode::Nftables, false);
}

/// Routed node (kindnet-like /32 veths): the script's routed expectations
/// pass, and its bridge expectations must fail (no seed 000 without a bridge).
#[test]
fn root_kind_check_script_routed() {
    require_root!();
    let _serial = tracing_lock();
    let lab = seed000_lab(ProxyMode::Iptables, Datapath::Routed);

    let out = run_script(&lab, "routed", None);
    assert!(
        out.status.success(),
        "the check failed on a routed lab node"
    );
    assert_sysctl_restored(&lab);

    let out = run_script(&lab, "bridge", None);
    assert_eq!(
        out.status.code(),
        Some(1),
        "seed 000 cannot happen without a bridge"
    );
    let err = stderr(&out);
    assert!(
        err.contains("FAIL: nattrace exited 0, wanted 1"),
        "the failure must be the broken step's: {err}"
    );
    assert_sysctl_restored(&lab);
}

/// Without a node to run on, the script must refuse (exit 2) before doing
/// anything: an empty NODE_EXEC would write the sysctl on this machine.
#[test]
fn check_script_refuses_an_empty_node_exec() {
    let out = Command::new("bash")
        .arg(script())
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("NODE_EXEC", "")
        .env("CLIENT_EXEC", "true")
        .env("SVC", "100.67.30.133:80")
        .env("CLIENT_IP", "100.96.54.240")
        .env("BACKEND_IP", "100.96.54.247")
        .env("NATTRACE", "/nonexistent")
        .output()
        .expect("running the script");
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("NODE_EXEC is not set"),
        "{}",
        stderr(&out)
    );
}

/// ci/kind/run.sh refuses a matrix entry it has no cluster config for, and a
/// missing binary, before it touches docker or kind (exit 2, one line).
#[test]
fn kind_runner_refuses_bad_arguments() {
    let runner = repo().join("ci/kind/run.sh");
    for (cni, proxy, bin, says) in [
        (
            "flannel",
            "iptables",
            "/bin/sh",
            "CNI must be bridge or kindnet",
        ),
        (
            "bridge",
            "ipvs",
            "/bin/sh",
            "PROXY_MODE must be iptables or nftables",
        ),
        (
            "kindnet",
            "nftables",
            "/nonexistent",
            "NATTRACE_BIN must name",
        ),
    ] {
        let out = Command::new("bash")
            .arg(&runner)
            .env("CNI", cni)
            .env("PROXY_MODE", proxy)
            .env("NATTRACE_BIN", bin)
            .output()
            .expect("running ci/kind/run.sh");
        assert_eq!(
            out.status.code(),
            Some(2),
            "{cni}/{proxy}: {}",
            stderr(&out)
        );
        assert!(
            stderr(&out).contains(says),
            "{cni}/{proxy}: {}",
            stderr(&out)
        );
    }
}
