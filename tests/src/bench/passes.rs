//! The bench's two measuring passes that run after the interleaved ones, so
//! they cannot disturb them: BPF run time (BPF_ENABLE_STATS held only here)
//! and the CPU profile of each condition.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddrV4;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use crate::profile::{self, Profile};
use crate::report::{BpfSample, BpfScale, Cond, Results};
use crate::shared::{self, CONN_PORT, ClientLoad, ClientRun};
use crate::{Ctx, iperf, say, start_tcpdump};

/// Runs `f` while the condition is on: nattrace tracing `svc` (for Other
/// and This), or tcpdump writing cni0. Returns f's result and the tracer's
/// thread ids (for the profile's buckets).
fn under<R>(
    ctx: &Ctx,
    cond: Cond,
    svc: SocketAddrV4,
    f: impl FnOnce(u32) -> anyhow::Result<R>,
) -> anyhow::Result<(R, HashSet<u32>)> {
    match cond {
        Cond::None => Ok((f(0)?, HashSet::new())),
        Cond::Other | Cond::This | Cond::OtherBaseline | Cond::ThisBaseline => {
            let args = match cond {
                Cond::This => shared::this_args(),
                Cond::ThisBaseline => shared::baseline_args(),
                _ => Vec::new(),
            };
            let (tracer, _) = shared::start_nattrace(ctx.binary(cond), ctx.lab, &[svc], &args)?;
            let pid = tracer.pid();
            let names = profile::thread_ids(pid);
            let r = f(pid);
            shared::stop_nattrace(tracer)?;
            Ok((r?, names))
        }
        Cond::Tcpdump => {
            let file = std::env::temp_dir().join(format!(
                "nattrace-bench-{}-profile.pcap",
                std::process::id()
            ));
            let mut dump = start_tcpdump(ctx.lab, &file)?;
            let names = profile::thread_ids(dump.id());
            let r = f(dump.id());
            unsafe { libc::kill(dump.id() as i32, libc::SIGTERM) };
            let _ = dump.wait();
            let _ = std::fs::remove_file(&file);
            Ok((r?, names))
        }
    }
}

fn conn_load(ctx: &Ctx) -> ClientLoad {
    ClientLoad {
        count: 1_000_000,
        secs: ctx.opts.conn_secs,
        parallel: 2,
        timeout_ms: 2000,
    }
}

pub(crate) fn conn_svc(ctx: &Ctx) -> SocketAddrV4 {
    SocketAddrV4::new(ctx.addrs.conn_svc, CONN_PORT)
}

pub(crate) fn client(ctx: &Ctx) -> anyhow::Result<ClientRun> {
    shared::run_client(ctx.lab, ctx.conn_bench, &ctx.addrs, &conn_load(ctx))
}

/// BPF run time per program call and per unit of work, with stats on.
pub fn bpf_pass(ctx: &Ctx, r: &mut Results, bulk: bool, conn: bool) -> anyhow::Result<()> {
    let Some(_stats) = enable_bpf_stats() else {
        return Ok(());
    };
    let runs = ctx.opts.runs.clamp(1, 3);
    let mut conds = Vec::new();
    if bulk && ctx.opts.baseline.is_some() {
        conds.push((Cond::OtherBaseline, "bulk, baseline build, another Service"));
    }
    if bulk {
        conds.push((Cond::Other, "bulk, nattrace, another Service"));
        conds.push((Cond::This, "bulk, nattrace, this Service"));
    }
    if bulk && ctx.opts.baseline.is_some() {
        conds.push((Cond::ThisBaseline, "bulk, baseline build, this Service"));
    }
    if conn {
        conds.push((Cond::This, "connections, nattrace, this Service"));
    }
    if conn && ctx.opts.baseline.is_some() {
        conds.push((
            Cond::ThisBaseline,
            "connections, baseline build, this Service",
        ));
    }
    // Conditions alternate run by run, as in the timed runs: run time per
    // call is read from the clock, so it moves with the machine's load, and
    // a fixed order put one build's runs first every time (2026-12-05: the
    // miss path read 7-15% apart between two builds in that order).
    let mut samples: Vec<BpfSample> = conds
        .iter()
        .map(|(cond, label)| BpfSample {
            label: (*label).into(),
            unit: if label.starts_with("conn") {
                "1000 conns"
            } else {
                "GB"
            },
            cond: Some(*cond),
            ..BpfSample::default()
        })
        .collect();
    for _ in 0..runs {
        for ((cond, label), s) in conds.iter().zip(samples.iter_mut()) {
            let (cond, is_conn) = (*cond, label.starts_with("conn"));
            let svc = if is_conn {
                conn_svc(ctx)
            } else {
                ctx.svc(cond)
            };
            let ((work, delta), _) = under(ctx, cond, svc, |pid| {
                let before = prog_runtime(pid);
                let work = if is_conn {
                    client(ctx)?.attempted as f64 / 1000.0
                } else {
                    iperf(ctx)? * ctx.opts.secs as f64 / 8.0
                };
                let after = prog_runtime(pid);
                Ok((work, runtime_delta(&before, &after)))
            })?;
            s.work += work;
            for (name, (ns, calls)) in delta {
                s.ns += ns;
                s.calls += calls;
                let p = s.progs.entry(name).or_default();
                p.0 += ns;
                p.1 += calls;
            }
        }
    }
    for s in samples {
        say(&format!(
            "bpf stats {}: {:.0} ns/call, {:.0} calls per {}",
            s.label,
            s.ns as f64 / s.calls.max(1) as f64,
            s.calls as f64 / s.work.max(1e-9),
            s.unit
        ));
        for (name, (ns, calls)) in &s.progs {
            say(&format!(
                "  {name}: {:.0} ns/call, {:.0} calls per {}",
                *ns as f64 / (*calls).max(1) as f64,
                *calls as f64 / s.work.max(1e-9),
                s.unit
            ));
        }
        r.bpf.push(s);
    }
    Ok(())
}

/// The BPF cost of one traced connection-rate run on `ctx`'s node, this
/// build, with stats on only for it: what a big node pays per connection
/// in the kernel (issue 25 item 4). `args` start nattrace (`--all-services`
/// traces every Service; else the bench's connection Service).
pub fn bpf_per_conn(ctx: &Ctx, args: &[&str]) -> anyhow::Result<Option<BpfScale>> {
    let Some(_stats) = enable_bpf_stats() else {
        return Ok(None);
    };
    // A scale node is new: without its server every connection would be
    // a SYN and a RST (two packets, where a served one has eight).
    shared::start_conn_server(ctx.lab, ctx.conn_bench)?;
    let svcs = if args.contains(&"--all-services") {
        Vec::new()
    } else {
        vec![conn_svc(ctx)]
    };
    let (tracer, _) = shared::start_nattrace(ctx.binary(Cond::This), ctx.lab, &svcs, args)?;
    let pid = tracer.pid();
    let before = prog_runtime(pid);
    let run = client(ctx);
    let after = prog_runtime(pid);
    shared::stop_nattrace(tracer)?;
    let run = run?;
    anyhow::ensure!(
        run.ok * 10 >= run.attempted * 9,
        "{} of {} connections served: not the healthy load this measures",
        run.ok,
        run.attempted
    );
    let thousands = run.attempted as f64 / 1000.0;
    let (ns, calls) = runtime_delta(&before, &after)
        .values()
        .fold((0u64, 0u64), |(n, c), (dn, dc)| (n + dn, c + dc));
    let b = BpfScale {
        ns_per_call: ns as f64 / calls.max(1) as f64,
        calls_per_1000: calls as f64 / thousands.max(1e-9),
        bpf_ms_per_1000: ns as f64 / 1e6 / thousands.max(1e-9),
    };
    say(&format!(
        "bpf per connection: {:.0} ns/call, {:.0} calls and {:.2} BPF CPU ms per 1000 conns",
        b.ns_per_call, b.calls_per_1000, b.bpf_ms_per_1000
    ));
    Ok(Some(b))
}

/// One profiled run per condition, bulk and connection rate.
pub fn profile_pass(ctx: &Ctx, r: &mut Results, bulk: bool, conn: bool) -> anyhow::Result<()> {
    if std::process::Command::new("perf")
        .arg("--version")
        .output()
        .is_err()
    {
        say("perf not found (Debian package linux-perf): no CPU profile");
        return Ok(());
    }
    r.perf_event = profile::event();
    let mut sets: Vec<(&'static str, Vec<Cond>)> = Vec::new();
    if bulk {
        let c = vec![Cond::None, Cond::Other, Cond::This, Cond::Tcpdump];
        sets.push(("GB", c));
    }
    if conn {
        // With a baseline, its process is profiled in the same rounds too:
        // the tracer's µs per connection of two builds, one machine state.
        let mut c = vec![Cond::None, Cond::This];
        if ctx.opts.baseline.is_some() {
            c.push(Cond::ThisBaseline);
        }
        c.push(Cond::Tcpdump);
        sets.push(("1000 conns", c));
    }
    for (unit, conds) in sets {
        let is_conn = unit != "GB";
        let mut profs: Vec<Profile> = conds
            .iter()
            .map(|c| Profile {
                label: c.label().into(),
                ..Profile::default()
            })
            .collect();
        for _ in 0..PROFILE_ROUNDS {
            for (cond, prof) in conds.iter().zip(&mut profs) {
                prof.merge(profile_one(ctx, *cond, is_conn, r.perf_event)?);
            }
        }
        for p in &profs {
            say(&format!(
                "profile {}: {:.1} busy CPU ms per {unit}",
                p.label,
                p.busy_ms / p.work.max(1e-9)
            ));
        }
        let base = profs.remove(0);
        r.profiles.push((unit, base, profs));
    }
    Ok(())
}

/// Profiled runs per condition, interleaved like the measured runs: one
/// profile of a few seconds on a shared machine is mostly noise.
const PROFILE_ROUNDS: usize = 3;

fn profile_one(ctx: &Ctx, cond: Cond, is_conn: bool, event: &str) -> anyhow::Result<Profile> {
    let svc = if is_conn {
        conn_svc(ctx)
    } else {
        ctx.svc(cond)
    };
    let data = profile::data_file(&format!("{cond:?}"));
    let (work, tids) = under(ctx, cond, svc, |_| {
        let perf = profile::start(&data, event)?;
        let work = if is_conn {
            client(ctx).map(|c| c.attempted as f64 / 1000.0)
        } else {
            iperf(ctx).map(|g| g * ctx.opts.secs as f64 / 8.0)
        };
        profile::stop(perf)?;
        work
    })?;
    let p = profile::summarize(&data, cond.label(), work, &tids);
    let _ = std::fs::remove_file(&data);
    p
}

/// BPF_ENABLE_STATS(BPF_STATS_RUN_TIME): run time is counted while the fd lives.
fn enable_bpf_stats() -> Option<OwnedFd> {
    const BPF_ENABLE_STATS: libc::c_long = 32;
    let attr: [u32; 2] = [0, 0];
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_ENABLE_STATS,
            attr.as_ptr(),
            std::mem::size_of_val(&attr),
        )
    };
    if fd < 0 {
        say(&format!(
            "BPF_ENABLE_STATS unavailable: {}",
            std::io::Error::last_os_error()
        ));
        return None;
    }
    Some(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Run time and calls of each program a process holds, directly or
/// through its links, by program id: the netfilter programs' fds are closed
/// once their links hold them, so every program is reached by its id (a
/// program fd's and a link's fdinfo both name it).
fn prog_runtime(pid: u32) -> BTreeMap<u64, ProgRuntime> {
    let mut progs = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir(Path::new(&format!("/proc/{pid}/fdinfo"))) else {
        return progs;
    };
    for entry in dir.flatten() {
        let Ok(info) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        if let (Some(id), _) = prog_fdinfo(&info)
            && !progs.contains_key(&id)
            && let Some(p) = prog_runtime_by_id(id)
        {
            progs.insert(id, p);
        }
    }
    progs
}

/// One program's name (the kernel's, at most 15 bytes) and its counters.
#[derive(Clone, Debug)]
struct ProgRuntime {
    name: String,
    ns: u64,
    calls: u64,
}

/// What each program ran between two readings, summed by name (a program
/// loaded twice, e.g. per address family, is one row).
fn runtime_delta(
    before: &BTreeMap<u64, ProgRuntime>,
    after: &BTreeMap<u64, ProgRuntime>,
) -> BTreeMap<String, (u64, u64)> {
    let mut by_name: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for (id, a) in after {
        let (ns0, calls0) = before.get(id).map_or((0, 0), |b| (b.ns, b.calls));
        let e = by_name.entry(a.name.clone()).or_default();
        e.0 += a.ns.saturating_sub(ns0);
        e.1 += a.calls.saturating_sub(calls0);
    }
    by_name
}

/// (prog_id, (run_time_ns, run_cnt)) from one fdinfo text.
fn prog_fdinfo(info: &str) -> (Option<u64>, Option<(u64, u64)>) {
    let field = |k: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    let stats = field("run_time_ns:").zip(field("run_cnt:"));
    (field("prog_id:"), stats)
}

/// A program's name and run time by id: BPF_PROG_GET_FD_BY_ID, then its
/// fdinfo (run time) and BPF_OBJ_GET_INFO_BY_FD (name; fdinfo has none).
fn prog_runtime_by_id(id: u64) -> Option<ProgRuntime> {
    const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
    // union bpf_attr for this command: prog_id (u32), next_id, open_flags.
    let mut attr = [0u32; 4];
    attr[0] = u32::try_from(id).ok()?;
    let fd = sys_bpf(BPF_PROG_GET_FD_BY_ID, &mut attr);
    if fd < 0 {
        return None;
    }
    // SAFETY: the kernel just gave us this fd.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd())).ok()?;
    let (ns, calls) = prog_fdinfo(&info).1?;
    Some(ProgRuntime {
        name: prog_name(&fd).unwrap_or_else(|| format!("prog {id}")),
        ns,
        calls,
    })
}

/// bpf(2) with `attr` as the command's union bpf_attr.
fn sys_bpf<T>(cmd: libc::c_long, attr: &mut [T]) -> libc::c_long {
    // SAFETY: attr outlives the call and is as large as the kernel reads
    // for the commands used here.
    unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.as_mut_ptr(),
            std::mem::size_of_val(attr),
        )
    }
}

/// struct bpf_prog_info's `name` (include/uapi/linux/bpf.h): the kernel
/// copies only as much of the struct as asked for, so the 80 bytes up to
/// and with the name are enough.
fn prog_name(fd: &OwnedFd) -> Option<String> {
    const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    const NAME_AT: usize = 64;
    let mut info = [0u8; NAME_AT + 16];
    // union bpf_attr for this command: bpf_fd (u32), info_len (u32), info (u64).
    let mut attr = [0u64; 2];
    attr[0] = u64::from(fd.as_raw_fd() as u32) | ((info.len() as u64) << 32);
    attr[1] = info.as_mut_ptr() as u64;
    // The kernel writes at most info_len bytes into info, which outlives
    // the call.
    let r = sys_bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr);
    if r < 0 {
        return None;
    }
    let name = &info[NAME_AT..];
    let len = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    Some(String::from_utf8_lossy(&name[..len]).into_owned()).filter(|n| !n.is_empty())
}
