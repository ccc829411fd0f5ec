//! `cargo xtask test` and `cargo xtask demo`: the README's two commands.
use std::{path::Path, process::Command};

use anyhow::{Context as _, bail};

use crate::{
    image, setup, vm,
    workspace::{
        cargo, cargo_with_env, conntrack_dir, established_dir, recorded_dir, workspace_root,
        write_golden,
    },
};

#[derive(clap::Args)]
pub struct TestArgs {
    /// Skip the QEMU guest-kernel run (the kprobe backend is then untested).
    #[arg(long)]
    pub no_vm: bool,
}

/// Everything CI runs: setup, formatting and lints, unit tests, then (as
/// root) the container image, the root integration tests on this kernel and
/// the guest kernels. What needs no root comes first, so a developer
/// without it still gets fmt, clippy and the unit tests.
pub fn test(args: TestArgs) -> anyhow::Result<()> {
    setup::run()?;
    lint()?;
    // Unit tests of every default member (the eBPF crate has none and
    // builds only for bpfel-unknown-none).
    cargo(&["test", "--lib", "--bins", "--no-fail-fast"])?;
    if !setup::is_root() {
        eprintln!(
            "xtask: not root: skipping the image, the root integration tests (network namespaces, eBPF) and the guest kernels; run `sudo cargo xtask test` for them"
        );
        return Ok(());
    }
    // The tests are compiled before the image's build starts: two builds
    // side by side were slower than one after the other (7f4b234).
    cargo(&["test", "--no-run"])?;
    // The image's musl release build (the guests' payload too) runs beside
    // the root tests, which mostly wait on clients that time out: it came
    // before them, ~8 of CI's 32 minutes on 2 busy cores. The guests follow
    // it there, each a kernel of its own that shares nothing with the
    // tests. The image's own tests wait for both the image and the other
    // root tests: they trace a lab, and traces in two test processes would
    // see each other's labs (`tracing_lock` in tests/src/tracer.rs holds
    // within one process only).
    let (built, image_ready) = std::sync::mpsc::channel();
    let no_vm = args.no_vm;
    let side = std::thread::spawn(move || -> anyhow::Result<()> {
        let image = image::run(image::ImageArgs::default());
        let ok = image.is_ok();
        let _ = built.send(image);
        if no_vm {
            return Ok(());
        }
        if !ok {
            bail!("not run: their musl payload is the image's build, which failed");
        }
        vm::run(vm::VmTestArgs::default())
    });
    let tests = cargo(&["test", "--no-fail-fast", "--", "--skip", IMAGE_TESTS]);
    let image = image_ready
        .recv()
        .unwrap_or_else(|_| Err(anyhow::anyhow!("the image build panicked")))
        .and_then(|()| {
            cargo_with_env(
                &["test", "--no-fail-fast", "--test", "image"],
                &[("NATTRACE_IMAGE", image::DEFAULT_TAG)],
            )
        });
    let guests = side
        .join()
        .unwrap_or_else(|_| Err(anyhow::anyhow!("vm-test panicked")));
    let failed: Vec<String> = [
        ("the root tests", tests),
        ("the image", image),
        ("the guest kernels", guests),
    ]
    .into_iter()
    .filter_map(|(what, r)| r.err().map(|e| format!("{what}: {e:#}")))
    .collect();
    if !failed.is_empty() {
        bail!("{}", failed.join("; "));
    }
    Ok(())
}

/// The names of tests/tests/image.rs's tests begin with this: they need
/// the image, so `test` runs them after it is built, apart from the others.
const IMAGE_TESTS: &str = "root_image_";

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

/// The seed scenarios (kube-proxy in iptables mode) whose traces are the
/// collector's recorded fixtures: (test binary of nattrace-tests, test).
pub const RECORDED: &[(&str, &str)] = &[
    (
        "tracer",
        "root_seed000_broken_every_same_node_connection_is_not_reverse_nated",
    ),
    ("tracer", "root_seed000_healthy_every_connection_is_ok"),
    (
        "scenarios",
        "root_dns_seed001_broken_reply_from_unexpected_source",
    ),
    ("scenarios", "root_dns_seed001_healthy_is_ok"),
    (
        "scenarios",
        "root_seed003_on_the_dnating_node_no_reply_through_node",
    ),
    (
        "scenarios",
        "root_seed003_with_masquerade_all_is_ok_and_snated",
    ),
    (
        "scenarios",
        "root_seed003_on_the_backend_node_reply_bypasses_the_dnating_node",
    ),
    ("scenarios", "root_hairpin_with_masquerade_is_ok"),
    ("scenarios", "root_hairpin_mode_off_is_named"),
    (
        "scenarios",
        "root_hairpin_without_masquerade_is_dropped_as_local_source",
    ),
];

/// Connections broken after an `ok` opening (issue 21), traced in the
/// default mode (kernel buffer on, healthy flows muted and watched in the
/// kernel): recorded apart from [`RECORDED`] into [`established_dir`],
/// because the kernel-buffer model test (tracer-userspace/tests/held.rs)
/// applies the buffer to recordings of every packet.
pub const ESTABLISHED: &[&str] = &[
    "root_bridge_nf_off_mid_stream_iptables",
    "root_bridge_nf_off_mid_stream_nftables",
    "root_conntrack_entry_deleted_mid_stream_iptables",
    "root_conntrack_entry_deleted_mid_stream_nftables",
    "root_conntrack_out_of_window_mid_stream_nftables",
];

/// established_more.rs's tests recorded beside [`ESTABLISHED`]'s (issue 22;
/// the listen queue's overflow, a reset right after the handshake).
pub const ESTABLISHED_MORE: &[&str] = &[
    "root_stale_tcp_entry_mid_flow_iptables",
    "root_stale_tcp_entry_mid_flow_nftables",
    "root_listen_queue_overflow_resets_after_the_handshake_iptables",
];

/// conntrack_snat.rs's real SNAT port collision (issue 22).
pub const CONNTRACK: &[&str] = &["root_snat_port_collision_is_an_insert_failure"];

/// `cargo xtask fixtures`: runs the seed scenarios' root lab tests on this
/// kernel with `--write` into [`recorded_dir`] (`NAME.rec`), and the
/// established-flow tests into [`established_dir`], then writes each
/// recording's `nattrace analyze NAME.rec --output json -v` next to it
/// (`NAME.json`), which the collector's tests compare against.
pub fn fixtures() -> anyhow::Result<()> {
    if !setup::is_root() {
        bail!("fixtures runs the root lab tests (network namespaces, eBPF): run it as root");
    }
    let seeds = recorded_dir();
    let established = established_dir();
    let mut runs: Vec<(&str, &Path, Vec<&str>)> = ["tracer", "scenarios"]
        .into_iter()
        .map(|binary| {
            let tests = RECORDED
                .iter()
                .filter(|(b, _)| *b == binary)
                .map(|(_, t)| *t)
                .collect();
            (binary, seeds.as_path(), tests)
        })
        .collect();
    runs.push(("established", established.as_path(), ESTABLISHED.to_vec()));
    runs.push((
        "established_more",
        established.as_path(),
        ESTABLISHED_MORE.to_vec(),
    ));
    let conntrack = conntrack_dir();
    runs.push(("conntrack_snat", conntrack.as_path(), CONNTRACK.to_vec()));
    for (binary, dir, tests) in &runs {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let dir_arg = dir.display().to_string();
        let mut args = vec![
            "test",
            "-p",
            "nattrace-tests",
            "--test",
            binary,
            "--",
            "--exact",
            "--test-threads",
            "1",
        ];
        args.extend(tests.iter().copied());
        cargo_with_env(&args, &[("NATTRACE_RECORD_DIR", &dir_arg)])?;
    }
    cargo(&["build", "--bin", "nattrace"])?;
    let nattrace = workspace_root().join("target/debug/nattrace");
    for (_, dir, tests) in &runs {
        for name in tests {
            write_golden(&nattrace, &dir.join(format!("{name}.rec")))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::IMAGE_TESTS;
    use crate::workspace::workspace_root;

    /// `test` keeps the image's tests out of the main run by a name filter
    /// (a substring, in every test binary): each of tests/tests/image.rs's
    /// tests must carry the prefix (else it runs before the image exists),
    /// and no other test may (else it never runs).
    #[test]
    fn only_the_image_tests_carry_their_prefix() {
        let image = std::fs::read_to_string(workspace_root().join("tests/tests/image.rs")).unwrap();
        let names: Vec<&str> = image
            .split("#[test]")
            .skip(1)
            .filter_map(|after| after.split("fn ").nth(1)?.split('(').next())
            .collect();
        assert!(names.len() >= 2, "{names:?}");
        for n in &names {
            assert!(n.starts_with(IMAGE_TESTS), "tests/tests/image.rs: {n}");
        }
        let mut others = Vec::new();
        for dir in [
            "tests/tests",
            "tests/src",
            "tracer-userspace/src",
            "tracer-userspace/tests",
            "xtask/src",
        ] {
            rust_files(&workspace_root().join(dir), &mut others);
        }
        for f in others
            .iter()
            .filter(|f| !f.ends_with("tests/tests/image.rs"))
        {
            let text = std::fs::read_to_string(f).unwrap();
            assert!(
                !text.contains(&format!("fn {IMAGE_TESTS}")),
                "{}: a test named {IMAGE_TESTS}* outside tests/tests/image.rs would never run",
                f.display()
            );
        }
    }

    fn rust_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                rust_files(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
}
