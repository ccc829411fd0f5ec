use super::*;

/// Rendered by the lab's kube-proxy (tests/src/kube_proxy.rs `render_nat`);
/// the scenarios test `ruleset_fixture_matches_the_lab_renderer` keeps it in sync.
const LAB_NAT: &str = include_str!("fixtures/lab_nat.txt");

fn ep(s: &str) -> std::net::SocketAddr {
    s.parse().unwrap()
}

#[test]
fn lab_rules_name_service_and_chains() {
    let rules = parse_nat(LAB_NAT);
    assert_eq!(rules.mode, ProxyMode::Iptables);
    assert_eq!(rules.services.len(), 2);
    let m = rules
        .lookup(ep("100.67.30.133:80"), "tcp", Some(ep("100.96.54.247:80")))
        .unwrap();
    assert_eq!(m.service, "default/web:http");
    assert_eq!(m.svc_chain, "KUBE-SVC-CDGGSHYLG3RE2FKL");
    assert_eq!(m.sep_chain.as_deref(), Some("KUBE-SEP-QCNXID34Z55D2JC7"));
    assert_eq!(m.hairpin_masq, Some(true));
    let other = rules
        .lookup(ep("100.67.30.133:80"), "tcp", Some(ep("100.96.55.21:80")))
        .unwrap();
    assert_eq!(
        other.sep_chain.as_deref(),
        Some("KUBE-SEP-CXHVRYFTTQ53DHQQ")
    );
    let dns = rules
        .lookup(ep("100.64.0.10:53"), "udp", Some(ep("100.96.54.247:53")))
        .unwrap();
    assert_eq!(dns.service, "kube-system/kube-dns:dns");
    assert_eq!(dns.svc_chain, "KUBE-SVC-TCOU7JCQXEZGVUNU");
    assert_eq!(rules.masquerade_all(), Some(false));
}

#[test]
fn unknown_service_backend_or_protocol_is_not_guessed() {
    let rules = parse_nat(LAB_NAT);
    assert!(rules.lookup(ep("100.67.30.133:81"), "tcp", None).is_none());
    assert!(rules.lookup(ep("100.67.30.133:80"), "udp", None).is_none());
    let m = rules
        .lookup(ep("100.67.30.133:80"), "tcp", Some(ep("1.2.3.4:80")))
        .unwrap();
    assert_eq!(m.sep_chain, None);
    assert_eq!(m.hairpin_masq, None);
}

#[test]
fn missing_hairpin_masquerade_and_masquerade_all_are_seen() {
    let text: String = LAB_NAT
        .lines()
        .filter(|l| !(l.starts_with("-A KUBE-SEP-") && l.contains("KUBE-MARK-MASQ")))
        .map(|l| {
            // masqueradeAll: the SVC chain marks without the `! -s` cluster CIDR match.
            l.replace("! -s 100.96.0.0/11 ", "") + "\n"
        })
        .collect();
    let rules = parse_nat(&text);
    let m = rules
        .lookup(ep("100.67.30.133:80"), "tcp", Some(ep("100.96.54.247:80")))
        .unwrap();
    assert_eq!(m.hairpin_masq, Some(false));
    assert_eq!(rules.masquerade_all(), Some(true));
}

#[test]
fn iptables_save_format_unquoted_comments_and_other_tables() {
    // iptables-save prints single-word comments without quotes.
    let text = "*nat\n:KUBE-SERVICES - [0:0]\n\
        -A KUBE-SERVICES -d 10.96.0.1/32 -p tcp -m comment --comment default/kubernetes:https -m tcp --dport 443 -j KUBE-SVC-NPX46M4PTMTKRN6Y\n\
        -A KUBE-SVC-NPX46M4PTMTKRN6Y -m comment --comment \"default/kubernetes:https -> 172.18.0.2:6443\" -j KUBE-SEP-ABC\n\
        -A KUBE-SEP-ABC -p tcp -m comment --comment default/kubernetes:https -m tcp -j DNAT --to-destination 172.18.0.2:6443\n\
        COMMIT\n";
    let rules = parse_nat(text);
    let m = rules
        .lookup(ep("10.96.0.1:443"), "tcp", Some(ep("172.18.0.2:6443")))
        .unwrap();
    assert_eq!(m.service, "default/kubernetes:https");
    assert_eq!(m.sep_chain.as_deref(), Some("KUBE-SEP-ABC"));
    assert_eq!(m.hairpin_masq, Some(false));
}

#[test]
fn no_kube_proxy_and_ipvs_modes() {
    assert_eq!(
        parse_nat("*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n").mode,
        ProxyMode::None
    );
    let ipvs = "*nat\n:KUBE-SERVICES - [0:0]\n\
        -A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT\nCOMMIT\n";
    let rules = parse_nat(ipvs);
    assert_eq!(rules.mode, ProxyMode::Ipvs);
    assert_eq!(rules.masquerade_all(), None);
}

#[test]
fn words_keep_quoted_text_together() {
    assert_eq!(
        words(r#"KUBE-X -m comment --comment "a b" -j Y"#),
        vec!["KUBE-X", "-m", "comment", "--comment", "a b", "-j", "Y"]
    );
    assert_eq!(words(r#"--comment """#), vec!["--comment", ""]);
}

/// A whole node as the lab renders it (tests/src/kube_proxy/node.rs; kept
/// in sync by `node_ruleset_fixture_matches_the_lab_renderer`).
const LAB_NODE: &str = include_str!("fixtures/lab_node.txt");

#[test]
fn whole_dump_gives_services_from_nat_and_rejects_from_filter() {
    let rules = parse_save(LAB_NODE);
    assert_eq!(rules.mode, ProxyMode::Iptables);
    assert_eq!(rules.services.len(), 1, "{rules:?}");
    assert_eq!(rules.services[0].name, "default/web:http");
    assert_eq!(rules.no_endpoints.len(), 1, "{rules:?}");
    let r = rules
        .no_endpoints_for(ep("100.67.30.140:80"), "tcp")
        .expect("the REJECT");
    assert_eq!(r.port_name, "default/web-empty:http");
    assert_eq!(r.protocol, "tcp");
    assert!(
        r.rule.starts_with("-A KUBE-SERVICES -d 100.67.30.140/32") && r.rule.contains("-j REJECT"),
        "{}",
        r.rule
    );
    assert!(
        rules
            .no_endpoints_for(ep("100.67.30.140:81"), "tcp")
            .is_none()
    );
    assert!(
        rules
            .no_endpoints_for(ep("100.67.30.140:80"), "udp")
            .is_none()
    );
    // The filter table's KUBE-SERVICES is not mistaken for nat's.
    assert!(rules.lookup(ep("100.67.30.140:80"), "tcp", None).is_none());
}

#[test]
fn kube_proxys_own_reject_forms_are_read() {
    // kube-proxy's restore input (proxier_test.go) and an external IP.
    let text = "*filter\n:KUBE-SERVICES - [0:0]\n:KUBE-EXTERNAL-SERVICES - [0:0]\n\
        -A KUBE-SERVICES -m comment --comment \"ns6/svc6:p80 has no endpoints\" -m tcp -p tcp -d 172.30.0.46 --dport 80 -j REJECT\n\
        -A KUBE-EXTERNAL-SERVICES -m comment --comment \"ns6/svc6:p80 has no endpoints\" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 3001 -j REJECT\n\
        -A KUBE-SERVICES -m comment --comment \"ns2/svc2:p53 has no endpoints\" -m udp -p udp -d 172.30.0.42 --dport 53 -j REJECT\n\
        -A KUBE-SERVICES -m comment --comment \"something else\" -m tcp -p tcp -d 172.30.0.47 --dport 80 -j REJECT\n\
        COMMIT\n*nat\n:KUBE-SERVICES - [0:0]\nCOMMIT\n";
    let rules = parse_save(text);
    assert_eq!(rules.no_endpoints.len(), 2, "{rules:?}");
    assert_eq!(
        rules
            .no_endpoints_for(ep("172.30.0.46:80"), "tcp")
            .unwrap()
            .port_name,
        "ns6/svc6:p80"
    );
    assert!(
        rules
            .no_endpoints_for(ep("172.30.0.42:53"), "udp")
            .is_some()
    );
    assert_eq!(rules.mode, ProxyMode::Iptables);
}

#[test]
fn nat_only_text_still_parses() {
    assert_eq!(parse_save(LAB_NAT), parse_nat(LAB_NAT));
}
