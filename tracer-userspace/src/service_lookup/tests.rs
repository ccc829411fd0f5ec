use super::*;
use crate::ruleset::{external::ExternalKind, external::tests::SAVE, parse_save};

fn rules() -> KubeProxyRules {
    let mut r = parse_save(SAVE);
    r.north_south.node_addresses = vec!["192.168.50.2".parse().unwrap()];
    r
}

fn name(s: &str) -> ServiceName {
    s.parse().unwrap()
}

#[test]
fn parses_namespace_name_and_port() {
    assert_eq!(
        name("prod/export:http"),
        ServiceName {
            namespace: "prod".into(),
            name: "export".into(),
            port: Some(PortRef::Name("http".into()))
        }
    );
    assert_eq!(name("prod/export:8080").port, Some(PortRef::Number(8080)));
    assert_eq!(name("prod/export").port, None);
    for bad in [
        "prod",
        "prod/",
        "/x",
        "Prod/x",
        "prod/x:",
        "prod/x:0",
        "prod/x:HTTP",
        "a/b/c",
    ] {
        assert!(bad.parse::<ServiceName>().is_err(), "{bad}");
    }
}

#[test]
fn a_name_resolves_to_every_address_of_the_service() {
    let got: Vec<String> = resolve(&rules(), &name("ns/np"))
        .unwrap()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        got,
        [
            "10.96.0.20:80 (ns/np:http ClusterIP/tcp)",
            "192.168.50.2:30090 (ns/np:http NodePort/tcp)",
            "198.51.100.7:80 (ns/np:http externalIP/tcp)",
            "203.0.113.10:80 (ns/np:http LoadBalancer IP/tcp)",
        ]
    );
    // By port name and by the Service's port number.
    assert_eq!(resolve(&rules(), &name("ns/np:http")).unwrap().len(), 4);
    assert_eq!(resolve(&rules(), &name("ns/np:80")).unwrap().len(), 4);
    let loc = resolve(&rules(), &name("ns/loc")).unwrap();
    assert_eq!(loc.len(), 2, "{loc:?}");
}

#[test]
fn unknown_names_and_ports_name_the_nearest() {
    let err = resolve(&rules(), &name("ns/nq")).unwrap_err();
    assert_eq!(
        err.to_string(),
        "no Service ns/nq in kube-proxy's rules on this node; nearest: ns/np, ns/loc (list them: nattrace doctor)"
    );
    // The right name in the wrong namespace is found by its name.
    assert_eq!(nearest_names(&rules(), "prod/np", 1), ["ns/np"]);
    let err = resolve(&rules(), &name("ns/np:https")).unwrap_err();
    assert_eq!(
        err.to_string(),
        "Service ns/np has no port https in kube-proxy's rules (its ports: ns/np:http)"
    );
    assert!(matches!(
        resolve(&KubeProxyRules::default(), &name("ns/np")),
        Err(LookupError::NoRules(_))
    ));
}

#[test]
fn an_address_names_its_service_port() {
    let t = target_at(&rules(), "192.168.50.2".parse().unwrap(), 30091);
    assert_eq!(t.len(), 1);
    assert_eq!(t[0].port_name, "ns/loc:http");
    assert_eq!(t[0].kind, AddrKind::External(ExternalKind::NodePort));
}

fn svc(s: &str) -> Service {
    Service::cluster_ip(s).unwrap()
}

#[test]
fn a_mistyped_address_names_the_nearest_services_by_address() {
    let near = nearest_addrs(&rules(), "10.96.0.22".parse().unwrap(), 3);
    let got: Vec<String> = near
        .iter()
        .map(|(a, s)| format!("{a} {}", s.join(",")))
        .collect();
    assert_eq!(
        got,
        [
            "10.96.0.21 ns/loc",
            "10.96.0.20 ns/np",
            "192.168.50.2 ns/loc,ns/np"
        ]
    );
    let line = check_addr(&rules(), &svc("10.96.0.22:80")).unwrap();
    assert_eq!(
        line,
        "--svc 10.96.0.22:80: no Service has this address in kube-proxy's rules; nearest: 10.96.0.21 (ns/loc), 10.96.0.20 (ns/np), 192.168.50.2 (ns/loc, ns/np); list them: iptables-save -t nat | grep KUBE-SVC; tracing it anyway"
    );
    // Other families are not near.
    assert!(nearest_addrs(&rules(), "fd00::1".parse().unwrap(), 3).is_empty());
}

#[test]
fn a_port_the_service_does_not_have_names_its_ports() {
    let line = check_addr(&rules(), &svc("10.96.0.20:8080")).unwrap();
    assert_eq!(
        line,
        "--svc 10.96.0.20:8080: ns/np at 10.96.0.20 has no port 8080 in kube-proxy's rules (its ports: 80/tcp (http)); list them: iptables-save -t nat | grep KUBE-SVC; tracing it anyway"
    );
    // A Service's address, with its port, without: fine. A NodePort too.
    for ok in [
        "10.96.0.20:80",
        "10.96.0.20",
        "192.168.50.2:30090",
        "203.0.113.10:80",
    ] {
        assert_eq!(check_addr(&rules(), &svc(ok)), None, "{ok}");
    }
    let mut nft = rules();
    nft.mode = crate::ruleset::ProxyMode::Nftables;
    assert!(
        check_addr(&nft, &svc("10.96.0.99"))
            .unwrap()
            .contains("list them: nft list table ip kube-proxy;")
    );
}

#[test]
fn without_rules_the_check_says_it_could_not_look() {
    assert_eq!(
        check_addr(&KubeProxyRules::default(), &svc("10.96.0.20:80")).unwrap(),
        "--svc 10.96.0.20:80: cannot check it, no kube-proxy rules were readable on this node; tracing it anyway"
    );
    // Several addresses: one line for all of them.
    let two = [svc("10.96.0.20:80"), svc("10.96.0.21")];
    assert_eq!(
        check_addrs(&KubeProxyRules::default(), &two),
        [
            "--svc 10.96.0.20:80, 10.96.0.21: cannot check, no kube-proxy rules were readable on this node; tracing anyway"
        ]
    );
    assert_eq!(check_addrs(&rules(), &two), Vec::<String>::new());
}

#[test]
fn an_unbracketed_ipv6_address_with_a_port_like_tail_is_read_as_an_address() {
    // Parsed as it always was: an address, every port.
    let s = svc("fd00::1:80");
    assert_eq!(s.port, None);
    assert_eq!(s.addr, "fd00::1:80".parse::<IpAddr>().unwrap());
    let (other, text) = ambiguous_v6(&s).unwrap();
    assert_eq!(
        (other.to_string(), text.as_str()),
        ("[fd00::1]:80".into(), "fd00::1:80")
    );
    let line = check_addr(&KubeProxyRules::default(), &s).unwrap();
    assert!(
        line.starts_with(
            "--svc fd00::1:80 is read as the address fd00::1:80 (every port): cannot check it"
        ) && line.ends_with("; for port 80 of fd00::1 write [fd00::1]:80"),
        "{line}"
    );
    // Bracketed, hex tails, or a port given: nothing ambiguous.
    for plain in ["[fd00::1]:80", "fd00::1:ab", "fd00::a", "10.96.0.20"] {
        assert_eq!(ambiguous_v6(&svc(plain)), None, "{plain}");
    }
    // With rules holding [fd00::1]:80, the warning says that is a Service's.
    let mut r = rules();
    r.services.push(crate::ruleset::SvcRule {
        name: "ns/v6:http".into(),
        cluster_ip: "fd00::1".parse().unwrap(),
        port: 80,
        proto: "tcp".into(),
        chain: "KUBE-SVC-V6".into(),
        masquerade_all: false,
        endpoints: vec![],
    });
    let line = check_addr(&r, &s).unwrap();
    assert_eq!(
        line,
        "--svc fd00::1:80 is read as the address fd00::1:80 (every port), which no Service has ([fd00::1]:80 is a Service's); for port 80 of fd00::1 write [fd00::1]:80"
    );
}
