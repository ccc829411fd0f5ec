//! The node's complete iptables layout (issue 10 item 2): kube-proxy's
//! filter and nat tables, kubelet's chains, the canaries and the CNI's
//! chains, through iptables-nft (default) or iptables-legacy, as the kernel
//! and `iptables-save` then show them; and a Service without endpoints.
use super::*;
use lab::{CniChains, IptablesBackend, LabSpec};

/// `iptables-save` output without comments, counters and the built-in chain
/// lines (iptables-nft-save prints those even where no base chain exists).
fn saved_rules(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| !l.starts_with(':') || l.ends_with("- [0:0]"))
        .map(str::to_string)
        .collect()
}

/// The rendered table `table` out of the lab's restore input.
fn rendered(lab: &Lab, node: &str, table: &str) -> Vec<String> {
    let all = lab.node_rules(node).expect("rendering");
    let header = format!("*{table}");
    let mut out = Vec::new();
    let mut inside = false;
    for line in all.lines() {
        if line.starts_with('*') {
            inside = line == header;
        }
        if inside {
            out.push(line.to_string());
        }
        if line == "COMMIT" {
            inside = false;
        }
    }
    out
}

fn with(spec: LabSpec, backend: IptablesBackend, cni: CniChains) -> LabSpec {
    let mut spec = spec;
    spec.kube_proxy.iptables = backend;
    spec.kube_proxy.cni_chains = cni;
    spec
}

fn nft_ruleset(lab: &Lab) -> String {
    lab.run(presets::NODE_A, &["nft", "list", "ruleset"])
        .expect("nft list ruleset")
}

fn legacy_tables(lab: &Lab) -> String {
    lab.run(presets::NODE_A, &["cat", "/proc/net/ip_tables_names"])
        .expect("ip_tables_names")
}

#[test]
fn root_default_node_has_kube_proxys_complete_layout_through_iptables_nft() {
    require_root!();
    let lab = build_lab(presets::no_endpoints());
    let node = presets::NODE_A;
    // filter round-trips exactly: what the lab wrote is what iptables-save shows.
    let filter = lab.iptables_save_table(node, "filter").expect("save");
    assert_eq!(
        saved_rules(&filter),
        rendered(&lab, node, "filter"),
        "{filter}"
    );
    // nat too, but for the probabilities: iptables-save prints one more digit.
    let nat = lab.iptables_save_table(node, "nat").expect("save");
    let no_prob = |v: Vec<String>| -> Vec<String> {
        v.into_iter()
            .filter(|l| !l.contains("--probability"))
            .collect()
    };
    assert_eq!(
        no_prob(saved_rules(&nat)),
        no_prob(rendered(&lab, node, "nat")),
        "{nat}"
    );
    let mangle = lab.iptables_save_table(node, "mangle").expect("save");
    assert_eq!(
        saved_rules(&mangle),
        rendered(&lab, node, "mangle"),
        "{mangle}"
    );
    for needle in [
        "-A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n-A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n-A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n-A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES\n-A FORWARD -m comment --comment \"flanneld forward\" -j FLANNEL-FWD\n",
        "-A INPUT -j KUBE-FIREWALL\n",
        "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n",
        "-A KUBE-SERVICES -d 100.67.30.140/32 -p tcp -m comment --comment \"default/web-empty:http has no endpoints\" -m tcp --dport 80 -j REJECT --reject-with icmp-port-unreachable\n",
        ":KUBE-KUBELET-CANARY - [0:0]",
        ":KUBE-PROXY-CANARY - [0:0]",
    ] {
        assert!(filter.contains(needle), "missing {needle:?} in:\n{filter}");
    }
    assert!(mangle.contains(":KUBE-IPTABLES-HINT - [0:0]"), "{mangle}");
    let nat = lab.iptables_save(node).expect("save");
    for needle in [
        "-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n-A POSTROUTING -m comment --comment \"flanneld masq\" -j FLANNEL-POSTRTG\n",
        "-A FLANNEL-POSTRTG ! -s 100.96.0.0/11 -d 100.96.54.0/24 -m comment --comment \"flanneld masq\" -j RETURN",
        ":KUBE-PROXY-CANARY - [0:0]",
    ] {
        assert!(nat.contains(needle), "missing {needle:?} in:\n{nat}");
    }
    // The Service without endpoints has no nat rules at all.
    assert!(!nat.contains("100.67.30.140"), "{nat}");

    // The kernel side: nf_tables base chains exist exactly where a jump was
    // added (filter's three hooks at priority 0; mangle only the user chains).
    let ruleset = nft_ruleset(&lab);
    assert!(
        ruleset.contains("type filter hook forward priority filter; policy accept;"),
        "{ruleset}"
    );
    let mangle_table = lab
        .run(node, &["nft", "list", "table", "ip", "mangle"])
        .expect("nft list table ip mangle");
    assert!(!mangle_table.contains("hook"), "{mangle_table}");
    assert_eq!(legacy_tables(&lab).trim(), "", "no legacy table may exist");

    // kube-proxy's REJECT: connection refused at once, not a timeout.
    let out = lab
        .http_get(presets::CLIENT_POD, presets::EMPTY_SERVICE_IP, 80, SHORT)
        .expect("curl");
    assert_eq!(out.status.code(), Some(7), "{}", text(&out));
    // The Service with endpoints still works through the whole layout.
    let out = lab
        .http_get(presets::CLIENT_POD, presets::WEB_SERVICE_IP, 80, SHORT)
        .expect("curl");
    assert!(out.status.success(), "{}", text(&out));
    // NodePorts on the node's address: KUBE-NODEPORTS → KUBE-EXT-… in nat,
    // and filter KUBE-EXTERNAL-SERVICES' REJECT for the empty one.
    let node_ip = lab::node_underlay_ip(0);
    let out = lab
        .http_get(presets::CLIENT_POD, node_ip, presets::WEB_NODE_PORT, SHORT)
        .expect("curl");
    assert!(out.status.success(), "{}", text(&out));
    let out = lab
        .http_get(
            presets::CLIENT_POD,
            node_ip,
            presets::EMPTY_NODE_PORT,
            SHORT,
        )
        .expect("curl");
    assert_eq!(out.status.code(), Some(7), "{}", text(&out));
    assert!(
        filter.contains("-A KUBE-EXTERNAL-SERVICES -p tcp -m comment --comment \"default/web-empty:http has no endpoints\" -m addrtype --dst-type LOCAL -m tcp --dport 30081 -j REJECT --reject-with icmp-port-unreachable"),
        "{filter}"
    );
}

#[test]
fn root_legacy_variant_writes_x_tables_and_nothing_in_nf_tables() {
    require_root!();
    let lab = build_lab(with(
        presets::no_endpoints(),
        IptablesBackend::Legacy,
        CniChains::default(),
    ));
    let node = presets::NODE_A;
    let names = legacy_tables(&lab);
    for table in ["filter", "nat", "mangle"] {
        assert!(
            names.lines().any(|l| l == table),
            "{table} missing: {names}"
        );
    }
    let filter = lab.iptables_save_table(node, "filter").expect("save");
    assert_eq!(
        saved_rules(&filter),
        rendered(&lab, node, "filter"),
        "{filter}"
    );
    let ruleset = nft_ruleset(&lab);
    assert!(!ruleset.contains("table ip"), "{ruleset}");
    let out = lab
        .http_get(presets::CLIENT_POD, presets::EMPTY_SERVICE_IP, 80, SHORT)
        .expect("curl");
    assert_eq!(out.status.code(), Some(7), "{}", text(&out));
    let out = lab
        .http_get(presets::CLIENT_POD, presets::WEB_SERVICE_IP, 80, SHORT)
        .expect("curl");
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn root_calico_variant_hooks_raw_and_mangle() {
    require_root!();
    let lab = build_lab(with(
        presets::seed000(Seed000::default()),
        IptablesBackend::Nft,
        CniChains::Calico,
    ));
    let ruleset = nft_ruleset(&lab);
    for needle in [
        "type filter hook prerouting priority raw;",
        "type filter hook prerouting priority mangle;",
        "chain cali-PREROUTING",
    ] {
        assert!(
            ruleset.contains(needle),
            "missing {needle:?} in:\n{ruleset}"
        );
    }
    assert!(!ruleset.contains("FLANNEL"), "{ruleset}");
    let raw = lab
        .iptables_save_table(presets::NODE_A, "raw")
        .expect("save");
    assert_eq!(
        saved_rules(&raw),
        rendered(&lab, presets::NODE_A, "raw"),
        "{raw}"
    );
    let out = lab
        .http_get(presets::CLIENT_POD, presets::WEB_SERVICE_IP, 80, SHORT)
        .expect("curl");
    assert!(out.status.success(), "{}", text(&out));
}
