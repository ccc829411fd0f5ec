//! Stitches kernel events into packets, packets into flows across the NAT,
//! and flows into verdicts. Pure: no I/O and no clock — time comes from the
//! events' `ts_ns` and from `tick(now)`, both CLOCK_MONOTONIC.
//!
//! Live loop: `push` every event read from the ring buffer, then (ideally
//! after draining it) `note_lost(kernel loss counter)`, `tick(now)` → print
//! the reports, `take_mute_candidates()` → mute those endpoints in the
//! kernel. At exit: drain, `note_lost`, `finish(now)`. Offline: `push` all,
//! `finish(last ts)`.
pub(crate) mod addr_text;
mod causes;
mod checks;
mod drop_reason;
mod established;
mod flow;
mod held;
mod hops;
mod icmp;
mod ifnames;
mod pod_names;
mod report;
mod store;
mod summary;
mod types;
mod verdict;

/// Hand-built event sequences and the node they were built for: for the
/// unit tests, and (feature `testkit`) for the bench and integration tests.
#[cfg(any(test, feature = "testkit"))]
pub mod fixtures;
#[cfg(any(test, feature = "testkit"))]
pub mod testing;
#[cfg(test)]
pub(crate) mod tests;

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap, VecDeque},
};

use tracer_common::{EndpointKey, PacketEvent, proto, tcp_flags};

pub use self::{
    causes::{Cause, CauseId, markdown_table},
    drop_reason::{BENIGN_DROPS, DropReasons, DropReasonsError},
    established::{Established, Phase, WATCH_WAIT_NS},
    held::PULL_AHEAD_NS,
    icmp::IcmpError,
    report::{Attempt, FlowReport, Hop, PacketEvidence},
    summary::{Summary, VerdictCounts},
    types::{Dir, Endpoint, Name, Proto, packet_kind},
    verdict::Verdict,
};
use self::{
    drop_reason::KnownReasons,
    flow::{Flow, FlowCtx},
    ifnames::IfNames,
    report::{Decision, ReportCtx},
    store::{FlowRef, PairIndex, Slots},
    types::{PacketKey, PairKey, in_node},
};
use crate::{
    facts::NodeFacts,
    ruleset::KubeProxyRules,
    service::{Service, ServiceSet, traced_ports},
};

fn traced_set(cfg: &CollectorConfig) -> ServiceSet {
    ServiceSet::new(traced_ports(
        &cfg.services,
        cfg.all_services.then_some(&cfg.kube_proxy),
    ))
}

const MS: u64 = 1_000_000;

#[derive(Clone, Debug)]
pub struct CollectorConfig {
    pub services: Vec<Service>,
    /// A flow without a reply at the client this long after its first request is decided.
    pub reply_timeout_ns: u64,
    pub facts: NodeFacts,
    /// The running kernel's drop reason names (see [`DropReasons`]).
    pub drop_reasons: DropReasons,
    /// Events are held this long and processed in timestamp order, because
    /// per-CPU events reach the ring buffer out of order.
    pub reorder_window_ns: u64,
    /// After the reply reaches the client, wait this long for the client's
    /// reaction (drop, RST) before reporting.
    pub settle_ns: u64,
    /// Events with the same packet identity this close belong to one packet.
    pub packet_gap_ns: u64,
    /// A decided flow is forgotten after this long without events.
    pub idle_timeout_ns: u64,
    /// Beyond this many flows the oldest is evicted (decided early if pending).
    pub max_live_flows: usize,
    pub max_packets_per_flow: usize,
    pub max_events_per_flow: usize,
    /// kube-proxy's nat rules of the node, to name each flow's Service and chains.
    pub kube_proxy: KubeProxyRules,
    /// `--all-services`: every Service port in `kube_proxy` is traced too
    /// (and follows [`Collector::update_rules`]).
    pub all_services: bool,
    /// When every program was attached (event clock): a flow whose first
    /// event is older may have passed hooks not attached yet.
    pub traced_since_ns: u64,
    /// How much of an `ok` report is built: what the run's outputs print
    /// of it. Every other verdict, and an established flow's later report,
    /// is built whole.
    pub ok_report: OkReport,
}

/// What an `ok` report carries ([`CollectorConfig::ok_report`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OkReport {
    /// Everything: the JSON line quotes the proving hops, `-v` prints every
    /// hop, a pcapng's comments quote them.
    #[default]
    Whole,
    /// The text line's: no packets and hops (text without `-v` and without
    /// a pcapng). They were ~3k of the ~16k instructions a healthy
    /// connection costs with the text output (issue 25, callgrind).
    Line,
    /// Only what the summary, the metrics and the exit status read: no
    /// hops, attempts, detail sentence or backend pod (`--hide-ok` without
    /// a pcapng).
    Counted,
}

impl OkReport {
    /// What a run whose outputs are these needs.
    pub fn printed_by(hide_ok: bool, pcap: bool, text_without_hops: bool) -> Self {
        match (pcap, hide_ok, text_without_hops) {
            (true, _, _) => Self::Whole,
            (false, true, _) => Self::Counted,
            (false, false, true) => Self::Line,
            (false, false, false) => Self::Whole,
        }
    }
}

impl Default for CollectorConfig {
    fn default() -> Self {
        Self {
            services: Vec::new(),
            reply_timeout_ns: 3_000 * MS,
            facts: NodeFacts::default(),
            drop_reasons: DropReasons::default(),
            reorder_window_ns: 20 * MS,
            settle_ns: 20 * MS,
            packet_gap_ns: 100 * MS,
            idle_timeout_ns: 30_000 * MS,
            max_live_flows: 200_000,
            max_packets_per_flow: 32,
            max_events_per_flow: 256,
            kube_proxy: KubeProxyRules::default(),
            all_services: false,
            traced_since_ns: 0,
            ok_report: OkReport::Whole,
        }
    }
}

/// The skb address is what links a packet's events across a NAT rewrite.
#[derive(Clone, Copy)]
struct SkbEntry {
    flow: FlowRef,
    key: PacketKey,
    ts: u64,
}

/// Evicting idle flows looks at this many flows per tick at most.
const EVICT_SCAN_PER_TICK: usize = 4096;
/// How far ahead of the horizon a reply deadline asks for the rules to be
/// re-read (`Collector::take_rules_request`): a request still unanswered
/// 100 ms after it was sent (with the 1 s reply timeout the tests use; at
/// most 9/10 of the timeout), so the read — milliseconds to a second, at
/// most one per 500 ms (session/steps.rs) — is done before the verdict.
const RULES_LOOKAHEAD_NS: u64 = 900 * MS;
/// Loss windows kept for the incomplete check.
const MAX_LOSS_WINDOWS: usize = 256;
/// Events held for reordering, at most (about 3 MiB). Past it the oldest
/// are processed before their reorder window has passed: only a burst no
/// ring buffer delivers (a synthetic recording, issue 26 item 7: 10^6
/// flows within 10 ms) gets there, and memory stays bounded as the flow
/// table is; an event that then arrives older still joins its flow (late).
const MAX_REORDER_EVENTS: usize = 1 << 15;
/// Queue entries (and skb map entries) before the first [`Collector::compact`].
const COMPACT_MIN: usize = 1 << 14;

/// Printed reports' vectors kept for the next reports: most of a tick's on
/// a busy node (~1,600 at 8k connections/s, a tick every 200 ms), each at
/// most ~2.4 KiB (`report::Recycled::of`).
const SPARE_REPORTS: usize = 1024;

/// Emptied evidence vectors kept for new flows: enough for the flows one
/// tick decides on a busy node to hand theirs to the next ones, at most
/// ~0.6 MiB (`Buffers::worth_keeping`'s sizes: 64-byte observations, 40-byte packets).
const SPARE_BUFFERS: usize = 256;

pub struct Collector {
    cfg: CollectorConfig,
    /// `cfg.services`, plus kube-proxy's with `all_services`.
    services: ServiceSet,
    ifnames: IfNames,
    known: KnownReasons,
    /// Events not yet processed, sorted by timestamp (ties in arrival order).
    /// They arrive nearly sorted, so this beats a heap: almost every insert
    /// is a push_back and release pops from the front.
    pending: VecDeque<PacketEvent>,
    /// Newest time known (event or tick).
    watermark: u64,
    /// Every event at or before this has been processed.
    horizon: u64,
    slots: Slots,
    free: Vec<u32>,
    live: usize,
    pairs: PairIndex,
    skbs: HashMap<u64, SkbEntry, foldhash::fast::RandomState>,
    last_skb_purge: u64,
    decide_q: VecDeque<(u64, FlowRef)>,
    timeout_q: VecDeque<(u64, FlowRef)>,
    /// No-reply decisions postponed until the kernel can have reported a
    /// request's fate (neighbour resolution): (until, slot, generation).
    hold_q: BinaryHeap<Reverse<(u64, u32, u32)>>,
    age_q: VecDeque<FlowRef>,
    /// Flows the kernel holds, by reply deadline (see `take_due_held`).
    held_due_q: VecDeque<(u64, FlowRef)>,
    /// Flows the kernel held, by (proto, client): held events arrive late,
    /// when their skb entry is gone and a DNATed one matches no pair yet.
    held_by_client: HashMap<(u8, Endpoint), FlowRef, foldhash::fast::RandomState>,
    /// Established flows that failed the watch, by decision time: decided
    /// at a tick only, after the session re-read the node's sysctls.
    watch_q: VecDeque<(u64, FlowRef)>,
    /// A flow failed the watch since the session last re-read the sysctls.
    sysctls_wanted: bool,
    /// A DNATed flow without a reply comes up for its verdict soon (or was
    /// dropped): the session re-reads kube-proxy's rules before that, so a
    /// stale conntrack entry is judged against the rules as they are then
    /// (checks/stale_entry.rs).
    rules_wanted: bool,
    /// `timeout_q` deadlines up to here were looked at for `rules_wanted`.
    rules_scanned_upto: u64,
    /// A request was dropped by netfilter before any DNAT: the session
    /// reads conntrack's table before the flow's verdict (its reply
    /// timeout), so a full table is judged as it is then
    /// (checks/table_full.rs).
    conntrack_wanted: bool,
    /// DNATed flows that failed the watch since the session last looked:
    /// their conntrack entries are looked up before they are decided
    /// (checks/midstream.rs `conntrack_invalid`). Bounded.
    ct_wanted: Vec<(crate::ctnetlink::CtTuple, crate::ctnetlink::CtTuple)>,
    /// The node's pod namespaces, to name clients, backends and hops.
    pods: crate::pods::PodIndex,
    /// kube-proxy's rules (`cfg.kube_proxy`) indexed for the reports.
    kube_index: crate::ruleset::ServiceIndex,
    /// `pods` indexed for the reports.
    pod_names: pod_names::PodNames,
    /// Namespaces other than the node's that events came from, known to
    /// the pods or already asked about (`pods_wanted`): an event from a new
    /// one is a pod started since the last read. Only local pods have a
    /// namespace here, so other nodes' addresses never ask.
    pods_seen: std::collections::HashSet<u32, foldhash::fast::RandomState>,
    pods_wanted: bool,
    ready: Vec<FlowReport>,
    /// Processing stops once this many reports wait (see [`Self::resume`]).
    report_batch: usize,
    /// It stopped there: events up to the reorder horizon still wait.
    stalled: bool,
    /// Queue and skb-map entries of removed flows are dropped once the
    /// queues hold this many (see [`Self::compact`]).
    compact_at: usize,
    /// Decided flows' emptied evidence vectors, for the next flows: at most
    /// [`SPARE_BUFFERS`] ([`flow::Buffers`]).
    spare: Vec<flow::Buffers>,
    /// Printed reports' emptied vectors, for the next reports: at most
    /// [`SPARE_REPORTS`] ([`Collector::recycle`]).
    spare_reports: Vec<report::Recycled>,
    mute: Vec<EndpointKey>,
    lost_total: u64,
    lost_seen: u64,
    loss_windows: VecDeque<(u64, u64)>,
    last_tick: u64,
    summary: Summary,
    /// `finish` runs: flows decided now are decided by the trace's end.
    stopping: bool,
}

impl Collector {
    pub fn new(cfg: CollectorConfig) -> Self {
        let ifnames = IfNames::new(&cfg.facts);
        let known = cfg.drop_reasons.known();
        let kube_index = crate::ruleset::ServiceIndex::new(&cfg.kube_proxy);
        Self {
            services: traced_set(&cfg),
            cfg,
            ifnames,
            known,
            pending: VecDeque::new(),
            watermark: 0,
            horizon: 0,
            slots: Slots::default(),
            free: Vec::new(),
            spare: Vec::new(),
            spare_reports: Vec::new(),
            live: 0,
            pairs: PairIndex::default(),
            skbs: HashMap::default(),
            last_skb_purge: 0,
            decide_q: VecDeque::new(),
            timeout_q: VecDeque::new(),
            hold_q: BinaryHeap::new(),
            age_q: VecDeque::new(),
            held_due_q: VecDeque::new(),
            held_by_client: HashMap::default(),
            watch_q: VecDeque::new(),
            sysctls_wanted: false,
            rules_wanted: false,
            rules_scanned_upto: 0,
            conntrack_wanted: false,
            ct_wanted: Vec::new(),
            pods: crate::pods::PodIndex::default(),
            pod_names: pod_names::PodNames::default(),
            kube_index,
            pods_seen: std::collections::HashSet::default(),
            pods_wanted: false,
            ready: Vec::new(),
            report_batch: usize::MAX,
            stalled: false,
            compact_at: COMPACT_MIN,
            mute: Vec::new(),
            lost_total: 0,
            lost_seen: 0,
            loss_windows: VecDeque::new(),
            last_tick: 0,
            summary: Summary::default(),
            stopping: false,
        }
    }

    /// Names interface `ifindex` of namespace `netns` (0 = the node's) in
    /// the flows decided from now on: pods' interfaces and those that
    /// appeared after start, which the node facts do not list.
    pub fn learn_interface(&mut self, netns: u32, ifindex: u32, name: &str) {
        self.ifnames.learn(netns, ifindex, name);
    }

    pub fn push(&mut self, ev: PacketEvent) {
        if ev.netns != 0
            && ev.netns != self.cfg.facts.netns_inode
            && self.pods_seen.insert(ev.netns)
        {
            self.pods_wanted = true;
        }
        if ev.ts_ns < self.horizon {
            // Past the reorder window: still worth attaching to its flow.
            if ev.flags & held::HELD == 0 {
                self.summary.late_events += 1;
            }
            self.process(&ev);
            return;
        }
        match self.pending.back() {
            Some(last) if last.ts_ns > ev.ts_ns => {
                // Usually only a few places off: look there before bisecting.
                let len = self.pending.len();
                let near = (1..=8.min(len)).find(|&k| self.pending[len - k].ts_ns <= ev.ts_ns);
                let at = match near {
                    Some(k) => len - k + 1,
                    None => self.pending.partition_point(|e| e.ts_ns <= ev.ts_ns),
                };
                self.pending.insert(at, ev);
            }
            _ => self.pending.push_back(ev),
        }
        self.watermark = self.watermark.max(ev.ts_ns);
        self.release(self.watermark.saturating_sub(self.cfg.reorder_window_ns));
        self.bound_reorder();
    }

    /// Processing stops once `batch` decided reports wait, until they are
    /// taken by [`resume`](Self::resume): `analyze` of a burst (10^6 flows
    /// evicted between two `stats` lines) then holds one batch of reports,
    /// not all (issue 26 item 7). The live session takes every report at
    /// each tick and keeps the default (no limit).
    pub fn with_report_batch(mut self, batch: usize) -> Self {
        self.report_batch = batch.max(1);
        self
    }

    /// Whether reports wait to be taken with [`resume`](Self::resume).
    pub fn backlogged(&self) -> bool {
        self.stalled || self.ready.len() >= self.report_batch
    }

    /// Goes on where the report batch stopped `push` or `tick`, and hands
    /// out what was decided. Loss is judged with what is known now; a loss
    /// counted at the next tick marks only the reports handed out then.
    pub fn resume(&mut self) -> Vec<FlowReport> {
        if self.stalled {
            self.stalled = false;
            self.release(self.watermark.saturating_sub(self.cfg.reorder_window_ns));
            self.bound_reorder();
            if !self.stalled {
                self.decide_due(self.horizon);
            }
        }
        self.take_ready()
    }

    fn bound_reorder(&mut self) {
        if self.pending.len() > MAX_REORDER_EVENTS {
            let upto = self.pending[self.pending.len() - MAX_REORDER_EVENTS].ts_ns;
            self.release(upto);
        }
    }

    /// The kernel's cumulative count of lost events (ring buffer full, flow
    /// map full). A rise marks flows active since the previous `tick` incomplete.
    pub fn note_lost(&mut self, total: u64) {
        self.lost_total = self.lost_total.max(total);
    }

    /// Decides what can be decided by `now` (CLOCK_MONOTONIC ns, the clock
    /// of `bpf_ktime_get_ns`). Call it after draining the ring buffer, so no
    /// event older than `now - reorder_window` is still unread.
    pub fn tick(&mut self, now_ns: u64) -> Vec<FlowReport> {
        self.watermark = self.watermark.max(now_ns);
        self.release(self.watermark.saturating_sub(self.cfg.reorder_window_ns));
        self.account_loss(now_ns);
        self.decide_due(self.horizon);
        self.want_rules_before_timeouts();
        while let Some(&(at, r)) = self.watch_q.front() {
            if at > self.horizon {
                break;
            }
            self.watch_q.pop_front();
            self.decide_established(r, at);
        }
        self.evict_idle();
        self.purge_skbs();
        // Past their deadline nobody will pull them (`analyze` never does).
        while self
            .held_due_q
            .front()
            .is_some_and(|&(deadline, _)| deadline < self.horizon)
        {
            self.held_due_q.pop_front();
        }
        self.take_ready()
    }

    /// Processes everything still buffered and decides every pending flow.
    pub fn finish(mut self, now_ns: u64) -> (Vec<FlowReport>, Summary) {
        self.watermark = self.watermark.max(now_ns);
        self.release(u64::MAX);
        self.horizon = self.watermark;
        self.stopping = true;
        self.account_loss(now_ns);
        self.decide_due(self.horizon);
        let mut pending: Vec<(u64, FlowRef)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let f = s.flow.as_ref()?;
                (!f.reported).then_some((
                    f.first_ts,
                    FlowRef {
                        idx: i as u32,
                        generation: s.generation,
                    },
                ))
            })
            .collect();
        pending.sort_unstable_by_key(|&(ts, _)| ts);
        for (_, r) in pending {
            self.decide_any(r, self.horizon);
        }
        let reports = self.take_ready();
        self.summary.lost_events = self.lost_total;
        (reports, self.summary)
    }

    /// Client endpoints (and their masqueraded form) of flows decided `ok`
    /// since the last call: the loader mutes them in the kernel.
    pub fn take_mute_candidates(&mut self) -> Vec<EndpointKey> {
        std::mem::take(&mut self.mute)
    }

    /// kube-proxy's rules changed (the session re-reads them): flows
    /// decided from now on are named after these, and with `all_services`
    /// new connections to exactly their Service ports open flows. Flows
    /// already open keep going.
    /// Whether a DNATed flow without a reply is about to be decided (or a
    /// DNATed request was dropped) since the last call: the session then
    /// re-reads kube-proxy's rules at once and hands them to
    /// [`Collector::update_rules`] if they changed, recording them as a
    /// `rules` line, so the flow — and `analyze` — judge its backend against
    /// the rules as they are when it fails, not as they were at start.
    pub fn take_rules_request(&mut self) -> bool {
        std::mem::take(&mut self.rules_wanted)
    }

    /// kube-proxy's rules as the collector judges flows now.
    pub fn rules(&self) -> &KubeProxyRules {
        &self.cfg.kube_proxy
    }

    /// Looks at the flows whose reply deadline comes within
    /// [`RULES_LOOKAHEAD_NS`]: one DNATed and still unanswered asks for the
    /// rules to be re-read before it is decided.
    fn want_rules_before_timeouts(&mut self) {
        let upto = self.horizon + RULES_LOOKAHEAD_NS.min(self.cfg.reply_timeout_ns / 10 * 9);
        let from = self.rules_scanned_upto;
        if upto <= from {
            return;
        }
        let start = self.timeout_q.partition_point(|&(d, _)| d <= from);
        let wanted = self
            .timeout_q
            .range(start..)
            .take_while(|&&(d, _)| d <= upto)
            .any(|&(_, r)| {
                self.flow(r)
                    .is_some_and(|f| f.backend.is_some() && f.client_reply.is_none() && !f.reported)
            });
        self.rules_wanted |= wanted;
        self.rules_scanned_upto = upto;
    }

    pub fn update_rules(&mut self, rules: KubeProxyRules) {
        self.kube_index = crate::ruleset::ServiceIndex::new(&rules);
        self.cfg.kube_proxy = rules;
        if self.cfg.all_services {
            self.services = traced_set(&self.cfg);
        }
    }

    /// Whether a flow failed the watch since the last call: the session
    /// then reads the node's sysctls again (before the tick) and hands
    /// them to [`Collector::update_sysctls`] if they changed.
    pub fn take_sysctls_request(&mut self) -> bool {
        std::mem::take(&mut self.sysctls_wanted)
    }

    /// The node's sysctls as the collector judges flows now.
    pub fn sysctls(&self) -> crate::facts::Sysctls {
        self.cfg.facts.sysctls()
    }

    /// The node's sysctls changed (re-read live, or a recording's
    /// `sysctls` line): flows decided from now on are judged with these.
    pub fn update_sysctls(&mut self, s: crate::facts::Sysctls) {
        self.cfg.facts.set_sysctls(s);
    }

    /// Whether a request was dropped by netfilter before any DNAT since the
    /// last call: the session then reads conntrack's table in the node
    /// namespace, hands it to [`Collector::update_conntrack`] and records it
    /// as a `conntrack` line, before the tick.
    pub fn take_conntrack_request(&mut self) -> bool {
        std::mem::take(&mut self.conntrack_wanted)
    }

    /// conntrack's table read again (live, or a recording's `conntrack`
    /// line): flows decided from now on are judged with it.
    pub fn update_conntrack(&mut self, t: crate::facts::ConntrackTable) {
        self.cfg.facts.conntrack_now = Some(t);
    }

    /// DNATed flows that failed the watch since the last call, each as the
    /// tuple its client sent and the client ↔ backend tuple: the session
    /// looks them up in conntrack ([`crate::ctnetlink::lookup`]), hands the
    /// results to [`Collector::update_ct_entry`] and records them, before
    /// the tick (they are decided [`WATCH_WAIT_NS`] after they failed).
    pub fn take_ct_lookups(
        &mut self,
    ) -> Vec<(crate::ctnetlink::CtTuple, crate::ctnetlink::CtTuple)> {
        std::mem::take(&mut self.ct_wanted)
    }

    /// A flow's conntrack entry as looked up (live, or a recording's
    /// `ct_entry` line): its flow is decided with it.
    pub fn update_ct_entry(&mut self, l: crate::ctnetlink::CtLookup) {
        self.cfg.facts.add_ct_entry(l);
    }

    /// Whether an event came from a namespace no pod had since the last
    /// call: the session then reads the node's pods again before the tick
    /// decides,
    /// hands them to [`Collector::update_pods`] and records them.
    pub fn take_pods_request(&mut self) -> bool {
        std::mem::take(&mut self.pods_wanted)
    }

    /// The node's pods as read now (live, or a recording's `pods` line).
    pub fn update_pods(&mut self, pods: crate::pods::PodIndex) {
        // Bounded: pods come and go for as long as nattrace runs.
        if self.pods_seen.len() >= 8192 {
            self.pods_seen.clear();
        }
        // Only named ones: an unnamed namespace asks once more when its
        // traffic shows, by which time its pod may have started.
        self.pods_seen.extend(
            pods.pods
                .iter()
                .filter(|p| p.pod.is_some())
                .map(|p| p.netns),
        );
        self.pod_names = pod_names::PodNames::new(&pods);
        self.pods = pods;
    }

    pub fn pods(&self) -> &crate::pods::PodIndex {
        &self.pods
    }

    pub fn reply_timeout_ns(&self) -> u64 {
        self.cfg.reply_timeout_ns
    }

    /// How many Service ports (IP:port, or IP for every port) open flows.
    pub fn traced_services(&self) -> usize {
        self.services.len()
    }

    pub fn summary(&self) -> &Summary {
        &self.summary
    }

    pub fn live_flows(&self) -> usize {
        self.live
    }

    /// Flows first seen at or before `ts_ns` and not yet decided, plus those
    /// decided and not yet handed out by `tick`: what a SIGUSR1 "finish"
    /// waits for (session/live.rs). Later flows do not count, so traffic
    /// that never stops cannot hold a finish off. A scan, done only while
    /// finishing.
    pub fn undecided_before(&self, ts_ns: u64) -> usize {
        self.ready.len()
            + self
                .slots
                .iter()
                .filter_map(|s| s.flow.as_ref())
                .filter(|f| !f.reported && f.first_ts <= ts_ns)
                .count()
    }

    /// Heap bytes held by the collector's tables (allocator overhead aside),
    /// for the memory budget benchmark. Not counted: reports decided and
    /// not yet handed out by `tick` (~6 KiB each for a 32-event flow).
    pub fn approx_memory_bytes(&self) -> usize {
        use std::mem::size_of;
        let evidence: usize = self
            .slots
            .iter()
            .filter_map(|s| s.flow.as_ref())
            .map(Flow::heap_bytes)
            .sum();
        // hashbrown: one control byte per bucket, buckets ≈ capacity * 8 / 7.
        let table = |cap: usize, entry: usize| cap * 8 / 7 * (entry + 1);
        self.slots.heap_bytes()
            + evidence
            + self.pairs.heap_bytes()
            + table(self.skbs.capacity(), size_of::<(u64, SkbEntry)>())
            + table(
                self.held_by_client.capacity(),
                size_of::<((u8, Endpoint), FlowRef)>(),
            )
            + self.pending.capacity() * size_of::<PacketEvent>()
            + (self.decide_q.capacity() + self.timeout_q.capacity()) * size_of::<(u64, FlowRef)>()
            + self.hold_q.capacity() * size_of::<(u64, u32, u32)>()
            + self.age_q.capacity() * size_of::<FlowRef>()
            + self.held_due_q.capacity() * size_of::<(u64, FlowRef)>()
            + self.free.capacity() * 4
            + self
                .spare
                .iter()
                .map(flow::Buffers::heap_bytes)
                .sum::<usize>()
            + self
                .spare_reports
                .iter()
                .map(report::Recycled::heap_bytes)
                .sum::<usize>()
    }

    /// Loss is applied here rather than when deciding: a flow can be decided
    /// while pushing events, before the caller has read the kernel's loss
    /// counter for that period.
    fn take_ready(&mut self) -> Vec<FlowReport> {
        // The next tick's reports go into a vector of this one's size: grown
        // from empty each tick, the reports (hundreds of bytes each) would be
        // copied at every doubling.
        let next = Vec::with_capacity(self.ready.len());
        let mut out = std::mem::replace(&mut self.ready, next);
        for r in &mut out {
            if !r.incomplete && self.overlaps_loss(r.first_ts_ns, r.decided_ts_ns) {
                report::mark_incomplete(r);
                self.summary.incomplete_flows += 1;
            }
        }
        by_first_ts(out)
    }

    fn release(&mut self, upto: u64) {
        if self.stalled {
            return;
        }
        while let Some(front) = self.pending.front() {
            if front.ts_ns > upto {
                break;
            }
            if self.ready.len() >= self.report_batch && upto != u64::MAX {
                // Not past these events yet: the horizon stays.
                self.stalled = true;
                return;
            }
            let Some(ev) = self.pending.pop_front() else {
                break;
            };
            // Decide in event time, so a verdict and its evidence do not
            // depend on when tick() happens to run (live vs offline).
            self.decide_due(ev.ts_ns.saturating_sub(1));
            self.horizon = self.horizon.max(ev.ts_ns);
            self.process(&ev);
        }
        if upto != u64::MAX {
            self.horizon = self.horizon.max(upto);
        }
    }

    fn account_loss(&mut self, now_ns: u64) {
        if self.lost_total > self.lost_seen {
            // The counter only says "some time since the last look".
            self.loss_windows.push_back((self.last_tick, now_ns));
            if self.loss_windows.len() > MAX_LOSS_WINDOWS {
                self.loss_windows.pop_front();
            }
            self.lost_seen = self.lost_total;
        }
        self.summary.lost_events = self.lost_total;
        self.last_tick = now_ns;
    }

    fn overlaps_loss(&self, from: u64, to: u64) -> bool {
        self.loss_windows
            .iter()
            .any(|&(start, end)| from <= end && to > start)
    }

    fn flow(&self, r: FlowRef) -> Option<&Flow> {
        self.slots.flow(r)
    }

    fn flow_mut(&mut self, r: FlowRef) -> Option<&mut Flow> {
        let s = self.slots.get_mut(r.idx)?;
        if s.generation == r.generation {
            s.flow.as_mut()
        } else {
            None
        }
    }

    fn is_service(&self, ev: &PacketEvent) -> bool {
        self.services
            .contains(crate::service::ip_of(ev.daddr), ev.dport)
    }

    fn process(&mut self, ev: &PacketEvent) {
        self.summary.events += 1;
        if ev.proto != proto::TCP && ev.proto != proto::UDP {
            self.summary.unmatched_events += 1;
            return;
        }
        if ev.icmp_type != 0 {
            self.process_icmp(ev);
            return;
        }
        let key = PacketKey::of(ev);
        let mut found = None;
        if ev.skb != 0
            && let Some(e) = self.skbs.get(&ev.skb)
            && e.key == key
            && ev.ts_ns.abs_diff(e.ts) <= self.cfg.packet_gap_ns
            && self.flow(e.flow).is_some()
        {
            found = Some(e.flow);
        }
        if found.is_none() {
            found = self
                .pairs
                .get(&PairKey::of(ev), &self.slots)
                .and_then(|idx| {
                    let generation = self.slots.get(idx)?.generation;
                    Some(FlowRef { idx, generation })
                });
        }
        if found.is_none() && ev.flags & held::HELD != 0 {
            found = self
                .held_by_client
                .get(&(ev.proto, held::client_of(ev)))
                .copied()
                .filter(|&r| self.flow(r).is_some());
        }
        let syn_only = ev.proto == proto::TCP
            && ev.tcp_flags & (tcp_flags::SYN | tcp_flags::ACK) == tcp_flags::SYN;
        if syn_only
            && let Some(r) = found
            && let Some(f) = self.flow(r)
            && Endpoint::src(ev) == f.client
            && f.syn_seq != Some(ev.seq)
        {
            // Same client port, new ISN: a new connection replaces the old flow.
            self.decide(r, ev.ts_ns);
            found = None;
        }
        let r = match found {
            Some(r) => r,
            None if self.is_service(ev)
                && (ev.proto == proto::UDP || syn_only || established::opens_unseen(ev)) =>
            {
                self.create(ev)
            }
            None => {
                self.summary.unmatched_events += 1;
                return;
            }
        };
        if self.flow(r).is_some_and(|f| {
            established::resets_settling_opening(f, ev, &self.known, self.cfg.facts.netns_inode)
        }) {
            // The opening is decided first, so that the reset is the
            // established connection's failure, not the opening's evidence.
            self.decide(r, ev.ts_ns);
        }
        let ctx = FlowCtx {
            node_netns: self.cfg.facts.netns_inode,
            packet_gap_ns: self.cfg.packet_gap_ns,
            settle_ns: self.cfg.settle_ns,
            max_packets: self.cfg.max_packets_per_flow,
            max_obs: self.cfg.max_events_per_flow,
            known: &self.known,
        };
        let Some(slot) = self.slots.get_mut(r.idx) else {
            return;
        };
        let Some(flow) = slot.flow.as_mut() else {
            return;
        };
        if ev.flags & tracer_common::event_flags::HOLDING != 0 {
            self.held_by_client.insert((ev.proto, flow.client), r);
        }
        if flow.reported
            && let Some(w) = flow.watch
            && !w.failed()
            && !w.reported
        {
            if established::fails(flow, ev, &self.cfg.drop_reasons, &self.known) {
                established::reopen(flow, ev);
                self.watch_q.push_back((ev.ts_ns + WATCH_WAIT_NS, r));
                wanted_after_failure(
                    flow,
                    &mut self.sysctls_wanted,
                    &mut self.rules_wanted,
                    &mut self.ct_wanted,
                );
            } else {
                established::note_healthy(flow, ev);
            }
        }
        let reopened = flow.watch.is_some_and(|w| w.failed());
        if ev.flags != 0 {
            held::note_flags(
                flow,
                ev.flags,
                (r, self.cfg.reply_timeout_ns),
                &mut self.held_due_q,
                &mut self.summary,
            );
        }
        let added = flow.add_event(ev, key, &ctx);
        if ev.hook == tracer_common::hook::DROP
            && Some(ev.drop_reason) == self.known.netfilter_drop
            && flow.backend.is_none()
        {
            self.conntrack_wanted = true;
        }
        let pair_idx = flow.pair_count() - 1;
        if added.duplicate {
            self.summary.duplicate_events += 1;
        }
        if let Some(p) = added.new_pair {
            self.pairs.insert(&p, r.idx, pair_idx, &self.slots);
        }
        if let Some((skb, key)) = added.new_packet
            && skb != 0
        {
            self.skbs.insert(
                skb,
                SkbEntry {
                    flow: r,
                    key,
                    ts: ev.ts_ns,
                },
            );
        }
        if let Some(at) = added.decidable_at
            && !reopened
        {
            self.decide_q.push_back((at, r));
        }
    }

    /// An ICMP error about a flow's packet: joins the flow its quote names
    /// (icmp.rs), never opens one.
    fn process_icmp(&mut self, ev: &PacketEvent) {
        let mut found = self
            .pairs
            .get(&PairKey::of(ev), &self.slots)
            .and_then(|idx| {
                let generation = self.slots.get(idx)?.generation;
                Some(FlowRef { idx, generation })
            });
        if found.is_none() && ev.flags & held::HELD != 0 {
            found = self
                .held_by_client
                .get(&(ev.proto, held::client_of(ev)))
                .copied()
                .filter(|&r| self.flow(r).is_some());
        }
        let Some(r) = found else {
            self.summary.unmatched_events += 1;
            return;
        };
        let reopen = self.flow(r).is_some_and(|flow| {
            flow.reported
                && flow.watch.is_some_and(|w| !w.failed() && !w.reported)
                && established::fails(flow, ev, &self.cfg.drop_reasons, &self.known)
        });
        let Some(flow) = self
            .slots
            .get_mut(r.idx)
            .filter(|s| s.generation == r.generation)
            .and_then(|s| s.flow.as_mut())
        else {
            return;
        };
        if reopen {
            established::reopen(flow, ev);
            self.watch_q.push_back((ev.ts_ns + WATCH_WAIT_NS, r));
            // Also the rules and the entry: an ICMP error can come before
            // the drop that fails the watch too (neigh_invalidate reports
            // each queued packet's error, then frees it), and a stale
            // entry judged on the rules of before was left without a cause
            // (a flake of established_more.rs's stale TCP entry, nftables).
            wanted_after_failure(
                flow,
                &mut self.sysctls_wanted,
                &mut self.rules_wanted,
                &mut self.ct_wanted,
            );
        }
        if ev.flags != 0 {
            held::note_flags(
                flow,
                ev.flags,
                (r, self.cfg.reply_timeout_ns),
                &mut self.held_due_q,
                &mut self.summary,
            );
        }
        if flow.reported {
            flow.last_ts = flow.last_ts.max(ev.ts_ns);
            return;
        }
        flow.add_icmp(ev);
    }

    fn create(&mut self, ev: &PacketEvent) -> FlowRef {
        if self.live >= self.cfg.max_live_flows.clamp(1, store::MAX_SLOTS) {
            self.evict_oldest(ev.ts_ns);
        }
        self.compact();
        let mut flow = Flow::reusing(ev, self.spare.pop());
        flow.opening_seen &= ev.ts_ns >= self.cfg.traced_since_ns;
        let pair = PairKey::of(ev);
        let idx = match self.free.pop() {
            Some(i) => i,
            None => self.slots.push(),
        };
        let Some(slot) = self.slots.get_mut(idx) else {
            unreachable!("slot {idx} was just allocated");
        };
        slot.flow = Some(flow);
        let r = FlowRef {
            idx,
            generation: slot.generation,
        };
        self.live += 1;
        self.pairs.insert(&pair, idx, 0, &self.slots);
        self.timeout_q
            .push_back((ev.ts_ns + self.cfg.reply_timeout_ns, r));
        self.age_q.push_back(r);
        r
    }

    fn remove(&mut self, r: FlowRef) {
        let Some(slot) = self.slots.get_mut(r.idx) else {
            return;
        };
        if slot.generation != r.generation {
            return;
        }
        let Some(flow) = slot.flow.take() else { return };
        slot.generation = slot.generation.wrapping_add(1);
        self.free.push(r.idx);
        self.live -= 1;
        for (i, p) in flow.pairs().enumerate() {
            self.pairs.remove(&p, r.idx, i);
        }
        let client = (flow.proto, flow.client);
        if self.held_by_client.get(&client) == Some(&r) {
            self.held_by_client.remove(&client);
        }
    }

    fn evict_oldest(&mut self, now: u64) {
        while let Some(r) = self.age_q.pop_front() {
            let Some(f) = self.flow_mut(r) else { continue };
            if !f.reported {
                f.evicted = true;
                self.decide_any(r, now);
            }
            self.remove(r);
            self.summary.evicted_flows += 1;
            return;
        }
    }

    /// Decides flows whose verdict became certain at or before `upto`.
    fn decide_due(&mut self, upto: u64) {
        while let Some(&(at, r)) = self.decide_q.front() {
            if at > upto {
                break;
            }
            self.decide_q.pop_front();
            self.decide(r, at);
        }
        while let Some(&(deadline, r)) = self.timeout_q.front() {
            if deadline > upto {
                break;
            }
            self.timeout_q.pop_front();
            // A reply already at the client is decided through decide_q, after settling.
            let Some(f) = self.flow(r).filter(|f| f.client_reply.is_none()) else {
                continue;
            };
            // A request still queued for neighbour resolution: its drop
            // (a stale endpoint) may come after the reply timeout, and would
            // change the cause (checks/backend.rs). Wait for it.
            if let Some(until) = verdict::hold_until(f, self.cfg.facts.netns_inode, &self.known)
                && until > deadline
                && !f.reported
            {
                self.hold_q.push(Reverse((until, r.idx, r.generation)));
                continue;
            }
            self.decide(r, deadline);
        }
        while let Some(&Reverse((until, idx, generation))) = self.hold_q.peek() {
            if until > upto {
                break;
            }
            self.hold_q.pop();
            let r = FlowRef { idx, generation };
            if self.flow(r).is_some_and(|f| f.client_reply.is_none()) {
                self.decide(r, until);
            }
        }
    }

    /// An opening, or an established flow that failed the watch.
    fn decide_any(&mut self, r: FlowRef, at: u64) {
        if self
            .flow(r)
            .is_some_and(|f| f.watch.is_some_and(|w| w.failed()))
        {
            self.decide_established(r, at);
        } else {
            self.decide(r, at);
        }
    }

    fn report_ctx(&self) -> ReportCtx<'_> {
        ReportCtx {
            facts: &self.cfg.facts,
            ifnames: &self.ifnames,
            reasons: &self.cfg.drop_reasons,
            known: &self.known,
            reply_timeout_ns: self.cfg.reply_timeout_ns,
            kube: crate::ruleset::IndexedRules {
                rules: &self.cfg.kube_proxy,
                index: &self.kube_index,
            },
            pods: &self.pod_names,
            ok_report: self.cfg.ok_report,
        }
    }

    /// An established flow that failed the watch, [`WATCH_WAIT_NS`] later:
    /// reported with `phase: established` unless its evidence now says `ok`
    /// (then it is watched on, silently).
    fn decide_established(&mut self, r: FlowRef, at: u64) {
        let Some(flow) = self.flow(r) else { return };
        if flow.reported {
            return;
        }
        let Some(info) = established::info(flow) else {
            return;
        };
        let decision = Decision {
            decided_ts: at,
            cut_short: false,
            stopped: false,
        };
        let mut report = report::build(flow, &self.report_ctx(), decision, None);
        let failed = report.verdict != Verdict::Ok;
        if failed {
            report.phase = Phase::Established;
            report.established = Some(info);
            report.detail = format!("{}{}", established::prefix(&info), report.detail);
            report.first_ts_ns = info.failed_ts_ns;
            self.summary.flows += 1;
            self.summary.established_failures += 1;
            self.summary.by_verdict.add(report.verdict);
            self.summary.incomplete_flows += u64::from(report.incomplete);
            self.ready.push(report);
        }
        let Some(f) = self.flow_mut(r) else { return };
        f.reported = true;
        let spare = f.drop_evidence();
        if let Some(w) = f.watch.as_mut() {
            if failed {
                w.reported = true;
            } else {
                w.failed_ts = 0;
            }
        }
        self.keep_spare(spare);
    }

    /// Reports the outputs are done with: their vectors, emptied, go into
    /// the next reports (see [`report::Recycled`]).
    pub fn recycle(&mut self, reports: impl IntoIterator<Item = FlowReport>) {
        for r in reports {
            if self.spare_reports.len() >= SPARE_REPORTS {
                break;
            }
            self.spare_reports.extend(report::Recycled::of(r));
        }
    }

    fn keep_spare(&mut self, b: flow::Buffers) {
        if self.spare.len() < SPARE_BUFFERS && b.worth_keeping() {
            self.spare.push(b);
        }
    }

    fn decide(&mut self, r: FlowRef, at: u64) {
        // From the slots, not `self.flow`: the spare report below is taken
        // from another field while the flow is borrowed.
        let Some(flow) = self.slots.flow(r) else {
            return;
        };
        if flow.reported || flow.watch.is_some_and(|w| w.failed()) {
            return;
        }
        if !flow.seen_in_node {
            self.summary.foreign_flows += 1;
            if let Some(f) = self.flow_mut(r) {
                f.reported = true;
                let spare = f.drop_evidence();
                self.keep_spare(spare);
            }
            return;
        }
        let decision = Decision {
            decided_ts: at,
            cut_short: at < flow.first_ts + self.cfg.reply_timeout_ns,
            stopped: self.stopping,
        };
        let spare = self.spare_reports.pop();
        let report = report::build(flow, &self.report_ctx(), decision, spare);
        if report.verdict == Verdict::Ok {
            let proto = flow.proto;
            let client =
                (!muted_by_kernel(flow, self.cfg.facts.netns_inode)).then_some(flow.client);
            for ep in client.into_iter().chain(flow.snat) {
                self.mute.push(EndpointKey {
                    addr: crate::service::kernel_addr(ep.addr),
                    port: ep.port,
                    proto,
                    _pad: 0,
                });
            }
        }
        self.summary.flows += 1;
        self.summary.by_verdict.add(report.verdict);
        self.summary.incomplete_flows += u64::from(report.incomplete);
        let ok = report.verdict == Verdict::Ok;
        self.ready.push(report);
        let Some(f) = self.flow_mut(r) else { return };
        f.reported = true;
        let good = established::good_before_watch(f);
        let fins = established::fins_before_watch(f);
        let spare = f.drop_evidence();
        if ok {
            f.watch = Some(established::Watch {
                ok_ts: at,
                good,
                fins,
                ..Default::default()
            });
        }
        self.keep_spare(spare);
    }

    fn evict_idle(&mut self) {
        for _ in 0..EVICT_SCAN_PER_TICK.min(self.age_q.len()) {
            let Some(&r) = self.age_q.front() else { break };
            let Some(f) = self.flow(r) else {
                self.age_q.pop_front();
                continue;
            };
            if !f.reported {
                break;
            }
            let idle = f.last_ts + self.cfg.idle_timeout_ns <= self.horizon;
            self.age_q.pop_front();
            if idle {
                self.remove(r);
            } else {
                // Still active: look at it again after the others.
                self.age_q.push_back(r);
            }
        }
    }

    /// Evicted flows leave entries in the deadline queues and the skb map
    /// until their time passes: in a burst (many flows evicted within one
    /// reply timeout / packet gap) those would grow with the flows seen,
    /// not the flows held. Dropped here once they outnumber the live ones;
    /// the threshold doubles with what is left, so the cost is amortized.
    fn compact(&mut self) {
        let len = self
            .timeout_q
            .len()
            .max(self.decide_q.len())
            .max(self.skbs.len());
        if len < self.compact_at {
            return;
        }
        let slots = &self.slots;
        let alive = |r: &FlowRef| slots.flow(*r).is_some();
        self.timeout_q.retain(|(_, r)| alive(r));
        self.decide_q.retain(|(_, r)| alive(r));
        self.skbs.retain(|_, e| alive(&e.flow));
        for q in [&mut self.timeout_q, &mut self.decide_q] {
            q.shrink_to(q.len() * 2);
        }
        self.skbs.shrink_to(self.skbs.len() * 2);
        let left = self
            .timeout_q
            .len()
            .max(self.decide_q.len())
            .max(self.skbs.len());
        self.compact_at = (left * 2).max(COMPACT_MIN);
    }

    fn purge_skbs(&mut self) {
        let gap = self.cfg.packet_gap_ns;
        if self.horizon < self.last_skb_purge + gap {
            return;
        }
        self.last_skb_purge = self.horizon;
        let horizon = self.horizon;
        self.skbs.retain(|_, e| e.ts + gap >= horizon);
    }
}

/// What the session reads again before a flow that failed the watch is
/// decided: the node's sysctls, kube-proxy's rules (a stale conntrack
/// entry is judged against the rules as they are then; so is a DROP rule
/// added mid-stream, the filter table being part of the read) and the
/// flow's conntrack entry (bounded).
fn wanted_after_failure(
    flow: &Flow,
    sysctls: &mut bool,
    rules: &mut bool,
    ct: &mut Vec<(crate::ctnetlink::CtTuple, crate::ctnetlink::CtTuple)>,
) {
    *sysctls = true;
    *rules = true;
    if ct.len() < 256
        && let Some(q) = flow.ct_tuples()
    {
        ct.push(q);
    }
}

/// The kernel mutes a TCP client's endpoint itself when the reverse-NATed
/// reply reaches the client's namespace (tracer-ebpf/src/filter.rs,
/// `Fate::Healthy`), so a mute from userspace would be a map lookup
/// syscall per healthy connection for nothing. UDP flows, clients the
/// kernel cannot see receive (a process of the node, another node's pod)
/// and the SNAT address are muted from here.
fn muted_by_kernel(flow: &Flow, node_netns: u32) -> bool {
    flow.proto == proto::TCP
        && flow.client_reply.is_some_and(|r| {
            r.reverse_nated
                && flow.packet_obs(r.packet).any(|o| {
                    o.hook == tracer_common::hook::DEV_RX
                        && !in_node(o.netns, node_netns)
                        && o.src == flow.service
                })
        })
}

/// Reports in the order their flows began, as a stable sort would leave
/// them. A report is several hundred bytes: sorting them in place moved
/// each one log n times (~950 instructions per healthy connection,
/// callgrind); here each moves once, after sorting (time, index) pairs.
fn by_first_ts(reports: Vec<FlowReport>) -> Vec<FlowReport> {
    if reports.is_sorted_by_key(|r| r.first_ts_ns) {
        return reports;
    }
    let mut order: Vec<(u64, u32)> = reports
        .iter()
        .enumerate()
        .map(|(i, r)| (r.first_ts_ns, i as u32))
        .collect();
    order.sort_unstable();
    let mut slots: Vec<Option<FlowReport>> = reports.into_iter().map(Some).collect();
    order
        .iter()
        .filter_map(|&(_, i)| slots[i as usize].take())
        .collect()
}
