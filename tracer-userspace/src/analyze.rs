//! `nattrace analyze FILE`: the collector over a recording, with the live
//! run's outputs. Feeding order is the live order (events as read, a tick
//! at every `stats` line, finish at `end`), so verdicts match the live run's.
use std::{
    fs::File,
    io::BufReader,
    path::{Path, PathBuf},
};

use crate::{
    collector::{CollectorConfig, OkReport},
    output::{
        files::{Named, check_distinct},
        queue::Overflow,
        sink::{Outcome, OutputFormat, Outputs},
    },
    recording::{
        Header, Reader, RecordingError,
        chain::{self, Chain},
        replay::{Records as _, Replayed, replay},
    },
};

#[derive(Clone, Debug)]
pub struct AnalyzeOptions {
    pub path: PathBuf,
    pub format: OutputFormat,
    pub verbose: bool,
    pub text: crate::output::text::TextStyle,
    /// `--hide-ok`.
    pub hide_ok: bool,
    pub pcap: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum AnalyzeError {
    #[error("{0}")]
    Recording(#[from] RecordingError),
    #[error("{0}")]
    Output(std::io::Error),
    /// `--pcap` names a recording being read.
    #[error("{0}")]
    SameFile(String),
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

/// One run's files (one file, or the files of one rotation) read as one.
struct Run {
    paths: Vec<PathBuf>,
    /// The first file's.
    header: Header,
    chain: Chain<BufReader<File>>,
}

/// Opens `paths` and joins the files of one rotated run (same `run_id`).
fn open_runs(paths: &[PathBuf]) -> Result<Vec<Run>, AnalyzeError> {
    let mut readers = Vec::new();
    let mut headers = Vec::new();
    for path in paths {
        let (reader, header) = Reader::open(path)?;
        if let Some(v) = reader.newer_version {
            crate::output::clean::warn(format_args!(
                "{} is format version {v}, newer than this nattrace's; reading what it understands",
                path.display()
            ));
        }
        readers.push(Some(reader));
        headers.push(header);
    }
    let groups = chain::group(&headers);
    Ok(groups
        .into_iter()
        .map(|g| Run {
            paths: g.iter().map(|&i| paths[i].clone()).collect(),
            header: headers[g[0]].clone(),
            chain: Chain::new(
                g.iter()
                    .map(|&i| readers[i].take().expect("each file in one group"))
                    .collect(),
            ),
        })
        .collect())
}

/// Unreadable lines of each file but the newest (whose end [`warn_read`] tells).
fn warn_skipped_before_last(run: &Run) {
    let n = run.paths.len();
    for (path, reader) in run.paths.iter().zip(run.chain.readers()).take(n - 1) {
        warn_skipped(path, reader);
    }
}

/// `nattrace analyze b.rec a.rec …`: every node's recording decided by its
/// own collector, then the flows merged across nodes (`crate::merge`). The
/// files of one rotated run are one node's one recording.
pub fn run_nodes(opts: &AnalyzeOptions, paths: &[PathBuf]) -> Result<Outcome, AnalyzeError> {
    check_outputs(opts, paths)?;
    let mut runs = open_runs(paths)?;
    if runs.len() == 1 {
        return run_one(opts, runs.pop().expect("one"));
    }
    let mut nodes = Vec::new();
    let mut headers = Vec::new();
    let mut unreadable_lines = false;
    for mut run in runs {
        let path = run.paths.last().expect("a file").clone();
        let stem = run.paths[0].file_stem().map_or_else(
            || path.display().to_string(),
            |s| s.to_string_lossy().into_owned(),
        );
        let header = run.header.clone();
        let mut name = header.node.clone().unwrap_or(stem);
        // Two recordings of one node name (copies, or old files): tell them apart.
        if nodes
            .iter()
            .any(|n: &crate::merge::NodeFlows| n.name.as_str() == name)
        {
            name = format!("{name}#{}", nodes.len() + 1);
        }
        let node = crate::merge::decide_node(&name, &header, &mut run.chain)?;
        unreadable_lines |= run.chain.skipped_lines() > 0;
        warn_skipped_before_last(&run);
        let reader = run.chain.newest();
        if let Some(first) = &reader.first_skipped {
            crate::output::clean::warn(format_args!(
                "recording {} has {} unreadable line(s), skipped (first at line {}: {})",
                path.display(),
                reader.skipped_lines,
                first.line,
                first.why
            ));
        }
        if let Some(p) = reader.problem() {
            crate::output::clean::warn(format_args!(
                "recording {} is truncated (line {}: {}); its flows still open at the cut may lack evidence",
                path.display(),
                p.line,
                p.why
            ));
        }
        nodes.push(node);
        headers.push(header);
    }
    let (reports, summary) = crate::merge::merge(&nodes);
    let mut out = Outputs::new(opts.format, opts.text, opts.verbose, Overflow::Block)
        .map(|o| o.hide_ok(opts.hide_ok))
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
    out.flows(&reports).map_err(AnalyzeError::Output)?;
    out.summary(&summary).map_err(AnalyzeError::Output)?;
    let mut outcome = close(&mut out);
    outcome.output_lost |= unreadable_lines;
    Ok(outcome)
}

pub fn run(opts: &AnalyzeOptions) -> Result<Outcome, AnalyzeError> {
    check_outputs(opts, std::slice::from_ref(&opts.path))?;
    let mut runs = open_runs(std::slice::from_ref(&opts.path))?;
    run_one(opts, runs.pop().expect("one file, one run"))
}

/// One node's run: one file, or a rotation's files in order.
fn run_one(opts: &AnalyzeOptions, mut run: Run) -> Result<Outcome, AnalyzeError> {
    let header = run.header.clone();
    let config = CollectorConfig {
        ok_report: OkReport::printed_by(
            opts.hide_ok,
            opts.pcap.is_some(),
            opts.format == OutputFormat::Text && !opts.verbose,
        ),
        ..header.collector_config()?
    };
    if run.paths.len() > 1 {
        crate::output::clean::say(format_args!(
            "reading {} as one rotated recording (run {})",
            run.paths
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            header.run_id.as_deref().unwrap_or("?")
        ));
    }
    // Opened at the first decided flow: a file with no event is refused in
    // one line (no preamble on stdout, no empty pcap).
    let mut outputs: Option<Outputs> = None;
    let done = replay(config, &mut run.chain, None, |reports| {
        open(opts, &header, &mut outputs)?
            .flows(reports)
            .map_err(AnalyzeError::Output)
    })?;
    let path = run.paths.last().expect("a file").clone();
    let skipped = run.chain.skipped_lines();
    let reader = run.chain.newest();
    // A header and then a cut-off first event is no readable event either.
    let unreadable = run
        .chain
        .readers()
        .iter()
        .find_map(|r| r.first_skipped.clone())
        .or_else(|| reader.problem().filter(|_| reader.cut_off).cloned());
    if done.events == 0
        && let Some(first) = unreadable
    {
        return Err(AnalyzeError::Unreadable {
            path,
            skipped,
            line: first.line,
            why: first.why,
        });
    }
    let out = open(opts, &header, &mut outputs)?;
    warn_skipped_before_last(&run);
    warn_read(&path, run.chain.newest(), &done);
    out.summary(&done.summary).map_err(AnalyzeError::Output)?;
    let mut outcome = close(out);
    // Lines that could not be read are evidence missing from the verdicts.
    outcome.output_lost |= skipped > 0;
    Ok(outcome)
}

/// `analyze X.rec --pcap X.rec` would turn the evidence into a pcapng:
/// refused before anything is opened for writing.
fn check_outputs(opts: &AnalyzeOptions, paths: &[PathBuf]) -> Result<(), AnalyzeError> {
    let Some(pcap) = &opts.pcap else {
        return Ok(());
    };
    let inputs: Vec<Named<'_>> = paths
        .iter()
        .map(|path| Named {
            what: "the recording",
            path,
        })
        .collect();
    check_distinct(
        &[Named {
            what: "--pcap",
            path: pcap,
        }],
        &inputs,
    )
    .map_err(AnalyzeError::SameFile)
}

/// The outputs, opened (preamble, pcap) the first time they are needed.
fn open<'a>(
    opts: &AnalyzeOptions,
    header: &Header,
    outputs: &'a mut Option<Outputs>,
) -> Result<&'a mut Outputs, AnalyzeError> {
    if outputs.is_none() {
        let mut out = Outputs::new(opts.format, opts.text, opts.verbose, Overflow::Block)
            .map(|o| o.hide_ok(opts.hide_ok))
            .map_err(AnalyzeError::Output)?;
        if let Some(pcap) = &opts.pcap {
            out.pcap(pcap, header).map_err(AnalyzeError::Output)?;
        }
        out.preamble(header).map_err(AnalyzeError::Output)?;
        *outputs = Some(out);
    }
    Ok(outputs.as_mut().expect("just opened"))
}

/// Nothing is live here: waits for the reader, however slow, and returns
/// what the outputs made of the run.
fn close(out: &mut Outputs) -> Outcome {
    let forever = std::time::Instant::now() + std::time::Duration::from_secs(365 * 24 * 3600);
    let drained = out.drain(forever, std::time::Duration::from_secs(365 * 24 * 3600));
    for w in drained.into_iter().chain(out.take_warnings()) {
        crate::output::clean::warn(w);
    }
    std::mem::take(&mut out.outcome)
}

/// Lines of one file skipped as unreadable, if any.
fn warn_skipped<R: std::io::BufRead>(path: &Path, reader: &Reader<R>) {
    if let Some(first) = &reader.first_skipped {
        crate::output::clean::warn(format_args!(
            "recording {} has {} unreadable line(s), skipped (first at line {}: {}); flows around them are marked incomplete",
            path.display(),
            reader.skipped_lines,
            first.line,
            first.why
        ));
    }
}

/// Lines skipped as unreadable, and a recording that stops without `end`.
fn warn_read<R: std::io::BufRead>(path: &Path, reader: &Reader<R>, done: &Replayed) {
    warn_skipped(path, reader);
    if done.ended {
        return;
    }
    let why = match (done.capped, done.rotated, reader.problem()) {
        (Some(bytes), _, _) => {
            format!("it stopped at the --write-max-mb limit ({bytes} bytes)")
        }
        (None, Some(bytes), _) => format!(
            "rotated at {bytes} bytes: the run goes on in the next file, {}",
            newer_file(path)
        ),
        (None, None, Some(p)) => format!("line {}: {}", p.line, p.why),
        (None, None, None) => "no end record".to_owned(),
    };
    crate::output::clean::warn(format_args!(
        "recording {} is truncated ({why}); read {} lines, flows still open at the cut are marked incomplete",
        path.display(),
        reader.lines_read()
    ));
}

/// The file a rotated recording continues in: FILE.(i-1), or FILE for FILE.1.
fn newer_file(path: &Path) -> String {
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
