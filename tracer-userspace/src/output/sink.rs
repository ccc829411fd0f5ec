//! Where decided flows go, the same for a live session and `nattrace
//! analyze`: stdout as text or JSON lines, and optionally a pcapng file.
use std::{
    fs::File,
    io::{self, BufWriter, Write},
    path::{Path, PathBuf},
};

use super::{json::JsonOutput, pcapng::PcapngOutput, text::TextOutput};
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
}

impl Outcome {
    /// 0 = every flow fine, 1 = at least one flow not `ok`.
    pub fn exit_status(&self) -> u8 {
        u8::from(self.problem_flows > 0)
    }
}

/// Buffered, flushed once per batch of flows: stdout is line-buffered, and
/// a write(2) per flow (plus waking whoever reads the pipe) is most of the
/// output's cost at thousands of flows per second.
type Buffered = BufWriter<io::Stdout>;

enum Stdout {
    Text(TextOutput<Buffered>),
    Json(JsonOutput<Buffered>),
}

pub struct Outputs {
    format: OutputFormat,
    stdout: Stdout,
    pcap: Option<(PathBuf, PcapngOutput<BufWriter<File>>)>,
    pub outcome: Outcome,
}

fn buffered() -> Buffered {
    BufWriter::with_capacity(256 * 1024, io::stdout())
}

impl Outputs {
    pub fn new(format: OutputFormat, color: bool, verbose: bool) -> Self {
        let stdout = match format {
            OutputFormat::Text => Stdout::Text(TextOutput::new(buffered(), color, verbose)),
            OutputFormat::Json => Stdout::Json(JsonOutput::new(buffered(), verbose)),
        };
        Self {
            format,
            stdout,
            pcap: None,
            outcome: Outcome::default(),
        }
    }

    /// Also write every decided flow's packets to `path` as pcapng.
    pub fn pcap(&mut self, path: &Path, header: &Header) -> io::Result<()> {
        let file = File::create(path).map_err(|e| {
            io::Error::new(e.kind(), format!("cannot create {}: {e}", path.display()))
        })?;
        let description = format!(
            "nattrace trace of {} in netns {} ({} backend)",
            header.services.join(", "),
            header.facts.netns_name,
            header.backend
        );
        let out = PcapngOutput::new(BufWriter::new(file), header.clock.clone(), &description)
            .map_err(|e| io::Error::other(format!("writing {}: {e}", path.display())))?;
        self.pcap = Some((path.to_owned(), out));
        Ok(())
    }

    pub fn flows(&mut self, reports: Vec<FlowReport>) -> io::Result<()> {
        for report in &reports {
            self.outcome.flows += 1;
            if report.verdict != Verdict::Ok {
                self.outcome.problem_flows += 1;
            }
            match &mut self.stdout {
                Stdout::Text(out) => out.flow(report)?,
                Stdout::Json(out) => out.flow(report)?,
            }
            self.pcap_flow(report);
        }
        match &mut self.stdout {
            Stdout::Text(out) => out.flush(),
            Stdout::Json(out) => out.flush(),
        }
    }

    pub fn summary(&mut self, summary: &Summary) -> io::Result<()> {
        if let Some((path, out)) = self.pcap.as_mut()
            && let Err(e) = out.flush()
        {
            eprintln!("nattrace: warning: writing {} failed: {e}", path.display());
        }
        match &mut self.stdout {
            Stdout::Text(out) => out.summary(summary),
            Stdout::Json(out) => out.summary(summary),
        }
    }

    /// A failing pcap (full disk) must not stop the trace: warn once, go on without it.
    fn pcap_flow(&mut self, report: &FlowReport) {
        if let Some((path, out)) = self.pcap.as_mut()
            && let Err(e) = out.flow(report)
        {
            eprintln!(
                "nattrace: warning: writing {} failed ({e}); no longer writing it",
                path.display()
            );
            self.pcap = None;
        }
    }

    /// One line of static facts before the flows, so a reader knows what was
    /// traced and how. From the header, so `analyze` prints the same.
    pub fn preamble(&mut self, h: &Header) -> io::Result<()> {
        let facts = &h.facts;
        let mut stdout = io::stdout().lock();
        match self.format {
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
                writeln!(
                    stdout,
                    "nattrace: tracing {} in netns {} (inode {}) with the {} backend ({}) on {} interfaces; bridge-nf-call-iptables={}{priorities}",
                    h.services.join(", "),
                    facts.netns_name,
                    facts.netns_inode,
                    h.backend,
                    h.backend_reason,
                    facts.interfaces.len(),
                    bridge_nf,
                )?;
                match &h.checks_line {
                    Some(line) => writeln!(stdout, "nattrace: {line}"),
                    None => Ok(()),
                }
            }
            OutputFormat::Json => writeln!(
                stdout,
                "{}",
                serde_json::json!({
                    "kind": "start",
                    "services": h.services,
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
