//! Continuous mode on a lab node, one lab per kube-proxy mode shared by
//! every case: `--all-services` traces and names two Services, a Service
//! created during the run (from its first connection after the next rules
//! re-read) and stops tracing one that was removed; `--metrics-addr` is
//! scraped, checked with `promtool check metrics` and against the flows
//! made (N curls = N ok flows of that Service, a Service without endpoints
//! = its cause counter); `--write` rotation keeps the right number of
//! files, each readable by `nattrace analyze`. The nftables-mode run is
//! the DaemonSet's (`--hide-ok`): no line for an `ok` flow, the same
//! counters, the failed flows printed. Needs root.
use std::{
    collections::BTreeMap,
    io::Write as _,
    net::{Ipv4Addr, TcpListener},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use lab::{
    Protocol, ProxyMode, ServiceSpec, both_modes, build_lab,
    presets::{self, BACKEND_POD, CLIENT_POD, NODE_A, WEB_PORT, WEB_SERVICE_IP},
    tracer::{Nattrace, nattrace, tracing_lock},
};

macro_rules! require_root {
    () => {
        if lab::skip_without_root(
            "continuous-mode tests need root (network namespaces, eBPF); \
             run `sudo cargo test -p nattrace-tests --test watch`",
        ) {
            return;
        }
    };
}

const API_IP: Ipv4Addr = Ipv4Addr::new(100, 67, 30, 140);
const LATE_IP: Ipv4Addr = Ipv4Addr::new(100, 67, 30, 150);
const EMPTY_IP: Ipv4Addr = Ipv4Addr::new(100, 67, 30, 160);

fn service(name: &str, ip: Ipv4Addr) -> ServiceSpec {
    ServiceSpec::new("default", name, "http", ip, WEB_PORT, Protocol::Tcp)
}

/// A free port on the root namespace's loopback, where nattrace (which
/// runs here and enters the node's namespace only to attach) serves.
fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    l.local_addr().expect("local addr").port()
}

fn scrape(port: u16) -> String {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "5"])
        .arg(format!("http://127.0.0.1:{port}/metrics"))
        .output()
        .expect("run curl");
    assert!(out.status.success(), "scrape failed: {out:?}");
    String::from_utf8(out.stdout).expect("utf-8 exposition")
}

/// `metric{labels} value` lines as (metric with labels, value).
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_owned(), v.parse().ok()?))
        })
        .collect()
}

fn flows_total(m: &BTreeMap<String, f64>, service: &str, verdict: &str) -> f64 {
    m.iter()
        .filter(|(k, _)| {
            k.starts_with("nattrace_flows_total{")
                && k.contains(&format!("service=\"{service}\""))
                && k.contains(&format!("verdict=\"{verdict}\""))
        })
        .map(|(_, v)| v)
        .sum()
}

fn gauge(m: &BTreeMap<String, f64>, name: &str) -> f64 {
    m.get(name).copied().unwrap_or(-1.0)
}

/// Waits until the traced-Services gauge says `want`: the rules were
/// re-read and the kernel's filter updated.
fn wait_services(port: u16, want: f64) {
    lab::wait::until_true(
        format_args!("nattrace_services_traced {want}"),
        lab::wait::FAIL_AFTER,
        || gauge(&samples(&scrape(port)), "nattrace_services_traced") == want,
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
}

fn promtool_check(text: &str) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian package prometheus, installed by cargo xtask setup)");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("feed promtool");
    let out = child.wait_with_output().expect("promtool");
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{}{}\n--- exposition\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn curl(lab: &lab::Lab, ip: Ipv4Addr, n: usize, expect_ok: bool) {
    for _ in 0..n {
        let out = lab
            .http_get(CLIENT_POD, ip, WEB_PORT, Duration::from_secs(2))
            .expect("curl");
        assert_eq!(out.status.success(), expect_ok, "curl {ip}: {out:?}");
    }
}

fn rotated(path: &Path, i: usize) -> PathBuf {
    if i == 0 {
        return path.to_owned();
    }
    PathBuf::from(format!("{}.{i}", path.display()))
}

fn continuous(mode: ProxyMode) {
    // deploy/daemonset.yaml's flag, in one of the two modes.
    let hide_ok = mode == ProxyMode::Nftables;
    let _guard = tracing_lock();
    let mut spec = presets::seed000(presets::Seed000::default())
        .service(service("api", API_IP).endpoint(BACKEND_POD, WEB_PORT))
        .service(service("empty", EMPTY_IP));
    spec.kube_proxy.mode = mode;
    let mut lab = build_lab(spec);
    let node = lab.node_netns(NODE_A).expect("node netns").path();
    let dir = std::env::temp_dir().join(format!(
        "nattrace-watch-{}-{}",
        std::process::id(),
        mode as u8
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let rec = dir.join("trace.rec");
    let port = free_port();
    let keep = 3;
    let mut args: Vec<String> = [
        "--all-services",
        "--rules-interval",
        "0.5",
        "--netns",
        node.to_str().expect("utf-8 path"),
        "--output",
        "json",
        "--reply-timeout",
        "1000",
        "--metrics-addr",
        &format!("127.0.0.1:{port}"),
        "--write",
        rec.to_str().expect("utf-8 path"),
        // Each rotated file starts with the header (about 10 KB since the
        // node checks and north-south rules joined it): room for a few KB
        // of events per file, so this run's traffic fills `keep` files.
        "--write-max-mb",
        "0.014",
        "--write-keep",
        &keep.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if hide_ok {
        args.push("--hide-ok".into());
    }
    let bin = nattrace();
    let mut tracer = Nattrace::spawn(&bin, &args, &[], false).expect("start nattrace");
    tracer
        .wait_started(Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{e:#}"));
    // web, api, empty: one port each.
    wait_services(port, 3.0);

    curl(&lab, WEB_SERVICE_IP, 3, true);
    curl(&lab, API_IP, 2, true);
    curl(&lab, EMPTY_IP, 1, false);

    // Created while tracing: traced from the first connection after the re-read.
    lab.add_service(service("late", LATE_IP).endpoint(BACKEND_POD, WEB_PORT))
        .expect("add a Service");
    wait_services(port, 4.0);
    curl(&lab, LATE_IP, 1, true);

    // Removed: its rules go, so does tracing (curl now fails: no DNAT).
    lab.remove_service(API_IP, WEB_PORT)
        .expect("remove a Service");
    wait_services(port, 3.0);
    let _ = lab.http_get(CLIENT_POD, API_IP, WEB_PORT, Duration::from_millis(500));

    // The last verdicts decided (reply timeout 1 s, stale-endpoint hold
    // 3.5 s): the counters the test expects. A connection to the removed
    // Service that was wrongly traced still shows in the flows printed at
    // exit, checked below.
    let decided = |m: &BTreeMap<String, f64>| {
        let by = |svc: &str, v: &str| flows_total(m, svc, v);
        by("default/web:http", "ok") >= 3.0
            && by("default/api:http", "ok") >= 2.0
            && by("default/late:http", "ok") >= 1.0
            && m.iter().any(|(k, v)| {
                k.starts_with("nattrace_flows_total{")
                    && k.contains("service=\"default/empty:http\"")
                    && *v >= 1.0
            })
    };
    lab::wait::until_true("every flow counted", lab::wait::FAIL_AFTER, || {
        decided(&samples(&scrape(port)))
    })
    .unwrap_or_else(|e| panic!("{e:#}\n{}", scrape(port)));
    let text = scrape(port);
    promtool_check(&text);
    documented_metrics_are_served(&text);
    // Prometheus asks for OpenMetrics, and gets it.
    let om = Command::new("curl")
        .args(["-sS", "--max-time", "5", "-H"])
        .arg("Accept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5")
        .arg(format!("http://127.0.0.1:{port}/metrics"))
        .output()
        .expect("curl");
    let om = String::from_utf8_lossy(&om.stdout);
    assert!(om.ends_with("# EOF\n"), "{om}");
    assert!(om.contains("# TYPE nattrace_flows counter"), "{om}");
    let m = samples(&text);
    let by = |svc: &str, v: &str| flows_total(&m, svc, v);
    assert_eq!(by("default/web:http", "ok"), 3.0, "{text}");
    assert_eq!(by("default/api:http", "ok"), 2.0, "{text}");
    assert_eq!(by("default/late:http", "ok"), 1.0, "{text}");
    let empty_cause: f64 = m
        .iter()
        .filter(|(k, _)| {
            k.starts_with("nattrace_flows_total{")
                && k.contains("service=\"default/empty:http\"")
                && k.contains("cause=\"no_endpoints\"")
        })
        .map(|(_, v)| v)
        .sum();
    assert_eq!(empty_cause, 1.0, "{text}");
    assert_eq!(gauge(&m, "nattrace_lost_events_total"), 0.0, "{text}");
    assert!(gauge(&m, "nattrace_kernel_events_total") > 0.0, "{text}");
    assert_eq!(
        gauge(&m, "nattrace_backend_info{backend=\"netfilter\"}"),
        1.0,
        "{text}"
    );
    assert!(
        m.keys()
            .any(|k| k.starts_with("nattrace_tc_interfaces{") && k.contains("state=\"attached\"")),
        "{text}"
    );

    tracer.terminate();
    let done = tracer
        .wait(Duration::from_secs(20))
        .expect("nattrace exits");
    let flows = done
        .flows()
        .unwrap_or_else(|e| panic!("{e:#}\n{}", done.describe()));
    let named = |name: &str| {
        flows
            .iter()
            .filter(|f| f["k8s_service"] == name)
            .collect::<Vec<_>>()
    };
    // With --hide-ok the ok flows are counted (metrics above, summary
    // below) but not printed; the failed one is printed either way.
    let shown = if hide_ok { 0 } else { 1 };
    assert_eq!(
        named("default/web:http").len(),
        3 * shown,
        "{}",
        done.describe()
    );
    assert_eq!(
        named("default/api:http").len(),
        2 * shown,
        "{}",
        done.describe()
    );
    assert_eq!(
        named("default/late:http").len(),
        shown,
        "{}",
        done.describe()
    );
    for f in named("default/web:http")
        .into_iter()
        .chain(named("default/late:http"))
    {
        assert_eq!(f["verdict"], "ok", "{f}");
    }
    let empty = named("default/empty:http");
    assert_eq!(empty.len(), 1, "{}", done.describe());
    assert_ne!(empty[0]["verdict"], "ok", "{}", done.describe());
    let summary = done
        .stdout
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["kind"] == "summary")
        .unwrap_or_else(|| panic!("a summary object: {}", done.describe()));
    assert_eq!(summary["by_verdict"]["ok"], 6, "{summary}");
    assert_eq!(done.status.code(), Some(1), "{}", done.describe());
    // The connection made after its removal is not traced: it would be a
    // failed flow, printed whatever --hide-ok says.
    let api_flows = flows
        .iter()
        .filter(|f| f["service"] == format!("{API_IP}:{WEB_PORT}"))
        .count();
    assert_eq!(api_flows, 2 * shown, "{}", done.describe());
    let stderr = &done.stderr;
    assert!(
        stderr.contains("every Service") || stderr.contains("tracing all"),
        "{stderr}"
    );

    // Rotation: exactly `keep` files, each a recording analyze reads alone.
    for i in 0..keep {
        let file = rotated(&rec, i);
        assert!(file.exists(), "{} missing", file.display());
        let out = Command::new(&bin)
            .args(["analyze", "--output", "json"])
            .arg(&file)
            .output()
            .expect("run analyze");
        let code = out.status.code();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            matches!(code, Some(0 | 1)),
            "analyze {}: {code:?}\n{stdout}\n{}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout
                .lines()
                .last()
                .is_some_and(|l| l.contains("\"summary\"")),
            "{stdout}"
        );
        // Older files end where the next one begins, and say so.
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            i > 0,
            stderr.contains("rotated at"),
            "{}: {stderr}",
            file.display()
        );
    }
    assert!(!rotated(&rec, keep).exists(), "more than {keep} files kept");
    let _ = std::fs::remove_dir_all(&dir);
}

both_modes!(continuous: root_all_services_metrics_and_rotation, root_all_services_metrics_and_rotation_nft);

/// The README, docs/METRICS.md and the DaemonSet's alert rules name metrics
/// a user will alert on: each must be one this build serves.
fn documented_metrics_are_served(exposition: &str) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let served: std::collections::BTreeSet<&str> = exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    for doc in ["README.md", "docs/METRICS.md", "deploy/daemonset.yaml"] {
        let text = std::fs::read_to_string(root.join(doc)).expect(doc);
        for (at, _) in text.match_indices("nattrace_") {
            let name: String = text[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            // `nattrace_version` is a recording field; `nattrace_` alone is a prefix.
            if name == "nattrace_" || name == "nattrace_version" {
                continue;
            }
            let family = name.strip_suffix("_total").unwrap_or(&name);
            assert!(
                served.contains(name.as_str()) || served.contains(family),
                "{doc} names metric {name}, which nattrace does not serve:\n{exposition}"
            );
        }
    }
}
