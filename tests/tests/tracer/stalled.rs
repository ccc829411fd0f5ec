//! Signals win over output: with stdout, `--write` and `--pcap` all going to
//! FIFOs nobody reads, Ctrl-C still detaches everything and exits at once,
//! and the output that could not be written is counted, not silently lost.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use lab::presets;
use lab::tracer::{bpf_objects, nattrace};

use super::cleanup::{assert_objects_gone, node_state};
use super::{ATTACH_TIMEOUT, args, build_lab, tracing_lock, web_svc};

/// A FIFO with a read end that is open (so opening it for writing does not
/// block, and writing does not fail with EPIPE) but never read.
struct StalledFifo {
    path: PathBuf,
    reader: File,
}

impl StalledFifo {
    fn new(dir: &Path, name: &str) -> StalledFifo {
        let path = dir.join(name);
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600))
            .expect("mkfifo");
        let reader = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)
            .expect("opening the FIFO's read end");
        StalledFifo { path, reader }
    }

    /// Bytes written and not read (FIONREAD): looked at, never read.
    fn pending(&self) -> usize {
        let mut n: libc::c_int = 0;
        let rc = unsafe { libc::ioctl(self.reader.as_raw_fd(), libc::FIONREAD, &mut n) };
        assert_eq!(rc, 0, "FIONREAD");
        n as usize
    }
}

#[test]
fn root_ctrl_c_exits_at_once_while_nobody_reads_the_output() {
    require_root!();
    let lab = build_lab(presets::seed000(presets::Seed000 {
        bridge_nf_call_iptables: true,
        ..Default::default()
    }));
    let before = node_state(&lab);
    let _lock = tracing_lock();
    for (signal, name) in [(libc::SIGINT, "SIGINT"), (libc::SIGTERM, "SIGTERM")] {
        stop_while_stalled(&lab, &before, signal, name);
    }
}

fn stop_while_stalled(lab: &lab::Lab, before: &str, signal: i32, name: &str) {
    let dir = std::env::temp_dir().join(format!("nattrace-stalled-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let stdout = StalledFifo::new(&dir, "stdout");
    let write = StalledFifo::new(&dir, "write");
    let pcap = StalledFifo::new(&dir, "pcap");

    let cmd_args = args(
        lab,
        &[web_svc()],
        &[
            "-v",
            "--write",
            write.path.to_str().unwrap(),
            "--pcap",
            pcap.path.to_str().unwrap(),
        ],
    );
    let stdout_end = OpenOptions::new()
        .write(true)
        .open(&stdout.path)
        .expect("opening the stdout FIFO");
    let mut child = Command::new(nattrace())
        .args(&cmd_args)
        // Small queues: the run must overflow them and say so.
        .env("NATTRACE_TEST_QUEUE_BYTES", "16384")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::from(stdout_end))
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting nattrace");
    let mut stderr = child.stderr.take().expect("piped");
    let stderr_thread = thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    // The first stdout line is written once everything is attached.
    lab::wait::until_true("nattrace's start line", ATTACH_TIMEOUT, || {
        assert!(
            child.try_wait().expect("try_wait").is_none(),
            "nattrace exited early"
        );
        stdout.pending() > 0
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
    let objects = bpf_objects(child.id());
    // Until every FIFO is full and lines are being dropped.
    for _ in 0..60 {
        let _ = lab.http_get(
            presets::CLIENT_POD,
            presets::WEB_SERVICE_IP,
            presets::WEB_PORT,
            Duration::from_secs(1),
        );
    }
    // Well past what a write(2) that blocks leaves in a 64 KiB pipe: the
    // writers caught up with the traffic and are stuck.
    let full = 32 * 1024;
    lab::wait::until_true("every FIFO full", lab::wait::FAIL_AFTER, || {
        stdout.pending() >= full && write.pending() >= full && pcap.pending() >= full
    })
    .unwrap_or_else(|e| {
        panic!(
            "{e:#}: stdout {}, write {}, pcap {}",
            stdout.pending(),
            write.pending(),
            pcap.pending()
        )
    });
    assert!(child.try_wait().expect("try_wait").is_none());

    let sent = Instant::now();
    unsafe { libc::kill(child.id() as i32, signal) };
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if sent.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("nattrace did not exit within 10 s of {name} while its output was stalled");
        }
        thread::sleep(Duration::from_millis(10));
    };
    let took = sent.elapsed();
    let stderr = stderr_thread.join().unwrap_or_default();
    eprintln!("{name} -> exit in {took:?}; stderr:\n{stderr}");
    assert!(
        took < Duration::from_millis(1500),
        "{name} took {took:?} to exit; stderr:\n{stderr}"
    );
    // Lines were dropped and the pcapng given up: output was lost (exit 3).
    assert_eq!(status.code(), Some(3), "stderr:\n{stderr}");
    // Said once while running, and accounted for at exit.
    assert_eq!(
        stderr.matches("dropping output lines").count(),
        1,
        "stderr:\n{stderr}"
    );
    assert!(
        stderr.contains("output lines were dropped because stdout was not read"),
        "stderr:\n{stderr}"
    );
    assert!(
        stderr.contains("recording") && stderr.contains("is not being written fast enough"),
        "stderr:\n{stderr}"
    );
    assert_eq!(node_state(lab), before, "the node namespace changed");
    assert_objects_gone(&objects, &format!("{name} with stalled output"));
    drop((stdout, write, pcap));
    let _ = std::fs::remove_dir_all(&dir);
}
