//! The bench's two measuring passes that run after the interleaved ones, so
//! they cannot disturb them: BPF run time (BPF_ENABLE_STATS held only here)
//! and the CPU profile of each condition.

use std::collections::HashSet;
use std::net::SocketAddrV4;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;

use crate::profile::{self, Profile};
use crate::report::{BpfSample, Cond, Results};
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
            let (tracer, _) = shared::start_nattrace(ctx.binary(cond), ctx.lab, &[svc], &[])?;
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
    for (cond, label) in conds {
        let is_conn = label.starts_with("conn");
        let svc = if is_conn {
            conn_svc(ctx)
        } else {
            ctx.svc(cond)
        };
        let mut s = BpfSample {
            label: label.into(),
            unit: if is_conn { "1000 conns" } else { "GB" },
            ..BpfSample::default()
        };
        for _ in 0..runs {
            let ((work, ns, calls), _) = under(ctx, cond, svc, |pid| {
                let before = prog_runtime(pid);
                let work = if is_conn {
                    client(ctx)?.attempted as f64 / 1000.0
                } else {
                    iperf(ctx)? * ctx.opts.secs as f64 / 8.0
                };
                let after = prog_runtime(pid);
                Ok((work, after.0 - before.0, after.1 - before.1))
            })?;
            s.work += work;
            s.ns += ns;
            s.calls += calls;
        }
        say(&format!(
            "bpf stats {label}: {:.0} ns/call, {:.0} calls per {}",
            s.ns as f64 / s.calls.max(1) as f64,
            s.calls as f64 / s.work.max(1e-9),
            s.unit
        ));
        r.bpf.push(s);
    }
    Ok(())
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
        sets.push(("1000 conns", vec![Cond::None, Cond::This, Cond::Tcpdump]));
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

/// Sum of run_time_ns and run_cnt over the programs a process holds,
/// directly or through its links: the netfilter programs' fds are closed
/// once their links hold them, so those are reached by the link's prog_id.
fn prog_runtime(pid: u32) -> (u64, u64) {
    let mut seen = HashSet::new();
    let mut linked = Vec::new();
    let (mut ns, mut cnt) = (0, 0);
    let Ok(dir) = std::fs::read_dir(Path::new(&format!("/proc/{pid}/fdinfo"))) else {
        return (0, 0);
    };
    for entry in dir.flatten() {
        let Ok(info) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        match prog_fdinfo(&info) {
            (Some(id), Some((t, c))) if seen.insert(id) => {
                ns += t;
                cnt += c;
            }
            (Some(_), Some(_)) => {}
            // Only program fds carry run_time_ns; a link names its prog_id.
            (Some(id), None) => linked.push(id),
            _ => {}
        }
    }
    for id in linked {
        if seen.insert(id)
            && let Some((t, c)) = prog_runtime_by_id(id)
        {
            ns += t;
            cnt += c;
        }
    }
    (ns, cnt)
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

/// A program's run time by id: BPF_PROG_GET_FD_BY_ID, then its fdinfo.
fn prog_runtime_by_id(id: u64) -> Option<(u64, u64)> {
    const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
    // union bpf_attr for this command: prog_id (u32), next_id, open_flags.
    let mut attr = [0u32; 4];
    attr[0] = u32::try_from(id).ok()?;
    // SAFETY: attr outlives the call and is as large as the kernel reads.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_GET_FD_BY_ID,
            attr.as_mut_ptr(),
            std::mem::size_of_val(&attr),
        )
    };
    if fd < 0 {
        return None;
    }
    // SAFETY: the kernel just gave us this fd.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    use std::os::fd::AsRawFd;
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd())).ok()?;
    prog_fdinfo(&info).1
}
