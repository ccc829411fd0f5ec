//! Counts over a whole session, for the last output line.
use serde::Serialize;

use super::verdict::Verdict;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct VerdictCounts {
    pub ok: u64,
    pub reply_not_reverse_nated: u64,
    pub no_reply: u64,
    pub dropped: u64,
    pub refused: u64,
    /// Flows whose opening nattrace did not see, without other evidence.
    /// Written only when some were (summary lines keep their shape).
    #[serde(skip_serializing_if = "is_zero")]
    pub unseen: u64,
    /// Flows cut by the trace's end before their reply timeout ran out,
    /// without a reply or a failure seen. Written only when some were.
    #[serde(skip_serializing_if = "is_zero")]
    pub undecided: u64,
}

impl VerdictCounts {
    pub fn get(&self, v: Verdict) -> u64 {
        match v {
            Verdict::Ok => self.ok,
            Verdict::ReplyNotReverseNated => self.reply_not_reverse_nated,
            Verdict::NoReply => self.no_reply,
            Verdict::Dropped => self.dropped,
            Verdict::Refused => self.refused,
            Verdict::Unseen => self.unseen,
            Verdict::Undecided => self.undecided,
        }
    }

    pub(crate) fn add(&mut self, v: Verdict) {
        match v {
            Verdict::Ok => self.ok += 1,
            Verdict::ReplyNotReverseNated => self.reply_not_reverse_nated += 1,
            Verdict::NoReply => self.no_reply += 1,
            Verdict::Dropped => self.dropped += 1,
            Verdict::Refused => self.refused += 1,
            Verdict::Unseen => self.unseen += 1,
            Verdict::Undecided => self.undecided += 1,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Summary {
    pub flows: u64,
    pub by_verdict: VerdictCounts,
    pub incomplete_flows: u64,
    /// Events the kernel could not deliver (last value given to `note_lost`).
    pub lost_events: u64,
    /// Runs of the tracing programs the kernel skipped (a program fired on
    /// a CPU where it was already running): each may have been an event of
    /// a traced packet, most are of others (filled in by the caller).
    #[serde(skip_serializing_if = "is_zero")]
    pub skipped_runs: u64,
    /// Packets of muted flows counted in the kernel instead of emitted (filled in by the caller).
    pub muted_packets: u64,
    pub events: u64,
    pub duplicate_events: u64,
    /// Events older than what had already been processed (beyond the reorder window).
    pub late_events: u64,
    /// Events that belong to no traced flow (e.g. connections opened before tracing).
    pub unmatched_events: u64,
    pub evicted_flows: u64,
    /// Flows seen only in other namespaces of this kernel (raw tracepoints
    /// are global: another node of a kind cluster, a parallel lab), not reported.
    pub foreign_flows: u64,
    /// Connections whose opening was `ok` and that broke later: each has a
    /// second report with `phase: established` (counted in `flows` and
    /// `by_verdict` too).
    #[serde(skip_serializing_if = "is_zero")]
    pub established_failures: u64,
    /// TCP connections whose events the kernel held until they proved
    /// healthy or not (tracer-ebpf/src/held.rs).
    #[serde(skip_serializing_if = "is_zero")]
    pub buffered_flows: u64,
    /// Held events sent by the kernel because the flow was a problem.
    #[serde(skip_serializing_if = "is_zero")]
    pub flushed_events: u64,
    /// Held events read by userspace at a flow's reply deadline or at exit.
    #[serde(skip_serializing_if = "is_zero")]
    pub pulled_events: u64,
    /// Held events of healthy connections discarded in the kernel (filled in
    /// by the caller, like `muted_packets`).
    #[serde(skip_serializing_if = "is_zero")]
    pub held_discarded: u64,
    /// Held flows whose buffer filled and was sent (caller).
    #[serde(skip_serializing_if = "is_zero")]
    pub held_spilled: u64,
    /// Connections sent per packet because the kernel's held-flow map was full (caller).
    #[serde(skip_serializing_if = "is_zero")]
    pub held_map_full: u64,
    /// How much the node namespace's conntrack counters rose over the run
    /// (filled in by the live session; absent in `analyze`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conntrack: Option<crate::doctor::conntrack_stats::ConntrackStats>,
}

/// The per-flow buffer's counts are left out where nothing was held (-v,
/// recordings made before it existed), so those summaries read as before.
fn is_zero(v: &u64) -> bool {
    *v == 0
}
