//! A request sent right before the trace stops (SIGTERM), within the reply
//! timeout: its reply had not come because nattrace stopped waiting, so
//! the flow is `undecided` and the run exits 0, live and in `analyze` of
//! its recording alike (issue 26: it was `no_reply`, exit 1, and failed a
//! healthy CI job at random). The healthy twin: the reply came before the
//! stop, `ok`. The DNS server of the lab's coredns pod is replaced by one
//! that notes each query in a file (the event the test stops on) and
//! answers only after `delay` seconds.
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use lab::presets::{self, CLIENT_POD, DNS_NAME, DNS_POD, DNS_SERVICE_IP, WEB_SERVICE_IP};
use lab::tracer::{Finished, nattrace};

use super::{args, start, tracing_lock};

/// Answers A queries for argv[2] with argv[3], `delay` seconds late; writes
/// argv[1] when a query arrives.
const SLOW_DNS: &str = r#"
import socket, struct, sys, time
marker, answer, delay = sys.argv[1], socket.inet_aton(sys.argv[2]), float(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", 53))
while True:
    q, peer = s.recvfrom(512)
    open(marker, "w").close()
    time.sleep(delay)
    qend = 12
    while q[qend] != 0:
        qend += q[qend] + 1
    qend += 5
    head = q[:2] + b"\x81\x80" + q[4:6] + b"\x00\x01\x00\x00\x00\x00"
    rr = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 30, 4) + answer
    s.sendto(head + q[12:qend] + rr, peer)
"#;

const REPLY_TIMEOUT_MS: u64 = 5000;

/// One query to kube-dns through the node, nattrace stopped by SIGTERM as
/// soon as the query reached the server (`delay` > 0: before its reply) or
/// dig got its answer (`delay` 0). Returns the live run and `analyze` of
/// its recording.
fn query_then_stop(delay: &str, name: &str) -> (Finished, std::process::Output, Option<u16>) {
    let lab = lab::build_lab(presets::dns(presets::Dns::default()));
    lab.stop_pod_servers(DNS_POD)
        .expect("stopping the lab's DNS server");
    let scratch = lab::Scratch::new("cut");
    let marker = scratch.path(&format!("{name}.query"));
    let rec = scratch.path(&format!("{name}.rec"));
    let marker_s = marker.display().to_string();
    let answer = WEB_SERVICE_IP.to_string();
    lab.spawn(
        DNS_POD,
        &["python3", "-c", SLOW_DNS, &marker_s, &answer, delay],
    )
    .expect("slow DNS server");
    // Listening: its socket is in the pod's UDP table.
    lab::wait::until_true("the slow DNS server on :53", lab::wait::FAIL_AFTER, || {
        lab.run(DNS_POD, &["cat", "/proc/net/udp"])
            .is_ok_and(|t| t.lines().any(|l| l.contains(":0035 ")))
    })
    .expect("slow DNS server listening");
    let _lock = tracing_lock();
    let svc = format!("{DNS_SERVICE_IP}:53");
    let timeout = REPLY_TIMEOUT_MS.to_string();
    let a = args(
        &lab,
        &[svc],
        &[
            "--reply-timeout",
            &timeout,
            "--write",
            &rec.display().to_string(),
        ],
    );
    let mut t = start(&a, &[]);
    let dig = format!("@{DNS_SERVICE_IP}");
    let mut query_id = None;
    if delay == "0" {
        let out = lab
            .exec_timeout(
                CLIENT_POD,
                &["dig", &dig, DNS_NAME, "A", "+time=5", "+tries=1"],
                Duration::from_secs(20),
            )
            .expect("dig");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.lines()
                .any(|l| l.starts_with(DNS_NAME) && l.ends_with(&answer)),
            "dig got no answer: {out:?}"
        );
        // ";; ->>HEADER<<- opcode: QUERY, status: NOERROR, id: 4242"
        query_id = text
            .split("id: ")
            .nth(1)
            .and_then(|t| t.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse().ok());
        assert!(query_id.is_some(), "no query id in dig's output: {text}");
    } else {
        lab.spawn(
            CLIENT_POD,
            &["dig", &dig, DNS_NAME, "A", "+time=30", "+tries=1"],
        )
        .expect("dig");
        lab::wait::until_true("the query at the server", lab::wait::FAIL_AFTER, || {
            marker.exists()
        })
        .expect("the query reached the DNS pod");
    }
    t.terminate();
    let done = t
        .wait(lab::wait::FAIL_AFTER)
        .unwrap_or_else(|e| panic!("{e:#}"));
    let analyzed = Command::new(nattrace())
        .args(["analyze", rec.to_str().unwrap(), "--output", "json"])
        .env_remove("RUST_LOG")
        .output()
        .expect("running nattrace analyze");
    let _ = std::fs::remove_file(&rec);
    let _ = std::fs::remove_file(&marker);
    (done, analyzed, query_id)
}

fn dns_flows(lines: impl Iterator<Item = String>) -> (Vec<Value>, Value) {
    let all: Vec<Value> = lines
        .map(|l| serde_json::from_str(&l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let flows = all
        .iter()
        .filter(|v| v["kind"] == "flow")
        .cloned()
        .collect();
    let summary = all.last().cloned().unwrap_or_default();
    (flows, summary)
}

fn assert_one(done: &Finished, analyzed: &std::process::Output, verdict: &str) -> Value {
    let all = done.describe();
    assert_eq!(done.status.code(), Some(0), "live exit status:\n{all}");
    let (flows, summary) = dns_flows(done.stdout.iter().cloned());
    assert_eq!(flows.len(), 1, "one flow:\n{all}");
    let f = &flows[0];
    assert_eq!(f["verdict"], verdict, "{f}\n{all}");
    assert_eq!(f["proto"], "udp", "{f}");
    assert_eq!(summary["kind"], "summary", "{all}");
    assert_eq!(summary["by_verdict"]["no_reply"], 0, "{summary}");
    // `analyze` of the recording: the same flow, the same exit status.
    let text = String::from_utf8_lossy(&analyzed.stdout).to_string();
    assert_eq!(
        analyzed.status.code(),
        Some(0),
        "analyze exit status: {text}\n{}",
        String::from_utf8_lossy(&analyzed.stderr)
    );
    let (again, _) = dns_flows(text.lines().map(str::to_owned));
    assert_eq!(again.len(), 1, "{text}");
    assert_eq!(again[0]["verdict"], f["verdict"], "{text}");
    assert_eq!(again[0]["detail"], f["detail"], "{text}");
    f.clone()
}

#[test]
fn root_a_query_whose_reply_the_stop_cut_off_is_undecided_exit_0() {
    require_root!();
    // The reply comes 30 s late: SIGTERM (sent as the query reaches the
    // server) always comes first.
    let (done, analyzed, _) = query_then_stop("30", "cut");
    let f = assert_one(&done, &analyzed, "undecided");
    let detail = f["detail"].as_str().unwrap();
    assert!(detail.contains("ms before tracing stopped"), "{detail}");
    assert!(
        detail.contains(&format!("within the {REPLY_TIMEOUT_MS} ms reply timeout")),
        "{detail}"
    );
    let (_, summary) = dns_flows(done.stdout.iter().cloned());
    assert_eq!(summary["by_verdict"]["undecided"], 1, "{summary}");
}

#[test]
fn root_a_query_answered_right_before_the_stop_is_ok_exit_0() {
    require_root!();
    let (done, analyzed, query_id) = query_then_stop("0", "answered");
    let f = assert_one(&done, &analyzed, "ok");
    // The query's id is the payload's first two bytes, which every hook
    // reads its own way (tc from the packet, the device and netfilter
    // programs through skb->head, by plain loads on 6.17+ or probe reads):
    // a packet's hops are stitched on them, so one hook reading them wrong
    // splits the query into two packets, one with another id.
    let packets = f["packets"].as_array().expect("packets");
    assert!(!packets.is_empty(), "{f}");
    for p in packets {
        assert_eq!(p["dns_id"], query_id.expect("dig's id"), "{f}");
    }
    let (_, summary) = dns_flows(done.stdout.iter().cloned());
    assert!(
        summary["by_verdict"].get("undecided").is_none(),
        "{summary}"
    );
}
