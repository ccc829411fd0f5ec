//! Incident capture against the lab: recordings that survive SIGKILL,
//! `nattrace analyze`, pcapng read back by tshark, forced event loss, and
//! cleanup of what a killed nattrace leaves attached. Root tests are
//! prefixed `root_`; without root they print why they are skipped and pass.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use lab::presets::{self, Backend, Seed000};
use lab::tracer::{Finished, Nattrace, curl_parallel, nattrace, tracing_lock};
use lab::{Lab, build_lab};
use serde_json::Value;

macro_rules! require_root {
    () => {
        if lab::skip_without_root(
            "capture tests need root (network namespaces, eBPF); \
             run `sudo cargo test -p nattrace-tests --test capture` or in CI",
        ) {
            return;
        }
    };
}

const ATTACH_TIMEOUT: Duration = Duration::from_secs(30);
const CURL_MAX_TIME: Duration = Duration::from_secs(1);

fn seed000(bridge_nf_call_iptables: bool) -> Lab {
    build_lab(presets::seed000(Seed000 {
        bridge_nf_call_iptables,
        backend: Backend::SameNode,
    }))
}

fn node_path(lab: &Lab) -> String {
    lab.node_netns(presets::NODE_A)
        .expect("node-a")
        .path()
        .display()
        .to_string()
}

fn args(lab: &Lab, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "--svc",
        &format!("{}:{}", presets::WEB_SERVICE_IP, presets::WEB_PORT),
        "--netns",
        &node_path(lab),
        "--output",
        "json",
        "--reply-timeout",
        "1000",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

fn start(args: &[String], envs: &[(&str, &str)]) -> Nattrace {
    let mut t = Nattrace::spawn(&nattrace(), args, envs, false).expect("starting nattrace");
    t.wait_started(ATTACH_TIMEOUT)
        .unwrap_or_else(|e| panic!("{e:#}"));
    t
}

fn curls(lab: &Lab, ports: &[u16]) -> usize {
    curl_parallel(
        lab,
        presets::CLIENT_POD,
        presets::WEB_SERVICE_IP,
        presets::WEB_PORT,
        ports,
        CURL_MAX_TIME,
    )
    .into_iter()
    .filter(|r| r.as_ref().is_ok_and(|o| o.status.success()))
    .count()
}

fn run(args: &[&str]) -> Output {
    Command::new(nattrace())
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("running nattrace")
}

fn json_lines(out: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

fn kind<'a>(lines: &'a [Value], k: &str) -> Vec<&'a Value> {
    lines.iter().filter(|v| v["kind"] == k).collect()
}

fn describe(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Removes every `*ts_ns` field, recursively: the only thing allowed to
/// differ between a live run and its re-analysis.
fn without_times(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(k, _)| !k.ends_with("ts_ns"))
                .map(|(k, v)| (k.clone(), without_times(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(without_times).collect()),
        other => other.clone(),
    }
}

fn analyze(file: &Path, extra: &[&str]) -> Output {
    let mut a = vec!["analyze", file.to_str().unwrap(), "--output", "json"];
    a.extend(extra);
    run(&a)
}

fn trace_seed000(lab: &Lab, ports: &[u16], extra: &[&str]) -> Finished {
    let mut t = start(&args(lab, extra), &[]);
    assert_eq!(curls(lab, ports), 0, "seed 000: curl fails");
    t.finish().unwrap_or_else(|e| panic!("{e:#}"))
}

#[test]
fn root_live_json_equals_analyze_json_and_pcapng_reads_in_tshark() {
    require_root!();
    let scratch = lab::Scratch::new("capture");
    let lab = seed000(false);
    let (rec, live_pcap, offline_pcap) = (
        scratch.path("seed.rec"),
        scratch.path("live.pcapng"),
        scratch.path("off.pcapng"),
    );
    let ports: Vec<u16> = (46000..46004).collect();
    let _lock = tracing_lock();
    let done = trace_seed000(
        &lab,
        &ports,
        &[
            "--write",
            rec.to_str().unwrap(),
            "--pcap",
            live_pcap.to_str().unwrap(),
        ],
    );
    let live = done
        .json()
        .unwrap_or_else(|e| panic!("{e:#}\n{}", done.describe()));
    assert_eq!(
        kind(&live, "flow").len(),
        ports.len(),
        "{}",
        done.describe()
    );
    let out = analyze(&rec, &["--pcap", offline_pcap.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    assert!(
        out.stderr.is_empty(),
        "a complete recording warns about nothing: {}",
        describe(&out)
    );
    let offline = json_lines(&out);
    let strip = |v: &[Value]| v.iter().map(without_times).collect::<Vec<_>>();
    assert_eq!(
        strip(&live),
        strip(&offline),
        "live and analyze JSON differ"
    );

    // pcapng: one packet block per packet and address pair (what a capture
    // at its hops would show: the packet before and after DNAT; its hops
    // are named in the comment), a comment on every packet.
    let mut sightings = std::collections::BTreeSet::new();
    for f in kind(&live, "flow") {
        for p in f["packets"].as_array().unwrap() {
            for h in p["hops"].as_array().unwrap() {
                sightings.insert(format!(
                    "{} {} {} {} {} {} {} {} {}",
                    f["client"],
                    p["dir"],
                    p["tcp_flags"],
                    p["seq"],
                    p["ack"],
                    p["ip_id"],
                    h["src"],
                    h["dst"],
                    h["node"]
                ));
            }
        }
    }
    let hops = sightings.len();
    for pcap in [&live_pcap, &offline_pcap] {
        let fields = tshark(
            pcap,
            &[
                "-e",
                "ip.src",
                "-e",
                "ip.dst",
                "-e",
                "tcp.flags",
                "-e",
                "frame.comment",
            ],
        );
        assert_eq!(
            fields.len(),
            hops,
            "{}: one packet per packet and address pair",
            pcap.display()
        );
        let syn_to = |dst: String| {
            fields
                .iter()
                .any(|f| f[1] == dst && f[2] == "0x0002" && f[3].contains("SYN request"))
        };
        assert!(
            syn_to(presets::WEB_SERVICE_IP.to_string()),
            "SYN to the Service: {fields:?}"
        );
        assert!(
            syn_to(presets::BACKEND_IP.to_string()),
            "SYN to the backend after DNAT: {fields:?}"
        );
        assert!(
            fields
                .iter()
                .all(|f| f[3].contains("reply_not_reverse_nated")),
            "every packet's comment carries the verdict: {fields:?}"
        );
        assert!(
            fields.iter().any(|f| f[3].contains("before-nat"))
                && fields.iter().any(|f| f[3].contains("after-nat")),
            "NAT stages are named: {fields:?}"
        );
    }
}

/// `tshark -r FILE -T fields <fields>` split into columns.
fn tshark(file: &Path, fields: &[&str]) -> Vec<Vec<String>> {
    let out = Command::new("tshark")
        .args([
            "-r",
            file.to_str().unwrap(),
            "-T",
            "fields",
            "-E",
            "separator=/t",
        ])
        .args(fields)
        .output()
        .expect("running tshark (apt install tshark)");
    assert!(out.status.success(), "tshark failed: {}", describe(&out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.split('\t').map(str::to_owned).collect())
        .collect()
}

#[test]
fn root_sigkill_mid_run_then_analyze_keeps_completed_flows() {
    require_root!();
    let scratch = lab::Scratch::new("capture");
    let lab = seed000(false);
    let rec = scratch.path("killed.rec");
    let ports: Vec<u16> = (46100..46104).collect();
    let _lock = tracing_lock();
    let mut t = start(&args(&lab, &["--write", rec.to_str().unwrap()]), &[]);
    assert_eq!(curls(&lab, &ports), 0);
    // Every curl's flow decided live, then more than a flush interval.
    for _ in &ports {
        assert!(
            t.wait_line(Duration::from_secs(10), |l| l.contains("\"kind\":\"flow\""))
                .is_some(),
            "flows are printed live"
        );
    }
    // Killed only once the recording holds them: the writer flushes at a
    // tick ≥ 1 s after its last flush, which a loaded machine can delay.
    lab::wait::until_true(
        "the recording holding every flow printed live",
        lab::wait::FAIL_AFTER,
        || {
            let flows = json_lines(&analyze(&rec, &[]));
            t.printed()
                .iter()
                .filter(|l| lab::tracer::is_flow_line(l))
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .all(|f| {
                    kind(&flows, "flow")
                        .iter()
                        .any(|o| o["client"] == f["client"])
                })
        },
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    t.signal(libc::SIGKILL);
    let killed = t
        .wait(ATTACH_TIMEOUT)
        .expect("waiting for the killed nattrace");
    let live: Vec<Value> = killed
        .json()
        .unwrap()
        .into_iter()
        .filter(|v| v["kind"] == "flow")
        .collect();
    assert_eq!(live.len(), ports.len(), "{}", killed.describe());

    let out = analyze(&rec, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.lines().count(),
        1,
        "one truncation warning: {}",
        describe(&out)
    );
    assert!(stderr.contains("truncated"), "{}", describe(&out));
    let offline = json_lines(&out);
    for f in &live {
        let same = kind(&offline, "flow")
            .into_iter()
            .find(|o| o["client"] == f["client"])
            .unwrap_or_else(|| panic!("flow {} missing offline: {}", f["client"], describe(&out)));
        for key in ["verdict", "cause", "backend", "incomplete", "detail"] {
            assert_eq!(same[key], f[key], "{key} of {}", f["client"]);
        }
    }
    assert!(kind(&offline, "summary").len() == 1, "{}", describe(&out));
}

#[test]
fn root_forced_ring_buffer_overflow_is_reported_and_marks_flows_incomplete() {
    require_root!();
    let lab = seed000(true);
    let ports: Vec<u16> = (46200..46216).collect();
    let _lock = tracing_lock();
    // -v: every packet. Without it 16 healthy connections cost 48 events
    // (the kernel's per-flow buffer), which a 4 KiB ring buffer may hold.
    let mut t = start(
        &args(&lab, &["--duration", "4", "--ringbuf-kib", "4", "-v"]),
        &[("NATTRACE_TEST_STALL_MS", "400")],
    );
    assert_eq!(curls(&lab, &ports), ports.len());
    let done = t.wait(ATTACH_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    let summary = done
        .summary()
        .unwrap_or_else(|e| panic!("{e:#}\n{}", done.describe()));
    assert!(
        summary["lost_events"].as_u64().unwrap() > 0,
        "{}",
        done.describe()
    );
    assert!(
        done.stderr.contains("events lost"),
        "live warning: {}",
        done.describe()
    );
    let flows = done.flows().unwrap();
    assert!(
        flows.iter().any(|f| f["incomplete"] == true),
        "affected flows are marked incomplete: {}",
        done.describe()
    );
    assert!(
        summary["incomplete_flows"].as_u64().unwrap() > 0,
        "{summary}"
    );
}

/// `tc filter show` on every interface of node-a, both clsact hooks.
fn filters(lab: &Lab) -> String {
    let links = lab
        .run(presets::NODE_A, &["ip", "-o", "link", "show"])
        .expect("ip link");
    let mut out = String::new();
    for l in links.lines() {
        let Some(name) = l
            .split(':')
            .nth(1)
            .map(|n| n.trim().split('@').next().unwrap_or("").to_owned())
        else {
            continue;
        };
        for hook in ["ingress", "egress"] {
            let text = lab
                .run(
                    presets::NODE_A,
                    &["tc", "filter", "show", "dev", &name, hook],
                )
                .unwrap_or_default();
            for line in text.lines() {
                out.push_str(&format!("{name} {hook}: {line}\n"));
            }
        }
    }
    out
}

fn qdiscs(lab: &Lab) -> String {
    lab.run(presets::NODE_A, &["tc", "qdisc", "show"])
        .expect("tc qdisc")
}

#[test]
fn root_cleanup_after_sigkill_removes_only_nattrace_filters() {
    require_root!();
    let lab = seed000(true);
    // A foreign clsact filter on an interface nattrace also attaches to.
    let dev = "cni0";
    lab.run(
        presets::NODE_A,
        &["tc", "qdisc", "add", "dev", dev, "clsact"],
    )
    .expect("clsact");
    // Another bpf filter (classic BPF, like ours of kind "bpf") and a u32 one;
    // no actions: the lab kernel may lack the act_* modules.
    for filter in [
        &[
            "prio",
            "7",
            "handle",
            "7",
            "bpf",
            "bytecode",
            "1,6 0 0 4294967295,",
        ][..],
        &[
            "prio",
            "8",
            "protocol",
            "ip",
            "u32",
            "match",
            "ip",
            "dst",
            "203.0.113.7/32",
            "flowid",
            "1:1",
        ][..],
    ] {
        let mut cmd = vec!["tc", "filter", "add", "dev", dev, "ingress"];
        cmd.extend_from_slice(filter);
        lab.run(presets::NODE_A, &cmd).expect("foreign filter");
    }
    let (filters_before, qdiscs_before) = (filters(&lab), qdiscs(&lab));
    assert!(
        filters_before.contains("u32") && filters_before.contains("bytecode"),
        "{filters_before}"
    );
    let env = [("NATTRACE_FORCE_CLSACT", "1")];
    let _lock = tracing_lock();

    for next_start in [false, true] {
        let t = start(&args(&lab, &[]), &env);
        t.signal(libc::SIGKILL);
        drop(t);
        let left = filters(&lab);
        assert!(
            left.contains("tc_ingress"),
            "SIGKILL leaves clsact filters behind:\n{left}"
        );
        if next_start {
            let mut t = start(&args(&lab, &["--duration", "1"]), &env);
            let done = t.wait(ATTACH_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
            assert!(
                done.stderr.contains("removed what a killed nattrace left"),
                "{}",
                done.describe()
            );
        } else {
            let out = run(&["cleanup", "--netns", &node_path(&lab)]);
            assert_eq!(out.status.code(), Some(0), "{}", describe(&out));
            assert!(
                String::from_utf8_lossy(&out.stdout).contains("removed tc filter"),
                "{}",
                describe(&out)
            );
        }
        assert_eq!(
            filters(&lab),
            filters_before,
            "only nattrace's filters are gone (next start: {next_start})"
        );
        assert_eq!(
            qdiscs(&lab),
            qdiscs_before,
            "nattrace's clsact qdiscs are gone, the foreign one stays"
        );
    }
    let out = run(&["cleanup", "--netns", &node_path(&lab)]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("nothing left"),
        "{}",
        describe(&out)
    );
}

#[test]
fn root_analyze_skips_corrupt_lines_and_refuses_a_file_without_events() {
    require_root!();
    let scratch = lab::Scratch::new("capture");
    let lab = seed000(false);
    let rec = scratch.path("corrupt-source.rec");
    let ports: Vec<u16> = (46200..46203).collect();
    {
        let _lock = tracing_lock();
        trace_seed000(&lab, &ports, &["--write", rec.to_str().unwrap()]);
    }
    let clean = analyze(&rec, &[]);
    assert_eq!(clean.status.code(), Some(1), "{}", describe(&clean));
    let clean_flows = kind(&json_lines(&clean), "flow").len();
    assert_eq!(clean_flows, ports.len(), "{}", describe(&clean));

    // A crash's block of NUL bytes in place of part of the file, and a line
    // with the wrong types, both in the middle.
    let bytes = std::fs::read(&rec).unwrap();
    let newlines: Vec<usize> = bytes
        .iter()
        .enumerate()
        .filter(|(_, b)| **b == b'\n')
        .map(|(i, _)| i)
        .collect();
    assert!(newlines.len() > 20, "a recording with events");
    let mid = newlines[newlines.len() / 2];
    let mut corrupt = bytes[..=mid].to_vec();
    corrupt.extend(std::iter::repeat_n(0u8, 4096));
    corrupt.extend_from_slice(b"\n{\"kind\":\"event\",\"ts_ns\":\"noon\",\"skb\":[]}\n");
    corrupt.extend_from_slice(&bytes[mid + 1..]);
    let corrupt_path = scratch.path("corrupt.rec");
    std::fs::write(&corrupt_path, &corrupt).unwrap();
    let out = analyze(&corrupt_path, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Evidence was skipped: exit 3 (README's table), over the flows' 1.
    assert_eq!(out.status.code(), Some(3), "{}", describe(&out));
    assert_eq!(stderr.lines().count(), 1, "one warning: {}", describe(&out));
    assert!(
        stderr.contains("2 unreadable line(s), skipped"),
        "{}",
        describe(&out)
    );
    let flows = json_lines(&out);
    assert_eq!(
        kind(&flows, "flow").len(),
        clean_flows,
        "{}",
        describe(&out)
    );
    assert_eq!(kind(&flows, "summary").len(), 1);

    // The header, then nothing readable: not analysable at all.
    let header_end = newlines[0];
    let mut junk = bytes[..=header_end].to_vec();
    for _ in 0..5 {
        junk.extend_from_slice(b"{\"kind\":\"event\",\"ts_ns\":\"noon\"}\n");
    }
    let junk_path = scratch.path("no-events.rec");
    std::fs::write(&junk_path, &junk).unwrap();
    let out = analyze(&junk_path, &[]);
    assert_one_line_exit_2(&out, "holds no readable event");
    assert!(out.stdout.is_empty(), "{}", describe(&out));
}

fn assert_one_line_exit_2(out: &Output, mention: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{}", describe(out));
    assert_eq!(stderr.lines().count(), 1, "{}", describe(out));
    assert!(
        stderr.contains(mention),
        "should mention {mention}: {}",
        describe(out)
    );
}

#[test]
fn bad_capture_arguments_are_one_line_and_exit_2() {
    let scratch = lab::Scratch::new("capture");
    let svc = ["--svc", "100.67.30.133:80"];
    let cases: &[(&[&str], &str)] = &[
        (&["--write", "/nonexistent-dir/x.rec"], "/nonexistent-dir"),
        (&["--pcap", "/tmp"], "/tmp"),
        (&["--write-max-mb", "0"], "0"),
        (&["--duration", "-1"], "-1"),
        (&["--reply-timeout", "abc"], "abc"),
    ];
    for (extra, mention) in cases {
        assert_one_line_exit_2(&run(&[&svc[..], extra].concat()), mention);
    }
    assert_one_line_exit_2(&run(&["analyze", "/nonexistent.rec"]), "/nonexistent.rec");
    let junk = scratch.path("junk.rec");
    std::fs::write(&junk, "hello\n").unwrap();
    assert_one_line_exit_2(
        &run(&["analyze", junk.to_str().unwrap()]),
        "not a nattrace recording",
    );
    assert_one_line_exit_2(&run(&["analyze", "/tmp"]), "/tmp");
    // Binary data, a gzip of a recording, an empty file.
    let binary = scratch.path("binary.rec");
    let mut bytes: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
    bytes[0] = 0x7f;
    std::fs::write(&binary, &bytes).unwrap();
    assert_one_line_exit_2(
        &run(&["analyze", binary.to_str().unwrap()]),
        "not a nattrace recording",
    );
    let gz = scratch.path("rec.gz");
    std::fs::write(
        &gz,
        [0x1f, 0x8b, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03],
    )
    .unwrap();
    assert_one_line_exit_2(
        &run(&["analyze", gz.to_str().unwrap()]),
        "not a nattrace recording",
    );
    let empty = scratch.path("empty.rec");
    std::fs::write(&empty, b"").unwrap();
    assert_one_line_exit_2(
        &run(&["analyze", empty.to_str().unwrap()]),
        "not a nattrace recording",
    );
}
