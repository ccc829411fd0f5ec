//! Target checks (issue 28): a `--svc` address or port no Service has is
//! warned about at start, naming the real Service; a `--svc` that saw no
//! connection at all ends with exit status 4 (README), below 1.

use lab::presets::{self, Backend};
use lab::{Lab, ProxyMode, both_modes};

use super::{curls, ports, seed000, trace, tracing_lock};

/// One digit off seed 000's web Service (100.67.30.133).
const TYPO: &str = "100.67.30.134:80";

fn target_warnings(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.starts_with("nattrace: warning: --svc "))
        .collect()
}

fn no_connection_lines(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.starts_with("nattrace: no connection to "))
        .collect()
}

fn curl_web(lab: &Lab, first_port: u16) {
    let p = ports(first_port, 2);
    assert_eq!(curls(lab, presets::WEB_SERVICE_IP, 80, &p), p.len());
}

both_modes!(typo_warned: root_targets_a_mistyped_svc_is_warned_and_exits_4, root_targets_a_mistyped_svc_is_warned_and_exits_4_nft);
fn typo_warned(mode: ProxyMode) {
    let lab = seed000(true, Backend::SameNode, mode);
    let _lock = tracing_lock();
    // The mistyped address and a port the Service does not have, while a
    // client uses the real one: neither is seen.
    let wrong_port = format!("{}:8080", presets::WEB_SERVICE_IP);
    let done = trace(&lab, &[TYPO.to_string(), wrong_port.clone()], || {
        curl_web(&lab, 46000)
    });
    let all = done.describe();
    assert_eq!(done.status.code(), Some(4), "{all}");
    let warned = target_warnings(&done.stderr);
    assert_eq!(warned.len(), 2, "one warning line per --svc:\n{all}");
    let list = match mode {
        ProxyMode::Nftables => "nft list table ip kube-proxy",
        _ => "iptables-save -t nat | grep KUBE-SVC",
    };
    let typo_line = warned
        .iter()
        .find(|l| l.contains(TYPO))
        .unwrap_or_else(|| panic!("no warning for {TYPO}:\n{all}"));
    assert!(
        typo_line.contains("no Service has this address")
            && typo_line.contains(&format!(
                "nearest: {} (default/web)",
                presets::WEB_SERVICE_IP
            ))
            && typo_line.contains(list),
        "{all}"
    );
    let port_line = warned
        .iter()
        .find(|l| l.contains(&wrong_port))
        .unwrap_or_else(|| panic!("no warning for {wrong_port}:\n{all}"));
    assert!(
        port_line.contains("default/web at 100.67.30.133 has no port 8080")
            && port_line.contains("its ports: 80/tcp (http)"),
        "{all}"
    );
    // The end says which saw nothing.
    let said = no_connection_lines(&done.stderr);
    assert_eq!(said.len(), 2, "{all}");
    for svc in [TYPO, wrong_port.as_str()] {
        assert!(
            said.iter().any(|l| l
                .starts_with(&format!("nattrace: no connection to {svc} was seen in "))
                && l.contains(list)),
            "{all}"
        );
    }
}

/// The real address with traffic: no warning, exit 0 as before.
#[test]
fn root_targets_the_real_address_with_traffic_is_not_warned_and_exits_0() {
    require_root!();
    let lab = seed000(true, Backend::SameNode, ProxyMode::Iptables);
    let _lock = tracing_lock();
    let done = trace(&lab, &[presets::web_svc()], || curl_web(&lab, 46100));
    let all = done.describe();
    assert_eq!(done.status.code(), Some(0), "{all}");
    assert!(target_warnings(&done.stderr).is_empty(), "{all}");
    assert!(no_connection_lines(&done.stderr).is_empty(), "{all}");
}

/// A failed flow to the real address says more than an idle typo: 1, not 4
/// (README's precedence), and the typo is still said at the end.
#[test]
fn root_targets_a_failed_flow_wins_over_a_target_without_flows() {
    require_root!();
    let lab = seed000(false, Backend::SameNode, ProxyMode::Iptables);
    let _lock = tracing_lock();
    let done = trace(&lab, &[presets::web_svc(), TYPO.to_string()], || {
        let p = ports(46200, 2);
        assert_eq!(curls(&lab, presets::WEB_SERVICE_IP, 80, &p), 0);
    });
    let all = done.describe();
    assert_eq!(done.status.code(), Some(1), "{all}");
    assert_eq!(no_connection_lines(&done.stderr).len(), 1, "{all}");
}
