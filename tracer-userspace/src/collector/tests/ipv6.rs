//! The collector's verdicts over IPv6: every IPv4 fixture with its
//! addresses moved to IPv6 (each IPv4 address a.b.c.d becomes
//! fd00:a:b::c:d with each byte a 16-bit group, the Services' too) must give the same verdicts, causes
//! and backends, and the outputs must write `[addr]:port`. The kernel's
//! IPv6 events have exactly this shape (same hooks and fields; ip_id 0), so
//! this checks that nothing in the collector depends on the family.
use std::net::{IpAddr, Ipv6Addr};

use tracer_common::{PacketEvent, addr_from_bytes, as_v4};

use super::run_with;
use crate::collector::{fixtures::*, *};
use crate::service::{Service, ip_of};

const MS: u64 = 1_000_000;

fn v6_of(v4: [u8; 4]) -> Ipv6Addr {
    let [a, b, c, d] = v4.map(u16::from);
    Ipv6Addr::new(0xfd00, a, b, 0, 0, 0, c, d)
}

fn to_v6(events: &[PacketEvent]) -> Vec<PacketEvent> {
    events
        .iter()
        .map(|e| {
            let mut e = *e;
            for a in [&mut e.saddr, &mut e.daddr] {
                let v4 = as_v4(a).expect("an IPv4 fixture");
                *a = addr_from_bytes(v6_of(v4).octets());
            }
            // IPv6 has no identification field: the kernel reports 0.
            e.ip_id = 0;
            e
        })
        .collect()
}

fn config_v6(bridge_nf: Option<bool>) -> CollectorConfig {
    let mut cfg = config(bridge_nf);
    cfg.services = services()
        .into_iter()
        .map(|s| match s.addr {
            IpAddr::V4(v4) => Service {
                addr: v6_of(v4.octets()).into(),
                port: s.port,
            },
            IpAddr::V6(_) => s,
        })
        .collect();
    cfg
}

/// (verdict, cause, backend) of each flow, addresses mapped back to IPv4
/// text so the two runs compare.
fn outcome(reports: &[FlowReport]) -> Vec<(Verdict, Option<CauseId>, Option<String>)> {
    reports
        .iter()
        .map(|r| {
            let backend = r.backend.map(|b| match b.ip() {
                IpAddr::V6(v6) => {
                    let s = v6.segments();
                    format!("{}.{}.{}.{}:{}", s[1], s[2], s[6], s[7], b.port())
                }
                IpAddr::V4(_) => b.to_string(),
            });
            // The same incident, named by the family's own sysctl.
            let cause = r.cause.as_ref().map(|c| match c.id {
                CauseId::BridgeNfCallIp6tablesOff => CauseId::BridgeNfCallIptablesOff,
                id => id,
            });
            (r.verdict, cause, backend)
        })
        .collect()
}

#[test]
fn every_fixture_gives_the_same_verdicts_over_ipv6() {
    let now = T0 + 10_000 * MS;
    let mut verdicts = Vec::new();
    for (name, events) in all() {
        for bridge_nf in [Some(true), Some(false)] {
            let (v4, _) = run_with(config(bridge_nf), &events, now);
            let (v6, summary) = run_with(config_v6(bridge_nf), &to_v6(&events), now);
            assert_eq!(outcome(&v6), outcome(&v4), "{name} bridge_nf={bridge_nf:?}");
            assert_eq!(summary.unmatched_events, 0, "{name}");
            for r in &v6 {
                assert!(r.client.is_ipv6() && r.service.is_ipv6(), "{name}: {r:?}");
            }
            verdicts.extend(v6.iter().map(|r| r.verdict));
        }
    }
    // The main verdicts are all among them.
    for v in [
        Verdict::Ok,
        Verdict::ReplyNotReverseNated,
        Verdict::NoReply,
        Verdict::Dropped,
    ] {
        assert!(verdicts.contains(&v), "no {v:?} among the IPv6 fixtures");
    }
}

#[test]
fn seed000_over_ipv6_names_the_un_reverse_nated_reply_in_brackets() {
    let events = to_v6(&seed000_same_node(false));
    let (reports, _) = run_with(config_v6(Some(false)), &events, T0 + 10_000 * MS);
    let r = super::only(&reports);
    assert_eq!(r.verdict, Verdict::ReplyNotReverseNated);
    // 100.67.30.133 as fd00:100:67::30:133 in hex.
    assert_eq!(r.service.to_string(), "[fd00:64:43::1e:85]:80");
    assert_eq!(
        r.backend.map(|b| b.to_string()).as_deref(),
        Some("[fd00:64:60::36:f7]:80")
    );
    assert!(
        r.detail
            .contains("with source [fd00:64:60::36:f7]:80 instead of [fd00:64:43::1e:85]:80"),
        "{}",
        r.detail
    );
    // Muting goes back to the kernel in its key form (a client whose
    // receive the kernel did not see: it mutes the others itself).
    let mut c = Collector::new(config_v6(Some(true)));
    for ev in to_v6(&seed000_same_node(true)).into_iter().filter(|e| {
        !(e.direction == tracer_common::direction::REPLY && e.hook == tracer_common::hook::DEV_RX)
    }) {
        c.push(ev);
    }
    let _ = c.tick(T0 + 10_000 * MS);
    let mute = c.take_mute_candidates();
    assert_eq!(mute.len(), 1);
    assert_eq!(
        ip_of(mute[0].addr),
        IpAddr::from(v6_of(CLIENT.0)),
        "{mute:?}"
    );
}

#[test]
fn ipv6_flows_in_json_text_and_pcapng() {
    let events = to_v6(&seed000_same_node(true));
    let (reports, summary) = run_with(config_v6(Some(true)), &events, T0 + 10_000 * MS);
    let r = super::only(&reports);
    let mut json = crate::output::json::JsonOutput::new(Vec::new(), true);
    json.flow(r).unwrap();
    let line = String::from_utf8(json.into_inner()).unwrap();
    let v: serde_json::Value = serde_json::from_str(line.lines().next().unwrap()).unwrap();
    assert_eq!(v["client"], "[fd00:64:60::36:f0]:43534");
    assert_eq!(v["service"], "[fd00:64:43::1e:85]:80");
    let mut text = crate::output::text::TextOutput::new(Vec::new(), Default::default(), false);
    text.flow(r).unwrap();
    text.summary(&summary, 0).unwrap();
    let text = String::from_utf8(text.into_inner()).unwrap();
    assert!(
        text.starts_with("✓ ok tcp [fd00:64:60::36:f0]:43534 → [fd00:64:43::1e:85]:80"),
        "{text}"
    );

    // tshark reads the synthesized IPv6 packets (when installed: CI has it).
    let mut pcap = crate::output::pcapng::PcapngOutput::new(Vec::new(), None, "ipv6 test").unwrap();
    pcap.flow(r).unwrap();
    let bytes = pcap.into_inner();
    let path = std::env::temp_dir().join(format!("nattrace-ipv6-{}.pcapng", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    let out = std::process::Command::new("tshark")
        .args([
            "-r",
            path.to_str().unwrap(),
            "-T",
            "fields",
            "-e",
            "ipv6.src",
        ])
        .args(["-e", "ipv6.dst", "-e", "tcp.flags.str", "-e", "_ws.expert"])
        .output();
    let _ = std::fs::remove_file(&path);
    let Ok(out) = out else {
        eprintln!("tshark not installed: pcapng not checked");
        return;
    };
    let listing = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        listing.contains("fd00:64:60::36:f0\tfd00:64:43::1e:85"),
        "{listing}"
    );
    assert!(
        listing.contains("fd00:64:60::36:f7\tfd00:64:60::36:f0"),
        "{listing}"
    );
    // Valid checksums: Wireshark flags nothing.
    assert!(!listing.to_lowercase().contains("checksum"), "{listing}");
}
