//! `cargo xtask bench`: what nattrace costs a node (issue 7). Builds nattrace
//! and the lab's bench binaries in release mode, runs the collector replay
//! (`cargo bench`), then the lab benchmarks (tests/src/bin/nattrace-bench.rs),
//! which print the table and write BENCHMARKS.md. Takes a few minutes; not
//! part of `cargo xtask test`.
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
    /// Only these sections: bulk, conn, startup (lab) and collector (the
    /// replay), comma-separated.
    #[arg(long, default_value = "bulk,conn,startup,collector")]
    pub only: String,
    /// Another nattrace binary (e.g. a build of main) to run on the miss
    /// path in the same interleaved rounds, for a before/after in one run.
    #[arg(long)]
    pub baseline: Option<std::path::PathBuf>,
    /// What --baseline is, for BENCHMARKS.md.
    #[arg(long, default_value = "baseline")]
    pub baseline_label: String,
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
    let md = if args.quick {
        out_dir.join("BENCHMARKS.quick.md")
    } else {
        root.join("BENCHMARKS.md")
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
        .args(["--runs", &runs.to_string(), "--secs", &secs.to_string()])
        .args([
            "--conn-secs",
            &conn_secs.to_string(),
            "--pods",
            &pods.to_string(),
        ])
        .args(["--only", &args.only])
        .args(args.baseline.iter().flat_map(|b| {
            [
                "--baseline".into(),
                b.display().to_string(),
                "--baseline-label".into(),
                args.baseline_label.clone(),
            ]
        }))
        .status()
        .context("could not run nattrace-bench")?;
    if !status.success() {
        bail!("nattrace-bench failed ({status})");
    }
    Ok(())
}
