//! `cargo xtask test` and `cargo xtask demo`: the README's two commands.
use std::{path::PathBuf, process::Command};

use anyhow::{Context as _, bail};

use crate::{image, setup, vm};

/// Root of the workspace (xtask lives one level below it).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits inside the workspace")
        .to_path_buf()
}

fn cargo(args: &[&str]) -> anyhow::Result<()> {
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

#[derive(clap::Args)]
pub struct TestArgs {
    /// Skip the QEMU guest-kernel run (the kprobe backend is then untested).
    #[arg(long)]
    pub no_vm: bool,
}

/// Everything CI runs: setup, formatting and lints, the container image,
/// unit and root integration tests on this kernel, then the guest kernels.
pub fn test(args: TestArgs) -> anyhow::Result<()> {
    setup::run()?;
    cargo(&["fmt", "--all", "--check"])?;
    cargo(&["clippy", "--all-targets", "--", "-D", "warnings"])?;
    // The image first: its musl build is the one vm-test needs too (same
    // cargo call), and tests/tests/image.rs runs it instead of building one.
    image::run(image::ImageArgs::default())?;
    cargo_with_env(
        &["test", "--no-fail-fast"],
        &[("NATTRACE_IMAGE", image::DEFAULT_TAG)],
    )?;
    if !args.no_vm {
        vm::run(vm::VmTestArgs::default())?;
    }
    Ok(())
}

/// Builds everything, creates the seed 000 lab node and traces it twice.
pub fn demo() -> anyhow::Result<()> {
    setup::run()?;
    cargo(&[
        "build",
        "--bin",
        "nattrace",
        "--bin",
        "nattrace-demo",
        "--bin",
        "lab-server",
    ])?;
    let target = workspace_root().join("target/debug");
    let status = Command::new(target.join("nattrace-demo"))
        .arg("--nattrace")
        .arg(target.join("nattrace"))
        .status()
        .context("could not run nattrace-demo")?;
    if !status.success() {
        bail!("demo failed ({status})");
    }
    Ok(())
}
