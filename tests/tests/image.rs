//! The container image (`cargo xtask image`) against a lab node: `doctor`
//! and a seed 000 trace, healthy and broken, run from the image's root
//! filesystem give the same findings and verdicts as the bare binary —
//! with kube-proxy's rules read by the iptables the image carries.
//!
//! `podman run` cannot start containers on these build machines (crun:
//! setrlimit RLIMIT_NOFILE EPERM, hybrid cgroups; docs/CONTAINERS.md), so
//! the image runs the way a privileged host-network container does, minus
//! the runtime: its root filesystem (`buildah mount`) under `unshare -m -p
//! -f` (own mount and PID namespaces, the host's network namespace) and
//! `chroot`, with /sys (BTF, bpffs), a fresh /proc and /run/netns mounted,
//! no /dev and the image's PATH. The broken node is traced by `--netns
//! PATH`; the healthy one from inside its namespace with no `--netns`, as
//! a container sharing the node's network (`hostNetwork`, `kubectl debug
//! node`) does. Both traces run at once on the node, one curl between them.
//!
//! Uses the image named by `$NATTRACE_IMAGE` (`cargo xtask test` builds it
//! first, in the same cargo call as vm-test's musl binaries), else builds
//! `localhost/nattrace:dev` with `cargo xtask image`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use lab::presets::{self, Backend, web_svc};
use lab::tracer::{Finished, Nattrace, nattrace, tracing_lock};
use lab::{Lab, build_lab};
use serde_json::Value;

const REPLY_TIMEOUT_MS: &str = "1000";
const ATTACH_TIMEOUT: Duration = Duration::from_secs(30);

fn buildah(args: &[&str]) -> String {
    let out = Command::new("buildah")
        .args(args)
        .output()
        .expect("running buildah");
    assert!(
        out.status.success(),
        "buildah {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The image's root filesystem, mounted; unmounted and removed on drop.
struct Rootfs {
    container: String,
    path: PathBuf,
}

impl Rootfs {
    fn mount(image: &str) -> Rootfs {
        let container = buildah(&["from", "--pull-never", image]);
        let path = PathBuf::from(buildah(&["mount", &container]));
        Rootfs { container, path }
    }
}

impl Drop for Rootfs {
    fn drop(&mut self) {
        let _ = Command::new("buildah")
            .args(["umount", &self.container])
            .output();
        let _ = Command::new("buildah")
            .args(["rm", &self.container])
            .output();
    }
}

fn image() -> String {
    if let Ok(image) = std::env::var("NATTRACE_IMAGE") {
        return image;
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let started = Instant::now();
    let status = Command::new(cargo)
        .args(["run", "-q", "-p", "xtask", "--", "image"])
        .current_dir(workspace)
        .status()
        .expect("running cargo xtask image");
    assert!(status.success(), "cargo xtask image failed");
    println!("cargo xtask image: {:.1?}", started.elapsed());
    "localhost/nattrace:dev".to_string()
}

/// How the container meets the node's network namespace.
#[derive(Clone, Copy, PartialEq)]
enum Network {
    /// Its own view of the host, tracing the node by `--netns PATH`.
    NetnsFlag,
    /// It shares the node's namespace (`hostNetwork`, `kubectl debug
    /// node`): started inside it by `ip netns exec` (which also mounts
    /// that namespace's sysfs, as a runtime does), traced with no `--netns`.
    Shared,
}

/// Program and arguments that run the image's entrypoint with `args` the
/// way a privileged container would. No /dev: nattrace needs none.
fn in_image(lab: &Lab, root: &Path, network: Network, args: &[String]) -> (String, Vec<String>) {
    let script = r#"R=$1; shift
mount --rbind /sys "$R/sys" && mount -t proc proc "$R/proc" &&
mount --rbind /run/netns "$R/run/netns" &&
exec env -i PATH=/usr/bin:/usr/sbin chroot "$R" /usr/bin/nattrace "$@""#;
    let mut v: Vec<String> = ["-m", "-p", "-f", "--kill-child", "sh", "-c", script, "sh"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.push(root.display().to_string());
    match network {
        Network::NetnsFlag => {
            v.extend(args.iter().cloned());
            ("unshare".into(), v)
        }
        Network::Shared => {
            let ns = node_ns(lab);
            let name = Path::new(&ns).file_name().unwrap().to_string_lossy();
            v.extend(without_netns(args));
            let mut ip: Vec<String> = ["netns", "exec", &name, "unshare"]
                .iter()
                .map(|s| s.to_string())
                .collect();
            ip.extend(v);
            ("ip".into(), ip)
        }
    }
}

/// `args` minus `--netns X`.
fn without_netns(args: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--netns" {
            it.next();
        } else {
            out.push(a.clone());
        }
    }
    out
}

fn node_ns(lab: &Lab) -> String {
    lab.node_netns(presets::NODE_A)
        .expect("node a")
        .path()
        .display()
        .to_string()
}

fn doctor_json(program: &str, args: &[String]) -> Value {
    let out = Command::new(program)
        .args(args)
        .output()
        .expect("running doctor");
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.trim()).unwrap_or_else(|e| {
        panic!(
            "{program} {args:?}: {e}: {text} {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// (check, severity, value) of every finding: what doctor concluded.
fn conclusions(report: &Value) -> Vec<(String, String, String)> {
    report["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .map(|f| {
            let s = |k: &str| f[k].as_str().unwrap_or_default().to_string();
            // The conntrack count is a live reading: the two doctors run
            // moments apart while the lab's last connections expire.
            let value = match s("check").as_str() {
                "conntrack" => "conntrack=<count>".to_string(),
                _ => s("value"),
            };
            (s("check"), s("severity"), value)
        })
        .collect()
}

/// Client port, verdict and cause of every flow.
fn verdicts(done: &Finished) -> Vec<(String, String, String)> {
    let mut v: Vec<_> = done
        .flows()
        .unwrap_or_else(|e| panic!("{e:#}\n{}", done.describe()))
        .iter()
        .map(|f| {
            let s = |k: &str| f[k].as_str().unwrap_or("-").to_string();
            (s("client"), s("verdict"), s("cause"))
        })
        .collect();
    v.sort();
    v
}

/// Traces the lab's web Service with the bare binary and the image at
/// once (two instances on one node are supported), curls it once, and
/// returns both outputs once the curl's flow is decided.
fn trace_both(lab: &Lab, root: &Path, network: Network) -> (Finished, Finished) {
    let args: Vec<String> = [
        "--svc",
        &web_svc(),
        "--netns",
        &node_ns(lab),
        "--reply-timeout",
        REPLY_TIMEOUT_MS,
        "--output",
        "json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut bare = Nattrace::spawn(&nattrace(), &args, &[], false).expect("starting nattrace");
    let (program, boxed_args) = in_image(lab, root, network, &args);
    let mut boxed =
        Nattrace::spawn(Path::new(&program), &boxed_args, &[], false).expect("starting the image");
    for t in [&mut bare, &mut boxed] {
        t.wait_started(ATTACH_TIMEOUT)
            .unwrap_or_else(|e| panic!("{e:#}"));
    }
    let _ = lab.http_get(
        presets::CLIENT_POD,
        presets::WEB_SERVICE_IP,
        presets::WEB_PORT,
        Duration::from_secs(1),
    );
    // Finished once the curl's flow is decided (SIGUSR1), not after a
    // duration a loaded machine's start-up can outlast; the image's
    // nattrace runs under unshare and sh, which pass no signal on.
    let bare = bare.finish().unwrap_or_else(|e| panic!("{e:#}"));
    let boxed = boxed
        .finish_descendant("nattrace")
        .unwrap_or_else(|e| panic!("{e:#}"));
    (bare, boxed)
}

fn check_node(lab: &Lab, root: &Path, network: Network, verdict: &str, cause: &str) {
    let doctor_args: Vec<String> = ["doctor", "--netns", &node_ns(lab), "--output", "json"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let bare = doctor_json(&nattrace().display().to_string(), &doctor_args);
    let (program, boxed_args) = in_image(lab, root, network, &doctor_args);
    let boxed = doctor_json(&program, &boxed_args);
    assert_eq!(conclusions(&boxed), conclusions(&bare), "{boxed}\n{bare}");
    let mode = conclusions(&boxed)
        .into_iter()
        .find(|(check, ..)| check == "kube_proxy_mode")
        .expect("a kube_proxy_mode finding");
    assert_eq!(
        mode.2, "kube-proxy=iptables",
        "the image reads the rules: {boxed}"
    );

    let (bare, boxed) = trace_both(lab, root, network);
    let (b, i) = (verdicts(&bare), verdicts(&boxed));
    assert!(!b.is_empty(), "a flow:\n{}", bare.describe());
    assert_eq!(
        i,
        b,
        "image:\n{}\nbare:\n{}",
        boxed.describe(),
        bare.describe()
    );
    for (_, v, c) in &i {
        assert_eq!(
            (v.as_str(), c.as_str()),
            (verdict, cause),
            "{}",
            boxed.describe()
        );
    }
    assert_eq!(
        boxed.status.code(),
        bare.status.code(),
        "{}",
        boxed.describe()
    );
    // The image names the Service from kube-proxy's rules, as the bare binary does.
    let kube = |d: &Finished| d.flows().unwrap()[0]["k8s_service"].clone();
    assert_eq!(kube(&boxed), "default/web:http", "{}", boxed.describe());
    assert_eq!(kube(&boxed), kube(&bare), "{}", bare.describe());
}

#[test]
fn root_image_gives_the_bare_binarys_doctor_and_verdicts() {
    if lab::skip_without_root("the image test needs root (buildah mount, unshare, eBPF)") {
        return;
    }
    if Command::new("buildah").arg("--version").output().is_err() {
        println!("skipped: buildah is not installed (cargo xtask setup installs it)");
        return;
    }
    let started = Instant::now();
    let root = Rootfs::mount(&image());
    for tool in ["usr/sbin/iptables-nft-save", "usr/sbin/nft", "usr/sbin/ip"] {
        assert!(root.path.join(tool).exists(), "the image carries {tool}");
    }
    let _lock = tracing_lock();
    let broken = build_lab(presets::seed000(presets::Seed000 {
        bridge_nf_call_iptables: false,
        backend: Backend::SameNode,
    }));
    check_node(
        &broken,
        &root.path,
        Network::NetnsFlag,
        "reply_not_reverse_nated",
        "bridge_nf_call_iptables_off",
    );
    drop(broken);
    let healthy = build_lab(presets::seed000(presets::Seed000 {
        bridge_nf_call_iptables: true,
        backend: Backend::SameNode,
    }));
    check_node(&healthy, &root.path, Network::Shared, "ok", "-");
    println!("image test: {:.1?}", started.elapsed());
}

/// Without iptables and nft (a scratch image that carries neither) doctor
/// says which program is missing, never "no kube-proxy rules".
#[test]
fn root_missing_tools_are_named_not_reported_as_no_rules() {
    if lab::skip_without_root("needs root (a lab node)") {
        return;
    }
    // Its lab uses seed 000's addresses, like the traced ones.
    let _lock = tracing_lock();
    let lab = build_lab(presets::seed000(presets::Seed000::default()));
    let out = Command::new(nattrace())
        .args(["doctor", "--netns", &node_ns(&lab), "--output", "json"])
        .env("PATH", "/nonexistent")
        .output()
        .expect("running doctor");
    let report: Value = serde_json::from_slice(&out.stdout).expect("doctor's JSON");
    let f = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["check"] == "kube_proxy_mode")
        .cloned()
        .expect("kube_proxy_mode");
    assert_eq!(f["value"], "kube-proxy=unknown", "{report}");
    let msg = f["message"].as_str().unwrap();
    assert!(
        msg.contains("iptables-nft-save not found in PATH: /nonexistent"),
        "{msg}"
    );
    assert!(!msg.contains("no kube-proxy rules"), "{msg}");
}
