//! One live tracing session: load the probes, feed their events to the
//! collector, print each flow as its verdict is decided, stop on Ctrl-C,
//! SIGTERM or `--duration`, then detach and summarise.
use std::{
    io,
    path::{Path, PathBuf},
    time::Duration,
};

use log::warn;
use tokio::signal::unix::{Signal, SignalKind, signal};
use tracer_common::PacketEvent;

pub use crate::output::sink::{Outcome, OutputFormat};
use crate::{
    collector::{Collector, DropReasons},
    output::sink::Outputs,
    probes::{
        self, TraceError, TraceOptions, Tracer, cleanup, netns::NetnsError, table::BackendChoice,
    },
    recording::{Clock, FORMAT, Header, RecordingError, RecordingWriter, StatsLine, VERSION},
    service::Service,
};

#[derive(Clone, Debug)]
pub struct SessionOptions {
    pub services: Vec<Service>,
    pub netns: Option<String>,
    pub duration: Option<Duration>,
    pub reply_timeout: Duration,
    pub format: OutputFormat,
    pub verbose: bool,
    pub color: bool,
    pub ringbuf_bytes: u32,
    pub backend: BackendChoice,
    /// `--write FILE`: record every event for `nattrace analyze`.
    pub write: Option<PathBuf>,
    /// `--write-max-mb` in bytes.
    pub write_max_bytes: Option<u64>,
    /// `--pcap FILE`.
    pub pcap: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("{0}")]
    Trace(#[from] TraceError),
    #[error("cannot start the event loop: {0}")]
    Runtime(io::Error),
    #[error("writing output failed: {0}")]
    Output(io::Error),
    #[error("{0}")]
    Recording(#[from] RecordingError),
}

/// `bpf_ktime_get_ns()` is CLOCK_MONOTONIC: the collector's clock must be the same.
fn monotonic_ns() -> u64 {
    clock_ns(nix::time::ClockId::CLOCK_MONOTONIC)
}

fn clock_ns(id: nix::time::ClockId) -> u64 {
    let ts = nix::time::clock_gettime(id).expect("CLOCK_MONOTONIC/REALTIME are always available");
    ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64
}

pub fn run(options: SessionOptions) -> Result<Outcome, SessionError> {
    // Before the leftover cleanup, which also needs root: bad setups fail
    // before anything is touched.
    probes::preflight()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(SessionError::Runtime)?;
    runtime.block_on(run_async(options))
}

async fn run_async(options: SessionOptions) -> Result<Outcome, SessionError> {
    // Before attaching: a Ctrl-C while attaching must still detach, which
    // the default disposition (exit without unwinding) would not.
    let mut sigint = signal(SignalKind::interrupt()).map_err(SessionError::Runtime)?;
    let mut sigterm = signal(SignalKind::terminate()).map_err(SessionError::Runtime)?;
    match cleanup::remove_leftovers(options.netns.as_deref()) {
        Ok(removed) if !removed.is_empty() => eprintln!(
            "nattrace: removed what a killed nattrace left behind: {}",
            removed.join("; ")
        ),
        Ok(_) => {}
        // Tracer::start reports a missing namespace in its one line.
        Err(NetnsError::NotFound { .. } | NetnsError::Open { .. }) => {}
        Err(err) => warn!("looking for leftovers of a killed nattrace failed: {err}"),
    }
    let mut tracer = Tracer::start(&TraceOptions {
        services: options.services.clone(),
        netns: options.netns.clone(),
        ringbuf_bytes: options.ringbuf_bytes,
        backend: options.backend,
    })?;
    for skipped in tracer.skipped() {
        eprintln!("nattrace: skipped {}: {}", skipped.program, skipped.reason);
    }
    let header = header(&options, &tracer);
    let mut recorder = match &options.write {
        Some(path) => Some(RecordingWriter::create(
            path,
            &header,
            options.write_max_bytes,
        )?),
        None => None,
    };
    let mut outputs = Outputs::new(options.format, options.color, options.verbose);
    if let Some(path) = &options.pcap {
        outputs.pcap(path, &header).map_err(SessionError::Output)?;
    }
    outputs.preamble(&header).map_err(SessionError::Output)?;
    let mut collector = Collector::new(header.collector_config()?);

    let mut events: Vec<PacketEvent> = Vec::with_capacity(4096);
    let deadline = options.duration.map(|d| tokio::time::Instant::now() + d);
    let until_deadline = async {
        match deadline {
            Some(at) => tokio::time::sleep_until(at).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(until_deadline);
    let mut ticker = tokio::time::interval(Duration::from_millis(200));
    let mut last_lost = 0u64;
    let mut ticks = 0u64;
    // Tests force ring-buffer overflow by reading slowly.
    let stall = std::env::var("NATTRACE_TEST_STALL_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map(Duration::from_millis);

    loop {
        tokio::select! {
            res = tracer.next_events(&mut events) => {
                if let Err(err) = res {
                    warn!("reading events failed: {err}");
                }
                push(&mut collector, recorder.as_mut(), &mut events);
                if let Some(stall) = stall {
                    std::thread::sleep(stall);
                }
            }
            _ = ticker.tick() => {
                ticks += 1;
                // The kernel wakes the reader only when the ring buffer is
                // filling: read what is there before deciding by the clock.
                tracer.drain(&mut events);
                push(&mut collector, recorder.as_mut(), &mut events);
                let attached = tracer.collect_tc();
                if attached > 0 {
                    eprintln!("nattrace: tc now attached on {attached} more interfaces (their device tracepoints stood in until now)");
                }
                let stats = tracer.stats();
                if stats.ringbuf_full > last_lost {
                    eprintln!(
                        "nattrace: warning: {} events lost so far (ring buffer full); affected flows are marked incomplete",
                        stats.ringbuf_full
                    );
                    last_lost = stats.ringbuf_full;
                }
                let now = monotonic_ns();
                if let Some(rec) = recorder.as_mut() {
                    rec.stats(StatsLine::new(now, &stats));
                    if let Some(w) = rec.take_warning() {
                        eprintln!("nattrace: warning: {w}");
                    }
                }
                collector.note_lost(stats.ringbuf_full);
                outputs.flows(collector.tick(now)).map_err(SessionError::Output)?;
                for client in collector.take_mute_candidates() {
                    if let Err(err) = tracer.mute(client) {
                        warn!("could not mute a decided flow: {err}");
                    }
                }
                if ticks.is_multiple_of(5) {
                    match tracer.poll_new_interfaces() {
                        Ok(names) if !names.is_empty() => eprintln!("nattrace: now also tracing {}", names.join(", ")),
                        Ok(_) => {}
                        Err(err) => warn!("watching for new interfaces failed: {err}"),
                    }
                }
            }
            _ = sigint.recv() => break,
            _ = sigterm.recv() => break,
            _ = &mut until_deadline => break,
        }
    }

    let finishing = finish(
        &mut tracer,
        collector,
        &mut outputs,
        recorder.as_mut(),
        &mut events,
    );
    let interrupted = tokio::select! {
        biased;
        _ = second_signal(&mut sigint, &mut sigterm) => true,
        res = finishing => {
            res?;
            false
        }
    };
    if interrupted {
        eprintln!("nattrace: interrupted again: exiting now without the summary");
    }
    // Detaches everything, also after a second Ctrl-C.
    drop(tracer);
    Ok(outputs.outcome)
}

async fn second_signal(sigint: &mut Signal, sigterm: &mut Signal) {
    tokio::select! {
        _ = sigint.recv() => {}
        _ = sigterm.recv() => {}
    }
}

fn push(
    collector: &mut Collector,
    recorder: Option<&mut RecordingWriter>,
    events: &mut Vec<PacketEvent>,
) {
    if let Some(rec) = recorder {
        for ev in events.iter() {
            rec.event(ev);
        }
    }
    for ev in events.drain(..) {
        collector.push(ev);
    }
}

/// Drain, decide what is pending, print it and the summary. Yields between
/// batches of flows so a second Ctrl-C can cut a long output short.
async fn finish(
    tracer: &mut Tracer,
    mut collector: Collector,
    outputs: &mut Outputs,
    mut recorder: Option<&mut RecordingWriter>,
    events: &mut Vec<PacketEvent>,
) -> Result<(), SessionError> {
    tracer.drain(events);
    push(&mut collector, recorder.as_deref_mut(), events);
    let stats = tracer.stats();
    let now = monotonic_ns();
    collector.note_lost(stats.ringbuf_full);
    if let Some(rec) = recorder {
        rec.end(StatsLine::new(now, &stats));
        if let Some(w) = rec.take_warning() {
            eprintln!("nattrace: warning: {w}");
        }
    }
    let (mut reports, mut summary) = collector.finish(now);
    summary.lost_events = summary.lost_events.max(stats.ringbuf_full);
    summary.muted_packets = stats.muted;
    while !reports.is_empty() {
        let rest = reports.split_off(reports.len().min(256));
        outputs.flows(reports).map_err(SessionError::Output)?;
        reports = rest;
        tokio::task::yield_now().await;
    }
    outputs.summary(&summary).map_err(SessionError::Output)
}

/// What a recording and `analyze` need to re-decide this session's flows.
fn header(options: &SessionOptions, tracer: &Tracer) -> Header {
    // Read-only static facts (sysctls, kube-proxy's rules) for the preamble
    // and for naming each flow's Service and chains.
    let mut inputs = crate::doctor::gather_with(
        options.netns.as_deref(),
        Some(tracer.facts().interfaces.clone()),
    )
    .unwrap_or_default();
    inputs.traced = options.services.iter().map(|s| s.addr).collect();
    // Recorded with kube-proxy's rules, so the collector (live and in
    // `analyze`) gives such a Service's flows no NAT-based cause.
    inputs.kube_proxy.outside_netfilter = inputs
        .traced
        .iter()
        .filter_map(|&ip| {
            let by = inputs.dataplane.not_netfilter(ip, &inputs.kube_proxy)?;
            Some(crate::ruleset::OutsideNetfilter { ip, by })
        })
        .collect();
    let checks = crate::doctor::assess(&inputs);
    // One line up front where the traced Services bypass netfilter NAT
    // (IPVS, eBPF): the verdicts that follow would otherwise mislead.
    if let Some(f) = checks.findings.iter().find(|f| f.check == "service_nat") {
        eprintln!("nattrace: warning: {}", f.message);
    }
    let clock = Clock {
        monotonic_ns: monotonic_ns(),
        realtime_ns: clock_ns(nix::time::ClockId::CLOCK_REALTIME),
    };
    Header {
        format: FORMAT.to_owned(),
        version: VERSION,
        nattrace_version: env!("CARGO_PKG_VERSION").to_owned(),
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_owned())
            .unwrap_or_default(),
        backend: tracer.backend().to_owned(),
        backend_reason: tracer.backend_reason().to_owned(),
        services: options.services.iter().map(ToString::to_string).collect(),
        facts: tracer.facts().clone(),
        reply_timeout_ms: options.reply_timeout.as_millis() as u64,
        drop_reasons: kernel_drop_reasons()
            .pairs()
            .map(|(v, n)| (v, n.to_owned()))
            .collect(),
        clock: Some(clock),
        skipped: tracer
            .skipped()
            .iter()
            .map(|s| format!("{}: {}", s.program, s.reason))
            .collect(),
        kube_proxy: inputs.kube_proxy,
        checks: serde_json::to_value(&checks.findings).unwrap_or_default(),
        checks_line: Some(checks.one_line()),
    }
}

/// The running kernel's drop reason numbering (it differs between kernels);
/// the built-in 6.18 table when tracefs is not mounted.
fn kernel_drop_reasons() -> DropReasons {
    let parsed = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
        .iter()
        .find_map(|root| {
            let text = std::fs::read_to_string(Path::new(root).join("events/skb/kfree_skb/format"))
                .ok()?;
            DropReasons::parse_tracefs_format(&text).ok()
        });
    let Some(parsed) = parsed else {
        return DropReasons::default();
    };
    // tracefs omits the values below NOT_SPECIFIED, but the collector needs
    // them to tell consumed packets from drops: 0 is NOT_DROPPED_YET, and
    // 1 is CONSUMED on kernels that have it (NOT_SPECIFIED = 2).
    let mut pairs: Vec<(u32, String)> = vec![(0, "NOT_DROPPED_YET".into())];
    if parsed.code("NOT_SPECIFIED") == Some(2) {
        pairs.push((1, "CONSUMED".into()));
    }
    pairs.extend(parsed.pairs().map(|(v, n)| (v, n.to_owned())));
    DropReasons::from_pairs(pairs)
}
