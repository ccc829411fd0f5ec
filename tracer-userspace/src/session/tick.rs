//! The event loop's periodic tick, as methods of the session it works on:
//! apart from `steps.rs` (whose helpers `live.rs` calls), so that neither
//! imports the other.

use log::warn;

use super::{SessionError, live::Live, monotonic_ns};
use crate::recording::StatsLine;

/// The event loop's periodic steps, as methods of the session they work on.
impl Live {
    /// The periodic work of the event loop after the ring buffer was drained:
    /// late tc attachments, loss warnings, the recording's stats line, decided
    /// flows out, their endpoints muted, and (every `poll_interfaces`) new
    /// interfaces picked up.
    pub(super) fn on_tick(&mut self, poll_interfaces: bool) -> Result<(), SessionError> {
        let Live {
            tracer,
            collector,
            continuous,
            recorder,
            outputs,
            notices,
            last_lost,
            rules_reread,
            conntrack,
            status,
            pods,
            ..
        } = self;
        let mut recorder = recorder.as_mut();
        // Before the stats line: `analyze` applies a rules line where the live
        // run did, before the tick.
        for line in continuous.tick(tracer, collector, recorder.as_deref_mut()) {
            notices.say(line);
        }
        // A flow failed the watch: the node's sysctls may be what changed
        // (br_netfilter switched off while running). Before the stats line,
        // like the rules line, so `analyze` judges with the same values.
        if collector.take_sysctls_request()
            && let Some(now) = tracer.reread_sysctls()
            && now != collector.sysctls()
        {
            collector.update_sysctls(now);
            if let Some(rec) = recorder.as_deref_mut() {
                rec.sysctls(now);
            }
        }
        // A DNATed flow failed the watch: whether conntrack still holds its
        // entry tells a deleted entry from an out-of-window packet
        // (checks/midstream.rs), asked now, before the flow is decided;
        // recorded before the stats line for `analyze`.
        for (tuple, unnated) in collector.take_ct_lookups() {
            if let Some(l) = tracer.ct_lookup(tuple, unnated) {
                if let Some(rec) = recorder.as_deref_mut() {
                    rec.ct_entry(&l);
                }
                collector.update_ct_entry(l);
            }
        }
        // A failing DNATed flow waits for this tick: whether its backend is
        // still an endpoint is asked of the rules as they are now (a stale
        // conntrack entry), recorded before the stats line for `analyze`.
        // A request made while the last read is too recent waits for the
        // next tick (it is not taken), so it is never lost.
        if rules_reread.due() && collector.take_rules_request() {
            rules_reread.done();
            let mut now = tracer.reread_rules();
            now.outside_netfilter = collector.rules().outside_netfilter.clone();
            if now.mode != crate::ruleset::ProxyMode::None && now != *collector.rules() {
                if let Some(rec) = recorder.as_deref_mut() {
                    rec.rules(&now);
                }
                collector.update_rules(now);
            }
        }
        // A request dropped by netfilter before any DNAT: whether the table
        // was full is asked of it now, before the flow's reply timeout
        // decides it; recorded before the stats line for `analyze`.
        if collector.take_conntrack_request()
            && let Some(now) = tracer.conntrack_table()
        {
            collector.update_conntrack(now);
            if let Some(rec) = recorder.as_deref_mut() {
                rec.conntrack(now);
            }
        }
        // An event from a namespace no pod had: a pod started since the
        // last read, named before this tick decides its flow. Recorded
        // before the stats line, so `analyze` names it the same way.
        if collector.take_pods_request() | pods.stale() {
            let now = pods.scan();
            if now != *collector.pods() {
                if let Some(rec) = recorder.as_deref_mut() {
                    rec.pods(&now);
                }
                collector.update_pods(now);
            }
        }
        if continuous.has_metrics()
            && let Some(now) = conntrack.due_read(tracer)
        {
            continuous.conntrack(&now);
        }
        let attached = tracer.collect_tc();
        if attached > 0 {
            notices.say(format_args!("tc now attached on {attached} more interfaces (their device tracepoints stood in until now)"));
        }
        if let Some(label) = tracer.collect_receive() {
            notices.say(format_args!("now also tracing {label}"));
        }
        let stats = tracer.stats();
        if stats.ringbuf_full > last_lost.0 {
            notices.warn(format_args!(
                "{} events lost so far (ring buffer full); affected flows are marked incomplete",
                stats.ringbuf_full
            ));
            last_lost.0 = stats.ringbuf_full;
        }
        // Not a count of lost events: most skipped runs are for packets of
        // no traced flow, so flows are not marked; the verdicts that rest
        // on one event have a second witness (verdict.rs neighbour_gave_up).
        if stats.skipped_runs > last_lost.1 {
            notices.warn(format_args!(
                "the kernel skipped {} runs of nattrace's tracing programs so far (a program fired on a CPU where it was already running, e.g. a drop in a softirq during another drop); a traced packet's event may be among them",
                stats.skipped_runs
            ));
            last_lost.1 = stats.skipped_runs;
        }
        let now = monotonic_ns();
        if let Some(rec) = recorder {
            rec.stats(StatsLine::new(now, &stats));
            if let Some(w) = rec.take_warning() {
                notices.warn(w);
            }
        }
        collector.note_lost(stats.ringbuf_full);
        let reports = collector.tick(now);
        continuous.flows(&reports);
        status.counts.flows(&reports);
        outputs.flows(&reports).map_err(SessionError::Output)?;
        collector.recycle(reports);
        // After this tick's flows: a test that saw a flow line knows a
        // progress line was due by then.
        if let Some(line) = status.update(stats.events, stats.ringbuf_full) {
            notices.say(line);
        }
        continuous.gauges(tracer, collector, &stats, outputs.dropped_lines());
        for w in outputs.take_warnings() {
            notices.warn(w);
        }
        for client in collector.take_mute_candidates() {
            if let Err(err) = tracer.mute(client) {
                warn!("could not mute a decided flow: {err}");
            }
        }
        if poll_interfaces {
            match tracer.poll_new_interfaces() {
                Ok(names) if !names.is_empty() => {
                    notices.say(format_args!("now also tracing {}", names.join(", ")))
                }
                Ok(_) => {}
                Err(err) => warn!("watching for new interfaces failed: {err}"),
            }
        }
        Ok(())
    }

    /// Held flows whose reply deadline comes (the collector's
    /// `take_due_held`): their events are read from the kernel and go to
    /// the collector and the recording like ring-buffer events. `sweep` also
    /// pulls buffers nobody asked for (their first event was lost), once they
    /// are well past any deadline.
    pub(super) fn pull_held(&mut self, sweep: bool) {
        let Live {
            tracer,
            collector,
            recorder,
            ifnames,
            ..
        } = self;
        let now = monotonic_ns();
        let due = collector.take_due_held(now);
        let mut events = Vec::new();
        if !due.is_empty() {
            tracer.pull(&due, &mut events);
        }
        if sweep {
            let stale = collector.reply_timeout_ns() * 2 + 1_000_000_000;
            tracer.pull_older(now.saturating_sub(stale), &mut events);
        }
        if !events.is_empty() {
            super::push(collector, recorder.as_mut(), ifnames.as_mut(), &mut events);
        }
    }
}
