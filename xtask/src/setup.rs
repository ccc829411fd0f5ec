//! `cargo xtask setup`: install what a fresh machine lacks, and nothing twice.
//!
//! Every step checks first and only then installs, so a second run takes
//! seconds. A step that cannot complete stops setup with the name of the
//! missing piece.
use std::process::Command;

use anyhow::{Context as _, bail};

use crate::vm;

/// Debian packages the build, the lab and the tests use.
const APT_PACKAGES: &[&str] = &[
    // bpf-linker links against LLVM 22, the nightly toolchain's LLVM.
    "llvm-22-dev",
    "libpolly-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    // the lab and the tests
    "iproute2",
    "iptables",
    "nftables",
    "conntrack",
    "curl",
    "python3",
    "dnsutils",
    "tcpdump",
    "tshark",
    // GNU time: a child's own peak RSS (tracer-userspace/tests/analyze_memory.rs)
    "time",
    "iperf3",
    "kmod",
    // cargo xtask image, and its test (tests/tests/image.rs)
    "buildah",
    // the kind CI check (ci/kind) and the offline checks of its workflow and configs
    "jq",
    "shellcheck",
    "yamllint",
    "python3-venv",
    // promtool, which checks the metrics exposition (tests/tests/watch.rs)
    "prometheus",
    // `cargo xtask bench` profiles with perf record (cpu-clock: no PMU in these VMs)
    "linux-perf",
    // `cargo xtask bench`'s counting measure of the process's cost per
    // connection (callgrind on `analyze` of a recorded run: no clock noise)
    "valgrind",
    // the root tests are proved under load beside `stress-ng --cpu 2` (issue 26)
    "stress-ng",
    // the lab's containerd nodes (tests/src/cri.rs): pods through the CRI,
    // wired by the CNI bridge plugin; a static pause built with cc
    "containerd",
    "runc",
    "containernetworking-plugins",
    "libc6-dev",
    // k8s-cri's build compiles the CRI's .proto (nattrace reads the CRI)
    "protobuf-compiler",
];

/// Where the PyPI tools live: a venv of Debian's python3 (its pip refuses
/// system-wide installs, PEP 668), with their commands linked into /usr/local/bin.
const PYTOOLS_VENV: &str = "/opt/nattrace-pytools";

/// PyPI packages (pinned: their bundled schemas are what the checks check
/// against) and the command each provides.
const PYPI_TOOLS: &[(&str, &str, &str)] = &[
    // .github/workflows against its built-in, vendored (offline) schema
    ("check-jsonschema", "0.39.0", "check-jsonschema"),
    // Kubernetes manifests against the API's schemas, bundled (offline)
    ("kubernetes-validate", "1.37.0", "kubernetes-validate"),
];

const BPF_LINKER_VERSION: &str = "0.13.0";
const NIGHTLY: &str = "nightly";

pub fn run() -> anyhow::Result<()> {
    let mut packages: Vec<&str> = APT_PACKAGES.to_vec();
    packages.extend_from_slice(vm::deps::APT_PACKAGES);
    if is_root() {
        apt_install(&packages)?;
        apt_lists_know_guest_kernels()?;
    } else {
        // Only the Debian packages need root; the Rust toolchain pieces
        // below install into the user's rustup and cargo homes.
        let missing = missing_packages(&packages);
        if missing.is_empty() {
            eprintln!("setup: {} Debian packages present", packages.len());
        } else {
            eprintln!(
                "setup: not root, skipping the apt step; missing Debian packages: {} (run `sudo cargo xtask setup` once)",
                missing.join(" ")
            );
        }
    }
    nightly_with_rust_src()?;
    rustup_targets(vm::deps::RUSTUP_TARGETS)?;
    bpf_linker()?;
    pypi_tools()?;
    eprintln!("setup: everything present");
    Ok(())
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn output_of(program: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn run_checked(cmd: &mut Command, what: &str) -> anyhow::Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("setup: could not start {what}"))?;
    if !status.success() {
        bail!("setup: {what} failed ({status})");
    }
    Ok(())
}

fn missing_packages<'a>(packages: &[&'a str]) -> Vec<&'a str> {
    packages
        .iter()
        .copied()
        .filter(|p| {
            output_of("dpkg-query", &["-W", "-f=${Status}", p])
                .is_none_or(|s| !s.contains("install ok installed"))
        })
        .collect()
}

fn apt_install(packages: &[&str]) -> anyhow::Result<()> {
    let missing = missing_packages(packages);
    if missing.is_empty() {
        eprintln!("setup: {} Debian packages present", packages.len());
        return Ok(());
    }
    eprintln!("setup: installing Debian packages: {}", missing.join(" "));
    run_checked(
        Command::new("apt-get").args(["update", "-q"]),
        "apt-get update",
    )?;
    run_checked(
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
        &format!("apt-get install {}", missing.join(" ")),
    )
}

/// vm-test fetches the guest kernels with `apt-get download`, which needs
/// package lists; a machine whose packages were all present never ran
/// `apt-get update` above, and a new image may ship without lists.
fn apt_lists_know_guest_kernels() -> anyhow::Result<()> {
    let known = output_of(
        "apt-cache",
        &["search", "--names-only", "^linux-image-6\\.1"],
    )
    .is_some_and(|out| out.lines().any(|l| l.starts_with("linux-image-6.1")));
    if known {
        return Ok(());
    }
    eprintln!("setup: apt lists know no guest kernel packages; running apt-get update");
    run_checked(
        Command::new("apt-get").args(["update", "-q"]),
        "apt-get update",
    )
}

fn nightly_with_rust_src() -> anyhow::Result<()> {
    let toolchains = output_of("rustup", &["toolchain", "list"])
        .context("setup: rustup not found; nattrace builds need rustup's stable and nightly")?;
    if !toolchains.lines().any(|l| l.starts_with(NIGHTLY)) {
        eprintln!("setup: installing the nightly toolchain (builds the eBPF crate)");
        run_checked(
            Command::new("rustup").args(["toolchain", "install", NIGHTLY, "--profile", "minimal"]),
            "rustup toolchain install nightly",
        )?;
    }
    let components = output_of(
        "rustup",
        &["component", "list", "--installed", "--toolchain", NIGHTLY],
    )
    .unwrap_or_default();
    if !components.lines().any(|l| l.starts_with("rust-src")) {
        eprintln!("setup: adding rust-src to nightly (build-std for bpfel-unknown-none)");
        run_checked(
            Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", NIGHTLY]),
            "rustup component add rust-src --toolchain nightly",
        )?;
    }
    Ok(())
}

fn rustup_targets(targets: &[&str]) -> anyhow::Result<()> {
    let installed = output_of("rustup", &["target", "list", "--installed"]).unwrap_or_default();
    for target in targets {
        if !installed.lines().any(|l| l.trim() == *target) {
            eprintln!("setup: adding rust target {target}");
            run_checked(
                Command::new("rustup").args(["target", "add", target]),
                &format!("rustup target add {target}"),
            )?;
        }
    }
    Ok(())
}

fn bpf_linker() -> anyhow::Result<()> {
    if output_of("bpf-linker", &["--version"]).is_some_and(|v| v.contains(BPF_LINKER_VERSION)) {
        return Ok(());
    }
    eprintln!("setup: building bpf-linker {BPF_LINKER_VERSION} against LLVM 22 (about a minute)");
    let path = format!(
        "/usr/lib/llvm-22/bin:{}",
        std::env::var("PATH").unwrap_or_default()
    );
    run_checked(
        Command::new("cargo")
            .args([
                "install",
                "bpf-linker",
                "--version",
                BPF_LINKER_VERSION,
                "--no-default-features",
                "--features",
                "llvm-22",
            ])
            .env("PATH", path),
        "cargo install bpf-linker (needs llvm-22-dev)",
    )?;
    if output_of("bpf-linker", &["--version"]).is_none() {
        bail!("setup: bpf-linker installed but not on PATH: add ~/.cargo/bin to PATH");
    }
    Ok(())
}

fn pypi_tools() -> anyhow::Result<()> {
    let venv = std::path::Path::new(PYTOOLS_VENV);
    let pip = venv.join("bin/pip");
    if !pip.exists() {
        eprintln!("setup: creating the PyPI tools venv {PYTOOLS_VENV}");
        // Debian's python3 by path: a pyenv shim first on PATH is another python.
        run_checked(
            Command::new("/usr/bin/python3").args(["-m", "venv", PYTOOLS_VENV]),
            "python3 -m venv (needs python3-venv)",
        )?;
    }
    let pip = pip.to_string_lossy();
    for (package, version, command) in PYPI_TOOLS {
        let shown = output_of(&pip, &["show", package]).unwrap_or_default();
        if !shown.lines().any(|l| l == format!("Version: {version}")) {
            eprintln!("setup: installing {package} {version} from PyPI");
            run_checked(
                Command::new(&*pip).args(["install", "-q", &format!("{package}=={version}")]),
                &format!("pip install {package}=={version}"),
            )?;
        }
        let link = std::path::Path::new("/usr/local/bin").join(command);
        let target = venv.join("bin").join(command);
        if std::fs::read_link(&link).ok().as_deref() != Some(target.as_path()) {
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(&target, &link)
                .with_context(|| format!("setup: linking {}", link.display()))?;
        }
    }
    Ok(())
}
