//! `cargo xtask vm-test --record-fixtures DIR`: the guests' recordings, cut
//! out of their console logs (tests/src/bin/vm-guest/record.rs prints them:
//! the guest has no other way out) into `DIR/NAME.rec`, each with its golden
//! `analyze --output json -v` (`DIR/NAME.json`) like `cargo xtask fixtures`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// Keep these in step with tests/src/bin/vm-guest/record.rs.
const BEGIN: &str = "NATTRACE-FIXTURE-BEGIN ";
const LINE: &str = "NATTRACE-FIXTURE ";
const END: &str = "NATTRACE-FIXTURE-END ";

/// What the guest runs to record: only the kprobe backend, the one this host
/// cannot record (`cargo xtask fixtures` covers the netfilter backend here).
pub const PAYLOAD: &str = "/bin/vm-guest --record-fixtures --backends kprobe";

/// The recordings in one guest's console log, as (name, lines).
fn extract(log: &str) -> Result<Vec<(String, Vec<String>)>> {
    let mut found = Vec::new();
    let mut current: Option<(String, Vec<String>)> = None;
    for line in log.lines() {
        // find, not starts_with: the kernel may print mid-line on the console.
        if let Some(i) = line.find(BEGIN) {
            let name = line[i + BEGIN.len()..].trim();
            if let Some((open, _)) = current.replace((name.to_string(), Vec::new())) {
                bail!("recording {open} has no end marker");
            }
        } else if let Some(i) = line.find(END) {
            let (name, count) = line[i + END.len()..]
                .trim()
                .split_once(' ')
                .context("end marker without a line count")?;
            let (open, lines) = current.take().context("end marker without a begin")?;
            let count: usize = count.parse().context("end marker's line count")?;
            if open != name || lines.len() != count {
                bail!(
                    "recording {open}: {} lines on the console, the guest printed {count} of {name}",
                    lines.len()
                );
            }
            found.push((open, lines));
        } else if let Some(i) = line.find(LINE) {
            let (name, text) = line[i + LINE.len()..]
                .split_once(' ')
                .context("fixture line without text")?;
            let (open, lines) = current
                .as_mut()
                .with_context(|| format!("line of {name} outside its markers"))?;
            // A JSON object per line; anything else is a console mix-up.
            if open != name || !text.starts_with('{') || !text.ends_with('}') {
                bail!("recording {open}: garbled console line: {line}");
            }
            lines.push(text.to_string());
        }
    }
    if let Some((open, _)) = current {
        bail!("recording {open} has no end marker (guest stopped early?)");
    }
    Ok(found)
}

/// Writes every recording in the console log at `log` into `dir`, with its
/// golden analyze output; returns the recordings written.
pub fn write(log: &Path, dir: &Path, nattrace: &Path) -> Result<Vec<PathBuf>> {
    let text =
        std::fs::read_to_string(log).with_context(|| format!("reading {}", log.display()))?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut written = Vec::new();
    for (name, lines) in extract(&text).with_context(|| log.display().to_string())? {
        let rec = dir.join(format!("{name}.rec"));
        std::fs::write(&rec, lines.join("\n") + "\n")
            .with_context(|| format!("writing {}", rec.display()))?;
        crate::workspace::write_golden(nattrace, &rec)?;
        written.push(rec);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::extract;

    #[test]
    fn recordings_are_cut_out_of_the_console_log() {
        let log = "[6.12] vm-guest: PASS something\n\
                   NATTRACE-FIXTURE-BEGIN a\n\
                   NATTRACE-FIXTURE a {\"kind\":\"header\"}\n\
                   [   12.5] some kernel line\n\
                   NATTRACE-FIXTURE a {\"kind\":\"end\"}\n\
                   NATTRACE-FIXTURE-END a 2\n\
                   NATTRACE-FIXTURE-BEGIN b\n\
                   NATTRACE-FIXTURE b {}\n\
                   NATTRACE-FIXTURE-END b 1\n";
        let got = extract(log).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].0, "a");
        assert_eq!(got[0].1, ["{\"kind\":\"header\"}", "{\"kind\":\"end\"}"]);
        assert_eq!(got[1], ("b".to_string(), vec!["{}".to_string()]));
    }

    #[test]
    fn a_lost_or_garbled_line_fails() {
        let lost = "NATTRACE-FIXTURE-BEGIN a\nNATTRACE-FIXTURE a {}\nNATTRACE-FIXTURE-END a 2\n";
        assert!(extract(lost).is_err());
        // A kernel message landed in the middle of a recording's line.
        let garbled = "NATTRACE-FIXTURE-BEGIN a\nNATTRACE-FIXTURE a {\"k\"[ 3.1] oops\nNATTRACE-FIXTURE-END a 1\n";
        assert!(extract(garbled).is_err());
        let unended = "NATTRACE-FIXTURE-BEGIN a\nNATTRACE-FIXTURE a {}\n";
        assert!(extract(unended).is_err());
    }
}
