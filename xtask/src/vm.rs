//! `cargo xtask vm-test`: boot Debian guest kernels under QEMU (TCG) and run a
//! payload in each — the only way to exercise kprobes from this build machine
//! (see docs/MACHINE.md, "Guest kernels under QEMU").
//!
//! Per kernel: newest Debian package → cached unpack → ELF vmlinux + modules →
//! initramfs (busybox, iproute2, iptables, conntrack, musl payload binaries) →
//! one qemu per kernel, in parallel, console streamed with a `[kernel]` prefix.

pub mod deps;
mod fixtures;
pub mod initramfs;
mod kernel;
mod qemu;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use kernel::{Kernel, Series};

/// The smoke checks (xtask/src/vm/smoke.sh), then the scenario runner
/// (tests/src/bin/vm-guest.rs). The runner runs even when a smoke check
/// failed: its own report says more about what that breaks.
const DEFAULT_PAYLOAD: &str =
    "/bin/vm-smoke; smoke=$?; /bin/vm-guest; guest=$?; [ $smoke = 0 ] && [ $guest = 0 ]";

/// Workspace binaries every guest gets in /bin, as PACKAGE:BIN (built for musl).
/// vm-guest finds nattrace and lab-server next to itself.
pub const PAYLOAD_BINS: &[&str] = &[
    "tracer-userspace:nattrace",
    "nattrace-tests:vm-guest",
    "nattrace-tests:lab-server",
];

#[derive(clap::Args)]
pub struct VmTestArgs {
    /// Kernel series to boot; repeat for several (default: all).
    #[arg(long = "kernel", value_enum)]
    kernels: Vec<Series>,
    /// Let every VM finish even after one fails (default: the first failure stops the rest).
    #[arg(long)]
    keep_going: bool,
    /// Shell command line the guest runs instead of the smoke test; its exit status decides.
    #[arg(long)]
    payload: Option<String>,
    /// Extra workspace binary for the guest's /bin (besides PAYLOAD_BINS), as PACKAGE:BIN; repeatable.
    #[arg(long = "bin", value_name = "PACKAGE:BIN")]
    bins: Vec<String>,
    /// Record seed 000 broken and healthy with the kprobe backend in each guest and
    /// write the recordings, with golden `analyze` output, into DIR (instead of the smoke test).
    #[arg(long, value_name = "DIR", conflicts_with = "payload")]
    record_fixtures: Option<PathBuf>,
    /// Seconds a VM may go without a console line (boot included) before it
    /// is killed as hung and counted as failed: progress, not total time.
    #[arg(long, default_value_t = DEFAULT_TIMEOUT_SECS)]
    timeout: u64,
}

/// 300: on a machine whose core is half as fast as the earlier ones', both
/// guests beside the root tests and `stress-ng --cpu 2` went 180 s without
/// a line inside the smoke's TCP step (at most ~75 s of guest time: a
/// 10 s listen poll, `nc -w 3`, `timeout 60`), before nattrace ran; a hung
/// guest still fails, 2 minutes later.
const DEFAULT_TIMEOUT_SECS: u64 = 300;

/// What `cargo xtask vm-test` with no options does (all kernels, smoke payload).
impl Default for VmTestArgs {
    fn default() -> Self {
        VmTestArgs {
            kernels: Vec::new(),
            keep_going: false,
            payload: None,
            bins: Vec::new(),
            record_fixtures: None,
            timeout: DEFAULT_TIMEOUT_SECS,
        }
    }
}

pub fn run(args: VmTestArgs) -> Result<()> {
    let started = Instant::now();
    qemu::install_interrupt_handler();
    let series = if args.kernels.is_empty() {
        vec![Series::V6_1, Series::V6_12]
    } else {
        let mut s = args.kernels.clone();
        s.sort();
        s.dedup();
        s
    };
    let cache = &target_dir().join("vm-cache");
    std::fs::create_dir_all(cache)?;

    let (ready, mut results) = prepare(&args, &series, cache)?;
    let prepared = started.elapsed();
    for (k, initrd) in &ready {
        let size = std::fs::metadata(initrd)?.len();
        eprintln!(
            "vm-test: {} = {} ({} modules, initramfs {:.1} MB)",
            k.series.label(),
            k.release,
            k.modules.len(),
            size as f64 / 1e6
        );
    }

    let outcomes = boot_all(&args, &ready, cache);

    for ((k, _), out) in ready.iter().zip(outcomes) {
        let mut verdict = match out {
            Ok(o) => describe(&o),
            Err(e) => format!("FAILED: {e:#}"),
        };
        if let Some(dir) = &args.record_fixtures {
            let log = cache.join(format!("{}.log", k.series.label()));
            match record(&log, dir) {
                Ok(n) => verdict.push_str(&format!(", {n} recordings written")),
                Err(e) => verdict = format!("FAILED: recordings: {e:#}"),
            }
        }
        results.push((format!("{} ({})", k.series.label(), k.release), verdict));
    }
    eprintln!(
        "vm-test: preparation {:.1}s, total {:.1}s",
        prepared.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    for (name, verdict) in &results {
        eprintln!("vm-test: {name}: {verdict}");
    }
    let failed = results.iter().filter(|(_, v)| !v.starts_with("ok")).count();
    if failed > 0 {
        bail!(
            "{failed} of {} kernel(s) failed; logs in {}",
            results.len(),
            cache.display()
        );
    }
    Ok(())
}

/// A kernel's label and how its run went ("ok ..." or why not).
type Verdict = (String, String);
/// A prepared kernel and its initramfs.
type Ready = (Kernel, PathBuf);

/// Prepares each kernel and its initramfs (with the payload built for musl);
/// kernels that failed to prepare are in the second list under `--keep-going`.
fn prepare(
    args: &VmTestArgs,
    series: &[Series],
    cache: &Path,
) -> Result<(Vec<Ready>, Vec<Verdict>)> {
    // Kernel preparation is mostly decompression and disk; the musl build is
    // mostly CPU. Overlapping them saves most of the first run's preparation time.
    let (kernels, binaries) = thread::scope(|s| {
        let preps: Vec<_> = series
            .iter()
            .map(|&k| (k, s.spawn(move || kernel::prepare(k, cache))))
            .collect();
        let mut bins: Vec<String> = PAYLOAD_BINS.iter().map(|b| b.to_string()).collect();
        bins.extend(args.bins.iter().cloned());
        let binaries = build_payload(&bins);
        let kernels: Vec<(Series, Result<Kernel>)> = preps
            .into_iter()
            .map(|(k, h)| (k, h.join().expect("kernel preparation panicked")))
            .collect();
        (kernels, binaries)
    });
    let payload = initramfs::Payload {
        binaries: binaries?,
        command: match (&args.payload, &args.record_fixtures) {
            (Some(p), _) => p.clone(),
            (None, Some(_)) => fixtures::PAYLOAD.to_string(),
            (None, None) => DEFAULT_PAYLOAD.to_string(),
        },
    };

    let base = initramfs::base(&payload)?;
    let mut ready = Vec::new();
    let mut results: Vec<Verdict> = Vec::new();
    for (series, k) in kernels {
        let k = k.and_then(|k| {
            let path = cache.join(format!("initramfs-{}.cpio", series.label()));
            kernel::write_atomic(&path, &initramfs::build(&base, &k)?)?;
            Ok((k, path))
        });
        match k {
            Ok(k) => ready.push(k),
            Err(e) if args.keep_going => {
                results.push((series.label().into(), format!("FAILED to prepare: {e:#}")));
            }
            Err(e) => return Err(e.context(format!("preparing kernel {}", series.label()))),
        }
    }
    Ok((ready, results))
}

/// Boots every prepared kernel in its own qemu, all at once; unless
/// `--keep-going`, the first failure stops the others.
fn boot_all(args: &VmTestArgs, ready: &[Ready], cache: &Path) -> Vec<Result<qemu::Outcome>> {
    let abort = AtomicBool::new(false);
    thread::scope(|s| {
        let handles: Vec<_> = ready
            .iter()
            .map(|(k, initrd)| {
                let vm = qemu::Vm {
                    label: k.series.label(),
                    vmlinux: &k.vmlinux,
                    initramfs: initrd,
                    log: cache.join(format!("{}.log", k.series.label())),
                    timeout: Duration::from_secs(args.timeout),
                    abort: &abort,
                };
                let abort = &abort;
                let keep_going = args.keep_going;
                s.spawn(move || {
                    let out = qemu::boot(&vm);
                    if !keep_going && !out.as_ref().is_ok_and(|o| o.passed()) {
                        abort.store(true, Ordering::Relaxed);
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("VM thread panicked"))
            .collect::<Vec<_>>()
    })
}

/// The recordings in a guest's console log, into `dir` with their goldens
/// (analyzed by this host's debug nattrace, as `cargo xtask fixtures` does).
fn record(log: &Path, dir: &Path) -> Result<usize> {
    crate::workspace::cargo(&["build", "--bin", "nattrace"])?;
    let nattrace = target_dir().join("debug/nattrace");
    let written = fixtures::write(log, dir, &nattrace)?;
    if written.is_empty() {
        bail!("{} holds no recording", log.display());
    }
    Ok(written.len())
}

fn describe(o: &qemu::Outcome) -> String {
    let boot = o
        .boot
        .map_or("-".into(), |b| format!("{:.1}s", b.as_secs_f64()));
    let times = format!("boot {boot}, run {:.1}s", o.total.as_secs_f64());
    if o.passed() {
        format!("ok ({times})")
    } else if o.timed_out {
        format!("FAILED: timeout ({times})")
    } else if o.aborted {
        format!("stopped: another kernel failed ({times})")
    } else if let Some(rc) = o.rc {
        format!("FAILED: payload rc={rc} ({times})")
    } else {
        format!(
            "FAILED: guest ended without a result, qemu {:?} ({times})",
            o.qemu_status
        )
    }
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::workspace::workspace_root().join("target"))
}

/// The release nattrace linked statically against musl: what the guests run,
/// and what `cargo xtask musl` hands to nodes and kind (nothing to install there).
pub fn build_static_nattrace() -> Result<PathBuf> {
    let mut paths = build_payload(&["tracer-userspace:nattrace".to_string()])?;
    Ok(paths.remove(0))
}

/// Builds the guest's binaries statically (musl) in one cargo call, so shared
/// dependencies compile once; returns their paths.
pub fn build_payload(bins: &[String]) -> Result<Vec<PathBuf>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(crate::workspace::workspace_root()).args([
        "build",
        "--release",
        "--target",
        deps::PAYLOAD_TARGET,
    ]);
    let mut paths = Vec::new();
    for spec in bins {
        let (pkg, bin) = spec
            .split_once(':')
            .with_context(|| format!("--bin {spec}: expected PACKAGE:BIN"))?;
        cmd.args(["-p", pkg, "--bin", bin]);
        paths.push(
            target_dir()
                .join(deps::PAYLOAD_TARGET)
                .join("release")
                .join(bin),
        );
    }
    if paths.is_empty() {
        return Ok(paths);
    }
    eprintln!(
        "xtask: building {} for {}",
        bins.join(", "),
        deps::PAYLOAD_TARGET
    );
    kernel::run(&mut cmd).context("building the payload for musl")?;
    Ok(paths)
}
