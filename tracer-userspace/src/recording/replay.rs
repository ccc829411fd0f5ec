//! Test support: a recording decided the way the live session decided it,
//! for every test that replays a recorded fixture.
use std::io::BufRead;

use super::{Header, Reader, Record};
use crate::collector::{Collector, FlowReport, Summary};

/// Events (and interface names) go in, a tick at every stats line, finish at
/// the end line — or, with `stop_after`, that long after the first event, as
/// if the session had been stopped then.
pub(crate) fn replay<R: BufRead>(
    reader: &mut Reader<R>,
    header: &Header,
    stop_after: Option<u64>,
) -> (Vec<FlowReport>, Summary) {
    let mut c = Collector::new(header.collector_config().expect("config"));
    let mut out = Vec::new();
    let mut first = None;
    let mut end = 0;
    for rec in reader.by_ref() {
        let now = match rec {
            Record::Event(ev) => {
                let t0 = *first.get_or_insert(ev.ts_ns);
                if let Some(d) = stop_after
                    && ev.ts_ns > t0 + d
                {
                    end = t0 + d;
                    break;
                }
                c.push(ev);
                continue;
            }
            Record::Interface(i) => {
                c.learn_interface(i.netns, i.ifindex, &i.name);
                continue;
            }
            Record::Stats(s) => {
                c.note_lost(s.lost_events);
                s.now_ns
            }
            Record::End(s) => {
                end = s.now_ns;
                break;
            }
            Record::Capped { .. } | Record::Rotated { .. } => continue,
            Record::Rules(rules) => {
                c.update_rules(*rules);
                continue;
            }
        };
        if let (Some(t0), Some(d)) = (first, stop_after)
            && now > t0 + d
        {
            end = t0 + d;
            break;
        }
        out.extend(c.tick(now));
        end = now;
    }
    let (rest, summary) = c.finish(end);
    out.extend(rest);
    (out, summary)
}
