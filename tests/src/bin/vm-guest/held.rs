//! Seed 000 with the kernel's per-flow buffer on (no `-v`), the way a user
//! runs nattrace: the other runs pass `-v` to check every hop, which turns
//! the buffer off, so without this the guests' kernels would verify
//! `tracer-ebpf/src/held.rs` but never run it.
//!
//! Checks the verdicts and causes are those of the `-v` runs and the event
//! budget of docs/DESIGN.md: a healthy connection costs at most 3 events
//! with the rest of its handshake discarded in the kernel; a broken one has
//! its held events sent (flushed by the kernel or pulled at the deadline).
use std::net::SocketAddrV4;

use super::{CONNECTIONS, Checks, LabFacts, Scenario, trace};
use lab::presets::{BACKEND_IP, WEB_PORT};

pub fn check(
    checks: &mut Checks,
    nattrace: &std::path::Path,
    sc: &Scenario,
    backend: &str,
    facts: &LabFacts,
) {
    let name = format!("{} {backend} held", sc.name);
    let result = trace(nattrace, backend, facts, None, false)
        .map_err(|e| format!("{e:#}"))
        .and_then(|run| judge(sc, &run.done));
    checks.record(&name, result);
}

fn judge(sc: &Scenario, done: &lab::tracer::Finished) -> Result<String, String> {
    let fail = |why: String| Err(format!("{why}\n{}", done.describe()));
    let flows = done.flows().map_err(|e| format!("{e:#}"))?;
    let summary = done.summary().map_err(|e| format!("{e:#}"))?;
    if done.status.code() != Some(sc.exit) {
        return fail(format!("exit status {}, expected {}", done.status, sc.exit));
    }
    if flows.len() < CONNECTIONS {
        return fail(format!(
            "{} flows for {CONNECTIONS} connections",
            flows.len()
        ));
    }
    let backend_addr = SocketAddrV4::new(BACKEND_IP, WEB_PORT).to_string();
    for f in &flows {
        if f["verdict"].as_str() != Some(sc.verdict)
            || f["cause"].as_str() != sc.cause
            || f["backend"] != backend_addr.as_str()
        {
            return fail(format!(
                "flow {} via {}: {} cause {}, expected {} cause {:?}",
                f["client"], f["backend"], f["verdict"], f["cause"], sc.verdict, sc.cause
            ));
        }
    }
    let count = |k: &str| summary[k].as_u64().unwrap_or(0);
    let (events, held) = (count("events"), count("buffered_flows"));
    if held < CONNECTIONS as u64 {
        return fail(format!(
            "{held} held flows (`buffered_flows`) for {CONNECTIONS} connections: the kernel held none"
        ));
    }
    let budget = if sc.connects {
        let per_flow = events as f64 / flows.len() as f64;
        if per_flow > 3.0 || count("held_discarded") == 0 {
            return fail(format!(
                "{events} events for {} healthy flows, {} held events discarded (want ≤ 3 per flow, some discarded)",
                flows.len(),
                count("held_discarded")
            ));
        }
        format!("{events} events for {} flows", flows.len())
    } else {
        let sent = count("flushed_events") + count("pulled_events");
        if sent == 0 {
            return fail("no held event was flushed or pulled for the broken flows".into());
        }
        format!("{sent} held events sent")
    };
    Ok(format!(
        "exit {}, {} flows {}; {budget}",
        sc.exit,
        flows.len(),
        sc.verdict
    ))
}
