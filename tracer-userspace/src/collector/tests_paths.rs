//! Other paths through the node (node-local client, hairpin) and the
//! throughput check.
use tracer_common::{
    direction::{REPLY, REQUEST},
    nat_stage::{AFTER, BEFORE},
    nf_hook::{LOCAL_IN, LOCAL_OUT, POST_ROUTING, PRE_ROUTING},
    tcp_flags,
};

use super::{
    fixtures::*,
    tests::{fixture, only, run},
    *,
};

const MS: u64 = 1_000_000;

#[test]
fn node_local_client_is_ok_at_input() {
    let mut b = Builder::default();
    let node = ([100, 96, 54, 1], 61000);
    let syn = tcp(tcp_flags::SYN, 10, 0, 1, 0x30, REQUEST);
    let t = b.path(
        syn,
        T0,
        &[
            (nf(LOCAL_OUT, BEFORE), node, SVC),
            (nf(LOCAL_OUT, AFTER), node, BACKEND),
            (nf(POST_ROUTING, BEFORE), node, BACKEND),
            (nf(POST_ROUTING, AFTER), node, BACKEND),
            (tc_out(VETH_BACKEND), node, BACKEND),
        ],
    );
    let synack = tcp(tcp_flags::SYN | tcp_flags::ACK, 20, 11, 0, 0x31, REPLY);
    b.path(
        synack,
        t + 50_000,
        &[
            (tc_in(VETH_BACKEND), BACKEND, node),
            (nf(PRE_ROUTING, BEFORE), BACKEND, node),
            (nf(PRE_ROUTING, AFTER), BACKEND, node),
            (nf(LOCAL_IN, BEFORE), BACKEND, node),
            (nf(LOCAL_IN, AFTER), SVC, node),
        ],
    );
    let (reports, _) = run(&b.events, Some(true));
    let r = only(&reports);
    assert_eq!(r.verdict, Verdict::Ok);
    assert!(r.detail.contains("reverse-NATed at INPUT"), "{}", r.detail);
}

#[test]
fn hairpin_with_masquerade_is_ok_and_shows_snat() {
    let mut b = Builder::default();
    let me = CLIENT;
    let me_backend = (CLIENT.0, 80);
    let masq = ([100, 96, 54, 1], 61000);
    let syn = tcp(tcp_flags::SYN, 10, 0, 1, 0x40, REQUEST);
    let t = b.route(
        syn,
        T0,
        &[
            &from_pod(CLIENT_NS, VETH_CLIENT, me, SVC),
            &forwarded(me, SVC, me_backend, masq),
            &to_pod(VETH_CLIENT, CLIENT_NS, masq, me_backend),
        ],
    );
    let synack = tcp(tcp_flags::SYN | tcp_flags::ACK, 20, 11, 0, 0x41, REPLY);
    b.route(
        synack,
        t + 50_000,
        &[
            &from_pod(CLIENT_NS, VETH_CLIENT, me_backend, masq),
            &forwarded(me_backend, masq, me, SVC),
            &to_pod(VETH_CLIENT, CLIENT_NS, SVC, me),
        ],
    );
    let mut c = Collector::new(config(Some(true)));
    for ev in &b.events {
        c.push(*ev);
    }
    let reports = c.tick(T0 + 1_000 * MS);
    let r = only(&reports);
    assert_eq!(r.verdict, Verdict::Ok);
    assert_eq!(r.snat.unwrap().to_string(), "100.96.54.1:61000");
    assert!(r.detail.contains("client masqueraded to 100.96.54.1:61000"));
    assert_eq!(c.take_mute_candidates().len(), 2);
}

/// Rough throughput and memory check (the benchmark wants ≥ 2M events/s on
/// one core): `cargo test --release -p tracer-userspace --lib -- --ignored throughput --nocapture`.
#[test]
#[ignore]
fn throughput() {
    let template = fixture("seed000_healthy.jsonl");
    let flows = 100_000u32;
    let mut events = Vec::with_capacity(template.len() * flows as usize);
    for i in 0..flows {
        let port = 1024 + (i % 60_000) as u16;
        let host = (i / 60_000) as u8;
        for e in &template {
            let mut e = *e;
            e.ts_ns += u64::from(i) * 10_000;
            e.skb += u64::from(i) << 16;
            for (addr, p) in [(&mut e.saddr, &mut e.sport), (&mut e.daddr, &mut e.dport)] {
                if *addr == tracer_common::v4_mapped(CLIENT.0) && *p == CLIENT.1 {
                    *p = port;
                    let mut client = CLIENT.0;
                    client[2] = host;
                    *addr = tracer_common::v4_mapped(client);
                }
            }
            events.push(e);
        }
    }
    // What the ring buffer delivers: sorted but for a little cross-CPU skew.
    events.sort_by_key(|e| e.ts_ns);
    let events = reorder(events, 10_000);
    let cfg = CollectorConfig {
        idle_timeout_ns: u64::MAX / 4,
        ..config(Some(true))
    };
    let mut c = Collector::new(cfg);
    let start = std::time::Instant::now();
    let mut decided = 0;
    for (i, ev) in events.iter().enumerate() {
        c.push(*ev);
        if i % 4096 == 0 {
            decided += c.tick(ev.ts_ns).len();
            c.take_mute_candidates();
        }
    }
    let elapsed = start.elapsed();
    eprintln!(
        "collector memory ≈ {:.1} MiB, flow state {} bytes",
        c.approx_memory_bytes() as f64 / (1 << 20) as f64,
        std::mem::size_of::<flow::Flow>()
    );
    eprintln!(
        "{} events, {} flows live, {decided} decided: {:.2} M events/s",
        events.len(),
        c.live_flows(),
        events.len() as f64 / elapsed.as_secs_f64() / 1e6
    );
}
