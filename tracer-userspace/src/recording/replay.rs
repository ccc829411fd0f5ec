//! A recording decided the way the live session decided it: events pushed
//! in the order they were read, a tick at every `stats` line, finish at the
//! `end` line. `analyze` of one file, of several nodes (`crate::merge`) and
//! the tests that replay recorded fixtures all decide through [`replay`],
//! so the three cannot drift apart.
use std::io::BufRead;

use super::{Reader, Record};
use crate::collector::{Collector, CollectorConfig, FlowReport, Summary};

/// Records, with how many lines were skipped so far as unreadable: those
/// are events missing from the flows around them, counted as lost.
pub trait Records: Iterator<Item = Record> {
    fn skipped_lines(&self) -> u64;
}

impl<R: BufRead> Records for Reader<R> {
    fn skipped_lines(&self) -> u64 {
        self.skipped_lines
    }
}

/// Records made in memory (rewritten or filtered by a test): none skipped.
pub struct InMemory<I>(pub I);

impl<I: Iterator<Item = Record>> Iterator for InMemory<I> {
    type Item = Record;
    fn next(&mut self) -> Option<Record> {
        self.0.next()
    }
}

impl<I: Iterator<Item = Record>> Records for InMemory<I> {
    fn skipped_lines(&self) -> u64 {
        0
    }
}

/// How a replayed recording ended, for the caller's warnings.
#[derive(Debug)]
pub struct Replayed {
    /// `lost_events` is the kernel's (or the writer's) count; skipped lines
    /// are the reader's to report.
    pub summary: Summary,
    /// Events pushed into the collector.
    pub events: u64,
    /// An `end` line (or `stop_after`) closed the recording; without one,
    /// the flows still open were marked incomplete.
    pub ended: bool,
    /// The `--write-max-mb` limit stopped it at this size.
    pub capped: Option<u64>,
    /// It was rotated at this size (`--write-keep`).
    pub rotated: Option<u64>,
}

/// Drives a collector over `records` and hands every batch of decided
/// reports to `decided` (at the ticks, then the rest at the end).
/// `stop_after`: as if the session had been stopped that long after the
/// first event.
pub fn replay<E>(
    config: CollectorConfig,
    records: &mut impl Records,
    stop_after: Option<u64>,
    mut decided: impl FnMut(&mut Vec<FlowReport>) -> Result<(), E>,
) -> Result<Replayed, E> {
    let mut c = Collector::new(config).with_report_batch(REPORT_BATCH);
    let mut last_ts = 0u64;
    let mut first = None;
    let past_stop = |first: Option<u64>, t: u64| match (first, stop_after) {
        (Some(t0), Some(d)) if t > t0 + d => Some(t0 + d),
        _ => None,
    };
    // (now, muted packets) of the end line, or of the stop.
    let mut end = None;
    // The kernel's per-flow buffer counters, as last recorded.
    let mut held = super::StatsLine::default();
    let (mut capped, mut rotated) = (None, None);
    // The kernel's loss count as recorded, and lines skipped as unreadable:
    // both are events missing from the flows around them.
    let (mut lost, mut skipped, mut events) = (0u64, 0u64, 0u64);
    while let Some(record) = records.next() {
        if records.skipped_lines() > skipped {
            skipped = records.skipped_lines();
            c.note_lost(lost + skipped);
        }
        match record {
            Record::Event(ev) => {
                if let Some(stop) = past_stop(Some(*first.get_or_insert(ev.ts_ns)), ev.ts_ns) {
                    end = Some((stop, 0));
                    break;
                }
                last_ts = last_ts.max(ev.ts_ns);
                events += 1;
                c.push(ev);
                drain_backlog(&mut c, &mut decided)?;
            }
            Record::Interface(i) => c.learn_interface(i.netns, i.ifindex, &i.name),
            Record::Stats(s) => {
                if let Some(stop) = past_stop(first, s.now_ns) {
                    end = Some((stop, 0));
                    break;
                }
                last_ts = last_ts.max(s.now_ns);
                lost = lost.max(s.lost_events);
                held = s;
                c.note_lost(lost + skipped);
                let reports = c.tick(s.now_ns);
                hand_out(&mut c, reports, &mut decided)?;
                drain_backlog(&mut c, &mut decided)?;
            }
            Record::Capped { bytes } => capped = Some(bytes),
            Record::Rotated { bytes } => rotated = Some(bytes),
            Record::Rules(rules) => c.update_rules(*rules),
            Record::Sysctls(s) => c.update_sysctls(s),
            Record::Conntrack(t) => c.update_conntrack(t),
            Record::Pods(p) => c.update_pods(p),
            Record::CtEntry(l) => c.update_ct_entry(*l),
            Record::End(s) => {
                lost = lost.max(s.lost_events);
                held = s;
                end = Some((s.now_ns, s.muted_packets));
            }
        }
    }
    skipped = skipped.max(records.skipped_lines());
    let (now, muted) = end.map_or((last_ts, 0), |(now, muted)| (now.max(last_ts), muted));
    c.note_lost(lost + skipped);
    let (mut reports, mut summary) = c.finish(now);
    if end.is_none() {
        // These flows were still open when the recording stopped: what
        // follows them was not recorded, so their verdict is not confirmed.
        for r in reports.iter_mut().filter(|r| !r.incomplete) {
            r.incomplete = true;
            r.detail.push_str(
                "; the recording ends before this flow was decided, evidence may be incomplete",
            );
            summary.incomplete_flows += 1;
        }
    }
    summary.lost_events = lost;
    summary.muted_packets = muted;
    summary.held_discarded = held.held_discarded;
    summary.held_spilled = held.held_spilled;
    summary.held_map_full = held.held_map_full;
    summary.skipped_runs = held.skipped_runs;
    summary.conntrack = held.conntrack;
    if !reports.is_empty() {
        decided(&mut reports)?;
    }
    Ok(Replayed {
        summary,
        events,
        ended: end.is_some(),
        capped,
        rotated,
    })
}

/// Decided reports handed out between ticks once this many wait: a burst
/// of flows (10^6 evicted between two `stats` lines) is not all held.
const REPORT_BATCH: usize = 1024;

fn drain_backlog<E>(
    c: &mut Collector,
    decided: &mut impl FnMut(&mut Vec<FlowReport>) -> Result<(), E>,
) -> Result<(), E> {
    while c.backlogged() {
        let reports = c.resume();
        hand_out(c, reports, decided)?;
    }
    Ok(())
}

/// Decided reports to `decided`, which takes those it keeps (`append`);
/// the collector reuses what it leaves (`Collector::recycle`).
fn hand_out<E>(
    c: &mut Collector,
    mut reports: Vec<FlowReport>,
    decided: &mut impl FnMut(&mut Vec<FlowReport>) -> Result<(), E>,
) -> Result<(), E> {
    if reports.is_empty() {
        return Ok(());
    }
    decided(&mut reports)?;
    c.recycle(reports);
    Ok(())
}

/// Every report of a recording and its summary, for the tests that replay
/// recorded fixtures (feature `testkit` for the integration tests).
#[cfg(any(test, feature = "testkit"))]
pub fn decide_all<R: BufRead>(
    reader: &mut Reader<R>,
    header: &super::Header,
    stop_after: Option<u64>,
) -> (Vec<FlowReport>, Summary) {
    let mut out = Vec::new();
    let config = header.collector_config().expect("config");
    let done = replay(config, reader, stop_after, |r| {
        out.append(r);
        Ok::<_, std::convert::Infallible>(())
    });
    let Ok(done) = done;
    (out, done.summary)
}
