//! `cargo xtask bench`: what nattrace costs a node (issue 7). Builds nattrace
//! and the lab's bench binaries in release mode, runs the collector replay
//! (`cargo bench`), then the lab benchmarks (tests/src/bin/nattrace-bench.rs),
//! which print the table and write BENCHMARKS.md (and the BPF pass, per
//! program, as target/bench/results.json). Takes a few minutes; not
//! part of `cargo xtask test`.
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context as _, bail};

use crate::workspace::{cargo_with_env as cargo, workspace_root};

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Runs per condition (conditions alternate run by run).
    #[arg(long, default_value_t = 7)]
    pub runs: u32,
    /// Seconds per iperf3 run.
    #[arg(long, default_value_t = 3)]
    pub secs: u32,
    /// Seconds per connection-rate run.
    #[arg(long, default_value_t = 3.0)]
    pub conn_secs: f64,
    /// Pods on the start-up benchmark's node (each one a veth on cni0).
    #[arg(long, default_value_t = 200)]
    pub pods: u32,
    /// Only these sections: bulk, conn, startup, interfaces, services (lab)
    /// and collector (the replay), comma-separated.
    #[arg(
        long,
        default_value = "bulk,conn,startup,interfaces,services,collector"
    )]
    pub only: String,
    /// Another nattrace build to run in the same interleaved rounds (miss
    /// path, traced bulk, connection rate, BPF calls), for a before/after in
    /// one run: a nattrace binary, or a git ref (`main`, a commit), which is
    /// built in release mode from `git archive` under target/bench/.
    #[arg(long)]
    pub baseline: Option<String>,
    /// What --baseline is, for BENCHMARKS.md.
    #[arg(long, default_value = "baseline")]
    pub baseline_label: String,
    /// Where to write the report (default: BENCHMARKS.md at the workspace
    /// root), e.g. for a run of some sections only.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// A smoke run for working on the harness: 1 short run each, 20 pods,
    /// a small collector replay; writes target/bench/BENCHMARKS.quick.md.
    #[arg(long)]
    pub quick: bool,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("bench builds lab namespaces and loads eBPF: run it as root");
    }
    let root = workspace_root();
    let out_dir = root.join("target/bench");
    std::fs::create_dir_all(&out_dir)?;
    let baseline = match &args.baseline {
        Some(b) => Some(baseline_binary(b, &args.baseline_label)?),
        None => None,
    };
    cargo(
        &[
            "build",
            "--release",
            "-p",
            "tracer-userspace",
            "--bin",
            "nattrace",
        ],
        &[],
    )?;
    cargo(
        &[
            "build",
            "--release",
            "-p",
            "nattrace-tests",
            "--bin",
            "nattrace-bench",
            "--bin",
            "conn-bench",
        ],
        &[],
    )?;
    let collector_json = out_dir.join("collector.json");
    let collector_json_s = collector_json.display().to_string();
    let with_collector = args.only.split(',').any(|s| s.trim() == "collector");
    if with_collector {
        let mut bench = vec!["bench", "-p", "tracer-userspace", "--bench", "collector"];
        if args.quick {
            bench.extend(["--", "--quick"]);
        }
        cargo(&bench, &[("NATTRACE_BENCH_OUT", &collector_json_s)])?;
    }

    let (runs, secs, conn_secs, pods) = if args.quick {
        (1, 1, 1.0, args.pods.min(20))
    } else {
        (args.runs, args.secs, args.conn_secs, args.pods)
    };
    let md = match (&args.out, args.quick) {
        (Some(out), _) => out.clone(),
        (None, true) => out_dir.join("BENCHMARKS.quick.md"),
        (None, false) => root.join("BENCHMARKS.md"),
    };
    let release = root.join("target/release");
    let status = Command::new(release.join("nattrace-bench"))
        .arg("--nattrace")
        .arg(release.join("nattrace"))
        .args(
            with_collector
                .then(|| ["--collector-json".into(), collector_json_s.clone()])
                .into_iter()
                .flatten(),
        )
        .arg("--out")
        .arg(&md)
        .arg("--json")
        .arg(out_dir.join("results.json"))
        .args(["--runs", &runs.to_string(), "--secs", &secs.to_string()])
        .args([
            "--conn-secs",
            &conn_secs.to_string(),
            "--pods",
            &pods.to_string(),
        ])
        .args(["--only", &args.only])
        .args(baseline.iter().flat_map(|(b, label)| {
            [
                "--baseline".into(),
                b.display().to_string(),
                "--baseline-label".into(),
                label.clone(),
            ]
        }))
        .status()
        .context("could not run nattrace-bench")?;
    if !status.success() {
        bail!("nattrace-bench failed ({status})");
    }
    Ok(())
}

/// `--baseline`: a binary as given, or a git ref built once per commit into
/// target/bench/baseline-<commit>/nattrace (its sources from `git archive`,
/// compiled with this workspace's target dir so the dependencies are
/// shared). Returns the binary and its label for BENCHMARKS.md.
fn baseline_binary(given: &str, label: &str) -> anyhow::Result<(PathBuf, String)> {
    let path = PathBuf::from(given);
    if path.is_file() {
        return Ok((path, label.to_string()));
    }
    let root = workspace_root();
    let rev = Command::new("git")
        .current_dir(&root)
        .args(["rev-parse", "--verify", "--quiet"])
        .arg(format!("{given}^{{commit}}"))
        .output()
        .context("running git rev-parse")?;
    if !rev.status.success() {
        bail!("--baseline {given}: neither a file nor a git ref of this repository");
    }
    let commit = String::from_utf8_lossy(&rev.stdout).trim().to_string();
    let dir = root.join("target/bench").join(format!("baseline-{commit}"));
    let bin = dir.join("nattrace");
    let label = if label == "baseline" {
        format!("{given} ({})", &commit[..7])
    } else {
        label.to_string()
    };
    if bin.is_file() {
        eprintln!("xtask: baseline {label}: {} (built before)", bin.display());
        return Ok((bin, label));
    }
    let src = dir.join("src");
    if src.exists() {
        std::fs::remove_dir_all(&src)?;
    }
    std::fs::create_dir_all(&src)?;
    let status = Command::new("sh")
        .current_dir(&root)
        .arg("-c")
        .arg(format!(
            "git archive {commit} | tar -x -C '{}'",
            src.display()
        ))
        .status()
        .context("running git archive")?;
    if !status.success() {
        bail!("git archive {commit} failed ({status})");
    }
    eprintln!("xtask: building the baseline {label} in {}", src.display());
    // A target directory of its own. Sharing this tree's, the baseline's
    // build left its fingerprints under the same names (a workspace
    // member's metadata hash does not include its path), so cargo then
    // found this tree's nattrace fresh and kept the baseline's binary in
    // target/release: a run with a new --baseline compared the baseline
    // with itself (found 2026-12-04: the "this build" binary lacked the
    // tree's changes). Kept across runs, so only the first baseline
    // builds the dependencies.
    let target = root.join("target/bench/baseline-target");
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(&src)
        .env("CARGO_TARGET_DIR", &target)
        .args([
            "build",
            "--release",
            "-p",
            "tracer-userspace",
            "--bin",
            "nattrace",
        ])
        .status()
        .context("building the baseline")?;
    if !status.success() {
        bail!("building the baseline {label} failed ({status})");
    }
    std::fs::copy(target.join("release/nattrace"), &bin)
        .with_context(|| format!("copying the baseline to {}", bin.display()))?;
    Ok((bin, label))
}
