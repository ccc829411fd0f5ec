//! The files of one rotated run (`--write-keep`: FILE.2, FILE.1, FILE) read
//! as the one stream the session wrote, so a flow that crosses a rotation
//! is decided whole instead of as two halves (`? no_reply`). Files belong
//! together by the header's `run_id` and follow its `file_seq`; each starts
//! with its own header and interface names (learnt again, harmlessly) and
//! counts the kernel's counters from zero, so the counters are added up
//! across the files.
use std::io::BufRead;

use super::{Header, Reader, Record, StatsLine, replay::Records};

pub struct Chain<R> {
    readers: Vec<Reader<R>>,
    at: usize,
    /// The counters at the end of the files before this one.
    base: StatsLine,
    last: StatsLine,
}

impl<R: BufRead> Chain<R> {
    /// `readers` in the order they were written.
    pub fn new(readers: Vec<Reader<R>>) -> Self {
        assert!(!readers.is_empty(), "a chain of no file");
        Self {
            readers,
            at: 0,
            base: StatsLine::default(),
            last: StatsLine::default(),
        }
    }

    pub fn readers(&self) -> &[Reader<R>] {
        &self.readers
    }

    /// The newest file: where the run ended (or was cut).
    pub fn newest(&self) -> &Reader<R> {
        self.readers.last().expect("not empty")
    }

    fn on(&self, mut s: StatsLine) -> StatsLine {
        let b = &self.base;
        s.lost_events += b.lost_events;
        s.kernel_events += b.kernel_events;
        s.muted_packets += b.muted_packets;
        s.flow_map_full += b.flow_map_full;
        s.held_discarded += b.held_discarded;
        s.held_spilled += b.held_spilled;
        s.held_map_full += b.held_map_full;
        s
    }
}

impl<R: BufRead> Iterator for Chain<R> {
    type Item = Record;

    fn next(&mut self) -> Option<Record> {
        loop {
            let more = self.at + 1 < self.readers.len();
            match self.readers[self.at].next() {
                None if more => {
                    self.base = self.on(self.last);
                    self.last = StatsLine::default();
                    self.at += 1;
                }
                None => return None,
                // The run goes on in the next file, which is here.
                Some(Record::Rotated { .. }) if more => {}
                Some(Record::Stats(s)) => {
                    self.last = s;
                    return Some(Record::Stats(self.on(s)));
                }
                Some(Record::End(s)) => {
                    self.last = s;
                    return Some(Record::End(self.on(s)));
                }
                Some(other) => return Some(other),
            }
        }
    }
}

impl<R: BufRead> Records for Chain<R> {
    fn skipped_lines(&self) -> u64 {
        self.readers.iter().map(|r| r.skipped_lines).sum()
    }
}

/// Groups files (as given) into runs: files of one `run_id` with distinct
/// `file_seq`s are one run, in `file_seq` order; every other file (older
/// recordings, copies of one file, other nodes) is a run of its own.
/// Returns indexes into `headers`, each group in reading order, the groups
/// in the order their first file was given.
pub fn group(headers: &[Header]) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (i, h) in headers.iter().enumerate() {
        let joins = h.run_id.as_ref().and_then(|id| {
            groups.iter().position(|g| {
                let first = &headers[g[0]];
                first.run_id.as_ref() == Some(id)
                    && h.file_seq.is_some()
                    && g.iter().all(|&j| headers[j].file_seq != h.file_seq)
            })
        });
        match joins {
            Some(g) => groups[g].push(i),
            None => groups.push(vec![i]),
        }
    }
    for g in &mut groups {
        g.sort_by_key(|&i| headers[i].file_seq);
    }
    groups
}
