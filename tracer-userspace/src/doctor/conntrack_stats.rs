//! conntrack's own statistics in the node namespace (issue 22):
//! `/proc/net/stat/nf_conntrack`, one line of hexadecimal counters per CPU
//! under a header naming them. The counters are the namespace's
//! (`net->ct.stat`, per CPU; net/netfilter/nf_conntrack_standalone.c
//! ct_cpu_seq_show), so the file must be read from inside the node's
//! namespace; the sum over CPUs is what `conntrack -S` adds up too.
//!
//! What the ones reported mean (net/netfilter/nf_conntrack_core.c):
//! - `insert_failed`: a new entry could not be confirmed at the last hook
//!   because an equal one was inserted first (two packets of one new
//!   connection on two CPUs, or a SNAT source-port collision) and the
//!   clash could not be resolved: the packet is dropped (`__nf_conntrack_confirm`).
//! - `drop`: dropped for want of room — a full table where no entry could
//!   be evicted (`__nf_conntrack_alloc`: "table full, dropping packet"),
//!   or a clash that was not resolved.
//! - `early_drop`: an unreplied entry evicted to make room (a full table).
//! - `invalid`: packets conntrack could not track (out of window, bad state).
//! - `clash_resolve` (`clashres`): a clash resolved instead of dropped
//!   (`nf_ct_resolve_clash`).
use serde::{Deserialize, Serialize};

/// The counters summed over CPUs; None where this kernel has no column.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ConntrackStats {
    pub insert_failed: Option<u64>,
    pub drop: Option<u64>,
    pub early_drop: Option<u64>,
    pub invalid: Option<u64>,
    pub clash_resolve: Option<u64>,
}

/// The counters' names in the file, as the kernel prints them.
const COLUMNS: [&str; 5] = ["insert_failed", "drop", "early_drop", "invalid", "clashres"];

impl ConntrackStats {
    /// Parses the file's text; None if it has no header line.
    pub fn parse(text: &str) -> Option<Self> {
        let mut lines = text.lines();
        let header: Vec<&str> = lines.next()?.split_whitespace().collect();
        let at = |name: &str| header.iter().position(|h| *h == name);
        let idx = COLUMNS.map(at);
        let mut sums = [None::<u64>; 5];
        for line in lines {
            let cells: Vec<&str> = line.split_whitespace().collect();
            for (k, i) in idx.iter().enumerate() {
                let Some(v) = i
                    .and_then(|i| cells.get(i))
                    .and_then(|c| u64::from_str_radix(c, 16).ok())
                else {
                    continue;
                };
                sums[k] = Some(sums[k].unwrap_or(0).saturating_add(v));
            }
        }
        let [insert_failed, drop, early_drop, invalid, clash_resolve] = sums;
        Some(Self {
            insert_failed,
            drop,
            early_drop,
            invalid,
            clash_resolve,
        })
    }

    /// Reads the calling thread's namespace's counters (call inside the
    /// node's). Through `thread-self`: `/proc/net` is `/proc/self/net`,
    /// the namespace of the process's main thread, not of a thread that
    /// entered the node's namespace with setns.
    pub fn read() -> Option<Self> {
        Self::parse(&std::fs::read_to_string("/proc/thread-self/net/stat/nf_conntrack").ok()?)
    }

    /// Each counter with its name, for metrics and text.
    pub fn named(&self) -> [(&'static str, Option<u64>); 5] {
        [
            ("insert_failed", self.insert_failed),
            ("drop", self.drop),
            ("early_drop", self.early_drop),
            ("invalid", self.invalid),
            ("clash_resolve", self.clash_resolve),
        ]
    }

    /// How much each counter rose from `before` to `self` (a counter that
    /// went down — module reloaded — counts from zero).
    pub fn rise_since(&self, before: &Self) -> Self {
        let d = |now: Option<u64>, then: Option<u64>| {
            now.map(|n| match then {
                Some(t) if t <= n => n - t,
                _ => n,
            })
        };
        Self {
            insert_failed: d(self.insert_failed, before.insert_failed),
            drop: d(self.drop, before.drop),
            early_drop: d(self.early_drop, before.early_drop),
            invalid: d(self.invalid, before.invalid),
            clash_resolve: d(self.clash_resolve, before.clash_resolve),
        }
    }

    /// `insert_failed=N drop=N …`, the counters this kernel has.
    pub fn describe(&self) -> String {
        self.named()
            .iter()
            .filter_map(|(n, v)| v.map(|v| format!("{n}={v}")))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Packets conntrack itself dropped (not a rule): insert failures and
    /// drops for want of room.
    pub fn dropped(&self) -> u64 {
        self.insert_failed.unwrap_or(0) + self.drop.unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two CPUs of a 6.18 kernel's file.
    const TEXT: &str = "entries  clashres found new invalid ignore delete chainlength insert insert_failed drop early_drop icmp_error  expect_new expect_create expect_delete search_restart
00000010  00000002 00000000 00000000 0000000a 00000000 00000000 00000000 00000000 00000003 00000001 00000000 00000000  00000000 00000000 00000000 00000000
00000010  00000001 00000000 00000000 00000001 00000000 00000000 00000000 00000000 00000010 00000000 00000004 00000000  00000000 00000000 00000000 00000000
";

    #[test]
    fn sums_the_cpus_by_column_name() {
        let s = ConntrackStats::parse(TEXT).unwrap();
        assert_eq!(s.insert_failed, Some(0x13));
        assert_eq!(s.drop, Some(1));
        assert_eq!(s.early_drop, Some(4));
        assert_eq!(s.invalid, Some(11));
        assert_eq!(s.clash_resolve, Some(3));
        assert_eq!(s.dropped(), 0x14);
        assert_eq!(
            s.describe(),
            "insert_failed=19 drop=1 early_drop=4 invalid=11 clash_resolve=3"
        );
    }

    #[test]
    fn a_kernel_without_a_column_has_none() {
        let old = "entries searched found new invalid ignore delete delete_list insert insert_failed drop early_drop icmp_error expect_new expect_create expect_delete search_restart\n00000001 00000000 00000000 00000000 00000002 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000\n";
        let s = ConntrackStats::parse(old).unwrap();
        assert_eq!(s.clash_resolve, None);
        assert_eq!(s.invalid, Some(2));
    }

    #[test]
    fn rise_over_a_run() {
        let before = ConntrackStats::parse(TEXT).unwrap();
        let mut after = before;
        after.insert_failed = Some(0x13 + 5);
        let rise = after.rise_since(&before);
        assert_eq!(rise.insert_failed, Some(5));
        assert_eq!(rise.drop, Some(0));
        assert_eq!(ConntrackStats::parse(""), None);
    }
}

#[cfg(test)]
mod doctor_tests {
    use super::*;
    use crate::doctor::{Inputs, Severity, assess};

    fn finding(stats: ConntrackStats) -> crate::doctor::Finding {
        let i = Inputs {
            conntrack_stats: Some(stats),
            ..Inputs::default()
        };
        assess(&i)
            .findings
            .into_iter()
            .find(|f| f.check == "conntrack_stats")
            .expect("a conntrack_stats finding")
    }

    #[test]
    fn drops_by_conntrack_itself_are_a_warning_never_an_error() {
        let quiet = ConntrackStats {
            invalid: Some(7),
            clash_resolve: Some(2),
            ..ConntrackStats::default()
        };
        assert_eq!(finding(quiet).severity, Severity::Ok);
        let f = finding(ConntrackStats {
            insert_failed: Some(3),
            ..quiet
        });
        assert_eq!(f.severity, Severity::Warning);
        assert_eq!(f.value, "conntrack_dropped=3");
        assert!(f.message.contains("insert_failed=3"), "{}", f.message);
        assert!(f.fix.unwrap().contains("--random-fully"));
    }
}
