//! The node the collector fixtures were built for, and where the crate's
//! fixture data lives. Behind the `testkit` feature: the bench and the
//! integration tests under `tests/` enable it through the crate's
//! dev-dependency on itself.
use std::path::{Path, PathBuf};

use tracer_common::PacketEvent;

use super::CollectorConfig;
use crate::{
    facts::{Interface, NodeFacts},
    service::Service,
};

/// The path of a file under `tracer-userspace/fixtures/` as a literal, for
/// `include_str!`/`include_bytes!`: `include_str!(fixture!("dns_ok.jsonl"))`.
#[macro_export]
macro_rules! fixture {
    ($name:literal) => {
        concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/", $name)
    };
}

/// `tracer-userspace/fixtures/`: the one home of the crate's fixture data
/// (xtask names it as `FIXTURES_DIR`, the lab tests as `lab::fixtures_dir`).
pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// The seed recordings made on real kernels, each beside its golden
/// `NAME.json` (`cargo xtask fixtures`, `cargo xtask vm-test --record-fixtures`).
pub fn recorded_dir() -> PathBuf {
    fixtures_dir().join("recorded")
}

/// Every `recorded/*.rec`, sorted.
pub fn recordings() -> Vec<PathBuf> {
    let mut recs: Vec<PathBuf> = std::fs::read_dir(recorded_dir())
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "rec"))
                .collect()
        })
        .unwrap_or_default();
    recs.sort();
    recs
}

pub const NODE_NS: u32 = 4026531840;

pub const ETH0: u32 = 2;
pub const CNI0: u32 = 3;
pub const FLANNEL: u32 = 4;
pub const VETH_CLIENT: u32 = 5;
pub const VETH_BACKEND: u32 = 6;
pub const VETH_DNS: u32 = 7;

pub const SVC: ([u8; 4], u16) = ([100, 67, 30, 133], 80);
pub const DNS_SVC: ([u8; 4], u16) = ([10, 32, 0, 10], 53);

pub fn facts(bridge_nf: Option<bool>) -> NodeFacts {
    let iface = |ifindex, name: &str, kind: &str, master| Interface {
        ifindex,
        name: name.to_string(),
        kind: kind.to_string(),
        master,
        hairpin: master.map(|_| false),
        mtu: 0,
    };
    NodeFacts {
        netns_inode: NODE_NS,
        netns_name: "node-a".to_string(),
        interfaces: vec![
            iface(ETH0, "eth0", "", None),
            iface(CNI0, "cni0", "bridge", None),
            iface(FLANNEL, "flannel.1", "vxlan", None),
            iface(VETH_CLIENT, "veth-client", "veth", Some(CNI0)),
            iface(VETH_BACKEND, "veth-backend", "veth", Some(CNI0)),
            iface(VETH_DNS, "veth-dns", "veth", Some(CNI0)),
        ],
        bridge_nf_call_iptables: bridge_nf,
        ip_forward: Some(true),
        bridge_nf_call_ip6tables: bridge_nf,
        ..NodeFacts::default()
    }
}

pub fn services() -> Vec<Service> {
    vec![
        Service {
            addr: SVC.0.into(),
            port: Some(SVC.1),
        },
        Service {
            addr: DNS_SVC.0.into(),
            port: None,
        },
    ]
}

pub fn config(bridge_nf: Option<bool>) -> CollectorConfig {
    CollectorConfig {
        services: services(),
        facts: facts(bridge_nf),
        ..CollectorConfig::default()
    }
}

pub fn from_jsonl(text: &str) -> Vec<PacketEvent> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("fixture line is a PacketEvent"))
        .collect()
}
