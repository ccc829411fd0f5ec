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
