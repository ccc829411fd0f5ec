//! `nattrace-demo --nattrace PATH` (run by `cargo xtask demo`, as root):
//! builds seed 000's node in network namespaces and traces it twice with the
//! real nattrace — once healthy (bridge-nf-call-iptables=1), once broken
//! (=0) — streaming nattrace's output exactly as a user would see it.
//! Exits non-zero unless the healthy run is all `ok` (exit 0) and the broken
//! run flags `reply_not_reverse_nated` (exit 1).

use std::io::IsTerminal as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use lab::Lab;
use lab::kubelet::{KubeletLayout, cgroup2_mount};
use lab::presets::{self, Backend, Seed000};
use lab::tracer::{Nattrace, say};

/// Enough for three curls of at most `CURL_MAX_TIME` each after attaching.
const TRACE_SECS: u64 = 5;
const CURL_MAX_TIME: Duration = Duration::from_secs(1);
const CURLS: usize = 3;
/// Loading and attaching (BTF parsing, verifier) on a busy 2-core machine.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(30);
const CAUSE: &str = "bridge_nf_call_iptables_off";
const VERDICTS: [&str; 5] = [
    "ok",
    "reply_not_reverse_nated",
    "no_reply",
    "dropped",
    "refused",
];

struct Case {
    heading: &'static str,
    bridge_nf_call_iptables: bool,
    expect_exit: i32,
    expect_verdict: &'static str,
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("nattrace-demo: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn parse_args() -> anyhow::Result<PathBuf> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [flag, path] if flag == "--nattrace" => Ok(PathBuf::from(path)),
        _ => bail!("usage: nattrace-demo --nattrace PATH (as root; `cargo xtask demo` runs it)"),
    }
}

fn run() -> anyhow::Result<bool> {
    let nattrace = parse_args()?;
    if !nattrace.is_file() {
        bail!(
            "{} does not exist; build it with `cargo build --bin nattrace`",
            nattrace.display()
        );
    }
    if !lab::is_root() {
        bail!("the demo needs root (network namespaces and eBPF); run `sudo cargo xtask demo`");
    }
    let started = Instant::now();
    let cases = [
        Case {
            heading: "healthy node: bridge-nf-call-iptables=1 — every connection should be ok",
            bridge_nf_call_iptables: true,
            expect_exit: 0,
            expect_verdict: "ok",
        },
        Case {
            heading: "seed 000: br_netfilter off (bridge-nf-call-iptables=0) — the same-node backend's \
                      replies bypass reverse NAT",
            bridge_nf_call_iptables: false,
            expect_exit: 1,
            expect_verdict: "reply_not_reverse_nated",
        },
    ];
    let mut all_ok = true;
    for case in &cases {
        all_ok &= run_case(&nattrace, case)?;
    }
    say("");
    if all_ok {
        say(&format!(
            "demo done in {:.1}s: the healthy node was all ok, and on the broken node nattrace \
             named the cause ({CAUSE}).",
            started.elapsed().as_secs_f64()
        ));
    } else {
        say("demo FAILED: nattrace did not report what the lab actually did (see above).");
    }
    Ok(all_ok)
}

fn run_case(nattrace: &std::path::Path, case: &Case) -> anyhow::Result<bool> {
    say("");
    say(&format!("━━━ {} ━━━", case.heading));
    let lab = Lab::build(presets::seed000(Seed000 {
        bridge_nf_call_iptables: case.bridge_nf_call_iptables,
        backend: Backend::SameNode,
    }))
    .context("building the seed 000 lab")?;
    // What a kubelet leaves on the node (a pause per pod in its cgroup, its
    // log directory): nattrace names the pods from it (--host-root).
    let mut kubelet = KubeletLayout::empty(&lab)?;
    let named = cgroup2_mount().is_some() && kubelet.start_pods(&lab).is_ok();
    let node = lab.node_netns(presets::NODE_A)?.path();
    say(&format!(
        "lab: node {} (netns {}), client pod {} {}, Service {}:{} → backend pod {} {} on the same node",
        presets::NODE_A,
        node.display(),
        presets::CLIENT_POD,
        presets::CLIENT_IP,
        presets::WEB_SERVICE_IP,
        presets::WEB_PORT,
        presets::BACKEND_POD,
        presets::BACKEND_IP,
    ));
    let svc = format!("{}:{}", presets::WEB_SERVICE_IP, presets::WEB_PORT);
    let mut args = vec![
        "--svc".to_string(),
        svc,
        "--netns".into(),
        node.display().to_string(),
        "--duration".into(),
        TRACE_SECS.to_string(),
    ];
    if named {
        args.extend([
            "--host-root".into(),
            kubelet.host_root().display().to_string(),
        ]);
    }
    if std::io::stdout().is_terminal() {
        args.extend(["--color".into(), "always".into()]);
    }
    say(&format!("$ nattrace {}", args.join(" ")));
    let mut tracer = Nattrace::spawn(nattrace, &args, &[], true)?;
    tracer.wait_started(ATTACH_TIMEOUT)?;

    let url = format!("http://{}:{}/", presets::WEB_SERVICE_IP, presets::WEB_PORT);
    for _ in 0..CURLS {
        let out = lab.http_get(
            presets::CLIENT_POD,
            presets::WEB_SERVICE_IP,
            presets::WEB_PORT,
            CURL_MAX_TIME,
        )?;
        let result = if out.status.success() {
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        } else {
            format!(
                "failed (curl exit {}): {}",
                out.status.code().unwrap_or(-1),
                String::from_utf8_lossy(&out.stderr).trim()
            )
        };
        say(&format!(
            "[pod {}] $ curl {url} → {result}",
            presets::CLIENT_POD
        ));
    }
    let done = tracer.wait(Duration::from_secs(TRACE_SECS + 20))?;
    Ok(judge(case, done.status.code(), &done.stdout))
}

/// Reads the verdicts off the flows' headlines (`<mark> <verdict> <proto>
/// ...`; their indented lines follow), ignoring colour codes.
fn judge(case: &Case, code: Option<i32>, stdout: &[String]) -> bool {
    let plain: Vec<String> = stdout.iter().map(|l| strip_ansi(l)).collect();
    let verdicts: Vec<&str> = plain
        .iter()
        .filter(|l| l.starts_with(['✓', '✗', '?']))
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter(|w| VERDICTS.contains(w))
        .collect();
    let wanted = verdicts
        .iter()
        .filter(|v| **v == case.expect_verdict)
        .count();
    let mut problems = Vec::new();
    if code != Some(case.expect_exit) {
        problems.push(format!(
            "exit status {code:?}, expected {}",
            case.expect_exit
        ));
    }
    if wanted == 0 {
        problems.push(format!("no flow was reported {}", case.expect_verdict));
    }
    if case.expect_verdict == "ok" && wanted != verdicts.len() {
        problems.push(format!("not every flow was ok: {verdicts:?}"));
    }
    if case.expect_verdict != "ok" && !plain.iter().any(|l| l.contains(CAUSE)) {
        problems.push(format!("the cause {CAUSE} was not named"));
    }
    if problems.is_empty() {
        say(&format!(
            "→ as expected: {wanted} flow(s) {}, nattrace exit status {}",
            case.expect_verdict, case.expect_exit
        ));
        true
    } else {
        say(&format!("→ UNEXPECTED: {}", problems.join("; ")));
        false
    }
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            // CSI sequences end with a letter.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
