//! Continuous mode, for a tracer that runs all the time (a DaemonSet):
//! `--all-services` follows kube-proxy's rules into the kernel's Service
//! filter and the collector, `--metrics-addr` serves Prometheus metrics.
//! The session calls [`Continuous`] at start and at each tick; everything
//! it does lives here.
mod http;
mod metrics;
mod reread;

use std::{
    collections::BTreeSet,
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

pub use self::metrics::Metrics;
use self::reread::RulesWatch;
use crate::{
    collector::{Collector, FlowReport},
    probes::{KernelStats, Tracer},
    recording::{Header, RecordingWriter},
    ruleset::KubeProxyRules,
    service::{Service, ServicePort, traced_ports},
};

/// `--max-flows` default: the collector held 100k live flows in 60.8 MiB
/// RSS (BENCHMARKS.md); flows are forgotten 30 s after their verdict, so
/// this is ~3000 new connections a second before anything is evicted.
pub const DEFAULT_MAX_FLOWS: usize = 100_000;

#[derive(Clone, Debug)]
pub struct ContinuousOptions {
    pub all_services: bool,
    /// How often kube-proxy's rules are re-read with `all_services`.
    pub rules_interval: Duration,
    pub metrics_addr: Option<SocketAddr>,
    pub max_flows: usize,
    /// `--write-keep`: recording files kept in all (1 = stop at the cap).
    pub write_keep: usize,
}

impl Default for ContinuousOptions {
    fn default() -> Self {
        Self {
            all_services: false,
            rules_interval: Duration::from_secs(5),
            metrics_addr: None,
            max_flows: DEFAULT_MAX_FLOWS,
            write_keep: 1,
        }
    }
}

pub struct Continuous {
    opts: ContinuousOptions,
    /// `--svc`: always traced.
    services: Vec<Service>,
    watch: Option<RulesWatch>,
    listener: Option<std::net::TcpListener>,
    metrics: Option<Arc<Metrics>>,
    /// Service ports the kernel filter could not take (full).
    untraced: usize,
    /// When the "filter full" warning was last given.
    warned_full: Option<Instant>,
    reads_seen: (u64, u64),
    /// The rules now, to name flows of Services without endpoints.
    rules: KubeProxyRules,
}

impl Continuous {
    /// Before anything is attached: a metrics address that cannot be bound
    /// (in use, not ours) is one line and exit 2 with the node untouched.
    pub fn bind(opts: &ContinuousOptions, services: &[Service]) -> std::io::Result<Self> {
        let listener = match opts.metrics_addr {
            Some(addr) => {
                let l = std::net::TcpListener::bind(addr).map_err(|e| {
                    std::io::Error::new(e.kind(), format!("cannot serve metrics on {addr}: {e}"))
                })?;
                l.set_nonblocking(true)?;
                Some(l)
            }
            None => None,
        };
        Ok(Self {
            opts: opts.clone(),
            services: services.to_vec(),
            watch: None,
            listener,
            metrics: None,
            untraced: 0,
            warned_full: None,
            reads_seen: (0, 0),
            rules: KubeProxyRules::default(),
        })
    }

    /// After attaching (inside the runtime): traces the Services of the
    /// rules read at start, starts re-reading them, serves metrics.
    /// Returns lines for the user.
    pub fn start(
        &mut self,
        netns: Option<&str>,
        tracer: &mut Tracer,
        header: &Header,
    ) -> Vec<String> {
        let mut said = Vec::new();
        self.rules = header.kube_proxy.clone();
        if let Some(listener) = self.listener.take() {
            let metrics = Arc::new(Metrics::new(tracer.backend()));
            match tokio::net::TcpListener::from_std(listener) {
                Ok(l) => {
                    if let Ok(addr) = l.local_addr() {
                        said.push(format!(
                            "serving Prometheus metrics on http://{addr}/metrics"
                        ));
                    }
                    tokio::spawn(http::serve(l, metrics.clone()));
                    self.metrics = Some(metrics);
                }
                Err(e) => said.push(format!("warning: cannot serve metrics: {e}")),
            }
        }
        if self.opts.all_services {
            said.extend(self.sync(tracer, &header.kube_proxy));
            let from_rules = traced_ports(&[], Some(&header.kube_proxy)).len();
            said.push(if from_rules == 0 {
                // IPVS mode has no per-Service chains to read; no rules at
                // all is a node without kube-proxy (or not yet synced).
                format!(
                    "warning: no Service ports in kube-proxy's rules ({} mode): nothing from them is traced until they appear (re-read every {:?}); IPVS and eBPF data planes need --svc",
                    header.kube_proxy.mode.as_str(),
                    self.opts.rules_interval
                )
            } else {
                format!(
                    "tracing all {from_rules} Service ports in kube-proxy's rules ({} mode), re-read every {:?}",
                    header.kube_proxy.mode.as_str(),
                    self.opts.rules_interval
                )
            });
            self.watch = Some(RulesWatch::spawn(
                netns.map(str::to_owned),
                self.opts.rules_interval,
                header.kube_proxy.clone(),
            ));
        }
        said
    }

    /// Makes the kernel filter match `rules` (plus `--svc`).
    fn sync(&mut self, tracer: &mut Tracer, rules: &KubeProxyRules) -> Vec<String> {
        let wanted: BTreeSet<ServicePort> = traced_ports(&self.services, Some(rules));
        let done = tracer.sync_services(&wanted);
        log::debug!("Service filter: {done:?}");
        self.untraced = done.failed;
        let mut said = Vec::new();
        if done.failed > 0
            && self
                .warned_full
                .is_none_or(|t| t.elapsed() > Duration::from_secs(600))
        {
            self.warned_full = Some(Instant::now());
            said.push(format!(
                "warning: {} Service ports not traced: the kernel's Service filter is full ({} entries)",
                done.failed,
                crate::probes::services::ALL_SERVICES_ENTRIES
            ));
        }
        said
    }

    /// At each session tick, before the collector ticks: new rules go to
    /// the kernel, the collector and the recording, in that order, so the
    /// first connection after this is traced and named.
    pub fn tick(
        &mut self,
        tracer: &mut Tracer,
        collector: &mut Collector,
        recorder: Option<&mut RecordingWriter>,
    ) -> Vec<String> {
        let Some(watch) = &self.watch else {
            return Vec::new();
        };
        if let Some(m) = &self.metrics {
            let (ok, failed) = watch.reads();
            m.rules_reads(true, ok.saturating_sub(self.reads_seen.0));
            m.rules_reads(false, failed.saturating_sub(self.reads_seen.1));
            self.reads_seen = (ok, failed);
        }
        let Some(rules) = watch.take() else {
            return Vec::new();
        };
        let said = self.sync(tracer, &rules);
        if let Some(rec) = recorder {
            rec.rules(&rules);
        }
        self.rules = rules.clone();
        collector.update_rules(rules);
        said
    }

    /// The node namespace's conntrack counters, read by the session.
    pub fn conntrack(&self, stats: &crate::doctor::conntrack_stats::ConntrackStats) {
        if let Some(m) = &self.metrics {
            m.conntrack(stats);
        }
    }

    /// Whether metrics are served (the conntrack counters are read for them).
    pub fn has_metrics(&self) -> bool {
        self.metrics.is_some()
    }

    /// Decided flows, before they go to the outputs.
    pub fn flows(&self, reports: &[FlowReport]) {
        if let Some(m) = &self.metrics {
            m.flows(reports, &self.rules);
        }
    }

    /// The gauges and running totals, at each tick.
    pub fn gauges(
        &self,
        tracer: &Tracer,
        collector: &Collector,
        stats: &KernelStats,
        dropped_lines: u64,
    ) {
        let Some(m) = &self.metrics else { return };
        m.kernel(stats);
        m.collector(collector.summary(), collector.live_flows());
        m.output_dropped(dropped_lines);
        m.tc(&tracer.tc_state());
        m.services(tracer.traced_services(), self.untraced);
    }
}
