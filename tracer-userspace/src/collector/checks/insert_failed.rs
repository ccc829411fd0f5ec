//! A request dropped by conntrack itself at confirmation (issue 22): the
//! clash of two entries with one tuple that could not be resolved — a SNAT
//! source-port collision (two connections masqueraded to the same
//! address:port, as when a tiny port range or a busy NAT runs out of free
//! ports), or the DNS A/AAAA race on kernels without clash resolution.
//!
//! Where it shows: `__nf_conntrack_confirm` (net/netfilter/nf_conntrack_core.c)
//! runs at priority NF_IP_PRI_CONNTRACK_CONFIRM (INT_MAX), after every
//! rule; when the new entry's reply tuple is taken and `nf_ct_resolve_clash`
//! cannot merge it (only UDP and other `allow_clash` protocols can), it
//! counts `insert_failed` and returns NF_DROP, and nf_hook_slow frees the
//! packet with SKB_DROP_REASON_NETFILTER_DROP. So the drop follows
//! nattrace's last netfilter point of POSTROUTING (after SNAT, priority
//! just past NF_IP_PRI_NAT_SRC) with no rule between: iptables has no
//! filter table there. What could also drop there is an nftables chain
//! hooked at postrouting with a priority above srcnat — the text says so.
use tracer_common::{hook, nat_stage, nf_hook};

use super::{Found, RuleCtx};

pub(in crate::collector) fn conntrack_insert_failed(ctx: &RuleCtx<'_>) -> Option<Found> {
    let drop = ctx.drop?;
    if Some(drop.drop_reason) != ctx.known.netfilter_drop {
        return None;
    }
    let flow = ctx.flow;
    let last = flow
        .obs
        .iter()
        .filter(|o| o.packet == drop.packet && o.ts_ns <= drop.ts_ns && o.hook != hook::DROP)
        .max_by_key(|o| o.ts_ns)?;
    if last.hook != hook::NETFILTER
        || last.nf_hook != nf_hook::POST_ROUTING
        || last.nat_stage != nat_stage::AFTER
        || !ctx.is_node(last.netns)
    {
        return None;
    }
    let snat = if last.src != flow.client {
        format!(", SNATed to {}", last.src)
    } else {
        String::new()
    };
    Some((
        "conntrack dropped it at confirmation (insert failed: a clashing entry)".to_string(),
        format!(
            "the {} ({} → {}{snat}) passed POSTROUTING's NAT and was then dropped by netfilter (NETFILTER_DROP) with no rule left to run: conntrack's confirmation found an entry with the same tuple already in the table and could not resolve the clash (insert_failed; `conntrack -S`, and this run's rise in the summary); an nftables chain hooked at postrouting after srcnat would look the same",
            ctx.kind(drop.packet),
            flow.client,
            last.dst,
        ),
    ))
}
