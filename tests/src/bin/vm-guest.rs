//! `vm-guest`: the scenario runner of `cargo xtask vm-test`, run as root inside
//! a guest kernel (xtask/src/vm.rs puts it in the initramfs next to nattrace
//! and lab-server).
//!
//! ```text
//! vm-guest [--backends kprobe,netfilter] [--nattrace PATH] [--record-fixtures]
//! ```
//!
//! For each probe backend the running kernel supports it traces seed 000
//! broken (bridge-nf-call-iptables=0) and healthy with the real nattrace, and
//! checks: the exit status, every flow's verdict and cause; that the fields the
//! probes read from kernel structs (ifindex, netns inode, addresses, conntrack
//! tuples) are what the lab configured — a wrong BTF offset must fail here, not
//! silently produce no events; and that all backends agree flow for flow.
//! Each seed 000 case runs again without `-v`, with the kernel's per-flow
//! buffer on (`vm-guest/held.rs`). Then seed 000 over IPv6 on a
//! dual-stack node (`vm-guest/ipv6.rs`), and long-lived connections broken
//! after an `ok` opening, each beside a healthy twin
//! (`vm-guest/established.rs`); a path-MTU black hole across the NAT and
//! its healthy twin (`vm-guest/icmp.rs`); and a full conntrack table, the guest's
//! `nf_conntrack_max` lowered and put back (`vm-guest/table_full.rs`).
//! One `vm-guest: PASS|FAIL` line per check; exit 0 only if all pass.
//!
//! `--record-fixtures` also has each seed 000 run `--write` its recording and
//! prints it on the console (`vm-guest/record.rs`) for
//! `cargo xtask vm-test --record-fixtures DIR`; it skips the checks that
//! record nothing (auto fallback, IPv6) to spare the emulated guest.

// Not tests/src/bin/facts.rs: cargo would take that for a binary of its own.
#[path = "vm-guest/established.rs"]
mod established;
#[path = "vm-guest/facts.rs"]
mod facts;
#[path = "vm-guest/held.rs"]
mod held;
#[path = "vm-guest/icmp.rs"]
mod icmp;
#[path = "vm-guest/ipv6.rs"]
mod ipv6;
#[path = "vm-guest/record.rs"]
mod record;
#[path = "vm-guest/table_full.rs"]
mod table_full;

use std::fs::File;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, SocketAddrV4, TcpStream};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use facts::{LabFacts, check_fields, compare, lab_facts};
use lab::Lab;
use lab::presets::{self, BACKEND_IP, Seed000, WEB_PORT, WEB_SERVICE_IP};
use lab::tracer::{Echo, Finished, Nattrace, nattrace_path, say};
use serde_json::Value;

/// Connections per run; all are made at once, so a broken run costs one timeout.
const CONNECTIONS: usize = 3;
/// Seed 000's connections never complete; this bounds what each one costs.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(1500);
/// Loading (BTF parsing, verifier) under TCG emulation is far slower than on
/// hardware: 6.1 verifies the kprobe backend's programs in 26-71 s each (in
/// parallel; 76 s to the start line on a quiet host, twice that beside
/// `stress-ng --cpu 2`). Only a failure bound: the wait ends on nattrace's
/// start line, and [`TRACER_ENV`]'s progress lines keep the console from
/// looking hung to vm-test meanwhile.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(400);
/// The guests' nattrace prints each program's load (with its verifier
/// count) on stderr, which vm-guest copies to the console: progress during
/// a start that can take minutes, and what the kernel was doing if it fails.
const TRACER_ENV: &[(&str, &str)] = &[("RUST_LOG", "warn,nattrace::probes::attach=debug")];
const CAUSE: &str = "bridge_nf_call_iptables_off";

struct Scenario {
    name: &'static str,
    bridge_nf_call_iptables: bool,
    exit: i32,
    verdict: &'static str,
    cause: Option<&'static str>,
    /// Whether the client's connections succeed (a lab check, apart from nattrace).
    connects: bool,
}

const SCENARIOS: [Scenario; 2] = [
    Scenario {
        name: "seed000-broken",
        bridge_nf_call_iptables: false,
        exit: 1,
        verdict: "reply_not_reverse_nated",
        cause: Some(CAUSE),
        connects: false,
    },
    Scenario {
        name: "seed000-healthy",
        bridge_nf_call_iptables: true,
        exit: 0,
        verdict: "ok",
        cause: None,
        connects: true,
    },
];

#[derive(Default)]
struct Checks {
    passed: usize,
    failed: Vec<String>,
}

impl Checks {
    fn record(&mut self, name: &str, result: Result<String, String>) {
        match result {
            Ok(detail) => {
                self.passed += 1;
                say(&format!("vm-guest: PASS {name}: {detail}"));
            }
            Err(why) => {
                let mut lines = why.lines();
                say(&format!(
                    "vm-guest: FAIL {name}: {}",
                    lines.next().unwrap_or("")
                ));
                for l in lines {
                    say(&format!("vm-guest:      {l}"));
                }
                self.failed.push(name.to_string());
            }
        }
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            say(&format!("vm-guest: FAIL setup: {e:#}"));
            ExitCode::from(2)
        }
    }
}

fn run() -> anyhow::Result<bool> {
    let started = Instant::now();
    let Args {
        backends,
        nattrace,
        record_fixtures,
    } = parse_args()?;
    if !lab::is_root() {
        bail!("vm-guest needs root (network namespaces, eBPF)");
    }
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")?
        .trim()
        .to_string();
    let backends = match backends {
        Some(b) => b,
        None => BACKENDS
            .into_iter()
            .filter(|b| kernel_has(b, &release))
            .collect(),
    };
    say(&format!(
        "vm-guest: kernel {release}, backends {}, nattrace {}",
        backends.join(", "),
        nattrace.display()
    ));
    let mut checks = Checks::default();
    if backends.is_empty() {
        checks.record(
            "backends",
            Err("this kernel supports no backend (no kprobes, no BPF netfilter links)".into()),
        );
    }
    for b in BACKENDS.into_iter().filter(|b| !kernel_has(b, &release)) {
        checks.record(
            &format!("forced {b} backend refused"),
            forced_backend_refused(&nattrace, b),
        );
    }

    for sc in &SCENARIOS {
        let t = Instant::now();
        let lab = Lab::build(presets::seed000(Seed000 {
            bridge_nf_call_iptables: sc.bridge_nf_call_iptables,
            backend: presets::Backend::SameNode,
        }))
        .with_context(|| format!("building the {} lab", sc.name))?;
        checks.record(&format!("{} node layout", sc.name), node_layout(&lab));
        let facts = lab_facts(&lab)?;
        say(&format!(
            "vm-guest: {} lab up in {:.1}s (node netns inode {}, client port ifindex {}, backend port ifindex {})",
            sc.name,
            t.elapsed().as_secs_f64(),
            facts.node_ns,
            facts.client_port,
            facts.backend_port
        ));
        let mut runs: Vec<(&str, Vec<Value>)> = Vec::new();
        for &backend in &backends {
            let name = format!("{} {backend}", sc.name);
            let fixture = record_fixtures.then(|| record::name(&release, backend, sc.name));
            let write = fixture.as_deref().map(record::path);
            match trace(&nattrace, backend, &facts, write.as_deref(), true) {
                Ok(run) => {
                    let flows = judge(&mut checks, &name, sc, backend, &facts, &run);
                    runs.push((backend, flows));
                    if let (Some(fixture), Some(write)) = (&fixture, &write) {
                        checks.record(&format!("{name} recording"), record::print(fixture, write));
                    }
                }
                Err(e) => checks.record(&format!("{name} trace"), Err(format!("{e:#}"))),
            }
        }
        if runs.len() > 1 {
            checks.record(&format!("{} backends agree", sc.name), compare(&runs));
        }
        if !record_fixtures {
            for &backend in &backends {
                held::check(&mut checks, &nattrace, sc, backend, &facts);
            }
        }
        if !record_fixtures && backends.contains(&"kprobe") && backends.contains(&"netfilter") {
            let name = format!("{} auto falls back to kprobe", sc.name);
            match auto_with_netfilter_window_full(&nattrace, &facts) {
                Ok(run) => {
                    let why = run.start["backend_reason"].as_str().unwrap_or_default();
                    checks.record(
                        &format!("{name}: reason"),
                        if why.contains("could not attach") && why.ends_with("kprobes instead") {
                            Ok(why.to_string())
                        } else {
                            Err(format!("backend_reason {why:?}"))
                        },
                    );
                    judge(&mut checks, &name, sc, "kprobe", &facts, &run);
                }
                Err(e) => checks.record(&name, Err(format!("{e:#}"))),
            }
        }
    }

    if !record_fixtures {
        ipv6::run(&mut checks, &nattrace, &backends)?;
        established::run(&mut checks, &nattrace, &backends);
        established::run_late_ack(&mut checks, &nattrace, &backends);
        icmp::run(&mut checks, &nattrace, &backends);
    }
    // Recorded too: the table-full case can only be made in a guest.
    table_full::run(
        &mut checks,
        &nattrace,
        &backends,
        record_fixtures.then_some(release.as_str()),
    );

    say(&format!(
        "vm-guest: {} passed, {} failed ({}) in {:.1}s on {release}",
        checks.passed,
        checks.failed.len(),
        if checks.failed.is_empty() {
            "-".to_string()
        } else {
            checks.failed.join("; ")
        },
        started.elapsed().as_secs_f64()
    ));
    Ok(checks.failed.is_empty())
}

/// The guest node carries kube-proxy's complete layout like every root lab
/// node: its filter and mangle tables read back from the kernel exactly as
/// the lab rendered them (so the guest has every module they need).
fn node_layout(lab: &Lab) -> Result<String, String> {
    let node = presets::NODE_A;
    let rendered = lab.node_rules(node).map_err(|e| e.to_string())?;
    let mut summary = Vec::new();
    for table in ["filter", "mangle", "nat"] {
        let saved = lab
            .iptables_save_table(node, table)
            .map_err(|e| e.to_string())?;
        let kept = |text: &str| -> Vec<String> {
            text.lines()
                .filter(|l| !l.starts_with('#') && !l.starts_with('*') && *l != "COMMIT")
                .filter(|l| !l.starts_with(':') || l.ends_with("- [0:0]"))
                // iptables-save prints probabilities with one more digit.
                .filter(|l| !l.contains("--probability"))
                .map(str::to_string)
                .collect()
        };
        let want: Vec<String> = {
            let header = format!("*{table}");
            let section: String = rendered
                .split_inclusive("COMMIT\n")
                .find(|s| s.starts_with(&header))
                .unwrap_or_default()
                .to_string();
            kept(&section)
        };
        let got = kept(&saved);
        if got != want {
            return Err(format!(
                "{table} table differs from the rendered layout:\n{saved}"
            ));
        }
        summary.push(format!("{table} {} lines", got.len()));
    }
    Ok(summary.join(", "))
}

struct Args {
    backends: Option<Vec<&'static str>>,
    nattrace: PathBuf,
    record_fixtures: bool,
}

fn parse_args() -> anyhow::Result<Args> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut backends = None;
    let mut nattrace = None;
    let mut record_fixtures = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--record-fixtures" {
            record_fixtures = true;
            continue;
        }
        let value = it.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--backends" => {
                let mut list = Vec::new();
                for b in value?.split(',') {
                    match BACKENDS.into_iter().find(|k| *k == b) {
                        Some(k) => list.push(k),
                        None => bail!("unknown backend {b:?} (kprobe, netfilter)"),
                    }
                }
                backends = Some(list);
            }
            "--nattrace" => nattrace = Some(PathBuf::from(value?)),
            _ => bail!(
                "usage: vm-guest [--backends kprobe,netfilter] [--nattrace PATH] [--record-fixtures]"
            ),
        }
    }
    let nattrace = match nattrace {
        Some(p) => p,
        None => nattrace_path()?,
    };
    Ok(Args {
        backends,
        nattrace,
        record_fixtures,
    })
}

const BACKENDS: [&str; 2] = ["kprobe", "netfilter"];

/// The kernel version and the kprobe PMU decide, not a trial attach: a guest
/// whose kernel should run a backend but cannot must fail, not quietly test less.
fn kernel_has(backend: &str, release: &str) -> bool {
    let mut v = release
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse::<u32>().ok());
    match backend {
        "kprobe" => Path::new("/sys/bus/event_source/devices/kprobe/type").exists(),
        // BPF netfilter links appeared in 6.4.
        _ => (v.next().unwrap_or(0), v.next().unwrap_or(0)) >= (6, 4),
    }
}

fn forced_backend_refused(nattrace: &Path, backend: &str) -> Result<String, String> {
    let svc = format!("{WEB_SERVICE_IP}:{WEB_PORT}");
    let out = std::process::Command::new(nattrace)
        .args(["--backend", backend, "--svc", &svc, "--duration", "1"])
        .output()
        .map_err(|e| format!("running {}: {e}", nattrace.display()))?;
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    if out.status.code() == Some(2) && !stderr.is_empty() {
        Ok(format!("exit 2: {stderr}"))
    } else {
        Err(format!(
            "expected exit 2 with a reason, got {}: {stderr}",
            out.status
        ))
    }
}

/// What one nattrace run printed, and what the client saw meanwhile.
struct Run {
    done: Finished,
    /// The `"kind":"start"` line.
    start: Value,
    /// Per connection: the HTTP status line, or why there was none.
    traffic: Vec<Result<String, String>>,
}

/// Every priority nattrace's OUTPUT-after-DNAT link may take (-99..=-1) is
/// held by an nft base chain, so its netfilter links cannot attach
/// (`nf_hook_entries_grow`: -EBUSY): `--backend auto` must say so and trace
/// with kprobes. The chains are removed again afterwards.
fn auto_with_netfilter_window_full(nattrace: &Path, facts: &LabFacts) -> anyhow::Result<Run> {
    let mut rules = String::from("table ip nattrace-vm-fill {\n");
    for (i, priority) in (-99..=-1).enumerate() {
        rules.push_str(&format!(
            "  chain output{i} {{ type filter hook output priority {priority}; policy accept; }}\n"
        ));
    }
    rules.push_str("}\n");
    nft_in(&facts.node_path, &["-f", "-"], Some(&rules))?;
    let run = trace(nattrace, "auto", facts, None, true);
    nft_in(
        &facts.node_path,
        &["delete", "table", "ip", "nattrace-vm-fill"],
        None,
    )?;
    run
}

/// `nft ARGS` in the namespace at `ns`, with `stdin` fed to it.
fn nft_in(ns: &Path, args: &[&str], stdin: Option<&str>) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut child = std::process::Command::new("/usr/sbin/ip")
        .args(["netns", "exec"])
        .arg(ns.file_name().context("netns path")?)
        .arg("nft")
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("running nft")?;
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .context("nft stdin")?
            .write_all(text.as_bytes())?;
    }
    drop(child.stdin.take());
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "nft {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// One nattrace run: attach, make the connections, wait for the summary;
/// `--write` the recording to `write` if given. `every_packet` passes `-v`
/// (every hop of every flow, the kernel's per-flow buffer off).
fn trace(
    nattrace: &Path,
    backend: &str,
    facts: &LabFacts,
    write: Option<&Path>,
    every_packet: bool,
) -> anyhow::Result<Run> {
    let mut args: Vec<String> = [
        "--backend",
        backend,
        "--svc",
        &format!("{WEB_SERVICE_IP}:{WEB_PORT}"),
        "--netns",
        &facts.node_path.to_string_lossy(),
        "--output",
        "json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if every_packet {
        args.push("-v".to_string());
    }
    if let Some(w) = write {
        args.extend(["--write".to_string(), w.display().to_string()]);
    }
    let t = Instant::now();
    let mut tracer = Nattrace::spawn_echoing(nattrace, &args, TRACER_ENV, Echo::Stderr)?;
    let first = tracer.wait_started(ATTACH_TIMEOUT)?;
    let attach = t.elapsed();
    let start: Value =
        serde_json::from_str(&first).with_context(|| format!("first line is not JSON: {first}"))?;
    let traffic = connect_all(&facts.client_path);
    // Stopped once every connection is decided, not after a --duration:
    // on an emulated guest sharing a loaded host the connections and their
    // verdicts can outlast any fixed one.
    let done = tracer.finish_after_flows(CONNECTIONS)?;
    say(&format!(
        "vm-guest: info nattrace --backend {backend}: attached in {:.1}s, ran {:.1}s, {} stdout lines",
        attach.as_secs_f64(),
        t.elapsed().as_secs_f64(),
        done.stdout.len()
    ));
    Ok(Run {
        done,
        start,
        traffic,
    })
}

fn connect_all(client_ns: &Path) -> Vec<Result<String, String>> {
    thread::scope(|s| {
        let handles: Vec<_> = (0..CONNECTIONS)
            .map(|_| s.spawn(|| http_get_in(client_ns)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("panicked".into())))
            .collect()
    })
}

/// nattrace's arguments for a recorded JSON trace of `svcs` in the node
/// namespace `node` with `backend` (the established and ICMP checks).
fn recorded_trace_args(backend: &str, svcs: &[String], node: &Path, record: &Path) -> Vec<String> {
    let mut args = vec!["--backend".to_string(), backend.to_string()];
    for svc in svcs {
        args.extend(["--svc".to_string(), svc.clone()]);
    }
    args.extend(
        [
            "--netns",
            &node.display().to_string(),
            "--output",
            "json",
            "--reply-timeout",
            "1000",
            "--write",
            &record.display().to_string(),
        ]
        .map(String::from),
    );
    args
}

/// GET from inside the client pod. setns moves only the calling thread, and
/// this thread ends with the request, so the rest of the runner stays put;
/// it also spares the guest curl and its libraries.
fn http_get_in(ns: &Path) -> Result<String, String> {
    let f = File::open(ns).map_err(|e| format!("opening {}: {e}", ns.display()))?;
    nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET)
        .map_err(|e| format!("setns: {e}"))?;
    let addr = SocketAddr::V4(SocketAddrV4::new(WEB_SERVICE_IP, WEB_PORT));
    let s = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
        .map_err(|e| format!("connect {addr}: {e}"))?;
    http_status(s, addr, Duration::from_secs(3))
}

/// One `GET /` on a connected stream: its status line if it is 200.
fn http_status(
    mut s: TcpStream,
    addr: SocketAddr,
    read_timeout: Duration,
) -> Result<String, String> {
    let _ = s.set_read_timeout(Some(read_timeout));
    s.write_all(format!("GET / HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .map_err(|e| format!("send: {e}"))?;
    let mut body = String::new();
    s.read_to_string(&mut body)
        .map_err(|e| format!("read: {e}"))?;
    match body.lines().next() {
        Some(status) if status.contains(" 200") => Ok(status.to_string()),
        other => Err(format!("unexpected response {other:?}")),
    }
}

fn judge(
    checks: &mut Checks,
    name: &str,
    sc: &Scenario,
    backend: &str,
    facts: &LabFacts,
    run: &Run,
) -> Vec<Value> {
    let Run {
        done,
        start,
        traffic,
    } = run;
    let ran = start["backend"].as_str().unwrap_or("?");
    let skipped: Vec<&str> = start["skipped"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    say(&format!(
        "vm-guest: info {name}: backend {ran} ({}); skipped: {}",
        start["backend_reason"].as_str().unwrap_or("?"),
        if skipped.is_empty() {
            "none".into()
        } else {
            skipped.join("; ")
        }
    ));
    let ok_connects = traffic.iter().filter(|t| t.is_ok()).count();
    let want = if sc.connects { CONNECTIONS } else { 0 };
    checks.record(
        &format!("{name} lab traffic"),
        if ok_connects == want {
            Ok(format!(
                "{ok_connects}/{CONNECTIONS} connections succeeded, as the lab is built"
            ))
        } else {
            Err(format!(
                "{ok_connects}/{CONNECTIONS} connections succeeded, expected {want}: {traffic:?}"
            ))
        },
    );
    let flows = match done.flows() {
        Ok(f) => f,
        Err(e) => {
            checks.record(
                &format!("{name} output"),
                Err(format!("{e:#}\n{}", done.describe())),
            );
            return Vec::new();
        }
    };
    let mut problems = Vec::new();
    if ran != backend {
        problems.push(format!("the start line says backend {ran:?}"));
    }
    if done.status.code() != Some(sc.exit) {
        problems.push(format!("exit status {}, expected {}", done.status, sc.exit));
    }
    if flows.len() < CONNECTIONS {
        problems.push(format!(
            "{} flows for {CONNECTIONS} connections",
            flows.len()
        ));
    }
    let backend_addr = SocketAddrV4::new(BACKEND_IP, WEB_PORT).to_string();
    for f in &flows {
        let (verdict, cause) = (f["verdict"].as_str(), f["cause"].as_str());
        if verdict != Some(sc.verdict) || cause != sc.cause || f["backend"] != backend_addr.as_str()
        {
            problems.push(format!(
                "flow {} -> {} via {}: {} cause {} (expected {} cause {:?}): {}",
                f["client"],
                f["service"],
                f["backend"],
                f["verdict"],
                f["cause"],
                sc.verdict,
                sc.cause,
                f["detail"]
            ));
        }
    }
    let summary = done
        .summary()
        .map(|s| s.to_string())
        .unwrap_or_else(|e| format!("{e:#}"));
    checks.record(
        &format!("{name} verdicts"),
        if problems.is_empty() {
            Ok(format!(
                "exit {}, {} flows {}{}",
                sc.exit,
                flows.len(),
                sc.verdict,
                sc.cause.map(|c| format!(" ({c})")).unwrap_or_default()
            ))
        } else {
            problems.push(format!("summary: {summary}"));
            problems.push(format!("stderr: {}", done.stderr.trim()));
            Err(problems.join("\n"))
        },
    );
    checks.record(
        &format!("{name} kernel fields"),
        check_fields(&flows, facts, backend),
    );
    flows
}
