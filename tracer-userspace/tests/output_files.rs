//! What nattrace writes and prints cannot be turned against the node or the
//! evidence (issue 26): no terminal escapes from names it did not choose,
//! no output over an input, no file it did not mean to write, no kernel
//! address in a recording, and a non-zero exit when output was lost. Tests
//! that need another user or a mount run only as root and say so otherwise.
use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

fn nattrace() -> Command {
    Command::new(env!("CARGO_BIN_EXE_nattrace"))
}

/// A recorded fixture by file name, wherever the crate keeps its fixtures.
fn fixture(name: &str) -> PathBuf {
    fn find(dir: &Path, name: &str) -> Option<PathBuf> {
        for entry in std::fs::read_dir(dir).ok()?.flatten() {
            let path = entry.path();
            if path.file_name().is_some_and(|n| n == name) {
                return Some(path);
            }
            if path.is_dir() && !path.ends_with("target") {
                if let Some(found) = find(&path, name) {
                    return Some(found);
                }
            }
        }
        None
    }
    find(Path::new(env!("CARGO_MANIFEST_DIR")), name)
        .unwrap_or_else(|| panic!("fixture {name} not found"))
}

/// A directory of this test's own, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!(
            "nattrace-out-{tag}-{}-{:x}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Bytes a terminal would act on: C0 but newline and tab, DEL, and C1
/// (UTF-8 `C2 80`..`C2 9F`).
fn control_bytes(out: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(out);
    text.lines()
        .filter(|l| {
            l.chars()
                .any(|c| (c.is_control() && c != '\t') || ('\u{80}'..='\u{9f}').contains(&c))
        })
        .map(|l| format!("{l:?}"))
        .collect()
}

const EVIL: &str = "\\u001b[2J\\u001b]0;pwned\\u0007\\r\\u009b31m";

/// Issue 26 item 1: a pod that renames its interface, or a recording that
/// names a Service or check with escapes, must not reach root's terminal.
#[test]
fn analyze_prints_no_terminal_escapes_from_names_in_a_recording() {
    let dir = TempDir::new("escapes");
    let text = std::fs::read_to_string(fixture("root_hairpin_mode_off_is_named.rec")).unwrap();
    let evil = text
        .replace("\"name\":\"veth0\"", &format!("\"name\":\"veth0{EVIL}\""))
        .replace("\"name\":\"cni0\"", &format!("\"name\":\"cni0{EVIL}\""))
        .replace(
            "\"checks_line\":\"checks: ",
            &format!("\"checks_line\":\"checks{EVIL}: "),
        )
        .replace(
            "ntlab-1304-2-ee63-node-a",
            &format!("ntlab-1304-2-ee63-node-a{EVIL}"),
        );
    assert_ne!(evil, text, "the fixture changed: nothing was replaced");
    let rec = dir.path("evil.rec");
    std::fs::write(&rec, &evil).unwrap();
    for color in ["never", "always"] {
        let out: Output = nattrace()
            .args(["analyze", "-v", "--color", color])
            .arg(&rec)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("veth0\\x1b[2J"), "{stdout}");
        let mut bad = control_bytes(&out.stdout);
        if color == "always" {
            // Our own colours are the only escapes left.
            let ours = [
                "\x1b[32m", "\x1b[31m", "\x1b[33m", "\x1b[2m", "\x1b[1m", "\x1b[0m",
            ];
            bad = control_bytes(
                ours.iter()
                    .fold(stdout.to_string(), |s, c| s.replace(c, ""))
                    .as_bytes(),
            );
        }
        bad.extend(control_bytes(&out.stderr));
        assert!(bad.is_empty(), "raw control characters printed: {bad:#?}");
    }
}
