//! One program call per veth crossing (issue 25): the receive a veth's
//! transmit leads to is reported by `net_dev_start_xmit`, so on a node
//! whose pods are all veths `netif_receive_skb` is not attached, and the
//! SYN-ACK's arrival in the client's namespace (what an `ok` verdict
//! stands on) is still seen. A pod with a device no transmit reports (a
//! macvlan on the node's uplink) makes nattrace attach it while running,
//! and the same connection then shows the same hops: the tracepoint skips
//! what the transmit reported. A macvlan pod there before the start is
//! found by the start's look, which runs beside the start, not in it.

use std::process::Command;
use std::time::{Duration, Instant};

use lab::presets;
use lab::tracer::{Nattrace, hops, raw_tracepoints};

use super::{ATTACH_TIMEOUT, args, build_lab, start, tracing_lock, web_svc};

const RECEIVE: &str = "netif_receive_skb";

/// A namespace this test creates beside the lab's, removed on drop (also
/// on panic); named after the lab, so a killed run's is swept with it.
struct ExtraNetns(String);

impl ExtraNetns {
    fn create(name: String) -> ExtraNetns {
        ip(&["netns", "add", &name]);
        ExtraNetns(name)
    }
}

impl Drop for ExtraNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("running ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One curl through the Service and its decided flow, as (verdict, the
/// places of its hops).
fn one_flow(lab: &lab::Lab, t: &mut Nattrace, seen: usize) -> (String, Vec<String>) {
    lab.http_get(
        presets::CLIENT_POD,
        presets::WEB_SERVICE_IP,
        presets::WEB_PORT,
        Duration::from_secs(5),
    )
    .expect("curl through the Service");
    t.wait_flows(seen + 1, ATTACH_TIMEOUT)
        .expect("the connection's flow");
    let line = t
        .printed()
        .iter()
        .filter(|l| lab::tracer::is_flow_line(l))
        .nth(seen)
        .expect("a flow line")
        .clone();
    let flow: serde_json::Value = serde_json::from_str(&line).expect("JSON flow");
    let places = hops(&flow)
        .into_iter()
        .map(|h| {
            format!(
                "{} {}{}",
                h.kind,
                h.place,
                if h.node_ns { "" } else { " (pod)" }
            )
        })
        .collect();
    (flow["verdict"].as_str().unwrap_or("").to_owned(), places)
}

#[test]
fn root_receive_tracepoint_only_for_pods_no_transmit_shows() {
    require_root!();
    let lab = build_lab(presets::seed000(presets::Seed000 {
        bridge_nf_call_iptables: true,
        ..Default::default()
    }));
    let _lock = tracing_lock();
    let mut t = start(&args(&lab, &[web_svc()], &[]), &[]);
    let (verdict, before) = one_flow(&lab, &mut t, 0);
    // After a decided flow: the look at the pods' namespaces, which runs
    // in the background from the start, has long finished on three pods.
    let attached = raw_tracepoints(t.pid());
    assert!(
        attached.iter().any(|n| n == "net_dev_start_xmit"),
        "{attached:?}"
    );
    assert!(
        !attached.iter().any(|n| n == RECEIVE),
        "a node of veth pods needs no receive tracepoint: {attached:?}"
    );
    assert_eq!(verdict, "ok", "{before:#?}");
    // The SYN-ACK's receive in the client's namespace, sent by the
    // transmit program of the client's node-side veth.
    assert!(
        before
            .iter()
            .any(|p| p.starts_with("SYN-ACK dev-rx") && p.ends_with("(pod)")),
        "{before:#?}"
    );

    // A macvlan pod: its parent is the node's uplink, its receive no
    // transmit shows.
    let node = lab
        .node_netns(presets::NODE_A)
        .expect("node-a")
        .name()
        .to_owned();
    let pod = ExtraNetns::create(format!("{}-mv", lab.id()));
    ip(&[
        "-n", &node, "link", "add", "mvpod", "link", "eth0", "type", "macvlan", "mode", "bridge",
    ]);
    ip(&["-n", &node, "link", "set", "mvpod", "netns", &pod.0]);
    ip(&["-n", &pod.0, "link", "set", "mvpod", "up"]);
    wait_receive(&t, "added while tracing");

    let (verdict, after) = one_flow(&lab, &mut t, 1);
    assert_eq!(verdict, "ok", "{after:#?}");
    assert_eq!(
        before, after,
        "the receive tracepoint must not report again what the transmit did"
    );
    t.terminate();
    let done = t.wait(ATTACH_TIMEOUT).expect("nattrace exits on SIGTERM");
    assert_eq!(done.status.code(), Some(0), "{}", done.describe());

    // The macvlan pod there at the start: found by the start's look.
    let mut t = start(&args(&lab, &[web_svc()], &[]), &[]);
    wait_receive(&t, "there at the start");
    let (verdict, again) = one_flow(&lab, &mut t, 0);
    assert_eq!(verdict, "ok", "{again:#?}");
    assert_eq!(before, again);
    t.terminate();
    let done = t.wait(ATTACH_TIMEOUT).expect("nattrace exits on SIGTERM");
    assert_eq!(done.status.code(), Some(0), "{}", done.describe());
    assert!(
        done.stderr
            .lines()
            .any(|l| l.contains("now also tracing") && l.contains("mvpod (macvlan)")),
        "the attach after the start is said, naming the device: {}",
        done.stderr
    );
}

/// Waits for the receive tracepoint to be attached for the macvlan pod.
fn wait_receive(t: &Nattrace, when: &str) {
    let deadline = Instant::now() + ATTACH_TIMEOUT;
    while !raw_tracepoints(t.pid()).iter().any(|n| n == RECEIVE) {
        assert!(
            Instant::now() < deadline,
            "the receive tracepoint was not attached for a macvlan pod {when} within {ATTACH_TIMEOUT:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
