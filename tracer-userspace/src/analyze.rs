//! `nattrace analyze FILE`: the collector over a recording, with the live
//! run's outputs. Feeding order is the live order (events as read, a tick
//! at every `stats` line, finish at `end`), so verdicts match the live run's.
use std::path::PathBuf;

use crate::{
    collector::{Collector, FlowReport},
    output::{
        queue::Overflow,
        sink::{Outcome, OutputFormat, Outputs},
    },
    recording::{Reader, Record, RecordingError},
};

#[derive(Clone, Debug)]
pub struct AnalyzeOptions {
    pub path: PathBuf,
    pub format: OutputFormat,
    pub verbose: bool,
    pub color: bool,
    pub pcap: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum AnalyzeError {
    #[error("{0}")]
    Recording(#[from] RecordingError),
    #[error("{0}")]
    Output(std::io::Error),
    /// A header, but not one event that can be read.
    #[error(
        "{path} holds no readable event: {skipped} line(s) after the header are not valid records (first at line {line}: {why}); is it a nattrace recording?"
    )]
    Unreadable {
        path: PathBuf,
        skipped: u64,
        line: u64,
        why: String,
    },
}

/// `nattrace analyze b.rec a.rec …`: every node's recording decided by its
/// own collector, then the flows merged across nodes (`crate::merge`).
pub fn run_nodes(opts: &AnalyzeOptions, paths: &[PathBuf]) -> Result<Outcome, AnalyzeError> {
    let mut nodes = Vec::new();
    let mut headers = Vec::new();
    for path in paths {
        let (mut reader, header) = Reader::open(path)?;
        let stem = path.file_stem().map_or_else(
            || path.display().to_string(),
            |s| s.to_string_lossy().into_owned(),
        );
        let mut name = header.node.clone().unwrap_or(stem);
        // Two recordings of one node name (copies, or old files): tell them apart.
        if nodes
            .iter()
            .any(|n: &crate::merge::NodeFlows| n.name.as_str() == name)
        {
            name = format!("{name}#{}", nodes.len() + 1);
        }
        let node = crate::merge::decide_node(&name, &header, reader.by_ref())?;
        if let Some(first) = &reader.first_skipped {
            eprintln!(
                "nattrace: warning: recording {} has {} unreadable line(s), skipped (first at line {}: {})",
                path.display(),
                reader.skipped_lines,
                first.line,
                first.why
            );
        }
        if let Some(p) = reader.problem() {
            eprintln!(
                "nattrace: warning: recording {} is truncated (line {}: {}); its flows still open at the cut may lack evidence",
                path.display(),
                p.line,
                p.why
            );
        }
        nodes.push(node);
        headers.push(header);
    }
    let (reports, summary) = crate::merge::merge(&nodes);
    let mut out = Outputs::new(opts.format, opts.color, opts.verbose, Overflow::Block)
        .map_err(AnalyzeError::Output)?;
    if let Some(pcap) = &opts.pcap {
        out.pcap(pcap, &headers[0]).map_err(AnalyzeError::Output)?;
        out.set_node_clocks(
            nodes
                .iter()
                .zip(&headers)
                .filter_map(|(n, h)| Some((n.name.to_string(), h.clock.clone()?)))
                .collect(),
        );
    }
    for h in &headers {
        out.preamble(h).map_err(AnalyzeError::Output)?;
    }
    out.flows(reports).map_err(AnalyzeError::Output)?;
    out.summary(&summary).map_err(AnalyzeError::Output)?;
    let forever = std::time::Instant::now() + std::time::Duration::from_secs(365 * 24 * 3600);
    out.drain(forever, std::time::Duration::from_secs(365 * 24 * 3600));
    for w in out.take_warnings() {
        eprintln!("nattrace: warning: {w}");
    }
    Ok(std::mem::take(&mut out.outcome))
}

pub fn run(opts: &AnalyzeOptions) -> Result<Outcome, AnalyzeError> {
    let (mut reader, header) = Reader::open(&opts.path)?;
    let mut collector = Collector::new(header.collector_config()?);
    if let Some(v) = reader.newer_version {
        eprintln!(
            "nattrace: warning: {} is format version {v}, newer than this nattrace's; reading what it understands",
            opts.path.display()
        );
    }
    // Opened at the first event: a file with none is refused in one line
    // (no preamble on stdout, no empty pcap).
    let mut outputs: Option<Outputs> = None;
    let open = |outputs: &mut Option<Outputs>| -> Result<(), AnalyzeError> {
        if outputs.is_some() {
            return Ok(());
        }
        let mut out = Outputs::new(opts.format, opts.color, opts.verbose, Overflow::Block)
            .map_err(AnalyzeError::Output)?;
        if let Some(pcap) = &opts.pcap {
            out.pcap(pcap, &header).map_err(AnalyzeError::Output)?;
        }
        out.preamble(&header).map_err(AnalyzeError::Output)?;
        *outputs = Some(out);
        Ok(())
    };

    let mut last_ts = 0u64;
    let mut end = None;
    let mut capped = None;
    let mut rotated = None;
    // The kernel's loss count as recorded, and lines skipped as unreadable:
    // both are events missing from the flows around them.
    let mut lost = 0u64;
    let mut skipped = 0u64;
    while let Some(record) = reader.next() {
        if reader.skipped_lines > skipped {
            skipped = reader.skipped_lines;
            collector.note_lost(lost + skipped);
        }
        match record {
            Record::Event(ev) => {
                open(&mut outputs)?;
                last_ts = last_ts.max(ev.ts_ns);
                collector.push(ev);
            }
            Record::Interface(i) => collector.learn_interface(i.netns, i.ifindex, &i.name),
            Record::Stats(s) => {
                last_ts = last_ts.max(s.now_ns);
                lost = lost.max(s.lost_events);
                collector.note_lost(lost + skipped);
                let reports = collector.tick(s.now_ns);
                if !reports.is_empty() {
                    open(&mut outputs)?;
                    let out = outputs.as_mut().expect("just opened");
                    out.flows(reports).map_err(AnalyzeError::Output)?;
                }
            }
            Record::Capped { bytes } => capped = Some(bytes),
            Record::Rotated { bytes } => rotated = Some(bytes),
            Record::Rules(rules) => collector.update_rules(*rules),
            Record::End(s) => end = Some(s),
        }
    }
    skipped = reader.skipped_lines;
    if outputs.is_none()
        && let Some(first) = &reader.first_skipped
    {
        return Err(AnalyzeError::Unreadable {
            path: opts.path.clone(),
            skipped,
            line: first.line,
            why: first.why.clone(),
        });
    }
    open(&mut outputs)?;
    let mut outputs = outputs.expect("just opened");
    if let Some(first) = &reader.first_skipped {
        eprintln!(
            "nattrace: warning: recording {} has {skipped} unreadable line(s), skipped (first at line {}: {}); flows around them are marked incomplete",
            opts.path.display(),
            first.line,
            first.why
        );
    }
    let (now, muted) = match end {
        Some(s) => {
            lost = lost.max(s.lost_events);
            (s.now_ns.max(last_ts), s.muted_packets)
        }
        None => (last_ts, 0),
    };
    collector.note_lost(lost + skipped);
    let (mut reports, mut summary) = collector.finish(now);
    if end.is_none() {
        // These flows were still open when the recording stopped: what
        // follows them was not recorded, so their verdict is not confirmed.
        for r in &mut reports {
            if mark_unfinished(r) {
                summary.incomplete_flows += 1;
            }
        }
        let why = match (capped, rotated, reader.problem()) {
            (Some(bytes), _, _) => {
                format!("it stopped at the --write-max-mb limit ({bytes} bytes)")
            }
            (None, Some(bytes), _) => format!(
                "rotated at {bytes} bytes: the run goes on in the next file, {}",
                newer_file(&opts.path)
            ),
            (None, None, Some(p)) => format!("line {}: {}", p.line, p.why),
            (None, None, None) => "no end record".to_owned(),
        };
        eprintln!(
            "nattrace: warning: recording {} is truncated ({why}); read {} lines, flows still open at the cut are marked incomplete",
            opts.path.display(),
            reader.lines_read()
        );
    }
    // Events the kernel (or the recording's writer) lost; skipped lines
    // have their own warning.
    summary.lost_events = lost;
    summary.muted_packets = muted;
    outputs.flows(reports).map_err(AnalyzeError::Output)?;
    outputs.summary(&summary).map_err(AnalyzeError::Output)?;
    // Nothing is live here: wait for the reader, however slow.
    let forever = std::time::Instant::now() + std::time::Duration::from_secs(365 * 24 * 3600);
    outputs.drain(forever, std::time::Duration::from_secs(365 * 24 * 3600));
    for w in outputs.take_warnings() {
        eprintln!("nattrace: warning: {w}");
    }
    Ok(std::mem::take(&mut outputs.outcome))
}

/// The file a rotated recording continues in: FILE.(i-1), or FILE for FILE.1.
fn newer_file(path: &std::path::Path) -> String {
    let name = path.to_string_lossy();
    match name.rsplit_once('.') {
        Some((base, i)) if i.parse::<usize>().is_ok_and(|i| i >= 1) => {
            let i: usize = i.parse().unwrap_or(1);
            crate::recording::rotate::rotated_name(std::path::Path::new(base), i - 1)
                .display()
                .to_string()
        }
        _ => format!("{name} (renamed {name}.1 when it was rotated)"),
    }
}

fn mark_unfinished(r: &mut FlowReport) -> bool {
    if r.incomplete {
        return false;
    }
    r.incomplete = true;
    r.detail
        .push_str("; the recording ends before this flow was decided, evidence may be incomplete");
    true
}
