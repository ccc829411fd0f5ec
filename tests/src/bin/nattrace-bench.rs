//! The lab half of `cargo xtask bench` (issue 7): what nattrace costs a node,
//! side by side with no tracer and with tcpdump, on one lab node built here.
//!
//! ```text
//! nattrace-bench --nattrace PATH [--collector-json PATH] [--out BENCHMARKS.md] [--json PATH]
//!                [--baseline PATH [--baseline-label TEXT]]
//!                [--runs 7] [--secs 3] [--conn-secs 3] [--pods 200] [--only bulk,conn,startup,interfaces,services]
//! ```
//!
//! Conditions alternate run by run, so slow drifts of a shared machine hit
//! all of them alike; results are ratios to the no-tracer median.

#[path = "../bench/callgrind.rs"]
mod callgrind;
#[path = "../bench/passes.rs"]
mod passes;
#[path = "../bench/profile.rs"]
mod profile;
#[path = "../bench/report.rs"]
mod report;
#[path = "../bench/shared.rs"]
mod shared;

use std::net::SocketAddrV4;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use lab::Lab;
use report::{BulkSample, Cond, ConnResults, Results, ServiceScale, StartupResults};
use shared::{Addrs, BULK_PORT, CONN_PORT, ClientLoad, NODE, OTHER_PORT};

pub(crate) struct Opts {
    pub(crate) nattrace: PathBuf,
    /// Another nattrace build, run on the miss path alongside (A/B).
    pub(crate) baseline: Option<(PathBuf, String)>,
    collector_json: Option<PathBuf>,
    out: Option<PathBuf>,
    /// The BPF pass (totals and per program) as JSON.
    json: Option<PathBuf>,
    runs: usize,
    secs: u64,
    conn_secs: f64,
    pods: usize,
    only: Vec<String>,
}

fn parse_opts() -> anyhow::Result<Opts> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let num = |name: &str, default: f64| -> anyhow::Result<f64> {
        get(name).map_or(Ok(default), |v| {
            v.parse().with_context(|| format!("{name} {v}"))
        })
    };
    Ok(Opts {
        nattrace: get("--nattrace")
            .context("--nattrace PATH is required")?
            .into(),
        collector_json: get("--collector-json").map(PathBuf::from),
        baseline: get("--baseline").map(|p| {
            let label = get("--baseline-label").unwrap_or_else(|| p.clone());
            (PathBuf::from(p), label)
        }),
        out: get("--out").map(PathBuf::from),
        json: get("--json").map(PathBuf::from),
        runs: num("--runs", 7.0)?.max(1.0) as usize,
        secs: num("--secs", 3.0)?.max(1.0) as u64,
        conn_secs: num("--conn-secs", 3.0)?.max(0.5),
        pods: (num("--pods", 200.0)? as usize).clamp(2, 222),
        only: get("--only")
            .unwrap_or_else(|| "bulk,conn,startup".into())
            .split(',')
            .map(str::to_string)
            .collect(),
    })
}

fn sibling(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let path = exe.with_file_name(name);
    if !path.is_file() {
        bail!(
            "{} not found: build it with cargo build --release -p nattrace-tests",
            path.display()
        );
    }
    Ok(path)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("nattrace-bench: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    if !lab::is_root() {
        bail!("needs root (network namespaces, eBPF)");
    }
    let opts = parse_opts()?;
    let conn_bench = sibling("conn-bench")?;
    let mut results = Results {
        baseline_label: opts
            .baseline
            .as_ref()
            .map(|b| b.1.clone())
            .unwrap_or_default(),
        machine: report::machine(),
        runs: opts.runs,
        secs: opts.secs,
        conn_secs: opts.conn_secs,
        ..Results::default()
    };
    let addrs = Addrs::for_this_process(0);
    if opts.only.iter().any(|s| s == "bulk" || s == "conn") {
        let lab = Lab::build(shared::spec(&addrs, true, 0))?;
        let ctx = Ctx {
            lab: &lab,
            addrs,
            opts: &opts,
            conn_bench: &conn_bench,
        };
        let (do_bulk, do_conn) = (
            opts.only.iter().any(|s| s == "bulk"),
            opts.only.iter().any(|s| s == "conn"),
        );
        if do_bulk {
            results.bulk = bulk(&ctx, &mut results.load_samples)?;
        }
        if do_conn {
            results.conn = Some(conn(&ctx, &mut results.load_samples)?);
        }
        passes::bpf_pass(&ctx, &mut results, do_bulk, do_conn)?;
        passes::profile_pass(&ctx, &mut results, do_bulk, do_conn)?;
        if do_conn {
            results.counted = callgrind::pass(&ctx)?;
        }
        results.startup_small = startup_runs(&ctx, 3)?.start_ms;
    }
    if opts.only.iter().any(|s| s == "startup") {
        let big_addrs = Addrs::for_this_process(7);
        let lab = build_lab(
            shared::spec(&big_addrs, true, opts.pods - 2),
            &format!("{} pods", opts.pods),
        )?;
        let ctx = Ctx {
            lab: &lab,
            addrs: big_addrs,
            opts: &opts,
            conn_bench: &conn_bench,
        };
        results.startup = Some(StartupResults {
            pods: opts.pods,
            ..startup_runs(&ctx, ctx.opts.runs.max(5))?
        });
    }
    if opts.only.iter().any(|s| s == "interfaces") {
        results.interfaces = interfaces_scale(&opts, &conn_bench)?;
    }
    if opts.only.iter().any(|s| s == "services") {
        results.services = services_scale(&opts, &conn_bench)?;
    }
    if let Some(path) = &opts.collector_json {
        let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
        results.collector = Some(serde_json::from_str(&text)?);
    }
    results.load_after = report::loadavg();
    let md = report::markdown(&results);
    println!("\n{md}");
    if let Some(out) = &opts.out {
        std::fs::write(out, &md).with_context(|| format!("writing {}", out.display()))?;
        say(&format!("wrote {}", out.display()));
    }
    if let Some(path) = &opts.json {
        let v = serde_json::json!({
            "baseline": results.baseline_label,
            "machine": results.machine.iter().cloned().collect::<std::collections::BTreeMap<_, _>>(),
            "load_after": results.load_after,
            "bpf": results.bpf.iter().map(report::BpfSample::json).collect::<Vec<_>>(),
        });
        std::fs::write(path, serde_json::to_string_pretty(&v)?)
            .with_context(|| format!("writing {}", path.display()))?;
        say(&format!("wrote {}", path.display()));
    }
    Ok(())
}

pub(crate) fn say(s: &str) {
    lab::tracer::say(s);
}

pub(crate) struct Ctx<'a> {
    lab: &'a Lab,
    addrs: Addrs,
    opts: &'a Opts,
    conn_bench: &'a Path,
}

impl Ctx<'_> {
    pub(crate) fn binary(&self, cond: Cond) -> &Path {
        match (&self.opts.baseline, cond) {
            (Some((path, _)), Cond::OtherBaseline | Cond::ThisBaseline) => path,
            _ => &self.opts.nattrace,
        }
    }

    pub(crate) fn svc(&self, cond: Cond) -> SocketAddrV4 {
        match cond {
            Cond::Other | Cond::OtherBaseline => {
                SocketAddrV4::new(self.addrs.other_svc, OTHER_PORT)
            }
            _ => SocketAddrV4::new(self.addrs.bulk_svc, BULK_PORT),
        }
    }
}

fn load1() -> f64 {
    report::loadavg()
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

fn bulk(ctx: &Ctx, loads: &mut Vec<f64>) -> anyhow::Result<Vec<(Cond, Vec<BulkSample>)>> {
    let port = BULK_PORT.to_string();
    ctx.lab
        .spawn(shared::BACKEND, &["iperf3", "-s", "-p", &port])?;
    shared::wait_listening(ctx.lab, shared::BACKEND, BULK_PORT)?;
    let mut conds = vec![Cond::None, Cond::Other, Cond::This, Cond::Tcpdump];
    if ctx.opts.baseline.is_some() {
        conds.insert(1, Cond::OtherBaseline);
        conds.insert(4, Cond::ThisBaseline);
    }
    let mut out: Vec<(Cond, Vec<BulkSample>)> = conds.iter().map(|c| (*c, Vec::new())).collect();
    for r in 0..ctx.opts.runs {
        loads.push(load1());
        for (cond, samples) in &mut out {
            let s = bulk_run(ctx, *cond)?;
            say(&format!(
                "bulk run {}/{} {:<28} {:6.2} Gbit/s  events {:>7} muted {:>8}",
                r + 1,
                ctx.opts.runs,
                cond.label(),
                s.gbps,
                s.events,
                s.muted
            ));
            samples.push(s);
        }
    }
    Ok(out)
}

pub(crate) fn iperf(ctx: &Ctx) -> anyhow::Result<f64> {
    let (svc, port, secs) = (
        ctx.addrs.bulk_svc.to_string(),
        BULK_PORT.to_string(),
        ctx.opts.secs.to_string(),
    );
    let out = ctx.lab.exec_timeout(
        shared::CLIENT,
        &[
            "iperf3",
            "-c",
            &svc,
            "-p",
            &port,
            "-t",
            &secs,
            "-J",
            "--connect-timeout",
            "3000",
        ],
        Duration::from_secs(ctx.opts.secs + 30),
    )?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("iperf3: {}", String::from_utf8_lossy(&out.stderr)))?;
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .map(|b| b / 1e9)
        .with_context(|| format!("iperf3 failed: {}", v["error"]))
}

static BULK_RUN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

fn bulk_run(ctx: &Ctx, cond: Cond) -> anyhow::Result<BulkSample> {
    match cond {
        Cond::None => Ok(BulkSample {
            gbps: iperf(ctx)?,
            ..Default::default()
        }),
        Cond::Other | Cond::This | Cond::OtherBaseline | Cond::ThisBaseline => {
            // NATTRACE_BENCH_KEEP=1: this build's runs are recorded, and a
            // run whose connections cost events after their openings keeps
            // its recording, to see which those are.
            let rec = (cond == Cond::This && std::env::var_os("NATTRACE_BENCH_KEEP").is_some())
                .then(|| {
                    std::env::temp_dir().join(format!(
                        "nattrace-bench-{}-bulk-{}.rec",
                        std::process::id(),
                        BULK_RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                    ))
                });
            let rec_s = rec.as_ref().map(|r| r.display().to_string());
            let extra: Vec<&str> = rec_s
                .as_deref()
                .map(|r| vec!["--write", r])
                .unwrap_or_default();
            let (tracer, _) =
                shared::start_nattrace(ctx.binary(cond), ctx.lab, &[ctx.svc(cond)], &extra)?;
            let pid = tracer.pid();
            let gbps = iperf(ctx);
            let hwm = status_kib(pid, "VmHWM:");
            let done = shared::stop_nattrace(tracer)?;
            let summary = done.summary()?;
            let events = summary["events"].as_u64().unwrap_or(0);
            let flows = summary["flows"].as_u64().unwrap_or(0);
            if let Some(rec) = &rec {
                if events > 3 * flows {
                    say(&format!(
                        "bulk run: {events} events for {flows} connections, kept {}",
                        rec.display()
                    ));
                } else {
                    let _ = std::fs::remove_file(rec);
                }
            }
            Ok(BulkSample {
                gbps: gbps?,
                events,
                muted: summary["muted_packets"].as_u64().unwrap_or(0),
                lost: summary["lost_events"].as_u64().unwrap_or(0),
                rss_kib: hwm,
                pcap_bytes: 0,
                flows,
            })
        }
        Cond::Tcpdump => {
            let file =
                std::env::temp_dir().join(format!("nattrace-bench-{}.pcap", std::process::id()));
            let mut dump = start_tcpdump(ctx.lab, &file)?;
            let gbps = iperf(ctx);
            unsafe { libc::kill(dump.id() as i32, libc::SIGTERM) };
            let _ = dump.wait();
            let size = std::fs::metadata(&file).map_or(0, |m| m.len());
            let _ = std::fs::remove_file(&file);
            Ok(BulkSample {
                gbps: gbps?,
                pcap_bytes: size,
                ..Default::default()
            })
        }
    }
}

/// `tcpdump -i cni0 -w FILE` in the node namespace, once it says it listens.
pub(crate) fn start_tcpdump(lab: &Lab, file: &Path) -> anyhow::Result<Child> {
    use std::io::{BufRead, BufReader};
    let mut cmd = lab.netns(NODE)?.command("tcpdump")?;
    cmd.args(["-i", "cni0", "-n", "-w"]).arg(file);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().context("starting tcpdump")?;
    let stderr = child.stderr.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("listening on") {
                let _ = tx.send(());
            }
        }
    });
    if rx.recv_timeout(Duration::from_secs(10)).is_err() {
        let _ = child.kill();
        let _ = child.wait();
        bail!("tcpdump did not start listening on cni0");
    }
    Ok(child)
}

fn conn(ctx: &Ctx, loads: &mut Vec<f64>) -> anyhow::Result<ConnResults> {
    shared::start_conn_server(ctx.lab, ctx.conn_bench)?;
    let load = ClientLoad {
        count: 1_000_000,
        secs: ctx.opts.conn_secs,
        parallel: 2,
        timeout_ms: 2000,
    };
    let svc = SocketAddrV4::new(ctx.addrs.conn_svc, CONN_PORT);
    let mut res = ConnResults::default();
    let file =
        std::env::temp_dir().join(format!("nattrace-bench-{}-conn.pcap", std::process::id()));
    for r in 0..ctx.opts.runs {
        loads.push(load1());
        let plain = shared::run_client(ctx.lab, ctx.conn_bench, &ctx.addrs, &load)?;
        let (tracer, _) =
            shared::start_nattrace(&ctx.opts.nattrace, ctx.lab, &[svc], &shared::this_args())?;
        let traced = shared::run_client(ctx.lab, ctx.conn_bench, &ctx.addrs, &load)?;
        let done = shared::stop_nattrace_after(tracer, traced.attempted)?;
        let check = shared::count_check(&done, &ctx.addrs, &traced, true);
        if let Some((bin, _)) = &ctx.opts.baseline {
            let (tracer, _) =
                shared::start_nattrace(bin, ctx.lab, &[svc], &shared::baseline_args())?;
            let run = shared::run_client(ctx.lab, ctx.conn_bench, &ctx.addrs, &load)?;
            let done = shared::stop_nattrace_after(tracer, run.attempted)?;
            let check = shared::count_check(&done, &ctx.addrs, &run, true);
            say(&format!(
                "conn run {}/{}: {:7.0} conns/s baseline build traced; {:.2} events/conn; count check: {} conns, {} flows{}",
                r + 1,
                ctx.opts.runs,
                run.per_sec,
                check.events as f64 / run.attempted.max(1) as f64,
                run.attempted,
                check.flows,
                if check.problems.is_empty() {
                    String::new()
                } else {
                    format!(" FAILED: {:?}", check.problems)
                }
            ));
            res.baseline.push((run, check));
        }
        let mut dump = start_tcpdump(ctx.lab, &file)?;
        let dumped = shared::run_client(ctx.lab, ctx.conn_bench, &ctx.addrs, &load);
        unsafe { libc::kill(dump.id() as i32, libc::SIGTERM) };
        let _ = dump.wait();
        let _ = std::fs::remove_file(&file);
        let dumped = dumped?;
        say(&format!(
            "conn run {}/{}: {:7.0} conns/s untraced, {:7.0} traced, {:7.0} tcpdump; {:.2} events/conn; count check: {} conns, {} flows, {} ok, {} lost{}",
            r + 1,
            ctx.opts.runs,
            plain.per_sec,
            traced.per_sec,
            dumped.per_sec,
            check.events as f64 / traced.attempted.max(1) as f64,
            traced.attempted,
            check.flows,
            check.ok,
            check.lost_events,
            if check.problems.is_empty() {
                String::new()
            } else {
                format!(" FAILED: {:?}", check.problems)
            }
        ));
        res.plain.push(plain);
        res.traced.push((traced, check));
        res.dump.push(dumped);
    }
    ctx.lab.run(
        NODE,
        &["sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0"],
    )?;
    let small = ClientLoad {
        count: 20,
        secs: 30.0,
        parallel: 4,
        timeout_ms: 300,
    };
    let (tracer, _) = shared::start_nattrace(
        &ctx.opts.nattrace,
        ctx.lab,
        &[svc],
        &["--reply-timeout", "1000"],
    )?;
    let run = shared::run_client(ctx.lab, ctx.conn_bench, &ctx.addrs, &small);
    let done = match &run {
        Ok(r) => shared::stop_nattrace_after(tracer, r.attempted),
        Err(_) => shared::stop_nattrace(tracer),
    }?;
    ctx.lab.run(
        NODE,
        &["sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1"],
    )?;
    let run = run?;
    let check = shared::count_check(&done, &ctx.addrs, &run, false);
    say(&format!(
        "bridge-nf-call-iptables=0: {} conns ({} completed), {} flows, {} flagged{}",
        run.attempted,
        run.ok,
        check.flows,
        check.flagged,
        if check.problems.is_empty() {
            String::new()
        } else {
            format!(" FAILED: {:?}", check.problems)
        }
    ));
    res.broken = Some((run, check));
    Ok(res)
}

/// Start (spawn → first line), full tc coverage (spawn → its last tc link:
/// past 64 interfaces only the node's own interfaces get tc, the pods'
/// veths are left to the device tracepoints) and detach (SIGTERM → exit,
/// everything attached) times in ms, and how many interfaces there are.
/// With `--baseline`, that build starts too, alternating run by run.
fn startup_runs(ctx: &Ctx, n: usize) -> anyhow::Result<StartupResults> {
    let (mut start, mut full, mut detach, mut hwm) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut baseline_start = Vec::new();
    let links = ctx
        .lab
        .run(NODE, &["ip", "-o", "link", "show"])?
        .lines()
        .count();
    for _ in 0..n {
        if let Some((bin, _)) = &ctx.opts.baseline {
            baseline_start.push(startup_once(ctx, bin)?.start_ms);
        }
        let once = startup_once(ctx, &ctx.opts.nattrace)?;
        start.push(once.start_ms);
        full.push(once.full_ms);
        detach.push(once.detach_ms);
        hwm.push(once.hwm_mib);
    }
    let ms = |v: &[f64]| v.iter().map(|v| v.round()).collect::<Vec<_>>();
    say(&format!(
        "startup on {links} interfaces: start {:?} ms, all tc links {:?} ms, detach {:?} ms{}",
        ms(&start),
        ms(&full),
        ms(&detach),
        if baseline_start.is_empty() {
            String::new()
        } else {
            format!("; baseline start {:?} ms", ms(&baseline_start))
        }
    ));
    Ok(StartupResults {
        pods: 0,
        interfaces: links,
        start_ms: start,
        full_ms: full,
        detach_ms: detach,
        hwm_mib: hwm,
        baseline_start_ms: baseline_start,
        bpf: None,
    })
}

/// One start of a nattrace build.
struct Start {
    /// Spawn → first line.
    start_ms: f64,
    /// Spawn → its last tc link.
    full_ms: f64,
    /// SIGTERM → exit.
    detach_ms: f64,
    /// Its peak RSS (VmHWM) at full coverage, before the stop.
    hwm_mib: f64,
}

fn startup_once(ctx: &Ctx, bin: &Path) -> anyhow::Result<Start> {
    let t_spawn = Instant::now();
    let (tracer, took) =
        shared::start_nattrace(bin, ctx.lab, &[ctx.svc(Cond::Other)], &[] as &[&str])?;
    let pid = tracer.pid();
    // Done when no link was added for 300 ms (a tcx link takes ~15 ms):
    // the netfilter backend's 9 netfilter and 3 raw tracepoint links
    // plus ingress + egress per interface with tc.
    let mut last = (0, t_spawn);
    while t_spawn.elapsed() < Duration::from_secs(60) {
        let now = bpf_links(pid);
        if now != last.0 {
            last = (now, Instant::now());
        } else if now >= 12 && last.1.elapsed() >= Duration::from_millis(300) {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let full = last.1.duration_since(t_spawn).as_secs_f64() * 1e3;
    std::thread::sleep(Duration::from_millis(200));
    let hwm_mib = status_kib(pid, "VmHWM:") as f64 / 1024.0;
    tracer.terminate();
    let t0 = Instant::now();
    // Exited = a zombie (or reaped); polled finely, Nattrace::wait polls at 20 ms.
    while t0.elapsed() < Duration::from_secs(30) {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if stat.is_empty() || stat.rsplit(") ").next().is_some_and(|s| s.starts_with('Z')) {
            break;
        }
        std::thread::sleep(Duration::from_micros(500));
    }
    let detach = t0.elapsed().as_secs_f64() * 1e3;
    shared::stop_nattrace(tracer)?;
    Ok(Start {
        start_ms: took.as_secs_f64() * 1e3,
        full_ms: full,
        detach_ms: detach,
        hwm_mib,
    })
}

/// BPF link fds a process holds (tcx, netfilter, raw tracepoint links).
fn bpf_links(pid: u32) -> usize {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return 0;
    };
    fds.flatten()
        .filter(|fd| {
            std::fs::read_link(fd.path())
                .is_ok_and(|t| t.to_string_lossy().starts_with("anon_inode:bpf_link"))
        })
        .count()
}

fn status_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(key))
                .map(str::to_string)
        })
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Services of the scale figure (issue 25): a node whose kube-proxy has
/// this many Service ports, traced with `--all-services`.
const SERVICE_SCALE: [usize; 3] = [3, 100, 10_000];

/// Pods of the scale figure (issue 25): each one more veth on the node.
const POD_SCALE: [usize; 3] = [10, 200, 1000];

/// The sizes a scale section measures: a `--quick` run (one run) leaves
/// out the largest.
fn scale_sizes<'a>(all: &'a [usize], opts: &Opts) -> &'a [usize] {
    if opts.runs <= 1 {
        &all[..all.len() - 1]
    } else {
        all
    }
}

/// Builds a lab node, saying what and how long it took.
fn build_lab(spec: lab::LabSpec, what: &str) -> anyhow::Result<Lab> {
    let t0 = Instant::now();
    let lab = Lab::build(spec)?;
    say(&format!(
        "lab node with {what} built in {:.1} s",
        t0.elapsed().as_secs_f64()
    ));
    Ok(lab)
}

/// Start-up and memory by the number of Services kube-proxy has on the
/// node, traced with `--all-services` (the DaemonSet's mode): nattrace
/// reads every rule at start and keeps a kernel map entry per Service port.
/// Each size is a lab node of its own with the bench's pods and that many
/// Services to the backend (the bench's three included).
fn services_scale(opts: &Opts, conn_bench: &Path) -> anyhow::Result<Vec<ServiceScale>> {
    let mut out = Vec::new();
    for &n in scale_sizes(&SERVICE_SCALE, opts) {
        let addrs = Addrs::for_this_process(11);
        let mut spec = shared::spec(&addrs, true, 0);
        // 100.64.0.0/14: apart from the bench's own Services (100.68-71).
        for i in 0..n - 3 {
            let ip = std::net::Ipv4Addr::new(
                100,
                64 + (i / 62_500) as u8,
                (i / 250 % 250) as u8,
                (i % 250 + 1) as u8,
            );
            spec = spec.service(
                lab::ServiceSpec::new("scale", &format!("s{i}"), "tcp", ip, 80, lab::Protocol::Tcp)
                    .endpoint(shared::BACKEND, 80),
            );
        }
        let lab = build_lab(spec, &format!("{n} Services"))?;
        let (mut start, mut hwm) = (Vec::new(), Vec::new());
        for _ in 0..opts.runs.clamp(1, 3) {
            let (tracer, took) =
                shared::start_nattrace(&opts.nattrace, &lab, &[], &["--all-services"])?;
            // The filter is filled before the first line; the rules read
            // for it is what the process holds, and it holds it a while.
            std::thread::sleep(Duration::from_millis(500));
            hwm.push(status_kib(tracer.pid(), "VmHWM:") as f64 / 1024.0);
            start.push(took.as_secs_f64() * 1e3);
            shared::stop_nattrace(tracer)?;
        }
        say(&format!(
            "services scale: {n} Services: start {:?} ms, peak RSS {:?} MiB",
            start.iter().map(|v| v.round()).collect::<Vec<_>>(),
            hwm.iter()
                .map(|v| (v * 10.0).round() / 10.0)
                .collect::<Vec<_>>()
        ));
        let ctx = Ctx {
            lab: &lab,
            addrs,
            opts,
            conn_bench,
        };
        out.push(ServiceScale {
            services: n,
            start_ms: start,
            hwm_mib: hwm,
            bpf: passes::bpf_per_conn(&ctx, &["--all-services"])?,
        });
    }
    Ok(out)
}

/// Start-up, full coverage and memory by the number of pods on the node
/// (`--svc` of one Service): what a bigger node pays to start.
fn interfaces_scale(opts: &Opts, conn_bench: &Path) -> anyhow::Result<Vec<StartupResults>> {
    let mut out = Vec::new();
    for &pods in scale_sizes(&POD_SCALE, opts) {
        let addrs = shared::Addrs::for_many_pods(13);
        let lab = build_lab(
            shared::spec(&addrs, true, pods - 2),
            &format!("{pods} pods"),
        )?;
        let ctx = Ctx {
            lab: &lab,
            addrs,
            opts,
            conn_bench,
        };
        out.push(StartupResults {
            pods,
            bpf: passes::bpf_per_conn(&ctx, &[])?,
            ..startup_runs(&ctx, opts.runs.clamp(1, 3))?
        });
    }
    Ok(out)
}
