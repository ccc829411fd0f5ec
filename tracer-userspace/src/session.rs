//! One live tracing session: load the probes, feed their events to the
//! collector, print each flow as its verdict is decided, stop on Ctrl-C,
//! SIGTERM or `--duration`, then detach and summarise.
use std::{
    io::{self, Write},
    path::Path,
    time::Duration,
};

use log::warn;
use tokio::signal::unix::{SignalKind, signal};
use tracer_common::PacketEvent;

use crate::{
    collector::{Collector, CollectorConfig, FlowReport, Summary, Verdict},
    output::{json::JsonOutput, text::TextOutput},
    probes::{TraceError, TraceOptions, Tracer, table::BackendChoice},
    service::Service,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    Text,
    Json,
}

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
}

/// What the session saw, for the exit status.
#[derive(Debug, Default)]
pub struct Outcome {
    pub flows: usize,
    pub problem_flows: usize,
}

impl Outcome {
    /// 0 = every flow fine, 1 = at least one flow not `ok`.
    pub fn exit_status(&self) -> u8 {
        u8::from(self.problem_flows > 0)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("needs root (CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON): run it with sudo")]
    NotRoot,
    #[error(
        "this kernel has no BTF (/sys/kernel/btf/vmlinux missing): nattrace needs a kernel built with CONFIG_DEBUG_INFO_BTF=y"
    )]
    NoBtf,
    #[error("{0}")]
    Trace(#[from] TraceError),
    #[error("cannot start the event loop: {0}")]
    Runtime(io::Error),
    #[error("writing output failed: {0}")]
    Output(io::Error),
}

enum Sink {
    Text(TextOutput<io::Stdout>),
    Json(JsonOutput<io::Stdout>),
}

impl Sink {
    fn flow(&mut self, report: &FlowReport) -> io::Result<()> {
        match self {
            Sink::Text(out) => out.flow(report),
            Sink::Json(out) => out.flow(report),
        }
    }

    fn summary(&mut self, summary: &Summary) -> io::Result<()> {
        match self {
            Sink::Text(out) => out.summary(summary),
            Sink::Json(out) => out.summary(summary),
        }
    }
}

/// Checks that need no kernel objects, so bad setups fail before anything is attached.
fn preflight() -> Result<(), SessionError> {
    if !nix::unistd::geteuid().is_root() {
        return Err(SessionError::NotRoot);
    }
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        return Err(SessionError::NoBtf);
    }
    Ok(())
}

/// `bpf_ktime_get_ns()` is CLOCK_MONOTONIC: the collector's clock must be the same.
fn monotonic_ns() -> u64 {
    let ts = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .expect("CLOCK_MONOTONIC is always available");
    ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64
}

pub fn run(options: SessionOptions) -> Result<Outcome, SessionError> {
    preflight()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(SessionError::Runtime)?;
    runtime.block_on(run_async(options))
}

async fn run_async(options: SessionOptions) -> Result<Outcome, SessionError> {
    let mut tracer = Tracer::start(&TraceOptions {
        services: options.services.clone(),
        netns: options.netns.clone(),
        ringbuf_bytes: options.ringbuf_bytes,
        backend: options.backend,
    })?;
    for skipped in tracer.skipped() {
        eprintln!("nattrace: skipped {}: {}", skipped.program, skipped.reason);
    }
    let mut sink = match options.format {
        OutputFormat::Text => Sink::Text(TextOutput::new(
            io::stdout(),
            options.color,
            options.verbose,
        )),
        OutputFormat::Json => Sink::Json(JsonOutput::new(io::stdout())),
    };
    preamble(&options, &tracer).map_err(SessionError::Output)?;

    let mut collector = Collector::new(CollectorConfig {
        services: options.services.clone(),
        reply_timeout_ns: options.reply_timeout.as_nanos() as u64,
        facts: tracer.facts().clone(),
        ..CollectorConfig::default()
    });
    let mut outcome = Outcome::default();
    let mut events: Vec<PacketEvent> = Vec::with_capacity(4096);
    let mut sigint = signal(SignalKind::interrupt()).map_err(SessionError::Runtime)?;
    let mut sigterm = signal(SignalKind::terminate()).map_err(SessionError::Runtime)?;
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

    loop {
        tokio::select! {
            res = tracer.next_events(&mut events) => {
                if let Err(err) = res {
                    warn!("reading events failed: {err}");
                }
                for ev in events.drain(..) {
                    collector.push(ev);
                }
            }
            _ = ticker.tick() => {
                ticks += 1;
                let stats = tracer.stats();
                if stats.ringbuf_full > last_lost {
                    eprintln!(
                        "nattrace: warning: {} events lost so far (ring buffer full); affected flows are marked incomplete",
                        stats.ringbuf_full
                    );
                    last_lost = stats.ringbuf_full;
                }
                collector.note_lost(stats.ringbuf_full);
                emit(&mut sink, &mut outcome, collector.tick(monotonic_ns()))?;
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

    tracer.drain(&mut events);
    for ev in events.drain(..) {
        collector.push(ev);
    }
    collector.note_lost(tracer.stats().ringbuf_full);
    let (reports, mut summary) = collector.finish(monotonic_ns());
    emit(&mut sink, &mut outcome, reports)?;
    let stats = tracer.stats();
    summary.lost_events = stats.ringbuf_full;
    summary.muted_packets = stats.muted;
    drop(tracer);
    sink.summary(&summary).map_err(SessionError::Output)?;
    Ok(outcome)
}

fn emit(
    sink: &mut Sink,
    outcome: &mut Outcome,
    reports: Vec<FlowReport>,
) -> Result<(), SessionError> {
    for report in reports {
        outcome.flows += 1;
        if report.verdict != Verdict::Ok {
            outcome.problem_flows += 1;
        }
        sink.flow(&report).map_err(SessionError::Output)?;
    }
    io::stdout().flush().map_err(SessionError::Output)
}

/// One line of static facts before the flows, so a reader knows what was traced and how.
fn preamble(options: &SessionOptions, tracer: &Tracer) -> io::Result<()> {
    let facts = tracer.facts();
    let services: Vec<String> = options.services.iter().map(ToString::to_string).collect();
    let bridge_nf = match facts.bridge_nf_call_iptables {
        Some(true) => "1",
        Some(false) => "0",
        None => "absent (br_netfilter not loaded)",
    };
    let line = format!(
        "tracing {} in netns {} (inode {}) with the {} backend ({}) on {} interfaces; bridge-nf-call-iptables={}",
        services.join(", "),
        facts.netns_name,
        facts.netns_inode,
        tracer.backend(),
        tracer.backend_reason(),
        facts.interfaces.len(),
        bridge_nf,
    );
    let mut stdout = io::stdout().lock();
    match options.format {
        OutputFormat::Text => writeln!(stdout, "nattrace: {line}"),
        OutputFormat::Json => writeln!(
            stdout,
            "{}",
            serde_json::json!({
                "kind": "start",
                "services": services,
                "netns": facts.netns_name,
                "netns_inode": facts.netns_inode,
                "backend": tracer.backend(),
                "backend_reason": tracer.backend_reason(),
                "interfaces": facts.interfaces,
                "bridge_nf_call_iptables": facts.bridge_nf_call_iptables,
                "ip_forward": facts.ip_forward,
                "skipped": tracer.skipped().iter().map(|s| format!("{}: {}", s.program, s.reason)).collect::<Vec<_>>(),
            })
        ),
    }
}
