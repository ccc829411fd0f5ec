//! `--metrics-addr`: the session's counters as Prometheus metrics
//! (OpenMetrics text, `prometheus-client`). Names and what to alert on are
//! documented in docs/METRICS.md; a test scrapes them in the lab, checks
//! them with `promtool check metrics` and against the flows made.
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use crate::{
    collector::{FlowReport, Summary},
    probes::{KernelStats, TcState},
    ruleset::KubeProxyRules,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FlowLabels {
    /// kube-proxy's `namespace/name:port`, or `IP:PORT` when no rule names it.
    service: String,
    verdict: String,
    /// The cause id, `none` for `ok` and for problems without a known cause.
    cause: String,
    /// `opening`, or `established` for a connection that broke after an
    /// `ok` opening (it was counted `ok` once before).
    phase: String,
    /// The client pod's Kubernetes namespace, `none` when the client is
    /// not a pod of this node (bounded by the cluster's namespaces, not
    /// its pods).
    client_namespace: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BackendLabels {
    backend: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TcLabels {
    mode: String,
    /// `attached`, `pending` (being attached), `tracepoints` (pod veths
    /// watched by the device tracepoints instead, on big nodes).
    state: String,
}

/// What became of events the kernel held (tracer-ebpf/src/held.rs).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HeldLabels {
    /// `discarded` (healthy, never sent), `flushed` (sent: a problem
    /// flow), `pulled` (read at a flow's reply deadline or at exit).
    outcome: String,
}

/// One of conntrack's own counters (doctor/conntrack_stats.rs).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConntrackLabels {
    counter: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: String,
}

/// Counters the kernel or the collector keep as running totals: the
/// metric grows by the difference since the last look.
#[derive(Default)]
struct Totals {
    lost: AtomicU64,
    events: AtomicU64,
    muted: AtomicU64,
    map_full: AtomicU64,
    evicted: AtomicU64,
    processed: AtomicU64,
    dropped_lines: AtomicU64,
    held_flows: AtomicU64,
    held: [AtomicU64; 3],
    held_spilled: AtomicU64,
    held_map_full: AtomicU64,
    skipped_runs: AtomicU64,
}

fn advance(counter: &Counter, last: &AtomicU64, now: u64) {
    let before = last.swap(now, Ordering::Relaxed);
    if now > before {
        counter.inc_by(now - before);
    }
}

pub struct Metrics {
    registry: Registry,
    flows: Family<FlowLabels, Counter>,
    incomplete: Counter,
    lost: Counter,
    events: Counter,
    processed: Counter,
    muted: Counter,
    map_full: Counter,
    evicted: Counter,
    dropped_lines: Counter,
    held_flows: Counter,
    held_events: Family<HeldLabels, Counter>,
    held_spilled: Counter,
    held_map_full: Counter,
    skipped_runs: Counter,
    live_flows: Gauge,
    services: Gauge,
    services_untraced: Gauge,
    rules_reads: Family<ResultLabels, Counter>,
    backend: Family<BackendLabels, Gauge>,
    tc: Family<TcLabels, Gauge>,
    skipped: Gauge,
    conntrack_stat: Family<ConntrackLabels, Gauge>,
    totals: Totals,
}

impl Metrics {
    pub fn new(backend: &str) -> Self {
        let mut m = Metrics {
            registry: Registry::with_prefix("nattrace"),
            flows: Family::default(),
            incomplete: Counter::default(),
            lost: Counter::default(),
            events: Counter::default(),
            processed: Counter::default(),
            muted: Counter::default(),
            map_full: Counter::default(),
            evicted: Counter::default(),
            dropped_lines: Counter::default(),
            held_flows: Counter::default(),
            held_events: Family::default(),
            held_spilled: Counter::default(),
            held_map_full: Counter::default(),
            skipped_runs: Counter::default(),
            live_flows: Gauge::default(),
            services: Gauge::default(),
            services_untraced: Gauge::default(),
            rules_reads: Family::default(),
            backend: Family::default(),
            tc: Family::default(),
            skipped: Gauge::default(),
            conntrack_stat: Family::default(),
            totals: Totals::default(),
        };
        m.backend
            .get_or_create(&BackendLabels {
                backend: backend.to_owned(),
            })
            .set(1);
        m.register_all();
        m
    }

    /// The node namespace's conntrack counters, as last read.
    pub fn conntrack(&self, stats: &crate::doctor::conntrack_stats::ConntrackStats) {
        for (name, value) in stats.named() {
            if let Some(v) = value {
                self.conntrack_stat
                    .get_or_create(&ConntrackLabels {
                        counter: name.to_owned(),
                    })
                    .set(i64::try_from(v).unwrap_or(i64::MAX));
            }
        }
    }

    /// Names and describes every metric in the registry.
    fn register_all(&mut self) {
        let r = &mut self.registry;
        r.register(
            "conntrack_stat",
            "conntrack's own counters in the node namespace since boot, summed over CPUs (/proc/net/stat/nf_conntrack): insert_failed, drop, early_drop, invalid, clash_resolve",
            self.conntrack_stat.clone(),
        );
        r.register(
            "flows",
            "Flows decided, by Service, verdict and cause",
            self.flows.clone(),
        );
        r.register(
            "flows_incomplete",
            "Decided flows whose evidence may be incomplete (lost events, eviction)",
            self.incomplete.clone(),
        );
        r.register(
            "lost_events",
            "Kernel events lost because the ring buffer was full",
            self.lost.clone(),
        );
        r.register(
            "skipped_runs",
            "Runs of nattrace's tracing programs the kernel skipped because the program was already running on that CPU (recursion_misses): an event of a traced packet may be among them",
            self.skipped_runs.clone(),
        );
        r.register(
            "kernel_events",
            "Events the kernel programs emitted (packets of traced flows at each observation point)",
            self.events.clone(),
        );
        r.register(
            "events_processed",
            "Events the collector processed",
            self.processed.clone(),
        );
        r.register(
            "muted_packets",
            "Packets of decided ok flows counted in the kernel instead of emitted",
            self.muted.clone(),
        );
        r.register(
            "flow_map_full",
            "New flows the kernel could not track (its flow map was full)",
            self.map_full.clone(),
        );
        r.register(
            "held_flows",
            "TCP connections whose events the kernel held until they proved healthy or not",
            self.held_flows.clone(),
        );
        r.register(
            "held_events",
            "Held events by outcome: discarded (healthy), flushed (a problem flow), pulled (at the reply deadline)",
            self.held_events.clone(),
        );
        r.register(
            "held_spilled",
            "Held flows whose buffer filled up and was sent (not a loss)",
            self.held_spilled.clone(),
        );
        r.register(
            "held_map_full",
            "TCP connections traced per packet because the kernel's held-flow map was full",
            self.held_map_full.clone(),
        );
        r.register(
            "evicted_flows",
            "Flows evicted from the collector over --max-flows",
            self.evicted.clone(),
        );
        r.register(
            "output_dropped_lines",
            "Output lines dropped because stdout was not read fast enough",
            self.dropped_lines.clone(),
        );
        r.register(
            "live_flows",
            "Flows the collector holds now",
            self.live_flows.clone(),
        );
        r.register(
            "services_traced",
            "Service ports (IP:port/protocol) the kernel filter traces now",
            self.services.clone(),
        );
        r.register(
            "services_untraced",
            "Service ports of kube-proxy's rules not traced because the kernel filter is full",
            self.services_untraced.clone(),
        );
        r.register(
            "rules_reads",
            "Re-reads of kube-proxy's rules (--all-services), by result",
            self.rules_reads.clone(),
        );
        r.register(
            "backend_info",
            "How netfilter is watched: netfilter (BPF links) or kprobe; value 1",
            self.backend.clone(),
        );
        r.register(
            "tc_interfaces",
            "Interfaces of the node by tc attachment state (mode tcx or clsact)",
            self.tc.clone(),
        );
        r.register(
            "programs_skipped",
            "Kernel programs that could not be attached",
            self.skipped.clone(),
        );
    }

    /// The exposition (OpenMetrics text, ends with `# EOF`).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// `rules` name Services that have no endpoints (no KUBE-SVC chain).
    /// A tick's reports are counted by label set first, on borrowed names:
    /// a busy node's tick holds thousands of `ok` flows of a few Services,
    /// and a family lookup takes five owned label strings and a lock.
    pub fn flows(&self, reports: &[FlowReport], rules: &KubeProxyRules) {
        type Key<'a> = (
            std::borrow::Cow<'a, str>,
            &'static str,
            &'a str,
            &'static str,
            &'a str,
        );
        let mut counts: std::collections::HashMap<Key<'_>, u64, foldhash::fast::RandomState> =
            Default::default();
        let mut incomplete = 0;
        for r in reports {
            let service = r
                .k8s_service
                .as_deref()
                .or_else(|| {
                    rules
                        .no_endpoints_for(r.service, r.proto.as_str())
                        .map(|n| n.port_name.as_str())
                })
                .filter(|n| !n.is_empty())
                .map_or_else(|| r.service.to_string().into(), std::borrow::Cow::Borrowed);
            let client_namespace = r
                .client_pod
                .as_ref()
                .map(crate::collector::Name::as_str)
                .and_then(|p| p.split_once('/'))
                .map_or("none", |(ns, _)| ns);
            let cause = r.cause.as_ref().map_or("none", |c| c.id.as_str());
            let phase = match r.phase {
                crate::collector::Phase::Opening => "opening",
                crate::collector::Phase::Established => "established",
            };
            *counts
                .entry((service, r.verdict.as_str(), cause, phase, client_namespace))
                .or_default() += 1;
            incomplete += u64::from(r.incomplete);
        }
        for ((service, verdict, cause, phase, client_namespace), n) in counts {
            let labels = FlowLabels {
                service: service.into_owned(),
                verdict: verdict.to_owned(),
                cause: cause.to_owned(),
                phase: phase.to_owned(),
                client_namespace: client_namespace.to_owned(),
            };
            self.flows.get_or_create(&labels).inc_by(n);
        }
        if incomplete > 0 {
            self.incomplete.inc_by(incomplete);
        }
    }

    pub fn kernel(&self, stats: &KernelStats) {
        let t = &self.totals;
        advance(&self.lost, &t.lost, stats.ringbuf_full);
        advance(&self.events, &t.events, stats.events);
        advance(&self.muted, &t.muted, stats.muted);
        advance(&self.map_full, &t.map_full, stats.flow_map_full);
        advance(&self.held_spilled, &t.held_spilled, stats.held_spilled);
        advance(&self.held_map_full, &t.held_map_full, stats.held_map_full);
        advance(&self.skipped_runs, &t.skipped_runs, stats.skipped_runs);
        self.held("discarded", &t.held[0], stats.held_discarded);
    }

    fn held(&self, outcome: &str, last: &AtomicU64, now: u64) {
        let counter = self.held_events.get_or_create(&HeldLabels {
            outcome: outcome.to_owned(),
        });
        advance(&counter, last, now);
    }

    pub fn collector(&self, summary: &Summary, live: usize) {
        let t = &self.totals;
        advance(&self.evicted, &t.evicted, summary.evicted_flows);
        advance(&self.processed, &t.processed, summary.events);
        advance(&self.held_flows, &t.held_flows, summary.buffered_flows);
        self.held("flushed", &t.held[1], summary.flushed_events);
        self.held("pulled", &t.held[2], summary.pulled_events);
        self.live_flows.set(live as i64);
    }

    pub fn output_dropped(&self, lines: u64) {
        advance(&self.dropped_lines, &self.totals.dropped_lines, lines);
    }

    pub fn tc(&self, tc: &TcState) {
        for (state, n) in [
            ("attached", tc.attached),
            ("pending", tc.pending),
            ("tracepoints", tc.tracepoints),
        ] {
            self.tc
                .get_or_create(&TcLabels {
                    mode: tc.mode.to_owned(),
                    state: state.to_owned(),
                })
                .set(n as i64);
        }
        self.skipped.set(tc.skipped as i64);
    }

    pub fn services(&self, traced: usize, untraced: usize) {
        self.services.set(traced as i64);
        self.services_untraced.set(untraced as i64);
    }

    /// `n` more re-reads of kube-proxy's rules with this result.
    pub fn rules_reads(&self, ok: bool, n: u64) {
        if n == 0 {
            return;
        }
        let result = if ok { "ok" } else { "failed" };
        self.rules_reads
            .get_or_create(&ResultLabels {
                result: result.to_owned(),
            })
            .inc_by(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_grow_by_their_difference_and_flows_by_label() {
        let m = Metrics::new("netfilter");
        m.kernel(&KernelStats {
            events: 10,
            ringbuf_full: 2,
            ..Default::default()
        });
        m.kernel(&KernelStats {
            events: 25,
            ringbuf_full: 2,
            skipped_runs: 3,
            ..Default::default()
        });
        let text = m.encode();
        assert!(text.contains("nattrace_skipped_runs_total 3\n"), "{text}");
        assert!(text.contains("nattrace_kernel_events_total 25\n"), "{text}");
        assert!(text.contains("nattrace_lost_events_total 2\n"), "{text}");
        assert!(
            text.contains("nattrace_backend_info{backend=\"netfilter\"} 1\n"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"));
    }

    /// Counted by label set per call, a flow still counts once under its
    /// own labels: every recorded fixture's reports, in two calls, against
    /// a count made here report by report.
    #[test]
    fn flows_count_once_each_under_their_labels() {
        use crate::recording::{Reader, replay::decide_all};
        let m = Metrics::new("netfilter");
        let mut want: std::collections::BTreeMap<String, u64> = Default::default();
        let recordings = crate::collector::testing::recordings();
        assert!(recordings.len() > 10, "{recordings:?}");
        for f in &recordings {
            let (mut reader, header) = Reader::open(f).unwrap();
            let (reports, _) = decide_all(&mut reader, &header, None);
            let rules = &header.kube_proxy;
            let (a, b) = reports.split_at(reports.len() / 2);
            m.flows(a, rules);
            m.flows(b, rules);
            for r in &reports {
                let service = r.k8s_service.as_deref().map_or_else(
                    || {
                        rules
                            .no_endpoints_for(r.service, r.proto.as_str())
                            .map_or_else(|| r.service.to_string(), |n| n.port_name.clone())
                    },
                    str::to_owned,
                );
                *want
                    .entry(format!("{service} {}", r.verdict.as_str()))
                    .or_default() += 1;
            }
        }
        let mut got: std::collections::BTreeMap<String, u64> = Default::default();
        for line in m.encode().lines() {
            let Some(rest) = line.strip_prefix("nattrace_flows_total{") else {
                continue;
            };
            let label = |k: &str| {
                let at = rest.find(&format!("{k}=\"")).unwrap() + k.len() + 2;
                rest[at..].split('"').next().unwrap().to_owned()
            };
            let n: u64 = line.rsplit(' ').next().unwrap().parse().unwrap();
            *got.entry(format!("{} {}", label("service"), label("verdict")))
                .or_default() += n;
        }
        assert!(want.values().sum::<u64>() > 20, "{want:?}");
        assert_eq!(got, want);
    }
}
