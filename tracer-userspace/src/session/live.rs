//! `run_async`'s three phases: start (outputs, probes, collector), the event
//! loop, and shutting down (last events, summary, detach, drain).
use std::time::{Duration, Instant};

use log::warn;
use tokio::signal::unix::Signal;
use tracer_common::PacketEvent;

use super::{
    SessionError, SessionOptions, Stop, finish, header, monotonic_ns, push, second_signal,
    start_gathering,
    steps::{
        detach, drain_outputs, interface_names, open_output_files, open_outputs,
        release_deleted_netns, remove_leftovers, say_start_notes, until,
    },
    watch::{NetnsWatch, Notices},
};
use crate::{
    collector::{Collector, CollectorConfig, OkReport},
    continuous::Continuous,
    output::sink::{Outcome, Outputs},
    probes::{TraceOptions, Tracer, ifnames::IfNameResolver},
    recording::RecordingWriter,
    timing,
};

/// Everything a running session holds between its phases.
pub(super) struct Live {
    pub(super) tracer: Tracer,
    pub(super) collector: Collector,
    pub(super) continuous: Continuous,
    pub(super) recorder: Option<RecordingWriter>,
    pub(super) outputs: Outputs,
    pub(super) notices: Notices,
    pub(super) ifnames: Option<IfNameResolver>,
    pub(super) watch: Option<NetnsWatch>,
    pub(super) events: Vec<PacketEvent>,
    /// Ring-buffer losses and skipped program runs already warned about.
    pub(super) last_lost: (u64, u64),
    /// When failing flows last had the rules re-read.
    pub(super) rules_reread: super::steps::RulesReread,
    /// The node namespace's conntrack counters at start, and when they
    /// were last read for the metrics.
    pub(super) conntrack: super::steps::ConntrackWatch,
    /// The `--svc` targets a flow is expected to (none with
    /// `--all-services`), and when tracing began, for the end's
    /// "no connection seen" line.
    pub(super) expected: Vec<super::Expected>,
    pub(super) started: Instant,
    /// The status line (a terminal) or periodic progress lines on stderr.
    pub(super) status: super::status::Status,
    /// Reads the node's pods again when a flow names an unknown address.
    pub(super) pods: crate::pods::scan::Rescan,
}

impl Live {
    /// Opens the outputs, attaches the probes and writes the preamble.
    pub(super) fn start(options: &SessionOptions) -> Result<Live, SessionError> {
        let status = super::status::Status::new(options.quiet);
        let mut notices = Notices::around(status.bar());
        let (record_file, pcap_file) = open_output_files(options)?;
        let mut continuous = Continuous::bind(&options.continuous, &options.services)
            .map_err(SessionError::CreateOutput)?;
        let gathering = start_gathering(options);
        crate::probes::prepare_loader();
        {
            let _t = timing::step("leftover cleanup");
            remove_leftovers(options.netns.as_deref(), &mut notices);
        }
        let _t = timing::step("Tracer::start");
        let drop_reasons = super::kernel_drop_reasons();
        let mut tracer = Tracer::start(&TraceOptions {
            services: options.services.clone(),
            netns: options.netns.clone(),
            ringbuf_bytes: options.ringbuf_bytes,
            backend: options.backend,
            all_services: options.continuous.all_services,
            buffer: !options.verbose,
            reply_timeout_ns: options.reply_timeout.as_nanos() as u64,
            benign_drops: drop_reasons.benign_bitmap(),
            closed_drops: drop_reasons.closed_bitmap(),
        })?;
        drop(_t);
        let watch = NetnsWatch::new(options.netns.as_deref());
        say_start_notes(&tracer, &mut notices);
        let header = {
            let _t = timing::step("header (waits for doctor's facts)");
            header(options, &tracer, gathering)
        };
        // Before the start line: with --all-services the kernel's Service
        // filter is filled here, and a client that connects as soon as it
        // reads that line must be traced (a NodePort's lone SYN, sent right
        // after it, was missed under load while the pods were scanned).
        let continuous_said = continuous.start(options.netns.as_deref(), &mut tracer, &header);
        let (mut recorder, outputs) =
            open_outputs(options, &header, record_file, pcap_file, status.bar())?;
        timing::mark("start line queued");
        let mut collector = Collector::new(CollectorConfig {
            ok_report: OkReport::printed_by(
                options.hide_ok,
                options.pcap.is_some(),
                options.format == crate::output::sink::OutputFormat::Text && !options.verbose,
            ),
            ..header.collector_config()?
        });
        let roots = crate::pods::scan::Roots::node(options.host_root.as_deref());
        let socket = options
            .cri_socket
            .clone()
            .or_else(|| crate::pods::cri::find_socket(&roots.host));
        let mut pods =
            crate::pods::scan::Rescan::new(roots, header.facts.netns_inode).with_cri(socket);
        {
            let _t = timing::step("pods");
            let now = pods.scan();
            if !options.quiet {
                notices.say(pods.source_line(&now));
            }
            if let Some(rec) = recorder.as_mut() {
                rec.pods(&now);
            }
            collector.update_pods(now);
        }
        for line in continuous_said {
            notices.say(line);
        }
        if !options.quiet {
            notices.say(super::steps::waiting_line(options));
        }
        let ifnames = interface_names(options, &tracer);
        let conntrack = super::steps::ConntrackWatch::start(&tracer);
        Ok(Live {
            tracer,
            collector,
            continuous,
            recorder,
            outputs,
            notices,
            ifnames,
            watch,
            events: Vec::with_capacity(4096),
            last_lost: (0, 0),
            rules_reread: Default::default(),
            conntrack,
            expected: if options.continuous.all_services {
                Vec::new()
            } else {
                options.expected.clone()
            },
            started: Instant::now(),
            status: status.tracing_began(),
            pods,
        })
    }

    /// Feeds events to the collector until a signal, the duration or the
    /// traced namespace's deletion ends the session. SIGUSR1 ("finish")
    /// ends it once every flow seen before it has its verdict, as a
    /// `--duration` would: after a known burst of traffic, a stop that
    /// neither cuts verdicts short (SIGTERM) nor guesses a time.
    pub(super) async fn event_loop(
        &mut self,
        duration: Option<Duration>,
        sigint: &mut Signal,
        sigterm: &mut Signal,
        finish: &mut Signal,
    ) -> Result<Stop, SessionError> {
        let until_deadline = until(duration);
        tokio::pin!(until_deadline);
        let mut ticker = tokio::time::interval(Duration::from_millis(200));
        let mut ticks = 0u64;
        // SIGUSR1's time (the events' clock): flows seen by then are awaited.
        let mut finishing: Option<u64> = None;
        // Tests force ring-buffer overflow by reading slowly.
        let stall = std::env::var("NATTRACE_TEST_STALL_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis);

        let stop = loop {
            tokio::select! {
                res = self.tracer.next_events(&mut self.events) => {
                    if let Err(err) = res {
                        warn!("reading events failed: {err}");
                    }
                    self.push_events();
                    if let Some(stall) = stall {
                        std::thread::sleep(stall);
                    }
                }
                _ = ticker.tick() => {
                    ticks += 1;
                    if self.watch.as_ref().is_some_and(NetnsWatch::gone) {
                        break Stop::NetnsGone;
                    }
                    // The kernel wakes the reader only when the ring buffer is
                    // filling: read what is there before deciding by the clock.
                    self.tracer.drain(&mut self.events);
                    self.push_events();
                    // Every 5 s also buffers nobody asked for.
                    self.pull_held(ticks.is_multiple_of(25));
                    self.on_tick(ticks.is_multiple_of(5))?;
                    // After this tick's drain and decisions: what was seen
                    // before the signal is in, and decided.
                    if finishing.is_some_and(|t| self.collector.undecided_before(t) == 0) {
                        break Stop::Duration;
                    }
                }
                _ = finish.recv(), if finishing.is_none() => finishing = Some(monotonic_ns()),
                _ = sigint.recv() => break Stop::Signal,
                _ = sigterm.recv() => break Stop::Signal,
                _ = &mut until_deadline => break Stop::Duration,
            }
        };
        Ok(stop)
    }

    /// The ring buffer's latest events into the collector and the recording.
    fn push_events(&mut self) {
        push(
            &mut self.collector,
            self.recorder.as_mut(),
            self.ifnames.as_mut(),
            &mut self.events,
        );
    }

    /// The last events and verdicts, the summary, detaching, and letting the
    /// output reach its readers; a second signal cuts the summary short.
    pub(super) async fn shut_down(
        self,
        stop: Stop,
        sigint: &mut Signal,
        sigterm: &mut Signal,
    ) -> Result<Outcome, SessionError> {
        let Live {
            mut tracer,
            mut collector,
            // Held to the end, as before the split: its metrics stay served
            // while the output drains.
            continuous: _continuous,
            mut recorder,
            mut outputs,
            mut notices,
            mut ifnames,
            watch,
            mut events,
            last_lost: _,
            rules_reread: _,
            conntrack,
            expected,
            started,
            status,
            pods: _,
        } = self;
        // Before the last flows, the summary and the closing lines.
        status.finish();
        let stopped_at = Instant::now();
        let mode = collector.rules().mode;

        // What the kernel still holds; then the last verdicts go to the output
        // threads, which write them while we detach (with hundreds of tcx
        // links detaching takes seconds, see probes/tc.rs).
        tracer.drain(&mut events);
        // And what it holds (buffered flows not yet decided), before the
        // last verdicts: a no_reply flow cut short keeps its hops.
        tracer.pull_older(u64::MAX, &mut events);
        push(
            &mut collector,
            recorder.as_mut(),
            ifnames.as_mut(),
            &mut events,
        );
        let stats = tracer.stats();
        let conntrack_rise = conntrack.rise(&tracer);
        let mut tracer = Some(tracer);
        if stop == Stop::NetnsGone {
            release_deleted_netns(&mut tracer, &mut ifnames, watch.as_ref(), &mut notices);
        }

        let finishing = finish(
            collector,
            &mut outputs,
            recorder.as_mut(),
            stats,
            conntrack_rise,
            &mut notices,
        );
        let interrupted = tokio::select! {
            biased;
            _ = second_signal(sigint, sigterm) => true,
            res = finishing => {
                res?;
                false
            }
        };
        if interrupted {
            notices.say("interrupted again: exiting now without the summary");
        }
        // Detaches everything, also after a second Ctrl-C.
        detach(tracer, &mut notices);

        drain_outputs(
            stop,
            stopped_at,
            interrupted,
            recorder.as_mut(),
            &mut outputs,
            &mut notices,
        );
        let mut outcome = std::mem::take(&mut outputs.outcome);
        outcome.aborted = stop == Stop::NetnsGone;
        if !interrupted {
            outcome.no_flow = no_flow(&outcome, &expected);
            let secs = (stopped_at - started).as_secs_f64();
            for e in expected
                .iter()
                .filter(|e| outcome.no_flow.contains(&e.label))
            {
                let ipv6 = e.services.first().is_some_and(|s| s.addr.is_ipv6());
                notices.say(format_args!(
                    "no connection to {} was seen in {secs:.1}s; check the address and port (the Services: {}) and that a client connects to it while nattrace runs",
                    e.label,
                    crate::service_lookup::list_command(mode, ipv6)
                ));
            }
            notices.drain(
                Instant::now() + Duration::from_millis(200),
                Duration::from_millis(100),
            );
        }
        Ok(outcome)
    }
}

/// The `--svc` targets none of whose addresses any decided flow went to.
fn no_flow(outcome: &Outcome, expected: &[super::Expected]) -> Vec<String> {
    expected
        .iter()
        .filter(|e| !e.services.iter().any(|s| outcome.saw(s)))
        .map(|e| e.label.clone())
        .collect()
}
