//! A full conntrack table (issue 22, `conntrack_table_full`), for real in
//! the guest: `nf_conntrack_max` is one limit for every namespace and only
//! the initial namespace may write it, so this runs only here, in the
//! guest's own root namespace (never on the build machine's), and puts the
//! guest's value back at the end (also on failure).
//!
//! Seed 000 healthy: the node's conntrack entries flushed, the limit set
//! to the node's count plus [`FILL`], the table filled with [`FILL`]
//! long-lived streams from the client pod through the Service (ESTABLISHED
//! and ASSURED: `early_drop` and the gc worker cannot evict them). Then,
//! under nattrace (`--backend kprobe`, `--write`):
//! - the next connection from the client fails (its SYNs time out: the
//!   client's symptom, checked first), and nattrace names it `dropped` /
//!   `conntrack_table_full`;
//! - the healthy twin: the limit raised back, the next connection gets its
//!   HTTP 200 and is `ok`;
//! - `nattrace analyze` of the recording decides both the same (the
//!   `conntrack` line carries the table read after the drop).
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use lab::Lab;
use lab::presets::{self, CLIENT_IP, NODE_A, Seed000, WEB_PORT, WEB_SERVICE_IP};
use lab::tracer::{Echo, Nattrace, is_flow_line, say};
use serde_json::Value;

use super::{ATTACH_TIMEOUT, Checks, established::Stream};

/// Connections that fill the table.
const FILL: u64 = 3;
/// The client's source ports for the failing and the healthy connection
/// (below the ephemeral range, so the streams cannot hold them).
const FULL_PORT: u16 = 30_001;
const OK_PORT: u16 = 30_002;
/// Only bounds a hang: every wait ends on its event.
const EVENT_TIMEOUT: Duration = Duration::from_secs(90);
const MAX: &str = "/proc/sys/net/netfilter/nf_conntrack_max";

/// `fixture`: the name to print the recording under (`--record-fixtures`,
/// record.rs), else it is only analysed and removed.
pub fn run(checks: &mut Checks, nattrace: &Path, backends: &[&str], fixture: Option<&str>) {
    let Some(&backend) = backends
        .iter()
        .find(|b| **b == "kprobe")
        .or(backends.first())
    else {
        return;
    };
    let name = format!("conntrack table full {backend}");
    let t = Instant::now();
    let fixture = fixture.map(|release| super::record::name(release, backend, "table_full"));
    let result = one(nattrace, backend, fixture.as_deref())
        .map(|ok| format!("{ok} (in {:.1}s)", t.elapsed().as_secs_f64()));
    checks.record(&name, result.map_err(|e| format!("{e:#}")));
}

/// The guest's `nf_conntrack_max`, put back when dropped.
struct RestoreMax(u64);

impl RestoreMax {
    fn set(&self, max: u64) -> anyhow::Result<()> {
        std::fs::write(MAX, format!("{max}\n")).with_context(|| format!("writing {MAX}"))
    }
}

impl Drop for RestoreMax {
    fn drop(&mut self) {
        if let Err(e) = self.set(self.0) {
            say(&format!("vm-guest: info could not restore {MAX}: {e:#}"));
        }
    }
}

fn read_u64(text: &str) -> anyhow::Result<u64> {
    text.trim()
        .parse()
        .with_context(|| format!("not a number: {text:?}"))
}

fn node_count(lab: &Lab) -> anyhow::Result<u64> {
    read_u64(&lab.run(
        NODE_A,
        &["cat", "/proc/sys/net/netfilter/nf_conntrack_count"],
    )?)
}

fn one(nattrace: &Path, backend: &str, fixture: Option<&str>) -> anyhow::Result<String> {
    let lab = Lab::build(presets::seed000(Seed000 {
        bridge_nf_call_iptables: true,
        backend: presets::Backend::SameNode,
    }))
    .context("building the lab")?;
    let node = lab.node_netns(NODE_A)?.path();
    let client = lab.netns(presets::CLIENT_POD)?.path();
    let restore = RestoreMax(read_u64(&std::fs::read_to_string(MAX)?)?);

    // The lab's own entries (its checks' connections, in TIME_WAIT) would
    // time out during the case and make room.
    lab.run(NODE_A, &["conntrack", "-F"])?;
    let before = node_count(&lab)?;
    // The streams first, the limit after them at what the table holds
    // then: a limit set before them (the count plus FILL) was sometimes
    // reached early by an entry the node made meanwhile (6.1 guest, one CI
    // run: the third stream's connect timed out), since the count it
    // guards is the namespace's own and grows with anything it tracks
    // (net/netfilter/nf_conntrack_core.c __nf_conntrack_alloc: `ct_count >
    // nf_conntrack_max` on the per-netns count).
    let mut streams = Vec::new();
    for _ in 0..FILL {
        let s = Stream::open(&client, WEB_SERVICE_IP).context("a stream filling the table")?;
        s.wait_lines(2)?;
        streams.push(s);
    }
    let count = node_count(&lab)?;
    if count < FILL {
        bail!("{count} conntrack entries in the node namespace with {FILL} streams open");
    }
    let max = count;
    restore.set(max)?;
    say(&format!(
        "vm-guest: info conntrack table: {count} entries in the node namespace, nf_conntrack_max {max} (was {}, {before} after the flush)",
        restore.0
    ));

    let record = PathBuf::from(format!("/tmp/vm-table-full-{backend}.rec"));
    let svc = format!("{WEB_SERVICE_IP}:{WEB_PORT}");
    let args = super::recorded_trace_args(backend, &[svc], &node, &record);
    let mut t = Nattrace::spawn_echoing(nattrace, &args, super::TRACER_ENV, Echo::Stderr)?;
    let first = t.wait_started(ATTACH_TIMEOUT)?;
    if !first.contains("\"kind\":\"start\"") {
        bail!("first line: {first}");
    }

    // The client's symptom first: its SYNs are dropped, connect times out.
    match get_from(&client, FULL_PORT, Duration::from_secs(3)) {
        Ok(status) => bail!("the connection with the table full succeeded: {status}"),
        Err(e) => say(&format!(
            "vm-guest: info with the table full the client saw: {e}"
        )),
    }
    let on_port = |port: u16| {
        let needle = format!("\"client\":\"{CLIENT_IP}:{port}\"");
        move |l: &str| is_flow_line(l) && l.contains(&needle)
    };
    let full_line = t.wait_line(EVENT_TIMEOUT, on_port(FULL_PORT));

    restore.set(restore.0)?;
    let ok = get_from(&client, OK_PORT, Duration::from_secs(10));
    let ok_line = t.wait_line(EVENT_TIMEOUT, on_port(OK_PORT));
    t.terminate();
    let done = t.wait(EVENT_TIMEOUT)?;
    for s in &streams {
        s.stop();
    }
    let ok = ok.map_err(|e| anyhow::anyhow!("after raising the limit back: {e}"))?;
    let (Some(full_line), Some(ok_line)) = (full_line, ok_line) else {
        bail!(
            "no flow for port {FULL_PORT} or {OK_PORT}\n{}",
            done.describe()
        );
    };
    if done.status.code() != Some(1) {
        bail!(
            "exit status {}, expected 1\n{}",
            done.status,
            done.describe()
        );
    }
    let full: Value = serde_json::from_str(&full_line)?;
    let healthy: Value = serde_json::from_str(&ok_line)?;
    judge(&full, &healthy).map_err(|e| anyhow::anyhow!("{e}\n{}", done.describe()))?;

    let analyzed = analyze(nattrace, &record);
    if let Some(name) = fixture {
        super::record::print(name, &record).map_err(|e| anyhow::anyhow!(e))?;
    }
    let _ = std::fs::remove_file(&record);
    let analyzed = analyzed?;
    let find = |port: u16| {
        let needle = format!("{CLIENT_IP}:{port}");
        analyzed.iter().find(|f| f["client"] == needle.as_str())
    };
    for (port, live) in [(FULL_PORT, &full), (OK_PORT, &healthy)] {
        let Some(offline) = find(port) else {
            bail!("analyze has no flow for port {port}: {analyzed:?}");
        };
        if offline["verdict"] != live["verdict"] || offline["cause"] != live["cause"] {
            bail!(
                "analyze decided port {port} {} cause {}, live {} cause {}",
                offline["verdict"],
                offline["cause"],
                live["verdict"],
                live["cause"]
            );
        }
    }
    Ok(format!(
        "dropped / conntrack_table_full ({}); after raising the limit back: {ok}, ok; analyze agrees",
        full["detail"].as_str().unwrap_or_default()
    ))
}

fn judge(full: &Value, healthy: &Value) -> anyhow::Result<()> {
    if full["verdict"] != "dropped" || full["cause"] != "conntrack_table_full" {
        bail!(
            "the connection with the table full: {} cause {} ({}), expected dropped / conntrack_table_full",
            full["verdict"],
            full["cause"],
            full["detail"]
        );
    }
    if !full["backend"].is_null() {
        bail!("the dropped SYN was DNATed to {}", full["backend"]);
    }
    if healthy["verdict"] != "ok" {
        bail!(
            "the healthy twin: {} cause {} ({})",
            healthy["verdict"],
            healthy["cause"],
            healthy["detail"]
        );
    }
    Ok(())
}

/// `GET /` from the client pod, from source port `port`; the status line.
fn get_from(client_ns: &Path, port: u16, timeout: Duration) -> Result<String, String> {
    let ns = client_ns.to_path_buf();
    // setns moves only the calling thread: a thread of its own.
    std::thread::spawn(move || -> Result<String, String> {
        let f = std::fs::File::open(&ns).map_err(|e| format!("opening {}: {e}", ns.display()))?;
        nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| format!("setns: {e}"))?;
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
            .map_err(|e| format!("socket: {e}"))?;
        sock.set_reuse_address(true)
            .map_err(|e| format!("SO_REUSEADDR: {e}"))?;
        let local = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port));
        sock.bind(&local.into())
            .map_err(|e| format!("bind {local}: {e}"))?;
        let addr = SocketAddr::V4(SocketAddrV4::new(WEB_SERVICE_IP, WEB_PORT));
        sock.connect_timeout(&addr.into(), timeout)
            .map_err(|e| format!("connect {addr} from port {port}: {e}"))?;
        super::http_status(sock.into(), addr, Duration::from_secs(5))
    })
    .join()
    .unwrap_or_else(|_| Err("panicked".into()))
}

/// `nattrace analyze FILE --output json`: its flows.
fn analyze(nattrace: &Path, record: &Path) -> anyhow::Result<Vec<Value>> {
    let out = Command::new(nattrace)
        .arg("analyze")
        .arg(record)
        .args(["--output", "json"])
        .output()
        .context("running nattrace analyze")?;
    let flows: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| is_flow_line(l))
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    if flows.is_empty() {
        bail!(
            "nattrace analyze printed no flows ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(flows)
}
