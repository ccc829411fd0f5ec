//! Which kprobe rows of the table this kernel can attach: the functions must
//! exist (nf_nat and bridge are modules on distribution kernels, and NAT's
//! function changed name over time) and, for NAT, conntrack's struct layouts
//! must be readable from BTF.
use std::collections::HashSet;

use super::{
    Skipped,
    table::{Attach, ProgramSpec},
};
use crate::btf::KernelBtf;

const KALLSYMS: &str = "/proc/kallsyms";

/// Programs that read `struct nf_conn` (offsets from nf_conntrack's BTF).
const READS_CONNTRACK: &[&str] = &[
    "kp_nf_nat_manip_pkt",
    "kp_nf_nat_packet",
    "kp_nf_nat_icmp_reply_translation",
    "kp_nf_nat_icmpv6_reply_translation",
];

/// Which of `wanted` the running kernel has (module symbols included).
/// None = kallsyms unreadable: then attach is left to find out.
fn present(wanted: &HashSet<&str>) -> Option<HashSet<String>> {
    let text = std::fs::read_to_string(KALLSYMS).ok()?;
    Some(
        text.lines()
            .filter_map(|line| line.split_whitespace().nth(2))
            .filter(|name| wanted.contains(name))
            .map(str::to_owned)
            .collect(),
    )
}

fn module_hint(symbol: &str) -> &'static str {
    match symbol {
        "nf_nat_manip_pkt"
        | "nf_nat_packet"
        | "nf_nat_icmp_reply_translation"
        | "nf_nat_icmpv6_reply_translation" => " (module nf_nat not loaded?)",
        "br_forward" => " (module bridge not loaded?)",
        _ => "",
    }
}

/// Drops from `plan` the kprobe rows this kernel cannot attach, with one
/// Skipped line each, and the fallbacks that are not needed.
pub fn resolve(
    plan: &mut Vec<&'static ProgramSpec>,
    skipped: &mut Vec<Skipped>,
    btf: &mut KernelBtf,
) {
    let mut wanted = HashSet::new();
    for spec in plan.iter() {
        if let Attach::Kprobe { symbol, unless } = spec.attach {
            wanted.insert(symbol);
            wanted.extend(unless);
        }
    }
    if wanted.is_empty() {
        return;
    }
    let have = present(&wanted);
    let has = |s: &str| have.as_ref().is_none_or(|h| h.contains(s));
    // A missing function is not worth a line when a fallback covers it.
    let covered = |s: &str| {
        plan.iter().any(|p| {
            matches!(p.attach, Attach::Kprobe { symbol, unless: Some(u) } if u == s && has(symbol))
        })
    };
    let conntrack = btf.conntrack_missing();

    let mut keep = Vec::with_capacity(plan.len());
    for spec in plan.iter() {
        let Attach::Kprobe { symbol, unless } = spec.attach else {
            keep.push(*spec);
            continue;
        };
        let reason = if unless.is_some_and(has) {
            None
        } else if !has(symbol) {
            (!covered(symbol)).then(|| format!("{symbol} not in {KALLSYMS}{}", module_hint(symbol)))
        } else if let (true, Some(e)) = (READS_CONNTRACK.contains(&spec.name), &conntrack) {
            Some(format!("cannot read conntrack entries: {e}"))
        } else {
            keep.push(*spec);
            continue;
        };
        if let Some(reason) = reason {
            skipped.push(Skipped {
                program: spec.label.to_owned(),
                reason,
            });
        }
    }
    *plan = keep;
}
