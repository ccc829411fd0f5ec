//! nattrace on a node that is not empty: other netfilter hooks at every
//! priority it would pick (iptables filter/mangle tables, an nft table, a
//! second nattrace), and rules reloaded while it traces. Since 6.4 a BPF
//! netfilter link may not share a priority with any hook already there
//! (net/netfilter/core.c, nf_hook_entries_grow: -EBUSY), so nattrace must
//! find free priorities inside each observation point's window and still
//! decide every flow right; and it must not disturb the node's own rules.

use std::collections::BTreeSet;

use lab::Lab;
use lab::presets::{self, Backend, Seed000};
use lab::tracer::{Finished, Nattrace, nattrace, tracing_lock};
use serde_json::Value;

use super::{ATTACH_TIMEOUT, args, build_lab, cleanup::node_state, curls, flows, ports, web_svc};

/// kube-proxy's iptables-mode filter table (pkg/proxy/iptables/proxier.go:
/// the jumps from the built-in chains and KUBE-FORWARD, without nfacct),
/// kubelet's canary chain: hooks at priority 0 on INPUT, FORWARD, OUTPUT.
const FILTER: &str = r#"*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-SERVICES - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A INPUT -j KUBE-FIREWALL
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -j KUBE-FIREWALL
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
COMMIT
"#;

/// The mangle canaries of kube-proxy and kubelet, with the built-in chains
/// a CNI's mangle rules (Calico's cali-PREROUTING) bring: priority -150 on
/// all five hooks.
const MANGLE: &str = r#"*mangle
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-IPTABLES-HINT - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:cali-PREROUTING - [0:0]
-A PREROUTING -m comment --comment "cali:6gwbT8clXdHdC1b1" -j cali-PREROUTING
COMMIT
"#;

/// (hook, priority) of every default nattrace would use, its old fixed
/// priorities, and kube-proxy nftables mode's filter chains (-110, -90).
const BUSY: &[(&str, i32)] = &[
    ("prerouting", -175),
    ("prerouting", -110),
    ("prerouting", -99),
    ("output", -175),
    ("output", -110),
    ("output", -99),
    ("output", -90),
    ("forward", -175),
    ("forward", -110),
    ("postrouting", 99),
    ("postrouting", 101),
    ("input", -110),
    ("input", 99),
    ("input", 101),
];

/// An nft table with one empty accepting base chain per (hook, priority).
fn nft_table(name: &str, chains: &[(&str, i32)]) -> String {
    let mut text = format!("table ip {name} {{\n");
    for (i, (hook, priority)) in chains.iter().enumerate() {
        text.push_str(&format!(
            "  chain c{i} {{ type filter hook {hook} priority {priority}; policy accept; }}\n"
        ));
    }
    text.push_str("}\n");
    text
}

/// Feeds `text` to `cmd` (a restore command taking a file) in node-a.
fn load(lab: &Lab, cmd: &[&str], text: &str) {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("nattrace-rules-{}-{n}", std::process::id()));
    std::fs::write(&path, text).expect("writing rules");
    let path_arg = path.display().to_string();
    let mut argv = cmd.to_vec();
    argv.push(&path_arg);
    let result = lab.run(presets::NODE_A, &argv);
    let _ = std::fs::remove_file(&path);
    result.unwrap_or_else(|e| panic!("{argv:?} failed: {e:#}\n{text}"));
}

/// The lab's node with a real node's filter and mangle tables and an nft
/// table sitting on every default priority.
fn busy_node(bridge_nf_call_iptables: bool) -> Lab {
    let lab = build_lab(presets::seed000(Seed000 {
        bridge_nf_call_iptables,
        backend: Backend::SameNode,
    }));
    load(
        &lab,
        &["iptables-restore", "-w", "5", "--noflush"],
        &format!("{FILTER}{MANGLE}"),
    );
    load(&lab, &["nft", "-f"], &nft_table("busy", BUSY));
    let ruleset = lab
        .run(presets::NODE_A, &["nft", "list", "ruleset"])
        .expect("nft list ruleset");
    for needle in [
        "hook forward priority filter",
        "hook prerouting priority mangle",
        "hook forward priority -175",
        "hook postrouting priority srcnat - 1",
        "KUBE-FORWARD",
    ] {
        assert!(ruleset.contains(needle), "{needle} missing:\n{ruleset}");
    }
    lab
}

/// Starts nattrace and returns it with its JSON start line.
fn start_json(args: &[String], envs: &[(&str, &str)]) -> (Nattrace, Value) {
    start_json_with(&nattrace(), args, envs)
}

fn start_json_with(
    bin: &std::path::Path,
    args: &[String],
    envs: &[(&str, &str)],
) -> (Nattrace, Value) {
    let mut t = Nattrace::spawn(bin, args, envs, false).expect("starting nattrace");
    let first = t
        .wait_started(ATTACH_TIMEOUT)
        .unwrap_or_else(|e| panic!("{e:#}"));
    let start: Value =
        serde_json::from_str(&first).unwrap_or_else(|e| panic!("not JSON ({e}): {first}"));
    assert_eq!(start["kind"], "start", "{first}");
    (t, start)
}

/// The one child of process `pid` (`/proc/PID/task/PID/children`).
fn only_child(pid: u32) -> Option<u32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).ok()?;
    let mut kids = text.split_whitespace().filter_map(|p| p.parse().ok());
    let first = kids.next()?;
    kids.next().is_none().then_some(first)
}

/// point → (priority, default) from a start line.
fn priorities(start: &Value) -> Vec<(String, i64, i64)> {
    start["nf_priorities"]
        .as_array()
        .unwrap_or_else(|| panic!("no nf_priorities: {start}"))
        .iter()
        .map(|p| {
            (
                p["point"].as_str().unwrap().to_owned(),
                p["priority"].as_i64().unwrap(),
                p["default"].as_i64().unwrap(),
            )
        })
        .collect()
}

/// The priority range a point must stay in, from the kernel's landmarks
/// (conntrack -200, DNAT -100, filter 0, SNAT 100, helper 300), exclusive.
fn landmarks(point: &str) -> (i64, i64) {
    match point {
        p if p.ends_with("before DNAT") => (-200, -100),
        p if p.ends_with("after DNAT") => (-100, 0),
        "FORWARD" => (-200, 0),
        p if p.ends_with("before SNAT") => (0, 100),
        p if p.ends_with("after SNAT") => (100, 300),
        other => panic!("unknown observation point {other}"),
    }
}

fn nft_hook(point: &str) -> &'static str {
    match point.split(' ').next().unwrap() {
        "PREROUTING" => "prerouting",
        "OUTPUT" => "output",
        "FORWARD" => "forward",
        "POSTROUTING" => "postrouting",
        "INPUT" => "input",
        other => panic!("unknown hook {other}"),
    }
}

fn assert_between_landmarks(prios: &[(String, i64, i64)], start: &Value) {
    // One after each NAT hook's rewrite that reports both sides of it
    // (PREROUTING, OUTPUT, POSTROUTING, INPUT: this kernel has
    // nf_conntrack's BTF, probes/table.rs `NatPoints`), and FORWARD.
    assert_eq!(prios.len(), 5, "five netfilter points: {start}");
    for (point, priority, _) in prios {
        let (lo, hi) = landmarks(point);
        assert!(
            lo < *priority && *priority < hi,
            "{point} at {priority} left ({lo}, {hi}): {start}"
        );
    }
}

/// Same-node curls through the Service while nattrace traces.
fn curl_web(lab: &Lab, local_ports: &[u16]) -> usize {
    curls(lab, presets::WEB_SERVICE_IP, presets::WEB_PORT, local_ports)
}

/// (client, verdict, backend, cause) of every flow.
fn flow_keys(done: &Finished) -> BTreeSet<(String, String, String, String)> {
    flows(done)
        .iter()
        .map(|f| {
            let s = |k: &str| f[k].as_str().unwrap_or("").to_owned();
            (s("client"), s("verdict"), s("backend"), s("cause"))
        })
        .collect()
}

/// Every flow of `done` is one of `ports`' curls with `verdict` (and the
/// seed-000 cause when broken), to the same-node backend.
fn assert_seed000_flows(done: &Finished, local_ports: &[u16], broken: bool) {
    let expected: BTreeSet<_> = local_ports
        .iter()
        .map(|p| {
            (
                format!("{}:{p}", presets::CLIENT_IP),
                if broken {
                    "reply_not_reverse_nated"
                } else {
                    "ok"
                }
                .to_owned(),
                format!("{}:{}", presets::BACKEND_IP, presets::WEB_PORT),
                if broken {
                    "bridge_nf_call_iptables_off"
                } else {
                    ""
                }
                .to_owned(),
            )
        })
        .collect();
    assert_eq!(flow_keys(done), expected, "{}", done.describe());
    assert_eq!(
        done.status.code(),
        Some(if broken { 1 } else { 0 }),
        "{}",
        done.describe()
    );
}

#[test]
fn root_attaches_beside_hooks_at_every_default_priority_and_verdicts_hold() {
    require_root!();
    let _lock = tracing_lock();
    for (broken, base) in [(true, 46000), (false, 46100)] {
        let lab = busy_node(!broken);
        let local_ports = ports(base, 4);
        let (mut t, start) =
            start_json(&args(&lab, &[web_svc()], &["--reply-timeout", "1000"]), &[]);
        let prios = priorities(&start);
        assert_between_landmarks(&prios, &start);
        let busy: BTreeSet<(&str, i64)> = BUSY.iter().map(|(h, p)| (*h, i64::from(*p))).collect();
        for (point, priority, default) in &prios {
            assert_ne!(priority, default, "{point}: its default is taken: {start}");
            assert!(
                !busy.contains(&(nft_hook(point), *priority))
                    && *priority != -150
                    && *priority != 0,
                "{point} at a taken priority {priority}: {start}"
            );
        }
        let got = curl_web(&lab, &local_ports);
        assert_eq!(got, if broken { 0 } else { local_ports.len() });
        let done = t
            .finish_after_flows(local_ports.len())
            .unwrap_or_else(|e| panic!("{e:#}"));
        assert_seed000_flows(&done, &local_ports, broken);

        if broken {
            // The text start line names the priorities that moved.
            let mut text_args = args(&lab, &[web_svc()], &["--duration", "1"]);
            let i = text_args.iter().position(|a| a == "json").unwrap();
            text_args[i] = "text".into();
            let mut t = Nattrace::spawn(&nattrace(), &text_args, &[], false).expect("spawn");
            let first = t
                .wait_started(ATTACH_TIMEOUT)
                .unwrap_or_else(|e| panic!("{e:#}"));
            let _ = t.wait(ATTACH_TIMEOUT);
            for (point, priority, default) in &prios {
                let said = format!("{point} {priority} (default {default} taken)");
                assert!(first.contains(&said), "{said} not in: {first}");
            }
        }
    }
}

#[test]
fn root_two_instances_on_one_node_report_the_same_flows() {
    require_root!();
    let _lock = tracing_lock();
    for (mode, envs, base) in [
        ("tcx", &[][..], 47000),
        ("clsact", &[("NATTRACE_FORCE_CLSACT", "1")][..], 47100),
    ] {
        let lab = busy_node(false);
        let before = node_state(&lab);
        let local_ports = ports(base, 4);
        let extra = |secs: &'static str| ["--duration", secs, "--reply-timeout", "1000"];
        // The first is stopped by SIGTERM once the traffic is done, not by a
        // --duration: on a loaded machine the second's start alone can take
        // seconds, and a first that had already left would free its
        // priorities for the second and see none of the flows.
        let (mut first, first_start) = start_json(&args(&lab, &[web_svc()], &extra("60")), envs);
        // The second one's leftover cleanup runs while the first traces,
        // from another PID namespace (another container on the node): it
        // cannot see the first one's process, only its claim (cleanup.rs).
        let mut in_container: Vec<String> = ["--pid", "--fork", "--mount-proc"]
            .map(String::from)
            .to_vec();
        in_container.push(nattrace().display().to_string());
        in_container.extend(args(&lab, &[web_svc()], &extra("60")));
        let (mut second, second_start) =
            start_json_with(std::path::Path::new("unshare"), &in_container, envs);
        let (a, b) = (priorities(&first_start), priorities(&second_start));
        assert_between_landmarks(&b, &second_start);
        for ((point, pa, _), (_, pb, _)) in a.iter().zip(&b) {
            assert_ne!(pa, pb, "{mode}: {point} shared by two BPF hooks");
        }
        assert_eq!(
            curl_web(&lab, &local_ports),
            0,
            "{mode}: seed 000 is broken"
        );
        // Both decided every connection (a stop before its reply timeout
        // would cut them short).
        for t in [&mut first, &mut second] {
            t.wait_flows(local_ports.len(), lab::wait::FAIL_AFTER)
                .unwrap_or_else(|e| panic!("{mode}: {e:#}"));
        }
        // The first (which created the clsact qdiscs) leaves first: the
        // qdiscs stay for the second's filters, and the second, leaving
        // last, removes them.
        first.terminate();
        let first = first
            .wait(ATTACH_TIMEOUT)
            .unwrap_or_else(|e| panic!("{e:#}"));
        if mode == "clsact" {
            let still = lab
                .run(
                    presets::NODE_A,
                    &["tc", "filter", "show", "dev", "cni0", "ingress"],
                )
                .unwrap_or_default();
            assert!(
                still.contains("tc_ingress"),
                "the first instance's exit removed the second's filters:\n{still}"
            );
        }
        // unshare does not pass SIGTERM on: signal the nattrace it forked.
        let in_ns = lab::wait::until("the nattrace unshare forked", lab::wait::FAIL_AFTER, || {
            only_child(second.pid())
        })
        .unwrap();
        unsafe { libc::kill(in_ns as i32, libc::SIGTERM) };
        let second = second
            .wait(ATTACH_TIMEOUT)
            .unwrap_or_else(|e| panic!("{e:#}"));
        assert!(
            !second
                .stderr
                .contains("removed what a killed nattrace left"),
            "{mode}: the second instance took the first one's filters for leftovers:\n{}",
            second.describe()
        );
        assert_seed000_flows(&first, &local_ports, true);
        assert_seed000_flows(&second, &local_ports, true);
        assert_eq!(
            node_state(&lab),
            before,
            "{mode}: the node changed after both exited"
        );
    }
}

#[test]
fn root_rules_restored_after_attach_neither_break_nor_are_broken() {
    require_root!();
    let _lock = tracing_lock();
    for (broken, base) in [(false, 48000), (true, 48100)] {
        let lab = build_lab(presets::seed000(Seed000 {
            bridge_nf_call_iptables: !broken,
            backend: Backend::SameNode,
        }));
        let nat = lab.iptables_save(presets::NODE_A).expect("iptables-save");
        let local_ports = ports(base, 4);
        let (mut t, start) =
            start_json(&args(&lab, &[web_svc()], &["--reply-timeout", "1000"]), &[]);
        let prios = priorities(&start);
        // kube-proxy's resync: whole tables rewritten (nat flushed and
        // reloaded, filter and mangle created), and another tool's nft
        // chains at exactly nattrace's priorities, which the kernel allows
        // for ordinary hooks.
        load(
            &lab,
            &["iptables-restore", "-w", "5"],
            &format!("{FILTER}{MANGLE}{nat}"),
        );
        let same: Vec<(&str, i32)> = prios
            .iter()
            .map(|(point, priority, _)| (nft_hook(point), *priority as i32))
            .collect();
        load(&lab, &["nft", "-f"], &nft_table("late", &same));
        let got = curl_web(&lab, &local_ports);
        assert_eq!(
            got,
            if broken { 0 } else { local_ports.len() },
            "curl through the Service (broken: {broken})"
        );
        let done = t
            .finish_after_flows(local_ports.len())
            .unwrap_or_else(|e| panic!("{e:#}"));
        assert_seed000_flows(&done, &local_ports, broken);
    }
}

/// clsact mode (kernels < 6.6): on exit nattrace removes only its own
/// filters, and the clsact qdisc it created only when nothing else is on it.
#[test]
fn root_clsact_exit_keeps_a_filter_added_mid_run() {
    require_root!();
    let _lock = tracing_lock();
    let lab = build_lab(presets::seed000(Seed000::default()));
    let dev = "cni0";
    let show = |lab: &Lab| {
        lab.run(
            presets::NODE_A,
            &["tc", "filter", "show", "dev", dev, "ingress"],
        )
        .unwrap_or_default()
    };
    let (mut t, _) = start_json(
        &args(&lab, &[web_svc()], &[]),
        &[("NATTRACE_FORCE_CLSACT", "1")],
    );
    assert!(show(&lab).contains("tc_ingress"), "{}", show(&lab));
    // Another tool's filter, added while nattrace runs (classic BPF; no
    // actions: the lab kernel may lack the act_* modules).
    lab.run(
        presets::NODE_A,
        &[
            "tc",
            "filter",
            "add",
            "dev",
            dev,
            "ingress",
            "prio",
            "7",
            "handle",
            "7",
            "bpf",
            "bytecode",
            "1,6 0 0 4294967295,",
        ],
    )
    .expect("foreign filter");
    // Stopped once the foreign filter is in (a --duration could end first).
    t.terminate();
    let done = t.wait(ATTACH_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    // No traffic to the traced Service in this test: 4 (README).
    assert_eq!(done.status.code(), Some(4), "{}", done.describe());
    let left = show(&lab);
    assert!(left.contains("bytecode"), "foreign filter gone:\n{left}");
    assert!(
        !left.contains("tc_ingress"),
        "nattrace's filter left:\n{left}"
    );
    let qdiscs = lab
        .run(presets::NODE_A, &["tc", "qdisc", "show", "dev", dev])
        .unwrap();
    assert!(
        qdiscs.contains("clsact"),
        "the clsact holding it went:\n{qdiscs}"
    );
    // Other interfaces: nattrace's clsact qdiscs are gone.
    let all = lab.run(presets::NODE_A, &["tc", "qdisc", "show"]).unwrap();
    assert_eq!(
        all.matches("clsact").count(),
        1,
        "only cni0 keeps a clsact:\n{all}"
    );
}

/// A window with every priority taken (OUTPUT -99..=-1, where nattrace looks
/// after DNAT): one line naming the hook and range, exit 2, nothing left
/// attached. This kernel has no kprobes, so `auto` has nothing to fall back to.
#[test]
fn root_a_full_window_is_one_line_and_exit_2() {
    require_root!();
    let _lock = tracing_lock();
    let lab = build_lab(presets::seed000(Seed000::default()));
    let full: Vec<(&str, i32)> = (-99..=-1).map(|p| ("output", p)).collect();
    load(&lab, &["nft", "-f"], &nft_table("full", &full));
    let before = node_state(&lab);
    let mut t = Nattrace::spawn(
        &nattrace(),
        &args(&lab, &[web_svc()], &["--duration", "1"]),
        &[],
        false,
    )
    .expect("spawn");
    let done = t.wait(ATTACH_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(done.status.code(), Some(2), "{}", done.describe());
    assert!(done.stdout.is_empty(), "{}", done.describe());
    let lines: Vec<&str> = done.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{}", done.describe());
    assert!(
        lines[0].contains("every netfilter priority from -99 to -1 at OUTPUT is taken"),
        "{}",
        lines[0]
    );
    assert_eq!(node_state(&lab), before, "a failed start left something");
}

/// Why FORWARD sits before the filter table: a NetworkPolicy-style DROP in
/// filter FORWARD (priority 0) must be reported after the FORWARD hop, on a
/// node whose filter, mangle and nft hooks pushed nattrace off its defaults.
#[test]
fn root_a_filter_forward_drop_is_reported_after_the_forward_hop() {
    require_root!();
    let _lock = tracing_lock();
    let lab = busy_node(true);
    lab.deny_forward_to(
        presets::NODE_A,
        presets::BACKEND_IP,
        presets::WEB_PORT,
        "networkpolicy deny",
    )
    .expect("DROP rule");
    let local_ports = ports(49000, 3);
    let (mut t, _) = start_json(&args(&lab, &[web_svc()], &["--reply-timeout", "1000"]), &[]);
    assert_eq!(curl_web(&lab, &local_ports), 0, "the DROP rule holds");
    let done = t
        .finish_after_flows(local_ports.len())
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(done.status.code(), Some(1), "{}", done.describe());
    let flows = flows(&done);
    assert_eq!(flows.len(), local_ports.len(), "{}", done.describe());
    for f in &flows {
        assert_eq!(f["verdict"], "dropped", "{f}");
        assert_eq!(f["cause"], "dropped_by_netfilter", "{f}");
        assert!(
            f.to_string().contains("after netfilter FORWARD"),
            "the drop is placed after the FORWARD hop: {f}"
        );
    }
}
