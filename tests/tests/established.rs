//! Connections that break after an `ok` opening (issue 21): long-lived
//! streams through a Service (the backend writes a line every 0.3 s, curl
//! reads them), broken mid-stream on the lab node, with a healthy stream
//! beside each broken one that must stay `ok`. nattrace runs in its default
//! mode (the kernel's per-flow buffer on, healthy flows muted), so what it
//! reports comes from the kernel's watch of established flows; the
//! recording is analysed again and must say the same. Needs root.
use std::{
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc::{Receiver, RecvTimeoutError},
    time::{Duration, Instant},
};

use lab::{
    Lab, Protocol, ProxyMode, ServiceSpec, both_modes, build_lab,
    presets::{self, Backend, NODE_A, Seed000, WEB_PORT, WEB_SERVICE_IP},
    tracer::{Finished, Nattrace, nattrace, tracing_lock},
};
use serde_json::Value;

macro_rules! require_root {
    () => {
        if lab::skip_without_root(
            "established-flow tests need root (network namespaces, eBPF); \
             run `sudo cargo test -p nattrace-tests --test established`",
        ) {
            return;
        }
    };
}

/// A second Service whose only endpoint is on the other node: its replies
/// are routed in over the overlay and always pass netfilter, so switching
/// br_netfilter off on node-a leaves it healthy.
const REMOTE_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(100, 67, 30, 134);
const BROKEN_PORT: u16 = 41001;
const HEALTHY_PORT: u16 = 41002;
const ATTACH_TIMEOUT: Duration = Duration::from_secs(30);
/// Waits on events (lines read, lines printed); this only bounds a hang.
const EVENT_TIMEOUT: Duration = Duration::from_secs(30);

/// `curl -N` reading a stream from the client pod, its lines counted.
struct Stream {
    child: Child,
    lines: Receiver<String>,
    read: usize,
}

impl Stream {
    fn open(lab: &Lab, ip: impl Into<IpAddr>, local_port: u16) -> Stream {
        let ns = lab.netns(presets::CLIENT_POD).expect("client pod");
        let url = format!(
            "http://{}/stream",
            std::net::SocketAddr::new(ip.into(), WEB_PORT)
        );
        let mut cmd: Command = ns.command("curl").expect("curl in the client pod");
        // -g: an IPv6 literal's brackets are not a glob.
        cmd.args(["-gsN", "--max-time", "120", "--local-port"])
            .arg(local_port.to_string())
            .arg(&url)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut child = cmd.spawn().expect("starting curl");
        let out = child.stdout.take().expect("piped");
        let lines = lab::wait::lines(out);
        Stream {
            child,
            lines,
            read: 0,
        }
    }

    /// Waits until `n` lines were read in all; false if the stream ended
    /// or stalled past `timeout`.
    fn wait_lines(&mut self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.read < n {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return false;
            };
            match self.lines.recv_timeout(left) {
                Ok(_) => self.read += 1,
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => return false,
            }
        }
        true
    }

    /// Lines read so far, counting those waiting in the pipe.
    fn lines_read(&mut self) -> usize {
        self.read += self.lines.try_iter().count();
        self.read
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The client's symptom: the healthy stream reads 8 more lines while the
/// broken one stops (one line may have been on its way).
fn assert_stalls_beside(broken: &mut Stream, healthy: &mut Stream, what: &str) {
    let before = broken.lines_read();
    let healthy_now = healthy.lines_read();
    assert!(
        healthy.wait_lines(healthy_now + 8, EVENT_TIMEOUT),
        "the healthy stream goes on"
    );
    assert!(
        broken.lines_read() <= before + 1,
        "{what}: {} lines after it broke",
        broken.lines_read() - before
    );
}

fn lab(mode: ProxyMode) -> Lab {
    build_lab(spec(mode))
}

fn spec(mode: ProxyMode) -> lab::LabSpec {
    let mut spec = presets::seed000(Seed000 {
        bridge_nf_call_iptables: true,
        backend: Backend::SameNode,
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
    );
    spec.kube_proxy.mode = mode;
    spec
}

fn start(lab: &Lab, record: &Path) -> Nattrace {
    start_for(lab, record, [WEB_SERVICE_IP, REMOTE_SERVICE_IP])
}

/// nattrace on node-a for the two Services at `ips` (port 80).
fn start_for<A: Into<IpAddr>>(lab: &Lab, record: &Path, ips: [A; 2]) -> Nattrace {
    let node = lab.node_netns(NODE_A).expect("node-a").path();
    let [a, b] = ips.map(|ip| std::net::SocketAddr::new(ip.into(), WEB_PORT).to_string());
    let args: Vec<String> = [
        "--svc",
        &a,
        "--svc",
        &b,
        "--netns",
        &node.display().to_string(),
        "--output",
        "json",
        "--reply-timeout",
        "1000",
        "--write",
        &record.display().to_string(),
        "--pcap",
        &record.with_extension("pcapng").display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut t = Nattrace::spawn(&nattrace(), &args, &[], false).expect("starting nattrace");
    let first = t
        .wait_started(ATTACH_TIMEOUT)
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert!(first.contains("\"kind\":\"start\""), "first line: {first}");
    t
}

/// Where the trace is recorded: a temporary file, or — when `cargo xtask
/// fixtures` asks ([`lab::tracer::RECORD_DIR_ENV`]) — `DIR/<test name>.rec`,
/// kept as the collector's recorded fixture. The temporary one and its
/// pcapng go when the test ends, also when it fails: a case that returned
/// early (the iptables branch of `ct-window`) left its pcapng in /tmp on
/// every run.
struct Record {
    path: PathBuf,
    keep: bool,
}

impl Record {
    fn new(name: &str) -> Record {
        match std::env::var(lab::tracer::RECORD_DIR_ENV) {
            Ok(dir) => {
                let thread = std::thread::current();
                let test = thread
                    .name()
                    .map_or(name, |n| n.rsplit("::").next().unwrap_or(n));
                Record {
                    path: PathBuf::from(dir).join(format!("{test}.rec")),
                    keep: true,
                }
            }
            Err(_) => Record {
                path: std::env::temp_dir()
                    .join(format!("nattrace-{name}-{}.rec", std::process::id())),
                keep: false,
            },
        }
    }
}

impl std::ops::Deref for Record {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.path
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.path.with_extension("pcapng"));
        if !self.keep {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn flows(done: &Finished) -> Vec<Value> {
    done.flows()
        .unwrap_or_else(|e| panic!("{e:#}\n{}", done.describe()))
}

fn client_port(f: &Value) -> u16 {
    f["client"]
        .as_str()
        .and_then(|c| c.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or(0)
}

/// The flows of `analyze FILE --output json`, as the live run printed them.
fn analyze(file: &Path) -> Vec<Value> {
    let out = Command::new(nattrace())
        .args(["analyze", &file.display().to_string(), "--output", "json"])
        .output()
        .expect("running nattrace analyze");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["kind"] == "flow")
        .collect()
}

/// The established report of the broken stream, checked; the healthy one
/// has only its `ok` opening. Live and analyze say the same.
fn assert_broken_and_healthy(
    done: &Finished,
    record: &Path,
    cause: &str,
    healthy_on_client_node: bool,
) -> Value {
    assert_eq!(done.status.code(), Some(1), "{}", done.describe());
    let live = flows(done);
    let established: Vec<&Value> = live
        .iter()
        .filter(|f| f["phase"] == "established")
        .collect();
    assert_eq!(
        established.len(),
        1,
        "one broken stream: {}",
        done.describe()
    );
    let broken = established[0].clone();
    println!(
        "established report: {} / {} — {}",
        broken["verdict"], broken["cause"], broken["detail"]
    );
    assert_eq!(client_port(&broken), BROKEN_PORT, "{broken}");
    assert_eq!(broken["cause"], cause, "{broken}");
    let good = broken["established"]["good_replies"].as_u64().unwrap_or(0);
    assert!(
        good >= 3,
        "at least the 3 lines read before were good: {broken}"
    );
    assert!(
        broken["detail"]
            .as_str()
            .is_some_and(|d| d.starts_with("mid-stream ")),
        "{broken}"
    );
    for port in [BROKEN_PORT, HEALTHY_PORT] {
        let opening: Vec<&Value> = live
            .iter()
            .filter(|f| client_port(f) == port && f["phase"].is_null())
            .collect();
        assert_eq!(opening.len(), 1, "port {port}: {}", done.describe());
        assert_eq!(opening[0]["verdict"], "ok", "{}", opening[0]);
    }
    assert!(
        !live
            .iter()
            .any(|f| client_port(f) == HEALTHY_PORT && f["verdict"] != "ok"),
        "the healthy stream stays ok: {}",
        done.describe()
    );
    let pcap = std::fs::read(record.with_extension("pcapng")).expect("the pcapng");
    assert!(
        pcap.windows(11).any(|w| w == b"mid-stream "),
        "the broken stream's packets carry a mid-stream comment in the pcapng"
    );
    // The healthy stream's events in the recording: none after its
    // handshake (every data packet checked in the kernel, no event), and
    // for a backend on the client's node 3 in all (docs/DESIGN.md, "Event
    // budget"). A backend on the other node costs its handshake per packet
    // in a lab: the other node's namespace is on the same kernel, and the
    // SYN-ACK reaching it from the backend's address sends the held events.
    let healthy: Vec<Value> = std::fs::read_to_string(record)
        .expect("the recording")
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["kind"] == "event")
        .filter(|v| v["sport"] == HEALTHY_PORT || v["dport"] == HEALTHY_PORT)
        .collect();
    let after_handshake = healthy
        .iter()
        .filter(|v| v["tcp_flags"].as_u64().unwrap_or(0) & 2 == 0)
        .count();
    assert_eq!(
        after_handshake, 0,
        "the healthy stream's data packets cost events"
    );
    if healthy_on_client_node {
        assert!(
            healthy.len() <= 3,
            "the healthy long-lived stream cost {} events",
            healthy.len()
        );
    }
    let replayed = analyze(record);
    let key = |f: &Value| {
        (
            client_port(f),
            f["phase"].as_str().unwrap_or("opening").to_string(),
            f["verdict"].clone(),
            f["cause"].clone(),
            f["detail"].clone(),
            f["established"].clone(),
        )
    };
    let mut a: Vec<_> = live.iter().map(key).collect();
    let mut b: Vec<_> = replayed.iter().map(key).collect();
    a.sort_by_key(|k| format!("{k:?}"));
    b.sort_by_key(|k| format!("{k:?}"));
    assert_eq!(a, b, "live == analyze");
    broken
}

/// bridge-nf-call-iptables switched off on node-a mid-stream: the
/// same-node backend's replies are bridged past netfilter, reach the
/// client un-reverse-NATed, and the stream stalls; the other stream's
/// replies are routed and stay reverse-NATed. With `ipv6`, the same on a
/// dual-stack node over IPv6: `bridge-nf-call-ip6tables` switched off (the
/// IPv4 sysctl left on), the IPv6 replies bridged past ip6tables.
fn bridge_nf_flip(mode: ProxyMode, ipv6: bool) {
    let _lock = tracing_lock();
    let (lab, ips, family, cause) = if ipv6 {
        let lab = build_lab(spec(mode).dual_stack());
        let ips =
            [WEB_SERVICE_IP, REMOTE_SERVICE_IP].map(|ip| lab::dual_stack::service_ip6(ip).into());
        (lab, ips, "ip6tables", "bridge_nf_call_ip6tables_off")
    } else {
        let ips = [WEB_SERVICE_IP, REMOTE_SERVICE_IP].map(IpAddr::from);
        (lab(mode), ips, "iptables", "bridge_nf_call_iptables_off")
    };
    let record = Record::new(if ipv6 { "bnf6-flip" } else { "bnf-flip" });
    let mut t = start_for(&lab, &record, ips);
    let mut broken = Stream::open(&lab, ips[0], BROKEN_PORT);
    let mut healthy = Stream::open(&lab, ips[1], HEALTHY_PORT);
    assert!(
        broken.wait_lines(4, EVENT_TIMEOUT),
        "stream to the same-node backend"
    );
    assert!(
        healthy.wait_lines(4, EVENT_TIMEOUT),
        "stream to the other node's backend"
    );

    let sysctl = format!("net.bridge.bridge-nf-call-{family}=0");
    lab.run(NODE_A, &["sysctl", "-w", &sysctl])
        .expect("switching the bridge sysctl off in node-a");
    // The client's symptom first.
    assert_stalls_beside(&mut broken, &mut healthy, "the bridged stream stalls");
    let line = t.wait_line(EVENT_TIMEOUT, |l| l.contains("\"phase\":\"established\""));
    assert!(line.is_some(), "nattrace reports the broken stream");
    // More lines of the healthy stream after the report: it is watched on.
    let healthy_now = healthy.lines_read();
    assert!(healthy.wait_lines(healthy_now + 3, EVENT_TIMEOUT));
    t.terminate();
    let done = t.wait(ATTACH_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    let broken_flow = assert_broken_and_healthy(&done, &record, cause, false);
    assert_eq!(
        broken_flow["verdict"], "reply_not_reverse_nated",
        "{broken_flow}"
    );
    assert_eq!(
        broken_flow["client"]
            .as_str()
            .is_some_and(|c| c.starts_with('[')),
        ipv6,
        "the flow's family: {broken_flow}"
    );
}

fn bridge_nf_off_mid_stream(mode: ProxyMode) {
    bridge_nf_flip(mode, false);
}

both_modes!(
    bridge_nf_off_mid_stream: root_bridge_nf_off_mid_stream_iptables,
    root_bridge_nf_off_mid_stream_nftables
);

fn bridge_nf6_off_mid_stream(mode: ProxyMode) {
    bridge_nf_flip(mode, true);
}

both_modes!(
    bridge_nf6_off_mid_stream: root_ipv6_bridge_nf_off_mid_stream_iptables,
    root_ipv6_bridge_nf_off_mid_stream_nftables
);

/// The broken stream's conntrack entry deleted on node-a with
/// nf_conntrack_tcp_loose=0 (set in node-a's namespace only): conntrack
/// makes no new entry mid-stream, the backend's next segments are INVALID
/// and NAT skips them; kube-proxy's `KUBE-FORWARD -m conntrack --ctstate
/// INVALID -j DROP` drops them (the lab renders it, as kube-proxy does
/// unless nf_conntrack_tcp_be_liberal is set), or — where no rule drops
/// them — they reach the client un-reverse-NATed. The other stream to the
/// same backend keeps its entry and stays `ok`.
/// With `ipv6`, the same over IPv6 on a dual-stack node (the sysctl is
/// the namespace's for both families): the entry is looked up over
/// ctnetlink with an AF_INET6 tuple.
fn conntrack_entry_deleted_mid_stream(mode: ProxyMode, ipv6: bool) {
    let _lock = tracing_lock();
    let (lab, ips, family) = if ipv6 {
        let lab = build_lab(spec(mode).dual_stack());
        let ips =
            [WEB_SERVICE_IP, REMOTE_SERVICE_IP].map(|ip| lab::dual_stack::service_ip6(ip).into());
        (lab, ips, "ipv6")
    } else {
        let ips = [WEB_SERVICE_IP, REMOTE_SERVICE_IP].map(IpAddr::from);
        (lab(mode), ips, "ipv4")
    };
    lab.run(
        NODE_A,
        &["sysctl", "-w", "net.netfilter.nf_conntrack_tcp_loose=0"],
    )
    .expect("nf_conntrack_tcp_loose=0 in node-a");
    let record = Record::new(if ipv6 { "ct6-invalid" } else { "ct-invalid" });
    let mut t = start_for(&lab, &record, ips);
    let mut broken = Stream::open(&lab, ips[0], BROKEN_PORT);
    let mut healthy = Stream::open(&lab, ips[0], HEALTHY_PORT);
    assert!(broken.wait_lines(4, EVENT_TIMEOUT), "first stream");
    assert!(healthy.wait_lines(4, EVENT_TIMEOUT), "second stream");

    let port = BROKEN_PORT.to_string();
    let deleted = lab
        .run(
            NODE_A,
            &[
                "conntrack",
                "-D",
                "-f",
                family,
                "-p",
                "tcp",
                "--orig-port-src",
                &port,
            ],
        )
        .expect("deleting the first stream's conntrack entry");
    assert!(
        deleted.contains(&format!("sport={BROKEN_PORT} ")),
        "conntrack -D printed the deleted entry: {deleted}"
    );
    assert_stalls_beside(
        &mut broken,
        &mut healthy,
        "the stream without its entry stalls",
    );
    let line = t.wait_line(EVENT_TIMEOUT, |l| l.contains("\"phase\":\"established\""));
    assert!(line.is_some(), "nattrace reports the broken stream");
    t.terminate();
    let done = t.wait(ATTACH_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    let broken_flow = assert_broken_and_healthy(&done, &record, "conntrack_invalid", true);
    let verdict = broken_flow["verdict"].as_str().unwrap_or_default();
    assert!(
        verdict == "dropped" || verdict == "reply_not_reverse_nated",
        "{broken_flow}"
    );
    // Named from conntrack itself, looked up when the flow failed: no entry.
    assert!(
        broken_flow["detail"]
            .as_str()
            .is_some_and(|d| d.contains("entry for the connection was gone")),
        "{broken_flow}"
    );
}

fn conntrack_entry4_deleted_mid_stream(mode: ProxyMode) {
    conntrack_entry_deleted_mid_stream(mode, false);
}

fn conntrack_entry6_deleted_mid_stream(mode: ProxyMode) {
    conntrack_entry_deleted_mid_stream(mode, true);
}

both_modes!(
    conntrack_entry4_deleted_mid_stream: root_conntrack_entry_deleted_mid_stream_iptables,
    root_conntrack_entry_deleted_mid_stream_nftables
);

both_modes!(
    conntrack_entry6_deleted_mid_stream: root_ipv6_conntrack_entry_deleted_mid_stream_iptables,
    root_ipv6_conntrack_entry_deleted_mid_stream_nftables
);

/// Run in the backend pod: waits for one segment the backend sends on the
/// stream to the client's PORT (its addresses as the backend sees them,
/// its sequence and acknowledgement numbers), then
/// sends one more segment of that connection with a sequence number 2^30
/// past it — over the window the client advertised, so conntrack marks it
/// INVALID although the connection's entry is in place (tcp_in_window,
/// net/netfilter/nf_conntrack_proto_tcp.c: "SEQ is over the upper bound";
/// one under the window would only be ignored since 6.1).
const OUT_OF_WINDOW: &str = r#"
import socket, struct, sys
cport = int(sys.argv[1])
# ETH_P_ALL: a packet socket of one protocol sees no outgoing packets
# (dev_queue_xmit_nit delivers to ptype_all only).
sniff = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(3))
sniff.settimeout(30)
while True:
    pkt, addr = sniff.recvfrom(65535)
    ihl = (pkt[0] & 15) * 4
    if addr[1] != 0x0800 or addr[2] != socket.PACKET_OUTGOING or pkt[9] != 6:
        continue
    sport, dport, seq, ack = struct.unpack("!HHII", pkt[ihl:ihl + 12])
    if dport == cport:
        break
src, client = pkt[12:16], pkt[16:20]
def csum(b):
    b += b"\0" * (len(b) % 2)
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xffff)
    s += s >> 16
    return ~s & 0xffff
seq = (seq + (1 << 30)) & 0xffffffff
tcp = struct.pack("!HHIIBBHHH", sport, dport, seq, ack, 5 << 4, 0x18, 502, 0, 0) + b"out-of-window\n"
c = csum(src + client + struct.pack("!BBH", 0, 6, len(tcp)) + tcp)
tcp = tcp[:16] + struct.pack("!H", c) + tcp[18:]
ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 0, 0x4000, 64, 6, 0, src, client)
raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
raw.sendto(ip + tcp, (socket.inet_ntoa(client), 0))
print("sent seq", seq, "to", socket.inet_ntoa(client), cport)
"#;

/// A segment of the broken stream out of the TCP window (sent from the
/// backend's namespace with the stream's own addresses, as a confused
/// middlebox or a spoofed segment would): conntrack marks it INVALID with
/// the connection's entry in place.
/// - iptables mode: kube-proxy's `KUBE-FORWARD … --ctstate INVALID -j DROP`
///   drops it, the client never sees it and the stream goes on: one
///   dropped packet followed by healthy replies is no failure, and the
///   stream stays `ok` (the watch reopens the flow and closes it again).
/// - nftables mode, where the lab renders no INVALID rule (kube-proxy's own
///   nftables mode has one; this stands for a node without it, as before
///   kubernetes#74840 or with a CNI's own forwarding rules): NAT skips it,
///   it reaches the client from the backend's address, the client answers
///   with a RST that resets the backend's socket (kubernetes#74839), and
///   the stream stops. nattrace names it `conntrack_invalid`, out of the
///   TCP window — the twin of the deleted entry above, told apart by
///   looking the entry up over ctnetlink when the flow failed.
fn conntrack_out_of_window_mid_stream(mode: ProxyMode) {
    let _lock = tracing_lock();
    let lab = lab(mode);
    let record = Record::new("ct-window");
    let mut t = start(&lab, &record);
    let mut broken = Stream::open(&lab, WEB_SERVICE_IP, BROKEN_PORT);
    let mut healthy = Stream::open(&lab, WEB_SERVICE_IP, HEALTHY_PORT);
    assert!(broken.wait_lines(4, EVENT_TIMEOUT), "first stream");
    assert!(healthy.wait_lines(4, EVENT_TIMEOUT), "second stream");
    let port = BROKEN_PORT.to_string();
    let sent = lab
        .run(
            presets::BACKEND_POD,
            &["python3", "-c", OUT_OF_WINDOW, &port],
        )
        .expect("sending the out-of-window segment");
    println!("{}", sent.trim());
    if mode == ProxyMode::Iptables {
        // Lines read after the segment span more than the watch's wait
        // (1 s at 0.3 s a line): the reopened flow was decided by then.
        let now = broken.lines_read();
        assert!(
            broken.wait_lines(now + 8, EVENT_TIMEOUT),
            "the rule kept the segment from the client: the stream goes on"
        );
        t.terminate();
        let done = t.wait(ATTACH_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
        // 4, not 0: the other traced Service (REMOTE_SERVICE_IP) saw no
        // connection in this case; 1 would be a failed flow.
        assert_eq!(done.status.code(), Some(4), "{}", done.describe());
        let live = flows(&done);
        assert!(
            live.iter().all(|f| f["verdict"] == "ok"),
            "a dropped stray segment leaves the streams ok: {}",
            done.describe()
        );
        return;
    }
    let line = t.wait_line(EVENT_TIMEOUT, |l| l.contains("\"phase\":\"established\""));
    assert!(line.is_some(), "nattrace reports the out-of-window segment");
    assert_stalls_beside(&mut broken, &mut healthy, "the reset stream stops");
    t.terminate();
    let done = t.wait(ATTACH_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    let broken_flow = assert_broken_and_healthy(&done, &record, "conntrack_invalid", true);
    assert_eq!(
        broken_flow["verdict"], "reply_not_reverse_nated",
        "{broken_flow}"
    );
    assert!(
        broken_flow["detail"].as_str().is_some_and(
            |d| d.contains("with the connection's entry in place (out of the TCP window)")
        ),
        "{broken_flow}"
    );
}

both_modes!(
    conntrack_out_of_window_mid_stream: root_conntrack_out_of_window_mid_stream_iptables,
    root_conntrack_out_of_window_mid_stream_nftables
);
