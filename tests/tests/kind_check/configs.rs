//! Offline validation of what only GitHub and kind run: the workflow
//! (check-jsonschema's built-in, vendored GitHub workflow schema), all of the
//! project's YAML (yamllint with `.yamllint`), the kind cluster configs (our
//! own schema `ci/kind/kind-cluster.schema.json`, plus each file's fields
//! against its name and the workflow's matrix), the pod/Service manifests
//! (kubernetes-validate, strict, against the kind node's Kubernetes), the
//! bridge CNI config, and the scripts (shellcheck). Each validator is also
//! shown a broken copy and must reject it, so none of these can pass by not
//! checking. The tools come from `cargo xtask setup` (Debian and PyPI).

use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

use super::repo;

/// The Kubernetes of the kind node image the cluster configs pin.
const KUBERNETES_VERSION: &str = "1.33.0";
const CLUSTER_NAME: &str = "nattrace";

/// Runs `program args` and returns its output; a missing tool is a failure
/// that says how to get it. As root the tool runs in a fresh network
/// namespace with only loopback (`unshare --net`), which proves that the
/// check needs no network (the schemas are bundled).
fn run(program: &str, args: &[&str]) -> Output {
    let mut cmd = if lab::is_root() {
        let mut c = Command::new("unshare");
        c.args(["--net", program]);
        c
    } else {
        Command::new(program)
    };
    cmd.args(args).current_dir(repo());
    match cmd.output() {
        Ok(out) if lab::is_root() && out.status.code() == Some(127) => {
            panic!("{program} not found: run `cargo xtask setup` (it installs it)")
        }
        Ok(out) => out,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            panic!("{program} not found: run `cargo xtask setup` (it installs it)")
        }
        Err(e) => panic!("running {program}: {e}"),
    }
}

fn describe(out: &Output) -> String {
    format!(
        "{}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn assert_passes(program: &str, args: &[&str]) {
    let out = run(program, args);
    assert!(
        out.status.success(),
        "{program} {}: {}",
        args.join(" "),
        describe(&out)
    );
}

fn assert_rejects(program: &str, args: &[&str], why: &str) {
    let out = run(program, args);
    assert!(
        !out.status.success(),
        "{program} accepted {why}: {}",
        describe(&out)
    );
}

/// A scratch directory of this test process, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("nattrace-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("creating a scratch directory");
        Scratch(dir)
    }

    /// Writes `file` (a repository path) into the scratch directory with
    /// `from` replaced by `to`, which must occur in it.
    fn broken_copy(&self, file: &str, from: &str, to: &str) -> String {
        let text = read(file);
        assert!(text.contains(from), "{file} no longer contains {from:?}");
        let name = Path::new(file).file_name().expect("a file name");
        let path = self.0.join(name);
        fs::write(&path, text.replacen(from, to, 1)).expect("writing a broken copy");
        path.to_string_lossy().into_owned()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn read(file: &str) -> String {
    fs::read_to_string(repo().join(file)).unwrap_or_else(|e| panic!("reading {file}: {e}"))
}

/// Every YAML document of `file` as JSON, parsed by PyYAML (which yamllint
/// brings): the test crate has no YAML parser of its own.
fn yaml_documents(file: &str) -> Vec<Value> {
    let out = Command::new("/usr/bin/python3")
        .args([
            "-c",
            "import json, sys, yaml; json.dump(list(yaml.safe_load_all(open(sys.argv[1]))), sys.stdout)",
        ])
        .arg(repo().join(file))
        .output()
        .expect("running python3 (cargo xtask setup installs it with PyYAML)");
    assert!(out.status.success(), "parsing {file}: {}", describe(&out));
    serde_json::from_slice(&out.stdout).expect("PyYAML's JSON")
}

fn files(dir: &str, suffix: &str) -> Vec<String> {
    let mut found: Vec<String> = fs::read_dir(repo().join(dir))
        .unwrap_or_else(|e| panic!("listing {dir}: {e}"))
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(suffix))
        .map(|n| format!("{dir}/{n}"))
        .collect();
    found.sort();
    found
}

#[test]
fn workflows_match_the_github_workflow_schema() {
    let workflows = files(".github/workflows", ".yml");
    assert!(!workflows.is_empty(), "no workflow found");
    let mut args = vec!["--builtin-schema", "vendor.github-workflows"];
    args.extend(workflows.iter().map(String::as_str));
    assert_passes("check-jsonschema", &args);

    let scratch = Scratch::new("workflow");
    let broken = scratch.broken_copy(".github/workflows/kind.yml", "runs-on:", "runs_on:");
    assert_rejects(
        "check-jsonschema",
        &["--builtin-schema", "vendor.github-workflows", &broken],
        "a job without runs-on",
    );
}

#[test]
fn yaml_passes_yamllint() {
    assert_passes(
        "yamllint",
        &["--strict", "-c", ".yamllint", ".yamllint", ".github", "ci"],
    );
    let scratch = Scratch::new("yamllint");
    let broken = scratch.broken_copy(
        "ci/kind/workload.yaml",
        "  name: backend",
        "   name: backend",
    );
    assert_rejects(
        "yamllint",
        &["--strict", "-c", ".yamllint", &broken],
        "mis-indented YAML",
    );
}

/// Each `ci/kind/cluster-<cni>-<proxy>.yaml` matches the kind schema, says in
/// its fields what its name says, and the workflow's matrix runs exactly
/// these files (ci/kind/run.sh picks `cluster-$CNI-$PROXY_MODE.yaml`).
#[test]
fn kind_configs_match_their_schema_names_and_the_matrix() {
    let configs = files("ci/kind", ".yaml");
    let configs: Vec<&String> = configs
        .iter()
        .filter(|f| f.starts_with("ci/kind/cluster-"))
        .collect();
    let mut args = vec!["--schemafile", "ci/kind/kind-cluster.schema.json"];
    args.extend(configs.iter().map(|s| s.as_str()));
    assert_passes("check-jsonschema", &args);

    let workflow = &yaml_documents(".github/workflows/kind.yml")[0];
    let matrix = &workflow["jobs"]["kind"]["strategy"]["matrix"];
    let names = |key: &str| -> Vec<String> {
        matrix[key]
            .as_array()
            .unwrap_or_else(|| panic!("matrix.{key} is not a list: {matrix}"))
            .iter()
            .map(|v| v.as_str().expect("a string").to_string())
            .collect()
    };
    let (cnis, proxies) = (names("cni"), names("proxy"));
    assert_eq!(cnis, ["bridge", "kindnet"]);
    assert_eq!(proxies, ["iptables", "nftables"]);
    let mut expected = Vec::new();
    for cni in &cnis {
        for proxy in &proxies {
            let file = format!("ci/kind/cluster-{cni}-{proxy}.yaml");
            let config = &yaml_documents(&file)[0];
            let net = &config["networking"];
            assert_eq!(net["disableDefaultCNI"], cni == "bridge", "{file}: {net}");
            assert_eq!(net["kubeProxyMode"], proxy.as_str(), "{file}: {net}");
            assert_eq!(config["name"], CLUSTER_NAME, "{file}");
            // The node's Kubernetes is the one the manifests are validated for.
            let image = config["nodes"][0]["image"].as_str().unwrap_or_default();
            let minor = KUBERNETES_VERSION.rsplit_once('.').expect("x.y.z").0;
            assert!(
                image.starts_with(&format!("kindest/node:v{minor}.")) && image.contains("@sha256:"),
                "{file}: node image {image:?} is not a digest-pinned Kubernetes {minor}"
            );
            expected.push(file);
        }
    }
    let mut found: Vec<String> = configs.into_iter().cloned().collect();
    found.sort();
    expected.sort();
    assert_eq!(
        found, expected,
        "cluster configs the matrix does not run (or lacks)"
    );

    let scratch = Scratch::new("kindcfg");
    let broken = scratch.broken_copy(
        "ci/kind/cluster-bridge-nftables.yaml",
        "kubeProxyMode: nftables",
        "kubeProxyMode: ipvs",
    );
    assert_rejects(
        "check-jsonschema",
        &["--schemafile", "ci/kind/kind-cluster.schema.json", &broken],
        "kube-proxy in IPVS mode (nattrace does not judge IPVS NAT)",
    );
    let broken = scratch.broken_copy(
        "ci/kind/cluster-kindnet-iptables.yaml",
        "disableDefaultCNI:",
        "disableDefaultCni:",
    );
    assert_rejects(
        "check-jsonschema",
        &["--schemafile", "ci/kind/kind-cluster.schema.json", &broken],
        "a misspelt field (kind decodes strictly)",
    );
}

/// The manifests are valid Kubernetes 1.33 objects, strictly, and say what
/// the check relies on: both pods pinned to the one node, the Service
/// selecting the backend on port 80.
#[test]
fn manifests_are_valid_and_put_both_pods_on_one_node() {
    let args = [
        "--strict",
        "--quiet",
        "-k",
        KUBERNETES_VERSION,
        "ci/kind/workload.yaml",
    ];
    assert_passes("kubernetes-validate", &args);

    let docs = yaml_documents("ci/kind/workload.yaml");
    let by_name = |kind: &str, name: &str| -> &Value {
        docs.iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name} in ci/kind/workload.yaml"))
    };
    let node = format!("{CLUSTER_NAME}-control-plane");
    for pod in ["client", "backend"] {
        let spec = &by_name("Pod", pod)["spec"];
        assert_eq!(
            spec["nodeSelector"]["kubernetes.io/hostname"], node,
            "pod {pod} is not pinned to {node}"
        );
    }
    let service = by_name("Service", "web");
    let backend = by_name("Pod", "backend");
    for (key, value) in service["spec"]["selector"].as_object().expect("a selector") {
        assert_eq!(&backend["metadata"]["labels"][key], value, "selector {key}");
    }
    // ci/kind/run.sh hands the check `<cluster IP>:80`.
    assert_eq!(service["spec"]["ports"][0]["port"], 80);

    let scratch = Scratch::new("manifest");
    let broken = scratch.broken_copy("ci/kind/workload.yaml", "nodeSelector:", "nodeSelectr:");
    assert_rejects(
        "kubernetes-validate",
        &["--strict", "--quiet", "-k", KUBERNETES_VERSION, &broken],
        "an unknown pod field",
    );
}

/// The CNI config ci/kind/run.sh writes to the node: the reference bridge
/// plugin on cni0 (the bridge seed 000's reply crosses), IPAM over the
/// node's pod CIDR, which run.sh substitutes.
#[test]
fn bridge_cni_config_puts_pods_on_cni0() {
    let text = read("ci/kind/cni-bridge.conflist");
    let config: Value = serde_json::from_str(&text).expect("cni-bridge.conflist is JSON");
    let bridge = &config["plugins"][0];
    assert_eq!(bridge["type"], "bridge");
    assert_eq!(bridge["bridge"], "cni0");
    assert_eq!(bridge["isGateway"], true);
    assert_eq!(bridge["ipam"]["type"], "host-local");
    assert_eq!(bridge["ipam"]["ranges"][0][0]["subnet"], "@POD_CIDR@");
    assert!(read("ci/kind/run.sh").contains("s|@POD_CIDR@|"));
}

#[test]
fn kind_scripts_pass_shellcheck() {
    let scripts = files("ci/kind", ".sh");
    assert!(scripts.len() >= 2, "{scripts:?}");
    let mut args = vec!["--severity=info"];
    args.extend(scripts.iter().map(String::as_str));
    assert_passes("shellcheck", &args);

    let scratch = Scratch::new("shellcheck");
    let broken = scratch.broken_copy(
        "ci/kind/check-seed000.sh",
        "node test -x \"$NATTRACE\"",
        "node test -x $NATTRACE",
    );
    assert_rejects("shellcheck", &[&broken], "an unquoted expansion");
}
