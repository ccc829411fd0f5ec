//! nattrace-bench's results and their rendering as BENCHMARKS.md: the
//! machine, one table per benchmark, and every target met or missed.

use std::fmt::Write as _;

use crate::profile::{self, Profile};
use crate::shared::{ClientRun, CountCheck};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Cond {
    None,
    /// `--baseline` (another build of nattrace) tracing another Service.
    OtherBaseline,
    Other,
    This,
    Tcpdump,
    /// `--baseline` tracing the traced flow itself (the bulk Service).
    ThisBaseline,
}

impl Cond {
    pub fn label(self) -> &'static str {
        match self {
            Cond::None => "no tracer",
            Cond::OtherBaseline => "baseline build, another Service",
            Cond::Other => "nattrace, another Service",
            Cond::This => "nattrace, this Service",
            Cond::Tcpdump => "tcpdump -i cni0 -w file",
            Cond::ThisBaseline => "baseline build, this Service",
        }
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub struct BulkSample {
    pub gbps: f64,
    pub events: u64,
    pub muted: u64,
    pub lost: u64,
    pub rss_kib: u64,
    pub pcap_bytes: u64,
    /// Flows the tracer reported (iperf3's control and data connections).
    pub flows: u64,
}

/// One run of the BPF run-time pass.
#[derive(Clone, Debug, Default)]
pub struct BpfSample {
    pub label: String,
    pub ns: u64,
    pub calls: u64,
    /// GB moved or thousands of connections.
    pub work: f64,
    pub unit: &'static str,
    /// Which build ran on which flow (the bulk ones), to pair this build
    /// with the baseline.
    pub cond: Option<Cond>,
    /// (run_time_ns, calls) per program name, summed like `ns` and `calls`.
    pub progs: std::collections::BTreeMap<String, (u64, u64)>,
}

impl BpfSample {
    /// The pass as JSON, for the results file.
    pub fn json(&self) -> serde_json::Value {
        let per = |ns: u64, calls: u64| {
            serde_json::json!({
                "run_time_ns": ns,
                "calls": calls,
                "ns_per_call": ns as f64 / calls.max(1) as f64,
                "calls_per_unit": calls as f64 / self.work.max(1e-9),
            })
        };
        serde_json::json!({
            "label": self.label,
            "unit": self.unit,
            "work": self.work,
            "total": per(self.ns, self.calls),
            "programs": self
                .progs
                .iter()
                .map(|(name, &(ns, calls))| (name.clone(), per(ns, calls)))
                .collect::<serde_json::Map<_, _>>(),
        })
    }
}

#[derive(Debug, Default)]
pub struct ConnResults {
    pub plain: Vec<ClientRun>,
    pub traced: Vec<(ClientRun, CountCheck)>,
    /// tcpdump -i cni0 -w FILE writing the same connections.
    pub dump: Vec<ClientRun>,
    pub broken: Option<(ClientRun, CountCheck)>,
    /// `--baseline` tracing the same connections, in the same rounds.
    pub baseline: Vec<(ClientRun, CountCheck)>,
}

/// BPF run time of one traced connection-rate run on a scaled node.
#[derive(Clone, Copy, Debug, Default)]
pub struct BpfScale {
    pub ns_per_call: f64,
    pub calls_per_1000: f64,
    pub bpf_ms_per_1000: f64,
}

impl BpfScale {
    /// "ns per call · calls · ms" for a table cell, or a dash.
    pub fn cell(b: Option<&BpfScale>) -> String {
        b.map_or("–".into(), |b| {
            format!(
                "{:.0} · {:.0} · {:.2}",
                b.ns_per_call, b.calls_per_1000, b.bpf_ms_per_1000
            )
        })
    }
}

#[derive(Debug, Default)]
pub struct StartupResults {
    pub pods: usize,
    pub interfaces: usize,
    pub start_ms: Vec<f64>,
    /// Start → a tcx link on every interface (attached in the background).
    pub full_ms: Vec<f64>,
    pub detach_ms: Vec<f64>,
    /// Peak RSS (VmHWM) of each start at full coverage.
    pub hwm_mib: Vec<f64>,
    /// `--baseline`'s start → first line, in the same rounds.
    pub baseline_start_ms: Vec<f64>,
    /// Connections through the node, traced: its BPF cost.
    pub bpf: Option<BpfScale>,
}

/// Start-up and memory with `--all-services` on a node with this many
/// Service ports (issue 25's scale figure).
#[derive(Debug, Default)]
pub struct ServiceScale {
    pub services: usize,
    pub start_ms: Vec<f64>,
    pub hwm_mib: Vec<f64>,
    /// Connections to one of them, traced with `--all-services`.
    pub bpf: Option<BpfScale>,
}

#[derive(Debug, Default)]
pub struct Results {
    pub machine: Vec<(String, String)>,
    pub load_after: String,
    pub runs: usize,
    pub secs: u64,
    pub conn_secs: f64,
    /// BPF run time, measured in its own pass with BPF_ENABLE_STATS held.
    pub bpf: Vec<BpfSample>,
    /// (unit of work, no-tracer profile, traced profiles).
    pub profiles: Vec<(&'static str, Profile, Vec<Profile>)>,
    /// Instructions per connection of `analyze` of a recorded run.
    pub counted: Option<crate::callgrind::Counted>,
    /// The event the profile sampled (cycles, or cpu-clock without a PMU).
    pub perf_event: &'static str,
    /// What `--baseline` is (e.g. "main before issue 15").
    pub baseline_label: String,
    /// 1-min load average, read before every run.
    pub load_samples: Vec<f64>,
    pub bulk: Vec<(Cond, Vec<BulkSample>)>,
    pub conn: Option<ConnResults>,
    pub startup_small: Vec<f64>,
    pub startup: Option<StartupResults>,
    pub collector: Option<serde_json::Value>,
    pub services: Vec<ServiceScale>,
    /// The scale figure by pods: one start-up condition per size.
    pub interfaces: Vec<StartupResults>,
}

fn sh(cmd: &str, args: &[&str]) -> String {
    std::process::Command::new(cmd)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

pub fn machine() -> Vec<(String, String)> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_default();
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or_else(String::new, |kib| format!("{:.1} GiB", kib / 1048576.0));
    vec![
        ("nproc".into(), sh("nproc", &[])),
        ("memory".into(), mem),
        ("kernel".into(), sh("uname", &["-r"])),
        ("CPU".into(), model),
        ("load average at start".into(), loadavg()),
    ]
}

/// (median, min, max).
pub fn stats(v: &[f64]) -> (f64, f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    (s[s.len() / 2], s[0], s[s.len() - 1])
}

fn verdict(met: bool) -> &'static str {
    if met { "**met**" } else { "**missed**" }
}

pub fn markdown(r: &Results) -> String {
    let mut md = String::new();
    let w = &mut md;
    let _ = writeln!(w, "# nattrace benchmarks\n");
    let _ = writeln!(
        w,
        "Written by `cargo xtask bench` (issues 7, 15); rerun it to refresh. One lab node \
         (network namespaces: a client pod and a backend pod on `cni0`, kube-proxy DNAT \
         rules, bridge-nf-call-iptables=1), release builds. Conditions alternate run by \
         run and results are ratios to the no-tracer median of the same run, because \
         absolute numbers on these VMs mean little.\n"
    );
    let this_args = crate::shared::this_args();
    let base_args = crate::shared::baseline_args();
    if !this_args.is_empty() || !base_args.is_empty() {
        let shown = |a: &[String]| match a {
            [] => "the defaults".to_string(),
            a => format!("`{}`", a.join(" ")),
        };
        let _ = writeln!(
            w,
            "**The build under test ran with {}** in the connection runs and their profile \
             (`NATTRACE_BENCH_THIS_ARGS`); the baseline build with {} \
             (`NATTRACE_BENCH_BASELINE_ARGS`).\n",
            shown(&this_args),
            shown(&base_args)
        );
    }
    let _ = writeln!(w, "## Machine\n\n| | |\n|---|---|");
    for (k, v) in &r.machine {
        let _ = writeln!(w, "| {k} | {v} |");
    }
    let _ = writeln!(w, "| load average at end | {} |\n", r.load_after);
    let busy = |l: &str| {
        l.split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let (_, lmin, lmax) = stats(&r.load_samples);
    if r.load_samples.is_empty() {
        // A pass that reads no load between runs (the start-up's alone):
        // the table's two readings are all there is.
    } else if busy(&r.load_after).is_some_and(|l| l > cores * 0.5) || lmax > cores * 1.5 {
        let _ = writeln!(
            w,
            "**The machine was shared and busy during this run**: the 1-min load average, read \
             before every run, went from {lmin:.1} to {lmax:.1} on {cores} cores (the bench \
             itself accounts for about 2 of that while a run is on; other people's builds ran \
             alongside). Absolute numbers are noisy; what counts are the ratios between \
             conditions of this one run, which alternate run by run so that slow drifts hit \
             them alike, and their spread. The BPF run time does not depend on the noise.\n"
        );
    } else {
        let _ = writeln!(
            w,
            "1-min load average, read before every run: {lmin:.1} to {lmax:.1} on {cores} cores.\n"
        );
    }
    let mut targets: Vec<String> = Vec::new();
    bulk_section(w, r, &mut targets);
    conn_section(w, r, &mut targets);
    bpf_section(w, r);
    profile_section(w, r);
    collector_section(w, r, &mut targets);
    startup_section(w, r, &mut targets);
    interfaces_section(w, r);
    services_section(w, r);
    let _ = writeln!(w, "## Targets\n");
    for t in &targets {
        let _ = writeln!(w, "- {t}");
    }
    md
}

fn bulk_section(w: &mut String, r: &Results, targets: &mut Vec<String>) {
    let Some((_, base_s)) = r.bulk.iter().find(|(c, _)| *c == Cond::None) else {
        return;
    };
    let base_v: Vec<f64> = base_s.iter().map(|s| s.gbps).collect();
    let base = quartiles(&base_v).1;
    let _ = writeln!(
        w,
        "## 1. Bulk throughput\n\niperf3 TCP, client pod → Service (DNAT) → backend pod on the \
         same bridge, {} runs × {} s per condition, conditions interleaved run by run, \
         BPF_ENABLE_STATS off (its two clock reads per program call are no cost a user pays).\n",
        r.runs, r.secs
    );
    let _ = writeln!(
        w,
        "| condition | Gbit/s median | ratio | IQR (ratio) | min–max (ratio) | run-by-run ratio median | events/run | muted pkts/run | tracer peak RSS |\n\
         |---|---|---|---|---|---|---|---|---|"
    );
    let mut ratio_of = std::collections::HashMap::new();
    for (cond, samples) in &r.bulk {
        let v: Vec<f64> = samples.iter().map(|s| s.gbps).collect();
        let (q1, med, q3) = quartiles(&v);
        let (_, min, max) = stats(&v);
        ratio_of.insert(*cond, med / base);
        let paired = paired_ratio(&v, &base_v);
        let avg = |f: fn(&BulkSample) -> u64| {
            samples.iter().map(f).sum::<u64>() / samples.len().max(1) as u64
        };
        let traced = matches!(
            cond,
            Cond::Other | Cond::This | Cond::OtherBaseline | Cond::ThisBaseline
        );
        let opt = |v: u64| {
            if traced { v.to_string() } else { "–".into() }
        };
        let _ = writeln!(
            w,
            "| {} | {med:.2} | {:.3} | {:.3}–{:.3} | {:.3}–{:.3} | {paired:.3} | {} | {} | {} |",
            cond.label(),
            med / base,
            q1 / base,
            q3 / base,
            min / base,
            max / base,
            opt(avg(|s| s.events)),
            opt(avg(|s| s.muted)),
            if traced {
                format!("{:.1} MiB", avg(|s| s.rss_kib) as f64 / 1024.0)
            } else {
                "–".into()
            },
        );
    }
    if let Some((_, s)) = r.bulk.iter().find(|(c, _)| *c == Cond::Tcpdump) {
        let bytes: u64 = s.iter().map(|s| s.pcap_bytes).sum::<u64>() / s.len().max(1) as u64;
        let _ = writeln!(
            w,
            "\ntcpdump wrote {:.0} MiB per run.",
            bytes as f64 / 1048576.0
        );
    }
    if let Some((_, s)) = r.bulk.iter().find(|(c, _)| *c == Cond::This) {
        let lost: u64 = s.iter().map(|s| s.lost).sum();
        let _ = writeln!(w, "\nTraced runs lost {lost} events.\n");
    }
    let get = |c| ratio_of.get(&c).copied().unwrap_or(f64::NAN);
    let (other, this, dump) = (get(Cond::Other), get(Cond::This), get(Cond::Tcpdump));
    if let Some(base) = ratio_of.get(&Cond::OtherBaseline) {
        let _ = writeln!(
            w,
            "The baseline build ({}) ran the same miss-path condition in the same rounds: \
             {base:.3} against this build's {other:.3}.\n",
            r.baseline_label
        );
    }
    if let Some(base) = ratio_of.get(&Cond::ThisBaseline) {
        let _ = writeln!(
            w,
            "And the traced bulk flow: the baseline build {base:.3} against this build's \
             {this:.3} (this / baseline {:.3}).\n",
            this / base
        );
    }
    long_lived(w, r, targets);
    targets.push(format!(
        "untraced traffic (filter miss) ≥ 0.98: {other:.3} — {}{}",
        verdict(other >= 0.98),
        gap(other, 0.98)
    ));
    targets.push(format!(
        "traced bulk flow ≥ 0.97: {this:.3} — {}{}",
        verdict(this >= 0.97),
        gap(this, 0.97)
    ));
    targets.push(format!(
        "nattrace's cost on the traced flow lower than tcpdump's: {:.1}% vs {:.1}% — {}",
        (1.0 - this) * 100.0,
        (1.0 - dump) * 100.0,
        verdict(this > dump)
    ));
}

/// (first quartile, median, third quartile), linearly interpolated.
pub fn quartiles(v: &[f64]) -> (f64, f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let at = |q: f64| {
        let x = q * (s.len() - 1) as f64;
        let (lo, hi) = (x.floor() as usize, x.ceil() as usize);
        s[lo] + (s[hi] - s[lo]) * (x - lo as f64)
    };
    (at(0.25), at(0.5), at(0.75))
}

/// Median of run i / base run i: the runs of one round ran back to back, so
/// this cancels drifts slower than a round.
pub fn paired_ratio(v: &[f64], base: &[f64]) -> f64 {
    let r: Vec<f64> = v.iter().zip(base).map(|(a, b)| a / b).collect();
    quartiles(&r).1
}

fn gap(value: f64, target: f64) -> String {
    if value >= target {
        String::new()
    } else {
        format!(" (short by {:.3})", target - value)
    }
}

fn conn_section(w: &mut String, r: &Results, targets: &mut Vec<String>) {
    let Some(c) = &r.conn else { return };
    let plain_v: Vec<f64> = c.plain.iter().map(|x| x.per_sec).collect();
    let traced_v: Vec<f64> = c.traced.iter().map(|x| x.0.per_sec).collect();
    let dump_v: Vec<f64> = c.dump.iter().map(|x| x.per_sec).collect();
    let base = quartiles(&plain_v).1;
    let traced = quartiles(&traced_v);
    let dump = quartiles(&dump_v);
    let _ = writeln!(
        w,
        "## 2. Connection rate\n\nconn-bench (tests/src/bin/conn-bench.rs): 2 client threads, \
         connect + read a few bytes + close, through the Service, {} runs × {} s per condition, \
         conditions interleaved run by run, BPF_ENABLE_STATS off.\n",
        r.runs, r.conn_secs
    );
    let _ = writeln!(
        w,
        "| condition | conns/s median | ratio | IQR (ratio) | run-by-run ratio median |\n|---|---|---|---|---|"
    );
    let baseline_v: Vec<f64> = c.baseline.iter().map(|x| x.0.per_sec).collect();
    let baseline_label = format!("baseline build ({}), this Service", r.baseline_label);
    for (label, v) in [
        ("no tracer", &plain_v),
        ("nattrace, this Service", &traced_v),
        (baseline_label.as_str(), &baseline_v),
        ("tcpdump -i cni0 -w file", &dump_v),
    ] {
        if v.is_empty() {
            continue;
        }
        let (q1, med, q3) = quartiles(v);
        let _ = writeln!(
            w,
            "| {label} | {med:.0} | {:.3} | {:.3}–{:.3} | {:.3} |",
            med / base,
            q1 / base,
            q3 / base,
            paired_ratio(v, &plain_v)
        );
    }
    let events: u64 = c.traced.iter().map(|x| x.1.events).sum();
    let conns: u64 = c.traced.iter().map(|x| x.0.attempted).sum();
    let per_conn = events as f64 / conns.max(1) as f64;
    let _ = writeln!(
        w,
        "\nEvents per connection (all traced runs): **{per_conn:.2}** ({events} events, {conns} connections).\n"
    );
    if !c.baseline.is_empty() {
        let b_events: u64 = c.baseline.iter().map(|x| x.1.events).sum();
        let b_conns: u64 = c.baseline.iter().map(|x| x.0.attempted).sum();
        let b_ok = c.baseline.iter().all(|x| x.1.problems.is_empty());
        let _ = writeln!(
            w,
            "The baseline build ({}), same rounds: {:.2} events per connection ({b_events} events, \
             {b_conns} connections); conns/s this / baseline, run by run: **{:.3}**; its count \
             check {}.\n",
            r.baseline_label,
            b_events as f64 / b_conns.max(1) as f64,
            paired_ratio(&traced_v, &baseline_v),
            if b_ok {
                "passed in every run"
            } else {
                "failed in some run"
            }
        );
    }
    // Two decimals alone would print 3.00 for a run a few events over.
    let over = events.saturating_sub(3 * conns);
    targets.push(format!(
        "≤ 3 events per healthy connection: {per_conn:.2} ({over} events over 3 per connection in {conns} connections) — {}",
        verdict(per_conn <= 3.0)
    ));
    if !dump_v.is_empty() {
        targets.push(format!(
            "connection rate: nattrace's cost lower than tcpdump's: {:.1}% vs {:.1}% — {}",
            (1.0 - traced.1 / base) * 100.0,
            (1.0 - dump.1 / base) * 100.0,
            verdict(traced.1 > dump.1)
        ));
    }
    let _ = writeln!(
        w,
        "Count check per traced run (connections made → flows reported):\n\n\
         | run | connections | flows | ok | lost events | incomplete | events | result |\n|---|---|---|---|---|---|---|---|"
    );
    let mut all_ok = true;
    for (i, (run, check)) in c.traced.iter().enumerate() {
        all_ok &= check.problems.is_empty();
        let _ = writeln!(
            w,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            i + 1,
            run.attempted,
            check.flows,
            check.ok,
            check.lost_events,
            check.incomplete,
            check.events,
            result(check)
        );
    }
    let lost: u64 = c.traced.iter().map(|x| x.1.lost_events).sum();
    let cost = 1.0 - traced.1 / base;
    if let Some((run, check)) = &c.broken {
        let _ = writeln!(
            w,
            "\nWith bridge-nf-call-iptables=0: {} connections (connect timeout 300 ms, {} completed), \
             {} flows, {} flagged `reply_not_reverse_nated` — {}.\n",
            run.attempted,
            run.ok,
            check.flows,
            check.flagged,
            result(check)
        );
        targets.push(format!(
            "bridge-nf-call-iptables=0: every same-node connection flagged: {}/{} — {}",
            check.flagged,
            run.attempted,
            verdict(check.problems.is_empty())
        ));
    }
    targets.push(format!(
        "connection-rate run: 100% of connections accounted for, 0 lost events: {} (lost {lost}) — {}",
        if all_ok { "every run" } else { "not every run" },
        verdict(all_ok && lost == 0)
    ));
    targets.push(format!(
        "nattrace costing ≤ 15% of the connection rate: {:.1}% — {}{}",
        cost * 100.0,
        verdict(cost <= 0.15),
        if cost > 0.15 {
            format!(" (over by {:.1} points)", (cost - 0.15) * 100.0)
        } else {
            String::new()
        }
    ));
}

/// What a long-lived healthy TCP connection costs after its opening: the
/// traced bulk runs are two such connections each (iperf3's control and
/// data connections, seconds long, client and backend on one bridge), whose
/// openings cost 3 events each (docs/DESIGN.md, "Event budget"); every
/// later packet is checked by the kernel's watch and only counted (muted).
fn long_lived(w: &mut String, r: &Results, targets: &mut Vec<String>) {
    for cond in [Cond::This, Cond::ThisBaseline] {
        let Some((_, s)) = r.bulk.iter().find(|(c, _)| *c == cond) else {
            continue;
        };
        let events: u64 = s.iter().map(|s| s.events).sum();
        let flows: u64 = s.iter().map(|s| s.flows).sum();
        let muted: u64 = s.iter().map(|s| s.muted).sum();
        let after = events.saturating_sub(3 * flows);
        let label = if cond == Cond::This {
            "this build".to_string()
        } else {
            format!("the baseline build ({})", r.baseline_label)
        };
        let _ = writeln!(
            w,
            "Long-lived healthy TCP connections, {label}: {flows} connections in {} traced bulk \
             runs cost {events} events ({:.2} per connection), {} after their openings; \
             {muted} later packets checked in the kernel without an event.\n",
            s.len(),
            events as f64 / flows.max(1) as f64,
            after
        );
        if cond == Cond::This {
            targets.push(format!(
                "a long-lived healthy TCP connection costs 0 events after its opening: \
                 {after} in {flows} connections ({muted} packets muted) — {}",
                verdict(after == 0)
            ));
        }
    }
}

fn result(check: &CountCheck) -> String {
    if check.problems.is_empty() {
        "pass".into()
    } else {
        format!("FAIL: {}", check.problems.join("; "))
    }
}

fn collector_section(w: &mut String, r: &Results, targets: &mut Vec<String>) {
    let Some(c) = &r.collector else { return };
    let _ = writeln!(
        w,
        "## 3. Collector replay\n\n`cargo bench -p tracer-userspace --bench collector`: synthetic streams \
         from the recorded fixtures (each flow a copy with its own client port and skb addresses, \
         lightly reordered), pushed through `Collector` on one core with a tick every 4096 events.\n\n\
         | stream | events | flows | M events/s median | min–max |\n|---|---|---|---|---|"
    );
    let (mut healthy, mut mixed) = (f64::NAN, f64::NAN);
    for name in ["healthy", "mixed"] {
        let s = &c[name];
        let eps = &s["events_per_sec"];
        let m = |k: &str| eps[k].as_f64().unwrap_or(f64::NAN) / 1e6;
        if name == "healthy" {
            healthy = m("median");
        } else {
            mixed = m("median");
        }
        let _ = writeln!(
            w,
            "| {name} | {} | {} | {:.2} | {:.2}–{:.2} |",
            s["events"],
            s["flows"],
            m("median"),
            m("min"),
            m("max")
        );
    }
    let mem = &c["memory"];
    let mib = |k: &str| mem[k].as_f64().unwrap_or(f64::NAN) / 1024.0;
    let hwm = mib("vm_hwm_kib");
    let _ = writeln!(
        w,
        "\n`healthy` is seed 000's healthy connection (32 events); `mixed` rotates all seven fixtures \
         (healthy, un-reversed reply, cross-node, DNS, no reply, dropped).\n\n\
         Memory, in a child process that streams {} flows in and holds all of them live: peak RSS \
         (VmHWM) **{hwm:.1} MiB** (process baseline {:.1} MiB; the collector's own estimate of its \
         tables {:.1} MiB), ticking every 128 flows as it streamed; {:.1} MiB when the last 50 ms \
         (~4,000 flows) are decided in one tick and their reports are held at once.\n",
        mem["live_flows"],
        mib("baseline_hwm_kib"),
        mem["approx_bytes"].as_f64().unwrap_or(f64::NAN) / 1048576.0,
        mib("one_tick_vm_hwm_kib"),
    );
    if let Some(rows) = c["scale"].as_array() {
        let _ = writeln!(
            w,
            "By live flows (issue 25's scale figure): the healthy stream with 1k, 10k and 100k flows \
             live at the end, each replayed until it pushed about as many events, and the memory \
             child at that many flows.\n\n\
             | live flows | M events/s median | min–max | peak RSS (MiB) | collector's tables (MiB) |\n|---|---|---|---|---|"
        );
        for row in rows {
            let eps = &row["events_per_sec"];
            let m = |k: &str| eps[k].as_f64().unwrap_or(f64::NAN) / 1e6;
            let _ = writeln!(
                w,
                "| {} | {:.2} | {:.2}–{:.2} | {:.1} | {:.1} |",
                row["live_flows"],
                m("median"),
                m("min"),
                m("max"),
                row["vm_hwm_kib"].as_f64().unwrap_or(f64::NAN) / 1024.0,
                row["approx_bytes"].as_f64().unwrap_or(f64::NAN) / 1048576.0,
            );
        }
        let _ = writeln!(w);
    }
    for (name, eps) in [("healthy", healthy), ("mixed", mixed)] {
        targets.push(format!(
            "collector ≥ 2,000,000 events/s on one core, {name} stream: {eps:.2} M/s — {}{}",
            verdict(eps >= 2.0),
            if eps < 2.0 {
                format!(" (short by {:.0}%)", (1.0 - eps / 2.0) * 100.0)
            } else {
                String::new()
            }
        ));
    }
    targets.push(format!(
        "≤ 64 MiB RSS at 100k live flows: {hwm:.1} MiB — {}",
        verdict(hwm <= 64.0)
    ));
}

fn startup_section(w: &mut String, r: &Results, targets: &mut Vec<String>) {
    let Some(s) = &r.startup else { return };
    let (start, smin, smax) = stats(&s.start_ms);
    let (det, dmin, dmax) = stats(&s.detach_ms);
    let (full, fmin, fmax) = stats(&s.full_ms);
    let small = stats(&r.startup_small).0;
    let _ = writeln!(
        w,
        "## 4. Start-up and detach\n\nA lab node with {} pods ({} interfaces in the node namespace, \
         each pod a veth on `cni0`); `nattrace --svc .. --netns ..`, {} runs.\n\n\
         | | median | min–max |\n|---|---|---|\n\
         | start → first line (`start` object: tracing), {} interfaces | {start:.0} ms | {smin:.0}–{smax:.0} ms |\n\
         | start → last tc link (the node's own interfaces; past 64 interfaces pod veths are left to the device tracepoints) | {full:.0} ms | {fmin:.0}–{fmax:.0} ms |\n\
         | SIGTERM → exit (everything detached) | {det:.0} ms | {dmin:.0}–{dmax:.0} ms |\n\
         | start, the 2-pod bench node (for comparison) | {} | |\n",
        s.pods,
        s.interfaces,
        s.start_ms.len(),
        s.interfaces,
        if small.is_nan() {
            "–".into()
        } else {
            format!("{small:.0} ms")
        }
    );
    if !s.baseline_start_ms.is_empty() {
        let (b, bmin, bmax) = stats(&s.baseline_start_ms);
        let _ = writeln!(
            w,
            "The baseline build ({}) started in the same rounds, alternating run by run: \
             {b:.0} ms median ({bmin:.0}–{bmax:.0} ms) to its first line.\n",
            r.baseline_label
        );
    }
    targets.push(format!(
        "start-up ≤ 300 ms with {} interfaces: {start:.0} ms — {}{}",
        s.interfaces,
        verdict(start <= 300.0),
        if start > 300.0 {
            format!(" (over by {:.0} ms)", start - 300.0)
        } else {
            String::new()
        }
    ));
}

fn bpf_section(w: &mut String, r: &Results) {
    if r.bpf.is_empty() {
        return;
    }
    let _ = writeln!(
        w,
        "## BPF run time (separate pass)\n\nMeasured in runs of their own with BPF_ENABLE_STATS \
         held (the kernel then reads the clock around every program call, which the runs above \
         do not pay), conditions alternating run by run (the clock's reading moves with the \
         machine's load): the sum over all of nattrace's programs.\n\n\
         | run | ns per program call | calls per unit | BPF CPU ms per unit |\n|---|---|---|---|"
    );
    for b in &r.bpf {
        let _ = writeln!(
            w,
            "| {} | {:.0} | {:.0} per {} | {:.2} |",
            b.label,
            b.ns as f64 / b.calls.max(1) as f64,
            b.calls as f64 / b.work.max(1e-9),
            b.unit,
            b.ns as f64 / 1e6 / b.work.max(1e-9),
        );
    }
    let _ = writeln!(w);
    bpf_programs(w, r);
}

/// The same pass per program (the kernel's name, cut at 15 bytes), so a
/// change in the sum is pinned to a hook: ns per call and calls per unit,
/// and this build against the baseline where both ran the same flow.
fn bpf_programs(w: &mut String, r: &Results) {
    let mut names: Vec<&String> = r.bpf.iter().flat_map(|b| b.progs.keys()).collect();
    names.sort();
    names.dedup();
    if names.is_empty() {
        return;
    }
    let pairs: Vec<(&BpfSample, &BpfSample)> = [
        (Cond::OtherBaseline, Cond::Other),
        (Cond::ThisBaseline, Cond::This),
    ]
    .into_iter()
    .filter_map(|(base, this)| {
        let find = |c| r.bpf.iter().find(|b| b.cond == Some(c) && b.unit == "GB");
        find(base).zip(find(this))
    })
    .collect();
    let _ = write!(
        w,
        "Per program: ns per call · calls per unit of work (GB or 1000 connections).\n\n| program |"
    );
    for b in &r.bpf {
        let _ = write!(w, " {} |", b.label);
    }
    for (_, this) in &pairs {
        let _ = write!(w, " Δ ns/call, {} vs baseline |", this.label);
    }
    let _ = write!(w, "\n|---|");
    for _ in 0..r.bpf.len() + pairs.len() {
        let _ = write!(w, "---|");
    }
    let _ = writeln!(w);
    let per_call = |b: &BpfSample, name: &str| {
        b.progs
            .get(name)
            .filter(|p| p.1 > 0)
            .map(|&(ns, calls)| (ns as f64 / calls as f64, calls as f64 / b.work.max(1e-9)))
    };
    for name in names {
        let _ = write!(w, "| `{name}` |");
        for b in &r.bpf {
            match per_call(b, name) {
                Some((ns, calls)) => {
                    let _ = write!(w, " {ns:.0} · {calls:.0} |");
                }
                None => {
                    let _ = write!(w, " – |");
                }
            }
        }
        for (base, this) in &pairs {
            match per_call(base, name).zip(per_call(this, name)) {
                Some(((b, _), (t, _))) => {
                    let _ = write!(w, " {:+.0} |", t - b);
                }
                None => {
                    let _ = write!(w, " – |");
                }
            }
        }
        let _ = writeln!(w);
    }
    let _ = writeln!(w);
}

fn profile_section(w: &mut String, r: &Results) {
    if r.profiles.is_empty() {
        return;
    }
    let _ = writeln!(
        w,
        "## Where the extra cycles go (CPU profile)\n\n`perf record -e {} -a -g -F {}` \
         (Debian linux-perf) over 3 runs per condition, interleaved like the measured runs and \
         after them. {} Each sample's leaf function goes into a bucket; idle is left \
         out; the numbers are busy CPU ms per unit of work, so a slower traced run is not \
         credited with doing less. The softirq row overlaps the buckets (it is the part of all \
         busy time whose call chain passes net_rx_action). Samples of processes that are neither \
         the workload, the tracer (by thread id) nor a kernel thread, outside softirq, are other \
         people's builds on the shared machine: they have their own row and are left out of the \
         total. Other people's test runs also load nattrace now and then, and its raw \
         tracepoints are global, so a little BPF time shows up even in the no-tracer column; \
         the \"extra\" columns subtract it.\n",
        r.perf_event,
        profile::FREQ,
        if r.perf_event == "cpu-clock" {
            "This VM exposes no PMU (`perf stat -e cycles true` and `-e instructions` say \
             \"<not supported>\"), so the samples are cpu-clock ticks: CPU time, not cycles."
        } else {
            "The samples are CPU cycles."
        }
    );
    for (unit, base, traced) in &r.profiles {
        profile::markdown(w, base, traced, unit);
    }
    if let Some(c) = &r.counted {
        crate::callgrind::markdown(w, c);
    }
}

fn services_section(w: &mut String, r: &Results) {
    if r.services.is_empty() {
        return;
    }
    let _ = writeln!(
        w,
        "## Start-up and memory by Services (`--all-services`)\n\n\
         A lab node whose kube-proxy (iptables mode) has this many Service ports, each with one \
         endpoint; `nattrace --all-services` reads every rule at start, keeps a kernel map entry \
         per Service port and re-reads the rules when they change. Start: spawn → first line; \
         peak RSS (VmHWM) half a second after it. BPF: one traced connection-rate run to one of \
         the Services with BPF_ENABLE_STATS on (ns per program call · calls · BPF CPU ms, per \
         1000 connections).\n\n\
         | Services | start median (ms) | min–max | peak RSS median (MiB) | BPF per 1000 conns |\n|---|---|---|---|---|"
    );
    for s in &r.services {
        let (start, smin, smax) = stats(&s.start_ms);
        let (hwm, _, _) = stats(&s.hwm_mib);
        let _ = writeln!(
            w,
            "| {} | {start:.0} | {smin:.0}–{smax:.0} | {hwm:.1} | {} |",
            s.services,
            BpfScale::cell(s.bpf.as_ref())
        );
    }
    let _ = writeln!(w);
}

fn interfaces_section(w: &mut String, r: &Results) {
    if r.interfaces.is_empty() {
        return;
    }
    let _ = writeln!(
        w,
        "## Start-up and memory by pods\n\n\
         A lab node with this many pods (each a veth on `cni0`), `nattrace --svc` of one Service. \
         Start: spawn → first line; coverage: spawn → the last tc link (past 64 interfaces only \
         the node's own get tc, the pods' veths are left to the device tracepoints); peak RSS \
         (VmHWM) at full coverage, before the stop. BPF: one traced connection-rate run through \
         the node with BPF_ENABLE_STATS on (ns per program call · calls · BPF CPU ms, per 1000 \
         connections).\n\n\
         | pods | interfaces | start median (ms) | min–max | coverage median (ms) | peak RSS (MiB) | BPF per 1000 conns |\n|---|---|---|---|---|---|---|"
    );
    for s in &r.interfaces {
        let (start, smin, smax) = stats(&s.start_ms);
        let (full, _, _) = stats(&s.full_ms);
        let (hwm, _, _) = stats(&s.hwm_mib);
        let _ = writeln!(
            w,
            "| {} | {} | {start:.0} | {smin:.0}–{smax:.0} | {full:.0} | {hwm:.1} | {} |",
            s.pods,
            s.interfaces,
            BpfScale::cell(s.bpf.as_ref())
        );
    }
    let _ = writeln!(w);
}
