//! Correctness under load: the benchmark's count check, small enough for
//! every test run. Many short connections through a Service while nattrace
//! traces it: each must come out as exactly one flow with the right verdict,
//! and no event may be lost. Needs root; without it the tests say why and pass.

#[path = "../src/bench/shared.rs"]
#[allow(dead_code)]
mod shared;

use std::net::SocketAddrV4;
use std::path::Path;

use lab::build_lab;
use lab::tracer::{nattrace, tracing_lock};
use shared::{Addrs, CONN_PORT, ClientLoad};

const CONN_BENCH: &str = env!("CARGO_BIN_EXE_conn-bench");

macro_rules! require_root {
    () => {
        if lab::skip_without_root(
            "load tests need root (network namespaces, eBPF); \
             run `sudo cargo test -p nattrace-tests --test load`",
        ) {
            return;
        }
    };
}

/// Builds the bench lab, traces the conn Service while `load` runs, and
/// returns the count check.
fn traced_connections(bridge_nf: bool, salt: u32, load: &ClientLoad) -> shared::CountCheck {
    let addrs = Addrs::for_this_process(salt);
    let lab = build_lab(shared::spec(&addrs, bridge_nf, 0));
    let conn_bench = Path::new(CONN_BENCH);
    shared::start_conn_server(&lab, conn_bench).expect("conn-bench server");
    let bin = nattrace();
    let svc = SocketAddrV4::new(addrs.conn_svc, CONN_PORT);
    let (tracer, _) = shared::start_nattrace(&bin, &lab, &[svc], &["--reply-timeout", "1000"])
        .unwrap_or_else(|e| panic!("{e:#}"));
    let run = shared::run_client(&lab, conn_bench, &addrs, load);
    let run = run.unwrap_or_else(|e| panic!("{e:#}"));
    let done =
        shared::stop_nattrace_after(tracer, run.attempted).unwrap_or_else(|e| panic!("{e:#}"));
    let check = shared::count_check(&done, &addrs, &run, bridge_nf);
    assert!(
        check.problems.is_empty(),
        "count check failed: {:?}\nclient: {run:?}\n{check:?}\n{}",
        check.problems,
        done.describe()
    );
    check
}

#[test]
fn root_every_connection_is_one_ok_flow_and_nothing_is_lost() {
    require_root!();
    let _guard = tracing_lock();
    let check = traced_connections(
        true,
        1,
        &ClientLoad {
            count: 50,
            secs: 20.0,
            parallel: 2,
            timeout_ms: 2000,
        },
    );
    assert_eq!(check.ok, 50);
}

#[test]
fn root_every_same_node_connection_is_flagged_without_bridge_nf() {
    require_root!();
    let _guard = tracing_lock();
    // Every connect fails (the SYN-ACK is never reverse-NATed): a short
    // timeout keeps it to about a second.
    let check = traced_connections(
        false,
        2,
        &ClientLoad {
            count: 10,
            secs: 20.0,
            parallel: 5,
            timeout_ms: 300,
        },
    );
    assert_eq!(check.flagged, 10);
}
