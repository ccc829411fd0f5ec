//! Waiting for events, never for time. On a loaded machine (2 cores shared
//! by several builds, or a TCG guest) any fixed sleep is a race: the server
//! may not listen yet, the tracer may not have decided yet. Every root test
//! waits here for the thing itself — a socket in LISTEN, a counter moving, a
//! line printed — and the deadline of each wait is only how long a *broken*
//! run takes to fail, never how long a working one waits.

use std::fmt::Display;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::bail;

use crate::Lab;

/// What a broken wait costs before it fails (nothing passes faster or
/// slower because of it: every wait returns as soon as its event happened).
pub const FAIL_AFTER: Duration = Duration::from_secs(60);

/// Calls `probe` until it returns `Some`, first at once, then with a nap
/// growing from 1 ms to 50 ms; after `fail_after` an error naming `what`.
pub fn until<T>(
    what: impl Display,
    fail_after: Duration,
    mut probe: impl FnMut() -> Option<T>,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + fail_after;
    let mut nap = Duration::from_millis(1);
    loop {
        if let Some(v) = probe() {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            bail!("{what}: not after {fail_after:?}");
        }
        thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(50));
    }
}

/// [`until`] for a condition.
pub fn until_true(
    what: impl Display,
    fail_after: Duration,
    mut cond: impl FnMut() -> bool,
) -> anyhow::Result<()> {
    until(what, fail_after, || cond().then_some(()))
}

/// Whether process `pid` itself holds a TCP socket in LISTEN on `port`
/// (IPv4 or IPv6). The socket is matched by inode against the process's
/// own descriptors, so a listener on the same port in another namespace
/// (another engineer's lab, or ours before `ip netns exec` entered the
/// namespace) does not count.
pub fn process_listens(pid: u32, port: u16) -> bool {
    let inodes = listening_inodes(pid, port);
    if inodes.is_empty() {
        return false;
    }
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path()).is_ok_and(|l| {
            l.to_str()
                .and_then(|l| l.strip_prefix("socket:["))
                .and_then(|l| l.strip_suffix(']'))
                .is_some_and(|i| inodes.iter().any(|x| x == i))
        })
    })
}

/// Inodes of the LISTEN (state 0A) TCP sockets on `port` in `pid`'s
/// network namespace, from `/proc/PID/net/tcp{,6}` (local address is
/// `ADDR:PORT` in hex; the inode is the 10th column).
fn listening_inodes(pid: u32, port: u16) -> Vec<String> {
    let want = format!(":{port:04X}");
    ["tcp", "tcp6"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(format!("/proc/{pid}/net/{f}")).ok())
        .flat_map(|text| {
            text.lines()
                .skip(1)
                .filter_map(|l| {
                    let cols: Vec<&str> = l.split_whitespace().collect();
                    (cols.len() > 9 && cols[1].ends_with(&want) && cols[3] == "0A")
                        .then(|| cols[9].to_string())
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Waits until process `pid` listens on TCP `port` ([`process_listens`]);
/// a process that exits first fails at once.
pub fn listening(pid: u32, port: u16) -> anyhow::Result<()> {
    let alive = || std::path::Path::new(&format!("/proc/{pid}")).exists();
    let listens = until(
        format_args!("process {pid} listening on TCP port {port}"),
        FAIL_AFTER,
        || match (alive(), process_listens(pid, port)) {
            (_, true) => Some(true),
            (false, false) => Some(false),
            (true, false) => None,
        },
    )?;
    if !listens {
        bail!("process {pid} exited before it listened on TCP port {port}");
    }
    Ok(())
}

/// Waits until something in lab target `pod` listens on TCP `port`, by `ss`
/// inside its namespace (for servers started with [`Lab::spawn`], which
/// print nothing we could read).
pub fn lab_listening(lab: &Lab, pod: &str, port: u16) -> anyhow::Result<()> {
    let filter = format!("sport = :{port}");
    until_true(
        format_args!("a TCP listener on {pod}:{port}"),
        FAIL_AFTER,
        || {
            lab.exec(pod, &["ss", "-Hltn", &filter])
                .is_ok_and(|out| !String::from_utf8_lossy(&out.stdout).trim().is_empty())
        },
    )
}

/// One counter of `/proc/net/snmp6` (e.g. `Icmp6InRouterAdvertisements`)
/// in lab target `target`'s namespace.
pub fn snmp6(lab: &Lab, target: &str, counter: &str) -> anyhow::Result<u64> {
    let text = lab.run(target, &["cat", "/proc/net/snmp6"])?;
    text.lines()
        .find_map(|l| {
            let (name, value) = l.split_once(char::is_whitespace)?;
            (name == counter).then(|| value.trim().parse().ok())?
        })
        .ok_or_else(|| anyhow::anyhow!("no {counter} in {target}'s /proc/net/snmp6"))
}

/// A child's output as lines on a channel, read by a thread of its own, so
/// a test waits for the line it expects (`recv_timeout`) and never blocks
/// on a child that hangs.
pub fn lines(out: impl std::io::Read + Send + 'static) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead as _;
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}
