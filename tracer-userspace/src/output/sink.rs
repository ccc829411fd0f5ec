//! Where decided flows go, the same for a live session and `nattrace
//! analyze`: stdout as text or JSON lines, and optionally a pcapng file.
//! Both are written by threads of their own through bounded queues
//! ([`super::queue`]), so a reader that stops reading never stalls the
//! caller: a live session drops (and counts) what does not fit, `analyze`
//! waits for room.
use std::{
    fs::File,
    io::{self, Write},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use super::{
    json::JsonOutput,
    pcapng::PcapngOutput,
    queue::{self, Overflow, QueueWriter, WriteQueue, queue_bytes},
    text::{TextOutput, TextStyle},
};
use crate::{
    collector::{FlowReport, Summary, Verdict},
    recording::Header,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    Text,
    Json,
}

/// What was decided, for the exit status.
#[derive(Debug, Default)]
pub struct Outcome {
    pub flows: usize,
    pub problem_flows: usize,
    /// Tracing stopped because it could not go on (the namespace was
    /// deleted); what was decided until then was printed.
    pub aborted: bool,
    /// Something the user asked for was not (all) written: the recording or
    /// pcapng failed, stdout was closed, or (`analyze`) recording lines
    /// could not be read. Each was warned about once.
    pub output_lost: bool,
    /// The Services (original destinations) of every flow decided.
    pub services_seen: std::collections::HashSet<std::net::SocketAddr, foldhash::fast::RandomState>,
    /// `--svc` targets no flow was seen to (set at the end of a live run
    /// with `--svc`, not `--all-services`).
    pub no_flow: Vec<String>,
}

/// `traced, but output was lost` (README's exit-status table).
pub const EXIT_OUTPUT_LOST: u8 = 3;
/// `traced, but a --svc saw no connection at all` (README's table): a
/// mistyped address must not look like a healthy Service.
pub const EXIT_NO_FLOW: u8 = 4;

impl Outcome {
    /// 0 = every flow fine, 1 = at least one flow not `ok`, 2 = aborted,
    /// 3 = output lost. 2 wins over 3 (nothing more could be traced), 3
    /// over 1: with evidence or verdicts missing, "a flow failed" is not
    /// the whole answer, and the warnings on stderr say what was lost.
    /// 4 = a `--svc` saw no flow, only when all else would be 0: a failed
    /// flow says more than an idle target.
    pub fn exit_status(&self) -> u8 {
        if self.aborted {
            return 2;
        }
        if self.output_lost {
            return EXIT_OUTPUT_LOST;
        }
        if self.problem_flows > 0 {
            return 1;
        }
        if !self.no_flow.is_empty() {
            return EXIT_NO_FLOW;
        }
        0
    }

    /// Whether a flow to `svc` (every port when it has none) was decided.
    pub fn saw(&self, svc: &crate::service::Service) -> bool {
        self.services_seen
            .iter()
            .any(|s| s.ip() == svc.addr && svc.port.is_none_or(|p| p == s.port()))
    }
}

/// How much output a live session holds for a reader that is not keeping
/// up: minutes of flows at a busy node's rate, and a bound on memory.
pub const STDOUT_QUEUE_BYTES: usize = 16 << 20;
/// pcapng blocks carry every hop of every packet: more per flow.
pub const PCAP_QUEUE_BYTES: usize = 64 << 20;

enum Stdout {
    Text(TextOutput<QueueWriter>),
    Json(JsonOutput<QueueWriter>),
}

impl Stdout {
    fn writer(&mut self) -> &mut QueueWriter {
        match self {
            Stdout::Text(out) => out.writer(),
            Stdout::Json(out) => out.writer(),
        }
    }
}

pub struct Outputs {
    format: OutputFormat,
    /// `-v`: the start line also names the namespace's inode and why this
    /// probe backend.
    verbose: bool,
    stdout: Stdout,
    overflow: Overflow,
    pcap: Option<(PathBuf, PcapngOutput<QueueWriter>)>,
    pub outcome: Outcome,
    warned_drops: bool,
    warnings: Vec<String>,
    /// stdout failed (closed: EPIPE): nothing more goes there.
    stdout_lost: bool,
    /// `--hide-ok`: an always-on DaemonSet's log would otherwise hold a
    /// ~1.6 KB line per healthy connection (16 MB/s at 10k connections/s),
    /// and writing it is ~45% of the process's instructions per healthy
    /// connection (callgrind, BENCHMARKS.md). Metrics and the summary
    /// still count them.
    hide_ok: bool,
}

impl Outputs {
    /// `overflow`: [`Overflow::Drop`] for a live session (never wait for
    /// the reader), [`Overflow::Block`] for `analyze`.
    pub fn new(
        format: OutputFormat,
        style: TextStyle,
        verbose: bool,
        overflow: Overflow,
    ) -> io::Result<Self> {
        let target = Box::new(queue::stdout_file()?);
        Self::with_target(format, style, verbose, overflow, target)
    }

    /// [`new`](Self::new) writing to `target` instead of stdout itself (a
    /// live run's stdout stepping around the status line on its terminal).
    pub fn with_target(
        format: OutputFormat,
        style: TextStyle,
        verbose: bool,
        overflow: Overflow,
        target: Box<dyn Write + Send>,
    ) -> io::Result<Self> {
        let queue = WriteQueue::spawn("stdout", target, queue_bytes(STDOUT_QUEUE_BYTES), overflow)?;
        let out = QueueWriter::new(queue);
        let stdout = match format {
            OutputFormat::Text => Stdout::Text(TextOutput::new(out, style, verbose)),
            OutputFormat::Json => Stdout::Json(JsonOutput::new(out, verbose)),
        };
        Ok(Self {
            format,
            verbose,
            stdout,
            overflow,
            pcap: None,
            outcome: Outcome::default(),
            warned_drops: false,
            warnings: Vec::new(),
            stdout_lost: false,
            hide_ok: false,
        })
    }

    /// No stdout line for an `ok` flow (`--hide-ok`); the pcapng, when
    /// asked for, still gets its packets.
    pub fn hide_ok(mut self, on: bool) -> Self {
        self.hide_ok = on;
        self
    }

    /// Also write every decided flow's packets to `path` as pcapng.
    pub fn pcap(&mut self, path: &Path, header: &Header) -> io::Result<()> {
        let file = queue::create_output(path).map_err(|e| {
            io::Error::new(e.kind(), format!("cannot create {}: {e}", path.display()))
        })?;
        self.pcap_file(file, path, header)
    }

    /// [`pcap`](Self::pcap) to a file opened already (before attaching).
    pub fn pcap_file(&mut self, file: File, path: &Path, header: &Header) -> io::Result<()> {
        // Dropping a pcapng block could orphan an interface: a pcap that
        // falls behind is given up whole, with a warning.
        let overflow = match self.overflow {
            Overflow::Drop => Overflow::Abandon,
            other => other,
        };
        let queue = WriteQueue::spawn(
            "pcap",
            Box::new(super::pcapng::WholeBlocks::new(file)),
            queue_bytes(PCAP_QUEUE_BYTES),
            overflow,
        )?;
        let description = format!(
            "nattrace trace of {} in netns {} ({} backend)",
            header.services.join(", "),
            header.facts.netns_name,
            header.backend
        );
        let out = PcapngOutput::new(QueueWriter::new(queue), header.clock.clone(), &description)
            .map_err(|e| io::Error::other(format!("writing {}: {e}", path.display())))?;
        self.pcap = Some((path.to_owned(), out));
        Ok(())
    }

    /// Each node's clock for the pcapng of flows merged across nodes.
    pub fn set_node_clocks(
        &mut self,
        clocks: std::collections::HashMap<String, crate::recording::Clock>,
    ) {
        if let Some((_, out)) = self.pcap.as_mut() {
            out.set_node_clocks(clocks);
        }
    }

    pub fn flows(&mut self, reports: &[FlowReport]) -> io::Result<()> {
        for report in reports {
            self.outcome.flows += 1;
            self.outcome.services_seen.insert(report.service);
            // An unseen opening, or a flow cut by the stop, without
            // evidence is not a failure seen.
            if report.verdict != Verdict::Ok && !report.verdict.is_undetermined() {
                self.outcome.problem_flows += 1;
            }
            let hidden = self.hide_ok && report.verdict == Verdict::Ok;
            if !self.stdout_lost && !hidden {
                let written = match &mut self.stdout {
                    Stdout::Text(out) => out.flow(report),
                    Stdout::Json(out) => out.flow(report),
                };
                self.stdout_result(written);
            }
            self.pcap_flow(report);
        }
        if let Some((_, out)) = self.pcap.as_mut()
            && let Err(e) = out.flush()
        {
            self.pcap_failed(&e.to_string());
        }
        self.flush_stdout();
        Ok(())
    }

    fn flush_stdout(&mut self) {
        if self.stdout_lost {
            return;
        }
        let flushed = match &mut self.stdout {
            Stdout::Text(out) => out.flush(),
            Stdout::Json(out) => out.flush(),
        };
        self.stdout_result(flushed);
    }

    /// A closed stdout (`| head`, a reader that died: EPIPE) must not stop
    /// the trace or the recording: warned once, counted as output lost.
    fn stdout_result(&mut self, result: io::Result<()>) {
        let result = result.and_then(|()| self.stdout.writer().queue().check());
        if let Err(e) = result
            && !self.stdout_lost
        {
            self.stdout_lost = true;
            self.outcome.output_lost = true;
            self.warnings.push(format!(
                "writing to stdout failed ({e}); no longer printing flows, still tracing"
            ));
        }
    }

    pub fn summary(&mut self, summary: &Summary) -> io::Result<()> {
        if let Some((_, out)) = self.pcap.as_mut()
            && let Err(e) = out.flush()
        {
            self.pcap_failed(&e.to_string());
        }
        let dropped = self.dropped_lines();
        if self.stdout_lost {
            return Ok(());
        }
        let written = match &mut self.stdout {
            Stdout::Text(out) => out.summary(summary, dropped),
            Stdout::Json(out) => out.summary(summary, dropped),
        };
        self.stdout_result(written);
        Ok(())
    }

    /// Output lines dropped so far because stdout was not read fast enough.
    pub fn dropped_lines(&mut self) -> u64 {
        self.stdout.writer().queue().dropped_lines()
    }

    /// Warnings for stderr (the caller decides how to print them without
    /// blocking): a pcap given up, and once, output lines being dropped.
    pub fn take_warnings(&mut self) -> Vec<String> {
        if !self.warned_drops && self.dropped_lines() > 0 {
            self.warned_drops = true;
            self.warnings.push(format!(
                "stdout is not being read fast enough: dropping output lines beyond {} KiB queued (counted in the summary)",
                queue_bytes(STDOUT_QUEUE_BYTES) >> 10
            ));
        }
        std::mem::take(&mut self.warnings)
    }

    /// Waits for stdout and the pcap to be written, at most until
    /// `deadline` and no longer than `stall` without progress; returns a
    /// warning per target left unwritten.
    pub fn drain(&mut self, deadline: Instant, stall: Duration) -> Vec<String> {
        let mut warnings = Vec::new();
        let _ = self.stdout.writer().flush();
        let d = self.stdout.writer().queue().drain(deadline, stall);
        // The last lines' write failing (EPIPE) shows only now.
        self.stdout_result(Ok(()));
        warnings.append(&mut self.warnings);
        if !d.done {
            warnings.push(format!(
                "stdout is not being read: {} output lines were not written",
                d.unwritten_lines
            ));
        }
        if let Some((path, out)) = self.pcap.as_mut() {
            let _ = out.flush();
            if !out.writer().queue().drain(deadline, stall).done {
                self.outcome.output_lost = true;
                warnings.push(format!(
                    "{} is not being read: the pcapng file is incomplete",
                    path.display()
                ));
            } else if let Err(e) = out.writer().queue().check() {
                self.outcome.output_lost = true;
                warnings.push(format!(
                    "writing {} failed ({e}); it holds what was written before",
                    path.display()
                ));
            }
        }
        warnings
    }

    /// A failing pcap (full disk) must not stop the trace: warn once, go on without it.
    fn pcap_flow(&mut self, report: &FlowReport) {
        if let Some((_, out)) = self.pcap.as_mut()
            && let Err(e) = out.flow(report)
        {
            self.pcap_failed(&e.to_string());
        }
    }

    fn pcap_failed(&mut self, why: &str) {
        if let Some((path, _)) = self.pcap.take() {
            self.outcome.output_lost = true;
            self.warnings.push(format!(
                "writing {} failed ({why}); no longer writing it",
                path.display()
            ));
        }
    }

    /// One line of static facts before the flows, so a reader knows what was
    /// traced and how. From the header, so `analyze` prints the same.
    pub fn preamble(&mut self, h: &Header) -> io::Result<()> {
        let facts = &h.facts;
        let format = self.format;
        let stdout = self.stdout.writer();
        match format {
            OutputFormat::Text => {
                let bridge_nf = match facts.bridge_nf_call_iptables {
                    Some(true) => "1",
                    Some(false) => "0",
                    None => "absent (br_netfilter not loaded)",
                };
                // Only priorities that moved off their defaults (a busy node).
                let priorities = crate::probes::table::priorities_note(&h.nf_priorities)
                    .map(|note| format!("; {note}"))
                    .unwrap_or_default();
                // The inode and why this backend are for whoever debugs
                // nattrace (`-v`; JSON has both), not for the on-call.
                let detail = if self.verbose {
                    format!(
                        "; netns inode {}; {} probes ({})",
                        facts.netns_inode, h.backend, h.backend_reason
                    )
                } else {
                    String::new()
                };
                // Every part may come from a recording: sanitized whole.
                let mut text = format!(
                    "nattrace: tracing {} in netns {} on {} interfaces; bridge-nf-call-iptables={}{priorities}{detail}\n",
                    traced_text(h),
                    facts.netns_name,
                    facts.interfaces.len(),
                    bridge_nf,
                );
                if let Some(line) = &h.checks_line {
                    text.push_str(&format!("nattrace: {line}\n"));
                }
                stdout.write_all(super::clean::sanitize(&text).as_bytes())
            }
            OutputFormat::Json => writeln!(
                stdout,
                "{}",
                serde_json::json!({
                    "kind": "start",
                    "services": h.services,
                    "all_services": h.all_services,
                    "netns": facts.netns_name,
                    "netns_inode": facts.netns_inode,
                    "backend": h.backend,
                    "backend_reason": h.backend_reason,
                    "interfaces": facts.interfaces,
                    "bridge_nf_call_iptables": facts.bridge_nf_call_iptables,
                    "ip_forward": facts.ip_forward,
                    "checks": h.checks,
                    "checks_line": h.checks_line,
                    "skipped": h.skipped,
                    "nf_priorities": h.nf_priorities,
                })
            ),
        }?;
        stdout.flush()
    }
}

/// What the start line says is traced.
fn traced_text(h: &Header) -> String {
    match (h.all_services, h.services.is_empty()) {
        (false, _) => h.services.join(", "),
        (true, true) => "every Service in kube-proxy's rules".to_owned(),
        (true, false) => format!(
            "every Service in kube-proxy's rules and {}",
            h.services.join(", ")
        ),
    }
}
