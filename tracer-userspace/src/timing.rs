//! Start-up step timings, logged at debug level (`RUST_LOG=debug`): how long
//! each step between exec and the `start` line took and when it ended,
//! in ms since the process began (docs/DESIGN.md, "Start-up").
use std::{sync::OnceLock, time::Instant};

static STARTED: OnceLock<Instant> = OnceLock::new();

/// Marks the process start; call first thing in `main`.
pub fn init() {
    STARTED.get_or_init(Instant::now);
}

fn since_start_ms() -> f64 {
    STARTED.get_or_init(Instant::now).elapsed().as_secs_f64() * 1e3
}

/// A step being timed: logs its duration when dropped.
pub struct Step {
    name: &'static str,
    began: Instant,
}

/// Times `name` until the returned guard is dropped.
#[must_use = "the step is timed until this guard drops"]
pub fn step(name: &'static str) -> Step {
    Step {
        name,
        began: Instant::now(),
    }
}

impl Drop for Step {
    fn drop(&mut self) {
        if log::log_enabled!(log::Level::Debug) {
            log::debug!(
                "start-up: {} took {:.1} ms (done at {:.1} ms)",
                self.name,
                self.began.elapsed().as_secs_f64() * 1e3,
                since_start_ms()
            );
        }
    }
}

/// Logs that `what` happened now.
pub fn mark(what: &str) {
    if log::log_enabled!(log::Level::Debug) {
        log::debug!("start-up: {what} at {:.1} ms", since_start_ms());
    }
}
