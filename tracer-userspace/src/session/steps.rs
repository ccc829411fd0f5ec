//! The steps `run_async` is made of: opening outputs, start notices, the
//! periodic tick, releasing a deleted namespace, detaching, draining.
use std::{
    io,
    time::{Duration, Instant},
};

use log::warn;

use crate::doctor::conntrack_stats::ConntrackStats;

use super::{
    EXIT_BUDGET, OUTPUT_STALL, SLOW_DETACH_INTERFACES, SessionError, SessionOptions, Stop,
    summarize_removed,
    watch::{NetnsWatch, Notices},
};
use crate::{
    output::{
        files,
        queue::{self, Overflow},
        sink::Outputs,
    },
    probes::{
        Tracer, cleanup,
        ifnames::IfNameResolver,
        netns::{Netns, NetnsError},
    },
    recording::{Header, RecordingError, RecordingWriter},
};
pub(super) fn say_start_notes(tracer: &Tracer, notices: &mut Notices) {
    if let Some(note) = tracer.tc_split_note() {
        notices.say(note);
    }
    for skipped in tracer.skipped() {
        notices.say(format_args!(
            "skipped {}: {}",
            skipped.program, skipped.reason
        ));
    }
}

/// "waiting for connections to … (Ctrl-C to stop)": what is traced, in a
/// short line however many Services.
pub(super) fn waiting_line(options: &SessionOptions) -> String {
    let labels: Vec<&str> = options.expected.iter().map(|e| e.label.as_str()).collect();
    let what = match (options.continuous.all_services, labels.is_empty()) {
        (true, true) => "every Service in kube-proxy's rules".to_owned(),
        (true, false) => format!(
            "every Service in kube-proxy's rules and {}",
            crate::doctor::first_few(&labels, ", ")
        ),
        (false, _) => crate::doctor::first_few(&labels, ", "),
    };
    let until = match options.duration {
        Some(d) => format!(" for {}s", d.as_secs_f64()),
        None => String::new(),
    };
    format!("waiting for connections to {what}{until} (Ctrl-C to stop)")
}

/// The recording writer (`--write`) and the outputs (stdout, `--pcap`),
/// on the files opened before attaching; the preamble goes out here.
pub(super) fn open_outputs(
    options: &SessionOptions,
    header: &Header,
    record_file: Option<std::fs::File>,
    pcap_file: Option<std::fs::File>,
    bar: Option<indicatif::ProgressBar>,
) -> Result<(Option<RecordingWriter>, Outputs), SessionError> {
    let mut recorder = match (record_file, &options.write) {
        (Some(file), Some(path)) => Some(RecordingWriter::from_file(
            file,
            path,
            header,
            options.write_max_bytes,
        )?),
        _ => None,
    };
    if let Some(rec) = recorder.as_mut() {
        rec.keep_files(options.continuous.write_keep);
    }
    let stdout = Box::new(queue::stdout_file().map_err(SessionError::Output)?);
    let target: Box<dyn io::Write + Send> = match bar {
        Some(bar) if super::status::stdout_is_stderr_terminal() => {
            Box::new(super::status::AroundBar::new(stdout, bar))
        }
        _ => stdout,
    };
    let mut outputs = Outputs::with_target(
        options.format,
        options.text,
        options.verbose,
        Overflow::Drop,
        target,
    )
    .map_err(SessionError::Output)?
    .hide_ok(options.hide_ok);
    if let (Some(file), Some(path)) = (pcap_file, &options.pcap) {
        outputs
            .pcap_file(file, path, header)
            .map_err(SessionError::Output)?;
    }
    outputs.preamble(header).map_err(SessionError::Output)?;
    Ok((recorder, outputs))
}

/// Names for the pods' interfaces and the node's new ones, as events from
/// them arrive (the node's at start are in the facts).
pub(super) fn interface_names(options: &SessionOptions, tracer: &Tracer) -> Option<IfNameResolver> {
    match Netns::open(options.netns.as_deref()) {
        Ok(node) => Some(IfNameResolver::new(node, &tracer.facts().interfaces)),
        Err(err) => {
            warn!("interface names of other namespaces will be missing: {err}");
            None
        }
    }
}

/// Output files are opened before anything is attached: a bad path (or a
/// FIFO nobody reads) fails without touching the node.
pub(super) fn open_output_files(
    options: &SessionOptions,
) -> Result<(Option<std::fs::File>, Option<std::fs::File>), SessionError> {
    // `--write F --pcap F` would leave F unreadable; with `--write-keep`
    // the rotated names F.1 … are outputs too.
    let rotated: Vec<std::path::PathBuf> = match &options.write {
        Some(path) => (1..options.continuous.write_keep)
            .map(|i| crate::recording::rotate::rotated_name(path, i))
            .collect(),
        None => Vec::new(),
    };
    let mut outputs: Vec<files::Named<'_>> = Vec::new();
    if let Some(path) = &options.write {
        outputs.push(files::Named {
            what: "--write",
            path,
        });
    }
    outputs.extend(rotated.iter().map(|path| files::Named {
        what: "--write's rotated file",
        path,
    }));
    if let Some(path) = &options.pcap {
        outputs.push(files::Named {
            what: "--pcap",
            path,
        });
    }
    files::check_distinct(&outputs, &[])
        .map_err(|why| SessionError::CreateOutput(io::Error::other(why)))?;
    if let Some(path) = &options.write {
        keep_previous_run(path, options.continuous.write_keep).map_err(|error| {
            RecordingError::Create {
                path: path.clone(),
                error,
            }
        })?;
    }
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
    Ok((record_file, pcap_file))
}

/// A restart with `--write-keep` (a DaemonSet's pod restarted) rotates the
/// previous run's FILE to FILE.1 instead of truncating it: the files kept
/// are the newest N whoever wrote them. Only a non-empty regular file of
/// ours is moved (never a symlink or someone else's file: those are
/// refused when FILE is opened).
fn keep_previous_run(path: &std::path::Path, keep: usize) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    if keep < 2 {
        return Ok(());
    }
    let ours = std::fs::symlink_metadata(path).is_ok_and(|m| {
        m.file_type().is_file() && m.len() > 0 && m.uid() == nix::unistd::geteuid().as_raw()
    });
    if ours {
        crate::recording::rotate::shift(path, keep)?;
    }
    Ok(())
}

pub(super) fn remove_leftovers(netns: Option<&str>, notices: &mut Notices) {
    match cleanup::remove_leftovers(netns) {
        Ok(removed) if !removed.is_empty() => notices.say(format_args!(
            "removed what a killed nattrace left behind: {}",
            summarize_removed(&removed)
        )),
        Ok(_) => {}
        // Tracer::start reports a missing namespace in its one line.
        Err(NetnsError::NotFound { .. } | NetnsError::Open { .. } | NetnsError::Denied { .. }) => {}
        Err(err) => warn!("looking for leftovers of a killed nattrace failed: {err}"),
    }
}

/// The traced namespace was deleted: let go of it first, since our
/// descriptors are what keeps the deleted node alive.
pub(super) fn release_deleted_netns(
    tracer: &mut Option<Tracer>,
    ifnames: &mut Option<IfNameResolver>,
    watch: Option<&NetnsWatch>,
    notices: &mut Notices,
) {
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

/// Lets the output reach its readers: within the exit budget after a
/// signal (but a reader that keeps up gets what was just queued), else as
/// long as they keep reading.
pub(super) fn drain_outputs(
    stop: Stop,
    stopped_at: Instant,
    interrupted: bool,
    recorder: Option<&mut RecordingWriter>,
    outputs: &mut Outputs,
    notices: &mut Notices,
) {
    let drain_until = match stop {
        Stop::Signal => (stopped_at + EXIT_BUDGET).max(Instant::now() + Duration::from_millis(100)),
        Stop::Duration | Stop::NetnsGone if interrupted => Instant::now(),
        Stop::Duration | Stop::NetnsGone => Instant::now() + Duration::from_secs(24 * 3600),
    };
    if let Some(rec) = recorder {
        if !rec.drain(drain_until, OUTPUT_STALL) {
            outputs.outcome.output_lost = true;
            notices.warn("the --write target is not being read: the recording is incomplete");
        }
        if rec.lost_output() {
            outputs.outcome.output_lost = true;
        }
        // A write error of the last lines (a full disk) shows only now.
        if let Some(w) = rec.take_warning() {
            notices.warn(w);
        }
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
        outputs.outcome.output_lost = true;
        notices.warn(format_args!(
            "{dropped} output lines were dropped because stdout was not read fast enough"
        ));
    }
    notices.drain(
        drain_until.max(Instant::now() + Duration::from_millis(50)),
        Duration::from_millis(100),
    );
}

/// Detaches everything (dropping the tracer), saying so first when that
/// takes seconds.
pub(super) fn detach(tracer: Option<Tracer>, notices: &mut Notices) {
    if let Some(t) = &tracer
        && t.tc_interface_count() > SLOW_DETACH_INTERFACES
    {
        notices.say(format_args!(
            "detaching from {} interfaces: the kernel takes a few milliseconds per tc link, so this takes a few seconds",
            t.tc_interface_count()
        ));
    }
    drop(tracer);
}

/// Completes after `duration` from now, or never.
pub(super) fn until(duration: Option<Duration>) -> impl std::future::Future<Output = ()> {
    let deadline = duration.map(|d| tokio::time::Instant::now() + d);
    async move {
        match deadline {
            Some(at) => tokio::time::sleep_until(at).await,
            None => std::future::pending().await,
        }
    }
}

/// Limits the rules re-reads failing flows ask for: at most one per
/// [`RulesReread::MIN_GAP`], so a failure storm does not run
/// `iptables-save` at every tick; a request waits meanwhile. A flow
/// decided before its read uses the rules of the last one, in `analyze`
/// too: it replays the recorded reads.
#[derive(Default)]
pub(super) struct RulesReread {
    last: Option<Instant>,
}

impl RulesReread {
    const MIN_GAP: Duration = Duration::from_millis(500);

    pub(super) fn due(&self) -> bool {
        self.last.is_none_or(|t| t.elapsed() >= Self::MIN_GAP)
    }

    pub(super) fn done(&mut self) {
        self.last = Some(Instant::now());
    }
}

/// The node namespace's conntrack counters (doctor/conntrack_stats.rs):
/// read at start and at the end for the summary's rise over the run, and
/// every [`ConntrackWatch::EVERY`] for the metrics.
pub(super) struct ConntrackWatch {
    start: Option<ConntrackStats>,
    last_read: Instant,
}

impl ConntrackWatch {
    const EVERY: Duration = Duration::from_secs(5);

    pub(super) fn start(tracer: &crate::probes::Tracer) -> Self {
        Self {
            start: tracer.conntrack_stats(),
            last_read: Instant::now() - Self::EVERY,
        }
    }

    pub(super) fn due_read(&mut self, tracer: &crate::probes::Tracer) -> Option<ConntrackStats> {
        if self.last_read.elapsed() < Self::EVERY {
            return None;
        }
        self.last_read = Instant::now();
        tracer.conntrack_stats()
    }

    /// How much each counter rose since start.
    pub(super) fn rise(&self, tracer: &crate::probes::Tracer) -> Option<ConntrackStats> {
        let start = self.start?;
        Some(tracer.conntrack_stats()?.rise_since(&start))
    }
}
