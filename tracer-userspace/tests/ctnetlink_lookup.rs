//! Root test of the ctnetlink lookup (src/ctnetlink.rs) against the real
//! kernel, in both families: entries made with `conntrack -I` (DNATed as
//! kube-proxy's would be, and one without NAT) in a namespace this test
//! creates and removes (also on panic), then looked up by the tuple a
//! client sent, as the session does when a flow fails the watch.
use std::{net::SocketAddr, process::Command};

use nattrace::ctnetlink::{CtTuple, lookup};
use nattrace::probes::netns::Netns;

fn tuple(src: &str, dst: &str) -> CtTuple {
    CtTuple {
        proto: 6,
        src: src.parse::<SocketAddr>().unwrap(),
        dst: dst.parse::<SocketAddr>().unwrap(),
    }
}

/// The namespace, deleted on drop.
struct Ns(String);

impl Drop for Ns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn run(ns: &str, args: &[&str]) {
    let out = Command::new("ip")
        .args(["netns", "exec", ns])
        .args(args)
        .output()
        .expect("spawn");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn entries_are_found_by_the_clients_tuple_in_both_families() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("skipped: needs root (a network namespace, conntrack -I)");
        return;
    }
    if Command::new("conntrack").arg("--version").output().is_err() {
        println!("skipped: the conntrack tool is missing (Debian package conntrack)");
        return;
    }
    let ns = Ns(format!("nattrace-ctnl-{}", std::process::id()));
    let status = Command::new("ip").args(["netns", "add", &ns.0]).status();
    assert!(status.is_ok_and(|s| s.success()), "ip netns add {}", ns.0);
    let insert = |src: &str, dst: &str, sport: &str, dport: &str, nat: Option<&str>| {
        let mut args = vec![
            "conntrack",
            "-I",
            "-p",
            "tcp",
            "-s",
            src,
            "-d",
            dst,
            "--sport",
            sport,
            "--dport",
            dport,
            "--state",
            "ESTABLISHED",
            "-t",
            "100",
            "-u",
            "SEEN_REPLY,ASSURED",
        ];
        if let Some(nat) = nat {
            args.extend(["--dst-nat", nat]);
        }
        run(&ns.0, &args);
    };
    insert(
        "10.0.0.1",
        "10.96.0.10",
        "41001",
        "80",
        Some("10.0.0.3:8080"),
    );
    insert(
        "fd00::1",
        "fd00:96::a",
        "41001",
        "80",
        Some("[fd00::3]:8080"),
    );
    // What nf_conntrack_tcp_loose=1 makes of a backend's mid-stream
    // segment after the DNAT entry was lost: backend → client, no NAT.
    insert("10.0.0.3", "10.0.0.1", "8080", "41002", None);

    let netns = Netns::open(Some(&ns.0)).expect("the test's namespace");
    let found = netns
        .run(|| {
            [
                lookup(
                    tuple("10.0.0.1:41001", "10.96.0.10:80"),
                    tuple("10.0.0.1:41001", "10.0.0.3:8080"),
                ),
                lookup(
                    tuple("[fd00::1]:41001", "[fd00:96::a]:80"),
                    tuple("[fd00::1]:41001", "[fd00::3]:8080"),
                ),
                lookup(
                    tuple("10.0.0.1:41002", "10.96.0.10:80"),
                    tuple("10.0.0.1:41002", "10.0.0.3:8080"),
                ),
                lookup(
                    tuple("10.0.0.1:41003", "10.96.0.10:80"),
                    tuple("10.0.0.1:41003", "10.0.0.3:8080"),
                ),
            ]
        })
        .expect("entering the namespace");
    let [v4, v6, replaced, gone] = found;
    for (l, backend) in [(&v4, "10.0.0.3:8080"), (&v6, "[fd00::3]:8080")] {
        assert_eq!(l.error, None, "{l:?}");
        let e = l
            .entry
            .as_ref()
            .unwrap_or_else(|| panic!("no entry: {l:?}"));
        assert_eq!(e.orig, l.tuple, "{l:?}");
        assert!(e.dnat(), "DST_NAT status: {l:?}");
        assert_eq!(e.reply.src, backend.parse::<SocketAddr>().unwrap(), "{l:?}");
        assert_eq!(e.tcp_state.as_deref(), Some("ESTABLISHED"), "{l:?}");
        assert!(e.timeout_s.is_some_and(|t| t <= 100), "{l:?}");
    }
    assert_eq!(replaced.entry, None, "{replaced:?}");
    let un = replaced.unnated.as_ref().expect("the un-NATed entry");
    assert_eq!(un.orig, tuple("10.0.0.3:8080", "10.0.0.1:41002"));
    assert!(!un.dnat(), "{un:?}");
    assert_eq!(
        (&gone.entry, &gone.unnated, &gone.error),
        (&None, &None, &None)
    );
    // Read in the namespace, not this process's: a new one has the defaults.
    assert_eq!(gone.tcp_loose, Some(true), "{gone:?}");
    assert_eq!(gone.tcp_be_liberal, Some(false), "{gone:?}");
}
