//! `conntrack_table_full` from events (checks/table_full.rs): a SYN dropped
//! with NETFILTER_DROP in the node before any netfilter point, judged with
//! the conntrack table read after the drop.
use tracer_common::{nat_stage, nf_hook};

use super::*;
use crate::doctor::conntrack_stats::ConntrackStats;
use crate::facts::ConntrackTable;

fn table(count: u64, max: u64, drop: u64) -> ConntrackTable {
    ConntrackTable {
        count: Some(count),
        max: Some(max),
        stats: Some(ConntrackStats {
            insert_failed: Some(0),
            drop: Some(drop),
            early_drop: Some(0),
            invalid: Some(0),
            clash_resolve: Some(0),
        }),
    }
}

/// The client's SYN (and its retransmits at 1 s and 3 s) reaches the node
/// and dies there with NETFILTER_DROP before PREROUTING's first point; with
/// `hook_entry`, the kprobe backend's event for entering PREROUTING
/// (nf_hook_slow) comes first, as on the 6.12 guest.
fn syn_dropped_at(hook_entry: bool) -> Vec<PacketEvent> {
    let mut b = Builder::default();
    let (c, s) = (CLIENT, SVC);
    let entry = [(nf(PRE_ROUTING, nat_stage::NONE), c, s)];
    let entry: &[crate::collector::fixtures::Hop] = if hook_entry { &entry } else { &[] };
    for (i, dt) in [0, 1_000 * MS, 3_000 * MS].into_iter().enumerate() {
        let syn = tcp(
            tcp_flags::SYN,
            7,
            0,
            500 + i as u16,
            0xffff_8880_0009_0000 + i as u64,
            REQUEST,
        );
        b.route(
            syn,
            T0 + dt,
            &[
                &from_pod(CLIENT_NS, VETH_CLIENT, c, s),
                &[(rx(NODE_NS, VETH_CLIENT), c, s), (rx(NODE_NS, CNI0), c, s)],
                entry,
                &[(drop(NODE_NS, CNI0, NETFILTER_DROP), c, s)],
            ],
        );
    }
    b.events
}

fn syn_dropped_at_conntrack() -> Vec<PacketEvent> {
    syn_dropped_at(false)
}

/// The kprobe backend's shape (6.12 guest): the hook's entry, then the drop.
#[test]
fn the_kprobe_backends_hook_entry_is_where_it_died() {
    let (flows, _) = decide(&syn_dropped_at(true), table(3, 3, 0), table(3, 3, 2));
    assert_eq!(cause(&flows[0]), CauseId::ConntrackTableFull);
}

/// Dropped after PREROUTING's NAT points (mangle/filter, never DNATed):
/// past conntrack, so a rule's, even with the table full.
#[test]
fn a_drop_past_the_nat_points_is_a_rules_even_with_the_table_full() {
    let mut b = Builder::default();
    let (c, s) = (CLIENT, SVC);
    let syn = tcp(tcp_flags::SYN, 7, 0, 700, 0xffff_8880_000b_0000, REQUEST);
    b.route(
        syn,
        T0,
        &[
            &from_pod(CLIENT_NS, VETH_CLIENT, c, s),
            &[
                (rx(NODE_NS, CNI0), c, s),
                (nf(PRE_ROUTING, BEFORE), c, s),
                (nf(PRE_ROUTING, AFTER), c, s),
                (nf(nf_hook::FORWARD, nat_stage::NONE), c, s),
                (drop(NODE_NS, CNI0, NETFILTER_DROP), c, s),
            ],
        ],
    );
    let (flows, _) = decide(&b.events, table(3, 3, 0), table(3, 3, 2));
    assert_eq!(cause(&flows[0]), CauseId::DroppedByNetfilter);
}

/// Runs the events; after the first tick (the drop processed) the session
/// would read the table: `read` is what it finds. Returns the flows and
/// whether the collector asked for the read.
fn decide(
    events: &[PacketEvent],
    start: ConntrackTable,
    read: ConntrackTable,
) -> (Vec<FlowReport>, bool) {
    let mut cfg = config(Some(true));
    cfg.facts.conntrack = Some(start);
    let mut c = Collector::new(cfg);
    for ev in events {
        c.push(*ev);
    }
    let mut flows = c.tick(T0 + 500 * MS);
    let asked = c.take_conntrack_request();
    if asked {
        c.update_conntrack(read);
    }
    flows.extend(c.tick(T0 + 6_000 * MS));
    let (rest, _) = c.finish(T0 + 10_000 * MS);
    flows.extend(rest);
    (flows, asked)
}

fn cause(f: &FlowReport) -> CauseId {
    f.cause.as_ref().map(|c| c.id).expect("a cause")
}

#[test]
fn a_request_dropped_before_any_nat_while_the_table_is_full_is_table_full() {
    let (flows, asked) = decide(
        &syn_dropped_at_conntrack(),
        table(3, 4, 10),
        table(4, 4, 13),
    );
    assert!(asked, "a netfilter drop before DNAT asks for the table");
    assert_eq!(flows.len(), 1, "{flows:?}");
    let f = &flows[0];
    assert_eq!(f.verdict, Verdict::Dropped);
    assert_eq!(cause(f), CauseId::ConntrackTableFull);
    let c = f.cause.as_ref().unwrap();
    assert_eq!(
        c.clause,
        "conntrack's table was full (4 of nf_conntrack_max 4 entries)"
    );
    for needle in [
        "NETFILTER_DROP",
        "before it reached any NAT point",
        "held 4 entries, nf_conntrack_max is 4",
        "drop +3",
    ] {
        assert!(c.text.contains(needle), "{needle:?} missing: {}", c.text);
    }
    assert!(c.hint.contains("nf_conntrack_max"), "{}", c.hint);
    assert!(c.hint.contains("conntrack.maxPerCore"), "{}", c.hint);
}

/// The count fell below the limit by the time it was read (entries timed
/// out), but `drop` rose over the run: still a full table.
#[test]
fn the_drop_counter_risen_over_the_run_is_enough() {
    let (flows, _) = decide(
        &syn_dropped_at_conntrack(),
        table(3, 4, 10),
        table(2, 4, 11),
    );
    let c = flows[0].cause.as_ref().expect("a cause");
    assert_eq!(c.id, CauseId::ConntrackTableFull);
    assert_eq!(
        c.clause,
        "conntrack's table was full (conntrack dropped for want of room)"
    );
    assert!(c.text.contains("drop +1"), "{}", c.text);
}

/// The healthy twin of the table: the same drop with room in the table and
/// no counter rising is a rule's (a raw-table DROP), never a full table.
#[test]
fn the_same_drop_with_room_in_the_table_stays_a_rule() {
    let (flows, asked) = decide(
        &syn_dropped_at_conntrack(),
        table(3, 4, 10),
        table(3, 4, 10),
    );
    assert!(asked);
    assert_eq!(cause(&flows[0]), CauseId::DroppedByNetfilter);
}

/// A recording without any conntrack reading (older files) decides as
/// before.
#[test]
fn without_a_reading_nothing_is_claimed() {
    let mut c = Collector::new(config(Some(true)));
    for ev in syn_dropped_at_conntrack() {
        c.push(ev);
    }
    let (flows, _) = c.finish(T0 + 10_000 * MS);
    assert_eq!(cause(&flows[0]), CauseId::DroppedByNetfilter);
}

/// The healthy twin of the flow: seed 000 working, with the table full,
/// is `ok` and asks for no read (nothing was dropped before DNAT).
#[test]
fn a_working_connection_beside_a_full_table_is_ok() {
    let (flows, asked) = decide(&seed000_same_node(true), table(4, 4, 10), table(4, 4, 12));
    assert!(!asked);
    assert!(flows.iter().all(|f| f.verdict == Verdict::Ok), "{flows:?}");
}

/// A drop after POSTROUTING's NAT (conntrack's confirmation) with the table
/// full is still an insert failure: where the packet died decides.
#[test]
fn a_drop_at_confirmation_stays_insert_failed_with_the_table_full() {
    let mut b = Builder::default();
    let (c, s, be) = (CLIENT, SVC, BACKEND);
    let syn = tcp(tcp_flags::SYN, 7, 0, 600, 0xffff_8880_000a_0000, REQUEST);
    b.route(
        syn,
        T0,
        &[
            &from_pod(CLIENT_NS, VETH_CLIENT, c, s),
            &[(rx(NODE_NS, VETH_CLIENT), c, s), (rx(NODE_NS, CNI0), c, s)],
            &forwarded(c, s, be, c),
            &[(drop(NODE_NS, CNI0, NETFILTER_DROP), c, be)],
        ],
    );
    let (flows, asked) = decide(&b.events, table(4, 4, 10), table(4, 4, 12));
    assert!(!asked, "DNATed: not a table-full candidate");
    assert_eq!(cause(&flows[0]), CauseId::ConntrackInsertFailed);
}
