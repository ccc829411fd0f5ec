//! A test's files (recordings, pcapngs, markers) in a directory of its own
//! under the temp dir, removed when the test ends, also on panic: CI
//! machines run the suite again and again, and the files of each run were
//! left in /tmp.
use std::path::{Path, PathBuf};

pub struct Scratch(PathBuf);

impl Scratch {
    /// `nattrace-<what>-<pid>-<n>`: unique per test in this process.
    pub fn new(what: &str) -> Scratch {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("nattrace-{what}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("creating a scratch directory in the temp dir");
        Scratch(dir)
    }

    /// `name` in the directory (not created).
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    pub fn dir(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
