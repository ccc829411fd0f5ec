//! `nattrace analyze` holds no more for a burst of flows than for the same
//! flows spread out (issue 26 item 7: 10^6 flows within 10 ms took 1.5 GB
//! where the same spread over 1000 s took 18 MB). Two synthetic recordings
//! of the same flows, written with the recording writer, are analyzed by
//! the real binary; its peak RSS (the child's rusage) is compared.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nattrace::collector::testing::{self, from_jsonl};
use nattrace::recording::{Clock, FORMAT, Header, RecordingWriter, StatsLine, VERSION};

const FLOWS: u32 = 40_000;
/// Far below FLOWS: eviction is what bounds the live flows in both runs.
const MAX_FLOWS: usize = 1_000;
const MS: u64 = 1_000_000;
/// The session's tick, as a live run records it (a `stats` line).
const TICK_NS: u64 = 200 * MS;

fn header() -> Header {
    Header {
        format: FORMAT.into(),
        version: VERSION,
        nattrace_version: "test".into(),
        kernel: "6.18".into(),
        backend: "netfilter".into(),
        backend_reason: String::new(),
        services: testing::services()
            .iter()
            .map(ToString::to_string)
            .collect(),
        facts: testing::facts(Some(true)),
        reply_timeout_ms: 1000,
        drop_reasons: Vec::new(),
        clock: Some(Clock {
            monotonic_ns: 1,
            realtime_ns: 1_700_000_000_000_000_000,
        }),
        skipped: Vec::new(),
        kube_proxy: Default::default(),
        checks: serde_json::Value::Null,
        checks_line: None,
        nf_priorities: Vec::new(),
        node: None,
        all_services: false,
        max_flows: Some(MAX_FLOWS),
        run_id: None,
        file_seq: None,
        traced_since_ns: None,
    }
}

/// `FLOWS` one-event flows (a client's SYN at the node's eth0), flow `i`
/// at `t0 + i * spacing`, with a `stats` line every [`TICK_NS`].
fn write(path: &Path, spacing_ns: u64) {
    let syn = from_jsonl(include_str!(nattrace::fixture!("no_reply.jsonl")))[0];
    let mut w = RecordingWriter::create(path, &header(), None).expect("create recording");
    let t0 = syn.ts_ns;
    let mut next_tick = t0 + TICK_NS;
    let drain = |w: &mut RecordingWriter| {
        assert!(w.drain(
            Instant::now() + Duration::from_secs(60),
            Duration::from_secs(60)
        ));
    };
    for i in 0..FLOWS {
        let mut e = syn;
        e.ts_ns = t0 + u64::from(i) * spacing_ns;
        while e.ts_ns >= next_tick {
            w.stats(StatsLine {
                now_ns: next_tick,
                ..Default::default()
            });
            next_tick += TICK_NS;
        }
        e.skb = e.skb.wrapping_add(u64::from(i) << 12);
        e.sport = 1024 + (i % 60_000) as u16;
        // The third byte of the IPv4-mapped client address (tracer_common::Addr).
        let mut v4 = e.saddr[3].to_ne_bytes();
        v4[2] = (i / 60_000) as u8;
        e.saddr[3] = u32::from_ne_bytes(v4);
        w.event(&e);
        // The writer drops what its queue cannot hold (as live): keep up.
        if i % 4096 == 0 {
            drain(&mut w);
        }
    }
    let last = t0 + u64::from(FLOWS) * spacing_ns;
    for k in 1..=10 {
        w.stats(StatsLine {
            now_ns: last + k * TICK_NS,
            ..Default::default()
        });
    }
    w.end(StatsLine {
        now_ns: last + 11 * TICK_NS,
        ..Default::default()
    });
    drain(&mut w);
    assert_eq!(w.dropped_lines(), 0, "the generator lost lines");
}

/// Peak RSS (KiB) of `nattrace analyze path`, and its summary line.
///
/// Through GNU time, not this process's rusage of its children: a spawned
/// child's peak includes the image of the process it was forked from
/// (fs/exec.c exec_mmap: setmax_mm_hiwater_rss of the old mm), i.e. this
/// test's writer buffers; time(1) forks from its own small image.
fn analyze(path: &Path) -> (u64, serde_json::Value) {
    let rss_file = path.with_extension("rss");
    let out = Command::new("/usr/bin/time")
        .arg("-f")
        .arg("%M")
        .arg("-o")
        .arg(&rss_file)
        .arg(env!("CARGO_BIN_EXE_nattrace"))
        .args(["analyze", "--output", "json"])
        .arg(path)
        .env_remove("RUST_LOG")
        // stdout's queue is a fixed 16 MiB that the burst fills faster than
        // this test reads it: the same small one for both runs.
        .env("NATTRACE_TEST_QUEUE_BYTES", "1048576")
        .stderr(Stdio::null())
        .output()
        .expect("run /usr/bin/time nattrace analyze (GNU time: apt-get install time)");
    let rss = std::fs::read_to_string(&rss_file).expect("time -o");
    let _ = std::fs::remove_file(&rss_file);
    let kib = rss
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .next_back()
        .unwrap_or_else(|| panic!("no peak RSS from time: {rss}"));
    let stdout = String::from_utf8(out.stdout).expect("utf-8");
    let summary = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["kind"] == "summary")
        .unwrap_or_else(|| {
            panic!(
                "no summary line:\n{}",
                &stdout[stdout.len().saturating_sub(2000)..]
            )
        });
    (kib, summary)
}

struct Temp(PathBuf);
impl Drop for Temp {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn analyze_of_a_burst_is_bounded_like_the_same_flows_spread_out() {
    let dir = std::env::temp_dir();
    let spread = Temp(dir.join(format!("nattrace-mem-spread-{}.rec", std::process::id())));
    let burst = Temp(dir.join(format!("nattrace-mem-burst-{}.rec", std::process::id())));
    write(&spread.0, 10 * MS);
    let (spread_kib, spread_sum) = analyze(&spread.0);
    // All flows within 10 ms: no tick between them.
    write(&burst.0, 10 * MS / u64::from(FLOWS));
    let (burst_kib, burst_sum) = analyze(&burst.0);
    for s in [&spread_sum, &burst_sum] {
        assert_eq!(s["flows"], u64::from(FLOWS), "{s}");
    }
    eprintln!("peak RSS: spread {spread_kib} KiB, burst {burst_kib} KiB");
    assert!(
        burst_kib < spread_kib * 3 / 2 + 16 * 1024,
        "a burst of {FLOWS} flows took {burst_kib} KiB, spread out {spread_kib} KiB (--max-flows {MAX_FLOWS})"
    );
}
