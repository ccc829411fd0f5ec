//! Static facts about the traced node namespace, gathered (read-only) by the
//! loader at start and handed to the collector, which uses them to name causes.
use serde::{Deserialize, Serialize};

/// An interface of the traced node namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Interface {
    pub ifindex: u32,
    pub name: String,
    /// rtnetlink link kind: "bridge", "veth", "vxlan", "" for plain devices.
    pub kind: String,
    /// ifindex of the bridge this interface is a port of.
    pub master: Option<u32>,
    /// Bridge port `hairpin_mode` (ports only).
    pub hairpin: Option<bool>,
    /// The link's MTU (issue 23: `doctor` compares pods', overlay's and
    /// uplink's); 0 = unknown (recordings from before it).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mtu: u32,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// What the node namespace looked like when tracing started.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeFacts {
    /// Inode of the traced network namespace (events with netns 0 are from it).
    pub netns_inode: u32,
    /// How the user named it (`--netns`), or "current".
    pub netns_name: String,
    pub interfaces: Vec<Interface>,
    /// `/proc/sys/net/bridge/bridge-nf-call-iptables` in the traced namespace;
    /// None when br_netfilter is not loaded (the file does not exist), which
    /// has the same effect as 0.
    pub bridge_nf_call_iptables: Option<bool>,
    pub ip_forward: Option<bool>,
    /// `/proc/sys/net/bridge/bridge-nf-call-ip6tables`: the same switch for
    /// bridged IPv6 frames (br_netfilter_hooks.c, br_nf_pre_routing checks
    /// `call_ip6tables` for ETH_P_IPV6). Absent from older recordings.
    #[serde(default)]
    pub bridge_nf_call_ip6tables: Option<bool>,
    /// conntrack's table and counters in the namespace at start (issue 22:
    /// `conntrack_table_full` judges the counters' rise against these).
    /// Absent from older recordings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conntrack: Option<ConntrackTable>,
    /// The latest reading while tracing (a recording's `conntrack` lines),
    /// never written in a header: flows decided after it are judged with it.
    #[serde(skip)]
    pub conntrack_now: Option<ConntrackTable>,
    /// conntrack's entries of flows that failed the watch, looked up when
    /// they failed (a recording's `ct_entry` lines; checks/midstream.rs),
    /// newest last; never written in a header.
    #[serde(skip)]
    pub ct_entries: Vec<crate::ctnetlink::CtLookup>,
}

impl NodeFacts {
    /// The newest lookup of a flow's tuple (client → the address it sent to).
    pub fn ct_entry(
        &self,
        tuple: &crate::ctnetlink::CtTuple,
    ) -> Option<&crate::ctnetlink::CtLookup> {
        self.ct_entries.iter().rev().find(|l| l.tuple == *tuple)
    }

    /// Kept for the flows decided next; bounded, as flows fail for as long
    /// as nattrace runs (a flow is decided [`WATCH_WAIT_NS`] after its
    /// lookup, long before 1024 others fail).
    ///
    /// [`WATCH_WAIT_NS`]: crate::collector::established::WATCH_WAIT_NS
    pub fn add_ct_entry(&mut self, l: crate::ctnetlink::CtLookup) {
        if self.ct_entries.len() >= 1024 {
            self.ct_entries.drain(..512);
        }
        self.ct_entries.push(l);
    }

    pub fn interface(&self, ifindex: u32) -> Option<&Interface> {
        self.interfaces.iter().find(|i| i.ifindex == ifindex)
    }

    pub fn sysctls(&self) -> Sysctls {
        Sysctls {
            bridge_nf_call_iptables: self.bridge_nf_call_iptables,
            bridge_nf_call_ip6tables: self.bridge_nf_call_ip6tables,
            ip_forward: self.ip_forward,
        }
    }

    pub fn set_sysctls(&mut self, s: Sysctls) {
        self.bridge_nf_call_iptables = s.bridge_nf_call_iptables;
        self.bridge_nf_call_ip6tables = s.bridge_nf_call_ip6tables;
        self.ip_forward = s.ip_forward;
    }
}

/// The node's sysctls among the facts, read again when an established flow
/// goes wrong (they may be what changed: br_netfilter switched off while
/// running) and recorded as a `sysctls` line when they differ.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sysctls {
    pub bridge_nf_call_iptables: Option<bool>,
    #[serde(default)]
    pub bridge_nf_call_ip6tables: Option<bool>,
    pub ip_forward: Option<bool>,
}

/// conntrack's table in the node namespace: `nf_conntrack_count` (this
/// namespace's entries) against `nf_conntrack_max` (one limit for every
/// namespace, writable only in the initial one), and its counters
/// (doctor/conntrack_stats.rs). Read at start and again when a request was
/// dropped by netfilter before any NAT (checks/table_full.rs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ConntrackTable {
    pub count: Option<u64>,
    pub max: Option<u64>,
    pub stats: Option<crate::doctor::conntrack_stats::ConntrackStats>,
}

impl ConntrackTable {
    /// Reads the calling thread's namespace's (call inside the node's).
    pub fn read() -> Self {
        let read = |p: &str| {
            std::fs::read_to_string(p)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
        };
        Self {
            count: read("/proc/sys/net/netfilter/nf_conntrack_count"),
            max: read("/proc/sys/net/netfilter/nf_conntrack_max"),
            stats: crate::doctor::conntrack_stats::ConntrackStats::read(),
        }
    }

    /// The table is at its limit: a new connection's entry can be had only
    /// by evicting an unreplied one (`__nf_conntrack_alloc`). A max of 0
    /// means no limit.
    pub fn at_max(&self) -> bool {
        matches!((self.count, self.max), (Some(c), Some(m)) if m > 0 && c >= m)
    }
}
