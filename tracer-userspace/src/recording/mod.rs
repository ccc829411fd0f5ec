//! Recordings (`--write FILE`): every raw event of a session plus what is
//! needed to decide its flows again later (`nattrace analyze FILE`).
//!
//! Format (documented in docs/RECORDING.md): JSON lines. A `header` object
//! first, then `event` lines in the order they were read from the ring
//! buffer, a `stats` line at every collector tick (the kernel's loss counter
//! and the tick's clock, so offline re-analysis ticks exactly where the live
//! run did), and an `end` line on a clean exit. Nothing is ever rewritten, so
//! a file cut anywhere (SIGKILL, full disk, size cap) is valid up to its last
//! complete line.
pub mod chain;
mod kube;
mod reader;
pub mod replay;
pub mod rotate;
mod skb_ids;
#[cfg(test)]
mod tests;

use std::{
    fs::File,
    io::{self, Write},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};
use tracer_common::PacketEvent;

pub use self::reader::{MAX_LINE_BYTES, ReadProblem, Reader, Record, STDIN};
use crate::{
    collector::{CollectorConfig, DropReasons},
    facts::NodeFacts,
    output::queue::{self, Overflow, QueueWriter, WriteQueue},
    probes::KernelStats,
    ruleset::KubeProxyRules,
    service::Service,
};

pub const FORMAT: &str = "nattrace-recording";
/// Bumped when a reader of the previous version would misread a file; new
/// optional fields do not bump it (readers ignore unknown fields).
/// 2: event addresses may be IPv6 (`"saddr":"fd00:10:244::2"`); IPv4 ones
/// are written dotted as in 1, so this reader reads version 1 files as they
/// are, and a version-1 reader warns and skips the IPv6 event lines.
/// 4: ICMP error events (`icmp_type` set, addresses those of the packet the
/// error quotes): an older reader would take them for that packet. Also
/// (additive) north-south Services in the header's `kube_proxy`.
pub const VERSION: u32 = 6;
/// A SIGKILL loses at most this much of the recording.
const FLUSH_EVERY: Duration = Duration::from_secs(1);

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Clock {
    /// CLOCK_MONOTONIC (the events' clock) and CLOCK_REALTIME read together,
    /// so event times can be shown as wall-clock time (pcapng).
    pub monotonic_ns: u64,
    pub realtime_ns: u64,
}

impl Clock {
    /// Add to an event's `ts_ns` to get nanoseconds since the Unix epoch.
    pub fn to_unix(&self, ts_ns: u64) -> u64 {
        (self.realtime_ns as i128 - self.monotonic_ns as i128 + ts_ns as i128).max(0) as u64
    }
}

/// Everything about the session that is not an event: what was traced, how,
/// and the node facts and tables the collector needs to name causes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    pub format: String,
    pub version: u32,
    pub nattrace_version: String,
    /// `uname -r` of the traced node.
    #[serde(default)]
    pub kernel: String,
    #[serde(default)]
    pub backend: String,
    #[serde(default)]
    pub backend_reason: String,
    /// `--svc` values as typed (IP or IP:PORT).
    pub services: Vec<String>,
    pub facts: NodeFacts,
    pub reply_timeout_ms: u64,
    /// The running kernel's `enum skb_drop_reason` (value, name): numbering
    /// differs between kernels, so the reader must not use its own.
    #[serde(default)]
    pub drop_reasons: Vec<(u32, String)>,
    #[serde(default)]
    pub clock: Option<Clock>,
    /// Programs that could not be attached (so a reader knows what the
    /// recording cannot contain).
    #[serde(default)]
    pub skipped: Vec<String>,
    /// kube-proxy's nat rules at start: flows are named after them.
    #[serde(default, deserialize_with = "kube::deserialize")]
    pub kube_proxy: KubeProxyRules,
    /// The node checks shown in the preamble (`doctor` findings), verbatim.
    #[serde(default)]
    pub checks: serde_json::Value,
    #[serde(default)]
    pub checks_line: Option<String>,
    /// The priority each netfilter link got (probes/table.rs windows).
    #[serde(default)]
    pub nf_priorities: Vec<crate::probes::table::ChosenPriority>,
    /// Which node this is (`--node-name`, else the `--netns` name, else the
    /// hostname): `analyze` of several nodes' recordings labels hops with
    /// it. Older recordings lack it; `analyze` then uses the file name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// `--all-services`: every Service port of `kube_proxy` (and of later
    /// `rules` lines) was traced, besides `services`.
    #[serde(default)]
    pub all_services: bool,
    /// `--max-flows`: the collector's flow limit (evictions change verdicts).
    #[serde(default)]
    pub max_flows: Option<usize>,
    /// One random id per run, the same in every file its rotation wrote
    /// (`--write-keep`): `analyze r.rec.2 r.rec.1 r.rec` reads those as one
    /// stream. Set by [`RecordingWriter`]; absent in older files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    /// This file's place in its run: 1 for the first, one more per rotation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_seq: Option<u64>,
    /// When every program was attached (CLOCK_MONOTONIC ns, the events'
    /// clock): flows whose first event is older are `opening_seen: false`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traced_since_ns: Option<u64>,
}

impl Header {
    /// The collector configuration of this session. The live run builds its
    /// collector from the header too, so offline verdicts cannot drift.
    pub fn collector_config(&self) -> Result<CollectorConfig, RecordingError> {
        // The CLI's limits: beyond them the collector's deadline arithmetic
        // is not meant to work (a crafted header must not make it overflow).
        if !(1..=600_000).contains(&self.reply_timeout_ms) {
            return Err(RecordingError::BadHeader(format!(
                "reply timeout {} ms is outside 1..600000",
                self.reply_timeout_ms
            )));
        }
        if (self.services.is_empty() && !self.all_services) || self.services.len() > 255 {
            return Err(RecordingError::BadHeader(format!(
                "{} Services (1 to 255 expected)",
                self.services.len()
            )));
        }
        let services = self
            .services
            .iter()
            .map(|s| {
                s.parse::<Service>()
                    .map_err(|e| RecordingError::BadHeader(e.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let drop_reasons = if self.drop_reasons.is_empty() {
            DropReasons::default()
        } else {
            DropReasons::from_pairs(self.drop_reasons.iter().map(|(v, n)| (*v, n.as_str())))
        };
        Ok(CollectorConfig {
            services,
            reply_timeout_ns: self.reply_timeout_ms * 1_000_000,
            facts: self.facts.clone(),
            drop_reasons,
            kube_proxy: self.kube_proxy.clone(),
            all_services: self.all_services,
            traced_since_ns: self.traced_since_ns.unwrap_or(0),
            max_live_flows: self
                .max_flows
                .unwrap_or(CollectorConfig::default().max_live_flows)
                .max(1),
            ..CollectorConfig::default()
        })
    }
}

/// The kernel counters at a collector tick (`stats`) or at the end (`end`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatsLine {
    /// The `now` the collector was ticked (or finished) with.
    pub now_ns: u64,
    /// Events the kernel could not deliver, cumulative.
    pub lost_events: u64,
    #[serde(default)]
    pub kernel_events: u64,
    #[serde(default)]
    pub muted_packets: u64,
    #[serde(default)]
    pub flow_map_full: u64,
    /// IPv6 packets (any, before filtering) whose TCP/UDP header could not
    /// be reached: non-first fragments, ESP/AH, too many extension headers.
    #[serde(default)]
    pub ipv6_unfollowed: u64,
    /// The kernel's per-flow buffer: held events of healthy connections
    /// discarded, buffers that filled and were sent, connections not held
    /// because its map was full (cumulative).
    #[serde(default)]
    pub held_discarded: u64,
    #[serde(default)]
    pub held_spilled: u64,
    #[serde(default)]
    pub held_map_full: u64,
    /// Runs of the tracing programs the kernel skipped, cumulative
    /// (`KernelStats::skipped_runs`); absent in older files.
    #[serde(default)]
    pub skipped_runs: u64,
    /// `end` only: how much the node namespace's conntrack counters rose
    /// over the run (the summary's `conntrack`, so `analyze` shows it too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conntrack: Option<crate::doctor::conntrack_stats::ConntrackStats>,
}

impl StatsLine {
    pub fn new(now_ns: u64, s: &KernelStats) -> Self {
        Self {
            now_ns,
            lost_events: s.ringbuf_full,
            kernel_events: s.events,
            muted_packets: s.muted,
            flow_map_full: s.flow_map_full,
            ipv6_unfollowed: s.ipv6_unfollowed,
            held_discarded: s.held_discarded,
            held_spilled: s.held_spilled,
            held_map_full: s.held_map_full,
            skipped_runs: s.skipped_runs,
            conntrack: None,
        }
    }
}

/// An interface name learned while tracing (see [`Line::Interface`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InterfaceName {
    /// Namespace inode as in the events (0 = the traced node's).
    pub netns: u32,
    pub ifindex: u32,
    pub name: String,
}

/// One line of a recording.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Line {
    Header(Box<Header>),
    Event(PacketEvent),
    /// The name of an interface in another namespace (a pod's) or one that
    /// appeared after start, written before the first event that needs it.
    Interface(InterfaceName),
    Stats(StatsLine),
    /// `--write-max-mb` was reached: nothing follows.
    Capped {
        bytes: u64,
    },
    /// kube-proxy's rules changed (`--all-services` re-reads them): flows
    /// decided after this line are named after these, and with
    /// `all_services` these are the traced Services.
    Rules {
        #[serde(deserialize_with = "kube::deserialize")]
        kube_proxy: KubeProxyRules,
    },
    /// `--write-max-mb` was reached and the recording goes on in a new file
    /// (`--write-keep`): this one was renamed to FILE.1.
    Rotated {
        bytes: u64,
    },
    /// The node's sysctls read again when an established flow went wrong,
    /// written when they differ from what the collector had: flows decided
    /// after this line are judged with these.
    Sysctls(crate::facts::Sysctls),
    End(StatsLine),
    /// conntrack's table and counters read again after a request was
    /// dropped by netfilter before any DNAT: flows decided after this line
    /// are judged with it (checks/table_full.rs).
    Conntrack(crate::facts::ConntrackTable),
    /// The node's pod namespaces, read at start and again when a flow
    /// named an address no pod had: flows decided after this line name
    /// their pods from it (src/pods).
    Pods(crate::pods::PodIndex),
    /// Version 6: conntrack's entry of a flow that failed the watch of
    /// established flows, looked up when it failed: flows decided after
    /// this line name the cause from it (checks/midstream.rs).
    CtEntry(Box<crate::ctnetlink::CtLookup>),
}

#[derive(Debug, thiserror::Error)]
pub enum RecordingError {
    #[error("cannot create recording {path}: {error}")]
    Create { path: PathBuf, error: io::Error },
    #[error("cannot read recording {path}: {error}")]
    Open { path: PathBuf, error: io::Error },
    #[error("{path} is not a nattrace recording: {why}")]
    NotARecording { path: PathBuf, why: String },
    #[error("bad recording header: {0}")]
    BadHeader(String),
    #[error("writing the recording failed: {0}")]
    Write(io::Error),
}

/// How far the disk (or whatever reads a FIFO) may fall behind before
/// events are dropped from the recording (and counted as lost in it).
pub const QUEUE_BYTES: usize = 64 << 20;

/// Appends a session to a recording file, through a bounded queue written by
/// its own thread (a slow disk or FIFO never stalls the session). Write
/// errors and the size cap stop the recording, never the trace; lines that
/// do not fit in the queue are dropped and counted as lost events in the
/// following `stats` lines, so `analyze` marks the affected flows incomplete.
/// [`take_warning`](Self::take_warning) says so once.
pub struct RecordingWriter {
    out: Option<QueueWriter>,
    /// `out` after the recording stopped (cap, error): still drained at exit.
    retired: Option<QueueWriter>,
    path: PathBuf,
    written: u64,
    limit: Option<u64>,
    last_flush: Instant,
    warning: Option<String>,
    warned_drops: bool,
    rotation: Rotation,
    /// Kernel addresses never reach the file: see [`skb_ids`].
    skb_ids: skb_ids::SkbIds,
    /// A write or rotation failed: the recording misses what followed.
    lost: bool,
    /// (stats time, bytes written) where the write rate is measured from.
    rate_from: Option<(u64, u64)>,
    warned_rate: bool,
}

/// The write rate is measured over this much session time…
const RATE_WINDOW_NS: u64 = 5_000_000_000;
/// …and a cap it predicts within this long is warned about (once): a flood
/// fills the default 1024 MiB in about 36 s (issue 26).
const CAP_WARN_NS: u64 = 600_000_000_000;

/// What a rotated-to file needs to stand on its own (see [`rotate`]).
#[derive(Default)]
struct Rotation {
    /// Files kept in all (`--write-keep`); 1 = stop at the cap instead.
    keep: usize,
    /// The session's header, with the rules as they are now.
    header: Option<Box<Header>>,
    /// Interface names written so far, written again after a new header.
    interfaces: std::collections::BTreeMap<(u32, u32), String>,
    /// The last pod index written, written again after a new header.
    pods: Option<crate::pods::PodIndex>,
    /// The kernel counters at the last rotation: each file counts from zero.
    base: StatsLine,
    last: StatsLine,
    /// Writing a new file's header and names: the cap does not apply.
    starting: bool,
    /// Bytes of the current file's header and names: a file holding no
    /// more than these is not rotated again (no loop on a huge line).
    start_bytes: u64,
    pub files: u64,
}

/// A run's id: random per process (std's hasher keys come from the OS),
/// mixed with the pid and the time.
fn new_run_id() -> String {
    use std::hash::BuildHasher as _;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let id = std::collections::hash_map::RandomState::new().hash_one((std::process::id(), now));
    format!("{id:016x}")
}

/// Interface names kept for rotation (pods come and go over days).
const MAX_KEPT_NAMES: usize = 16384;

impl RecordingWriter {
    pub fn create(
        path: &Path,
        header: &Header,
        limit_bytes: Option<u64>,
    ) -> Result<Self, RecordingError> {
        let file = queue::create_output(path).map_err(|error| RecordingError::Create {
            path: path.to_owned(),
            error,
        })?;
        Self::from_file(file, path, header, limit_bytes)
    }

    /// [`create`](Self::create) with a file opened already (before attaching,
    /// so a bad path fails before anything is touched).
    pub fn from_file(
        file: File,
        path: &Path,
        header: &Header,
        limit_bytes: Option<u64>,
    ) -> Result<Self, RecordingError> {
        let queue = WriteQueue::spawn(
            "recording",
            Box::new(file),
            queue::queue_bytes(QUEUE_BYTES),
            Overflow::Drop,
        )
        .map_err(RecordingError::Write)?;
        let mut w = Self {
            out: Some(QueueWriter::new(queue)),
            retired: None,
            path: path.to_owned(),
            written: 0,
            limit: limit_bytes,
            last_flush: Instant::now(),
            warning: None,
            warned_drops: false,
            rotation: Rotation {
                keep: 1,
                header: Some(Box::new(header.clone())),
                files: 1,
                ..Rotation::default()
            },
            skb_ids: skb_ids::SkbIds::default(),
            lost: false,
            rate_from: None,
            warned_rate: false,
        };
        let mut header = header.clone();
        header.run_id.get_or_insert_with(new_run_id);
        header.file_seq = Some(1);
        w.rotation.header = Some(Box::new(header.clone()));
        w.line(&Line::Header(Box::new(header)));
        w.rotation.start_bytes = w.written;
        // The header is what makes the file readable at all: out first.
        w.flush();
        match w.warning.take() {
            Some(why) => Err(RecordingError::Write(io::Error::other(why))),
            None => Ok(w),
        }
    }

    pub fn event(&mut self, ev: &PacketEvent) {
        let mut ev = *ev;
        ev.skb = self.skb_ids.id(ev.skb, ev.ts_ns);
        self.line(&Line::Event(ev));
    }

    /// `--write-keep N`: at the cap, rotate (keeping N files in all)
    /// instead of stopping.
    pub fn keep_files(&mut self, keep: usize) {
        self.rotation.keep = keep.max(1);
    }

    /// Files started so far (1 + rotations).
    pub fn files_written(&self) -> u64 {
        self.rotation.files
    }

    /// kube-proxy's rules changed: recorded, and the header of the next
    /// rotated file carries them.
    pub fn rules(&mut self, rules: &KubeProxyRules) {
        if let Some(h) = self.rotation.header.as_mut() {
            h.kube_proxy = rules.clone();
        }
        self.line(&Line::Rules {
            kube_proxy: rules.clone(),
        });
    }

    /// The node's sysctls changed (read again when a flow went wrong).
    pub fn sysctls(&mut self, s: crate::facts::Sysctls) {
        if let Some(h) = self.rotation.header.as_mut() {
            h.facts.set_sysctls(s);
        }
        self.line(&Line::Sysctls(s));
    }

    /// The node's pod namespaces as read now.
    pub fn pods(&mut self, pods: &crate::pods::PodIndex) {
        self.rotation.pods = Some(pods.clone());
        self.line(&Line::Pods(pods.clone()));
    }

    /// conntrack's table read again (a request dropped before any DNAT).
    pub fn conntrack(&mut self, t: crate::facts::ConntrackTable) {
        self.line(&Line::Conntrack(t));
    }

    /// conntrack's entry of a flow that failed the watch.
    pub fn ct_entry(&mut self, l: &crate::ctnetlink::CtLookup) {
        self.line(&Line::CtEntry(Box::new(l.clone())));
    }

    pub fn interface(&mut self, netns: u32, ifindex: u32, name: &str) {
        let names = &mut self.rotation.interfaces;
        if names.len() >= MAX_KEPT_NAMES {
            names.clear();
        }
        names.insert((netns, ifindex), name.to_owned());
        self.line(&Line::Interface(InterfaceName {
            netns,
            ifindex,
            name: name.to_owned(),
        }));
    }

    /// At every collector tick; also where the ≤ 1 s flush happens.
    pub fn stats(&mut self, line: StatsLine) {
        self.rotation.last = line;
        let line = self.with_dropped(line);
        self.line(&Line::Stats(line));
        self.predict_cap(line.now_ns);
        if self.last_flush.elapsed() >= FLUSH_EVERY {
            self.flush();
        }
    }

    /// Without `--write-keep` the recording stops at `--write-max-mb`: say
    /// so ahead, once, when the rate predicts it within minutes, so the
    /// incident is not left unrecorded by surprise.
    fn predict_cap(&mut self, now_ns: u64) {
        let Some(limit) = self.limit else { return };
        if self.warned_rate || self.rotation.keep > 1 || self.out.is_none() {
            return;
        }
        let Some((t0, w0)) = self.rate_from else {
            self.rate_from = Some((now_ns, self.written));
            return;
        };
        let dt = now_ns.saturating_sub(t0);
        if dt < RATE_WINDOW_NS {
            return;
        }
        self.rate_from = Some((now_ns, self.written));
        let grown = self.written.saturating_sub(w0);
        if grown == 0 {
            return;
        }
        let left = limit.saturating_sub(self.written);
        let eta_ns = (left as u128 * dt as u128 / grown as u128) as u64;
        if eta_ns >= CAP_WARN_NS || self.warning.is_some() {
            return;
        }
        self.warned_rate = true;
        let mib_s = grown as f64 / (1 << 20) as f64 / (dt as f64 / 1e9);
        self.warning = Some(format!(
            "recording {} grows {mib_s:.1} MiB/s: it reaches --write-max-mb ({} MiB) in about {} s and then stops recording (tracing goes on); raise --write-max-mb, or rotate with --write-keep N",
            self.path.display(),
            limit >> 20,
            eta_ns / 1_000_000_000
        ));
    }

    pub fn end(&mut self, line: StatsLine) {
        self.rotation.last = line;
        let line = self.with_dropped(line);
        self.line(&Line::End(line));
        self.flush();
    }

    /// Lines dropped from the recording (queue full) are events missing
    /// from it: to a reader, lost events.
    fn with_dropped(&self, mut line: StatsLine) -> StatsLine {
        let base = &self.rotation.base;
        line.lost_events = line.lost_events.saturating_sub(base.lost_events);
        line.kernel_events = line.kernel_events.saturating_sub(base.kernel_events);
        line.muted_packets = line.muted_packets.saturating_sub(base.muted_packets);
        line.flow_map_full = line.flow_map_full.saturating_sub(base.flow_map_full);
        line.held_discarded = line.held_discarded.saturating_sub(base.held_discarded);
        line.held_spilled = line.held_spilled.saturating_sub(base.held_spilled);
        line.held_map_full = line.held_map_full.saturating_sub(base.held_map_full);
        line.skipped_runs = line.skipped_runs.saturating_sub(base.skipped_runs);
        line.lost_events += self.dropped_lines();
        line
    }

    /// Lines dropped because the target did not keep up.
    pub fn dropped_lines(&self) -> u64 {
        self.out.as_ref().map_or(0, |o| o.queue().dropped_lines())
    }

    /// A one-line warning, once per cause: the recording stopped (cap or
    /// error), or lines were dropped.
    pub fn take_warning(&mut self) -> Option<String> {
        if let Some(Err(e)) = self.out.as_ref().map(|o| o.queue().check()) {
            self.fail(e);
        }
        if self.warning.is_none() && !self.warned_drops && self.dropped_lines() > 0 {
            self.warned_drops = true;
            return Some(format!(
                "recording {} is not being written fast enough: dropping events beyond {} KiB queued (recorded as lost events)",
                self.path.display(),
                queue::queue_bytes(QUEUE_BYTES) >> 10
            ));
        }
        self.warning.take()
    }

    /// Waits until what was recorded is written, at most until `deadline`
    /// and no longer than `stall` without progress. False if it gave up.
    pub fn drain(&mut self, deadline: Instant, stall: Duration) -> bool {
        let mut done = true;
        for out in [self.out.as_mut(), self.retired.as_mut()]
            .into_iter()
            .flatten()
        {
            let _ = out.flush();
            done &= out.queue().drain(deadline, stall).done;
        }
        done
    }

    /// Whether part of the session is missing from the recording: a write
    /// or rotation failed (a full disk), or lines were dropped. Call after
    /// [`drain`](Self::drain): the last write's error shows only then.
    pub fn lost_output(&mut self) -> bool {
        for out in [self.out.as_ref(), self.retired.as_ref()]
            .into_iter()
            .flatten()
        {
            if out.queue().check().is_err() {
                self.lost = true;
            }
        }
        if let Some(Err(e)) = self.out.as_ref().map(|o| o.queue().check()) {
            self.fail(e);
        }
        self.lost || self.dropped_lines() > 0
    }

    pub fn bytes_written(&self) -> u64 {
        self.written
    }
    fn line(&mut self, line: &Line) {
        if self.out.is_none() {
            return;
        }
        // serde_json cannot fail on these types; a Vec keeps a line atomic
        // with respect to the cap.
        let mut buf = serde_json::to_vec(line).unwrap_or_default();
        buf.push(b'\n');
        if let Some(limit) = self.limit
            && self.written + buf.len() as u64 > limit
            && !self.rotation.starting
            && self.written > self.rotation.start_bytes
            && self.rotation.keep > 1
            && self.path.is_file()
        {
            self.rotate();
            return self.line(line);
        }
        let Some(out) = self.out.as_mut() else {
            return;
        };
        if let Some(limit) = self.limit
            && self.written + buf.len() as u64 > limit
            && !self.rotation.starting
        {
            let capped = Line::Capped {
                bytes: self.written,
            };
            let mut marker = serde_json::to_vec(&capped).unwrap_or_default();
            marker.push(b'\n');
            let _ = out.write_all(&marker).and_then(|()| out.flush());
            self.retired = self.out.take();
            self.warning = Some(format!(
                "recording {} reached the --write-max-mb limit ({} bytes): no longer recording, still tracing",
                self.path.display(),
                self.written
            ));
            return;
        }
        match out.write_all(&buf) {
            Ok(()) => self.written += buf.len() as u64,
            Err(e) => self.fail(e),
        }
    }

    /// FILE → FILE.1 (older ones shift, the oldest goes) and a new FILE
    /// with the header and interface names, counting from zero. A failure
    /// stops the recording, never the trace.
    fn rotate(&mut self) {
        let Some(mut old) = self.out.take() else {
            return;
        };
        let mut marker = serde_json::to_vec(&Line::Rotated {
            bytes: self.written,
        })
        .unwrap_or_default();
        marker.push(b'\n');
        let _ = old.write_all(&marker).and_then(|()| old.flush());
        // The previous retired writer finishes its file on its own thread.
        self.retired = Some(old);
        let started = rotate::shift(&self.path, self.rotation.keep)
            .and_then(|()| queue::create_output(&self.path))
            .and_then(|file| {
                WriteQueue::spawn(
                    "recording",
                    Box::new(file),
                    queue::queue_bytes(QUEUE_BYTES),
                    Overflow::Drop,
                )
            });
        let queue = match started {
            Ok(queue) => queue,
            Err(e) => {
                self.lost = true;
                self.warning = Some(format!(
                    "rotating recording {} failed ({e}): no longer recording, still tracing",
                    self.path.display()
                ));
                return;
            }
        };
        self.out = Some(QueueWriter::new(queue));
        self.written = 0;
        self.rotation.base = self.rotation.last;
        self.rotation.files += 1;
        self.rotation.starting = true;
        if let Some(h) = self.rotation.header.as_mut() {
            h.file_seq = Some(self.rotation.files);
        }
        if let Some(header) = self.rotation.header.clone() {
            self.line(&Line::Header(header));
        }
        let names = std::mem::take(&mut self.rotation.interfaces);
        for (&(netns, ifindex), name) in &names {
            self.line(&Line::Interface(InterfaceName {
                netns,
                ifindex,
                name: name.clone(),
            }));
        }
        self.rotation.interfaces = names;
        if let Some(pods) = self.rotation.pods.clone() {
            self.line(&Line::Pods(pods));
        }
        self.rotation.starting = false;
        self.rotation.start_bytes = self.written;
        self.flush();
    }

    fn flush(&mut self) {
        self.last_flush = Instant::now();
        if let Some(out) = self.out.as_mut()
            && let Err(e) = out.flush()
        {
            self.fail(e);
        }
    }

    fn fail(&mut self, e: io::Error) {
        self.lost = true;
        self.retired = self.out.take();
        self.warning = Some(format!(
            "writing recording {} failed ({e}): no longer recording, still tracing",
            self.path.display()
        ));
    }
}
