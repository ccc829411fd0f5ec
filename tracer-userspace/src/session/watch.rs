//! What a live session watches besides the kernel's events: the traced
//! namespace's name (deleted under us?) and its own stderr (never blocking).
use std::{
    fmt::Display,
    io::Write as _,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use crate::output::queue::{self, Overflow, QueueWriter, WriteQueue};

/// The file that names the traced namespace (`/run/netns/NAME`'s bind mount,
/// or a `/proc/PID/ns/net`), and the namespace it named when tracing began.
///
/// Our own descriptors keep a deleted namespace alive: the netns fd, and
/// every netfilter link (bpf_nf_link_attach takes a reference with
/// `get_net_track`, net/netfilter/nf_bpf_link.c, since the fix for
/// CVE-2024-50130). So `ip netns del` alone would leave a "deleted" node
/// forwarding for as long as nattrace runs; the session stops and lets go
/// when this says the name is gone.
pub struct NetnsWatch {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl NetnsWatch {
    /// None for the current namespace (it cannot be deleted under us) or
    /// when the name cannot be read now.
    pub fn new(spec: Option<&str>) -> Option<Self> {
        let path = match spec? {
            s if s.contains('/') => PathBuf::from(s),
            s => Path::new("/run/netns").join(s),
        };
        let meta = std::fs::metadata(&path).ok()?;
        Some(Self {
            path,
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }

    /// Whether the name no longer leads to the namespace we trace: the file
    /// is gone, or it is another file now (`ip netns del` first detaches the
    /// bind mount, leaving the empty mount point, then unlinks it).
    pub fn gone(&self) -> bool {
        match std::fs::metadata(&self.path) {
            Ok(meta) => (meta.dev(), meta.ino()) != (self.dev, self.ino),
            Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The session's own stderr lines (warnings, notices), through a queue of
/// their own: `nattrace ... 2>&1 | stalled-reader` must not block the event
/// loop on a warning either.
pub struct Notices {
    out: Option<QueueWriter>,
}

/// Warnings are a few lines a minute; past this the reader is not reading.
const NOTICE_QUEUE_BYTES: usize = 64 * 1024;

impl Notices {
    pub fn new() -> Self {
        Self::around(None)
    }

    /// With a live status line on stderr: each line clears it first.
    pub fn around(bar: Option<indicatif::ProgressBar>) -> Self {
        let out = queue::stderr_file()
            .and_then(|f| {
                let target: Box<dyn std::io::Write + Send> = match bar {
                    Some(bar) => Box::new(super::status::AroundBar::new(f, bar)),
                    None => Box::new(f),
                };
                WriteQueue::spawn("stderr", target, NOTICE_QUEUE_BYTES, Overflow::Drop)
            })
            .map(QueueWriter::new)
            .ok();
        Self { out }
    }

    /// `nattrace: <line>` on stderr (sanitized: it may name an interface).
    pub fn say(&mut self, line: impl Display) {
        let line = line.to_string();
        let line = crate::output::clean::sanitize(&line);
        match self.out.as_mut() {
            Some(out) => {
                let _ = writeln!(out, "nattrace: {line}");
                let _ = out.flush();
            }
            None => crate::output::clean::to_stderr(format!("nattrace: {line}\n")),
        }
    }

    /// `nattrace: warning: <line>`.
    pub fn warn(&mut self, line: impl Display) {
        self.say(format_args!("warning: {line}"));
    }

    /// Lets what was said reach stderr, within the deadline.
    pub fn drain(&mut self, deadline: Instant, stall: Duration) {
        if let Some(out) = self.out.as_mut() {
            let _ = out.flush();
            out.queue().drain(deadline, stall);
        }
    }
}

impl Default for Notices {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replaced_or_removed_name_is_gone() {
        let dir = std::env::temp_dir().join(format!("nattrace-watch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("ns");
        std::fs::write(&file, b"").unwrap();
        let watch = NetnsWatch::new(Some(file.to_str().unwrap())).unwrap();
        assert!(!watch.gone());
        // What `ip netns del` leaves between umount and unlink: another
        // inode (made while the first exists, so the number cannot be reused).
        let other = dir.join("other");
        std::fs::write(&other, b"").unwrap();
        std::fs::rename(&other, &file).unwrap();
        assert!(watch.gone());
        std::fs::remove_file(&file).unwrap();
        assert!(watch.gone());
        let _ = std::fs::remove_dir_all(&dir);
        assert!(NetnsWatch::new(None).is_none());
    }
}
