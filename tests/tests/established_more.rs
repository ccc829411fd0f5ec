//! Connections that break after an `ok` opening, the cases beyond
//! established.rs (issue 21): a client that keeps writing on a long-lived
//! connection through a Service (`lab-server writer`, each line echoed by
//! the backend's `GET /echo`) whose backend becomes unreachable or loses
//! the connection's socket mid-flow. Beside each broken connection,
//! connections to another backend stay `ok`: one kept busy, one closed
//! normally, one the server aborts (SO_LINGER 0) while the client still
//! writes, one the client aborts. nattrace runs in its default mode (the
//! kernel's buffer on, healthy flows muted), and the recording is analysed
//! again and must say the same. Needs root.
use std::{
    io::Write as _,
    net::Ipv4Addr,
    path::Path,
    process::{Child, ChildStdin, Command, Stdio},
    sync::mpsc::Receiver,
    time::Duration,
};

use lab::{
    Datapath, Lab, Protocol, ProxyMode, ServiceSpec, both_modes, build_lab,
    hold::{Hold, out_rsts, wait_reset},
    lab_server_path,
    presets::{self, Backend, NODE_A, Seed000, WEB_PORT, WEB_SERVICE_IP},
    tracer::{Finished, Nattrace, nattrace, tracing_lock},
};
use serde_json::Value;

macro_rules! require_root {
    () => {
        if lab::skip_without_root(
            "established-flow tests need root (network namespaces, eBPF); \
             run `sudo cargo test -p nattrace-tests --test established_more`",
        ) {
            return;
        }
    };
}

/// A second Service whose only endpoint is on the other node: the twins
/// use it, so breaking node-a's backend leaves them alone.
const REMOTE_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(100, 67, 30, 134);
const BROKEN_PORT: u16 = 41011;
const HEALTHY_PORT: u16 = 41012;
const CLOSE_PORT: u16 = 41013;
const SERVER_ABORT_PORT: u16 = 41014;
const CLIENT_ABORT_PORT: u16 = 41015;
const TWINS: [u16; 4] = [
    HEALTHY_PORT,
    CLOSE_PORT,
    SERVER_ABORT_PORT,
    CLIENT_ABORT_PORT,
];
const ATTACH_TIMEOUT: Duration = Duration::from_secs(30);
/// Waits on events (lines printed); this only bounds a hang.
const EVENT_TIMEOUT: Duration = Duration::from_secs(30);

/// `lab-server writer` in the client pod: a line written per `send`, its
/// echo (or `stalled`, `error: …`) read back.
struct Writer {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    port: u16,
}

impl Writer {
    fn open(lab: &Lab, ip: Ipv4Addr, port: u16) -> Writer {
        let ns = lab.netns(presets::CLIENT_POD).expect("client pod");
        let server = lab_server_path().expect("lab-server");
        let mut cmd: Command = ns
            .command(&server.to_string_lossy())
            .expect("lab-server in the client pod");
        cmd.args(["writer", &ip.to_string(), &WEB_PORT.to_string()])
            .arg(port.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("starting the writer");
        let stdin = child.stdin.take().expect("piped");
        let out = child.stdout.take().expect("piped");
        let lines = lab::wait::lines(out);
        let mut w = Writer {
            child,
            stdin,
            lines,
            port,
        };
        assert_eq!(w.next(), "connected", "writer from port {port}");
        w
    }

    fn next(&mut self) -> String {
        self.lines
            .recv_timeout(EVENT_TIMEOUT)
            .unwrap_or_else(|_| format!("(nothing from the writer on port {})", self.port))
    }

    /// Sends `text` (a line, or a command: close, abort) and returns what
    /// the writer printed for it.
    fn send(&mut self, text: &str) -> String {
        writeln!(self.stdin, "{text}").expect("writing to the writer");
        self.stdin.flush().expect("flushing");
        self.next()
    }

    fn exchange(&mut self, n: usize) {
        for i in 0..n {
            let line = format!("line{i}");
            assert_eq!(
                self.send(&line),
                format!("echo {line}"),
                "port {}",
                self.port
            );
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The broken connection (to node-a's backend) and its twins (to the other
/// node's), each with three lines echoed.
fn writers(lab: &Lab, twin_ports: &[u16]) -> (Writer, Vec<Writer>) {
    let mut broken = Writer::open(lab, WEB_SERVICE_IP, BROKEN_PORT);
    let mut twins: Vec<Writer> = twin_ports
        .iter()
        .map(|&p| Writer::open(lab, REMOTE_SERVICE_IP, p))
        .collect();
    broken.exchange(3);
    for w in twins.iter_mut() {
        w.exchange(3);
    }
    (broken, twins)
}

/// After the break: the busy twin goes on while nattrace reports the broken
/// connection, which must be `refused` with `cause`.
fn refused_while_twin_goes_on(
    mut t: Nattrace,
    twin: &mut Writer,
    record: &Path,
    cause: &str,
    twin_ports: &[u16],
) -> Value {
    twin.exchange(3);
    let line = t.wait_line(EVENT_TIMEOUT, |l| l.contains("\"phase\":\"established\""));
    assert!(line.is_some(), "nattrace reports the broken connection");
    twin.exchange(3);
    t.terminate();
    let done = t.wait(ATTACH_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    let flow = assert_broken(&done, record, cause, twin_ports);
    assert_eq!(flow["verdict"], "refused", "{flow}");
    flow
}

fn lab(mode: ProxyMode) -> Lab {
    lab_on(mode, Datapath::Bridge)
}

/// The lab on a bridged node (seed 000's) or a routed one (Calico-like:
/// a /32 route per pod veth, no bridge).
fn lab_on(mode: ProxyMode, datapath: Datapath) -> Lab {
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
    build_lab(spec.with_datapath(datapath))
}

fn start(lab: &Lab, record: &Path) -> Nattrace {
    let node = lab.node_netns(NODE_A).expect("node-a").path();
    let args: Vec<String> = [
        "--svc",
        &format!("{WEB_SERVICE_IP}:{WEB_PORT}"),
        "--svc",
        &format!("{REMOTE_SERVICE_IP}:{WEB_PORT}"),
        "--netns",
        &node.display().to_string(),
        "--output",
        "json",
        "--reply-timeout",
        "1000",
        "--write",
        &record.display().to_string(),
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

/// A finished trace that failed (exit status 1): its flow lines.
fn failed_trace_flows(done: &Finished) -> Vec<Value> {
    assert_eq!(done.status.code(), Some(1), "{}", done.describe());
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

/// The one established report (the broken connection's), checked; every
/// twin has only its `ok` opening. Live and analyze say the same.
fn assert_broken(done: &Finished, record: &Path, cause: &str, twins: &[u16]) -> Value {
    let live = failed_trace_flows(done);
    let established: Vec<&Value> = live
        .iter()
        .filter(|f| f["phase"] == "established")
        .collect();
    assert_eq!(
        established.len(),
        1,
        "one broken connection: {}",
        done.describe()
    );
    let broken = established[0].clone();
    println!(
        "established report: {} / {} — {}",
        broken["verdict"], broken["cause"], broken["detail"]
    );
    assert_eq!(client_port(&broken), BROKEN_PORT, "{broken}");
    assert_eq!(broken["cause"], cause, "{broken}");
    assert!(
        broken["detail"]
            .as_str()
            .is_some_and(|d| d.starts_with("mid-stream ")),
        "{broken}"
    );
    for &port in std::iter::once(&BROKEN_PORT).chain(twins) {
        let opening: Vec<&Value> = live
            .iter()
            .filter(|f| client_port(f) == port && f["phase"].is_null())
            .collect();
        assert_eq!(opening.len(), 1, "port {port}: {}", done.describe());
        assert_eq!(opening[0]["verdict"], "ok", "{}", opening[0]);
    }
    for &port in twins {
        assert!(
            !live
                .iter()
                .any(|f| client_port(f) == port && f["verdict"] != "ok"),
            "the twin on port {port} stays ok: {}",
            done.describe()
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

/// The node's end of `pod`'s veth, by the ifindex its eth0 names
/// ("eth0@if7").
fn node_veth(lab: &Lab, pod: &str) -> String {
    let link = lab
        .run(pod, &["ip", "-o", "link", "show", "dev", "eth0"])
        .expect("the pod's eth0");
    let peer = link
        .split_once("@if")
        .and_then(|(_, rest)| rest.split(':').next())
        .expect("a veth peer")
        .to_string();
    let links = lab
        .run(NODE_A, &["ip", "-o", "link", "show"])
        .expect("node-a links");
    links
        .lines()
        .find_map(|l| {
            let rest = l.strip_prefix(&format!("{peer}: "))?;
            Some(rest.split(['@', ':']).next()?.trim().to_string())
        })
        .unwrap_or_else(|| panic!("no link {peer} in node-a: {links}"))
}

/// The backend pod on node-a cut off mid-flow: its veth removed from the
/// node (the pod's socket is never told, as when its node or its network
/// goes away). The client's next line is never echoed (its read stalls)
/// and its retransmissions find no port for the backend's MAC on the
/// bridge: `backend_unreachable`, phase established. The twin to the other
/// node's backend goes on.
fn backend_gone_mid_flow(mode: ProxyMode) {
    let _lock = tracing_lock();
    let lab = lab(mode);
    let scratch = lab::Scratch::new("established");
    let record = scratch.path("backend-gone.rec");
    let mut t = start(&lab, &record);
    let mut broken = Writer::open(&lab, WEB_SERVICE_IP, BROKEN_PORT);
    let mut healthy = Writer::open(&lab, REMOTE_SERVICE_IP, HEALTHY_PORT);
    broken.exchange(4);
    healthy.exchange(4);

    let veth = node_veth(&lab, presets::BACKEND_POD);
    lab.run(NODE_A, &["ip", "link", "del", "dev", &veth])
        .expect("removing the backend's veth");
    // The client's symptom first: its line is not answered.
    assert_eq!(
        broken.send("after"),
        "stalled",
        "the cut-off backend echoes"
    );
    healthy.exchange(4);
    let line = t.wait_line(EVENT_TIMEOUT, |l| l.contains("\"phase\":\"established\""));
    assert!(line.is_some(), "nattrace reports the broken connection");
    healthy.exchange(3);
    t.terminate();
    let done = t.wait(ATTACH_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    let flow = assert_broken(&done, &record, "backend_unreachable", &[HEALTHY_PORT]);
    let verdict = flow["verdict"].as_str().unwrap_or_default();
    assert!(verdict == "dropped" || verdict == "no_reply", "{flow}");
    assert!(
        flow["established"]["good_replies"].as_u64().unwrap_or(0) >= 4,
        "the 4 echoes before were good: {flow}"
    );
}

both_modes!(
    backend_gone_mid_flow: root_backend_gone_mid_flow_iptables,
    root_backend_gone_mid_flow_nftables
);

/// A stale conntrack entry on TCP (issue 22): the Service's endpoint moved
/// kube-proxy style (the rules first) and the old pod cut off while a
/// connection to it is open. Its conntrack entry still DNATs the
/// client's segments to the old address (kube-proxy never deletes TCP
/// entries), so the client's next line stalls: `stale_conntrack_entry`,
/// phase established, the fix `conntrack -D -p tcp …` for this one entry,
/// not the endpoints (they are right already). The twin to the other
/// Service stays `ok`.
fn stale_tcp_entry_mid_flow(mode: ProxyMode) {
    let _lock = tracing_lock();
    let mut lab = lab(mode);
    let scratch = lab::Scratch::new("established");
    let record = scratch.path("stale-tcp.rec");
    let mut t = start(&lab, &record);
    let mut broken = Writer::open(&lab, WEB_SERVICE_IP, BROKEN_PORT);
    let mut healthy = Writer::open(&lab, REMOTE_SERVICE_IP, HEALTHY_PORT);
    broken.exchange(4);
    healthy.exchange(4);

    let moved = ServiceSpec::new(
        "default",
        "web",
        "http",
        WEB_SERVICE_IP,
        WEB_PORT,
        Protocol::Tcp,
    )
    .endpoint(presets::REMOTE_BACKEND_POD, WEB_PORT);
    lab.replace_service(moved).expect("moving the endpoint");
    // The old pod cut off without closing its sockets (a deleted pod's
    // process would send FIN first: no stale entry then), as when its
    // node or its network goes away.
    let veth = node_veth(&lab, presets::BACKEND_POD);
    lab.run(NODE_A, &["ip", "link", "del", "dev", &veth])
        .expect("removing the old backend's veth");
    assert_eq!(
        broken.send("after"),
        "stalled",
        "the connection to the deleted pod is answered"
    );
    healthy.exchange(4);
    let line = t.wait_line(EVENT_TIMEOUT, |l| l.contains("\"phase\":\"established\""));
    assert!(line.is_some(), "nattrace reports the broken connection");
    healthy.exchange(3);
    t.terminate();
    let done = t.wait(ATTACH_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    let flow = assert_broken(&done, &record, "stale_conntrack_entry", &[HEALTHY_PORT]);
    let old = presets::BACKEND_IP.to_string();
    let hint = flow["hint"].as_str().unwrap_or_default();
    let delete = format!(
        "conntrack -D -p tcp --orig-src {} --orig-port-src {BROKEN_PORT} --orig-dst {WEB_SERVICE_IP} --orig-port-dst {WEB_PORT} --reply-src {old}",
        presets::CLIENT_IP
    );
    assert!(hint.contains(&delete), "{delete:?} not in the fix: {flow}");
    let text = flow["cause_text"].as_str().unwrap_or_default();
    let remote = lab
        .spec()
        .nodes
        .iter()
        .flat_map(|n| &n.pods)
        .find(|p| p.name == presets::REMOTE_BACKEND_POD)
        .map(|p| p.ip.to_string())
        .expect("the remote backend");
    assert!(text.contains(&old) && text.contains(&remote), "{flow}");
    // How tracer-userspace/fixtures/established/root_stale_tcp_entry_*
    // were made (with their goldens: `nattrace analyze --output json -v`).
    if let Ok(dir) = std::env::var(lab::tracer::RECORD_DIR_ENV) {
        let name = format!(
            "root_stale_tcp_entry_mid_flow_{}.rec",
            format!("{mode:?}").to_lowercase()
        );
        std::fs::copy(&record, std::path::Path::new(&dir).join(name))
            .expect("keeping the recording");
    }
}

both_modes!(
    stale_tcp_entry_mid_flow: root_stale_tcp_entry_mid_flow_iptables,
    root_stale_tcp_entry_mid_flow_nftables
);

/// The backend on node-a loses the connection's socket without telling the
/// client (`ss -K` with the backend's own RST dropped in the pod, as when
/// its kernel forgot it: a restarted sandbox, a pod that took over the
/// address). With `crashed`, the backend's server is gone too (no
/// listener: the segment is dropped with NO_SOCKET); else it still listens
/// (a restarted process: the listener answers the ACK). Either way the
/// client's next line gets a bare RST and ECONNRESET: `backend_restarted`,
/// phase established. The twins to the other backend: one kept busy, one
/// closed normally, one the server resets (SO_LINGER 0) while the client's
/// next line is on its way (NO_SOCKET and a bare RST follow the abort),
/// one the client resets — all `ok`.
fn backend_restarted_mid_flow(mode: ProxyMode, crashed: bool) {
    backend_restarted_on(mode, crashed, Datapath::Bridge);
}

fn backend_restarted_on(mode: ProxyMode, crashed: bool, datapath: Datapath) {
    let _lock = tracing_lock();
    let lab = lab_on(mode, datapath);
    let scratch = lab::Scratch::new("established");
    let record = scratch.path("backend-restarted.rec");
    let t = start(&lab, &record);
    let (mut broken, mut twins) = writers(&lab, &TWINS);
    // The twins' ends: a normal close, the server's abort with the
    // client's next line on its way, the client's abort.
    assert_eq!(twins[1].send("close"), "closed");
    let reset = twins[2].send("reset-me then late");
    assert!(
        reset == "error: ConnectionReset" || reset == "eof",
        "the server's abort: {reset}"
    );
    assert_eq!(twins[3].send("abort"), "aborted");

    let backend = presets::BACKEND_POD;
    let drop_rst = ["-p", "tcp", "--tcp-flags", "RST", "RST", "-j", "DROP"];
    let rule = |op: &str| {
        let mut args = vec!["iptables", op, "OUTPUT"];
        args.extend(drop_rst);
        lab.run(backend, &args).expect("the backend pod's RST rule");
    };
    rule("-I");
    let killed = lab
        .run(
            backend,
            &["ss", "-K", "-tn", "dport", "=", &format!(":{BROKEN_PORT}")],
        )
        .expect("ss -K in the backend pod");
    assert!(
        killed.contains(&format!(":{BROKEN_PORT}")),
        "ss -K killed the connection's socket: {killed}"
    );
    rule("-D");
    if crashed {
        lab.stop_pod_servers(backend).expect("stopping the backend");
    }
    let got = broken.send("after");
    assert_eq!(got, "error: ConnectionReset", "the client's symptom");
    let flow = refused_while_twin_goes_on(t, &mut twins[0], &record, "backend_restarted", &TWINS);
    let text = flow["cause_text"].as_str().unwrap_or_default();
    // NO_SOCKET is never claimed while a listener is left. With none left
    // it is named when the segment's NO_SOCKET drop reached the collector,
    // which in some runs it does not (the listener is gone then: `ss -tln`
    // in the pod is empty; the bare RST still arrives and decides the
    // cause): a known gap, docs/DESIGN.md "Not done yet".
    assert!(
        crashed || !text.contains("NO_SOCKET"),
        "NO_SOCKET claimed with a listener left: {text}"
    );
    if crashed && !text.contains("NO_SOCKET") {
        println!("known gap: the NO_SOCKET drop of the crashed backend was not seen");
    }
    assert!(
        flow["established"]["good_replies"].as_u64().unwrap_or(0) >= 3,
        "the 3 echoes before were good: {flow}"
    );
}

fn backend_restarted(mode: ProxyMode) {
    backend_restarted_mid_flow(mode, false);
}

both_modes!(
    backend_restarted: root_backend_restarted_mid_flow_iptables,
    root_backend_restarted_mid_flow_nftables
);

#[test]
fn root_backend_crashed_mid_flow_iptables() {
    require_root!();
    backend_restarted_mid_flow(ProxyMode::Iptables, true);
}

/// The keep-alive race: the backend's application closes the connection
/// (a FIN, nothing unread) and the client, having read that FIN, writes
/// once more; the backend's kernel resets the data (net/ipv4/tcp_input.c
/// `tcp_rcv_state_process`: data after close() in FIN_WAIT1/2) and the
/// client's next write fails (EPIPE: it had read the FIN). On the wire the
/// RST is the bare one of a lost socket; the backend's FIN, noted by the
/// kernel while the flow was muted, makes it `backend_closed`, not
/// `backend_restarted`. The twins to the other backend, one kept busy and
/// one closed by its client, stay `ok`. Both kube-proxy modes, bridged and
/// routed.
fn backend_closed_on(mode: ProxyMode, datapath: Datapath) {
    let _lock = tracing_lock();
    let lab = lab_on(mode, datapath);
    let scratch = lab::Scratch::new("established");
    let record = scratch.path("backend-closed.rec");
    let mut t = start(&lab, &record);
    let twin_ports = [HEALTHY_PORT, CLOSE_PORT];
    let (mut broken, mut twins) = writers(&lab, &twin_ports);
    assert_eq!(twins[1].send("close"), "closed");
    // Its opening decided `ok` first (a reset within the opening's settle
    // time would be part of the opening's evidence): the race happens on
    // an established connection.
    let opening = t.wait_line(EVENT_TIMEOUT, |l| {
        l.contains("\"verdict\":\"ok\"") && l.contains(&format!(":{BROKEN_PORT}\""))
    });
    assert!(opening.is_some(), "the broken connection's opening is ok");
    let got = broken.send("write-after-close");
    assert!(
        got == "error: BrokenPipe" || got == "error: ConnectionReset",
        "the client's symptom: {got}"
    );
    let flow = refused_while_twin_goes_on(t, &mut twins[0], &record, "backend_closed", &twin_ports);
    assert!(
        flow["established"]["good_replies"].as_u64().unwrap_or(0) >= 3,
        "the 3 echoes before were good: {flow}"
    );
}

fn backend_closed(mode: ProxyMode) {
    backend_closed_on(mode, Datapath::Bridge);
}

both_modes!(
    backend_closed: root_backend_closed_then_the_client_wrote_iptables,
    root_backend_closed_then_the_client_wrote_nftables
);

#[test]
fn root_routed_backend_closed_then_the_client_wrote_iptables() {
    require_root!();
    backend_closed_on(ProxyMode::Iptables, Datapath::Routed);
}

/// A NetworkPolicy-like DROP added on node-a mid-flow: a chain
/// `KUBE-NWPLCY-TEST` jumped to from FORWARD drops the broken
/// connection's packets (by its client port); the other connection to the
/// same backend goes on. The client's line is never echoed; nattrace reads
/// the filter rules again when the flow fails and names the rule as
/// iptables-save writes it: `dropped_by_rule`, phase established.
fn policy_drop_mid_flow(mode: ProxyMode) {
    policy_drop_on(mode, Datapath::Bridge);
}

fn policy_drop_on(mode: ProxyMode, datapath: Datapath) {
    let _lock = tracing_lock();
    let lab = lab_on(mode, datapath);
    let scratch = lab::Scratch::new("established");
    let record = scratch.path("policy-drop.rec");
    let mut t = start(&lab, &record);
    let mut broken = Writer::open(&lab, WEB_SERVICE_IP, BROKEN_PORT);
    let mut healthy = Writer::open(&lab, WEB_SERVICE_IP, HEALTHY_PORT);
    broken.exchange(3);
    healthy.exchange(3);

    let client = lab
        .pod_ip(presets::CLIENT_POD)
        .expect("the client's address");
    let chain = "KUBE-NWPLCY-TEST";
    let port = BROKEN_PORT.to_string();
    let src = format!("{client}/32");
    for args in [
        vec!["iptables", "-N", chain],
        vec!["iptables", "-I", "FORWARD", "-j", chain],
        vec![
            "iptables", "-A", chain, "-s", &src, "-p", "tcp", "-m", "tcp", "--sport", &port, "-j",
            "DROP",
        ],
    ] {
        lab.run(NODE_A, &args).expect("the policy rule in node-a");
    }
    let written = lab
        .run(NODE_A, &["iptables", "-S", chain])
        .expect("iptables -S");
    let rule = written
        .lines()
        .find(|l| l.starts_with(&format!("-A {chain} ")))
        .expect("the rule as written")
        .trim()
        .to_string();
    assert_eq!(
        broken.send("after"),
        "stalled",
        "the dropped connection echoes"
    );
    healthy.exchange(3);
    let line = t.wait_line(EVENT_TIMEOUT, |l| l.contains("\"phase\":\"established\""));
    if line.is_none() {
        // What CI needs to find out why: the recording stays, and what
        // nattrace printed is in the message.
        t.terminate();
        let done = t.wait(ATTACH_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
        panic!(
            "nattrace reports the broken connection; its recording is kept at {}; it printed:\n{}\n{}",
            record.display(),
            done.stdout.join("\n"),
            done.stderr
        );
    }
    healthy.exchange(3);
    t.terminate();
    let done = t.wait(ATTACH_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    let flow = assert_broken(&done, &record, "dropped_by_rule", &[HEALTHY_PORT]);
    assert_eq!(flow["verdict"], "dropped", "{flow}");
    let text = flow["cause_text"].as_str().unwrap_or_default();
    assert!(
        text.contains(&format!("`{rule}`")) && text.contains(chain),
        "the rule named as written ({rule}): {text}"
    );
}

both_modes!(
    policy_drop_mid_flow: root_policy_drop_mid_flow_iptables,
    root_policy_drop_mid_flow_nftables
);

/// A second DNS Service whose only endpoint is on the other node (the
/// UDP twin's).
const DNS_B_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(100, 64, 0, 11);
const UDP_BROKEN_PORT: u16 = 41031;
const UDP_HEALTHY_PORT: u16 = 41032;

/// One `dig` from `port` to `server`: whether it got the answer.
fn dig_from(lab: &Lab, server: Ipv4Addr, port: u16) -> bool {
    let out = lab
        .exec_timeout(
            presets::CLIENT_POD,
            &[
                "dig",
                "-b",
                &format!("0.0.0.0#{port}"),
                &format!("@{server}"),
                presets::DNS_NAME,
                "A",
                "+time=1",
                "+tries=1",
            ],
            Duration::from_secs(10),
        )
        .expect("running dig");
    let text = String::from_utf8_lossy(&out.stdout);
    text.contains("status: NOERROR") && text.contains(&WEB_SERVICE_IP.to_string())
}

/// A long-lived UDP 5-tuple (a client that keeps its source port, as a
/// resolver or statsd client does): its first exchanges through the DNS
/// Service are answered, then the same-node DNS server stops (its pod
/// stays: the query is dropped NO_SOCKET there). The later exchange fails
/// while the first succeeded: a verdict with phase established (`no_reply`
/// mid-stream, the NO_SOCKET drop in its attempt), not the first
/// exchange's `ok` nor a `no_reply` on it. The twin on another source
/// port to the other node's DNS pod stays `ok`.
fn udp_later_exchange_fails(mode: ProxyMode) {
    let _lock = tracing_lock();
    let mut spec = presets::dns(presets::Dns::default()).service(
        ServiceSpec::new(
            "kube-system",
            "dns-b",
            "dns",
            DNS_B_SERVICE_IP,
            53,
            Protocol::Udp,
        )
        .endpoint(presets::REMOTE_DNS_POD, 53),
    );
    spec.kube_proxy.mode = mode;
    let lab = build_lab(spec);
    let scratch = lab::Scratch::new("established");
    let record = scratch.path("udp-later.rec");
    let node = lab.node_netns(NODE_A).expect("node-a").path();
    let args: Vec<String> = [
        "--svc",
        &format!("{}:53", presets::DNS_SERVICE_IP),
        "--svc",
        &format!("{DNS_B_SERVICE_IP}:53"),
        "--netns",
        &node.display().to_string(),
        "--output",
        "json",
        "--reply-timeout",
        "1000",
        "--write",
        &record.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut t = Nattrace::spawn(&nattrace(), &args, &[], false).expect("starting nattrace");
    t.wait_started(ATTACH_TIMEOUT)
        .unwrap_or_else(|e| panic!("{e:#}"));
    for _ in 0..3 {
        assert!(dig_from(&lab, presets::DNS_SERVICE_IP, UDP_BROKEN_PORT));
        assert!(dig_from(&lab, DNS_B_SERVICE_IP, UDP_HEALTHY_PORT));
    }
    // Both flows' first exchanges are decided `ok` before the break.
    for port in [UDP_BROKEN_PORT, UDP_HEALTHY_PORT] {
        let line = t.wait_line(EVENT_TIMEOUT, |l| {
            l.contains("\"verdict\":\"ok\"") && l.contains(&format!(":{port}\""))
        });
        assert!(line.is_some(), "the first exchange from port {port} is ok");
    }
    lab.stop_pod_servers(presets::DNS_POD)
        .expect("stopping the same-node DNS server");
    assert!(
        !dig_from(&lab, presets::DNS_SERVICE_IP, UDP_BROKEN_PORT),
        "the client's symptom: no answer"
    );
    assert!(dig_from(&lab, DNS_B_SERVICE_IP, UDP_HEALTHY_PORT));
    let line = t.wait_line(EVENT_TIMEOUT, |l| l.contains("\"phase\":\"established\""));
    assert!(line.is_some(), "nattrace reports the later exchange");
    assert!(dig_from(&lab, DNS_B_SERVICE_IP, UDP_HEALTHY_PORT));
    t.terminate();
    let done = t.wait(ATTACH_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    let live = failed_trace_flows(&done);
    let established: Vec<&Value> = live
        .iter()
        .filter(|f| f["phase"] == "established")
        .collect();
    assert_eq!(established.len(), 1, "{}", done.describe());
    let broken = established[0];
    println!(
        "established report: {} / {} — {}",
        broken["verdict"], broken["cause"], broken["detail"]
    );
    assert_eq!(client_port(broken), UDP_BROKEN_PORT, "{broken}");
    assert_eq!(broken["proto"], "udp", "{broken}");
    // The query dropped at the backend's namespace (no listener:
    // NO_SOCKET) is the attempt's evidence; no reply reached the client.
    let verdict = broken["verdict"].as_str().unwrap_or_default();
    assert!(verdict == "no_reply" || verdict == "dropped", "{broken}");
    assert_eq!(broken["attempts"][0]["dropped"], "NO_SOCKET", "{broken}");
    assert!(
        broken["established"]["good_replies"].as_u64().unwrap_or(0) >= 1,
        "an answered exchange after the first was good: {broken}"
    );
    for port in [UDP_BROKEN_PORT, UDP_HEALTHY_PORT] {
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
            .any(|f| client_port(f) == UDP_HEALTHY_PORT && f["verdict"] != "ok"),
        "{}",
        done.describe()
    );
    // What the healthy long-lived UDP flow cost (docs/DESIGN.md): its
    // events, grouped into exchanges (an exchange takes a few ms, digs are
    // a process start apart). The 3 exchanges made once its `ok` was out
    // (and the kernel muted it) cost none.
    let mut ts: Vec<u64> = std::fs::read_to_string(&record)
        .expect("the recording")
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["kind"] == "event")
        .filter(|v| v["sport"] == UDP_HEALTHY_PORT || v["dport"] == UDP_HEALTHY_PORT)
        .filter_map(|v| v["ts_ns"].as_u64())
        .collect();
    ts.sort_unstable();
    let exchanges = 1 + ts.windows(2).filter(|w| w[1] - w[0] > 20_000_000).count();
    println!(
        "healthy UDP flow: {} events in {exchanges} of its 6 exchanges",
        ts.len()
    );
    assert!(exchanges <= 3, "exchanges after the mute cost events");
    // Live == analyze.
    let key = |f: &Value| {
        (
            client_port(f),
            f["phase"].as_str().unwrap_or("opening").to_string(),
            f["verdict"].clone(),
            f["cause"].clone(),
            f["detail"].clone(),
        )
    };
    let mut a: Vec<_> = live.iter().map(key).collect();
    let mut b: Vec<_> = analyze(&record).iter().map(key).collect();
    a.sort_by_key(|k| format!("{k:?}"));
    b.sort_by_key(|k| format!("{k:?}"));
    assert_eq!(a, b, "live == analyze");
}

both_modes!(
    udp_later_exchange_fails: root_udp_later_exchange_fails_iptables,
    root_udp_later_exchange_fails_nftables
);

const IDLE_PORT: u16 = 41016;

/// Connections opened before nattrace started (their openings unseen) are
/// watched too, and judged on positive evidence only: the broken one (a
/// policy DROP added mid-flow) is reported with phase established, the
/// busy twin is `ok` (its first reply after the start, reverse-NATed), and
/// an idle one that sends nothing while traced gets no verdict at all
/// (never `no_reply` on absence).
fn unseen_flows_are_watched(mode: ProxyMode) {
    let _lock = tracing_lock();
    let lab = lab(mode);
    let mut broken = Writer::open(&lab, WEB_SERVICE_IP, BROKEN_PORT);
    let mut healthy = Writer::open(&lab, WEB_SERVICE_IP, HEALTHY_PORT);
    let mut idle = Writer::open(&lab, WEB_SERVICE_IP, IDLE_PORT);
    broken.exchange(2);
    healthy.exchange(2);
    idle.exchange(2);
    let scratch = lab::Scratch::new("established");
    let record = scratch.path("unseen.rec");
    let mut t = start(&lab, &record);
    broken.exchange(3);
    healthy.exchange(3);
    for port in [BROKEN_PORT, HEALTHY_PORT] {
        let line = t.wait_line(EVENT_TIMEOUT, |l| {
            l.contains("\"verdict\":\"ok\"") && l.contains(&format!(":{port}\""))
        });
        assert!(line.is_some(), "the unseen flow from port {port} is ok");
    }
    let client = lab
        .pod_ip(presets::CLIENT_POD)
        .expect("the client's address");
    let chain = "KUBE-NWPLCY-TEST";
    let port = BROKEN_PORT.to_string();
    let src = format!("{client}/32");
    for args in [
        vec!["iptables", "-N", chain],
        vec!["iptables", "-I", "FORWARD", "-j", chain],
        vec![
            "iptables", "-A", chain, "-s", &src, "-p", "tcp", "-m", "tcp", "--sport", &port, "-j",
            "DROP",
        ],
    ] {
        lab.run(NODE_A, &args).expect("the policy rule in node-a");
    }
    assert_eq!(
        broken.send("after"),
        "stalled",
        "the dropped connection echoes"
    );
    healthy.exchange(3);
    let line = t.wait_line(EVENT_TIMEOUT, |l| l.contains("\"phase\":\"established\""));
    assert!(
        line.is_some(),
        "nattrace reports the broken unseen connection"
    );
    healthy.exchange(2);
    t.terminate();
    let done = t.wait(ATTACH_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    let flow = assert_broken(&done, &record, "dropped_by_rule", &[HEALTHY_PORT]);
    assert_eq!(flow["verdict"], "dropped", "{flow}");
    let live = done.flows().expect("flows");
    for f in live.iter().filter(|f| f["phase"].is_null()) {
        assert_eq!(f["opening_seen"], false, "begun before the start: {f}");
    }
    assert!(
        !live.iter().any(|f| client_port(f) == IDLE_PORT),
        "the idle connection gets no verdict: {}",
        done.describe()
    );
    assert_eq!(idle.send("still"), "echo still", "the idle one was fine");
}

both_modes!(
    unseen_flows_are_watched: root_unseen_flows_are_watched_iptables,
    root_unseen_flows_are_watched_nftables
);

/// The same cases on a routed node (tests/tests/routed.rs's datapath: pod
/// veths routed by /32 routes, no bridge, so no br_netfilter): the
/// backend's bare RST and a policy DROP in FORWARD are named the same.
fn routed_backend_restarted(mode: ProxyMode) {
    backend_restarted_on(mode, false, Datapath::Routed);
}

both_modes!(
    routed_backend_restarted: root_routed_backend_restarted_mid_flow_iptables,
    root_routed_backend_restarted_mid_flow_nftables
);

fn routed_policy_drop(mode: ProxyMode) {
    policy_drop_on(mode, Datapath::Routed);
}

both_modes!(
    routed_policy_drop: root_routed_policy_drop_mid_flow_iptables,
    root_routed_policy_drop_mid_flow_nftables
);

/// A process of the lab in a pod, killed when dropped.
struct PodProcess(Child);

impl Drop for PodProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `lab-server ARGS` in `pod`, its stdout's lines sent to the receiver.
fn in_pod(lab: &Lab, pod: &str, args: &[&str]) -> (PodProcess, Receiver<String>) {
    let server = lab_server_path().expect("lab-server");
    let mut cmd: Command = lab
        .netns(pod)
        .expect("the pod")
        .command(&server.to_string_lossy())
        .expect("lab-server in the pod");
    cmd.args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = cmd.spawn().expect("starting lab-server");
    let out = child.stdout.take().expect("piped");
    let lines = lab::wait::lines(out);
    (PodProcess(child), lines)
}

/// The listen queue's overflow: node-a's backend stops accepting (a
/// stalled accept loop, `lab-server backlog`: listen(4) with
/// TCP_DEFER_ACCEPT, never accept()). The client fills the queue (four
/// connections, each with its request), then opens three more and only
/// then sends their requests: the first request takes the queue's last
/// place, and the listener has no room for the other two
/// (net/ipv4/tcp_minisocks.c `tcp_check_req`, `listen_overflow`). With
/// `net.ipv4.tcp_abort_on_overflow=1` in the backend's pod it resets each
/// (`embryonic_reset`, a bare RST): connect() succeeded, the first read
/// fails with ECONNRESET about a millisecond after the SYN-ACK — inside the
/// opening's settle time, where the reset was taken as the opening's
/// evidence and the connection reported `ok`; now `refused`. At 0, the
/// default, the kernel drops each request (TCP_LISTEN_OVERFLOW) and the
/// client's read hangs: `dropped`. Either way phase established,
/// `listen_queue_overflow`. Then, at 0, one more connection: its SYN finds
/// the queue full and is dropped without a drop event (connect() times
/// out): `no_reply`, `listen_queue_overflow` (it was
/// `no_reply_through_node`). The connections that got a place, and one to
/// the other node's backend, stay `ok`.
fn listen_queue_overflow(mode: ProxyMode, abort: bool) {
    let _lock = tracing_lock();
    let lab = lab(mode);
    let scratch = lab::Scratch::new("established");
    let record = scratch.path("listen-overflow.rec");
    let backend = presets::BACKEND_POD;
    lab.stop_pod_servers(backend).expect("stopping the backend");
    let sysctl = format!("net.ipv4.tcp_abort_on_overflow={}", u8::from(abort));
    lab.run(backend, &["sysctl", "-qw", &sysctl])
        .expect("the backend pod's sysctl");
    let (_listener, ready) = in_pod(&lab, backend, &["backlog", &WEB_PORT.to_string(), "4"]);
    assert_eq!(
        ready.recv_timeout(EVENT_TIMEOUT).ok().as_deref(),
        Some("ready"),
        "the backend listens"
    );
    let mut t = start(&lab, &record);
    let mut twin = Writer::open(&lab, REMOTE_SERVICE_IP, HEALTHY_PORT);
    twin.exchange(3);
    let (_burst, lines) = in_pod(
        &lab,
        presets::CLIENT_POD,
        &[
            "burst",
            &WEB_SERVICE_IP.to_string(),
            &WEB_PORT.to_string(),
            "4",
            "3",
        ],
    );
    let mut fates = Vec::new();
    loop {
        let line = lines
            .recv_timeout(EVENT_TIMEOUT)
            .expect("the client's connections' fates");
        if line == "done" {
            break;
        }
        fates.push(line);
    }
    println!("client: {fates:?}");
    let ports = |word: &str| -> Vec<u16> {
        fates
            .iter()
            .filter_map(|l| l.strip_prefix(word)?.trim().split(' ').next()?.parse().ok())
            .collect()
    };
    let (filled, open, reset) = (ports("filled"), ports("open"), ports("reset"));
    assert_eq!(filled.len(), 4, "four filled the queue: {fates:?}");
    // The client's symptom: two reset after connect() (abort), or all
    // three waiting for an answer (no abort; the listener never answers).
    let (burst, verdict) = if abort {
        assert_eq!((open.len(), reset.len()), (1, 2), "{fates:?}");
        ([&open[..], &reset[..]].concat(), "refused")
    } else {
        assert_eq!((open.len(), reset.len()), (3, 0), "{fates:?}");
        (open.clone(), "dropped")
    };
    twin.exchange(3);
    let mut broken = Vec::new();
    for _ in 0..2 {
        let line = t.wait_line(EVENT_TIMEOUT, |l| {
            l.contains("\"phase\":\"established\"")
                && burst.iter().any(|p| l.contains(&format!(":{p}\"")))
                && !broken.iter().any(|p| l.contains(&format!(":{p}\"")))
        });
        let Some(line) = line else {
            t.terminate();
            let done = t.wait(ATTACH_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
            panic!("nattrace did not report the overflow: {}", done.describe());
        };
        let flow: Value = serde_json::from_str(&line).expect("a JSON line");
        broken.push(client_port(&flow));
    }
    // The queue full, a new connection's SYN is dropped without a trace
    // (no drop event): its connect() times out.
    let unanswered = (!abort).then(|| {
        let (_client, lines) = in_pod(
            &lab,
            presets::CLIENT_POD,
            &[
                "burst",
                &WEB_SERVICE_IP.to_string(),
                &WEB_PORT.to_string(),
                "1",
                "0",
            ],
        );
        assert_eq!(
            lines.recv_timeout(EVENT_TIMEOUT),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected),
            "the client's symptom: connect() timed out"
        );
        let line = t.wait_line(EVENT_TIMEOUT, |l| l.contains("\"verdict\":\"no_reply\""));
        let line = line.expect("nattrace reports the unanswered SYN");
        client_port(&serde_json::from_str(&line).expect("a JSON line"))
    });
    twin.exchange(3);
    t.terminate();
    let done = t.wait(ATTACH_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    let live = failed_trace_flows(&done);
    let replayed = analyze(&record);
    for flows in [&live, &replayed] {
        for &p in &broken {
            let of_port: Vec<&Value> = flows.iter().filter(|f| client_port(f) == p).collect();
            let established: Vec<&&Value> = of_port
                .iter()
                .filter(|f| f["phase"] == "established")
                .collect();
            assert_eq!(established.len(), 1, "port {p}: {}", done.describe());
            let f = established[0];
            println!(
                "port {p}: {} / {} — {}",
                f["verdict"], f["cause"], f["detail"]
            );
            assert_eq!(f["verdict"], verdict, "{f}");
            assert_eq!(f["cause"], "listen_queue_overflow", "{f}");
            assert!(
                of_port
                    .iter()
                    .any(|f| f["phase"].is_null() && f["verdict"] == "ok"),
                "its opening was ok: {of_port:?}"
            );
        }
        if let Some(p) = unanswered {
            let f = flows
                .iter()
                .find(|f| client_port(f) == p)
                .expect("the unanswered connection");
            println!(
                "port {p}: {} / {} — {}",
                f["verdict"], f["cause"], f["detail"]
            );
            assert_eq!(f["verdict"], "no_reply", "{f}");
            assert_eq!(f["cause"], "listen_queue_overflow", "{f}");
        }
        let placed = burst.iter().filter(|p| !broken.contains(p));
        for &p in filled.iter().chain(placed).chain([&HEALTHY_PORT]) {
            let of_port: Vec<&Value> = flows.iter().filter(|f| client_port(f) == p).collect();
            assert!(
                !of_port.is_empty() && of_port.iter().all(|f| f["verdict"] == "ok"),
                "port {p} stays ok: {of_port:?}"
            );
        }
    }
    // The collector's fixture (tracer-userspace/fixtures/established/),
    // made by `cargo xtask fixtures`.
    if abort && let Ok(dir) = std::env::var(lab::tracer::RECORD_DIR_ENV) {
        let name = format!(
            "root_listen_queue_overflow_resets_after_the_handshake_{}.rec",
            format!("{mode:?}").to_lowercase()
        );
        std::fs::copy(&record, Path::new(&dir).join(name)).expect("keeping the recording");
    }
}

fn reset_after_handshake(mode: ProxyMode) {
    listen_queue_overflow(mode, true);
}

both_modes!(
    reset_after_handshake: root_listen_queue_overflow_resets_after_the_handshake_iptables,
    root_listen_queue_overflow_resets_after_the_handshake_nftables
);

#[test]
fn root_listen_queue_overflow_drops_the_request_iptables() {
    require_root!();
    listen_queue_overflow(ProxyMode::Iptables, false);
}

/// Source ports of the connections whose close repeats its last ACK.
const SERVER_CLOSES_PORT: u16 = 41021;
const CLIENT_CLOSES_PORT: u16 = 41022;
/// A connection from `port` to node-a's backend that ends with the
/// writer's `command` (it prints `said`), the close's last ACK held in
/// `closes_second`'s namespace until the answer to the retransmitted FIN
/// is held too, then let through: `closes_second` resets the late one.
fn close_late(lab: &Lab, port: u16, command: &str, said: &str, closes_second: &str) {
    let mut w = Writer::open(lab, WEB_SERVICE_IP, port);
    w.exchange(3);
    let (src, sport, dport) = if closes_second == presets::CLIENT_POD {
        (WEB_SERVICE_IP, WEB_PORT, port)
    } else {
        (presets::CLIENT_IP, port, WEB_PORT)
    };
    let mut hold =
        Hold::start(lab, closes_second, src, sport, dport).unwrap_or_else(|e| panic!("{e:#}"));
    let before = out_rsts(lab, closes_second).expect("OutRsts");
    assert_eq!(w.send(command), said);
    hold.wait_repeated(EVENT_TIMEOUT)
        .unwrap_or_else(|e| panic!("{e:#}"));
    hold.release().expect("releasing the held ACKs");
    wait_reset(lab, closes_second, before, EVENT_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
}

/// A close whose last ACK arrives twice, after its receiver has finished
/// the connection (found by a CI run beside stress-ng: a healthy seed-000
/// curl got a second line, `dropped` mid-stream). The side that closes
/// second, in LAST_ACK, retransmits its FIN when the ACK is late; the
/// other side, in TIME_WAIT, answers it with the same ACK again
/// (net/ipv4/tcp_minisocks.c `tcp_timewait_state_process`, TCP_TW_ACK).
/// The first ACK frees the socket (net/ipv4/tcp_input.c
/// `tcp_rcv_state_process`, TCP_LAST_ACK → `tcp_done`); the second finds
/// none (dropped with NO_SOCKET; at a port that listens, the listener takes
/// it: `case TCP_LISTEN: if (th->ack)`) and is answered with a bare RST
/// (`tcp_v4_send_reset`), which ends the TIME_WAIT socket. Both
/// applications had closed: nothing failed. The late ACKs are held in the
/// pod by `lab-server hold` (NFQUEUE: held, not dropped) until the
/// retransmission's answer is held too: the server closes first (the
/// writer's `close-me`; the client's kernel resets), then the client
/// (`close`; the backend's kernel resets). Each connection is `ok` and
/// nothing more, exit 0, live and analysed; the resets are counted in the
/// pods, so each race did happen. The twin to the other backend, kept
/// busy, stays `ok`.
fn late_ack_of_a_close(mode: ProxyMode) {
    let _lock = tracing_lock();
    let lab = lab(mode);
    let scratch = lab::Scratch::new("established");
    let record = scratch.path("late-ack.rec");
    let mut t = start(&lab, &record);
    let mut twin = Writer::open(&lab, REMOTE_SERVICE_IP, HEALTHY_PORT);
    twin.exchange(3);
    // The server closes first: the client's kernel resets the late ACK.
    close_late(
        &lab,
        SERVER_CLOSES_PORT,
        "close-me",
        "eof",
        presets::CLIENT_POD,
    );
    // The client closes first: the backend's kernel resets it.
    close_late(
        &lab,
        CLIENT_CLOSES_PORT,
        "close",
        "closed",
        presets::BACKEND_POD,
    );

    twin.exchange(3);
    t.terminate();
    let done = t.wait(ATTACH_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(done.status.code(), Some(0), "{}", done.describe());
    let live = done
        .flows()
        .unwrap_or_else(|e| panic!("{e:#}\n{}", done.describe()));
    for flows in [&live, &analyze(&record)] {
        for port in [SERVER_CLOSES_PORT, CLIENT_CLOSES_PORT, HEALTHY_PORT] {
            let of_port: Vec<&Value> = flows.iter().filter(|f| client_port(f) == port).collect();
            assert_eq!(of_port.len(), 1, "port {port}: {}", done.describe());
            assert_eq!(of_port[0]["verdict"], "ok", "{}", of_port[0]);
        }
    }
}

both_modes!(
    late_ack_of_a_close: root_a_late_ack_of_a_close_is_no_failure_iptables,
    root_a_late_ack_of_a_close_is_no_failure_nftables
);
