//! What an on-call engineer gets for a mistake: one line on stderr, exit 2.

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Output};

use super::nattrace;

fn assert_one_line_exit_2(out: &Output, mentions: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let all = format!(
        "exit {:?}\nstdout: {}\nstderr: {stderr}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(out.status.code(), Some(2), "{all}");
    assert_eq!(
        stderr.lines().count(),
        1,
        "exactly one line on stderr:\n{all}"
    );
    let line = stderr.to_lowercase();
    assert!(
        mentions.iter().any(|m| line.contains(m)),
        "the line should mention one of {mentions:?}:\n{all}"
    );
}

fn nattrace_cmd() -> Command {
    let mut cmd = Command::new(nattrace());
    // A RUST_LOG from the caller's shell would add log lines to stderr.
    cmd.env_remove("RUST_LOG");
    cmd
}

#[test]
fn bad_service_address_is_one_line_and_exit_2() {
    let out = nattrace_cmd()
        .args(["--svc", "300.1.1.1"])
        .output()
        .expect("running nattrace");
    assert_one_line_exit_2(&out, &["300.1.1.1"]);
}

#[test]
fn bad_ipv6_service_inputs_are_one_line_and_exit_2() {
    for (svc, mention) in [
        ("[fd00:10:96::a]:0", "port"),
        ("[fd00:10:96::a]:http", "http"),
        ("[fd00:10:96::a", "fd00:10:96::a"),
        ("fd00:10:96::zz", "fd00:10:96::zz"),
        ("[100.67.30.133]:80", "100.67.30.133"),
        ("ff02::1", "multicast"),
        ("fe80::1", "link-local"),
        ("::ffff:100.67.30.133", "ipv4-mapped"),
        ("::", "unspecified"),
    ] {
        let out = nattrace_cmd()
            .args(["--svc", "100.67.30.133:80", "--svc", svc])
            .output()
            .expect("running nattrace");
        assert_one_line_exit_2(&out, &[mention]);
    }
}

#[test]
fn root_unknown_netns_is_one_line_and_exit_2() {
    require_root!();
    let out = nattrace_cmd()
        .args([
            "--svc",
            "100.67.30.133:80",
            "--netns",
            "nosuch",
            "--duration",
            "1",
        ])
        .output()
        .expect("running nattrace");
    assert_one_line_exit_2(&out, &["nosuch"]);
}

#[test]
fn root_running_without_root_is_one_line_and_exit_2() {
    require_root!();
    // A copy nobody can reach: the build tree may sit under a private home.
    let scratch = lab::Scratch::new("nonroot");
    let dir = scratch.dir();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod dir");
    let bin = dir.join("nattrace");
    std::fs::copy(nattrace(), &bin).expect("copying nattrace");
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
        ])
        .arg(&bin)
        .args(["--svc", "100.67.30.133:80", "--duration", "1"])
        .env_remove("RUST_LOG")
        .output()
        .expect("running setpriv");
    assert_one_line_exit_2(&out, &["root", "cap_", "privilege", "permission"]);
}

#[test]
fn non_unicast_service_addresses_are_one_line_and_exit_2() {
    for (svc, what) in [
        ("0.0.0.0", "unspecified"),
        ("0.0.0.0:80", "unspecified"),
        ("0.1.2.3", "unspecified"),
        ("255.255.255.255", "broadcast"),
        ("224.0.0.1:53", "multicast"),
        ("239.255.255.250", "multicast"),
        ("240.1.2.3", "reserved"),
    ] {
        let out = nattrace_cmd()
            .args(["--svc", svc, "--duration", "1"])
            .output()
            .expect("running nattrace");
        assert_one_line_exit_2(&out, &[what]);
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(svc),
            "names {svc}: {out:?}"
        );
    }
}

#[test]
fn duration_zero_says_what_is_allowed() {
    for bad in ["0", "0.0", "-3", "604801"] {
        let out = nattrace_cmd()
            .args(["--svc", "100.67.30.133:80", "--duration", bad])
            .output()
            .expect("running nattrace");
        assert_one_line_exit_2(&out, &["more than 0 and at most 604800 seconds"]);
        let line = String::from_utf8_lossy(&out.stderr);
        assert!(!line.contains("between 0"), "{line}");
    }
}

/// No root needed: the check runs before anything else. With root it must
/// still be one line (no WARN log lines from entering a non-namespace).
#[test]
fn netns_that_is_not_a_network_namespace_is_one_line_and_exit_2() {
    for (path, mentions) in [
        ("/tmp", "not a network namespace"),
        ("/etc/hostname", "not a network namespace"),
        ("/proc/self/ns/mnt", "another kind of namespace"),
    ] {
        if !std::path::Path::new(path).exists() {
            continue;
        }
        let out = nattrace_cmd()
            .args([
                "--svc",
                "100.67.30.133:80",
                "--netns",
                path,
                "--duration",
                "1",
            ])
            .output()
            .expect("running nattrace");
        assert_one_line_exit_2(&out, &[mentions]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        // Log lines read `nattrace: warning: …` (issue 28).
        assert!(
            !stderr.contains("WARN") && !stderr.contains("warning"),
            "{stderr}"
        );
        for sub in ["doctor", "cleanup"] {
            let out = nattrace_cmd()
                .args([sub, "--netns", path])
                .output()
                .expect("running nattrace");
            assert_one_line_exit_2(&out, &[mentions]);
        }
    }
}

/// A FIFO nobody reads would block open(2) forever: refused before
/// anything is attached.
#[test]
fn root_output_fifo_without_a_reader_is_one_line_and_exit_2() {
    require_root!();
    let scratch = lab::Scratch::new("fifo");
    let fifo = scratch.path("out");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("mkfifo");
    for opt in ["--write", "--pcap"] {
        let out = nattrace_cmd()
            .args(["--svc", "100.67.30.133:80", "--duration", "1", opt])
            .arg(&fifo)
            .output()
            .expect("running nattrace");
        assert_one_line_exit_2(&out, &["fifo no process has open for reading"]);
    }
}
