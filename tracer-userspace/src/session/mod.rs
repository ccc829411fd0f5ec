//! One live tracing session: load the probes, feed their events to the
//! collector, print each flow as its verdict is decided, stop on Ctrl-C,
//! SIGTERM or `--duration`, then detach and summarise.
mod watch;

use std::{
    io,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use log::warn;
use tokio::signal::unix::{Signal, SignalKind, signal};
use tracer_common::PacketEvent;

use self::watch::{NetnsWatch, Notices};
pub use crate::output::sink::{Outcome, OutputFormat};
use crate::{
    collector::{Collector, DropReasons},
    output::{
        queue::{self, Overflow},
        sink::Outputs,
    },
    probes::{
        self, KernelStats, TraceError, TraceOptions, Tracer, cleanup,
        ifnames::IfNameResolver,
        netns::{Netns, NetnsError},
        table::BackendChoice,
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
    CreateOutput(io::Error),
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

/// After a signal, everything (detach, last flows, summary) is done within
/// this, whatever the reader of our output does.
const EXIT_BUDGET: Duration = Duration::from_millis(700);
/// Past this many interfaces with tc detaching takes long enough to say so
/// (two tcx links each, one RCU grace period per link: probes/tc.rs). Pod
/// veths have no tc on big nodes, so this is rare (NATTRACE_TC_EVERYWHERE).
const SLOW_DETACH_INTERFACES: usize = 64;
/// Otherwise, the output is written as long as the reader keeps reading.
const OUTPUT_STALL: Duration = Duration::from_secs(1);

/// Why the event loop ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stop {
    Signal,
    Duration,
    NetnsGone,
}

async fn run_async(options: SessionOptions) -> Result<Outcome, SessionError> {
    // Before attaching: a Ctrl-C while attaching must still detach, which
    // the default disposition (exit without unwinding) would not.
    let mut sigint = signal(SignalKind::interrupt()).map_err(SessionError::Runtime)?;
    let mut sigterm = signal(SignalKind::terminate()).map_err(SessionError::Runtime)?;
    let mut notices = Notices::new();
    // Output files are opened before anything is attached: a bad path (or a
    // FIFO nobody reads) fails without touching the node.
    let record_file = match &options.write {
        Some(path) => Some(
            queue::create_output(path).map_err(|error| RecordingError::Create {
                path: path.clone(),
                error,
            })?,
        ),
        None => None,
    };
    let pcap_file = match &options.pcap {
        Some(path) => Some(queue::create_output(path).map_err(|e| {
            SessionError::CreateOutput(io::Error::new(
                e.kind(),
                format!("cannot create {}: {e}", path.display()),
            ))
        })?),
        None => None,
    };
    match cleanup::remove_leftovers(options.netns.as_deref()) {
        Ok(removed) if !removed.is_empty() => notices.say(format_args!(
            "removed what a killed nattrace left behind: {}",
            summarize_removed(&removed)
        )),
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
    let watch = NetnsWatch::new(options.netns.as_deref());
    if let Some(note) = tracer.tc_split_note() {
        notices.say(note);
    }
    for skipped in tracer.skipped() {
        notices.say(format_args!(
            "skipped {}: {}",
            skipped.program, skipped.reason
        ));
    }
    let header = header(&options, &tracer);
    let mut recorder = match (record_file, &options.write) {
        (Some(file), Some(path)) => Some(RecordingWriter::from_file(
            file,
            path,
            &header,
            options.write_max_bytes,
        )?),
        _ => None,
    };
    let mut outputs = Outputs::new(
        options.format,
        options.color,
        options.verbose,
        Overflow::Drop,
    )
    .map_err(SessionError::Output)?;
    if let (Some(file), Some(path)) = (pcap_file, &options.pcap) {
        outputs
            .pcap_file(file, path, &header)
            .map_err(SessionError::Output)?;
    }
    outputs.preamble(&header).map_err(SessionError::Output)?;
    let mut collector = Collector::new(header.collector_config()?);
    // Names for the pods' interfaces and the node's new ones, as events
    // from them arrive (the node's at start are in the facts).
    let mut ifnames = match Netns::open(options.netns.as_deref()) {
        Ok(node) => Some(IfNameResolver::new(node, &tracer.facts().interfaces)),
        Err(err) => {
            warn!("interface names of other namespaces will be missing: {err}");
            None
        }
    };

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

    let stop = loop {
        tokio::select! {
            res = tracer.next_events(&mut events) => {
                if let Err(err) = res {
                    warn!("reading events failed: {err}");
                }
                push(&mut collector, recorder.as_mut(), ifnames.as_mut(), &mut events);
                if let Some(stall) = stall {
                    std::thread::sleep(stall);
                }
            }
            _ = ticker.tick() => {
                ticks += 1;
                if watch.as_ref().is_some_and(NetnsWatch::gone) {
                    break Stop::NetnsGone;
                }
                // The kernel wakes the reader only when the ring buffer is
                // filling: read what is there before deciding by the clock.
                tracer.drain(&mut events);
                push(&mut collector, recorder.as_mut(), ifnames.as_mut(), &mut events);
                let attached = tracer.collect_tc();
                if attached > 0 {
                    notices.say(format_args!("tc now attached on {attached} more interfaces (their device tracepoints stood in until now)"));
                }
                let stats = tracer.stats();
                if stats.ringbuf_full > last_lost {
                    notices.warn(format_args!(
                        "{} events lost so far (ring buffer full); affected flows are marked incomplete",
                        stats.ringbuf_full
                    ));
                    last_lost = stats.ringbuf_full;
                }
                let now = monotonic_ns();
                if let Some(rec) = recorder.as_mut() {
                    rec.stats(StatsLine::new(now, &stats));
                    if let Some(w) = rec.take_warning() {
                        notices.warn(w);
                    }
                }
                collector.note_lost(stats.ringbuf_full);
                outputs.flows(collector.tick(now)).map_err(SessionError::Output)?;
                for w in outputs.take_warnings() {
                    notices.warn(w);
                }
                for client in collector.take_mute_candidates() {
                    if let Err(err) = tracer.mute(client) {
                        warn!("could not mute a decided flow: {err}");
                    }
                }
                if ticks.is_multiple_of(5) {
                    match tracer.poll_new_interfaces() {
                        Ok(names) if !names.is_empty() => notices.say(format_args!("now also tracing {}", names.join(", "))),
                        Ok(_) => {}
                        Err(err) => warn!("watching for new interfaces failed: {err}"),
                    }
                }
            }
            _ = sigint.recv() => break Stop::Signal,
            _ = sigterm.recv() => break Stop::Signal,
            _ = &mut until_deadline => break Stop::Duration,
        }
    };
    let stopped_at = Instant::now();

    // What the kernel still holds; then the last verdicts go to the output
    // threads, which write them while we detach (with hundreds of tcx
    // links detaching takes seconds, see probes/tc.rs).
    tracer.drain(&mut events);
    push(
        &mut collector,
        recorder.as_mut(),
        ifnames.as_mut(),
        &mut events,
    );
    let stats = tracer.stats();
    let mut tracer = Some(tracer);
    if stop == Stop::NetnsGone {
        // Let go first: our descriptors are what keeps the deleted node alive.
        let netns_name = tracer.as_ref().map(|t| t.facts().netns_name.clone());
        drop(tracer.take());
        // The interface-name resolver holds the namespace open too.
        drop(ifnames.take());
        let path = watch.as_ref().map(|w| w.path().display().to_string());
        notices.say(format_args!(
            "network namespace {} was deleted ({} no longer names it): stopped tracing and released it",
            netns_name.unwrap_or_default(),
            path.unwrap_or_default()
        ));
    }

    let finishing = finish(
        collector,
        &mut outputs,
        recorder.as_mut(),
        stats,
        &mut notices,
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
        notices.say("interrupted again: exiting now without the summary");
    }
    // Detaches everything, also after a second Ctrl-C.
    if let Some(t) = &tracer
        && t.tc_interface_count() > SLOW_DETACH_INTERFACES
    {
        notices.say(format_args!(
            "detaching from {} interfaces: the kernel takes a few milliseconds per tc link, so this takes a few seconds",
            t.tc_interface_count()
        ));
    }
    drop(tracer);

    // Let the output reach its readers: within the exit budget after a
    // signal (but a reader that keeps up gets what was just queued), else
    // as long as they keep reading.
    let drain_until = match stop {
        Stop::Signal => (stopped_at + EXIT_BUDGET).max(Instant::now() + Duration::from_millis(100)),
        Stop::Duration | Stop::NetnsGone if interrupted => Instant::now(),
        Stop::Duration | Stop::NetnsGone => Instant::now() + Duration::from_secs(24 * 3600),
    };
    if let Some(rec) = recorder.as_mut()
        && !rec.drain(drain_until, OUTPUT_STALL)
    {
        notices.warn("the --write target is not being read: the recording is incomplete");
    }
    for w in outputs
        .take_warnings()
        .into_iter()
        .chain(outputs.drain(drain_until, OUTPUT_STALL))
    {
        notices.warn(w);
    }
    let dropped = outputs.dropped_lines();
    if dropped > 0 {
        notices.warn(format_args!(
            "{dropped} output lines were dropped because stdout was not read fast enough"
        ));
    }
    notices.drain(
        drain_until.max(Instant::now() + Duration::from_millis(50)),
        Duration::from_millis(100),
    );
    let mut outcome = std::mem::take(&mut outputs.outcome);
    outcome.aborted = stop == Stop::NetnsGone;
    Ok(outcome)
}

async fn second_signal(sigint: &mut Signal, sigterm: &mut Signal) {
    tokio::select! {
        _ = sigint.recv() => {}
        _ = sigterm.recv() => {}
    }
}

fn push(
    collector: &mut Collector,
    mut recorder: Option<&mut RecordingWriter>,
    ifnames: Option<&mut IfNameResolver>,
    events: &mut Vec<PacketEvent>,
) {
    if let Some(ifnames) = ifnames {
        // Before the events, so a recording names them as the live run does.
        let mut last = None;
        for ev in events.iter().filter(|e| e.ifindex != 0) {
            if last == Some((ev.netns, ev.ifindex)) {
                continue;
            }
            last = Some((ev.netns, ev.ifindex));
            for (ifindex, name) in ifnames.learn(ev.netns, ev.ifindex) {
                collector.learn_interface(ev.netns, ifindex, &name);
                if let Some(rec) = recorder.as_deref_mut() {
                    rec.interface(ev.netns, ifindex, &name);
                }
            }
        }
    }
    if let Some(rec) = recorder {
        for ev in events.iter() {
            rec.event(ev);
        }
    }
    for ev in events.drain(..) {
        collector.push(ev);
    }
}

/// Decide what is pending, print it and the summary. Yields between
/// batches of flows so a second Ctrl-C can cut a long output short.
async fn finish(
    mut collector: Collector,
    outputs: &mut Outputs,
    recorder: Option<&mut RecordingWriter>,
    stats: KernelStats,
    notices: &mut Notices,
) -> Result<(), SessionError> {
    let now = monotonic_ns();
    collector.note_lost(stats.ringbuf_full);
    if let Some(rec) = recorder {
        rec.end(StatsLine::new(now, &stats));
        if let Some(w) = rec.take_warning() {
            notices.warn(w);
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

/// The leftover cleanup's findings in one short line: on a node with
/// hundreds of interfaces, counts and the first few interface names.
fn summarize_removed(removed: &[String]) -> String {
    const SHOWN: usize = 3;
    if removed.len() <= SHOWN {
        return removed.join("; ");
    }
    // Entries read "<kind> [<program>] on <interface>".
    let mut kinds: Vec<(String, usize)> = Vec::new();
    let mut ifaces: Vec<&str> = Vec::new();
    for r in removed {
        let (what, iface) = r.rsplit_once(" on ").unwrap_or((r.as_str(), ""));
        let kind = what.split(' ').take(2).collect::<Vec<_>>().join(" ");
        match kinds.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => *n += 1,
            None => kinds.push((kind, 1)),
        }
        if !iface.is_empty() && !ifaces.contains(&iface) {
            ifaces.push(iface);
        }
    }
    let counts = kinds
        .iter()
        .map(|(k, n)| format!("{n} × {k}"))
        .collect::<Vec<_>>()
        .join(", ");
    let names = crate::doctor::first_few(&ifaces, ", ");
    format!("{counts} on {} interfaces ({names})", ifaces.len())
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
    // doctor's checks read IPv4 rules; IPv6 Services are not among them yet.
    inputs.traced = options
        .services
        .iter()
        .filter_map(|s| match s.addr {
            std::net::IpAddr::V4(a) => Some(a),
            std::net::IpAddr::V6(_) => None,
        })
        .collect();
    // Recorded with kube-proxy's rules, so the collector (live and in
    // `analyze`) gives such a Service's flows no NAT-based cause.
    inputs.kube_proxy.outside_netfilter = crate::doctor::outside_netfilter(&inputs);
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
        nf_priorities: tracer.priorities().to_vec(),
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

#[cfg(test)]
mod tests {
    use super::summarize_removed;

    #[test]
    fn leftovers_on_hundreds_of_interfaces_fit_one_short_line() {
        let removed: Vec<String> = (0..302)
            .flat_map(|i| {
                [
                    format!("tc filter tc_ingress on veth{i}"),
                    format!("tc filter tc_egress on veth{i}"),
                    format!("clsact qdisc on veth{i}"),
                ]
            })
            .collect();
        let line = summarize_removed(&removed);
        assert_eq!(
            line,
            "604 × tc filter, 302 × clsact qdisc on 302 interfaces (veth0, veth1, veth2 and 299 more)"
        );
        let few = ["tc filter tc_ingress on eth0".to_owned()];
        assert_eq!(summarize_removed(&few), "tc filter tc_ingress on eth0");
    }
}
