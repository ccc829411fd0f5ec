//! Booting a guest under QEMU: console streaming, a hang timeout, and making sure every
//! qemu we started is gone when vm-test ends, however it ends.
//!
//! Other qemus may run on the machine, so we only ever signal the pids we spawned.
//! A pid stays in `RUNNING` exactly as long as its process is unreaped: removal
//! and reaping happen under the same lock, so the interrupt handler can never
//! signal a pid that the kernel has already handed to someone else.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// Printed by the guest's /init after the payload, with its exit status.
pub const RESULT_MARKER: &str = "NATTRACE-VM-RESULT rc=";
/// Printed by /init once it runs, i.e. when the kernel has booted.
const BOOTED_MARKER: &str = "vm: kernel ";

static RUNNING: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// On SIGINT/SIGTERM/SIGHUP: kill our qemus, then exit. Without this, Ctrl-C
/// would leave VMs burning the shared cores for up to their timeout.
/// Idempotent, and only a warning if another part of xtask already owns the
/// signals: PDEATHSIG (see `boot`) still takes the VMs down with the process.
pub fn install_interrupt_handler() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let installed = ctrlc::set_handler(|| {
            eprintln!("vm-test: interrupted, killing the VMs it started");
            kill_running();
            std::process::exit(130);
        });
        if let Err(e) = installed {
            eprintln!("vm-test: warning: no Ctrl-C handler of our own ({e})");
        }
    });
}

/// Kills every qemu this process started that is still running.
fn kill_running() {
    let running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
    for &pid in running.iter() {
        // SAFETY: kill(2) has no memory-safety preconditions.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    }
}

pub struct Vm<'a> {
    pub label: &'a str,
    pub vmlinux: &'a Path,
    pub initramfs: &'a Path,
    pub log: PathBuf,
    /// How long the guest may print nothing on its console before it is
    /// killed as hung. A bound on silence, not on the whole run: under TCG on
    /// a loaded host a working guest is slow, but it keeps printing (boot,
    /// then one line per check).
    pub timeout: Duration,
    /// Set by another VM's failure when the run should stop early.
    pub abort: &'a AtomicBool,
}

pub struct Outcome {
    /// The payload's exit status, if the guest got to report it.
    pub rc: Option<i32>,
    /// From qemu start to /init's first line.
    pub boot: Option<Duration>,
    pub total: Duration,
    pub timed_out: bool,
    pub aborted: bool,
    pub qemu_status: Option<ExitStatus>,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        self.rc == Some(0) && !self.timed_out && !self.aborted
    }
}

pub fn boot(vm: &Vm) -> Result<Outcome> {
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args([
        "-accel",
        "tcg,thread=multi",
        "-cpu",
        "max",
        "-m",
        "1024",
        "-smp",
        "1",
    ])
    .args(["-nographic", "-no-reboot", "-nic", "none"])
    .arg("-kernel")
    .arg(vm.vmlinux)
    .arg("-initrd")
    .arg(vm.initramfs)
    .args(["-append", "console=ttyS0 panic=-1 quiet"])
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    // Own process group: the terminal's Ctrl-C reaches only us, and we decide
    // what happens to the VMs (our handler kills them).
    .process_group(0);
    // SAFETY: prctl is async-signal-safe. PDEATHSIG covers the one exit our handler
    // can't see, SIGKILL of vm-test itself; it fires when the spawning thread ends,
    // and that thread waits for qemu.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }

    // Before the spawn: from there on, every early return would strand a qemu.
    let log = File::create(&vm.log).with_context(|| format!("creating {}", vm.log.display()))?;
    let log = std::sync::Arc::new(Mutex::new(log));
    let start = Instant::now();
    let mut child = {
        let mut running = RUNNING.lock().unwrap();
        let child = cmd
            .spawn()
            .context("starting qemu-system-x86_64 (cargo xtask setup)")?;
        running.push(child.id());
        child
    };
    let last_line = std::sync::Arc::new(Mutex::new(Instant::now()));
    let out = stream(
        vm.label,
        child.stdout.take().unwrap(),
        log.clone(),
        start,
        last_line.clone(),
    );
    let err = stream(
        &format!("{} qemu", vm.label),
        child.stderr.take().unwrap(),
        log,
        start,
        last_line.clone(),
    );

    let mut timed_out = false;
    let mut aborted = false;
    let status = loop {
        if let Some(st) = reap(&mut child, false)? {
            break Some(st);
        }
        if last_line.lock().unwrap().elapsed() > vm.timeout {
            timed_out = true;
        } else if vm.abort.load(Ordering::Relaxed) {
            aborted = true;
        }
        if timed_out || aborted {
            reap(&mut child, true)?;
            break None;
        }
        thread::sleep(Duration::from_millis(100));
    };
    let seen = out.join().expect("console reader panicked");
    let _ = err.join();
    if timed_out {
        println!(
            "[{}] vm-test: killed after {:?} without a console line (hung)",
            vm.label, vm.timeout
        );
    }
    Ok(Outcome {
        rc: seen.rc,
        boot: seen.boot,
        total: start.elapsed(),
        timed_out,
        aborted,
        qemu_status: status,
    })
}

/// Reaps the child if it has exited (or kills and reaps it), dropping its pid
/// from `RUNNING` in the same critical section.
fn reap(child: &mut Child, kill: bool) -> Result<Option<ExitStatus>> {
    let mut running = RUNNING.lock().unwrap();
    let status = if kill {
        let _ = child.kill();
        Some(child.wait()?)
    } else {
        child.try_wait()?
    };
    if status.is_some() {
        running.retain(|&p| p != child.id());
    }
    Ok(status)
}

#[derive(Default)]
struct Seen {
    rc: Option<i32>,
    boot: Option<Duration>,
}

/// Copies a qemu stream to the terminal (prefixed) and the log, watching for markers.
fn stream(
    label: &str,
    pipe: impl Read + Send + 'static,
    log: std::sync::Arc<Mutex<File>>,
    start: Instant,
    last_line: std::sync::Arc<Mutex<Instant>>,
) -> thread::JoinHandle<Seen> {
    let prefix = format!("[{label}] ");
    thread::spawn(move || {
        let mut seen = Seen::default();
        let mut reader = BufReader::new(pipe);
        let mut buf = Vec::new();
        while matches!(reader.read_until(b'\n', &mut buf), Ok(n) if n > 0) {
            *last_line.lock().unwrap() = Instant::now();
            let line = printable(&String::from_utf8_lossy(&buf));
            let line = line.as_str();
            if seen.boot.is_none() && line.starts_with(BOOTED_MARKER) {
                seen.boot = Some(start.elapsed());
            }
            // find, not starts_with: a kernel message can land mid-line on the console.
            if let Some(i) = line.find(RESULT_MARKER) {
                let rc = line[i + RESULT_MARKER.len()..].split_whitespace().next();
                seen.rc = rc.and_then(|r| r.parse().ok());
            }
            let _ = writeln!(log.lock().unwrap(), "{line}");
            println!("{prefix}{line}");
            buf.clear();
        }
        seen
    })
}

/// Drops terminal escape sequences and control characters: SeaBIOS resets and
/// clears the screen on the serial console, which would wipe the user's terminal.
fn printable(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        match c {
            '\x1b' => {
                // CSI sequences run to a final byte in '@'..='~'; others are ESC + one char.
                if chars.next() == Some('[') {
                    for c in chars.by_ref() {
                        if ('@'..='~').contains(&c) {
                            break;
                        }
                    }
                }
            }
            '\t' => out.push(c),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out
}
