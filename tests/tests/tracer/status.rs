//! The live heartbeat (issue 28): a status line updated in place on a
//! terminal stderr (under a real pseudo-terminal, `script`), never in
//! stdout; plain periodic lines when stderr is not a terminal; `--quiet`
//! silences both.

use std::io::{BufRead as _, BufReader, Read as _};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Instant;

use lab::presets::{self, Backend};
use lab::tracer::{nattrace, tracing_lock};
use lab::wait::FAIL_AFTER;
use lab::{Lab, ProxyMode};

use super::{args, curls, ports, seed000, start};

fn curl_web(lab: &Lab, first_port: u16) {
    let p = ports(first_port, 1);
    assert_eq!(curls(lab, presets::WEB_SERVICE_IP, 80, &p), 1);
}

/// What a reader collected, waited on until `pred` holds of all of it.
fn wait_for(rx: &mpsc::Receiver<String>, got: &mut String, pred: impl Fn(&str) -> bool) -> bool {
    let deadline = Instant::now() + FAIL_AFTER;
    while !pred(got) {
        let Some(left) = deadline.checked_duration_since(Instant::now()) else {
            return false;
        };
        match rx.recv_timeout(left) {
            Ok(more) => got.push_str(&more),
            Err(_) => return pred(got),
        }
    }
    true
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// What nattrace wrote to the pseudo-terminal `script` gave it (stderr,
/// and stdout unless `stdout_to` redirects it), once a status line counted
/// the one curl's flow; then it is stopped with Ctrl-C's signal.
struct PtyRun {
    seen: String,
    counted: bool,
    status: Option<i32>,
}

fn under_pty(lab: &Lab, first_port: u16, stdout_to: Option<&std::path::Path>) -> PtyRun {
    let dir = std::env::temp_dir().join(format!(
        "nattrace-status-{}-{first_port}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let pidfile = dir.join("pid");
    let mut cmd = vec![nattrace().display().to_string()];
    cmd.extend(args(lab, &[presets::web_svc()], &[]));
    let redirect = stdout_to
        .map(|p| format!(" > {}", shell_quote(&p.display().to_string())))
        .unwrap_or_default();
    let inner = format!(
        "echo $$ > {}; exec {}{redirect}",
        shell_quote(&pidfile.display().to_string()),
        cmd.iter()
            .map(|a| shell_quote(a))
            .collect::<Vec<_>>()
            .join(" "),
    );
    // stderr (and stdout) on the pty `script` makes, whose output is what
    // we read.
    let mut script = Command::new("script")
        .args([
            "-qfec",
            &format!("sh -c {}", shell_quote(&inner)),
            "/dev/null",
        ])
        .env_remove("RUST_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running script (util-linux)");
    let mut pty = script.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = pty.read(&mut buf) {
            if n == 0
                || tx
                    .send(String::from_utf8_lossy(&buf[..n]).into_owned())
                    .is_err()
            {
                break;
            }
        }
    });
    let mut seen = String::new();
    let started = wait_for(&rx, &mut seen, |s| s.contains("waiting for connections to"));
    let kill = |sig| {
        if let Ok(pid) = std::fs::read_to_string(&pidfile) {
            let pid: i32 = pid.trim().parse().unwrap();
            unsafe { libc::kill(pid, sig) };
        }
    };
    if !started {
        kill(libc::SIGKILL);
        panic!("no start on the pty:\n{seen:?}");
    }
    curl_web(lab, first_port);
    let counted = wait_for(&rx, &mut seen, |s| {
        s.contains("nattrace: 1 flow (1 ok, 0 failed), ") && s.contains("— Ctrl-C to stop")
    });
    kill(libc::SIGINT);
    let status = script.wait().unwrap();
    drop(script.stdin.take());
    reader.join().unwrap();
    while let Ok(more) = rx.try_recv() {
        seen.push_str(&more);
    }
    let _ = std::fs::remove_dir_all(&dir);
    PtyRun {
        seen,
        counted,
        status: status.code(),
    }
}

#[test]
fn root_status_line_on_a_terminal_stays_out_of_stdout() {
    require_root!();
    let lab = seed000(true, Backend::SameNode, ProxyMode::Iptables);
    let _lock = tracing_lock();
    let out = std::env::temp_dir().join(format!("nattrace-status-{}.json", std::process::id()));
    let run = under_pty(&lab, 47000, Some(&out));
    let stdout = std::fs::read_to_string(&out).unwrap_or_default();
    let _ = std::fs::remove_file(&out);
    let seen = &run.seen;
    assert!(run.counted, "no status line on the pty:\n{seen:?}");
    assert_eq!(run.status, Some(0), "{seen:?}\n{stdout}");
    // stdout holds JSON lines only: the start, the flow, the summary.
    let kinds: Vec<String> = stdout
        .lines()
        .map(|l| {
            let v: serde_json::Value =
                serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}\n{stdout}"));
            v["kind"].as_str().unwrap_or_default().to_owned()
        })
        .collect();
    assert_eq!(kinds, ["start", "flow", "summary"], "{stdout}");
    assert!(
        !stdout.contains("Ctrl-C") && !stdout.contains('\x1b'),
        "{stdout}"
    );
}

/// stdout on the status line's terminal: the line is cleared before each
/// output line, which therefore starts on a line of its own, whole.
#[test]
fn root_status_line_steps_around_output_on_the_same_terminal() {
    require_root!();
    let lab = seed000(true, Backend::SameNode, ProxyMode::Iptables);
    let _lock = tracing_lock();
    let run = under_pty(&lab, 47050, None);
    let seen = &run.seen;
    assert!(run.counted, "no status line on the pty:\n{seen:?}");
    assert_eq!(run.status, Some(0), "{seen:?}");
    let mut kinds = Vec::new();
    // JSON lines start with `{"` (the start line's keys are sorted).
    for line in seen.split('\n').filter(|l| l.contains("{\"")) {
        let at = line.find("{\"").unwrap();
        // What the terminal shows before the JSON: what follows the last
        // clearing of the line (`\r` ESC[2K: the status line suspended).
        let shown = line[..at].rsplit("\x1b[2K").next().unwrap_or_default();
        let before = shown.replace('\r', "");
        assert!(
            before.is_empty(),
            "{before:?} before a line: {line:?}\n{seen:?}"
        );
        let json = line[at..].trim_end_matches('\r');
        let v: serde_json::Value =
            serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {json:?}\n{seen:?}"));
        kinds.push(v["kind"].as_str().unwrap_or_default().to_owned());
    }
    assert_eq!(kinds, ["start", "flow", "summary"], "{seen:?}");
}

/// stderr not a terminal: a plain line every NATTRACE_STATUS_EVERY_MS.
#[test]
fn root_status_plain_lines_when_stderr_is_not_a_terminal() {
    require_root!();
    let lab = seed000(true, Backend::SameNode, ProxyMode::Iptables);
    let _lock = tracing_lock();
    let mut child = Command::new(nattrace())
        .args(args(&lab, &[presets::web_svc()], &[]))
        .env("NATTRACE_STATUS_EVERY_MS", "300")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting nattrace");
    let stderr = child.stderr.take().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let out_reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if tx.send(format!("{line}\n")).is_err() {
                break;
            }
        }
    });
    let mut said = String::new();
    let waiting = format!(
        "nattrace: waiting for connections to {} (Ctrl-C to stop)\n",
        presets::web_svc()
    );
    let started = wait_for(&rx, &mut said, |s| s.contains(&waiting));
    if started {
        curl_web(&lab, 47100);
    }
    let counted = started
        && wait_for(&rx, &mut said, |s| {
            s.lines().any(|l| {
                l.starts_with("nattrace: 1 flow (1 ok, 0 failed), ")
                    && l.contains(" events, 0 lost, ")
                    && l.ends_with('s')
            })
        });
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    let stdout = out_reader.join().unwrap();
    assert!(started && counted, "{status}\n{said}\n{stdout}");
    assert!(
        !stdout.contains("flow (") && !stdout.contains("waiting"),
        "{stdout}"
    );
}

/// `--quiet`: neither the waiting line nor progress lines, though one was
/// due at the tick that printed the flow (the interval is 1 ms).
#[test]
fn root_status_quiet_silences_the_heartbeat() {
    require_root!();
    let lab = seed000(true, Backend::SameNode, ProxyMode::Iptables);
    let _lock = tracing_lock();
    let mut t = start(
        &args(&lab, &[presets::web_svc()], &["--quiet"]),
        &[("NATTRACE_STATUS_EVERY_MS", "1")],
    );
    curl_web(&lab, 47200);
    let done = t.finish_after_flows(1).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(done.status.code(), Some(0), "{}", done.describe());
    assert!(
        !done.stderr.contains("waiting for") && !done.stderr.contains(" events, "),
        "{}",
        done.describe()
    );
    // Without --quiet the same run says both (the control).
    let mut t = start(
        &args(&lab, &[presets::web_svc()], &[]),
        &[("NATTRACE_STATUS_EVERY_MS", "1")],
    );
    curl_web(&lab, 47300);
    let done = t.finish_after_flows(1).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(
        done.stderr.contains("waiting for") && done.stderr.contains(" events, "),
        "{}",
        done.describe()
    );
}
