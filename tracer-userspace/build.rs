use anyhow::{Context as _, anyhow};
use aya_build::Toolchain;

/// Builds the eBPF object with the nightly toolchain and bpf-linker; the binary embeds it.
fn main() -> anyhow::Result<()> {
    let cargo_metadata::Metadata {
        packages,
        target_directory,
        ..
    } = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("MetadataCommand::exec")?;
    let ebpf_package = packages
        .into_iter()
        .find(|cargo_metadata::Package { name, .. }| name.as_str() == "tracer-ebpf")
        .ok_or_else(|| anyhow!("tracer-ebpf package not found"))?;
    let cargo_metadata::Package {
        name,
        manifest_path,
        ..
    } = ebpf_package;
    let root_dir = manifest_path
        .parent()
        .ok_or_else(|| anyhow!("no parent for {manifest_path}"))?;
    let ebpf_package = aya_build::Package {
        name: name.as_str(),
        root_dir: root_dir.as_str(),
        ..Default::default()
    };
    share_ebpf_target_dir(name.as_str(), target_directory.as_std_path())?;
    // aya-build re-emits every line the nested cargo writes to stderr as a
    // build-script warning, so its progress ("Compiling core …") drowned a
    // newcomer's first `cargo xtask demo` in 40 warnings. Quiet cargo still
    // reports errors, and compiler warnings arrive through its JSON stdout.
    // SAFETY: the build script is single-threaded here.
    unsafe { std::env::set_var("CARGO_TERM_QUIET", "true") };
    aya_build::build_ebpf([ebpf_package], Toolchain::default())
}

/// Points aya-build's per-OUT_DIR target directory at one shared directory,
/// `target/ebpf`. aya-build gives each of our build script's runs (dev, test,
/// release, musl: one per profile and target) its own nested target
/// directory, so a clean `cargo xtask test` compiled core and the eBPF crate
/// four times, over a minute each on 2 cores. The nested cargo's flags are
/// the same in every run, so a shared directory is rebuilt only when the
/// kernel crate changes; its own lock serialises concurrent runs.
fn share_ebpf_target_dir(name: &str, target_directory: &std::path::Path) -> anyhow::Result<()> {
    let out_dir = std::path::PathBuf::from(std::env::var_os("OUT_DIR").context("OUT_DIR not set")?);
    // Where aya-build 0.2.0 puts it (its `--target-dir`).
    let nested = out_dir.join("aya-build").join("target");
    let link = nested.join(name);
    let shared = target_directory.join("ebpf");
    std::fs::create_dir_all(&nested).with_context(|| format!("creating {}", nested.display()))?;
    std::fs::create_dir_all(&shared).with_context(|| format!("creating {}", shared.display()))?;
    if std::fs::read_link(&link).is_ok_and(|t| t == shared) {
        return Ok(());
    }
    match std::fs::symlink_metadata(&link) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(&link),
        Ok(_) => std::fs::remove_file(&link),
        Err(_) => Ok(()),
    }
    .with_context(|| format!("removing {}", link.display()))?;
    std::os::unix::fs::symlink(&shared, &link)
        .with_context(|| format!("linking {} to {}", link.display(), shared.display()))
}
