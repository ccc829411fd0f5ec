use super::*;

/// Rendered by the lab's kube-proxy (tests/src/kube_proxy.rs `render_nat`);
/// the scenarios test `ruleset_fixture_matches_the_lab_renderer` keeps it in sync.
const LAB_NAT: &str = include_str!(crate::fixture!("ruleset/lab_nat.txt"));

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
    assert_eq!(&*m.service, "default/web:http");
    assert_eq!(&*m.svc_chain, "KUBE-SVC-CDGGSHYLG3RE2FKL");
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
    assert_eq!(&*dns.service, "kube-system/kube-dns:dns");
    assert_eq!(&*dns.svc_chain, "KUBE-SVC-TCOU7JCQXEZGVUNU");
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
    assert_eq!(&*m.service, "default/kubernetes:https");
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
const LAB_NODE: &str = include_str!(crate::fixture!("ruleset/lab_node.txt"));

#[test]
fn whole_dump_gives_services_from_nat_and_rejects_from_filter() {
    let rules = parse_save(LAB_NODE);
    assert_eq!(rules.mode, ProxyMode::Iptables);
    assert_eq!(rules.services.len(), 1, "{rules:?}");
    assert_eq!(&*rules.services[0].name, "default/web:http");
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

#[test]
fn a_program_that_is_not_installed_is_missing_not_failed() {
    let ns = Netns::open(None).unwrap();
    assert_eq!(
        run_in(&ns, "nattrace-test-no-such-program", &[]),
        Err(RunError::Missing)
    );
    // Installed but failing is not "missing".
    assert_eq!(run_in(&ns, "false", &[]), Err(RunError::Failed));
    assert_eq!(run_in(&ns, "echo", &["x"]).as_deref(), Ok("x\n"));
}

#[test]
fn missing_tools_are_noted_once_with_the_search_path() {
    let mut m = Missing {
        tools: Vec::new(),
        path: "/usr/sbin:/usr/bin".into(),
    };
    assert_eq!(m.note("nft", Ok("{}".into())).as_deref(), Some("{}"));
    assert_eq!(m.note("nft", Err(RunError::Failed)), None);
    assert!(m.tools.is_empty());
    m.note("nft", Err(RunError::Missing));
    m.note("nft", Err(RunError::Missing));
    assert_eq!(m.tools.len(), 1);
    assert_eq!(
        m.tools[0].to_string(),
        "nft not found in PATH: /usr/sbin:/usr/bin"
    );
}
/// `ip6tables-nft-save` of a dual-stack lab node (seed 000, kube-dns and a
/// Service without endpoints); the ipv6 test `root_ipv6_reader_fixtures_are_the_labs`
/// keeps it equal to the lab's (and checks legacy's nat table reads the same).
const LAB_NODE6: &str = include_str!(crate::fixture!("ruleset/lab_node6.txt"));

#[test]
fn ip6tables_save_names_ipv6_services_and_chains() {
    let rules = parse_save(LAB_NODE6);
    assert_eq!(rules.mode, ProxyMode::Iptables);
    assert_eq!(rules.services.len(), 2, "{rules:#?}");
    // The same chain names as IPv4: kube-proxy hashes the port name only.
    let m = rules
        .lookup(
            ep("[fd00:10:96::1e85]:80"),
            "tcp",
            Some(ep("[fd00:10:244:36::f7]:80")),
        )
        .unwrap();
    assert_eq!(&*m.service, "default/web:http");
    assert_eq!(&*m.svc_chain, "KUBE-SVC-CDGGSHYLG3RE2FKL");
    assert_eq!(m.sep_chain.as_deref(), Some("KUBE-SEP-5TM52U3QQ5FLZKAS"));
    assert_eq!(m.hairpin_masq, Some(true));
    let dns = rules.lookup(ep("[fd00:10:96::a]:53"), "udp", None).unwrap();
    assert_eq!(&*dns.service, "kube-system/kube-dns:dns");
    assert_eq!(rules.cluster_cidr, None);
    assert_eq!(rules.masquerade_all(), Some(false));
    // The IPv4 address with the same low bits is another Service.
    assert!(rules.lookup(ep("100.67.30.133:80"), "tcp", None).is_none());
}

#[test]
fn ip6tables_rejects_are_no_endpoint_services() {
    let rules = parse_save(LAB_NODE6);
    let r = rules
        .no_endpoints_for(ep("[fd00:10:96::1e8c]:80"), "tcp")
        .expect("the empty Service's REJECT");
    assert_eq!(r.port_name, "default/empty:http");
    assert!(r.rule.contains("icmp6-port-unreachable"), "{}", r.rule);
    assert!(
        rules
            .no_endpoints_for(ep("[fd00:10:96::1e8c]:81"), "tcp")
            .is_none()
    );
}

#[test]
fn both_families_merge_into_one_ruleset() {
    let mut rules = parse_save(include_str!(crate::fixture!("ruleset/lab_node.txt")));
    let v4 = rules.services.len();
    rules.merge(parse_save(LAB_NODE6));
    assert_eq!(rules.services.len(), v4 + 2);
    assert_eq!(rules.mode, ProxyMode::Iptables);
    let a = rules.lookup(ep("100.67.30.133:80"), "tcp", None).unwrap();
    let b = rules
        .lookup(ep("[fd00:10:96::1e85]:80"), "tcp", None)
        .unwrap();
    assert_eq!((a.service, a.svc_chain), (b.service, b.svc_chain));
}

#[test]
fn host_addresses_of_both_families() {
    assert_eq!(host("10.0.0.1/32"), Some("10.0.0.1".parse().unwrap()));
    assert_eq!(host("fd00::a/128"), Some("fd00::a".parse().unwrap()));
    assert_eq!(host("fd00::a"), Some("fd00::a".parse().unwrap()));
    assert_eq!(host("fd00::/32"), None);
    assert_eq!(host("10.0.0.0/8"), None);
}

/// Issue 26 item 12: a Service port without a name was labelled
/// `prod/export:`; docs/METRICS.md promises `namespace/name:port`.
#[test]
fn unnamed_service_port_is_labelled_with_its_number() {
    assert_eq!(port_label("prod/export:", 8080), "prod/export:8080");
    assert_eq!(port_label("prod/export", 8080), "prod/export:8080");
    assert_eq!(port_label("default/web:http", 80), "default/web:http");
    assert_eq!(port_label("", 80), "");
    let nat = LAB_NAT
        .replace("default/web:http cluster IP", "prod/export cluster IP")
        .replace("default/web:http ->", "prod/export ->");
    let rules = parse_nat(&nat);
    let m = rules
        .lookup(ep("100.67.30.133:80"), "tcp", Some(ep("100.96.54.247:80")))
        .unwrap();
    assert_eq!(&*m.service, "prod/export:80");
    let rejects = filter::parse_filter_rejects(&[
        "-A KUBE-SERVICES -d 100.67.40.7/32 -p tcp -m comment --comment \"prod/empty has no endpoints\" -m tcp --dport 9000 -j REJECT --reject-with icmp-port-unreachable",
    ]);
    assert_eq!(rejects[0].port_name, "prod/empty:9000");
}
