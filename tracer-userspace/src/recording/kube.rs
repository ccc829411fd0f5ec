//! Reading kube-proxy's rules back from a header. `ruleset` types are
//! serialize-only (they hold `&'static str`), so the reader has its own
//! mirror and converts; a field added there shows up here as a compile error
//! in `from`.
use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Deserializer};

use crate::ruleset::{
    KubeProxyRules, MissingTool, OutsideNetfilter, ProxyMode, RejectRule, SepRule, SvcRule,
};

#[derive(Deserialize)]
struct Rules {
    #[serde(default)]
    mode: String,
    #[serde(default)]
    source: Option<String>,
    #[serde(default)]
    services: Vec<Svc>,
    #[serde(default)]
    no_endpoints: Vec<Reject>,
    #[serde(default)]
    cluster_cidr: Option<String>,
    #[serde(default)]
    outside_netfilter: Vec<Outside>,
    #[serde(default)]
    missing_tools: Vec<MissingTool>,
    #[serde(default)]
    filter_drops: Vec<crate::ruleset::firewall::FilterDrop>,
    #[serde(default)]
    north_south: crate::ruleset::NorthSouth,
}

#[derive(Deserialize)]
struct Outside {
    /// IPv4 only in recordings before IPv6 Services were checked: still read.
    ip: IpAddr,
    by: String,
}

#[derive(Deserialize)]
struct Reject {
    ip: IpAddr,
    port: u16,
    protocol: String,
    #[serde(default)]
    port_name: String,
    #[serde(default)]
    rule: String,
}

#[derive(Deserialize)]
struct Svc {
    name: String,
    cluster_ip: IpAddr,
    port: u16,
    proto: String,
    chain: String,
    #[serde(default)]
    masquerade_all: bool,
    #[serde(default)]
    endpoints: Vec<Sep>,
}

#[derive(Deserialize)]
struct Sep {
    chain: String,
    endpoint: SocketAddr,
    #[serde(default)]
    hairpin_masq: bool,
}

pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<KubeProxyRules, D::Error> {
    let r = Rules::deserialize(d)?;
    Ok(KubeProxyRules {
        mode: match r.mode.as_str() {
            "iptables" => ProxyMode::Iptables,
            "ipvs" => ProxyMode::Ipvs,
            "nftables" => ProxyMode::Nftables,
            _ => ProxyMode::None,
        },
        source: r.source.as_deref().map(|s| match s {
            "nft" => "nft",
            "legacy" => "legacy",
            _ => "default",
        }),
        services: r
            .services
            .into_iter()
            .map(|s| SvcRule {
                // Recordings before the label was fixed carry `ns/name:`.
                name: crate::ruleset::port_label(&s.name, s.port).into(),
                cluster_ip: s.cluster_ip,
                port: s.port,
                proto: s.proto,
                chain: s.chain.into(),
                masquerade_all: s.masquerade_all,
                endpoints: s
                    .endpoints
                    .into_iter()
                    .map(|e| SepRule {
                        chain: e.chain.into(),
                        endpoint: e.endpoint,
                        hairpin_masq: e.hairpin_masq,
                    })
                    .collect(),
            })
            .collect(),
        no_endpoints: r
            .no_endpoints
            .into_iter()
            .map(|n| RejectRule {
                ip: n.ip,
                port: n.port,
                protocol: n.protocol,
                port_name: crate::ruleset::port_label(&n.port_name, n.port),
                rule: n.rule,
            })
            .collect(),
        cluster_cidr: r.cluster_cidr,
        outside_netfilter: r
            .outside_netfilter
            .into_iter()
            .map(|o| OutsideNetfilter { ip: o.ip, by: o.by })
            .collect(),
        missing_tools: r.missing_tools,
        filter_drops: r.filter_drops,
        north_south: r.north_south,
    })
}
