//! nattrace's userspace: probes are loaded by [`probes`], their events are
//! stitched into flows and verdicts by [`collector`] (pure, no I/O), and
//! written by [`output`]. The binary (`main.rs`) is a thin CLI over these.
pub mod analyze;
pub mod btf;
pub mod collector;
pub mod continuous;
pub mod ctnetlink;
pub mod doctor;
pub mod facts;
pub mod host;
pub mod merge;
pub mod output;
pub mod pods;
pub mod probes;
pub mod recording;
pub mod ruleset;
pub mod service;
pub mod service_lookup;
pub mod session;
pub mod timing;
