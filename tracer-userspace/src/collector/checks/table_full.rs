//! A new connection's first packet dropped by conntrack itself because its
//! table is full (issue 22, kubernetes#18604).
//!
//! Where it shows: conntrack's hook (`nf_conntrack_in`, priority
//! NF_IP_PRI_CONNTRACK = -200 at PREROUTING and OUTPUT) runs before the nat
//! table and before nattrace's first netfilter point there (just after
//! conntrack). For a packet of no known connection it allocates an entry:
//! `__nf_conntrack_alloc` (net/netfilter/nf_conntrack_core.c) counts it,
//! `ct_count = atomic_inc_return(&cnet->count)`, and when
//! `nf_conntrack_max && ct_count > nf_conntrack_max` and `early_drop()`
//! finds no unreplied entry to evict it logs "nf_conntrack: table full,
//! dropping packet" and returns -ENOMEM; `nf_conntrack_in` then does
//! `NF_CT_STAT_INC_ATOMIC(state->net, drop); ret = NF_DROP;` and
//! nf_hook_slow frees the packet with SKB_DROP_REASON_NETFILTER_DROP. The
//! count is the namespace's, the limit one for all namespaces (writable in
//! the initial one only). So the request dies with NETFILTER_DROP in the
//! node before any netfilter point nattrace has — never DNATed — while the
//! node's `nf_conntrack_count` is at `nf_conntrack_max`, and `drop` rises
//! (`early_drop` where eviction made room for others). The kprobe backend
//! also reports the hook's entry (`nf_hook_slow`, no NAT stage) at
//! PREROUTING/OUTPUT: seen on the 6.12 guest, the SYN's hops are tc-ingress,
//! netfilter PREROUTING, drop NETFILTER_DROP.
//!
//! Not `conntrack_insert_failed` (checks/insert_failed.rs): that drop is at
//! confirmation, after POSTROUTING's NAT point; this one is before the
//! first. The two are told apart by where the packet died, never by the
//! counters (a full table and a clash both raise `drop`). What else drops
//! there is a raw-table rule (priority -300): the counters decide, and the
//! text says so.
use tracer_common::{hook, nat_stage, nf_hook};

use super::{Found, RuleCtx};
use crate::{collector::types::Dir, collector::verdict::drop_place, facts::ConntrackTable};

pub(in crate::collector) fn conntrack_table_full(ctx: &RuleCtx<'_>) -> Option<Found> {
    let drop = ctx.drop?;
    let flow = ctx.flow;
    if Some(drop.drop_reason) != ctx.known.netfilter_drop
        || flow.backend.is_some()
        || !ctx.is_node(drop.netns)
        || flow.packets.get(drop.packet as usize)?.dir != Dir::Request
    {
        return None;
    }
    // The kprobe backend reports entering the hook (nf_hook_slow, stage
    // NONE) before any hook function ran: that one is where it died. Any
    // other netfilter point means it got past conntrack.
    let passed_conntrack = flow.obs.iter().any(|o| {
        o.packet == drop.packet
            && o.ts_ns <= drop.ts_ns
            && o.hook == hook::NETFILTER
            && ctx.is_node(o.netns)
            && !(o.nat_stage == nat_stage::NONE
                && matches!(o.nf_hook, nf_hook::PRE_ROUTING | nf_hook::LOCAL_OUT))
    });
    if passed_conntrack {
        return None;
    }
    let start = ctx.facts.conntrack;
    // Read after the drop (the session asks for it); else what start saw.
    let now = ctx.facts.conntrack_now.or(start)?;
    let evidence = evidence(start.as_ref(), &now)?;
    let clause = match (now.count, now.max) {
        (Some(c), Some(m)) if now.at_max() => {
            format!("conntrack's table was full ({c} of nf_conntrack_max {m} entries)")
        }
        _ => "conntrack's table was full (conntrack dropped for want of room)".to_string(),
    };
    Some((
        clause,
        format!(
            "the {} ({} → {}) was dropped by netfilter (NETFILTER_DROP) {} before it reached any NAT point: conntrack could not create an entry for the new connection (\"nf_conntrack: table full, dropping packet\" in the kernel log): {evidence}; a raw-table DROP rule at PREROUTING/OUTPUT would drop it at the same place",
            ctx.kind(drop.packet),
            flow.client,
            flow.service,
            drop_place(flow, drop, ctx.ifnames),
        ),
    ))
}

/// What shows the table full: the count at the limit when read after the
/// drop, or conntrack's `drop`/`early_drop` counters risen since start.
fn evidence(start: Option<&ConntrackTable>, now: &ConntrackTable) -> Option<String> {
    let mut found = Vec::new();
    if let (Some(c), Some(m)) = (now.count, now.max)
        && now.at_max()
    {
        found.push(format!(
            "the node namespace held {c} entries, nf_conntrack_max is {m}"
        ));
    }
    if let (Some(then), Some(later)) = (start.and_then(|s| s.stats), now.stats) {
        let rise = later.rise_since(&then);
        let risen: Vec<String> = [("drop", rise.drop), ("early_drop", rise.early_drop)]
            .into_iter()
            .filter_map(|(n, v)| v.filter(|&v| v > 0).map(|v| format!("{n} +{v}")))
            .collect();
        if !risen.is_empty() {
            found.push(format!(
                "conntrack's counters rose during the run ({})",
                risen.join(", ")
            ));
        }
    }
    (!found.is_empty()).then(|| found.join("; "))
}
