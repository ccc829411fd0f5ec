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
}

pub fn run(opts: &AnalyzeOptions) -> Result<Outcome, AnalyzeError> {
    let (mut reader, header) = Reader::open(&opts.path)?;
    let mut collector = Collector::new(header.collector_config()?);
    let mut outputs = Outputs::new(opts.format, opts.color, opts.verbose, Overflow::Block)
        .map_err(AnalyzeError::Output)?;
    if let Some(pcap) = &opts.pcap {
        outputs.pcap(pcap, &header).map_err(AnalyzeError::Output)?;
    }
    if let Some(v) = reader.newer_version {
        eprintln!(
            "nattrace: warning: {} is format version {v}, newer than this nattrace's; reading what it understands",
            opts.path.display()
        );
    }
    outputs.preamble(&header).map_err(AnalyzeError::Output)?;

    let mut last_ts = 0u64;
    let mut end = None;
    let mut capped = None;
    for record in reader.by_ref() {
        match record {
            Record::Event(ev) => {
                last_ts = last_ts.max(ev.ts_ns);
                collector.push(ev);
            }
            Record::Stats(s) => {
                last_ts = last_ts.max(s.now_ns);
                collector.note_lost(s.lost_events);
                let reports = collector.tick(s.now_ns);
                outputs.flows(reports).map_err(AnalyzeError::Output)?;
            }
            Record::Capped { bytes } => capped = Some(bytes),
            Record::End(s) => end = Some(s),
        }
    }
    let (now, lost, muted) = match end {
        Some(s) => (s.now_ns.max(last_ts), s.lost_events, s.muted_packets),
        None => (last_ts, 0, 0),
    };
    if lost > 0 {
        collector.note_lost(lost);
    }
    let (mut reports, mut summary) = collector.finish(now);
    if end.is_none() {
        // These flows were still open when the recording stopped: what
        // follows them was not recorded, so their verdict is not confirmed.
        for r in &mut reports {
            if mark_unfinished(r) {
                summary.incomplete_flows += 1;
            }
        }
        let why = match (capped, reader.problem()) {
            (Some(bytes), _) => format!("it stopped at the --write-max-mb limit ({bytes} bytes)"),
            (None, Some(p)) => format!("line {}: {}", p.line, p.why),
            (None, None) => "no end record".to_owned(),
        };
        eprintln!(
            "nattrace: warning: recording {} is truncated ({why}); read {} lines, flows still open at the cut are marked incomplete",
            opts.path.display(),
            reader.lines_read()
        );
    }
    if end.is_some() {
        summary.lost_events = summary.lost_events.max(lost);
        summary.muted_packets = muted;
    }
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

fn mark_unfinished(r: &mut FlowReport) -> bool {
    if r.incomplete {
        return false;
    }
    r.incomplete = true;
    r.detail
        .push_str("; the recording ends before this flow was decided, evidence may be incomplete");
    true
}
