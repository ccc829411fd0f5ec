//! Named network namespaces (`/run/netns/<name>`, the iproute2 convention, so
//! `ip netns exec` and `nattrace --netns` find them) and running commands in them.
//!
//! Commands enter a namespace with `setns(2)` in the forked child instead of
//! `ip netns exec`: that keeps the caller's mount namespace (`ip netns exec`
//! remounts /sys, hiding tracefs), avoids an extra exec, and the process we
//! start is the process we get a pid for.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use crate::error::{LabError, Result};

/// Where iproute2 keeps the bind mounts of named namespaces.
pub const NETNS_DIR: &str = "/run/netns";

/// Every namespace a lab creates starts with this, followed by
/// `<pid>-<counter>-<random>-`; [`cleanup_stale`] relies on that shape.
pub const NAME_PREFIX: &str = "ntlab-";

/// Lab-internal commands (ip, iptables-restore, sysctl writes) finish in
/// milliseconds; anything slower is stuck, and a stuck lab should fail loudly.
pub(crate) const INTERNAL_TIMEOUT: Duration = Duration::from_secs(20);

/// A named network namespace owned by a lab. Deleting it is the lab's job
/// (it must kill the processes inside first), so this type has no Drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// `ip netns add` creates the namespace and its bind mount atomically
    /// enough for us; it also creates /run/netns if needed.
    pub(crate) fn create(name: &str) -> Result<Netns> {
        run_checked(None, &["ip", "netns", "add", name], None)?;
        Ok(Netns {
            name: name.to_string(),
        })
    }

    /// A namespace someone else created (the CRI's `cni-…` pods).
    pub(crate) fn existing(name: &str) -> Netns {
        Netns {
            name: name.to_string(),
        }
    }

    /// The namespace's name as `ip netns list` shows it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The bind-mount path, e.g. `/run/netns/ntlab-123-0-ab12-node-a`
    /// (what `nattrace --netns` takes).
    pub fn path(&self) -> PathBuf {
        Path::new(NETNS_DIR).join(&self.name)
    }

    /// A `Command` whose child joins this namespace before exec.
    pub fn command(&self, program: &str) -> Result<Command> {
        let ns_file = File::open(self.path())
            .map_err(|e| LabError::io(format!("opening {}", self.path().display()), e))?;
        let mut cmd = Command::new(program);
        // The closure owns the File, so the fd stays open until the Command is
        // dropped; O_CLOEXEC (std's default) keeps it out of the exec'd program.
        unsafe {
            cmd.pre_exec(move || {
                // Only async-signal-safe work is allowed between fork and exec:
                // setns is a plain syscall.
                if libc::setns(ns_file.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(cmd)
    }

    /// Best effort: used from Drop, where there is nobody to return an error to.
    pub(crate) fn delete(&self) {
        // Already deleted (a test may `ip netns del` a node, as happens to
        // real nodes): nothing to clean up, and no error to report.
        if !self.path().exists() {
            return;
        }
        if let Err(e) = run_checked(None, &["ip", "netns", "delete", &self.name], None) {
            eprintln!("lab: could not delete netns {}: {e}", self.name);
        }
    }

    /// Pids of processes whose network namespace is this one.
    pub(crate) fn pids(&self) -> Vec<i32> {
        run_checked(None, &["ip", "netns", "pids", &self.name], None)
            .map(|out| {
                out.split_whitespace()
                    .filter_map(|p| p.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// A unique lab id: pid (so stale labs of dead processes can be found),
/// a per-process counter (parallel tests in one process), and a little
/// randomness (a recycled pid must not collide with a leftover name).
pub(crate) fn unique_lab_id() -> String {
    use std::hash::{BuildHasher, RandomState};
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    // RandomState is seeded from the OS per instance: enough entropy for a tag.
    let r = RandomState::new().hash_one(n) & 0xffff;
    format!("{NAME_PREFIX}{}-{n}-{r:04x}", std::process::id())
}

/// Removes namespaces left by labs whose process is gone (e.g. killed with
/// SIGKILL, where no Drop ran), killing whatever still runs inside them.
/// Namespaces of living processes are never touched, so this is safe while
/// other test processes run their own labs.
pub fn cleanup_stale() {
    let Ok(entries) = std::fs::read_dir(NETNS_DIR) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !of_a_dead_lab(&name) {
            continue;
        }
        let ns = Netns { name };
        for p in ns.pids() {
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
        ns.delete();
    }
    crate::cri::cleanup_stale();
}

/// A lab object's name (`ntlab-<pid>-…`) whose test process is gone.
pub(crate) fn of_a_dead_lab(name: &str) -> bool {
    name.strip_prefix(NAME_PREFIX)
        .and_then(|rest| rest.split('-').next())
        .and_then(|p| p.parse::<u32>().ok())
        .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
}

pub(crate) fn describe(args: &[&str]) -> String {
    args.iter()
        .map(|a| {
            if a.is_empty() || a.contains(|c: char| c.is_whitespace() || c == '"') {
                format!("'{a}'")
            } else {
                a.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn ns_label(ns: Option<&Netns>) -> String {
    ns.map_or_else(|| "root".to_string(), |n| n.name.clone())
}

/// Runs `args` (in `ns`, or as-is when `None`), feeding `stdin`, and waits at
/// most `timeout`. A non-zero exit is *not* an error here; see [`run_checked`].
pub(crate) fn run(
    ns: Option<&Netns>,
    args: &[&str],
    stdin: Option<&[u8]>,
    timeout: Duration,
) -> Result<Output> {
    let (program, rest) = args
        .split_first()
        .ok_or_else(|| LabError::Spec("empty command".into()))?;
    let mut cmd = match ns {
        Some(ns) => ns.command(program)?,
        None => Command::new(program),
    };
    cmd.args(rest)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Own process group: a timeout kills the command and anything it forked.
        .process_group(0);
    let mut child = cmd.spawn().map_err(|source| LabError::Spawn {
        command: describe(args),
        netns: ns_label(ns),
        source,
    })?;
    if let Some(input) = stdin {
        let mut pipe = child.stdin.take().expect("stdin was piped");
        // A command that exits early closes its stdin; its status says why.
        let _ = pipe.write_all(input);
    }
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let status = match wait_deadline(&mut child, timeout) {
        Some(status) => status,
        None => {
            kill_group(&mut child);
            return Err(LabError::Timeout {
                command: describe(args),
                netns: ns_label(ns),
                seconds: timeout.as_secs_f64(),
            });
        }
    };
    Ok(Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    })
}

/// Like [`run`] with the internal timeout, but a non-zero exit becomes a
/// [`LabError::Command`] carrying stderr; returns stdout.
pub(crate) fn run_checked(
    ns: Option<&Netns>,
    args: &[&str],
    stdin: Option<&[u8]>,
) -> Result<String> {
    let out = run(ns, args, stdin, INTERNAL_TIMEOUT)?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let mut msg = String::from_utf8_lossy(&out.stderr).trim().to_string();
    if msg.is_empty() {
        msg = String::from_utf8_lossy(&out.stdout).trim().to_string();
    }
    if let Some(input) = stdin {
        // For ip -batch / iptables-restore the input is the interesting part.
        msg = format!("{msg}\n--- input ---\n{}", String::from_utf8_lossy(input));
    }
    Err(LabError::Command {
        command: describe(args),
        netns: ns_label(ns),
        status: out.status.to_string(),
        stderr: msg,
    })
}

fn drain<R: Read + Send + 'static>(pipe: Option<R>) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_end(&mut buf);
        }
        buf
    })
}

/// std has no wait-with-timeout; polling is fine for commands that take
/// milliseconds to seconds.
fn wait_deadline(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    let mut nap = Duration::from_millis(1);
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() >= deadline => return None,
            Ok(None) => {
                thread::sleep(nap);
                nap = (nap * 2).min(Duration::from_millis(20));
            }
            Err(_) => return None,
        }
    }
}

/// Kills the child's whole process group (it was started as a group leader)
/// and reaps the child.
pub(crate) fn kill_group(child: &mut Child) {
    let pid = child.id() as i32;
    unsafe { libc::kill(-pid, libc::SIGKILL) };
    let _ = child.kill();
    let _ = child.wait();
}
