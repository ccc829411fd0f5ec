//! Per decided flow a headline (mark, verdict, client → Service → backend)
//! and indented lines for the evidence, the cause and the fix, wrapped to
//! fit a terminal (`--wide`: the whole flow on one line, for grep);
//! optionally each packet's hook path under it; a summary line. Colour
//! only when asked (the CLI asks when stdout is a terminal and NO_COLOR is
//! not set), so piped output stays plain.
use std::io::{self, Write as _};

use super::clean::Clean;
use crate::collector::addr_text;
use crate::collector::{FlowReport, Hop, Name, PacketEvidence, Summary, Verdict};
use crate::ruleset::KubeMatch;

const GREEN: &str = "\x1b[32m";
const RED: &str = "\x1b[31m";
const YELLOW: &str = "\x1b[33m";
const DIM: &str = "\x1b[2m";
const BOLD: &str = "\x1b[1m";
const RESET: &str = "\x1b[0m";
/// The only escape sequences that reach the terminal: the colours above.
const OURS: &[&str] = &[GREEN, RED, YELLOW, DIM, BOLD, RESET];

/// Width the indented lines are wrapped to: readable in an 80-column
/// terminal with its scrollbar, and what a pasted incident note shows.
const WRAP: usize = 80;

/// How flows are written as text.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TextStyle {
    /// ANSI colours (a terminal that wants them).
    pub color: bool,
    /// One line per flow (`--wide`).
    pub wide: bool,
}

/// Everything it writes goes through [`Clean`]: names in a flow (interfaces,
/// Services, chains) come from the node or a recording, not from us.
pub struct TextOutput<W: io::Write> {
    out: Clean<W>,
    /// One flow's lines, written (and sanitized) whole: through `Clean`
    /// piece by piece every fragment paid a UTF-8 check, a scan and a
    /// write of its own (callgrind: most of an `ok` flow's text cost).
    buf: Vec<u8>,
    color: bool,
    wide: bool,
    verbose: bool,
}

impl<W: io::Write> TextOutput<W> {
    pub fn new(out: W, style: TextStyle, verbose: bool) -> Self {
        Self {
            out: Clean::new(out, if style.color { OURS } else { &[] }),
            buf: Vec::with_capacity(1024),
            color: style.color,
            wide: style.wide,
            verbose,
        }
    }

    /// The target, for lines that are not flows (the preamble: it
    /// sanitizes its own).
    pub fn writer(&mut self) -> &mut W {
        self.out.get_mut()
    }

    pub fn into_inner(self) -> W {
        self.out.into_inner()
    }

    fn paint(&self, code: &'static str) -> &'static str {
        if self.color { code } else { "" }
    }

    pub fn flow(&mut self, r: &FlowReport) -> io::Result<()> {
        self.buf.clear();
        self.flow_lines(r)?;
        self.out.write_all(&self.buf)
    }

    /// The flow's headline and indented lines, pushed into `buf` piece by
    /// piece: an `ok` flow's four lines went through five `format!`s and
    /// their Strings, ~5.4k of its ~17k instructions (issue 25, callgrind).
    fn flow_lines(&mut self, r: &FlowReport) -> io::Result<()> {
        let (mark, colour) = match (r.verdict, r.incomplete) {
            (_, true) | (Verdict::Unseen | Verdict::Undecided, _) => ("?", YELLOW),
            (Verdict::Ok, _) => ("✓", GREEN),
            _ => ("✗", RED),
        };
        let (c, b, reset) = (self.paint(colour), self.paint(BOLD), self.paint(RESET));
        let buf = &mut self.buf;
        for part in [c, mark, " ", b, r.verdict.as_str(), reset, " "] {
            push(buf, part);
        }
        push(buf, r.proto.as_str());
        push(buf, " ");
        addr_text::push(buf, &r.client);
        push(buf, " → ");
        addr_text::push(buf, &r.service);
        if let Some(backend) = r.backend {
            push(buf, " DNAT→ ");
            addr_text::push(buf, &backend);
        }
        // The names an on-call engineer's next kubectl command needs.
        let pods = match (&r.client_pod, &r.backend_pod) {
            (None, None) => None,
            // As the headline: client → backend.
            (c, b) => Some([
                c.as_ref().map_or("(not a pod of this node)", Name::as_str),
                b.as_ref().map_or("(not a pod of this node)", Name::as_str),
            ]),
        };
        let mut notes = Vec::new();
        if r.incomplete {
            notes.push("incomplete: verdict not confirmed");
        }
        if !r.opening_seen {
            notes.push("opening not seen: began before tracing");
        }
        if self.wide {
            if let Some(snat) = r.snat {
                push(buf, " SNAT→ ");
                addr_text::push(buf, &snat);
            }
            if let Some(k) = &r.kube {
                push(buf, " ");
                chains(buf, k);
            }
            if let Some([client, backend]) = pods {
                for part in [" (pods: ", client, " → ", backend, ")"] {
                    push(buf, part);
                }
            }
            for part in [" — ", &r.detail, "."] {
                push(buf, part);
            }
            if let Some(a) = attempts(r) {
                write!(buf, " Attempts: {a}.")?;
            }
            if let Some(cause) = &r.cause {
                write!(
                    buf,
                    " {b}cause: {}{reset} — fix: {}",
                    cause.id.as_str(),
                    cause.hint
                )?;
            }
            for n in notes {
                write!(buf, " ({n})")?;
            }
            push(buf, "\n");
        } else {
            push(buf, "\n");
            // Addresses and chain names on lines of their own: never cut.
            if let Some(snat) = r.snat {
                push(buf, "    SNAT→ ");
                addr_text::push(buf, &snat);
                push(buf, "\n");
            }
            if let Some(k) = &r.kube {
                push(buf, "    kube-proxy: ");
                chains(buf, k);
                push(buf, "\n");
            }
            if let Some([client, backend]) = pods {
                self.wrapped("pods: ", &[client, " → ", backend])?;
            }
            self.wrapped("", &[&r.detail, "."])?;
            if let Some(a) = attempts(r) {
                self.wrapped("attempts: ", &[&a])?;
            }
            if let Some(cause) = &r.cause {
                writeln!(self.buf, "    {b}cause: {}{reset}", cause.id.as_str())?;
                self.wrapped("fix: ", &[&cause.hint])?;
            }
            for n in notes {
                writeln!(self.buf, "    ({n})")?;
            }
        }
        if self.verbose {
            if let Some(cause) = &r.cause {
                if self.wide {
                    writeln!(self.buf, "    why: {}", cause.text)?;
                } else {
                    self.wrapped("why: ", &[&cause.text])?;
                }
            }
            for p in &r.packets {
                self.packet(r, p)?;
            }
            for e in &r.icmp_errors {
                self.icmp_error(r, e)?;
            }
            if r.truncated {
                writeln!(
                    self.buf,
                    "    (more packets not recorded: per-flow evidence limit)"
                )?;
            }
        }
        Ok(())
    }

    /// `label` and `text` (its parts, joined) on lines indented by four,
    /// wrapped at [`WRAP`] columns (continuations under the text); a word
    /// longer than a line (a chain name, a command) stays whole.
    fn wrapped(&mut self, label: &str, text: &[&str]) -> io::Result<()> {
        // Most lines fit (an `ok` flow's always do): textwrap's Unicode
        // line breaking was half of such a flow's text cost.
        let len: usize = text.iter().map(|t| t.len()).sum();
        if 4 + label.len() + len <= WRAP && !text.iter().any(|t| t.contains('\n')) {
            push(&mut self.buf, "    ");
            push(&mut self.buf, label);
            for t in text {
                push(&mut self.buf, t);
            }
            push(&mut self.buf, "\n");
            return Ok(());
        }
        let text = text.concat();
        let first = format!("    {label}");
        let rest = " ".repeat(first.chars().count());
        let options = textwrap::Options::new(WRAP)
            .initial_indent(&first)
            .subsequent_indent(&rest)
            .break_words(false)
            // A sysctl or a flag is one word: never cut at its hyphens.
            .word_splitter(textwrap::WordSplitter::NoHyphenation)
            // Nor a pod's namespace/name or a path at its slashes (Unicode
            // line breaking allows a break after '/').
            .word_separator(textwrap::WordSeparator::AsciiSpace);
        for line in textwrap::wrap(&text, options) {
            writeln!(self.buf, "{line}")?;
        }
        Ok(())
    }

    fn packet(&mut self, r: &FlowReport, p: &PacketEvidence) -> io::Result<()> {
        let mut head = format!(
            "    {} seq={} ack={} ip_id={}",
            p.kind, p.seq, p.ack, p.ip_id
        );
        if let Some(id) = p.dns_id {
            head.push_str(&format!(" dns_id=0x{id:04x}"));
        }
        writeln!(self.buf, "{head}")?;
        for h in &p.hops {
            let line = self.hop(r, h);
            writeln!(self.buf, "{line}")?;
        }
        Ok(())
    }

    /// An ICMP error about the flow: what, from whom, about which packet,
    /// and whether it reached that packet's sender; its hops show the
    /// quoted packet as the error carried it at each point.
    fn icmp_error(&mut self, r: &FlowReport, e: &crate::collector::IcmpError) -> io::Result<()> {
        let about = match e.about {
            crate::collector::Dir::Request => "request",
            crate::collector::Dir::Reply => "reply",
        };
        let fate = match (&e.dropped, e.reached_sender, e.translated) {
            (Some(reason), _, _) => format!(
                "dropped {} ({reason})",
                e.dropped_at.as_deref().unwrap_or("")
            ),
            (None, true, Some(false)) => "reached the client untranslated".to_string(),
            (None, true, _) => "reached the sender".to_string(),
            (None, false, _) => "never reached the sender".to_string(),
        };
        writeln!(
            self.buf,
            "    {} about the {about} of {} bytes, quoting {} → {}: {fate}",
            e.describe(),
            e.quoted_len,
            e.quoted_src,
            e.quoted_dst
        )?;
        for h in &e.hops {
            let line = self.hop(r, h);
            writeln!(self.buf, "{line}")?;
        }
        Ok(())
    }

    fn hop(&self, r: &FlowReport, h: &Hop) -> String {
        let ms = h.ts_ns.saturating_sub(node_start(r, h)) as f64 / 1e6;
        let mut place = h.hook.to_string();
        if let Some(nf) = h.nf_hook {
            place.push(' ');
            place.push_str(nf);
        }
        if let Some(stage) = h.nat_stage {
            place.push(' ');
            place.push_str(stage);
        }
        if h.hook != "netfilter" {
            match &h.ifname {
                Some(n) => place.push_str(&format!(" {n}")),
                // No device (e.g. a drop when a socket's queue is purged).
                None if h.ifindex == 0 => {}
                // Not resolvable (its namespace was gone before it was looked up).
                None => place.push_str(&format!(" if{}", h.ifindex)),
            }
        }
        let here = match &h.pod {
            Some(pod) => pod.to_string(),
            None => format!("ns {}", h.netns),
        };
        let ns = match (&h.node, h.node_ns) {
            (None, true) => "node".to_string(),
            (None, false) => here,
            (Some(n), true) => n.to_string(),
            (Some(n), false) => format!("{n} {here}"),
        };
        let (dim, reset) = (self.paint(DIM), self.paint(RESET));
        let mut line = format!(
            "      {dim}{ms:>9.3} ms{reset}  {place:<36} {ns:<14} {} → {}",
            h.src, h.dst
        );
        if let Some(reason) = &h.drop_reason {
            line.push_str(&format!("  {}drop: {reason}{reset}", self.paint(RED)));
        }
        if h.client_side {
            line.push_str("  ← the reply as the client gets it: the verdict is read here");
        }
        line
    }

    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    /// `dropped_lines`: output lines a live session dropped because stdout
    /// was not read fast enough.
    pub fn summary(&mut self, s: &Summary, dropped_lines: u64) -> io::Result<()> {
        let by = Verdict::ALL
            .iter()
            // `refused` is rare: listed only when it happened.
            .filter(|v| {
                !matches!(v, Verdict::Refused | Verdict::Unseen | Verdict::Undecided)
                    || s.by_verdict.get(**v) > 0
            })
            .map(|v| format!("{} {}", v.as_str(), s.by_verdict.get(*v)))
            .collect::<Vec<_>>()
            .join(", ");
        let mut line = format!("summary: {} flows ({by})", s.flows);
        if s.incomplete_flows > 0 {
            line.push_str(&format!(", {} incomplete", s.incomplete_flows));
        }
        if s.established_failures > 0 {
            line.push_str(&format!(
                ", {} broke mid-stream after an ok opening",
                s.established_failures
            ));
        }
        line.push_str(&format!("; lost events: {}", s.lost_events));
        if s.skipped_runs > 0 {
            line.push_str(&format!(
                " (and {} program runs the kernel skipped: an event may be missing)",
                s.skipped_runs
            ));
        }
        // conntrack dropping packets itself while tracing (issue 22).
        if let Some(c) = s
            .conntrack
            .filter(|c| c.dropped() > 0 || c.early_drop.unwrap_or(0) > 0)
        {
            line.push_str(&format!(
                "; conntrack counters rose during the run: {}",
                c.describe()
            ));
        }
        if dropped_lines > 0 {
            line.push_str(&format!(
                "; output lines dropped (stdout not read fast enough): {dropped_lines}"
            ));
        }
        if s.foreign_flows > 0 {
            line.push_str(&format!(
                "; {} flows of other namespaces ignored",
                s.foreign_flows
            ));
        }
        if s.evicted_flows > 0 && !self.verbose {
            line.push_str(&format!(
                "; {} flows evicted (flow table full, --max-flows)",
                s.evicted_flows
            ));
        }
        if self.verbose {
            line.push_str(&format!(
                "; events {}, duplicates {}, late {}, unmatched {}, evicted flows {}, muted packets {}",
                s.events, s.duplicate_events, s.late_events, s.unmatched_events, s.evicted_flows, s.muted_packets
            ));
        }
        if self.verbose && s.buffered_flows + s.held_map_full > 0 {
            // The kernel's per-flow buffer (DESIGN.md, "Event budget"): how
            // nattrace kept its cost down, not news about the Service.
            line.push_str(&format!(
                "; kernel buffer: {} flows held (events of healthy flows discarded {}, sent {}, pulled {}; spilled {}; buffer full {})",
                s.buffered_flows,
                s.held_discarded,
                s.flushed_events,
                s.pulled_events,
                s.held_spilled,
                s.held_map_full
            ));
        }
        writeln!(self.out, "{line}")?;
        self.out.flush()
    }
}

/// Times count from the flow's first event; in a flow merged across nodes,
/// from that node's first event of the flow: the nodes' clocks are not
/// comparable.
fn node_start(r: &FlowReport, h: &Hop) -> u64 {
    let Some(node) = &h.node else {
        return r.first_ts_ns;
    };
    r.packets
        .iter()
        .flat_map(|p| &p.hops)
        .filter(|x| x.node.as_ref() == Some(node))
        .map(|x| x.ts_ns)
        .min()
        .unwrap_or(h.ts_ns)
}

fn push(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(s.as_bytes());
}

/// `[Service SVC-chain → SEP-chain]`: kube-proxy's chains that sent the
/// flow to its backend.
fn chains(buf: &mut Vec<u8>, k: &KubeMatch) {
    for part in ["[", &k.service, " ", &k.svc_chain] {
        push(buf, part);
    }
    if let Some(sep) = &k.sep_chain {
        push(buf, " → ");
        push(buf, sep);
    }
    push(buf, "]");
}

/// The opening request's transmissions, briefly, when there was more than
/// one backend or more than one attempt: "100.96.54.247:80 (KUBE-SEP-…)
/// dropped NEIGH_FAILED at +0 ms, 100.96.54.248:80 answered at +1012 ms".
fn attempts(r: &FlowReport) -> Option<String> {
    let first = r.attempts.first()?;
    let several_backends = r.attempts.iter().any(|a| a.backend != first.backend);
    if r.attempts.len() < 2 || (!several_backends && r.verdict == Verdict::Ok) {
        return None;
    }
    let parts: Vec<String> = r
        .attempts
        .iter()
        .map(|a| {
            let to = a
                .backend
                .map_or_else(|| "not DNATed".to_string(), |b| b.to_string());
            let what = match (&a.dropped, a.answered) {
                (_, true) => "answered".to_string(),
                (Some(reason), false) => format!("dropped {reason}"),
                (None, false) => "no answer".to_string(),
            };
            let ms = a.at_ns.saturating_sub(r.first_ts_ns) / 1_000_000;
            format!("+{ms} ms → {to} {what}")
        })
        .collect();
    Some(parts.join(", "))
}
