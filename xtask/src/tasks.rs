//! `cargo xtask test` and `cargo xtask demo`: the README's two commands.
use std::{path::PathBuf, process::Command};

use anyhow::{Context as _, bail};

use crate::{setup, vm};

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

/// Everything CI runs: setup, formatting and lints, unit tests, then (as
/// root) the root integration tests on this kernel and the guest kernels.
/// What needs no root comes first, so a developer without it still gets
/// fmt, clippy and the unit tests.
pub fn test(args: TestArgs) -> anyhow::Result<()> {
    setup::run()?;
    lint()?;
    // Unit tests of every default member (the eBPF crate has none and
    // builds only for bpfel-unknown-none).
    cargo(&["test", "--lib", "--bins", "--no-fail-fast"])?;
    if !setup::is_root() {
        eprintln!(
            "xtask: not root: skipping the root integration tests (network namespaces, eBPF) and the guest kernels; run `sudo cargo xtask test` for them"
        );
        return Ok(());
    }
    cargo(&["test", "--no-fail-fast"])?;
    if !args.no_vm {
        vm::run(vm::VmTestArgs::default())?;
    }
    Ok(())
}

/// `cargo fmt --check` and clippy `-D warnings` over userspace and over the
/// eBPF crate, which only compiles for bpfel-unknown-none with nightly's
/// build-std (the toolchain aya-build uses in tracer-userspace/build.rs).
pub fn lint() -> anyhow::Result<()> {
    cargo(&["fmt", "--all", "--check"])?;
    cargo(&["clippy", "--all-targets", "--", "-D", "warnings"])?;
    let args = [
        "run",
        "nightly",
        "cargo",
        "clippy",
        "-p",
        "tracer-ebpf",
        "--target",
        "bpfel-unknown-none",
        "-Z",
        "build-std=core",
        "--",
        "-D",
        "warnings",
    ];
    eprintln!("xtask: rustup {}", args.join(" "));
    // The outer cargo's RUSTC points at the stable compiler; nightly's
    // cargo must pick its own.
    let status = Command::new("rustup")
        .args(args)
        .env_remove("RUSTC")
        .env_remove("RUSTC_WRAPPER")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("RUSTUP_TOOLCHAIN")
        .current_dir(workspace_root())
        .status()
        .context("could not run rustup (the eBPF crate needs rustup's nightly)")?;
    if !status.success() {
        bail!("clippy on tracer-ebpf failed ({status})");
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
