//! The live run's heartbeat on stderr (issue 28): one status line updated
//! in place when stderr is a terminal (indicatif), else a plain line every
//! [`PLAIN_EVERY`]; `--quiet` silences both. Without it, "saw nothing"
//! looks the same as "still starting" or "healthy".
use std::{
    io::{self, IsTerminal as _, Write},
    time::{Duration, Instant},
};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::collector::{FlowReport, Verdict};

/// How often the plain (not a terminal) progress line is printed.
pub const PLAIN_EVERY: Duration = Duration::from_secs(10);
/// Tests set a shorter interval (milliseconds) to wait for the line.
const PLAIN_EVERY_ENV: &str = "NATTRACE_STATUS_EVERY_MS";

/// The flows decided so far, by how they went.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub ok: u64,
    pub failed: u64,
    /// `unseen` and `undecided`: no evidence either way.
    pub unknown: u64,
    pub events: u64,
    pub lost: u64,
}

impl Counts {
    pub fn flows(&mut self, reports: &[FlowReport]) {
        for r in reports {
            match r.verdict {
                Verdict::Ok => self.ok += 1,
                v if v.is_undetermined() => self.unknown += 1,
                _ => self.failed += 1,
            }
        }
    }

    /// `12 flows (10 ok, 2 failed), 340 events, 0 lost, 30s`.
    pub fn line(&self, elapsed: Duration) -> String {
        let flows = self.ok + self.failed + self.unknown;
        let unknown = if self.unknown > 0 {
            format!(", {} unknown", self.unknown)
        } else {
            String::new()
        };
        format!(
            "{flows} flow{} ({} ok, {} failed{unknown}), {} events, {} lost, {}s",
            if flows == 1 { "" } else { "s" },
            self.ok,
            self.failed,
            self.events,
            self.lost,
            elapsed.as_secs()
        )
    }
}

/// The status line being drawn, for writers that do not know the session
/// (the logger).
static ACTIVE: std::sync::Mutex<Option<ProgressBar>> = std::sync::Mutex::new(None);

fn set_active(bar: Option<ProgressBar>) {
    *ACTIVE.lock().unwrap_or_else(|e| e.into_inner()) = bar;
}

/// stderr for the logger: its lines step around a live status line too.
pub struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let bar = ACTIVE.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match bar {
            Some(bar) => bar.suspend(|| io::stderr().write_all(buf))?,
            None => io::stderr().write_all(buf)?,
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        io::stderr().flush()
    }
}

pub struct Status {
    bar: Option<ProgressBar>,
    plain_every: Option<Duration>,
    next_plain: Instant,
    started: Instant,
    pub counts: Counts,
}

impl Status {
    pub fn new(quiet: bool) -> Self {
        let tty = !quiet && io::stderr().is_terminal();
        let bar = tty.then(|| {
            let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
            bar.set_style(ProgressStyle::with_template("{msg}").expect("a valid template"));
            set_active(Some(bar.clone()));
            bar
        });
        let plain_every = (!quiet && !tty).then(|| {
            std::env::var(PLAIN_EVERY_ENV)
                .ok()
                .and_then(|v| v.parse().ok())
                .map_or(PLAIN_EVERY, Duration::from_millis)
        });
        let now = Instant::now();
        Self {
            bar,
            next_plain: now + plain_every.unwrap_or(PLAIN_EVERY),
            plain_every,
            started: now,
            counts: Counts::default(),
        }
    }

    /// Elapsed counts from here: once the programs are attached, as the
    /// end's "no connection … was seen in N s" does.
    pub fn tracing_began(mut self) -> Self {
        self.started = Instant::now();
        self
    }

    /// The status line, for writers to the same terminal to step around.
    pub fn bar(&self) -> Option<ProgressBar> {
        self.bar.clone()
    }

    /// Redraws the line; returns the plain one when it is due, for the
    /// caller to say among its notices.
    #[must_use = "the plain line is due: say it"]
    pub fn update(&mut self, events: u64, lost: u64) -> Option<String> {
        self.counts.events = events;
        self.counts.lost = lost;
        let elapsed = self.started.elapsed();
        if let Some(bar) = &self.bar {
            bar.set_message(format!(
                "nattrace: {} — Ctrl-C to stop",
                self.counts.line(elapsed)
            ));
        }
        let every = self.plain_every?;
        if Instant::now() < self.next_plain {
            return None;
        }
        self.next_plain = Instant::now() + every;
        Some(self.counts.line(elapsed))
    }

    /// Gone before the summary and the last lines.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            set_active(None);
            bar.finish_and_clear();
        }
    }
}

/// A writer whose writes clear the status line first and redraw it after,
/// so a line written to the bar's terminal never lands inside it.
pub struct AroundBar<W> {
    inner: W,
    bar: ProgressBar,
}

impl<W: Write> AroundBar<W> {
    pub fn new(inner: W, bar: ProgressBar) -> Self {
        Self { inner, bar }
    }
}

impl<W: Write> Write for AroundBar<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // Whole: a chunk the queues write is whole lines, and a partial
        // write would leave the cursor mid-line for the redraw.
        let inner = &mut self.inner;
        self.bar
            .suspend(|| inner.write_all(buf).and_then(|()| inner.flush()))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Whether stdout is the terminal stderr is (then flow lines step around
/// the status line too).
pub fn stdout_is_stderr_terminal() -> bool {
    use std::os::unix::fs::MetadataExt as _;
    if !io::stdout().is_terminal() || !io::stderr().is_terminal() {
        return false;
    }
    let rdev = |f: io::Result<std::fs::File>| f.and_then(|f| f.metadata()).map(|m| m.rdev());
    match (
        rdev(crate::output::queue::stdout_file()),
        rdev(crate::output::queue::stderr_file()),
    ) {
        (Ok(a), Ok(b)) => a == b,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_counts_flows_by_how_they_went() {
        let c = Counts {
            ok: 10,
            failed: 2,
            unknown: 0,
            events: 340,
            lost: 0,
        };
        assert_eq!(
            c.line(Duration::from_millis(30_400)),
            "12 flows (10 ok, 2 failed), 340 events, 0 lost, 30s"
        );
        let c = Counts {
            ok: 0,
            failed: 0,
            unknown: 1,
            events: 3,
            lost: 7,
        };
        assert_eq!(
            c.line(Duration::ZERO),
            "1 flow (0 ok, 0 failed, 1 unknown), 3 events, 7 lost, 0s"
        );
    }

    #[test]
    fn writes_around_a_hidden_bar_pass_through_whole() {
        let bar = ProgressBar::hidden();
        let mut out = AroundBar::new(Vec::new(), bar);
        out.write_all(b"one line\n").unwrap();
        assert_eq!(out.inner, b"one line\n");
    }
}
