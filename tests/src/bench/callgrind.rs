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
        "opening the recording (analyze only: its header, the node's rules)",
        &["nattrace::analyze::open_runs"],
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
    /// [`STAGES`] again, on the same recording with the node grown to
    /// [`SCALE_SERVICES`] Service ports and [`SCALE_PODS`] pods.
    pub at_scale: Vec<(&'static str, u64)>,
    pub at_scale_total: u64,
    /// [`STAGES`] and the total of `analyze … --hide-ok` on the same
    /// recording: the DaemonSet's output, no line for an `ok` flow.
    pub hide_ok: Vec<(&'static str, u64)>,
    pub hide_ok_total: u64,
    /// The same with `--output text`: what an on-call engineer's
    /// `sudo nattrace --svc …` prints.
    pub text: Vec<(&'static str, u64)>,
    pub text_total: u64,
}

/// The big node of the scaled pass: what reports look up per decided flow
/// (the Service port and its endpoint chain in kube-proxy's rules, the pods
/// of the flow's ends and hops) grows with these.
pub const SCALE_SERVICES: usize = 10_000;
pub const SCALE_PODS: usize = 1_000;

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
    let scaled = temp("conn-scaled.rec");
    let r = counted(ctx, &rec, &data, &scaled);
    let _ = std::fs::remove_file(&scaled);
    // NATTRACE_BENCH_KEEP=1 keeps both for callgrind_annotate by hand.
    if std::env::var_os("NATTRACE_BENCH_KEEP").is_some() {
        say(&format!("kept {} and {}", rec.display(), data.display()));
    } else {
        let _ = std::fs::remove_file(&rec);
        let _ = std::fs::remove_file(&data);
    }
    r.map(Some)
}

fn counted(ctx: &Ctx, rec: &Path, data: &Path, scaled: &Path) -> anyhow::Result<Counted> {
    let rec_s = rec.display().to_string();
    let nattrace = ctx.binary(Cond::This);
    let (tracer, _) =
        shared::start_nattrace(nattrace, ctx.lab, &[conn_svc(ctx)], &["--write", &rec_s])?;
    let run = client(ctx)?;
    let done = shared::stop_nattrace_after(tracer, run.attempted)?;
    let summary = done.summary()?;
    let num = |k: &str| summary[k].as_u64().unwrap_or(0);
    let json = ["--output", "json"];
    let (total_ir, stages, top_self) = count(nattrace, rec, data, &json)?;
    let (hide_ok_total, hide_ok, _) =
        count(nattrace, rec, data, &["--output", "json", "--hide-ok"])?;
    let (text_total, text, _) = count(nattrace, rec, data, &["--output", "text"])?;
    scale(rec, scaled)?;
    let (at_scale_total, at_scale, _) = count(nattrace, scaled, data, &json)?;
    let c = Counted {
        connections: run.attempted,
        flows: num("flows"),
        events: num("events"),
        total_ir,
        stages,
        top_self,
        at_scale,
        at_scale_total,
        hide_ok,
        hide_ok_total,
        text,
        text_total,
    };
    say(&format!(
        "callgrind: {:.0} instructions per connection ({} flows, {} events); {:.0} with {SCALE_SERVICES} Services and {SCALE_PODS} pods",
        c.total_ir as f64 / c.flows.max(1) as f64,
        c.flows,
        c.events,
        c.at_scale_total as f64 / c.flows.max(1) as f64,
    ));
    Ok(c)
}

type Stages = Vec<(&'static str, u64)>;
/// Functions by their own instructions.
type Top = Vec<(String, u64)>;

/// `nattrace analyze REC [args]` under callgrind: total Ir, the stages and
/// the top functions by their own Ir.
fn count(
    nattrace: &Path,
    rec: &Path,
    data: &Path,
    args: &[&str],
) -> anyhow::Result<(u64, Stages, Top)> {
    let out = Command::new("valgrind")
        .args(["--tool=callgrind", "--quiet"])
        .arg(format!("--callgrind-out-file={}", data.display()))
        .arg(nattrace)
        .arg("analyze")
        .arg(rec)
        .args(args)
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
    Ok((total_ir, stages, top_self))
}

/// The recording with the node grown: [`SCALE_SERVICES`] more Service
/// ports in kube-proxy's rules (header) and [`SCALE_PODS`] more pods (each
/// `pods` line), all listed before the node's own, so a lookup that scans
/// passes them all. The events are the same, so what changes per
/// connection is what grows with the node.
fn scale(rec: &Path, out: &Path) -> anyhow::Result<()> {
    use serde_json::{Value, json};
    use std::io::{BufRead as _, BufReader, BufWriter, Write as _};
    let services: Vec<Value> = (0..SCALE_SERVICES)
        .map(|i| {
            let (hi, lo) = (i / 250, i % 250 + 1);
            json!({
                "name": format!("scale/svc-{i}:tcp"),
                "cluster_ip": format!("100.69.{hi}.{lo}"),
                "port": 80,
                "proto": "tcp",
                "chain": format!("KUBE-SVC-SCALE{i:011}"),
                "masquerade_all": false,
                "endpoints": [{
                    "chain": format!("KUBE-SEP-SCALE{i:011}"),
                    "endpoint": format!("100.101.{hi}.{lo}:8080"),
                    "hairpin_masq": true,
                }],
            })
        })
        .collect();
    let pods: Vec<Value> = (0..SCALE_PODS)
        .map(|i| {
            json!({
                "netns": 4_026_600_000u32 + i as u32,
                "addrs": [format!("100.102.{}.{}", i / 250, i % 250 + 1)],
                "pod": format!("scale/pod-{i}"),
            })
        })
        .collect();
    let grow = |list: Option<&mut Value>, more: &[Value]| -> anyhow::Result<()> {
        let Some(Value::Array(list)) = list else {
            bail!("recording line without the list to grow");
        };
        list.splice(0..0, more.iter().cloned());
        Ok(())
    };
    let input = BufReader::new(std::fs::File::open(rec).context("opening the recording")?);
    let mut w =
        BufWriter::new(std::fs::File::create(out).context("creating the scaled recording")?);
    for (i, line) in input.lines().enumerate() {
        let line = line?;
        let kind_is = |k: &str| line.starts_with(&format!("{{\"kind\":\"{k}\""));
        if i == 0 || kind_is("pods") {
            let mut v: Value = serde_json::from_str(&line).context("a recording line")?;
            if i == 0 {
                grow(v.pointer_mut("/kube_proxy/services"), &services)?;
            } else {
                grow(v.get_mut("pods"), &pods)?;
            }
            serde_json::to_writer(&mut w, &v)?;
            writeln!(w)?;
        } else {
            writeln!(w, "{line}")?;
        }
    }
    w.flush()?;
    Ok(())
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
         is its own row and also inside the others). The last column is the same recording \
         with the node grown to {SCALE_SERVICES} Service ports in kube-proxy's rules and \
         {SCALE_PODS} more pods, listed before the node's own (its reading row also parses \
         those once).\n\n\
         | stage | instructions per connection | share | at {SCALE_SERVICES} Services, {SCALE_PODS} pods |\n|---|---|---|---|",
        c.connections, c.flows, c.events
    );
    let scaled = |i: usize| c.at_scale.get(i).map_or(0.0, |s| per(s.1));
    for (i, (name, ir)) in c.stages.iter().enumerate() {
        let share = 100.0 * *ir as f64 / c.total_ir.max(1) as f64;
        let _ = writeln!(
            w,
            "| {name} | {:.0} | {share:.1}% | {:.0} |",
            per(*ir),
            scaled(i)
        );
    }
    let _ = writeln!(
        w,
        "| **whole process (analyze, start-up included)** | **{:.0}** | 100% | {:.0} |",
        per(c.total_ir),
        per(c.at_scale_total)
    );
    // The first two stages are analyze's own (reading the recording).
    let reading = |stages: &[(&str, u64)]| stages.iter().take(2).map(|s| s.1).sum::<u64>();
    let live = c.total_ir.saturating_sub(reading(&c.stages));
    let live_scaled = c.at_scale_total.saturating_sub(reading(&c.at_scale));
    let _ = writeln!(
        w,
        "| **the same without reading the recording** (a live session's share) | **{:.0}** | {:.1}% | {:.0} |",
        per(live),
        100.0 * live as f64 / c.total_ir.max(1) as f64,
        per(live_scaled)
    );
    let hidden = c.hide_ok_total.saturating_sub(reading(&c.hide_ok));
    let _ = writeln!(
        w,
        "| **the live share with `--hide-ok`** (the DaemonSet: no line for an `ok` flow) | **{:.0}** | | |",
        per(hidden),
    );
    let text = c.text_total.saturating_sub(reading(&c.text));
    let _ = writeln!(
        w,
        "| **the live share with `--output text`** (on-call's `sudo nattrace --svc …`) | **{:.0}** | | |",
        per(text),
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
