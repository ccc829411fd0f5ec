//! Running the `nattrace` binary against a lab: locate it, start it with
//! piped output (optionally echoed live, for the demo), wait until it has
//! attached, stop it, and read its JSON lines. Also the checks that it left
//! no BPF object behind.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use serde_json::Value;

use crate::Lab;

/// Overrides where the `nattrace` binary is looked for.
pub const NATTRACE_BIN_ENV: &str = "NATTRACE_BIN";

/// `$NATTRACE_BIN`, else `nattrace` next to the running executable or in its
/// parent directory (integration tests run from target/debug/deps).
pub fn nattrace_path() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os(NATTRACE_BIN_ENV) {
        let path = PathBuf::from(path);
        if !path.is_file() {
            bail!("{NATTRACE_BIN_ENV}={} is not a file", path.display());
        }
        return Ok(path);
    }
    let exe = std::env::current_exe().context("locating the running executable")?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    let candidates: Vec<PathBuf> = [Some(dir), dir.parent()]
        .into_iter()
        .flatten()
        .map(|d| d.join("nattrace"))
        .collect();
    candidates.iter().find(|p| p.is_file()).cloned().with_context(|| {
        format!(
            "nattrace not found at {}; build it with `cargo build --bin nattrace` or set {NATTRACE_BIN_ENV}",
            candidates
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(" or ")
        )
    })
}

/// [`nattrace_path`] for tests, where a missing binary is a failure.
pub fn nattrace() -> PathBuf {
    nattrace_path().unwrap_or_else(|e| panic!("{e:#}"))
}

/// What of a spawned nattrace's output is copied live to ours.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Echo {
    None,
    /// Its stderr: progress on a console whose silence counts as a hang
    /// (vm-guest), without its stdout's JSON.
    Stderr,
    Both,
}

static TRACING: Mutex<()> = Mutex::new(());

/// Held by a test for the whole of its trace, so that traces in one test
/// binary take turns: nattrace's raw tracepoints see every namespace and
/// labs reuse the seeds' addresses. A test that panicked holding it must not
/// fail all the others.
pub fn tracing_lock() -> MutexGuard<'static, ()> {
    TRACING.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where `cargo xtask fixtures` asks traces to be recorded.
pub const RECORD_DIR_ENV: &str = "NATTRACE_RECORD_DIR";

/// `--write DIR/NAME.rec` when [`RECORD_DIR_ENV`] is set (nothing otherwise):
/// how the collector's recorded fixtures are made. `name` defaults to the
/// running test's name (its thread's), without module path.
pub fn record_args(name: Option<&str>) -> Vec<String> {
    let Ok(dir) = std::env::var(RECORD_DIR_ENV) else {
        return Vec::new();
    };
    let thread = std::thread::current();
    let name = name
        .or_else(|| thread.name().map(|n| n.rsplit("::").next().unwrap_or(n)))
        .unwrap_or("trace");
    vec!["--write".to_string(), format!("{dir}/{name}.rec")]
}

/// A running nattrace. Killed (SIGKILL) if dropped before [`Nattrace::wait`].
pub struct Nattrace {
    child: Option<Child>,
    lines: Receiver<String>,
    stdout: Vec<String>,
    stdout_thread: Option<JoinHandle<()>>,
    stderr_thread: Option<JoinHandle<String>>,
}

/// What a finished nattrace printed.
#[derive(Debug)]
pub struct Finished {
    /// Its exit status.
    pub status: ExitStatus,
    /// Every stdout line, in order.
    pub stdout: Vec<String>,
    /// All of stderr.
    pub stderr: String,
}

impl Nattrace {
    /// Starts `bin args` in the caller's namespace (it enters `--netns` itself).
    /// With `echo`, its stdout and stderr are also copied live to ours.
    pub fn spawn(
        bin: &Path,
        args: &[String],
        envs: &[(&str, &str)],
        echo: bool,
    ) -> anyhow::Result<Nattrace> {
        let echo = if echo { Echo::Both } else { Echo::None };
        Self::spawn_echoing(bin, args, envs, echo)
    }

    /// [`Nattrace::spawn`] copying only what `echo` says to ours.
    pub fn spawn_echoing(
        bin: &Path,
        args: &[String],
        envs: &[(&str, &str)],
        echo: Echo,
    ) -> anyhow::Result<Nattrace> {
        let mut child = Command::new(bin)
            .args(args)
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let stdout = child.stdout.take().expect("stdout was piped");
        let mut stderr = child.stderr.take().expect("stderr was piped");
        let (tx, lines) = mpsc::channel();
        let stdout_thread = thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if echo == Echo::Both {
                    println!("{line}");
                }
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr_thread = thread::spawn(move || {
            if echo == Echo::None {
                let mut text = String::new();
                let _ = stderr.read_to_string(&mut text);
                return text;
            }
            let mut text = String::new();
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("{line}");
                text.push_str(&line);
                text.push('\n');
            }
            text
        });
        Ok(Nattrace {
            child: Some(child),
            lines,
            stdout: Vec::new(),
            stdout_thread: Some(stdout_thread),
            stderr_thread: Some(stderr_thread),
        })
    }

    /// The process id (for signals and /proc).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Waits for the first stdout line, which nattrace prints once its
    /// programs are attached; an exit before that is an error with its output.
    pub fn wait_started(&mut self, timeout: Duration) -> anyhow::Result<String> {
        match self.lines.recv_timeout(timeout) {
            Ok(line) => {
                self.stdout.push(line.clone());
                Ok(line)
            }
            Err(RecvTimeoutError::Timeout) => {
                // Its stderr is the only clue (a verifier log, a step that
                // hangs), so it is stopped and what it said goes with the error.
                self.signal(libc::SIGKILL);
                let said = self
                    .wait(Duration::from_secs(5))
                    .map(|done| tail(&done.stderr, 40))
                    .unwrap_or_default();
                bail!(
                    "nattrace printed nothing within {timeout:?} (still attaching?); stderr: {said}"
                )
            }
            Err(RecvTimeoutError::Disconnected) => {
                let done = self.wait(Duration::from_secs(5))?;
                bail!(
                    "nattrace exited before attaching ({}); stderr: {}",
                    done.status,
                    done.stderr.trim()
                )
            }
        }
    }

    /// Waits until a stdout line satisfies `pred` (lines before it are
    /// kept for [`Finished::stdout`]); None on timeout or exit.
    pub fn wait_line(&mut self, timeout: Duration, pred: impl Fn(&str) -> bool) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            let line = self.lines.recv_timeout(left).ok()?;
            self.stdout.push(line.clone());
            if pred(&line) {
                return Some(line);
            }
        }
    }

    /// Waits until `n` lines satisfying `pred` were printed in all (counting
    /// those already read): the event a test stops on once its traffic is
    /// done, instead of a `--duration` or a sleep the verdicts may outlast
    /// on a loaded machine. An error on exit or after `fail_after` (a
    /// broken run; a working one returns as soon as the line is out).
    pub fn wait_lines(
        &mut self,
        n: usize,
        fail_after: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + fail_after;
        let mut seen = self.stdout.iter().filter(|l| pred(l)).count();
        while seen < n {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    seen += usize::from(pred(&line));
                    self.stdout.push(line);
                }
                Err(RecvTimeoutError::Timeout) => {
                    bail!("{seen} of {n} expected lines after {fail_after:?}")
                }
                Err(RecvTimeoutError::Disconnected) => {
                    bail!("nattrace exited after {seen} of {n} expected lines")
                }
            }
        }
        Ok(())
    }

    /// [`Nattrace::wait_lines`] for `n` decided flows (`--output json`).
    pub fn wait_flows(&mut self, n: usize, fail_after: Duration) -> anyhow::Result<()> {
        self.wait_lines(n, fail_after, is_flow_line)
    }

    /// Stops nattrace (SIGTERM) once it printed `n` decided flows, and
    /// returns what it printed: how a test ends a trace after its traffic
    /// instead of by a `--duration` that a loaded machine's traffic can
    /// outlast. Fewer flows (a broken run) are said on stderr, and the
    /// caller's assertions on the output fail with all of it.
    pub fn finish_after_flows(&mut self, n: usize) -> anyhow::Result<Finished> {
        let waited = self.wait_flows(n, crate::wait::FAIL_AFTER);
        self.terminate();
        let done = self.wait(crate::wait::FAIL_AFTER)?;
        if let Err(e) = waited {
            eprintln!("waiting for {n} flows: {e:#}");
        }
        Ok(done)
    }

    /// Finishes a trace after its traffic: SIGUSR1, on which nattrace stops
    /// once every flow it saw before has its verdict (README), and what it
    /// printed. The event a test waits for instead of a `--duration` that
    /// the traffic and its verdicts can outlast on a loaded machine.
    pub fn finish(&mut self) -> anyhow::Result<Finished> {
        self.signal(libc::SIGUSR1);
        self.wait(crate::wait::FAIL_AFTER)
    }

    /// [`Nattrace::finish`] for a nattrace started under a wrapper that does
    /// not pass signals on (`unshare -f`, a container's init): SIGUSR1 goes
    /// to the wrapper's descendant named `comm`, waited for until it exists.
    pub fn finish_descendant(&mut self, comm: &str) -> anyhow::Result<Finished> {
        let root = self.pid();
        let pid = crate::wait::until(
            format!("the {comm} process under pid {root}"),
            crate::wait::FAIL_AFTER,
            || descendant_named(root, comm),
        )?;
        unsafe { libc::kill(pid as i32, libc::SIGUSR1) };
        self.wait(crate::wait::FAIL_AFTER)
    }

    /// The stdout lines read so far (by the waits above).
    pub fn printed(&self) -> &[String] {
        &self.stdout
    }

    /// Sends a signal (SIGINT, SIGKILL, ...).
    pub fn signal(&self, sig: i32) {
        if let Some(child) = &self.child {
            unsafe { libc::kill(child.id() as i32, sig) };
        }
    }

    /// Sends SIGTERM (what `kubectl delete`/systemd/Ctrl-C-like stops do).
    pub fn terminate(&self) {
        if let Some(child) = &self.child {
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        }
    }

    /// Waits for exit (killing it after `timeout`) and returns what it printed.
    pub fn wait(&mut self, timeout: Duration) -> anyhow::Result<Finished> {
        let mut child = self
            .child
            .take()
            .context("nattrace was already waited for")?;
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("nattrace did not exit within {timeout:?} and was killed");
            }
            thread::sleep(Duration::from_millis(20));
        };
        if let Some(t) = self.stdout_thread.take() {
            let _ = t.join();
        }
        self.stdout.extend(self.lines.try_iter());
        let stderr = self
            .stderr_thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default();
        Ok(Finished {
            status,
            stdout: std::mem::take(&mut self.stdout),
            stderr,
        })
    }
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.trim_end().lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Whether a JSON output line is a decided flow.
pub fn is_flow_line(line: &str) -> bool {
    line.contains("\"kind\":\"flow\"")
}

impl Drop for Nattrace {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Finished {
    /// Every stdout line parsed as JSON (for `--output json`); a line that
    /// is not JSON is an error naming it.
    pub fn json(&self) -> anyhow::Result<Vec<Value>> {
        self.stdout
            .iter()
            .map(|l| serde_json::from_str(l).with_context(|| format!("not a JSON line: {l:?}")))
            .collect()
    }

    /// The `"kind":"flow"` objects.
    pub fn flows(&self) -> anyhow::Result<Vec<Value>> {
        Ok(self
            .json()?
            .into_iter()
            .filter(|v| v["kind"] == "flow")
            .collect())
    }

    /// The one flow of the trace; panics with everything nattrace printed
    /// when there is not exactly one.
    pub fn only_flow(&self) -> Value {
        let flows = self
            .flows()
            .unwrap_or_else(|e| panic!("{e:#}\n{}", self.describe()));
        assert_eq!(flows.len(), 1, "one flow expected:\n{}", self.describe());
        flows.into_iter().next().expect("one flow")
    }

    /// The last line, which must be the `"kind":"summary"` object.
    pub fn summary(&self) -> anyhow::Result<Value> {
        let last = self.json()?.pop().context("no output at all")?;
        if last["kind"] != "summary" {
            bail!("the last line is not the summary: {last}");
        }
        Ok(last)
    }

    /// Everything it printed, for assertion messages.
    pub fn describe(&self) -> String {
        format!(
            "exit {}\n--- stdout\n{}\n--- stderr\n{}",
            self.status,
            self.stdout.join("\n"),
            self.stderr.trim_end()
        )
    }
}

/// `curl` from `target` to `http://ip:port/`, one per source port in
/// `local_ports`, all at once (seed 000's failures each cost `max_time`).
/// Fixed source ports let a test match nattrace's flows to its connections.
pub fn curl_parallel(
    lab: &Lab,
    target: &str,
    ip: Ipv4Addr,
    port: u16,
    local_ports: &[u16],
    max_time: Duration,
) -> Vec<crate::Result<Output>> {
    let url = format!("http://{ip}:{port}/");
    let secs = format!("{:.1}", max_time.as_secs_f64());
    thread::scope(|s| {
        let handles: Vec<_> = local_ports
            .iter()
            .map(|p| {
                let (url, secs, p) = (&url, &secs, p.to_string());
                s.spawn(move || {
                    lab.exec_timeout(
                        target,
                        &["curl", "-sS", "--max-time", secs, "--local-port", &p, url],
                        max_time + Duration::from_secs(10),
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("curl thread panicked"))
            .collect()
    })
}

/// A kind of BPF object, by its id namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum BpfKind {
    /// `prog_id` in fdinfo.
    Prog,
    /// `map_id`.
    Map,
    /// `link_id` (tcx, netfilter, raw tracepoint attachments).
    Link,
}

/// The BPF objects a process holds open, read from `/proc/<pid>/fdinfo`
/// (no bpftool needed): what it loaded and attached.
pub fn bpf_objects(pid: u32) -> Vec<(BpfKind, u32)> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
        return found;
    };
    for entry in entries.flatten() {
        let Ok(info) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        // A link's fdinfo also names its prog_id; the link is what it is.
        let kind_key = [
            ("link_id:", BpfKind::Link),
            ("map_id:", BpfKind::Map),
            ("prog_id:", BpfKind::Prog),
        ]
        .into_iter()
        .find(|(key, _)| info.lines().any(|l| l.starts_with(key)));
        if let Some((key, kind)) = kind_key {
            let id = info
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().parse().ok());
            if let Some(id) = id {
                found.push((kind, id));
            }
        }
    }
    found.sort_unstable();
    found.dedup();
    found
}

/// The raw tracepoints a process has attached (its links' `tp_name` in
/// `/proc/<pid>/fdinfo`, kernel/bpf/syscall.c
/// `bpf_raw_tp_link_show_fdinfo`).
pub fn raw_tracepoints(pid: u32) -> Vec<String> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
        return found;
    };
    for entry in entries.flatten() {
        if let Ok(info) = std::fs::read_to_string(entry.path()) {
            found.extend(
                info.lines()
                    .filter_map(|l| l.strip_prefix("tp_name:"))
                    .map(|n| n.trim().to_owned()),
            );
        }
    }
    found.sort();
    found
}

/// Whether a BPF object with this id still exists anywhere in the kernel
/// (`BPF_*_GET_FD_BY_ID`; needs CAP_SYS_ADMIN).
pub fn bpf_object_exists(kind: BpfKind, id: u32) -> bool {
    const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
    const BPF_MAP_GET_FD_BY_ID: libc::c_long = 14;
    const BPF_LINK_GET_FD_BY_ID: libc::c_long = 30;
    let cmd = match kind {
        BpfKind::Prog => BPF_PROG_GET_FD_BY_ID,
        BpfKind::Map => BPF_MAP_GET_FD_BY_ID,
        BpfKind::Link => BPF_LINK_GET_FD_BY_ID,
    };
    // The union member for these commands: { id, next_id, open_flags }.
    let attr: [u32; 3] = [id, 0, 0];
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.as_ptr(),
            std::mem::size_of_val(&attr) as libc::c_uint,
        )
    };
    if fd >= 0 {
        unsafe { libc::close(fd as i32) };
        return true;
    }
    std::io::Error::last_os_error().raw_os_error() != Some(libc::ENOENT)
}

/// Prints a line and flushes, so headings interleave correctly with the
/// streamed nattrace output.
pub fn say(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{text}");
    let _ = out.flush();
}

/// The address of an `"ip:port"` JSON string (a flow's client, backend, ...).
pub fn ip_of(endpoint: &Value) -> std::net::Ipv4Addr {
    endpoint
        .as_str()
        .and_then(|s| s.rsplit_once(':'))
        .and_then(|(ip, _)| ip.parse().ok())
        .unwrap_or_else(|| panic!("not an ip:port: {endpoint}"))
}

/// `nattrace doctor --output json` on `node` of `lab`: its exit status and
/// its report.
pub fn doctor(lab: &crate::Lab, node: &str) -> (Option<i32>, Value) {
    let ns = lab.node_netns(node).expect("a node of the lab").path();
    let out = std::process::Command::new(nattrace())
        .args([
            "doctor",
            "--netns",
            &ns.display().to_string(),
            "--output",
            "json",
        ])
        .output()
        .expect("running nattrace doctor");
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(text.trim())
        .unwrap_or_else(|e| panic!("{e}: {text} {}", String::from_utf8_lossy(&out.stderr)));
    (out.status.code(), v)
}

/// One point a packet of a flow passed, from nattrace's JSON.
#[derive(Clone, Debug)]
pub struct Hop {
    /// The packet's kind: `SYN`, `SYN-ACK`, `DNS query`, ...
    pub kind: String,
    /// "hook nf_hook nat_stage ifname", the parts that exist.
    pub place: String,
    /// Whether the point is in the traced node's namespace.
    pub node_ns: bool,
    pub src: String,
    pub dst: String,
}

/// Every hop of every packet of a flow, in order.
pub fn hops(flow: &Value) -> Vec<Hop> {
    let mut out = Vec::new();
    for p in flow["packets"].as_array().expect("packets") {
        for h in p["hops"].as_array().expect("hops") {
            let place = [&h["hook"], &h["nf_hook"], &h["nat_stage"], &h["ifname"]]
                .iter()
                .filter_map(|v| v.as_str())
                .collect::<Vec<_>>()
                .join(" ");
            let text = |v: &Value| v.as_str().unwrap_or("").to_string();
            out.push(Hop {
                kind: text(&p["kind"]),
                place,
                node_ns: h["node_ns"].as_bool().unwrap_or(false),
                src: text(&h["src"]),
                dst: text(&h["dst"]),
            });
        }
    }
    out
}

/// Whether a `kind` packet passed a point starting with `place` with
/// addresses (src, dst) that `test` accepts.
pub fn has_hop(flow: &Value, kind: &str, place: &str, test: impl Fn(&str, &str) -> bool) -> bool {
    hops(flow)
        .iter()
        .any(|h| h.kind == kind && h.place.starts_with(place) && test(&h.src, &h.dst))
}

/// The flow's verdict and cause (`None`: no cause) are these.
pub fn assert_verdict_and_cause(f: &Value, verdict: &str, cause: Option<&str>, done: &Finished) {
    assert_eq!(f["verdict"], verdict, "{}", done.describe());
    match cause {
        Some(c) => assert_eq!(f["cause"], c, "{}", done.describe()),
        None => assert!(f["cause"].is_null(), "{}", done.describe()),
    }
}

/// The first process below `pid` (children, grandchildren, ...) whose
/// command name is `comm`, from /proc's child lists.
fn descendant_named(pid: u32, comm: &str) -> Option<u32> {
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        let kids = std::fs::read_to_string(format!("/proc/{p}/task/{p}/children")).ok()?;
        for kid in kids
            .split_whitespace()
            .filter_map(|k| k.parse::<u32>().ok())
        {
            let name = std::fs::read_to_string(format!("/proc/{kid}/comm")).unwrap_or_default();
            if name.trim_end() == comm {
                return Some(kid);
            }
            todo.push(kid);
        }
    }
    None
}
