//! The pods' names as reports use them, indexed once per read of the
//! node's pods (`Collector::update_pods`) instead of per hop: each hop
//! scanned every pod for its namespace and formatted a fresh label (two
//! per healthy connection, ~1.6k instructions in callgrind; on a
//! 1,000-pod node the scan alone is a thousand comparisons per hop).
use std::{collections::HashMap, net::IpAddr};

use super::types::Name;
use crate::pods::PodIndex;

type Fast = foldhash::fast::RandomState;

#[derive(Debug, Default)]
pub(crate) struct PodNames {
    /// A namespace's label ("ns/name", or "netns NAME"); None for a
    /// namespace listed without either (the first entry of a namespace
    /// decides, as `PodIndex::by_netns`).
    labels: HashMap<u32, Option<Name>, Fast>,
    /// The named pod owning an address; the first one listed wins, as
    /// `PodIndex::pod_of`.
    by_addr: HashMap<IpAddr, Name, Fast>,
}

impl PodNames {
    pub(crate) fn new(pods: &PodIndex) -> Self {
        let mut names = PodNames::default();
        for p in pods.pods.iter().filter(|p| p.netns != 0) {
            names
                .labels
                .entry(p.netns)
                .or_insert_with(|| p.label().map(|l| Name(l.into())));
        }
        for p in &pods.pods {
            let Some(pod) = &p.pod else { continue };
            let pod = Name(pod.as_str().into());
            for a in &p.addrs {
                names.by_addr.entry(*a).or_insert_with(|| pod.clone());
            }
        }
        names
    }

    /// What `PodIndex::netns_label` says, without formatting it again.
    pub(crate) fn label(&self, netns: u32) -> Option<&Name> {
        self.labels.get(&netns)?.as_ref()
    }

    /// What `PodIndex::pod_of` says.
    pub(crate) fn pod_of(&self, addr: IpAddr) -> Option<&Name> {
        self.by_addr.get(&addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pods::PodEntry;

    fn entry(netns: u32, addrs: &[&str], pod: Option<&str>, netns_name: Option<&str>) -> PodEntry {
        PodEntry {
            netns,
            addrs: addrs.iter().map(|a| a.parse().unwrap()).collect(),
            pod: pod.map(str::to_owned),
            uid: None,
            netns_name: netns_name.map(str::to_owned),
            named_by: None,
        }
    }

    /// Every lookup answers as the index's own scan does, including its
    /// order rules: a namespace listed twice, an address held by an
    /// unnamed namespace before a named pod, namespace 0.
    #[test]
    fn answers_as_the_pod_index_scan() {
        let idx = PodIndex {
            pods: vec![
                entry(0, &["10.0.0.9"], Some("x/zero"), None),
                entry(11, &["10.0.0.1"], None, Some("lab-a")),
                entry(12, &["10.0.0.1", "fd00::1"], Some("ns/web-0"), None),
                entry(12, &["10.0.0.2"], Some("ns/dup"), None),
                entry(13, &["10.0.0.3"], None, None),
                entry(14, &["10.0.0.3"], Some("ns/late"), Some("lab-b")),
            ],
        };
        let names = PodNames::new(&idx);
        for netns in [0, 11, 12, 13, 14, 99] {
            assert_eq!(
                names.label(netns).map(Name::as_str),
                idx.netns_label(netns).as_deref(),
                "netns {netns}"
            );
        }
        for a in [
            "10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.9", "fd00::1", "10.9.9.9",
        ] {
            let a: IpAddr = a.parse().unwrap();
            assert_eq!(names.pod_of(a).map(Name::as_str), idx.pod_of(a), "addr {a}");
        }
    }
}
