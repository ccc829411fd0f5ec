//! Idle clients of `--metrics-addr` cannot take the tracer's fds (issue 26
//! item 8): under `prlimit --nofile=256`, 400 idle connections used to
//! leave nothing for the rtnetlink socket that picks up new interfaces
//! ("watching for new interfaces failed: ... Too many open files").
//!
//! nattrace runs inside the lab's node namespace (nsenter --net, no mount
//! namespace change) so its metrics server binds a lab address and every
//! client lives in the lab.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::*;

/// The node's cni0 gateway: an address of the lab's node namespace.
const METRICS: &str = "100.96.54.1:9464";
const CLIENTS: usize = 400;
/// `MAX_CLIENTS` in tracer-userspace/src/continuous/http.rs.
const MAX_CLIENTS: usize = 16;

/// Runs `f` on a thread inside the namespace at `ns` (sockets made there
/// stay there).
fn in_netns<R: Send>(ns: &Path, f: impl FnOnce() -> R + Send) -> R {
    let file = std::fs::File::open(ns).expect("netns file");
    std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        })
        .join()
        .expect("netns thread")
    })
}

fn addr() -> SocketAddr {
    METRICS.parse().unwrap()
}

/// One scrape; None when the server closed it (all slots busy) or failed.
fn scrape(ns: &Path) -> Option<String> {
    in_netns(ns, || {
        let mut s = TcpStream::connect_timeout(&addr(), Duration::from_secs(5)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).ok()?;
        text.starts_with("HTTP/1.1 200").then_some(text)
    })
}

fn attached(text: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with("nattrace_tc_interfaces{") && l.contains("state=\"attached\""))?
        .rsplit(' ')
        .next()?
        .parse()
        .ok()
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[test]
fn root_idle_metrics_clients_leave_the_tracer_its_fds() {
    require_root!();
    let _guard = tracing_lock();
    let lab = seed000(true, Backend::SameNode, ProxyMode::Iptables);
    let node = lab.node_netns(presets::NODE_A).expect("node-a");
    let ns: PathBuf = node.path();
    let bin = nattrace();
    let args: Vec<String> = [
        format!("--net={}", ns.display()),
        "prlimit".into(),
        "--nofile=256".into(),
        bin.display().to_string(),
        "--svc".into(),
        format!("{}:{}", presets::WEB_SERVICE_IP, presets::WEB_PORT),
        "--output".into(),
        "json".into(),
        "--metrics-addr".into(),
        METRICS.into(),
    ]
    .into();
    let mut tracer =
        Nattrace::spawn(Path::new("nsenter"), &args, &[], false).expect("start nattrace");
    tracer
        .wait_started(ATTACH_TIMEOUT)
        .unwrap_or_else(|e| panic!("{e:#}"));
    let pid = tracer.pid();
    // The gauges are set on the first tick after attaching.
    let deadline = Instant::now() + ATTACH_TIMEOUT;
    let before = loop {
        let text = scrape(&ns).expect("a scrape before any client");
        match attached(&text) {
            Some(n) if n > 0.0 => break n,
            _ if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            _ => panic!("no tc_interfaces attached gauge:\n{text}"),
        }
    };
    let fds_before = open_fds(pid);

    // Idle: connected, never a byte sent, kept open to the end.
    let clients: Vec<TcpStream> = in_netns(&ns, || {
        (0..CLIENTS)
            .map(|_| TcpStream::connect(addr()).expect("connect to the metrics address"))
            .collect()
    });

    // A new interface while they are connected: traced at the next poll.
    let ip = |args: &[&str]| {
        let ok = std::process::Command::new("ip")
            .args(["-n", node.name()])
            .args(args)
            .status()
            .expect("ip");
        assert!(ok.success(), "ip {args:?}");
    };
    ip(&[
        "link", "add", "ntmfa", "type", "veth", "peer", "name", "ntmfb",
    ]);
    ip(&["link", "set", "ntmfa", "up"]);
    ip(&["link", "set", "ntmfb", "up"]);

    let deadline = Instant::now() + Duration::from_secs(60);
    let mut most_fds = 0;
    let now = loop {
        most_fds = most_fds.max(open_fds(pid));
        if let Some(n) = scrape(&ns).as_deref().and_then(attached)
            && n > before
        {
            break n;
        }
        assert!(
            Instant::now() < deadline,
            "the new veth was not traced within 60 s with {CLIENTS} idle metrics clients"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    most_fds = most_fds.max(open_fds(pid));
    drop(clients);
    tracer.terminate();
    let done = tracer
        .wait(Duration::from_secs(20))
        .expect("nattrace exits");
    assert!(
        !done.stderr.contains("Too many open files")
            && !done.stderr.contains("watching for new interfaces failed"),
        "the tracer ran out of fds:\n{}",
        done.describe()
    );
    assert!(
        done.stderr.contains("ntmfa"),
        "says it now traces the new veth:\n{}",
        done.describe()
    );
    // Its own fds, the capped clients, one being closed, and this scrape;
    // and, while a look at the young namespaces for devices no transmit
    // reports runs (probes/receive.rs, on a thread of its own after each
    // interface poll), its copy of the node namespace's fd, one namespace
    // file and one rtnetlink socket.
    assert!(
        most_fds <= fds_before + MAX_CLIENTS + 7,
        "{most_fds} fds open with {CLIENTS} idle clients (before them: {fds_before}); attached {before} -> {now}"
    );
}
