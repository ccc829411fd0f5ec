//! Connections that break after an `ok` opening (issue 21), on the guest's
//! kernel with its backend (kprobe on 6.1, kprobe and netfilter on 6.12),
//! the way `tests/tests/established.rs` runs them on 6.18: two long-lived
//! streams through a Service (lab-server's `GET /stream`, a line every
//! 0.3 s), nattrace in its default mode (kernel buffer on, healthy flows
//! muted and watched in the kernel), one stream broken mid-stream on the
//! node, the other beside it must stay `ok`:
//! - `bridge-nf-call-iptables` set to 0 in the node's namespace after the
//!   handshake: the same-node backend's replies cross cni0 past netfilter
//!   → `reply_not_reverse_nated`, phase established, cause
//!   `bridge_nf_call_iptables_off`; the twin's backend is on the other node
//!   (its replies are routed, always through netfilter);
//! - the stream's conntrack entry deleted with `nf_conntrack_tcp_loose=0`:
//!   its next packets are INVALID, kube-proxy's `KUBE-FORWARD ... --ctstate
//!   INVALID -j DROP` drops them → `conntrack_invalid`; the twin keeps its
//!   entry to the same backend.
//!
//! Each check also counts the healthy twin's events in the recording after
//! its handshake: 0 (every data packet checked in the kernel, no event).
//!
//! And a healthy close whose last ACK comes twice ([`run_late_ack`]): it
//! must stay `ok`.
use std::fs::File;
use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, SocketAddrV4, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use lab::presets::{self, NODE_A, Seed000, WEB_PORT, WEB_SERVICE_IP};
use lab::tracer::{Echo, Finished, Nattrace, say};
use lab::{Lab, Protocol, ServiceSpec};
use serde_json::Value;

use super::{ATTACH_TIMEOUT, Checks};

/// The twin's Service for the br_netfilter case: its only endpoint is on
/// the other node, so its replies are routed in over the overlay.
const REMOTE_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(100, 67, 30, 134);
/// Only bounds a hang: every wait ends on its event (lines read, a line
/// printed). Generous for TCG on a loaded host.
const EVENT_TIMEOUT: Duration = Duration::from_secs(90);

struct Case {
    name: &'static str,
    /// Where the healthy twin connects.
    twin: Ipv4Addr,
    verdicts: &'static [&'static str],
    cause: &'static str,
    /// What the report's detail must say (the INVALID kind, named from
    /// conntrack's entry looked up over ctnetlink when the flow failed).
    detail: &'static str,
}

const CASES: [Case; 2] = [
    Case {
        name: "established bridge-nf-call-iptables=0 mid-stream",
        twin: REMOTE_SERVICE_IP,
        verdicts: &["reply_not_reverse_nated"],
        cause: "bridge_nf_call_iptables_off",
        detail: "",
    },
    Case {
        name: "established conntrack entry deleted mid-stream",
        twin: WEB_SERVICE_IP,
        // Dropped by kube-proxy's INVALID rule; where the drop is not
        // seen in time, the un-reverse-NATed reply decides.
        verdicts: &["dropped", "reply_not_reverse_nated"],
        cause: "conntrack_invalid",
        detail: "entry for the connection was gone",
    },
];

/// Runs both cases with each backend; one lab per case (the first one's
/// node is left with br_netfilter off).
pub fn run(checks: &mut Checks, nattrace: &Path, backends: &[&str]) {
    for (i, case) in CASES.iter().enumerate() {
        for &backend in backends {
            let name = format!("{} {backend}", case.name);
            let t = Instant::now();
            let result = one(nattrace, backend, case, i == 1)
                .map(|ok| format!("{ok} (in {:.1}s)", t.elapsed().as_secs_f64()));
            checks.record(&name, result.map_err(|e| format!("{e:#}")));
        }
    }
}

fn lab() -> anyhow::Result<Lab> {
    Lab::build(
        presets::seed000(Seed000 {
            bridge_nf_call_iptables: true,
            backend: presets::Backend::SameNode,
        })
        .service(
            ServiceSpec::new(
                "default",
                "web-b",
                "http",
                REMOTE_SERVICE_IP,
                WEB_PORT,
                Protocol::Tcp,
            )
            .endpoint(presets::REMOTE_BACKEND_POD, WEB_PORT),
        ),
    )
    .context("building the lab")
}

fn one(nattrace: &Path, backend: &str, case: &Case, invalid: bool) -> anyhow::Result<String> {
    let lab = lab()?;
    if invalid {
        lab.run(
            NODE_A,
            &["sysctl", "-w", "net.netfilter.nf_conntrack_tcp_loose=0"],
        )?;
    }
    let node = lab.node_netns(NODE_A)?.path();
    let client = lab.netns(presets::CLIENT_POD)?.path();
    let record = PathBuf::from(format!("/tmp/vm-established-{backend}-{invalid}.rec"));
    let svcs = [WEB_SERVICE_IP, REMOTE_SERVICE_IP].map(|ip| format!("{ip}:{WEB_PORT}"));
    let args = super::recorded_trace_args(backend, &svcs, &node, &record);
    let mut t = Nattrace::spawn_echoing(nattrace, &args, super::TRACER_ENV, Echo::Stderr)?;
    let first = t.wait_started(ATTACH_TIMEOUT)?;
    if !first.contains("\"kind\":\"start\"") {
        bail!("first line: {first}");
    }
    let broken = Stream::open(&client, WEB_SERVICE_IP)?;
    let healthy = Stream::open(&client, case.twin)?;
    broken.wait_lines(4).context("the stream to break")?;
    healthy.wait_lines(4).context("the healthy stream")?;

    if invalid {
        let port = broken.port.to_string();
        let deleted = lab.run(
            NODE_A,
            &["conntrack", "-D", "-p", "tcp", "--orig-port-src", &port],
        )?;
        if !deleted.contains(&format!("sport={port} ")) {
            bail!("conntrack -D deleted no entry of port {port}: {deleted}");
        }
    } else {
        lab.run(
            NODE_A,
            &["sysctl", "-w", "net.bridge.bridge-nf-call-iptables=0"],
        )?;
    }
    // The lab's own check first: the twin goes on, the broken stream stalls
    // (one line may have been on its way).
    let before = broken.lines();
    healthy
        .wait_lines(healthy.lines() + 6)
        .context("the healthy stream after the break")?;
    if broken.lines() > before + 1 {
        bail!(
            "the broken stream did not stall: {} lines after the break",
            broken.lines() - before
        );
    }
    let reported = t.wait_line(EVENT_TIMEOUT, |l| l.contains("\"phase\":\"established\""));
    // Watched on after the report.
    healthy.wait_lines(healthy.lines() + 2)?;
    t.terminate();
    let done = t.wait(EVENT_TIMEOUT)?;
    broken.stop();
    healthy.stop();
    let text = std::fs::read_to_string(&record).unwrap_or_default();
    let _ = std::fs::remove_file(&record);
    if reported.is_none() {
        bail!("no established report\n{}", done.describe());
    }
    judge(case, &done, broken.port, healthy.port, &text)
        .map_err(|e| anyhow::anyhow!("{e}\n{}", done.describe()))
}

fn client_port(f: &Value) -> u16 {
    f["client"]
        .as_str()
        .and_then(|c| c.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or(0)
}

fn judge(
    case: &Case,
    done: &Finished,
    broken: u16,
    healthy: u16,
    record: &str,
) -> anyhow::Result<String> {
    if done.status.code() != Some(1) {
        bail!("exit status {}, expected 1", done.status);
    }
    let flows = done.flows()?;
    let established: Vec<&Value> = flows
        .iter()
        .filter(|f| f["phase"] == "established")
        .collect();
    let [b] = established[..] else {
        bail!("{} established reports, expected 1", established.len());
    };
    if client_port(b) != broken
        || !case.verdicts.iter().any(|v| b["verdict"] == *v)
        || b["cause"] != case.cause
    {
        bail!(
            "established report {} {} cause {}, expected port {broken}, {:?} cause {}",
            b["client"],
            b["verdict"],
            b["cause"],
            case.verdicts,
            case.cause
        );
    }
    if !b["detail"]
        .as_str()
        .is_some_and(|d| d.contains(case.detail))
    {
        bail!("the report's detail does not say {:?}: {b}", case.detail);
    }
    let good = b["established"]["good_replies"].as_u64().unwrap_or(0);
    if good < 3 {
        bail!("{good} good replies before the break, at least 3 lines were read: {b}");
    }
    for port in [broken, healthy] {
        let opening: Vec<&Value> = flows
            .iter()
            .filter(|f| client_port(f) == port && f["phase"].is_null())
            .collect();
        if opening.len() != 1 || opening[0]["verdict"] != "ok" {
            bail!("port {port}: openings {opening:?}, expected one ok");
        }
    }
    if let Some(f) = flows
        .iter()
        .find(|f| client_port(f) == healthy && f["verdict"] != "ok")
    {
        bail!("the healthy stream was flagged: {f}");
    }
    // The healthy stream's events after its handshake (no SYN flag).
    let after_handshake = record
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["kind"] == "event")
        .filter(|v| v["sport"] == healthy || v["dport"] == healthy)
        .filter(|v| v["tcp_flags"].as_u64().unwrap_or(0) & 2 == 0)
        .count();
    if after_handshake != 0 {
        bail!("the healthy stream's data packets cost {after_handshake} events");
    }
    Ok(format!(
        "{} / {} after {} good replies ({}); the healthy twin ok, 0 events after its handshake",
        b["verdict"].as_str().unwrap_or("?"),
        case.cause,
        good,
        b["detail"].as_str().unwrap_or_default()
    ))
}

/// The close's last ACK held in the client pod (`lab::hold`) until its
/// FIN's retransmission is answered too, as
/// `root_a_late_ack_of_a_close_is_no_failure_*` on 6.18: the server closes
/// first, the client then, and the repeated ACK reaches a socket the first
/// one freed (NO_SOCKET, a bare RST back). Both sides had closed: the
/// kernel's watch counts it (tracer-ebpf/src/watch.rs `closing`) and the
/// connection stays `ok`, exit 0.
pub fn run_late_ack(checks: &mut Checks, nattrace: &Path, backends: &[&str]) {
    for &backend in backends {
        let t = Instant::now();
        let result = late_ack(nattrace, backend)
            .map(|ok| format!("{ok} (in {:.1}s)", t.elapsed().as_secs_f64()));
        checks.record(
            &format!("established late ACK of a close {backend}"),
            result.map_err(|e| format!("{e:#}")),
        );
    }
}

fn late_ack(nattrace: &Path, backend: &str) -> anyhow::Result<String> {
    use lab::hold::{Hold, out_rsts, wait_reset};
    use std::sync::mpsc::channel;
    let lab = lab()?;
    let node = lab.node_netns(NODE_A)?.path();
    let client = lab.netns(presets::CLIENT_POD)?.path().to_path_buf();
    let record = PathBuf::from(format!("/tmp/vm-late-ack-{backend}.rec"));
    let svcs = [format!("{WEB_SERVICE_IP}:{WEB_PORT}")];
    let args = super::recorded_trace_args(backend, &svcs, &node, &record);
    let mut t = Nattrace::spawn_echoing(nattrace, &args, super::TRACER_ENV, Echo::Stderr)?;
    let first = t.wait_started(ATTACH_TIMEOUT)?;
    if !first.contains("\"kind\":\"start\"") {
        bail!("first line: {first}");
    }
    // The connection, on a thread in the client's namespace: a line
    // echoed, then (told to) `close-me`, read to the server's FIN, closed.
    let (port_tx, port_rx) = channel::<anyhow::Result<u16>>();
    let (go_tx, go_rx) = channel::<()>();
    let conn = std::thread::spawn(move || -> anyhow::Result<()> {
        let opened = (|| -> anyhow::Result<(TcpStream, BufReader<TcpStream>)> {
            nix::sched::setns(File::open(&client)?, nix::sched::CloneFlags::CLONE_NEWNET)?;
            let addr = SocketAddr::V4(SocketAddrV4::new(WEB_SERVICE_IP, WEB_PORT));
            let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10))?;
            s.set_read_timeout(Some(EVENT_TIMEOUT))?;
            s.write_all(b"GET /echo HTTP/1.0\r\n\r\n")?;
            let mut r = BufReader::new(s.try_clone()?);
            // The response's head first: a line sent with the request may
            // be read with it and never echoed.
            let mut line = String::from("-");
            while !line.trim().is_empty() {
                line.clear();
                if r.read_line(&mut line)? == 0 {
                    bail!("the server closed before its response");
                }
            }
            s.write_all(b"line0\n")?;
            while line.trim() != "echo line0" {
                line.clear();
                if r.read_line(&mut line)? == 0 {
                    bail!("the server closed before echoing");
                }
            }
            Ok((s, r))
        })();
        let (mut s, mut r) = match opened {
            Ok(c) => c,
            Err(e) => {
                let _ = port_tx.send(Err(e));
                return Ok(());
            }
        };
        let _ = port_tx.send(Ok(s.local_addr()?.port()));
        go_rx.recv()?;
        s.write_all(b"close-me\n")?;
        std::io::copy(&mut r, &mut std::io::sink())?;
        Ok(())
    });
    let port = port_rx
        .recv_timeout(EVENT_TIMEOUT)
        .context("the connection's thread")??;
    let mut hold = Hold::start(&lab, presets::CLIENT_POD, WEB_SERVICE_IP, WEB_PORT, port)?;
    let before = out_rsts(&lab, presets::CLIENT_POD)?;
    go_tx.send(())?;
    conn.join()
        .map_err(|_| anyhow::anyhow!("the connection's thread panicked"))??;
    hold.wait_repeated(EVENT_TIMEOUT)?;
    hold.release()?;
    wait_reset(&lab, presets::CLIENT_POD, before, EVENT_TIMEOUT)?;
    let held = hold.acks.len();
    drop(hold);
    t.terminate();
    let done = t.wait(EVENT_TIMEOUT)?;
    let _ = std::fs::remove_file(&record);
    if done.status.code() != Some(0) {
        bail!(
            "exit status {}, expected 0\n{}",
            done.status,
            done.describe()
        );
    }
    let flows = done.flows()?;
    let of_port: Vec<&Value> = flows.iter().filter(|f| client_port(f) == port).collect();
    if of_port.len() != 1 || of_port[0]["verdict"] != "ok" {
        bail!(
            "port {port}: {of_port:?}, expected one ok\n{}",
            done.describe()
        );
    }
    Ok(format!(
        "ok, nothing more, exit 0: {held} ACKs held (the late one twice), the client's reset sent"
    ))
}

/// A `GET /stream` from inside the client pod, its lines counted on a
/// thread of its own (setns moves only that thread).
pub(super) struct Stream {
    pub(super) port: u16,
    lines: Arc<AtomicUsize>,
    socket: TcpStream,
}

impl Stream {
    pub(super) fn open(client_ns: &Path, ip: Ipv4Addr) -> anyhow::Result<Stream> {
        let ns = client_ns.to_path_buf();
        let (tx, rx) = std::sync::mpsc::channel();
        let lines = Arc::new(AtomicUsize::new(0));
        let counted = lines.clone();
        std::thread::spawn(move || {
            let opened = (|| -> anyhow::Result<TcpStream> {
                let f = File::open(&ns).with_context(|| format!("opening {}", ns.display()))?;
                nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET)?;
                let addr = SocketAddr::V4(SocketAddrV4::new(ip, WEB_PORT));
                let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10))
                    .with_context(|| format!("connect {addr}"))?;
                s.write_all(format!("GET /stream HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())?;
                Ok(s)
            })();
            let s = match opened {
                Ok(s) => s,
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            let reader = match s.try_clone() {
                Ok(r) => r,
                Err(e) => {
                    let _ = tx.send(Err(e.into()));
                    return;
                }
            };
            let _ = tx.send(Ok(s));
            for line in BufReader::new(reader).lines() {
                let Ok(line) = line else { break };
                if line.starts_with("pod=") {
                    counted.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        let socket = rx
            .recv_timeout(EVENT_TIMEOUT)
            .context("the stream's thread")??;
        let port = socket.local_addr()?.port();
        Ok(Stream {
            port,
            lines,
            socket,
        })
    }

    pub(super) fn lines(&self) -> usize {
        self.lines.load(Ordering::Relaxed)
    }

    /// Until `n` lines of the body were read in all; an error
    /// if the stream stalls past [`EVENT_TIMEOUT`].
    pub(super) fn wait_lines(&self, n: usize) -> anyhow::Result<()> {
        let deadline = Instant::now() + EVENT_TIMEOUT;
        while self.lines() < n {
            if Instant::now() > deadline {
                bail!("{} of {n} lines after {EVENT_TIMEOUT:?}", self.lines());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        say(&format!(
            "vm-guest: info stream from port {}: {} lines",
            self.port,
            self.lines()
        ));
        Ok(())
    }

    pub(super) fn stop(&self) {
        let _ = self.socket.shutdown(Shutdown::Both);
    }
}
