//! `cargo xtask image`: an OCI image of the static nattrace binary, built
//! with buildah from scratch (no registry, no base image, works offline).
//!
//! The image is nattrace plus the programs it runs to read kube-proxy's
//! rules (`iptables-nft-save`, `iptables-legacy-save`, `nft`; `ip` for
//! IPVS detection), copied from this machine's Debian packages with the
//! shared libraries they load: without them a scratch image's `doctor`
//! would find no rules on a node full of them. Everything else comes from
//! the node through mounts (see deploy/ and README "On a cluster").
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, Result, bail};

use crate::vm::{self, initramfs::Tree};

/// Where the entrypoint lives; PATH covers it and the tools.
const BIN: &str = "/usr/bin/nattrace";

/// What nattrace runs (tracer-userspace/src/ruleset/mod.rs, ruleset/dataplane.rs).
const TOOLS: &[&str] = &[
    "/usr/sbin/xtables-nft-multi",
    "/usr/sbin/xtables-legacy-multi",
    "/usr/sbin/nft",
    "/usr/sbin/ip",
];

/// The tag `cargo xtask image` gives by default (and the image test uses).
pub const DEFAULT_TAG: &str = "localhost/nattrace:dev";

#[derive(clap::Args)]
pub struct ImageArgs {
    /// Image name and tag.
    #[arg(long, default_value = DEFAULT_TAG)]
    pub tag: String,
    /// Also write the image as an OCI archive (for `podman load`, `kind load
    /// image-archive`, `ctr image import`, or `skopeo copy` to a registry).
    #[arg(long, value_name = "FILE")]
    pub archive: Option<PathBuf>,
}

impl Default for ImageArgs {
    fn default() -> Self {
        ImageArgs {
            tag: DEFAULT_TAG.to_string(),
            archive: None,
        }
    }
}

/// A buildah working container, removed however the build ends.
struct Working(String);

impl Drop for Working {
    fn drop(&mut self) {
        let _ = Command::new("buildah")
            .args(["rm", &self.0])
            .stdout(std::process::Stdio::null())
            .status();
    }
}

fn buildah(args: &[&str]) -> Result<String> {
    let out = Command::new("buildah")
        .args(args)
        .output()
        .context("running buildah (cargo xtask setup installs it)")?;
    if !out.status.success() {
        bail!(
            "buildah {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

pub fn run(args: ImageArgs) -> Result<()> {
    // The same cargo call as vm-test's, so CI compiles the musl binaries once.
    let bins: Vec<String> = vm::PAYLOAD_BINS.iter().map(|b| b.to_string()).collect();
    let built = vm::build_payload(&bins)?;
    let nattrace = built
        .iter()
        .find(|p| p.file_name().is_some_and(|n| n == "nattrace"))
        .context("PAYLOAD_BINS builds nattrace")?;
    let tree = rootfs(nattrace)?;

    let working = Working(buildah(&["from", "scratch"])?);
    let root = PathBuf::from(buildah(&["mount", &working.0])?);
    tree.write_under(&root)?;
    // Mount points the runtime or `kubectl debug` fills; /tmp for --write.
    for dir in ["proc", "sys", "run/netns", "host", "tmp"] {
        std::fs::create_dir_all(root.join(dir))?;
    }
    std::fs::set_permissions(
        root.join("tmp"),
        std::os::unix::fs::PermissionsExt::from_mode(0o1777),
    )?;
    buildah(&["umount", &working.0])?;
    configure(&working.0)?;
    let previous = buildah(&["images", "--quiet", "--no-trunc", &args.tag]).ok();
    buildah(&[
        "commit", "--quiet", "--format", "oci", &working.0, &args.tag,
    ])?;
    // The tag moved: drop the image it named, so rebuilds do not pile up
    // (only that one: the image storage is the machine's, not ours).
    if let Some(old) = previous.filter(|p| !p.is_empty())
        && buildah(&["images", "--quiet", "--no-trunc", &args.tag]).ok() != Some(old.clone())
    {
        let _ = buildah(&["rmi", &old]);
    }
    if let Some(archive) = &args.archive {
        let _ = std::fs::remove_file(archive);
        buildah(&[
            "push",
            "--quiet",
            &args.tag,
            &format!("oci-archive:{}:{}", archive.display(), args.tag),
        ])?;
        eprintln!("image: wrote {}", archive.display());
    }
    let size = buildah(&["images", "--format", "{{.Size}}", &args.tag]).unwrap_or_default();
    eprintln!("image: built {} ({size})", args.tag);
    Ok(())
}

/// nattrace and the tools it runs.
fn rootfs(nattrace: &Path) -> Result<Tree> {
    let mut t = Tree::default();
    let data =
        std::fs::read(nattrace).with_context(|| format!("reading {}", nattrace.display()))?;
    t.file(BIN, 0o755, data);
    vm::initramfs::add_host_tools(&mut t, TOOLS)?;
    // The user the process runs as has a name (iptables and nft look it up
    // only for messages, but a nameless uid 0 confuses operators' tools).
    t.file(
        "etc/passwd",
        0o644,
        b"root:x:0:0:root:/:/usr/bin/nattrace\n".to_vec(),
    );
    t.file("etc/group", 0o644, b"root:x:0:\n".to_vec());
    Ok(t)
}

fn configure(working: &str) -> Result<()> {
    let revision = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(crate::workspace::workspace_root())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".to_string());
    let created = Command::new("date")
        .args(["-u", "+%Y-%m-%dT%H:%M:%SZ"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let labels = [
        ("title", "nattrace".to_string()),
        (
            "description",
            "eBPF tracer of Kubernetes Service NAT on a node: per connection, whether the reply came back reverse-NATed, and why not".to_string(),
        ),
        ("version", env!("CARGO_PKG_VERSION").to_string()),
        ("revision", revision),
        ("created", created),
        ("licenses", "MIT OR Apache-2.0".to_string()),
        ("base.name", "scratch".to_string()),
    ];
    let mut args: Vec<String> = ["config", "--os", "linux", "--arch", "amd64"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for (key, value) in labels {
        args.push("--label".into());
        args.push(format!("org.opencontainers.image.{key}={value}"));
    }
    args.extend(
        [
            "--env",
            "PATH=/usr/bin:/usr/sbin",
            "--entrypoint",
            &format!("[\"{BIN}\"]"),
            // No arguments: the node's checks, then exit (nothing interactive).
            "--cmd",
            "[\"doctor\"]",
            "--workingdir",
            "/",
            working,
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    buildah(&args)?;
    Ok(())
}
