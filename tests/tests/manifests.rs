//! deploy/ validated offline: every Kubernetes object against the API
//! schemas `kubernetes-validate` (PyPI, `cargo xtask setup`) carries, in
//! strict mode (unknown fields fail); the ServiceMonitor, a CRD with no
//! schema there, by structure; and the objects against each other
//! (`manifests/check.py`). No root, no cluster.

use std::path::PathBuf;
use std::process::Command;

fn deploy() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn yaml_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(deploy())
        .expect("deploy/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

/// The Kubernetes version the schemas are taken from (the oldest release
/// still supported upstream when this was written, so the manifests work
/// on it and everything newer).
const KUBERNETES_VERSION: &str = "1.32.0";

#[test]
fn deploy_manifests_match_the_kubernetes_schemas() {
    if Command::new("kubernetes-validate")
        .arg("--version")
        .output()
        .is_err()
    {
        println!("skipped: kubernetes-validate is not installed (cargo xtask setup installs it)");
        return;
    }
    let files = yaml_files();
    assert!(files.len() >= 3, "{files:?}");
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        if text.contains("kind: ServiceMonitor") {
            // No schema for a CRD offline: check.py checks it by structure.
            continue;
        }
        let out = Command::new("kubernetes-validate")
            .args(["--strict", "-k", KUBERNETES_VERSION])
            .arg(file)
            .output()
            .expect("running kubernetes-validate");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{}: {said}", file.display());
        assert!(said.contains("passed"), "{}: {said}", file.display());
        assert!(!said.contains("WARN"), "{}: {said}", file.display());
    }
    let out = Command::new("python3")
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/manifests/check.py"))
        .args(&files)
        .output()
        .expect("running python3");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The DaemonSet's container arguments are ones this build accepts: run
/// with them and a namespace that does not exist, nattrace gets past
/// argument parsing (clap would say "unexpected argument") to its own
/// check of the namespace (or, not root, of root), which fails before
/// anything is attached.
#[test]
fn daemonset_args_are_accepted_by_this_build() {
    let text = std::fs::read_to_string(deploy().join("daemonset.yaml")).unwrap();
    let mut lines = text.lines().skip_while(|l| l.trim() != "args:").skip(1);
    let args: Vec<String> = lines
        .by_ref()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .take_while(|l| l.starts_with("- "))
        .map(|l| l.trim_start_matches("- ").trim_matches('"').to_owned())
        .collect();
    assert!(
        args.iter().any(|a| a == "--all-services") && args.iter().any(|a| a == "--hide-ok"),
        "{args:?}"
    );
    let out = Command::new(lab::tracer::nattrace())
        .args(&args)
        .args(["--netns", "/nonexistent/nattrace-manifest-check"])
        .output()
        .expect("running nattrace");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    // Not root: the root check comes first, also past the parsing.
    assert!(
        stderr.contains("no network namespace") || stderr.contains("needs root"),
        "{args:?}: {stderr}"
    );
    assert!(!stderr.contains("argument"), "{args:?}: {stderr}");
}
