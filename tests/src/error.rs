//! The lab's error type. Every failure names the command that failed, the
//! namespace it ran in and what it printed, because a lab failure is almost
//! always an environment problem the reader has to fix by hand.

use std::io;

/// Everything that can go wrong while building, using or tearing down a lab.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    /// Network namespaces, veths and iptables need CAP_NET_ADMIN/CAP_SYS_ADMIN.
    #[error("the lab needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); running as uid {uid}")]
    NotRoot {
        /// The effective uid we run as.
        uid: u32,
    },

    /// The declarative description is inconsistent (duplicate names, unknown pods, ...).
    #[error("invalid lab spec: {0}")]
    Spec(String),

    /// A command ran but exited unsuccessfully.
    #[error("`{command}` (in {netns}) failed with {status}: {stderr}")]
    Command {
        /// The command line, shell-quoted loosely for reading.
        command: String,
        /// Which namespace it ran in (`root` for `ip -n ...` style commands).
        netns: String,
        /// Exit status as printed by std.
        status: String,
        /// Its stderr (or stdout when stderr was empty), trimmed.
        stderr: String,
    },

    /// A command could not be started at all (missing binary, setns failure).
    #[error("could not start `{command}` (in {netns}): {source}")]
    Spawn {
        /// The command line.
        command: String,
        /// Which namespace it was meant to run in.
        netns: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },

    /// A command did not finish in time and was killed.
    #[error("`{command}` (in {netns}) did not finish within {seconds:.1}s and was killed")]
    Timeout {
        /// The command line.
        command: String,
        /// Which namespace it ran in.
        netns: String,
        /// The limit that was exceeded.
        seconds: f64,
    },

    /// A server process in a pod exited or stayed silent instead of reporting readiness.
    #[error("{server} in pod {pod} did not become ready: {detail}")]
    ServerNotReady {
        /// Which server (e.g. `http :80`).
        server: String,
        /// The pod it was started in.
        pod: String,
        /// What we saw instead (its stderr, or a timeout).
        detail: String,
    },

    /// The `lab-server` binary (the pods' HTTP and DNS servers) was not found.
    #[error(
        "the lab's server binary `lab-server` was not found (looked at {searched}); build it with \
         `cargo build -p nattrace-tests --bins`, or point NATTRACE_LAB_SERVER at it"
    )]
    LabServerMissing {
        /// The paths tried, comma separated.
        searched: String,
    },

    /// `exec`/`netns` was called with a name the lab does not know.
    #[error("no lab namespace named {name:?} (known: {known})")]
    UnknownTarget {
        /// The name asked for.
        name: String,
        /// The names that exist, comma separated.
        known: String,
    },

    /// Any other I/O error, with what we were doing.
    #[error("{what}: {source}")]
    Io {
        /// What the lab was doing.
        what: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

/// Result alias for the lab.
pub type Result<T, E = LabError> = std::result::Result<T, E>;

impl LabError {
    pub(crate) fn io(what: impl Into<String>, source: io::Error) -> Self {
        LabError::Io {
            what: what.into(),
            source,
        }
    }
}
