//! One live tracing session: load the probes, feed their events to the
//! collector, print each flow as its verdict is decided, stop on Ctrl-C,
//! SIGTERM or `--duration`, then detach and summarise.
mod live;
mod status;
pub use status::LogWriter;
mod steps;
mod tick;
mod watch;

use std::{
    io,
    path::{Path, PathBuf},
    time::Duration,
};

use tokio::signal::unix::{Signal, SignalKind, signal};
use tracer_common::PacketEvent;

use self::{live::Live, watch::Notices};
pub use crate::output::sink::{Outcome, OutputFormat};
use crate::{
    collector::{Collector, DropReasons},
    continuous::ContinuousOptions,
    output::sink::Outputs,
    probes::{
        self, KernelStats, TraceError, Tracer, ifnames::IfNameResolver, table::BackendChoice,
    },
    recording::{Clock, FORMAT, Header, RecordingError, RecordingWriter, StatsLine, VERSION},
    service::Service,
};

#[derive(Clone, Debug)]
pub struct SessionOptions {
    pub services: Vec<Service>,
    /// `--svc NAMESPACE/NAME[:PORT]`: resolved into `services` at start
    /// from kube-proxy's rules on the node (issue 24).
    pub service_names: Vec<crate::service_lookup::ServiceName>,
    pub netns: Option<String>,
    pub duration: Option<Duration>,
    pub reply_timeout: Duration,
    pub format: OutputFormat,
    pub verbose: bool,
    /// `--hide-ok`: no line for an `ok` flow (the DaemonSet's logs).
    pub hide_ok: bool,
    pub text: crate::output::text::TextStyle,
    pub ringbuf_bytes: u32,
    pub backend: BackendChoice,
    /// `--write FILE`: record every event for `nattrace analyze`.
    pub write: Option<PathBuf>,
    /// `--write-max-mb` in bytes.
    pub write_max_bytes: Option<u64>,
    /// `--pcap FILE`.
    pub pcap: Option<PathBuf>,
    /// `--node-name`: names this node in the recording's header.
    pub node_name: Option<String>,
    /// `--host-root`: where kubelet's pod directories are (src/pods).
    pub host_root: Option<PathBuf>,
    /// `--cri-socket`: the container runtime asked first for pod names.
    pub cri_socket: Option<PathBuf>,
    /// `--all-services`, `--metrics-addr`, `--max-flows`, `--write-keep`.
    pub continuous: ContinuousOptions,
    /// Filled by [`run`]: each `--svc` with the addresses it stands for,
    /// for the target checks at start and the "no flow seen" status.
    pub expected: Vec<Expected>,
    /// `--quiet`: no waiting line, status line or periodic progress lines.
    pub quiet: bool,
}

/// One `--svc` argument and the addresses it stands for (a name: every
/// address it resolved to). With none of them in any flow the run ends
/// with [`crate::output::sink::EXIT_NO_FLOW`] (issue 28).
#[derive(Clone, Debug)]
pub struct Expected {
    pub label: String,
    pub services: Vec<Service>,
    /// Given as `IP[:PORT]` (checked against the rules at start).
    pub by_address: bool,
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
    #[error("--svc {0}")]
    Lookup(#[from] crate::service_lookup::LookupError),
}

/// `bpf_ktime_get_ns()` is CLOCK_MONOTONIC: the collector's clock must be the same.
fn monotonic_ns() -> u64 {
    clock_ns(nix::time::ClockId::CLOCK_MONOTONIC)
}

fn clock_ns(id: nix::time::ClockId) -> u64 {
    let ts = nix::time::clock_gettime(id).expect("CLOCK_MONOTONIC/REALTIME are always available");
    ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64
}

pub fn run(mut options: SessionOptions) -> Result<Outcome, SessionError> {
    // Before the leftover cleanup, which also needs root: bad setups fail
    // before anything is touched.
    probes::preflight()?;
    options.expected = options
        .services
        .iter()
        .map(|s| Expected {
            label: s.to_string(),
            services: vec![*s],
            by_address: true,
        })
        .collect();
    resolve_names(&mut options)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(SessionError::Runtime)?;
    runtime.block_on(run_async(options))
}

/// `--svc NAMESPACE/NAME` → every address of the Service, read from
/// kube-proxy's rules in the traced namespace before anything is attached
/// (an unknown name is a usage error: exit 2). One line per name says what
/// it resolved to; the start line then lists the addresses.
fn resolve_names(options: &mut SessionOptions) -> Result<(), SessionError> {
    if options.service_names.is_empty() {
        return Ok(());
    }
    let rules = crate::ruleset::read(options.netns.as_deref());
    for wanted in &options.service_names {
        let targets = crate::service_lookup::resolve(&rules, wanted)?;
        let list: Vec<String> = targets.iter().map(ToString::to_string).collect();
        crate::output::clean::say(format_args!(
            "--svc {wanted} resolves to {}",
            list.join(", ")
        ));
        options.expected.push(Expected {
            label: wanted.to_string(),
            services: targets.iter().map(|t| t.service()).collect(),
            by_address: false,
        });
        for t in targets {
            let svc = t.service();
            if !options.services.contains(&svc) {
                options.services.push(svc);
            }
        }
    }
    Ok(())
}

/// After a signal, everything (detach, last flows, summary) is done within
/// this, whatever the reader of our output does.
const EXIT_BUDGET: Duration = Duration::from_millis(700);
/// Past this many interfaces with tc detaching takes long enough to say so
/// (two tcx links each, one RCU grace period per link: probes/tc.rs). Pod
/// veths have no tc, so this is rare (NATTRACE_TC_EVERYWHERE).
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
    let mut sigusr1 = signal(SignalKind::user_defined1()).map_err(SessionError::Runtime)?;
    let mut live = Live::start(&options)?;
    let stop = live
        .event_loop(options.duration, &mut sigint, &mut sigterm, &mut sigusr1)
        .await?;
    live.shut_down(stop, &mut sigint, &mut sigterm).await
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
    conntrack: Option<crate::doctor::conntrack_stats::ConntrackStats>,
    notices: &mut Notices,
) -> Result<(), SessionError> {
    let now = monotonic_ns();
    collector.note_lost(stats.ringbuf_full);
    if let Some(rec) = recorder {
        rec.end(StatsLine {
            conntrack,
            ..StatsLine::new(now, &stats)
        });
        if let Some(w) = rec.take_warning() {
            notices.warn(w);
        }
    }
    let (mut reports, mut summary) = collector.finish(now);
    summary.lost_events = summary.lost_events.max(stats.ringbuf_full);
    summary.muted_packets = stats.muted;
    summary.held_discarded = stats.held_discarded;
    summary.held_spilled = stats.held_spilled;
    summary.held_map_full = stats.held_map_full;
    summary.skipped_runs = stats.skipped_runs;
    summary.conntrack = conntrack;
    while !reports.is_empty() {
        let rest = reports.split_off(reports.len().min(256));
        outputs.flows(&reports).map_err(SessionError::Output)?;
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

/// Read-only static facts (sysctls, kube-proxy's rules) for the preamble
/// and for naming each flow's Service and chains, gathered on a thread of
/// their own while the probes load: `iptables-save` and friends are
/// subprocesses, 25-45 ms of start-up when run after attaching.
fn start_gathering(options: &SessionOptions) -> std::thread::JoinHandle<crate::doctor::Inputs> {
    let netns = options.netns.clone();
    std::thread::spawn(move || {
        let _t = crate::timing::step("doctor's facts + rules (own thread)");
        crate::doctor::gather_with(netns.as_deref(), None).unwrap_or_default()
    })
}

/// What a recording and `analyze` need to re-decide this session's flows.
fn header(
    options: &SessionOptions,
    tracer: &Tracer,
    gathering: std::thread::JoinHandle<crate::doctor::Inputs>,
) -> Header {
    let mut inputs = gathering.join().unwrap_or_default();
    inputs.traced = options.services.iter().map(|s| s.addr).collect();
    // Recorded with kube-proxy's rules, so the collector (live and in
    // `analyze`) gives such a Service's flows no NAT-based cause.
    inputs.kube_proxy.outside_netfilter = crate::doctor::outside_netfilter(&inputs);
    let checks = crate::doctor::assess(&inputs);
    // One line up front where the traced Services bypass netfilter NAT
    // (IPVS, eBPF): the verdicts that follow would otherwise mislead.
    if let Some(f) = checks.findings.iter().find(|f| f.check == "service_nat") {
        crate::output::clean::warn(&f.message);
    }
    // Without the rules flows carry no Service name or chains: say why.
    for tool in &inputs.kube_proxy.missing_tools {
        crate::output::clean::warn(format_args!("kube-proxy's rules not read: {tool}"));
    }
    // A typo in `--svc IP[:PORT]` traces nothing, silently: one line each
    // naming the nearest Services (names resolved from these rules already).
    let by_address: Vec<Service> = options
        .expected
        .iter()
        .filter(|e| e.by_address)
        .flat_map(|e| e.services.iter().copied())
        .collect();
    for line in crate::service_lookup::check_addrs(&inputs.kube_proxy, &by_address) {
        crate::output::clean::warn(line);
    }
    let traced_since = monotonic_ns();
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
        node: Some(node_name(options)),
        all_services: options.continuous.all_services,
        max_flows: Some(options.continuous.max_flows),
        run_id: None,
        file_seq: None,
        // Read after Tracer::start returned: every program is attached.
        traced_since_ns: Some(traced_since),
    }
}

/// `--node-name`, else the name of the `--netns` namespace (a kind node's
/// or a lab's), else this host's name.
fn node_name(options: &SessionOptions) -> String {
    if let Some(n) = &options.node_name {
        return n.clone();
    }
    if let Some(ns) = &options.netns {
        return Path::new(ns)
            .file_name()
            .map_or_else(|| ns.clone(), |f| f.to_string_lossy().into_owned());
    }
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "node".to_owned())
}

/// The running kernel's drop reason numbering (it differs between kernels,
/// also between stable releases of one: 6.18.44's is not 6.18's): from
/// tracefs, else from the kernel's BTF (tracefs is not mounted everywhere,
/// and nattrace does not mount it), else the built-in 6.18 table. Read once.
pub(super) fn kernel_drop_reasons() -> DropReasons {
    static READ: std::sync::OnceLock<DropReasons> = std::sync::OnceLock::new();
    READ.get_or_init(read_drop_reasons).clone()
}

fn read_drop_reasons() -> DropReasons {
    // The last: tracefs of the node under `kubectl debug node`'s host root.
    let parsed = [
        "/sys/kernel/tracing",
        "/sys/kernel/debug/tracing",
        "/host/sys/kernel/tracing",
    ]
    .iter()
    .find_map(|root| {
        let text =
            std::fs::read_to_string(Path::new(root).join("events/skb/kfree_skb/format")).ok()?;
        DropReasons::parse_tracefs_format(&text).ok()
    });
    let Some(parsed) = parsed else {
        return crate::btf::KernelBtf::load()
            .ok()
            .and_then(|btf| btf.enum_values("skb_drop_reason"))
            .map(DropReasons::from_pairs)
            .unwrap_or_default();
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
