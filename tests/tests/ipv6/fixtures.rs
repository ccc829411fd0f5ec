//! The IPv6 reader fixtures of tracer-userspace's ruleset unit tests are
//! what a dual-stack lab node shows: `ip6tables-save` (iptables-nft; the
//! legacy backend's rules are the same) and `nft -j list table ip6
//! kube-proxy`. Regenerate both with
//! `NATTRACE_WRITE_FIXTURE=1 cargo test -p nattrace-tests --test ipv6 root_ipv6_reader_fixtures`.

use super::*;
use lab::{IptablesBackend, Protocol, ServiceSpec};
use serde_json::Value;

const IP6TABLES_FIXTURE: &str = "ruleset/lab_node6.txt";
const NFT6_FIXTURE: &str = "ruleset/lab_nft6.json";
const WRITE_FIXTURE_ENV: &str = "NATTRACE_WRITE_FIXTURE";

/// Seed 000, kube-dns and a Service without endpoints, dual-stack.
fn fixture_spec(mode: ProxyMode, backend: IptablesBackend) -> LabSpec {
    let mut spec = presets::seed000(presets::Seed000::default())
        .service(
            ServiceSpec::new(
                "kube-system",
                "kube-dns",
                "dns",
                presets::DNS_SERVICE_IP,
                53,
                Protocol::Udp,
            )
            .endpoint(presets::BACKEND_POD, 53),
        )
        .service(ServiceSpec::new(
            "default",
            "empty",
            "http",
            presets::EMPTY_SERVICE_IP,
            80,
            Protocol::Tcp,
        ))
        .dual_stack();
    spec.kube_proxy.mode = mode;
    spec.kube_proxy.iptables = backend;
    spec
}

fn path(fixture: &str) -> std::path::PathBuf {
    lab::fixtures_dir().join(fixture)
}

/// A save without its `#` lines and packet counters (whatever the lab's
/// set-up sent): the ruleset alone.
fn normalized(save: &str) -> String {
    save.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| match l.split_once(" [") {
            Some((chain, _)) if l.starts_with(':') => format!("{chain} [0:0]"),
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

/// nft's version and rule handles say nothing about the ruleset.
fn without_metainfo(mut v: Value) -> Value {
    if let Some(items) = v["nftables"].as_array_mut() {
        items.retain(|i| i.get("metainfo").is_none());
    }
    v
}

fn write_or_compare(fixture: &str, live: String, equal: impl Fn(&str, &str) -> bool) {
    let path = path(fixture);
    if std::env::var_os(WRITE_FIXTURE_ENV).is_some() {
        std::fs::write(&path, &live).expect("writing the fixture");
        return;
    }
    let stored = std::fs::read_to_string(&path).expect("reading the fixture");
    assert!(
        equal(&live, &stored),
        "{fixture} differs from the lab's:\n{live}\nregenerate: {WRITE_FIXTURE_ENV}=1 cargo test -p nattrace-tests --test ipv6 root_ipv6_reader_fixtures"
    );
}

#[test]
fn root_ipv6_reader_fixtures_are_the_labs() {
    require_root!();
    let lab = build_lab(fixture_spec(ProxyMode::Iptables, IptablesBackend::Nft));
    let save = lab
        .run(presets::NODE_A, &["ip6tables-nft-save"])
        .expect("ip6tables-nft-save");
    write_or_compare(IP6TABLES_FIXTURE, normalized(&save), |a, b| a == b);
    drop(lab);

    // iptables-legacy writes the same rules: its nat table reads the same.
    let lab = build_lab(fixture_spec(ProxyMode::Iptables, IptablesBackend::Legacy));
    let legacy = lab
        .ip6tables_save_table(presets::NODE_A, "nat")
        .expect("ip6tables-legacy-save");
    let rules = |text: &str| -> Vec<String> {
        let mut r: Vec<String> = text
            .lines()
            .filter(|l| l.starts_with("-A "))
            .map(String::from)
            .collect();
        r.sort();
        r
    };
    let stored = std::fs::read_to_string(path(IP6TABLES_FIXTURE)).unwrap();
    let nat_section = stored
        .split("*nat")
        .nth(1)
        .expect("a nat table in the fixture");
    assert_eq!(rules(&legacy), rules(nat_section), "{legacy}");
    drop(lab);

    let lab = build_lab(fixture_spec(ProxyMode::Nftables, IptablesBackend::Nft));
    let json = lab
        .run(
            presets::NODE_A,
            &["nft", "-j", "list", "table", "ip6", "kube-proxy"],
        )
        .expect("nft -j list table ip6 kube-proxy");
    let pretty = serde_json::to_string_pretty(&serde_json::from_str::<Value>(&json).unwrap());
    write_or_compare(NFT6_FIXTURE, pretty.unwrap() + "\n", |a, b| {
        let parse = |s: &str| without_metainfo(serde_json::from_str(s).unwrap());
        parse(a) == parse(b)
    });
}
