//! `vm-guest --record-fixtures`: the guest's `--write` recordings leave the
//! guest on its serial console, the one channel the host reads (the guest has
//! no network and no shared disk). xtask/src/vm/fixtures.rs cuts them out of
//! the console log into the collector's recorded fixtures.
//!
//! ```text
//! NATTRACE-FIXTURE-BEGIN NAME
//! NATTRACE-FIXTURE NAME LINE      (one per line of the recording, verbatim)
//! NATTRACE-FIXTURE-END NAME COUNT
//! ```
//! Recordings are JSON lines with control characters escaped, so a line
//! survives the console as it is; COUNT lets the host notice a lost line.

use std::path::{Path, PathBuf};

use lab::tracer::say;

/// Keep these in step with xtask/src/vm/fixtures.rs.
pub const BEGIN: &str = "NATTRACE-FIXTURE-BEGIN ";
pub const LINE: &str = "NATTRACE-FIXTURE ";
pub const END: &str = "NATTRACE-FIXTURE-END ";

/// The fixture's name: kernel series, backend and scenario, e.g.
/// `vm6_12_kprobe_seed000_broken` (no dots: the name is a file stem).
pub fn name(release: &str, backend: &str, scenario: &str) -> String {
    let series: Vec<&str> = release
        .split(|c: char| !c.is_ascii_digit())
        .take(2)
        .collect();
    format!(
        "vm{}_{backend}_{}",
        series.join("_"),
        scenario.replace('-', "_")
    )
}

/// Where the guest's nattrace writes the recording named `name`.
pub fn path(name: &str) -> PathBuf {
    PathBuf::from(format!("/tmp/{name}.rec"))
}

/// Prints the recording at `rec` between the markers.
pub fn print(name: &str, rec: &Path) -> Result<String, String> {
    let text =
        std::fs::read_to_string(rec).map_err(|e| format!("reading {}: {e}", rec.display()))?;
    let lines: Vec<&str> = text.lines().collect();
    if lines.is_empty() {
        return Err(format!("{} is empty", rec.display()));
    }
    say(&format!("{BEGIN}{name}"));
    for l in &lines {
        say(&format!("{LINE}{name} {l}"));
    }
    say(&format!("{END}{name} {}", lines.len()));
    Ok(format!(
        "{} lines of {} on the console",
        lines.len(),
        rec.display()
    ))
}
