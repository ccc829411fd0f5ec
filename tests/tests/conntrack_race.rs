//! Issue 22: the "5-second DNS timeout" race (kubernetes/kubernetes#56903)
//! tried for real on this kernel. glibc sends the A and AAAA queries of one
//! lookup from one UDP socket at once; when the two packets are handled on
//! two CPUs, both create a conntrack entry for the same tuple, both are
//! DNATed (possibly to different endpoints), and the second to reach
//! `__nf_conntrack_confirm` finds the first: before Linux 4.19/5.6 it was
//! dropped (`insert_failed`), the lookup waited 5 s for a retry.
//!
//! Since then the clash is resolved instead (net/netfilter/nf_conntrack_core.c):
//! `__nf_ct_resolve_clash` lets the loser use the winner's entry when both
//! were NATed alike (ed07d9a021df, "netfilter: nf_conntrack: resolve clash
//! for matching conntracks", 4.19), and `nf_ct_resolve_clash_harder`
//! inserts the loser's entry in the reply direction only, with a 1 s fixed
//! timeout and IPS_NAT_CLASH, when the two picked different endpoints
//! (6a757c07e51f, "netfilter: conntrack: allow insertion of clashing
//! entries", 5.6). Either way `clash_resolve` rises instead of
//! `insert_failed`, and the packet goes on.
//!
//! The test sends the two queries from two threads sharing one socket, to
//! a Service with two endpoints picked at random, for many rounds, and
//! checks that every round that lost an answer is accounted for by
//! conntrack's own counters in the node namespace; it prints how often the
//! clash happened and how it ended.
use std::time::Duration;

use lab::presets;
use lab::{
    KubeProxyConfig, Lab, LabSpec, NodeSpec, PodSpec, Protocol, ProxyMode, ServiceSpec, build_lab,
};

macro_rules! require_root {
    () => {
        if lab::skip_without_root(
            "conntrack race tests need root (network namespaces); \
             run `sudo cargo test -p nattrace-tests --test conntrack_race` or in CI",
        ) {
            return;
        }
    };
}

const DNS_2_POD: &str = "coredns-2";
const DNS_2_IP: std::net::Ipv4Addr = std::net::Ipv4Addr::new(100, 96, 54, 11);
const ROUNDS: usize = 400;

fn spec() -> LabSpec {
    let node = NodeSpec::new(presets::NODE_A, presets::NODE_A_POD_CIDR)
        .pod(PodSpec::new(presets::CLIENT_POD, presets::CLIENT_IP))
        .pod(PodSpec::new(presets::DNS_POD, presets::DNS_POD_IP).dns(
            53,
            presets::DNS_NAME,
            presets::WEB_SERVICE_IP,
        ))
        .pod(PodSpec::new(DNS_2_POD, DNS_2_IP).dns(53, presets::DNS_NAME, presets::WEB_SERVICE_IP));
    // Not pinned: kube-proxy's random choice, so the two packets of a
    // round may pick different endpoints (the case 6a757c07e51f handles).
    let dns = ServiceSpec::new(
        "kube-system",
        "kube-dns",
        "dns",
        presets::DNS_SERVICE_IP,
        53,
        Protocol::Udp,
    )
    .endpoint(presets::DNS_POD, 53)
    .endpoint(DNS_2_POD, 53);
    let mut spec = LabSpec::new(vec![node]).service(dns);
    spec.kube_proxy = KubeProxyConfig {
        cluster_cidr: Some(presets::CLUSTER_CIDR),
        mode: ProxyMode::Iptables,
        ..KubeProxyConfig::default()
    };
    spec
}

/// insert_failed, drop, clash_resolve of the node namespace, summed over CPUs.
fn counters(lab: &Lab) -> [u64; 3] {
    let text = lab
        .run(presets::NODE_A, &["cat", "/proc/net/stat/nf_conntrack"])
        .expect("reading /proc/net/stat/nf_conntrack in the node");
    let mut lines = text.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    let col = |n: &str| header.iter().position(|h| *h == n);
    let cols = [col("insert_failed"), col("drop"), col("clashres")];
    let mut sums = [0u64; 3];
    for line in lines {
        let cells: Vec<&str> = line.split_whitespace().collect();
        for (k, c) in cols.iter().enumerate() {
            if let Some(v) = c
                .and_then(|c| cells.get(c))
                .and_then(|v| u64::from_str_radix(v, 16).ok())
            {
                sums[k] += v;
            }
        }
    }
    sums
}

/// Two threads, one socket, the two queries released together; prints
/// `rounds lost` (rounds that did not get both answers within 1 s).
const RACE: &str = r#"
import socket, struct, sys, threading
svc, name, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
def query(qid, qtype):
    q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode()
    return q + b"\0" + struct.pack(">HH", qtype, 1)
lost = 0
for r in range(rounds):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", 0))
    s.settimeout(1.0)
    go = threading.Barrier(2)
    def send(q):
        go.wait()
        s.sendto(q, (svc, 53))
    qs = [query((2 * r) & 0xffff, 1), query((2 * r + 1) & 0xffff, 28)]
    ts = [threading.Thread(target=send, args=(q,)) for q in qs]
    for t in ts: t.start()
    for t in ts: t.join()
    got = 0
    try:
        while got < 2:
            s.recv(512)
            got += 1
    except socket.timeout:
        lost += 1
    s.close()
print(rounds, lost)
"#;

#[test]
fn root_dns_race_two_threads_one_socket_is_resolved_or_counted() {
    require_root!();
    let lab = build_lab(spec());
    let before = counters(&lab);
    let rounds = ROUNDS.to_string();
    let out = lab
        .exec_timeout(
            presets::CLIENT_POD,
            &[
                "python3",
                "-c",
                RACE,
                &presets::DNS_SERVICE_IP.to_string(),
                presets::DNS_NAME,
                &rounds,
            ],
            Duration::from_secs(600),
        )
        .expect("running the race");
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{printed}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut it = printed
        .split_whitespace()
        .map(|n| n.parse::<u64>().unwrap());
    let (done, lost) = (it.next().unwrap(), it.next().unwrap());
    let after = counters(&lab);
    let rise = |k: usize| after[k] - before[k];
    let (insert_failed, dropped, clash_resolve) = (rise(0), rise(1), rise(2));
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    println!(
        "DNS race on {}: {done} rounds, {lost} lost an answer; conntrack: clash_resolve +{clash_resolve}, insert_failed +{insert_failed}, drop +{dropped}",
        kernel.trim()
    );
    assert_eq!(done, ROUNDS as u64);
    // Every lost answer is conntrack's doing and counted, or none is lost.
    assert!(
        lost <= insert_failed + dropped,
        "{lost} rounds lost an answer that conntrack's counters do not explain"
    );
}
