//! The process's cost per connection counted, not timed: one traced
//! connection-rate run is recorded (`--write`), then `nattrace analyze` of
//! that recording runs under `valgrind --tool=callgrind`. Instructions per
//! connection do not move with the machine's load, so a change of a few
//! percent shows where the timed profile's spread hides it.
//!
//! `analyze` runs the same decode → collector → JSON path as a live
//! session; what it cannot show (ring-buffer reads, wakeups, the kernel's
//! write) is in the timed profile's stage table beside it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context as _, bail};

use crate::passes::{client, conn_svc};
use crate::report::Cond;
use crate::shared;
use crate::{Ctx, say};

/// Inclusive instruction counts of the stages, by the function that enters
/// each (Rust paths, matched as substrings of callgrind's names; the
/// outermost match counts). Reading the recording is `analyze`'s own (a
/// live session reads fixed-size events from the ring buffer instead);
/// the collector's decisions run inside its event intake, and the output
/// runs after both.
pub const STAGES: &[(&str, &[&str])] = &[
    (
        "reading the recording (analyze only: JSON lines in)",
        // The chain's iterator reads every line; the reader's own
        // functions may be inlined into it (then only a tiny one is left
        // under that name: a run of 2026-12-04 counted 9 instructions).
        &[
            "nattrace::recording::chain::Chain",
            "nattrace::recording::reader::Reader",
        ],
    ),
    (
        "collector: events in, decisions and reports (Collector::push)",
        &["nattrace::collector::Collector::push"],
    ),
    (
        "… of which decisions and reports (decide_due)",
        &["nattrace::collector::Collector::decide_due"],
    ),
    (
        "output: JSON lines (Outputs::flows)",
        &["nattrace::output::sink::Outputs::flows"],
    ),
    (
        "output: writer thread",
        &["nattrace::output::queue::writer"],
    ),
    (
        "allocation (malloc, free; inside the rows above)",
        &["malloc", "free", "realloc"],
    ),
];

#[derive(Clone, Debug, Default)]
pub struct Counted {
    pub connections: u64,
    pub flows: u64,
    pub events: u64,
    pub total_ir: u64,
    /// (stage, inclusive Ir): [`STAGES`] in order.
    pub stages: Vec<(&'static str, u64)>,
    /// The most expensive functions by their own (exclusive) Ir.
    pub top_self: Vec<(String, u64)>,
}

fn have(cmd: &str) -> bool {
    Command::new(cmd)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("nattrace-bench-{}-{name}", std::process::id()))
}

pub fn pass(ctx: &Ctx) -> anyhow::Result<Option<Counted>> {
    if !have("valgrind") || !have("callgrind_annotate") {
        say("valgrind not found (Debian package valgrind): no counted cost per connection");
        return Ok(None);
    }
    let rec = temp("conn.rec");
    let data = temp("conn.callgrind");
    let r = counted(ctx, &rec, &data);
    // NATTRACE_BENCH_KEEP=1 keeps both for callgrind_annotate by hand.
    if std::env::var_os("NATTRACE_BENCH_KEEP").is_some() {
        say(&format!("kept {} and {}", rec.display(), data.display()));
    } else {
        let _ = std::fs::remove_file(&rec);
        let _ = std::fs::remove_file(&data);
    }
    r.map(Some)
}

fn counted(ctx: &Ctx, rec: &Path, data: &Path) -> anyhow::Result<Counted> {
    let rec_s = rec.display().to_string();
    let nattrace = ctx.binary(Cond::This);
    let (tracer, _) =
        shared::start_nattrace(nattrace, ctx.lab, &[conn_svc(ctx)], &["--write", &rec_s])?;
    let run = client(ctx)?;
    let done = shared::stop_nattrace_after(tracer, run.attempted)?;
    let summary = done.summary()?;
    let num = |k: &str| summary[k].as_u64().unwrap_or(0);
    let out = Command::new("valgrind")
        .args(["--tool=callgrind", "--quiet"])
        .arg(format!("--callgrind-out-file={}", data.display()))
        .arg(nattrace)
        .args(["analyze", &rec_s, "--output", "json"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .context("running valgrind --tool=callgrind")?;
    // analyze exits 1 for a problem flow; only 2 means it could not read.
    if out.status.code() == Some(2) || out.status.code().is_none() {
        bail!(
            "callgrind of nattrace analyze failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let inclusive = annotate(data, true)?;
    let exclusive = annotate(data, false)?;
    let total_ir = exclusive.iter().map(|(_, ir)| ir).sum();
    let stages = STAGES
        .iter()
        .map(|(name, pats)| (*name, stage_ir(&inclusive, &exclusive, name, pats)))
        .collect();
    let mut top_self = exclusive;
    top_self.sort_by_key(|r| std::cmp::Reverse(r.1));
    top_self.truncate(12);
    let c = Counted {
        connections: run.attempted,
        flows: num("flows"),
        events: num("events"),
        total_ir,
        stages,
        top_self,
    };
    say(&format!(
        "callgrind: {:.0} instructions per connection ({} flows, {} events)",
        c.total_ir as f64 / c.flows.max(1) as f64,
        c.flows,
        c.events
    ));
    Ok(c)
}

/// A stage's instructions: the outermost matching function's inclusive
/// count (a recursive or nested match would count twice), or for the
/// allocator, whose functions are leaves, the sum of their own counts.
fn stage_ir(
    inclusive: &[(String, u64)],
    exclusive: &[(String, u64)],
    name: &str,
    pats: &[&str],
) -> u64 {
    let is_alloc = name.starts_with("allocation");
    let matches = |f: &str| {
        if is_alloc {
            let base = f.rsplit(':').next().unwrap_or(f);
            pats.iter()
                .any(|p| base == *p || base.starts_with(&format!("_int_{p}")))
        } else {
            pats.iter().any(|p| f.contains(p))
        }
    };
    if is_alloc {
        exclusive
            .iter()
            .filter(|(f, _)| matches(f))
            .map(|(_, ir)| ir)
            .sum()
    } else {
        inclusive
            .iter()
            .filter(|(f, _)| matches(f))
            .map(|(_, ir)| *ir)
            .max()
            .unwrap_or(0)
    }
}

/// `callgrind_annotate` lines "1,234 (5.6%)  file:function [object]" (or,
/// older, "1,234  file:function"), as (function, Ir).
fn annotate(data: &Path, inclusive: bool) -> anyhow::Result<Vec<(String, u64)>> {
    let out = Command::new("callgrind_annotate")
        .arg(format!(
            "--inclusive={}",
            if inclusive { "yes" } else { "no" }
        ))
        .arg("--threshold=100")
        .arg(data)
        .output()
        .context("running callgrind_annotate")?;
    if !out.status.success() {
        bail!("callgrind_annotate failed ({})", out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut rows = Vec::new();
    for line in text.lines() {
        let line = line.trim_start();
        let Some((num, rest)) = line.split_once(char::is_whitespace) else {
            continue;
        };
        let Ok(ir) = num.replace(',', "").parse::<u64>() else {
            continue;
        };
        let rest = rest.trim_start();
        let rest = match rest.strip_prefix('(') {
            Some(r) => r.split_once(')').map_or(r, |(_, after)| after).trim_start(),
            None => rest,
        };
        // "file:function [object]": the function after the first ':' that
        // follows the file name (Rust paths have '::' of their own).
        let func = rest.rsplit_once(" [").map_or(rest, |(f, _)| f);
        let func = match func.split_once(':') {
            Some((file, f)) if !file.contains("::") && !f.starts_with(':') => f,
            _ => func,
        };
        if func.contains("PROGRAM TOTALS") {
            continue;
        }
        rows.push((func.to_string(), ir));
    }
    Ok(rows)
}

/// The counted table for BENCHMARKS.md.
pub fn markdown(w: &mut String, c: &Counted) {
    use std::fmt::Write as _;
    let per = |ir: u64| ir as f64 / c.flows.max(1) as f64;
    let _ = writeln!(
        w,
        "### Counted: instructions per connection (callgrind)\n\n\
         One traced connection-rate run recorded ({} connections, {} flows, {} events), then \
         `valgrind --tool=callgrind nattrace analyze REC --output json`: the same decode → \
         collector → JSON path as live, counted in instructions, which the machine's load does \
         not move. Stages are inclusive counts of the function that enters each (the allocator \
         is its own row and also inside the others).\n\n\
         | stage | instructions per connection | share |\n|---|---|---|",
        c.connections, c.flows, c.events
    );
    for (name, ir) in &c.stages {
        let share = 100.0 * *ir as f64 / c.total_ir.max(1) as f64;
        let _ = writeln!(w, "| {name} | {:.0} | {share:.1}% |", per(*ir));
    }
    let _ = writeln!(
        w,
        "| **whole process (analyze, start-up included)** | **{:.0}** | 100% |",
        per(c.total_ir)
    );
    let reading = c.stages.first().map_or(0, |s| s.1);
    let live = c.total_ir.saturating_sub(reading);
    let _ = writeln!(
        w,
        "| **the same without reading the recording** (a live session's share) | **{:.0}** | {:.1}% |",
        per(live),
        100.0 * live as f64 / c.total_ir.max(1) as f64
    );
    let list: Vec<String> = c
        .top_self
        .iter()
        .map(|(f, ir)| format!("`{}` {:.0}", short(f), per(*ir)))
        .collect();
    let _ = writeln!(
        w,
        "\nFunctions with the most instructions of their own, per connection: {}.\n",
        list.join(", ")
    );
}

fn short(f: &str) -> String {
    f.chars().take(90).collect()
}
