//! Other paths through the node (node-local client, hairpin). Collector
//! throughput and memory: `cargo bench -p tracer-userspace --bench collector`.
use tracer_common::{
    direction::{REPLY, REQUEST},
    nat_stage::{AFTER, BEFORE},
    nf_hook::{LOCAL_IN, LOCAL_OUT, POST_ROUTING, PRE_ROUTING},
    tcp_flags,
};

use super::{only, run};
use crate::collector::{fixtures::*, *};

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
    // The client itself was muted by the kernel at its namespace's
    // receive; its masqueraded address is muted from here.
    let mute = c.take_mute_candidates();
    assert_eq!(mute.len(), 1, "{mute:?}");
    assert_eq!(mute[0].port, 61000);
}
