//! Servers inside pods: a tiny HTTP server naming the pod, and a DNS
//! responder for one A record (dnsmasq is not guaranteed to be installed).
//! Both are one python script fed to `python3 -` on stdin: nothing is written
//! to disk, and `ps` shows `python3 - http 80 <pod> <ip>` rather than the script.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use crate::error::{LabError, Result};
use crate::netns::{self, Netns};
use crate::spec::Server;

const SCRIPT: &str = include_str!("servers.py");

/// Python starts in ~30 ms; a server that is not bound after this is broken.
const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// pyenv-style `python3` shims are shell scripts that cost ~100 ms per start
/// and may depend on the working directory; resolve the real interpreter once.
fn python() -> &'static str {
    static PYTHON: OnceLock<String> = OnceLock::new();
    PYTHON.get_or_init(|| {
        std::process::Command::new("python3")
            .args(["-c", "import sys; print(sys.executable)"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| "python3".to_string())
    })
}

impl Server {
    /// Short description for messages, e.g. `http :80`.
    pub fn describe(&self) -> String {
        match self {
            Server::Http { port } => format!("http :{port}"),
            Server::Dns { port, name, .. } => format!("dns :{port}/udp ({name})"),
        }
    }

    fn args(&self, pod: &str, pod_ip: &str) -> Vec<String> {
        let mut args = vec![python().to_string(), "-".into()];
        match self {
            Server::Http { port } => {
                args.extend(["http".into(), port.to_string(), pod.into(), pod_ip.into()])
            }
            Server::Dns { port, name, answer } => args.extend([
                "dns".into(),
                port.to_string(),
                name.clone(),
                answer.to_string(),
            ]),
        }
        args
    }
}

/// Starts `server` in `ns` and returns once it printed "ready". The child is
/// its own process-group leader so the lab can kill it with everything it forks.
pub(crate) fn start(ns: &Netns, pod: &str, pod_ip: &str, server: &Server) -> Result<Child> {
    let args = server.args(pod, pod_ip);
    let mut cmd = ns.command(&args[0])?;
    cmd.args(&args[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd.spawn().map_err(|source| LabError::Spawn {
        command: format!("python3 servers.py {}", server.describe()),
        netns: ns.name().to_string(),
        source,
    })?;

    // Dropping the pipe after writing gives python EOF, so it runs the script.
    let script_written = child
        .stdin
        .take()
        .expect("stdin was piped")
        .write_all(SCRIPT.as_bytes());
    if let Err(e) = script_written {
        netns::kill_group(&mut child);
        return Err(LabError::ServerNotReady {
            server: server.describe(),
            pod: pod.to_string(),
            detail: format!("could not pass the script to python: {e}"),
        });
    }
    let stdout = child.stdout.take().expect("stdout was piped");
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        let ready = reader.read_line(&mut line).is_ok() && line.trim() == "ready";
        let _ = tx.send(ready);
        // Keep draining so the server never blocks on a full pipe.
        let _ = std::io::copy(&mut reader, &mut std::io::sink());
    });
    let mut stderr = child.stderr.take().expect("stderr was piped");

    match rx.recv_timeout(READY_TIMEOUT) {
        Ok(true) => {
            let pod = pod.to_string();
            thread::spawn(move || {
                let mut text = String::new();
                let _ = stderr.read_to_string(&mut text);
                if !text.trim().is_empty() {
                    log::warn!("server in pod {pod}: {}", text.trim());
                }
            });
            Ok(child)
        }
        outcome => {
            netns::kill_group(&mut child);
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            let detail = match outcome {
                Err(_) => format!(
                    "no \"ready\" within {READY_TIMEOUT:?}; stderr: {}",
                    text.trim()
                ),
                _ => format!("exited; stderr: {}", text.trim()),
            };
            Err(LabError::ServerNotReady {
                server: server.describe(),
                pod: pod.to_string(),
                detail,
            })
        }
    }
}
