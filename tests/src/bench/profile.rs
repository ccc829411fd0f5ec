//! Where the extra cycles go: a system-wide CPU profile (`perf record`, from
//! Debian's linux-perf) of one run per condition, each sample's leaf symbol
//! put in a bucket, and the buckets compared per unit of work (a GB moved,
//! a thousand connections) between the no-tracer and the traced runs.
//!
//! These VMs expose no PMU (`perf stat -e cycles` says "not supported"), so
//! the profile samples the `cpu-clock` software event: a sample is 1/FREQ s
//! of one CPU's time, whatever that CPU was doing.

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{Context as _, bail};

pub const FREQ: u64 = 997;

/// The buckets, in the order BENCHMARKS.md lists them.
pub const BUCKETS: &[&str] = &[
    "BPF programs (JITed code)",
    "BPF helpers, maps, ring buffer",
    "tracepoint dispatch",
    "netfilter hook calls",
    "tc / tcx dispatch",
    "tracer process (nattrace / tcpdump, user + kernel)",
    "workload userspace (iperf3 / conn-bench)",
    "rest of the kernel (network stack, scheduler, ...)",
    "other processes (other people's builds)",
];

/// One profiled run.
#[derive(Clone, Debug, Default)]
pub struct Profile {
    pub label: String,
    /// GB moved or thousands of connections made during the profile.
    pub work: f64,
    /// Busy CPU ms per bucket (idle excluded).
    pub buckets: BTreeMap<&'static str, f64>,
    /// Of `busy_ms`, the part whose call chain passes softirq processing.
    pub softirq_ms: f64,
    /// Busy CPU ms per kernel symbol, for the "top extra symbols" list.
    pub syms: BTreeMap<String, f64>,
    /// Busy CPU ms of the workload, the tracer and kernel threads (not of
    /// other processes).
    pub busy_ms: f64,
    /// The tracer's own CPU ms by stage ([`STAGES`]) and by leaf symbol.
    pub tracer_stages: BTreeMap<&'static str, f64>,
    pub tracer_syms: BTreeMap<String, f64>,
    /// Softirq work sampled on the tracer's threads: not its own (see
    /// [`summarize`]), shown beside its stages.
    pub tracer_softirq_ms: f64,
}

impl Profile {
    /// Adds another run of the same condition.
    pub fn merge(&mut self, o: Profile) {
        self.work += o.work;
        self.busy_ms += o.busy_ms;
        self.softirq_ms += o.softirq_ms;
        self.tracer_softirq_ms += o.tracer_softirq_ms;
        for (k, v) in o.buckets {
            *self.buckets.entry(k).or_default() += v;
        }
        for (k, v) in o.syms {
            *self.syms.entry(k).or_default() += v;
        }
        for (k, v) in o.tracer_stages {
            *self.tracer_stages.entry(k).or_default() += v;
        }
        for (k, v) in o.tracer_syms {
            *self.tracer_syms.entry(k).or_default() += v;
        }
    }
}

/// The event to sample: `cycles` where the VM exposes a PMU, else
/// `cpu-clock` (`perf stat -e cycles true` prints "<not supported>" here).
pub fn event() -> &'static str {
    let out = Command::new("perf")
        .args(["stat", "-e", "cycles", "true"])
        .output();
    match out {
        Ok(o)
            if o.status.success()
                && !String::from_utf8_lossy(&o.stderr).contains("not supported") =>
        {
            "cycles"
        }
        _ => "cpu-clock",
    }
}

/// `perf record -e EVENT -a -g` until [`stop`].
pub fn start(out: &Path, event: &str) -> anyhow::Result<Child> {
    let child = Command::new("perf")
        .args(["record", "-q", "-e", event, "-a", "-g", "-F"])
        .arg(FREQ.to_string())
        .arg("-o")
        .arg(out)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting perf record (Debian package linux-perf)")?;
    // perf opens its per-CPU events within a few ms; give it margin.
    std::thread::sleep(std::time::Duration::from_millis(300));
    Ok(child)
}

pub fn stop(mut child: Child) -> anyhow::Result<()> {
    // SIGINT: perf flushes and writes its header.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = child.wait()?;
    if !status.success() && status.code() != Some(130) && status.code().is_some() {
        bail!("perf record failed ({status})");
    }
    Ok(())
}

/// Thread ids of a process (perf's `pid` key is the thread). By id, not by
/// name: other people's test runs on the machine run `nattrace` too.
pub fn thread_ids(pid: u32) -> HashSet<u32> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return HashSet::from([pid]);
    };
    dir.flatten()
        .filter_map(|t| t.file_name().to_str()?.parse().ok())
        .collect()
}

/// Softirq work lands in whatever task was running when it was raised, so a
/// sample whose call chain passes net_rx_action is network work even in an
/// unrelated process.
fn bucket(
    (tid, comm): (u32, &str),
    sym: &str,
    user: bool,
    softirq: bool,
    tracer: &HashSet<u32>,
) -> &'static str {
    if tracer.contains(&tid) {
        return BUCKETS[5];
    }
    let workload = comm.starts_with("iperf3") || comm.starts_with("conn-bench");
    let kthread = ["swapper", "ksoftirqd", "kworker", "rcu", "migration"]
        .iter()
        .any(|k| comm.starts_with(k));
    if !workload && !kthread && !softirq {
        return BUCKETS[8];
    }
    if user {
        return BUCKETS[6];
    }
    let has = |p: &[&str]| p.iter().any(|x| sym.starts_with(x));
    if has(&["bpf_prog_"]) {
        BUCKETS[0]
    } else if has(&[
        "bpf_trace_run",
        "__bpf_trace_",
        "__traceiter_",
        "bpf_get_stack",
        "trace_event_",
        "perf_trace_",
        "__bpf_prog_enter",
        "__bpf_prog_exit",
    ]) {
        BUCKETS[2]
    } else if has(&[
        "bpf_",
        "htab_",
        "__htab_",
        "ringbuf",
        "__bpf_ringbuf",
        "array_map_",
        "percpu_array_",
        "lookup_nulls_elem",
        "pcpu_freelist",
        "alloc_htab_elem",
        "jhash",
    ]) {
        BUCKETS[1]
    } else if has(&["nf_hook_slow", "nf_hook_run_bpf", "nf_hook"]) {
        BUCKETS[3]
    } else if has(&["tcx_", "sch_handle_", "tcf_", "cls_bpf"]) {
        BUCKETS[4]
    } else {
        BUCKETS[7]
    }
}

/// Where the tracer process's time goes, by its samples' leaf symbol. The
/// release binary has no frame pointers, so a stage is the leaf's crate or
/// kernel path, not the caller that asked for it: an allocation is its own
/// stage whoever allocated.
pub const STAGES: &[&str] = &[
    "ring buffer read (aya, user copy)",
    "collector (flows, verdicts)",
    "output (JSON/text formatting, queue)",
    "recording / metrics / pods",
    "allocation (malloc, free)",
    "async runtime (tokio)",
    "kernel: write/read syscalls",
    "kernel: wakeups, scheduling, epoll, futex",
    "kernel: other (page faults, timers, ...)",
    "other user code (std, core, libc)",
];

fn stage(sym: &str, user: bool) -> &'static str {
    let has = |p: &[&str]| p.iter().any(|x| sym.contains(x));
    if !user {
        return if has(&[
            "write",
            "read",
            "pipe",
            "copy_to_user",
            "copy_from_user",
            "_copy_",
            "splice",
            "ext4",
            "vfs_",
            "fsnotify",
        ]) {
            STAGES[6]
        } else if has(&[
            "schedule",
            "switch",
            "epoll",
            "futex",
            "wake",
            "ep_",
            "poll",
            "enqueue",
            "dequeue",
            "irq",
            "syscall",
            "entry_",
            "do_nanosleep",
            "hrtimer",
            "clock_nanosleep",
        ]) {
            STAGES[7]
        } else {
            STAGES[8]
        };
    }
    if has(&["ring_buf", "RingBuf", "drain_ring", "next_events"]) {
        STAGES[0]
    } else if has(&["nattrace::collector", "tracer_common"]) {
        STAGES[1]
    } else if has(&[
        "serde_json",
        "nattrace::output",
        "serde::ser",
        "core::fmt",
        "itoa",
        "ryu",
    ]) {
        STAGES[2]
    } else if has(&[
        "nattrace::recording",
        "nattrace::continuous",
        "nattrace::pods",
    ]) {
        STAGES[3]
    } else if has(&[
        "malloc",
        "free",
        "realloc",
        "__rust_alloc",
        "__rdl_",
        "memalign",
    ]) {
        STAGES[4]
    } else if has(&["tokio", "mio::"]) {
        STAGES[5]
    } else {
        STAGES[9]
    }
}

fn is_idle(sym: &str) -> bool {
    [
        "pv_native_safe_halt",
        "default_idle",
        "cpuidle_",
        "do_idle",
        "poll_idle",
        "acpi_idle",
    ]
    .iter()
    .any(|p| sym.starts_with(p))
}

/// `perf report` lines `samples|comm|dso|[k] sym` (leaf symbols only).
fn report(data: &Path, extra: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("perf")
        .arg("report")
        .arg("-i")
        .arg(data)
        .args(["--no-children", "-g", "none", "--stdio", "-q"])
        .args(["--field-separator", "|"])
        .args(extra)
        .stderr(Stdio::null())
        .output()
        .context("perf report")?;
    if !out.status.success() {
        bail!("perf report failed ({})", out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Reads one profile; `tracer` names the tracer's threads.
pub fn summarize(
    data: &Path,
    label: &str,
    work: f64,
    tracer: &HashSet<u32>,
) -> anyhow::Result<Profile> {
    let ms = 1000.0 / FREQ as f64;
    let mut p = Profile {
        label: label.into(),
        work,
        ..Profile::default()
    };
    let text = report(
        data,
        &[
            "--fields",
            "sample,parent,pid,dso,sym",
            "--parent",
            "handle_softirqs|__do_softirq|net_rx_action",
        ],
    )?;
    for line in text.lines() {
        let f: Vec<&str> = line.split('|').map(str::trim).collect();
        let [n, parent, pid, _dso, sym] = f[..] else {
            continue;
        };
        let Ok(n) = n.parse::<f64>() else { continue };
        let Some((tid, comm)) = pid.split_once(':') else {
            continue;
        };
        let tid: u32 = tid.trim().parse().unwrap_or(0);
        let user = sym.starts_with("[.]");
        let sym = sym.trim_start_matches("[k] ").trim_start_matches("[.] ");
        if is_idle(sym) {
            continue;
        }
        let softirq = !parent.contains("[other]");
        // A softirq runs on whatever task it interrupted or that
        // re-enabled bottom halves (kernel/softirq.c: irq_exit_rcu ->
        // invoke_softirq, __local_bh_enable_ip -> do_softirq), and perf
        // charges it to that task. On the tracer's threads that is the
        // workload's packets (and their BPF programs, already counted by
        // BPF_ENABLE_STATS), not the tracer's work.
        let b = if softirq && tracer.contains(&tid) {
            p.tracer_softirq_ms += n * ms;
            bucket((tid, comm), sym, user, softirq, &HashSet::new())
        } else {
            bucket((tid, comm), sym, user, softirq, tracer)
        };
        *p.buckets.entry(b).or_default() += n * ms;
        if b == BUCKETS[5] {
            *p.tracer_stages.entry(stage(sym, user)).or_default() += n * ms;
            let tag = if user { "" } else { "[k] " };
            *p.tracer_syms.entry(format!("{tag}{sym}")).or_default() += n * ms;
        }
        if b == BUCKETS[8] {
            continue;
        }
        p.busy_ms += n * ms;
        if softirq {
            p.softirq_ms += n * ms;
        }
        if !user && b != BUCKETS[5] {
            *p.syms.entry(sym.to_string()).or_default() += n * ms;
        }
    }
    Ok(p)
}

pub fn data_file(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "nattrace-bench-{}-{name}.perf.data",
        std::process::id()
    ))
}

/// The comparison table of `traced` against `base`, per unit of work.
pub fn markdown(w: &mut String, base: &Profile, traced: &[Profile], unit: &str) {
    let per = |p: &Profile, v: f64| v / p.work.max(1e-9);
    let _ = write!(w, "| bucket (CPU ms per {unit}) | {} |", base.label);
    for t in traced {
        let _ = write!(w, " {} | extra |", t.label);
    }
    let _ = write!(w, "\n|---|---|");
    for _ in traced {
        let _ = write!(w, "---|---|");
    }
    let _ = writeln!(w);
    let mut rows: Vec<&str> = BUCKETS.to_vec();
    rows.push("**all busy CPU but other processes'**");
    rows.push("of which in softirq (call chain through net_rx_action)");
    let value = |p: &Profile, i: usize| match i {
        i if i < BUCKETS.len() => p.buckets.get(BUCKETS[i]).copied().unwrap_or(0.0),
        i if i == BUCKETS.len() => p.busy_ms,
        _ => p.softirq_ms,
    };
    for (i, name) in rows.iter().enumerate() {
        let b = per(base, value(base, i));
        let _ = write!(w, "| {name} | {b:.1} |");
        for t in traced {
            let v = per(t, value(t, i));
            let _ = write!(w, " {v:.1} | {:+.1} |", v - b);
        }
        let _ = writeln!(w);
    }
    for t in traced {
        let mut extra: Vec<(String, f64)> = t
            .syms
            .iter()
            .map(|(s, v)| {
                let b = base.syms.get(s).copied().unwrap_or(0.0);
                (s.clone(), per(t, *v) - per(base, b))
            })
            .collect();
        extra.sort_by(|a, b| b.1.total_cmp(&a.1));
        let list: Vec<String> = extra
            .iter()
            .take(10)
            .map(|(s, v)| format!("`{s}` {v:+.1}"))
            .collect();
        let _ = writeln!(
            w,
            "\nKernel symbols with the most extra CPU ms per {unit}, {}: {}.",
            t.label,
            list.join(", ")
        );
    }
    let _ = writeln!(w);
    tracer_stages(w, traced, unit);
}

/// The tracer process's own time by stage, in µs per unit/1000 (per
/// connection for "1000 conns", per MB for "GB"), and its top symbols.
fn tracer_stages(w: &mut String, traced: &[Profile], unit: &str) {
    let traced: Vec<&Profile> = traced
        .iter()
        .filter(|t| !t.tracer_stages.is_empty())
        .collect();
    if traced.is_empty() {
        return;
    }
    let per = if unit == "GB" { "MB" } else { "connection" };
    let _ = write!(
        w,
        "| the tracer process's own CPU, by stage (µs per {per}) |"
    );
    for t in &traced {
        let _ = write!(w, " {} |", t.label);
    }
    let _ = write!(w, "\n|---|");
    for _ in &traced {
        let _ = write!(w, "---|");
    }
    let _ = writeln!(w);
    // CPU ms per (unit) = µs per (unit / 1000).
    let us = |t: &Profile, v: f64| v / t.work.max(1e-9);
    for name in STAGES {
        let _ = write!(w, "| {name} |");
        for t in &traced {
            let v = t.tracer_stages.get(name).copied().unwrap_or(0.0);
            let _ = write!(w, " {:.2} |", us(t, v));
        }
        let _ = writeln!(w);
    }
    let _ = write!(w, "| **all of the tracer process** |");
    for t in &traced {
        let all: f64 = t.tracer_stages.values().sum();
        let _ = write!(w, " **{:.2}** |", us(t, all));
    }
    let _ = write!(
        w,
        "\n| not counted above: softirqs sampled on its threads (the workload's packets) |"
    );
    for t in &traced {
        let _ = write!(w, " {:.2} |", us(t, t.tracer_softirq_ms));
    }
    let _ = writeln!(w);
    for t in &traced {
        let mut top: Vec<(&String, &f64)> = t.tracer_syms.iter().collect();
        top.sort_by(|a, b| b.1.total_cmp(a.1));
        let list: Vec<String> = top
            .iter()
            .take(12)
            .map(|(s, v)| format!("`{}` {:.2}", short(s), us(t, **v)))
            .collect();
        let _ = writeln!(
            w,
            "\nThe tracer's top symbols (µs per {per}), {}: {}.",
            t.label,
            list.join(", ")
        );
    }
    let _ = writeln!(w);
}

/// A Rust symbol without its hash and generic arguments, for the table.
fn short(sym: &str) -> String {
    let s = sym.split("::h").next().unwrap_or(sym);
    s.chars().take(90).collect()
}
