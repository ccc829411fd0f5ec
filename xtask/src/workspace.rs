//! The workspace the tasks work in: its root, cargo run there, and the
//! fixture data the tracer's tests read (with the goldens written for it).
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

/// Root of the workspace (xtask lives one level below it).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits inside the workspace")
        .to_path_buf()
}

pub fn cargo(args: &[&str]) -> anyhow::Result<()> {
    cargo_with_env(args, &[])
}

pub fn cargo_with_env(args: &[&str], envs: &[(&str, &str)]) -> anyhow::Result<()> {
    eprintln!("xtask: cargo {}", args.join(" "));
    let status = Command::new(env!("CARGO"))
        .args(args)
        .envs(envs.iter().copied())
        .current_dir(workspace_root())
        .status()
        .context("could not run cargo")?;
    if !status.success() {
        bail!("cargo {} failed ({status})", args.join(" "));
    }
    Ok(())
}

/// The one home of the tracer's fixture data, from the workspace root.
pub const FIXTURES_DIR: &str = "tracer-userspace/fixtures";

/// Where the seed recordings and their goldens live.
pub fn recorded_dir() -> PathBuf {
    workspace_root().join(FIXTURES_DIR).join("recorded")
}

/// Where conntrack's own failures' recordings (issue 22) and their goldens live.
pub fn conntrack_dir() -> PathBuf {
    workspace_root().join(FIXTURES_DIR).join("conntrack")
}

/// Where the established-flow recordings (issue 21) and their goldens live.
pub fn established_dir() -> PathBuf {
    workspace_root().join(FIXTURES_DIR).join("established")
}

/// Writes `NAME.json`, the recording `NAME.rec`'s `nattrace analyze
/// --output json -v`, next to it: the golden the collector's tests compare
/// against.
pub fn write_golden(nattrace: &Path, rec: &Path) -> anyhow::Result<()> {
    let out = Command::new(nattrace)
        .args(["analyze"])
        .arg(rec)
        .args(["--output", "json", "-v"])
        .output()
        .with_context(|| format!("running nattrace analyze {}", rec.display()))?;
    // 0: every flow ok, 1: a flow was not; 2: the recording is unusable.
    if !matches!(out.status.code(), Some(0 | 1)) {
        bail!(
            "nattrace analyze {} failed ({}): {}",
            rec.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let golden = rec.with_extension("json");
    std::fs::write(&golden, &out.stdout)
        .with_context(|| format!("writing {}", golden.display()))?;
    eprintln!("xtask: {} and its golden analyze output", rec.display());
    Ok(())
}
