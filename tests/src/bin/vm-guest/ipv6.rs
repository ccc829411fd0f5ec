//! Seed 000 over IPv6 in the guest: the dual-stack lab node with
//! `bridge-nf-call-ip6tables=0` (every flow `reply_not_reverse_nated`,
//! naming it) and healthy (every flow `ok`), traced by each backend the
//! kernel has — so the kprobe backend's IPv6 NAT probe runs on 6.1/6.12.

use std::fs::File;
use std::io::{Read as _, Write as _};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use lab::Lab;
use lab::dual_stack::service_ip6;
use lab::presets::{self, Seed000, WEB_PORT, WEB_SERVICE_IP};
use lab::tracer::{Echo, Nattrace, say};
use serde_json::Value;

use super::{ATTACH_TIMEOUT, CONNECT_TIMEOUT, CONNECTIONS, Checks};

/// The cause nattrace names for a same-node IPv6 reply bridged past ip6tables.
pub(super) const CAUSE6: &str = "bridge_nf_call_ip6tables_off";

fn web6() -> SocketAddr {
    SocketAddr::new(IpAddr::V6(service_ip6(WEB_SERVICE_IP)), WEB_PORT)
}

/// Both scenarios with every backend in `backends`.
pub(super) fn run(checks: &mut Checks, nattrace: &Path, backends: &[&str]) -> anyhow::Result<()> {
    for (name, ip6tables, exit, verdict, cause) in [
        (
            "seed000-ipv6-broken",
            false,
            1,
            "reply_not_reverse_nated",
            Some(CAUSE6),
        ),
        ("seed000-ipv6-healthy", true, 0, "ok", None),
    ] {
        let t = Instant::now();
        let mut spec = presets::seed000(Seed000::default()).dual_stack();
        for node in &mut spec.nodes {
            node.bridge_nf_call_ip6tables = ip6tables;
        }
        let lab = Lab::build(spec).with_context(|| format!("building the {name} lab"))?;
        say(&format!(
            "vm-guest: {name} lab up in {:.1}s",
            t.elapsed().as_secs_f64()
        ));
        let backend6 = SocketAddr::new(
            IpAddr::V6(lab.pod_ip6(presets::BACKEND_POD).expect("dual-stack pod")),
            WEB_PORT,
        )
        .to_string();
        for &backend in backends {
            let run = format!("{name} {backend}");
            let result = trace(nattrace, backend, &lab).and_then(|(status, flows, ok)| {
                judge(&flows, status, ok, exit, verdict, cause, &backend6)
            });
            checks.record(&run, result.map_err(|e| e.to_string()));
        }
    }
    Ok(())
}

/// One run: (exit status, flows, connections that succeeded).
fn trace(
    nattrace: &Path,
    backend: &str,
    lab: &Lab,
) -> anyhow::Result<(Option<i32>, Vec<Value>, usize)> {
    let node = lab.node_netns(presets::NODE_A)?.path();
    let client = lab.netns(presets::CLIENT_POD)?.path();
    let args: Vec<String> = [
        "--backend",
        backend,
        "--svc",
        &web6().to_string(),
        "--netns",
        &node.to_string_lossy(),
        "--output",
        "json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut tracer = Nattrace::spawn_echoing(nattrace, &args, super::TRACER_ENV, Echo::Stderr)?;
    tracer.wait_started(ATTACH_TIMEOUT)?;
    let ok = thread::scope(|s| {
        let handles: Vec<_> = (0..CONNECTIONS)
            .map(|_| s.spawn(|| get6(&client)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(false))
            .filter(|ok| *ok)
            .count()
    });
    // Stopped once every connection is decided: a fixed --duration is a
    // race on an emulated guest sharing a loaded host.
    let done = tracer.finish_after_flows(CONNECTIONS)?;
    let flows = done.flows().with_context(|| done.describe())?;
    Ok((done.status.code(), flows, ok))
}

/// A GET to the IPv6 ClusterIP from inside the client pod (this thread only).
fn get6(ns: &Path) -> bool {
    let Ok(f) = File::open(ns) else { return false };
    if nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET).is_err() {
        return false;
    }
    let Ok(mut s) = TcpStream::connect_timeout(&web6(), CONNECT_TIMEOUT) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(3)));
    let mut body = String::new();
    s.write_all(b"GET / HTTP/1.0\r\n\r\n").is_ok()
        && s.read_to_string(&mut body).is_ok()
        && body.starts_with("HTTP/1.0 200")
}

fn judge(
    flows: &[Value],
    status: Option<i32>,
    connected: usize,
    exit: i32,
    verdict: &str,
    cause: Option<&str>,
    backend6: &str,
) -> anyhow::Result<String> {
    let want_connected = if exit == 0 { CONNECTIONS } else { 0 };
    let mut problems = Vec::new();
    if connected != want_connected {
        problems.push(format!(
            "{connected}/{CONNECTIONS} connections succeeded, expected {want_connected}"
        ));
    }
    if status != Some(exit) {
        problems.push(format!("exit status {status:?}, expected {exit}"));
    }
    if flows.len() < CONNECTIONS {
        problems.push(format!(
            "{} flows for {CONNECTIONS} connections",
            flows.len()
        ));
    }
    for f in flows {
        if f["verdict"] != verdict || f["cause"].as_str() != cause || f["backend"] != backend6 {
            problems.push(format!(
                "flow {} -> {} via {}: {} cause {} (expected {verdict} cause {cause:?})",
                f["client"], f["service"], f["backend"], f["verdict"], f["cause"]
            ));
        }
    }
    if problems.is_empty() {
        Ok(format!(
            "exit {exit}, {} IPv6 flows {verdict}{}",
            flows.len(),
            cause.map(|c| format!(" ({c})")).unwrap_or_default()
        ))
    } else {
        anyhow::bail!(problems.join("\n"))
    }
}
