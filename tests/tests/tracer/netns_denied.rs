//! `--netns` as a user who may not enter it (issue 26 item 13): one line
//! that says "needs root" (not a bare EPERM), and a namespace of another
//! kind named as such (not "does not exist"); exit 2 both.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Output};

use super::nattrace;

/// A namespace of this test's own, removed on drop (also on panic).
struct OwnNetns(String);

impl OwnNetns {
    fn create() -> OwnNetns {
        let name = format!("ntdenied-{}", std::process::id());
        let ok = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .expect("ip netns add");
        assert!(ok.success(), "ip netns add {name}");
        OwnNetns(name)
    }
}

impl Drop for OwnNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// nattrace copied where `nobody` can run it (the build tree may sit under
/// a private home); removed on drop.
struct NobodyCopy(PathBuf);

impl NobodyCopy {
    fn new() -> NobodyCopy {
        let dir = std::env::temp_dir().join(format!("nattrace-denied-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let bin = dir.join("nattrace");
        std::fs::copy(nattrace(), &bin).expect("copying nattrace");
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        NobodyCopy(dir)
    }

    fn run(&self, args: &[&str]) -> Output {
        Command::new("setpriv")
            .args([
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "--inh-caps=-all",
            ])
            .arg(self.0.join("nattrace"))
            .args(args)
            .env_remove("RUST_LOG")
            .output()
            .expect("running setpriv")
    }
}

impl Drop for NobodyCopy {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn assert_one_line_exit_2(out: &Output, must: &[&str], must_not: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let all = format!(
        "exit {:?}\nstdout: {}\nstderr: {stderr}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(out.status.code(), Some(2), "{all}");
    assert_eq!(stderr.lines().count(), 1, "one line on stderr:\n{all}");
    for m in must {
        assert!(stderr.contains(m), "should say {m:?}:\n{all}");
    }
    for m in must_not {
        assert!(!stderr.contains(m), "should not say {m:?}:\n{all}");
    }
}

#[test]
fn root_doctor_netns_as_a_user_says_needs_root() {
    require_root!();
    let ns = OwnNetns::create();
    let bin = NobodyCopy::new();
    for path in [ns.0.clone(), format!("/run/netns/{}", ns.0)] {
        let out = bin.run(&["doctor", "--netns", &path]);
        assert_one_line_exit_2(&out, &["needs root", &ns.0], &["EPERM"]);
    }
    // The tracer says the same for its --netns.
    let out = bin.run(&["--svc", "100.67.30.133:80", "--netns", &ns.0]);
    assert_one_line_exit_2(&out, &["root"], &["EPERM"]);
}

#[test]
fn root_doctor_netns_of_another_kind_says_so_not_missing() {
    require_root!();
    let bin = NobodyCopy::new();
    // pid 1's namespace links cannot be opened by `nobody`.
    let out = bin.run(&["doctor", "--netns", "/proc/1/ns/pid"]);
    assert_one_line_exit_2(
        &out,
        &["pid namespace", "not a network namespace"],
        &["does not exist"],
    );
    // One we may open: the check by namespace type.
    let out = bin.run(&["doctor", "--netns", "/proc/self/ns/pid"]);
    assert_one_line_exit_2(&out, &["not a network namespace"], &["does not exist"]);
    // Another process's network namespace: permission, not absence.
    let out = bin.run(&["doctor", "--netns", "/proc/1/ns/net"]);
    assert_one_line_exit_2(
        &out,
        &["permission denied", "needs root"],
        &["does not exist"],
    );
}
