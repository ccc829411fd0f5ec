//! Servers inside pods: a tiny HTTP server naming the pod, and a DNS
//! responder for one A record (dnsmasq is not guaranteed to be installed).
//! Both are the `lab-server` binary of this crate (src/bin/lab-server.rs):
//! std only, so the same lab runs in a busybox guest without python.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use crate::error::{LabError, Result};
use crate::netns::{self, Netns};
use crate::spec::Server;

/// Overrides where `lab-server` is looked for (e.g. inside a guest initramfs).
pub const LAB_SERVER_ENV: &str = "NATTRACE_LAB_SERVER";

/// The binary starts in a millisecond; one that is not bound after this is broken.
const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// `$NATTRACE_LAB_SERVER`, else next to the running executable or in its
/// parent directory: integration tests run from target/debug/deps while
/// cargo puts the crate's binaries in target/debug.
pub fn lab_server_path() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os(LAB_SERVER_ENV) {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(LabError::LabServerMissing {
                searched: format!("{} (from {LAB_SERVER_ENV})", path.display()),
            })
        };
    }
    let exe = std::env::current_exe().map_err(|e| LabError::io("locating the test binary", e))?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    let candidates: Vec<PathBuf> = [Some(dir), dir.parent()]
        .into_iter()
        .flatten()
        .map(|d| d.join("lab-server"))
        .collect();
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or_else(|| LabError::LabServerMissing {
            searched: candidates
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
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

    pub(crate) fn args(&self, pod: &str) -> Vec<String> {
        match self {
            Server::Http { port } => {
                vec!["http".into(), port.to_string(), "--name".into(), pod.into()]
            }
            Server::Dns { port, name, answer } => {
                vec![
                    "dns".into(),
                    port.to_string(),
                    name.clone(),
                    answer.to_string(),
                ]
            }
        }
    }
}

/// Starts `server` in `ns` and returns once it printed "ready". The child is
/// its own process-group leader so the lab can kill it with everything it forks.
pub(crate) fn start(ns: &Netns, pod: &str, server: &Server) -> Result<Child> {
    let program = lab_server_path()?;
    let mut cmd = ns.command(&program.to_string_lossy())?;
    cmd.args(server.args(pod))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd.spawn().map_err(|source| LabError::Spawn {
        command: format!("{} {}", program.display(), server.args(pod).join(" ")),
        netns: ns.name().to_string(),
        source,
    })?;

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
