use super::*;
use crate::ruleset::parse_nat;

fn port(ifindex: u32, name: &str, hairpin: bool) -> Interface {
    Interface {
        ifindex,
        name: name.into(),
        kind: "veth".into(),
        master: Some(3),
        hairpin: Some(hairpin),
        mtu: 0,
    }
}

fn healthy() -> Inputs {
    Inputs {
        netns: "node-a".into(),
        br_netfilter_loaded: true,
        bridge_nf_call_iptables: Some(true),
        interfaces: vec![
            Interface {
                ifindex: 3,
                name: "cni0".into(),
                kind: "bridge".into(),
                ..Interface::default()
            },
            port(4, "veth0", true),
            port(5, "veth1", true),
        ],
        ip_forward: Some(true),
        rp_filter: vec![("all".into(), 0), ("eth0".into(), 2)],
        conntrack_count: Some(10),
        conntrack_max: Some(1000),
        kube_proxy: parse_nat(include_str!(crate::fixture!("ruleset/lab_nat.txt"))),
        ..Inputs::default()
    }
}

fn severity(r: &Report, check: &str) -> Severity {
    r.findings
        .iter()
        .find(|f| f.check == check)
        .unwrap_or_else(|| panic!("no {check}: {r:#?}"))
        .severity
}

#[test]
fn healthy_node_passes() {
    let r = assess(&healthy());
    assert!(!r.breaks_services(), "{}", r.text());
    assert_eq!(severity(&r, "kube_proxy_mode"), Severity::Info);
    let line = r.one_line();
    assert!(line.starts_with("checks: 0 problem(s): "), "{line}");
    assert!(line.contains("bridge-nf-call-iptables=1 on cni0"), "{line}");
    assert!(line.contains("kube-proxy=iptables"), "{line}");
    assert!(line.contains("masqueradeAll=false"), "{line}");
    assert!(line.contains("conntrack=10/1000"), "{line}");
    assert!(!line.contains('\n'));
}

#[test]
fn bridge_nf_off_breaks_services_with_a_fix() {
    let r = assess(&Inputs {
        bridge_nf_call_iptables: Some(false),
        ..healthy()
    });
    assert!(r.breaks_services());
    assert_eq!(severity(&r, "bridge_nf_call_iptables"), Severity::Error);
    assert!(
        r.text()
            .contains("fix: load br_netfilter and set net.bridge.bridge-nf-call-iptables=1")
    );
    assert!(
        r.one_line()
            .starts_with("checks: 1 problem(s): bridge-nf-call-iptables=0 on cni0 (error)")
    );
}

#[test]
fn missing_module_forward_and_full_conntrack_are_errors() {
    let r = assess(&Inputs {
        br_netfilter_loaded: false,
        bridge_nf_call_iptables: None,
        ip_forward: Some(false),
        conntrack_count: Some(950),
        ..healthy()
    });
    for check in [
        "br_netfilter",
        "bridge_nf_call_iptables",
        "ip_forward",
        "conntrack",
    ] {
        assert_eq!(severity(&r, check), Severity::Error, "{check}");
    }
}

#[test]
fn hairpin_off_strict_rp_filter_and_no_kube_proxy_are_warnings() {
    let mut i = healthy();
    i.interfaces[2].hairpin = Some(false);
    i.rp_filter = vec![("all".into(), 1), ("eth0".into(), 0)];
    i.kube_proxy = KubeProxyRules::default();
    let r = assess(&i);
    assert!(!r.breaks_services());
    assert_eq!(severity(&r, "hairpin_mode"), Severity::Warning);
    assert_eq!(severity(&r, "rp_filter"), Severity::Warning);
    assert_eq!(severity(&r, "kube_proxy_mode"), Severity::Warning);
    assert!(r.one_line().contains("hairpin=off on veth1 (warning)"));
    assert!(r.findings.iter().all(|f| f.check != "masquerade_all"));
}

#[test]
fn the_one_line_stays_short_with_hundreds_of_interfaces() {
    let mut i = healthy();
    for n in 0..302 {
        i.interfaces
            .push(port(10 + n, &format!("veth{n:08x}"), false));
        i.rp_filter.push((format!("veth{n:08x}"), 1));
    }
    let r = assess(&i);
    let line = r.one_line();
    // Interface names are at most 15 bytes (IFNAMSIZ): bounded whatever the node.
    assert!(line.len() < 400, "{} chars: {line}", line.len());
    assert!(
        line.contains("hairpin=off on veth00000000,veth00000001,veth00000002 and 299 more"),
        "{line}"
    );
    assert!(line.contains("rp_filter=strict on "), "{line}");
    // The full lists stay in the findings' messages (`nattrace doctor`).
    let hairpin = r
        .findings
        .iter()
        .find(|f| f.check == "hairpin_mode")
        .unwrap();
    assert!(hairpin.message.contains("veth0000012d"));
}

#[test]
fn nftables_mode_reports_services_rejects_and_cluster_cidr_masquerade() {
    let r = assess(&Inputs {
        kube_proxy: crate::ruleset::nft::parse(include_str!(crate::fixture!(
            "ruleset/lab_nft.json"
        )))
        .unwrap(),
        ..healthy()
    });
    let mode = r
        .findings
        .iter()
        .find(|f| f.check == "kube_proxy_mode")
        .unwrap();
    assert_eq!(mode.value, "kube-proxy=nftables");
    assert_eq!(
        mode.message,
        "kube-proxy runs in nftables mode (2 Services, 1 without endpoints, rejected)"
    );
    let masq = r
        .findings
        .iter()
        .find(|f| f.check == "masquerade_all")
        .unwrap();
    assert_eq!(masq.value, "masqueradeAll=false");
    assert!(
        masq.message
            .contains("outside the cluster CIDR 100.96.0.0/11 is masqueraded")
    );
    assert!(r.findings.iter().all(|f| f.check != "service_nat"));
}

#[test]
fn services_outside_netfilter_are_a_warning_for_doctor_and_the_traced_ip() {
    use crate::ruleset::dataplane::Dataplane;
    let ipvs = Dataplane {
        ipvs_device: Some(vec!["10.96.0.1".parse().unwrap()]),
        ..Dataplane::default()
    };
    // doctor: no traced IP, the node as a whole.
    let r = assess(&Inputs {
        dataplane: ipvs.clone(),
        kube_proxy: KubeProxyRules::default(),
        ..healthy()
    });
    assert_eq!(severity(&r, "service_nat"), Severity::Warning);
    assert!(
        r.one_line().contains("service_nat=ipvs (warning)"),
        "{}",
        r.one_line()
    );
    // A trace of the IPVS address is marked; one of kube-proxy's NAT Services is not.
    let traced = |ip: &str| {
        assess(&Inputs {
            dataplane: ipvs.clone(),
            traced: vec![ip.parse().unwrap()],
            ..healthy()
        })
    };
    let r = traced("10.96.0.1");
    let f = r
        .findings
        .iter()
        .find(|f| f.check == "service_nat")
        .unwrap();
    assert!(
        f.message.starts_with("10.96.0.1 is translated by IPVS"),
        "{}",
        f.message
    );
    let r = traced("100.67.30.133");
    assert!(r.findings.iter().all(|f| f.check != "service_nat"));
}

/// A dual-stack Service traced by both ClusterIPs on an IPVS node: each
/// address is checked, the IPv6 one on kube-ipvs0 like the IPv4 one.
#[test]
fn a_traced_ipv6_service_on_kube_ipvs0_is_named_as_ipvs() {
    use crate::ruleset::dataplane::Dataplane;
    let inputs = Inputs {
        dataplane: Dataplane {
            ipvs_device: Some(vec![
                "10.96.0.1".parse().unwrap(),
                "fd00:10:96::1".parse().unwrap(),
            ]),
            ..Dataplane::default()
        },
        traced: vec![
            "fd00:10:96::1".parse().unwrap(),
            "100.67.30.133".parse().unwrap(),
        ],
        ..healthy()
    };
    let outside = outside_netfilter(&inputs);
    assert_eq!(outside.len(), 1, "{outside:?}");
    assert_eq!(
        outside[0].ip,
        "fd00:10:96::1".parse::<std::net::IpAddr>().unwrap()
    );
    let r = assess(&inputs);
    let f = r
        .findings
        .iter()
        .find(|f| f.check == "service_nat")
        .unwrap();
    assert!(
        f.message
            .starts_with("fd00:10:96::1 is translated by IPVS (kube-proxy --proxy-mode=ipvs: kube-ipvs0 holds fd00:10:96::1)"),
        "{}",
        f.message
    );
}

#[test]
fn a_missing_tool_is_reported_as_missing_never_as_no_rules() {
    let mut i = healthy();
    i.kube_proxy = KubeProxyRules {
        missing_tools: vec![ruleset::MissingTool {
            program: "iptables-nft-save".into(),
            path: "/usr/bin:/bin".into(),
        }],
        ..KubeProxyRules::default()
    };
    let r = assess(&i);
    let f = r
        .findings
        .iter()
        .find(|f| f.check == "kube_proxy_mode")
        .unwrap();
    assert_eq!(f.severity, Severity::Warning);
    assert_eq!(f.value, "kube-proxy=unknown");
    assert!(
        f.message
            .contains("iptables-nft-save not found in PATH: /usr/bin:/bin"),
        "{}",
        f.message
    );
    assert!(!f.message.contains("no kube-proxy rules"), "{}", f.message);
    assert!(
        r.one_line().contains("kube-proxy=unknown"),
        "{}",
        r.one_line()
    );
}

/// A dual-stack node: the IPv4 checks plus the IPv6 ones.
fn dual_stack() -> Inputs {
    let mut i = healthy();
    i.kube_proxy
        .merge(crate::ruleset::parse_save(include_str!(crate::fixture!(
            "ruleset/lab_node6.txt"
        ))));
    i.ipv6 = super::ipv6::Ipv6Facts {
        global_on: vec!["cni0".into(), "eth0".into()],
        bridge_nf_call_ip6tables: Some(true),
        forwarding: Some(true),
        conf: vec![super::ipv6::RaConf {
            name: "eth0".into(),
            forwarding: true,
            accept_ra: 1,
        }],
        ra_default_via: vec![],
    };
    i
}

#[test]
fn ipv6_checks_only_on_nodes_with_ipv6() {
    let r = assess(&healthy());
    assert!(
        !r.findings
            .iter()
            .any(|f| f.check.contains("ip6") || f.check.contains("ipv6"))
    );
    let r = assess(&dual_stack());
    assert_eq!(severity(&r, "bridge_nf_call_ip6tables"), Severity::Ok);
    assert_eq!(severity(&r, "ipv6_forwarding"), Severity::Ok);
    assert_eq!(severity(&r, "conntrack_ipv6"), Severity::Info);
    assert!(!r.findings.iter().any(|f| f.check == "ipv6_accept_ra"));
    // The lab's IPv6 half has one Service without endpoints, and its IPv4
    // fixture no such Service name with endpoints: informational.
    assert_eq!(severity(&r, "ipv6_no_endpoints"), Severity::Info);
    assert!(!r.breaks_services(), "{}", r.text());
}

#[test]
fn bridged_ipv6_past_ip6tables_and_no_ipv6_forwarding_break_services() {
    let mut i = dual_stack();
    i.ipv6.bridge_nf_call_ip6tables = Some(false);
    i.ipv6.forwarding = Some(false);
    let r = assess(&i);
    assert_eq!(severity(&r, "bridge_nf_call_ip6tables"), Severity::Error);
    assert_eq!(severity(&r, "ipv6_forwarding"), Severity::Error);
    assert!(r.breaks_services());
    let text = r.text();
    assert!(
        text.contains("net.bridge.bridge-nf-call-ip6tables=1"),
        "{text}"
    );
    assert!(
        r.one_line()
            .contains("bridge-nf-call-ip6tables=0 on cni0 (error)"),
        "{}",
        r.one_line()
    );
}

#[test]
fn ra_learned_default_route_on_a_forwarding_interface() {
    let mut i = dual_stack();
    i.ipv6.ra_default_via = vec!["eth0".into()];
    let r = assess(&i);
    assert_eq!(severity(&r, "ipv6_accept_ra"), Severity::Error);
    assert!(r.text().contains("accept_ra=2"), "{}", r.text());
    // accept_ra=2 keeps RAs coming although the interface forwards.
    i.ipv6.conf[0].accept_ra = 2;
    assert_eq!(severity(&assess(&i), "ipv6_accept_ra"), Severity::Ok);
}

#[test]
fn dual_stack_service_without_ipv6_endpoints_is_a_warning() {
    let mut i = dual_stack();
    // The IPv4 half of default/empty:http has an endpoint.
    let mut svc = i.kube_proxy.services[0].clone();
    svc.name = "default/empty:http".into();
    i.kube_proxy.services.push(svc);
    let r = assess(&i);
    assert_eq!(severity(&r, "ipv6_no_endpoints"), Severity::Warning);
    assert!(
        r.text()
            .contains("default/empty:http has endpoints over IPv4 but none over IPv6"),
        "{}",
        r.text()
    );
}
