//! The container image (`cargo xtask image`) against a lab node: `doctor`
//! and a seed 000 trace, healthy and broken, run from the image give the
//! same findings and verdicts as the bare binary — with kube-proxy's rules
//! read by the iptables the image carries.
//!
//! The image runs under a real runtime (issue 29): side-loaded into the
//! lab's containerd node (`ctr images import` of the OCI archive) and run
//! through the CRI the way the DaemonSet runs it — privileged, the node's
//! network and PID namespaces, read-only root, the DaemonSet's mounts and
//! the node's root at /host (`kubectl debug node --profile=sysadmin`). The
//! pods it traces are that containerd's too. `podman run` still fails on
//! these machines (crun: setrlimit RLIMIT_NOFILE EPERM, hybrid cgroups;
//! docs/CONTAINERS.md); containerd's runc does not, so the old chroot
//! stand-in is gone. The broken node is traced by `--netns PATH`, the
//! healthy one from the namespace the container shares with the node (no
//! `--netns`); the bare binary traces beside it, one curl for both.
//!
//! Uses the image named by `$NATTRACE_IMAGE` (`cargo xtask test` builds it
//! beside the other root tests, in the same cargo call as vm-test's musl
//! binaries, and runs these after both), else builds
//! `localhost/nattrace:dev` with `cargo xtask image`. Every test's name
//! begins with `root_image_`: that is how `cargo xtask test` keeps them out
//! of the other root tests' run (xtask/src/tasks.rs `IMAGE_TESTS`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use lab::presets::{self, Backend, web_svc};
use lab::tracer::{Finished, Nattrace, nattrace, tracing_lock};
use lab::{Lab, Runtime, build_lab, cri};
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

/// How the container is pointed at the node.
#[derive(Clone, Copy, PartialEq)]
enum Network {
    /// By `--netns PATH` (the node's /run/netns is mounted in), as one
    /// traces a pod's or another namespace from a debug container.
    NetnsFlag,
    /// No `--netns`: it traces the namespace it shares with the node
    /// (`hostNetwork`, as the DaemonSet and `kubectl debug node` run it).
    Shared,
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

/// The image as an OCI archive (what `cargo xtask image --archive` writes
/// and `ctr images import` side-loads onto a node), removed on drop.
struct Archive(PathBuf);

impl Archive {
    fn of(image: &str) -> Archive {
        let path = std::env::temp_dir().join(format!("nattrace-image-{}.tar", std::process::id()));
        let _ = std::fs::remove_file(&path);
        buildah(&[
            "push",
            "--quiet",
            image,
            &format!("oci-archive:{}:{image}", path.display()),
        ]);
        Archive(path)
    }
}

impl Drop for Archive {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// What nattrace printed in a container, as a [`Finished`].
fn finished_in(container: &cri::HostContainer, code: i32) -> Finished {
    use std::os::unix::process::ExitStatusExt as _;
    let (stdout, stderr) = container.output();
    Finished {
        status: std::process::ExitStatus::from_raw(code << 8),
        stdout,
        stderr,
    }
}

/// Doctor and a seed 000 trace from the image run by the node's containerd
/// as the DaemonSet runs it (privileged, hostNetwork, hostPID, the
/// DaemonSet's mounts and /host), against the bare binary on the same node.
fn check_node(lab: &Lab, archive: &Archive, network: Network, verdict: &str, cause: &str) {
    let inside = |args: &[String]| match network {
        Network::NetnsFlag => args.to_vec(),
        Network::Shared => without_netns(args),
    };
    let node = lab.cri(presets::NODE_A).expect("node-a runs containerd");
    node.import_image(&archive.0).expect("importing the image");
    let image = image();
    let doctor_args: Vec<String> = ["doctor", "--netns", &node_ns(lab), "--output", "json"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let bare = doctor_json(&nattrace().display().to_string(), &doctor_args);
    let doctor = node
        .run_host_container("nattrace-doctor", &image, &inside(&doctor_args), &[])
        .expect("running doctor under containerd");
    let code = doctor.wait_exit(ATTACH_TIMEOUT).expect("doctor exits");
    let (out, err) = doctor.output();
    let boxed: Value = serde_json::from_str(out.join("\n").trim())
        .unwrap_or_else(|e| panic!("doctor under containerd (exit {code}): {e}: {out:?}\n{err}"));
    assert_eq!(conclusions(&boxed), conclusions(&bare), "{boxed}\n{bare}");
    drop(doctor);

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
    // The runtime's socket where the DaemonSet mounts the node's: names
    // from the CRI in both.
    let socket = node.socket();
    let mut bare_args = args.clone();
    bare_args.extend(["--cri-socket".to_string(), socket.display().to_string()]);
    let mut bare = Nattrace::spawn(&nattrace(), &bare_args, &[], false).expect("starting nattrace");
    let cri_mount = [(socket, "/run/containerd/containerd.sock".to_string())];
    let trace = node
        .run_host_container("nattrace", &image, &inside(&args), &cri_mount)
        .expect("running nattrace under containerd");
    bare.wait_started(ATTACH_TIMEOUT)
        .unwrap_or_else(|e| panic!("{e:#}"));
    trace
        .wait_stdout(ATTACH_TIMEOUT, |_| true)
        .unwrap_or_else(|e| panic!("nattrace under containerd did not start: {e}"));
    let _ = lab.http_get(
        presets::CLIENT_POD,
        presets::WEB_SERVICE_IP,
        presets::WEB_PORT,
        Duration::from_secs(1),
    );
    let bare = bare.finish().unwrap_or_else(|e| panic!("{e:#}"));
    // hostPID: the container's nattrace is a process of ours to signal.
    let pid = trace.pid().expect("the container's pid");
    unsafe { libc::kill(pid as i32, libc::SIGUSR1) };
    let code = trace
        .wait_exit(lab::wait::FAIL_AFTER)
        .expect("nattrace under containerd exits");
    let boxed = finished_in(&trace, code);
    let (b, i) = (verdicts(&bare), verdicts(&boxed));
    assert!(!b.is_empty(), "a flow:\n{}", bare.describe());
    assert_eq!(
        i,
        b,
        "containerd:\n{}\nbare:\n{}",
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
    let field = |d: &Finished, k: &str| d.flows().unwrap()[0][k].clone();
    assert_eq!(
        field(&boxed, "k8s_service"),
        "default/web:http",
        "{}",
        boxed.describe()
    );
    for (key, pod) in [
        ("client_pod", presets::CLIENT_POD),
        ("backend_pod", presets::BACKEND_POD),
    ] {
        assert_eq!(
            field(&boxed, key),
            lab::kubelet::k8s_name(pod),
            "{}",
            boxed.describe()
        );
        assert_eq!(field(&boxed, key), field(&bare, key), "{}", bare.describe());
    }
}

/// Issue 29 item 3: the image run by containerd (the lab's containerd
/// node, whose pods the CRI made) gives the bare binary's findings.
#[test]
fn root_image_under_containerd_gives_the_bare_binarys_doctor_and_verdicts() {
    if lab::skip_without_root("the image test needs root (containerd, eBPF)") {
        return;
    }
    if !Path::new("/usr/bin/containerd").is_file()
        || Command::new("buildah").arg("--version").output().is_err()
    {
        println!(
            "skipped: containerd or buildah is not installed (cargo xtask setup installs them)"
        );
        return;
    }
    let started = Instant::now();
    let archive = Archive::of(&image());
    let _lock = tracing_lock();
    let root = Rootfs::mount(&image());
    for tool in ["usr/sbin/iptables-nft-save", "usr/sbin/nft", "usr/sbin/ip"] {
        assert!(root.path.join(tool).exists(), "the image carries {tool}");
    }
    drop(root);
    for (on, network, verdict, cause) in [
        (
            false,
            Network::NetnsFlag,
            "reply_not_reverse_nated",
            "bridge_nf_call_iptables_off",
        ),
        (true, Network::Shared, "ok", "-"),
    ] {
        let lab = build_lab(
            presets::seed000(presets::Seed000 {
                bridge_nf_call_iptables: on,
                backend: Backend::SameNode,
            })
            .with_runtime(Runtime::Containerd),
        );
        check_node(&lab, &archive, network, verdict, cause);
    }
    println!("image under containerd: {:.1?}", started.elapsed());
}

/// Without iptables and nft (a scratch image that carries neither) doctor
/// says which program is missing, never "no kube-proxy rules".
#[test]
fn root_image_missing_tools_are_named_not_reported_as_no_rules() {
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
