//! Collector replay benchmark: synthetic streams built from the recorded
//! fixtures (one template flow, copied with fresh client ports and skb
//! addresses) pushed through `Collector` on one core, the way the live loop
//! does (`push` each event, `tick` + `take_mute_candidates` every 4096).
//!
//! `cargo bench -p tracer-userspace --bench collector [-- --quick]`
//!
//! Peak memory is measured in a child process (this binary re-executed) that
//! streams 100,000 flows in without ever holding the events, so its VmHWM is
//! the collector's and not the benchmark's. With `NATTRACE_BENCH_OUT=path`
//! the results are also written there as JSON (cargo xtask bench reads it).

use std::process::Command;
use std::time::Instant;

use nattrace::collector::testing::{self, from_jsonl};
use nattrace::collector::{Collector, CollectorConfig, VerdictCounts};
use tracer_common::PacketEvent;

const FLOWS: u32 = 100_000;
/// New flows per second of trace time: 100k flows arrive within one second,
/// far inside the idle timeout, so all of them are live at the end.
const FLOW_SPACING_NS: u64 = 10_000;
const TICK_EVERY: usize = 4096;
const RSS_CHILD_ENV: &str = "NATTRACE_COLLECTOR_RSS_CHILD";
/// How many flows the memory child streams in (default [`FLOWS`]).
const RSS_FLOWS_ENV: &str = "NATTRACE_COLLECTOR_FLOWS";
/// Live flows of the scale table (issue 25): what a node with that many
/// open connections pays per event, and in memory.
const SCALE: [u32; 3] = [1_000, 10_000, 100_000];

const HEALTHY: &str = include_str!(nattrace::fixture!("seed000_healthy.jsonl"));
const MIXED: &[&str] = &[
    HEALTHY,
    include_str!(nattrace::fixture!("seed000_broken.jsonl")),
    include_str!(nattrace::fixture!("cross_node_ok.jsonl")),
    include_str!(nattrace::fixture!("dns_ok.jsonl")),
    include_str!(nattrace::fixture!("no_reply.jsonl")),
    include_str!(nattrace::fixture!("reply_dropped.jsonl")),
];

/// The collector tests' fixture node, which the templates were built for.
fn config() -> CollectorConfig {
    testing::config(Some(true))
}

/// Flow `i` of a template: its client moved to a port/host of its own, its
/// packets to skb addresses of their own, its time shifted.
fn instance(template: &[PacketEvent], i: u32, out: &mut Vec<PacketEvent>) {
    let first = template[0];
    let client = (first.saddr, first.sport);
    let port = 1024 + (i % 60_000) as u16;
    let host = (i / 60_000) as u8;
    for e in template {
        let mut e = *e;
        e.ts_ns += u64::from(i) * FLOW_SPACING_NS;
        e.skb = e.skb.wrapping_add(u64::from(i) << 16);
        for (addr, p) in [(&mut e.saddr, &mut e.sport), (&mut e.daddr, &mut e.dport)] {
            if (*addr, *p) == client {
                *p = port;
                // The third IPv4 byte of the IPv4-mapped address (tracer_common::Addr).
                let mut v4 = addr[3].to_ne_bytes();
                v4[2] = host;
                addr[3] = u32::from_ne_bytes(v4);
            }
        }
        out.push(e);
    }
}

/// Time order with a little cross-CPU skew, as the ring buffer delivers it:
/// a deterministic shuffle within windows of 8 events.
fn stream(templates: &[Vec<PacketEvent>], flows: u32) -> Vec<PacketEvent> {
    let mut events = Vec::new();
    for i in 0..flows {
        instance(&templates[i as usize % templates.len()], i, &mut events);
    }
    events.sort_by_key(|e| e.ts_ns);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for chunk in events.chunks_mut(8) {
        for j in (1..chunk.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            chunk.swap(j, (x % (j as u64 + 1)) as usize);
        }
    }
    events
}

struct Replay {
    events_per_sec: f64,
    decided: usize,
    verdicts: VerdictCounts,
}

fn replay(events: &[PacketEvent]) -> Replay {
    let mut c = Collector::new(config());
    let start = Instant::now();
    let mut decided = 0;
    for (i, ev) in events.iter().enumerate() {
        c.push(*ev);
        if i % TICK_EVERY == 0 {
            decided += c.tick(ev.ts_ns).len();
            c.take_mute_candidates();
        }
    }
    let last = events.last().map_or(0, |e| e.ts_ns);
    let (rest, summary) = c.finish(last + 10_000_000_000);
    let elapsed = start.elapsed();
    Replay {
        events_per_sec: events.len() as f64 / elapsed.as_secs_f64(),
        decided: decided + rest.len(),
        verdicts: summary.by_verdict,
    }
}

fn status_kib(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// The child: streams 100k healthy flows in flow by flow (the collector
/// reorders them), holding one flow's events at a time, and prints its memory.
fn rss_child(one_tick: bool) {
    let flows = std::env::var(RSS_FLOWS_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(FLOWS);
    let template = from_jsonl(HEALTHY);
    let baseline = status_kib("VmHWM:");
    let mut c = Collector::new(config());
    let mut buf = Vec::with_capacity(template.len());
    for i in 0..flows {
        buf.clear();
        instance(&template, i, &mut buf);
        for ev in &buf {
            c.push(*ev);
        }
        if i % 128 == 0 {
            let now = buf[0].ts_ns;
            c.tick(now);
            c.take_mute_candidates();
        }
    }
    // Past the reorder window, so the last flows leave the reorder buffer
    // and all 100k are flow state; well inside the idle timeout. Ticking on
    // in the run's steps, as the live loop would: one 50 ms jump decides
    // ~4,000 flows at once, and their reports (~8 KiB each with 32 hops)
    // outweigh the flows' own state (the "one_tick" child measures that).
    let end = buf[0].ts_ns + 50_000_000;
    let step = if one_tick {
        50_000_000
    } else {
        128 * FLOW_SPACING_NS
    };
    let mut now = buf[0].ts_ns;
    while now < end {
        now = (now + step).min(end);
        c.tick(now);
        c.take_mute_candidates();
    }
    let live = c.live_flows();
    let approx = c.approx_memory_bytes();
    let s = c.summary();
    println!(
        "{{\"flows\":{},\"evicted\":{},\"late\":{},\"live_flows\":{live},\"vm_hwm_kib\":{},\"baseline_hwm_kib\":{baseline},\"approx_bytes\":{approx}}}",
        s.flows,
        s.evicted_flows,
        s.late_events,
        status_kib("VmHWM:")
    );
}

fn memory_child(mode: &str, flows: u32) -> serde_json::Value {
    let exe = std::env::current_exe().expect("own path");
    let out = Command::new(exe)
        .env(RSS_CHILD_ENV, mode)
        .env(RSS_FLOWS_ENV, flows.to_string())
        .output()
        .expect("running the memory child");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "memory child ({}): {e}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() {
    if let Some(mode) = std::env::var_os(RSS_CHILD_ENV) {
        rss_child(mode == "one_tick");
        return;
    }
    let quick = std::env::args().any(|a| a == "--quick");
    let (reps, flows) = if quick { (2, 20_000) } else { (5, FLOWS) };
    let mut results = serde_json::Map::new();
    for (name, texts) in [("healthy", &[HEALTHY][..]), ("mixed", MIXED)] {
        let templates: Vec<Vec<PacketEvent>> = texts.iter().map(|t| from_jsonl(t)).collect();
        let events = stream(&templates, flows);
        let runs: Vec<Replay> = (0..reps).map(|_| replay(&events)).collect();
        let (med, min, max) = median(runs.iter().map(|r| r.events_per_sec).collect());
        let last = &runs[runs.len() - 1];
        println!(
            "collector {name}: {} events, {flows} flows ({} decided; ok {} / flagged {}): \
             {:.2} M events/s median (min {:.2}, max {:.2}, {reps} runs)",
            events.len(),
            last.decided,
            last.verdicts.ok,
            last.decided as u64 - last.verdicts.ok,
            med / 1e6,
            min / 1e6,
            max / 1e6
        );
        results.insert(
            name.into(),
            serde_json::json!({
                "events": events.len(), "flows": flows, "decided": last.decided,
                "ok": last.verdicts.ok, "runs": reps,
                "events_per_sec": {"median": med, "min": min, "max": max},
            }),
        );
    }
    let mut mem = memory_child("stepped", FLOWS);
    let one_tick = memory_child("one_tick", FLOWS);
    let mib = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or(0.0) / 1024.0;
    println!(
        "collector memory: {} live flows, peak RSS (VmHWM) {:.1} MiB (process baseline {:.1} MiB), tables ≈ {:.1} MiB; \
         {:.1} MiB when the last 50 ms are decided in one tick",
        mem["live_flows"],
        mib(&mem, "vm_hwm_kib"),
        mib(&mem, "baseline_hwm_kib"),
        mem["approx_bytes"].as_f64().unwrap_or(0.0) / 1048576.0,
        mib(&one_tick, "vm_hwm_kib"),
    );
    mem["one_tick_vm_hwm_kib"] = one_tick["vm_hwm_kib"].clone();
    results.insert("memory".into(), mem);
    results.insert("scale".into(), scale(quick, reps));
    if let Some(path) = std::env::var_os("NATTRACE_BENCH_OUT") {
        let text = serde_json::to_string_pretty(&results).expect("json");
        std::fs::write(&path, text).expect("writing NATTRACE_BENCH_OUT");
    }
}

/// Per-event cost and memory by live flows: the healthy stream of 1k, 10k
/// and 100k flows (all of them live at the end: spaced 10 µs apart, far
/// inside the idle timeout), replayed enough times that each size pushes
/// about as many events.
fn scale(quick: bool, reps: usize) -> serde_json::Value {
    let template = vec![from_jsonl(HEALTHY)];
    let sizes = if quick { &SCALE[..2] } else { &SCALE[..] };
    let mut rows = Vec::new();
    for &n in sizes {
        let events = stream(&template, n);
        let runs = (reps * (FLOWS / n) as usize).clamp(reps, 200);
        let (med, min, max) = median((0..runs).map(|_| replay(&events).events_per_sec).collect());
        let mem = memory_child("stepped", n);
        println!(
            "collector scale: {n} live flows: {:.2} M events/s median (min {:.2}, max {:.2}, {runs} runs); \
             peak RSS {:.1} MiB, tables ≈ {:.1} MiB",
            med / 1e6,
            min / 1e6,
            max / 1e6,
            mem["vm_hwm_kib"].as_f64().unwrap_or(0.0) / 1024.0,
            mem["approx_bytes"].as_f64().unwrap_or(0.0) / 1048576.0,
        );
        rows.push(serde_json::json!({
            "flows": n, "runs": runs,
            "events_per_sec": {"median": med, "min": min, "max": max},
            "live_flows": mem["live_flows"], "vm_hwm_kib": mem["vm_hwm_kib"],
            "baseline_hwm_kib": mem["baseline_hwm_kib"], "approx_bytes": mem["approx_bytes"],
        }));
    }
    serde_json::Value::Array(rows)
}
