//! What the benchmark binary (src/bin/nattrace-bench.rs) and the load test
//! (tests/load.rs) share: the lab they build, the short-connection client and
//! the count check. Included by both with `#[path]`, so it stays out of the
//! `lab` library's API.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use lab::tracer::{Finished, Nattrace};
use lab::{Lab, LabSpec, NodeSpec, PodSpec, Protocol, ServiceSpec, cidr};
use serde_json::Value;

pub const NODE: &str = "node-a";
pub const CLIENT: &str = "client";
pub const BACKEND: &str = "backend";
pub const BULK_PORT: u16 = 5201;
pub const CONN_PORT: u16 = 7000;
pub const OTHER_PORT: u16 = 80;

/// Raw tracepoints see every namespace of the machine, and other people's
/// labs (and test runs) use the seeds' addresses: ours come from our pid, so a
/// concurrent lab elsewhere never matches our filter or our count check.
#[derive(Clone, Copy, Debug)]
pub struct Addrs {
    pub pod_net: [u8; 3],
    pub client: Ipv4Addr,
    pub backend: Ipv4Addr,
    /// iperf3 through DNAT.
    pub bulk_svc: Ipv4Addr,
    /// conn-bench through DNAT.
    pub conn_svc: Ipv4Addr,
    /// Same backend, never used: tracing it puts our traffic on the filter's miss path.
    pub other_svc: Ipv4Addr,
}

impl Addrs {
    pub fn for_this_process(salt: u32) -> Addrs {
        let n = std::process::id().wrapping_mul(31).wrapping_add(salt);
        // Pod CIDRs inside kops' cluster CIDR 100.96.0.0/11, Services inside 100.64.0.0/13.
        let pod_net = [100, 100 + (n % 28) as u8, (n / 28 % 256) as u8];
        let svc = |host| Ipv4Addr::new(100, 68 + (n % 4) as u8, (n / 4 % 256) as u8, host);
        Addrs {
            pod_net,
            client: Ipv4Addr::new(pod_net[0], pod_net[1], pod_net[2], 10),
            backend: Ipv4Addr::new(pod_net[0], pod_net[1], pod_net[2], 20),
            bulk_svc: svc(10),
            conn_svc: svc(11),
            other_svc: svc(12),
        }
    }

    /// With `for_many_pods`' /21, idle pods run on past the first /24.
    pub fn extra_pod_ip(&self, i: usize) -> Ipv4Addr {
        let [a, b, c] = self.pod_net;
        Ipv4Addr::from(u32::from(Ipv4Addr::new(a, b, c, 0)) + 30 + i as u32)
    }

    /// As [`Addrs::for_this_process`], its pod network the start of a /21
    /// ([`BIG_POD_PREFIX`]): room for [`MAX_PODS`] idle pods.
    pub fn for_many_pods(salt: u32) -> Addrs {
        let mut a = Addrs::for_this_process(salt);
        a.pod_net[2] &= !7;
        let [p, q, r] = a.pod_net;
        a.client = Ipv4Addr::new(p, q, r, 10);
        a.backend = Ipv4Addr::new(p, q, r, 20);
        a
    }
}

/// The pod network's prefix on a node with more idle pods than one /24
/// holds, and how many it holds (a /21 less the first 30 addresses).
pub const BIG_POD_PREFIX: u8 = 21;
pub const MAX_PODS: usize = 2048 - 30 - 1;

/// One node, a client and a backend pod, three Services to the backend, and
/// `extra_pods` idle pods (each one more veth on cni0).
pub fn spec(addrs: &Addrs, bridge_nf: bool, extra_pods: usize) -> LabSpec {
    let [a, b, c] = addrs.pod_net;
    let prefix = if extra_pods <= 220 {
        24
    } else {
        assert!(
            extra_pods <= MAX_PODS && c % 8 == 0,
            "{extra_pods} idle pods need Addrs::for_many_pods"
        );
        BIG_POD_PREFIX
    };
    let mut node = NodeSpec::new(NODE, cidr(&format!("{a}.{b}.{c}.0/{prefix}")))
        .bridge_nf_call_iptables(bridge_nf)
        .pod(PodSpec::new(CLIENT, addrs.client))
        .pod(PodSpec::new(BACKEND, addrs.backend));
    for i in 0..extra_pods {
        node = node.pod(PodSpec::new(&format!("idle{i}"), addrs.extra_pod_ip(i)));
    }
    let svc = |name: &str, ip, port| {
        ServiceSpec::new("bench", name, "tcp", ip, port, Protocol::Tcp).endpoint(BACKEND, port)
    };
    let mut spec = LabSpec::new(vec![node])
        .service(svc("bulk", addrs.bulk_svc, BULK_PORT))
        .service(svc("conn", addrs.conn_svc, CONN_PORT))
        .service(svc("other", addrs.other_svc, OTHER_PORT));
    spec.kube_proxy.cluster_cidr = Some(cidr("100.96.0.0/11"));
    spec
}

/// Waits until something listens on `port` in `pod` (servers started
/// with `Lab::spawn` print nothing we can read).
pub fn wait_listening(lab: &Lab, pod: &str, port: u16) -> anyhow::Result<()> {
    lab::wait::lab_listening(lab, pod, port)
}

/// Starts the conn-bench server in the backend pod and waits until it listens.
pub fn start_conn_server(lab: &Lab, conn_bench: &Path) -> anyhow::Result<()> {
    let bin = conn_bench.to_string_lossy();
    let port = CONN_PORT.to_string();
    lab.spawn(BACKEND, &[&bin, "server", &port, "--max-secs", "3600"])?;
    wait_listening(lab, BACKEND, CONN_PORT)
}

/// What one conn-bench client run reported.
#[derive(Clone, Copy, Debug, Default)]
pub struct ClientRun {
    pub attempted: u64,
    pub ok: u64,
    pub per_sec: f64,
}

pub struct ClientLoad {
    pub count: u64,
    pub secs: f64,
    pub parallel: u64,
    pub timeout_ms: u64,
}

/// Runs the conn-bench client in the client pod against the conn Service.
pub fn run_client(
    lab: &Lab,
    conn_bench: &Path,
    addrs: &Addrs,
    load: &ClientLoad,
) -> anyhow::Result<ClientRun> {
    let args: Vec<String> = vec![
        conn_bench.to_string_lossy().into_owned(),
        "client".into(),
        addrs.conn_svc.to_string(),
        CONN_PORT.to_string(),
        "--count".into(),
        load.count.to_string(),
        "--secs".into(),
        load.secs.to_string(),
        "--parallel".into(),
        load.parallel.to_string(),
        "--timeout-ms".into(),
        load.timeout_ms.to_string(),
    ];
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let limit = Duration::from_secs_f64(load.secs) + Duration::from_secs(30);
    let out = lab.exec_timeout(CLIENT, &argv, limit)?;
    if !out.status.success() {
        bail!(
            "conn-bench client failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let v: Value = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "conn-bench output: {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })?;
    let num = |k: &str| v[k].as_f64().unwrap_or(0.0);
    Ok(ClientRun {
        attempted: num("attempted") as u64,
        ok: num("ok") as u64,
        per_sec: num("per_sec"),
    })
}

/// `NATTRACE_BENCH_THIS_ARGS`: more arguments for the build under test in
/// the connection runs and their profile (e.g. `--hide-ok`, the
/// DaemonSet's output); the baseline build keeps the defaults, so
/// `--baseline HEAD` times one flag against the same code.
pub fn this_args() -> Vec<String> {
    args_of("NATTRACE_BENCH_THIS_ARGS")
}

/// `NATTRACE_BENCH_BASELINE_ARGS`: the same for the baseline build, so two
/// builds are timed in one mode (e.g. both with `--hide-ok`).
pub fn baseline_args() -> Vec<String> {
    args_of("NATTRACE_BENCH_BASELINE_ARGS")
}

fn args_of(var: &str) -> Vec<String> {
    std::env::var(var)
        .map(|a| a.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default()
}

/// Either build prints no `ok` flow line: runs stop on SIGUSR1 and the
/// count check reads the summary when there are no lines.
fn hides_ok() -> bool {
    this_args()
        .iter()
        .chain(&baseline_args())
        .any(|a| a == "--hide-ok")
}

/// `nattrace --svc .. --netns <node> --output json` plus `extra`, waiting
/// for its first line; returns it with the time that took.
pub fn start_nattrace(
    nattrace: &Path,
    lab: &Lab,
    svcs: &[SocketAddrV4],
    extra: &[impl AsRef<str>],
) -> anyhow::Result<(Nattrace, Duration)> {
    let mut args: Vec<String> = svcs
        .iter()
        .flat_map(|s| ["--svc".to_string(), s.to_string()])
        .collect();
    args.push("--netns".into());
    args.push(lab.node_netns(NODE)?.path().display().to_string());
    args.extend(["--output".into(), "json".into()]);
    args.extend(extra.iter().map(|s| s.as_ref().to_string()));
    // The verifier gives up with EAGAIN when a signal is pending on the
    // loading thread (kernel/bpf/verifier.c do_check: `signal_pending`);
    // libbpf retries such a load, aya 0.14 does not, and this bench's starts
    // met it now and then (tc_ingress, tc_egress): a start so refused is
    // tried again, the rest is an error.
    let mut attempts = 0;
    let (tracer, first, took) = loop {
        attempts += 1;
        let t0 = Instant::now();
        let mut tracer = Nattrace::spawn(nattrace, &args, &[], false)?;
        match tracer.wait_started(Duration::from_secs(60)) {
            Ok(first) => break (tracer, first, t0.elapsed()),
            Err(e) if attempts < 3 && format!("{e:#}").contains("(os error 11)") => {
                lab::tracer::say("nattrace's start: a program load refused with EAGAIN, again");
            }
            Err(e) => return Err(e),
        }
    };
    let v: Value = serde_json::from_str(&first).with_context(|| format!("first line: {first}"))?;
    if v["kind"] != "start" {
        bail!("nattrace's first line is not the start object: {first}");
    }
    Ok((tracer, took))
}

/// Stops nattrace once it decided `flows` connections (a client run's
/// `attempted`): the last replies and the client's reactions are read by
/// then, whatever the machine's load. Fewer are said on stderr; the count
/// check names what is missing.
pub fn stop_nattrace_after(mut tracer: Nattrace, flows: u64) -> anyhow::Result<Finished> {
    if hides_ok() {
        // A build with --hide-ok prints no flow line to wait for: SIGUSR1
        // stops a tracer once every flow it saw has its verdict (README),
        // which the summary then counts. Both builds are stopped alike.
        let done = tracer.finish()?;
        if done.status.code() == Some(2) {
            bail!("nattrace could not trace: {}", done.describe());
        }
        return Ok(done);
    }
    if let Err(e) = tracer.wait_flows(flows as usize, lab::wait::FAIL_AFTER) {
        eprintln!("{e:#}");
    }
    stop_nattrace(tracer)
}

/// Stops nattrace (SIGTERM) and returns what it printed.
pub fn stop_nattrace(mut tracer: Nattrace) -> anyhow::Result<Finished> {
    tracer.terminate();
    let done = tracer.wait(Duration::from_secs(60))?;
    if done.status.code() == Some(2) {
        bail!("nattrace could not trace: {}", done.describe());
    }
    Ok(done)
}

/// The count check: the flows nattrace reported for the conn Service against
/// the connections the client made.
#[derive(Clone, Debug, Default)]
pub struct CountCheck {
    pub flows: u64,
    pub ok: u64,
    pub flagged: u64,
    pub incomplete: u64,
    pub lost_events: u64,
    pub events: u64,
    pub muted: u64,
    /// Empty when the check passed.
    pub problems: Vec<String>,
}

/// With `expect_ok`, every attempted connection must be one `ok` flow; without,
/// every one must be flagged `reply_not_reverse_nated` (bridge-nf-call-iptables=0).
pub fn count_check(done: &Finished, addrs: &Addrs, run: &ClientRun, expect_ok: bool) -> CountCheck {
    let mut c = CountCheck::default();
    let service = SocketAddrV4::new(addrs.conn_svc, CONN_PORT).to_string();
    let (flows, summary) = match (done.flows(), done.summary()) {
        (Ok(f), Ok(s)) => (f, s),
        (Err(e), _) | (_, Err(e)) => {
            c.problems.push(format!("unreadable output: {e:#}"));
            return c;
        }
    };
    for f in flows.iter().filter(|f| f["service"] == service.as_str()) {
        c.flows += 1;
        match f["verdict"].as_str() {
            Some("ok") => c.ok += 1,
            Some("reply_not_reverse_nated") => c.flagged += 1,
            _ => {}
        }
        if f["incomplete"] == true {
            c.incomplete += 1;
        }
    }
    let num = |k: &str| summary[k].as_u64().unwrap_or(0);
    if c.flows == 0 && hides_ok() {
        // No line for an ok flow: the summary counts them (the lab traces
        // this one Service).
        c.flows = num("flows");
        c.ok = summary["by_verdict"]["ok"].as_u64().unwrap_or(0);
    }
    c.lost_events = num("lost_events");
    c.events = num("events");
    c.muted = num("muted_packets");
    let want = run.attempted;
    let good = if expect_ok { c.ok } else { c.flagged };
    if expect_ok && run.ok != run.attempted {
        c.problems.push(format!(
            "{} of {} connections failed",
            run.attempted - run.ok,
            run.attempted
        ));
    }
    if c.flows != want || good != want {
        c.problems.push(format!(
            "{want} connections, {} flows, {good} {}",
            c.flows,
            if expect_ok { "ok" } else { "flagged" }
        ));
    }
    if c.lost_events != 0 || c.incomplete != 0 {
        c.problems.push(format!(
            "{} events lost, {} flows incomplete",
            c.lost_events, c.incomplete
        ));
    }
    c
}
