//! Reading a recording that may be cut short, corrupt, from another version,
//! or crafted: every line is bounded and nothing panics. A line that does
//! not make sense (a block of NUL bytes after a crash, wrong types, an
//! overlong line) is skipped and counted, and reading goes on; only the end
//! of the input before the `end` record stops it with a [`ReadProblem`].
use std::{
    fs::File,
    io::{self, BufRead, BufReader, Read},
    path::Path,
};

use tracer_common::PacketEvent;

use super::{FORMAT, Header, InterfaceName, Line, RecordingError, StatsLine, VERSION};

/// A line longer than this is not one we wrote (a header with thousands of
/// interfaces is ~1 MiB): reading stops instead of allocating without bound.
pub const MAX_LINE_BYTES: usize = 8 << 20;
/// Event times beyond this would overflow the collector's deadline
/// arithmetic; CLOCK_MONOTONIC reaches it after ~146 years of uptime.
const MAX_TS_NS: u64 = 1 << 62;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    Event(PacketEvent),
    Interface(InterfaceName),
    Stats(StatsLine),
    Capped {
        bytes: u64,
    },
    /// kube-proxy's rules changed during the run.
    Rules(Box<crate::ruleset::KubeProxyRules>),
    /// The recording goes on in a newer file (`--write-keep`).
    Rotated {
        bytes: u64,
    },
    /// The node's sysctls, read again when an established flow went wrong.
    Sysctls(crate::facts::Sysctls),
    End(StatsLine),
    /// conntrack's table read again during the run.
    Conntrack(crate::facts::ConntrackTable),
    /// The node's pod namespaces.
    Pods(crate::pods::PodIndex),
    /// conntrack's entry of a flow that failed the watch.
    CtEntry(Box<crate::ctnetlink::CtLookup>),
}

/// Why the recording was read only in part (one line for the user).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadProblem {
    /// 1-based number of the first line not used.
    pub line: u64,
    pub why: String,
}

pub struct Reader<R> {
    inner: R,
    line_no: u64,
    buf: Vec<u8>,
    problem: Option<ReadProblem>,
    finished: bool,
    /// Lines of a kind this version does not know (a newer writer): skipped.
    pub unknown_lines: u64,
    /// Lines that are not valid records: skipped.
    pub skipped_lines: u64,
    /// The first of them, and why.
    pub first_skipped: Option<ReadProblem>,
    /// The header's format version when newer than [`VERSION`].
    pub newer_version: Option<u32>,
    /// The file ends in the middle of a line.
    pub cut_off: bool,
}

enum Raw {
    Eof,
    Line,
    /// EOF in the middle of a line: the writer was cut off.
    Partial,
    TooLong,
}

/// The path that stands for stdin.
pub const STDIN: &str = "-";

impl Reader<BufReader<File>> {
    /// `path`, or stdin for `-` (`nattrace analyze -`, a recording piped
    /// from another node: `ssh node cat x.rec | nattrace analyze -`).
    pub fn open(path: &Path) -> Result<(Self, Header), RecordingError> {
        let file = if path == Path::new(STDIN) {
            use std::os::fd::AsFd as _;
            io::stdin().as_fd().try_clone_to_owned().map(File::from)
        } else {
            File::open(path)
        };
        let file = file.map_err(|error| RecordingError::Open {
            path: path.to_owned(),
            error,
        })?;
        if file.metadata().is_ok_and(|m| m.is_dir()) {
            return Err(RecordingError::Open {
                path: path.to_owned(),
                error: io::Error::other("it is a directory"),
            });
        }
        Reader::new(BufReader::with_capacity(256 * 1024, file)).map_err(|why| {
            RecordingError::NotARecording {
                path: path.to_owned(),
                why,
            }
        })
    }
}

impl<R: BufRead> Reader<R> {
    /// Reads the header; Err(why) if the input does not start with one.
    pub fn new(inner: R) -> Result<(Self, Header), String> {
        let mut r = Reader {
            inner,
            line_no: 0,
            buf: Vec::new(),
            problem: None,
            finished: false,
            unknown_lines: 0,
            skipped_lines: 0,
            first_skipped: None,
            cut_off: false,
            newer_version: None,
        };
        match r.raw_line() {
            Ok(Raw::Line | Raw::Partial) => {}
            Ok(Raw::Eof) => return Err("the file is empty".into()),
            Ok(Raw::TooLong) => return Err("the first line is not a header (too long)".into()),
            Err(e) => return Err(e.to_string()),
        }
        let header = match serde_json::from_slice::<Line>(&r.buf) {
            Ok(Line::Header(h)) => *h,
            Ok(_) => return Err("the first line is not a header".into()),
            Err(e) => return Err(format!("the first line is not a header ({e})")),
        };
        if header.format != FORMAT {
            return Err(format!(
                "format '{}', expected '{FORMAT}'",
                header.format.chars().take(64).collect::<String>()
            ));
        }
        if header.version > VERSION {
            r.newer_version = Some(header.version);
        }
        Ok((r, header))
    }

    /// Why reading stopped early, if it did (only meaningful once `next`
    /// has returned None).
    pub fn problem(&self) -> Option<&ReadProblem> {
        self.problem.as_ref()
    }

    /// Lines read so far (header included).
    pub fn lines_read(&self) -> u64 {
        self.line_no
    }

    fn raw_line(&mut self) -> io::Result<Raw> {
        self.buf.clear();
        let limit = MAX_LINE_BYTES as u64 + 1;
        let n = (&mut self.inner)
            .take(limit)
            .read_until(b'\n', &mut self.buf)?;
        if n == 0 {
            return Ok(Raw::Eof);
        }
        self.line_no += 1;
        if self.buf.last() == Some(&b'\n') {
            self.buf.pop();
            return Ok(Raw::Line);
        }
        if self.buf.len() > MAX_LINE_BYTES {
            return Ok(Raw::TooLong);
        }
        Ok(Raw::Partial)
    }

    /// After [`Raw::TooLong`]: reads up to the end of that line without keeping it.
    fn skip_rest_of_line(&mut self) -> io::Result<()> {
        loop {
            self.buf.clear();
            let n = (&mut self.inner)
                .take(1 << 20)
                .read_until(b'\n', &mut self.buf)?;
            if n == 0 || self.buf.last() == Some(&b'\n') {
                self.buf.clear();
                return Ok(());
            }
        }
    }

    /// Counts a line that is not a valid record and goes on.
    fn skip(&mut self, why: impl Into<String>) {
        self.skipped_lines += 1;
        if self.first_skipped.is_none() {
            self.first_skipped = Some(ReadProblem {
                line: self.line_no,
                why: why.into(),
            });
        }
    }

    fn stop(&mut self, why: impl Into<String>) -> Option<Record> {
        self.finished = true;
        self.problem = Some(ReadProblem {
            line: self.line_no,
            why: why.into(),
        });
        None
    }

    fn next_record(&mut self) -> Option<Record> {
        loop {
            if self.finished {
                return None;
            }
            match self.raw_line() {
                Err(e) => return self.stop(format!("read error: {e}")),
                Ok(Raw::Eof) => {
                    self.line_no += 1;
                    return self.stop("no end record (nattrace was killed or the file was cut)");
                }
                Ok(Raw::TooLong) => {
                    if let Err(e) = self.skip_rest_of_line() {
                        return self.stop(format!("read error: {e}"));
                    }
                    self.skip(format!("line longer than {MAX_LINE_BYTES} bytes"));
                    continue;
                }
                Ok(Raw::Partial) => {
                    self.cut_off = true;
                    return self.stop("the last line is incomplete (the writer was cut off)");
                }
                Ok(Raw::Line) => {}
            }
            // A crash can leave a block of NUL bytes where the file system
            // had allocated but not written: a record may follow it on the
            // same line.
            let start = self
                .buf
                .iter()
                .position(|&b| b != 0)
                .unwrap_or(self.buf.len());
            if start > 0 {
                self.buf.drain(..start);
            }
            while self.buf.last() == Some(&0) {
                self.buf.pop();
            }
            if self.buf.iter().all(u8::is_ascii_whitespace) {
                if start > 0 {
                    self.skip("NUL bytes");
                }
                continue;
            }
            let line = match serde_json::from_slice::<Line>(&self.buf) {
                Ok(line) => line,
                Err(e) => {
                    if self.is_unknown_kind() {
                        self.unknown_lines += 1;
                    } else {
                        self.skip(format!("not a valid record ({e})"));
                    }
                    continue;
                }
            };
            return match line {
                Line::Event(ev) if ev.ts_ns >= MAX_TS_NS => {
                    self.skip("event time out of range");
                    continue;
                }
                // The collector has no place for a hook it does not know:
                // counted and warned about, never dropped silently.
                Line::Event(ev) if tracer_common::hook::name(ev.hook) == "unknown" => {
                    self.skip(format!("event with unknown hook {}", ev.hook));
                    continue;
                }
                Line::Event(ev) => Some(Record::Event(ev)),
                // Names only label output: an overlong one is cut, not fatal.
                Line::Interface(mut i) => {
                    i.name = i.name.chars().take(64).collect();
                    Some(Record::Interface(i))
                }
                Line::Stats(s) if s.now_ns >= MAX_TS_NS => {
                    self.skip("stats time out of range");
                    continue;
                }
                Line::Stats(s) => Some(Record::Stats(s)),
                Line::Header(_) => {
                    self.skip("a second header");
                    continue;
                }
                Line::Capped { bytes } => {
                    self.finished = true;
                    Some(Record::Capped { bytes })
                }
                Line::Rotated { bytes } => {
                    self.finished = true;
                    Some(Record::Rotated { bytes })
                }
                Line::Rules { kube_proxy } => Some(Record::Rules(Box::new(kube_proxy))),
                Line::Sysctls(s) => Some(Record::Sysctls(s)),
                Line::Conntrack(t) => Some(Record::Conntrack(t)),
                Line::Pods(p) => Some(Record::Pods(p)),
                Line::CtEntry(l) => Some(Record::CtEntry(l)),
                Line::End(s) if s.now_ns >= MAX_TS_NS => {
                    self.skip("end time out of range");
                    continue;
                }
                Line::End(s) => {
                    self.finished = true;
                    Some(Record::End(s))
                }
            };
        }
    }

    /// A well-formed object whose `kind` this version does not know:
    /// written by a newer nattrace, safe to skip.
    fn is_unknown_kind(&self) -> bool {
        #[derive(serde::Deserialize)]
        struct Kind<'a> {
            #[serde(borrow)]
            kind: std::borrow::Cow<'a, str>,
        }
        serde_json::from_slice::<Kind>(&self.buf).is_ok_and(|k| {
            !matches!(
                &*k.kind,
                "header" | "event" | "interface" | "stats" | "capped" | "end" | "rules" | "rotated"
            )
        })
    }
}

impl<R: BufRead> Iterator for Reader<R> {
    type Item = Record;

    fn next(&mut self) -> Option<Record> {
        self.next_record()
    }
}
