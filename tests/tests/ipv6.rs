//! IPv6 and dual-stack Services (issue 12): the lab's dual-stack nodes
//! (bridged and routed, kube-proxy's ip6tables rules and `table ip6
//! kube-proxy`) and the seed incidents over IPv6, traced by the real
//! nattrace. Needs root (tests are prefixed `root_`); without it they print
//! why they are skipped and pass.
//!
//! Each lab serves several cases in turn (IPv4 and IPv6, healthy and
//! broken by flipping a sysctl in the lab's node namespace), so the whole
//! binary builds few labs.

use std::net::IpAddr;
use std::time::Duration;

use lab::presets::{self, Backend};
use lab::{Datapath, Lab, LabSpec, ProxyMode, both_modes, build_lab};

macro_rules! require_root {
    () => {
        if lab::skip_without_root(
            "IPv6 tests need root (network namespaces, eBPF); \
             run `sudo cargo test -p nattrace-tests --test ipv6` or in CI",
        ) {
            return;
        }
    };
}

#[path = "ipv6/doctor.rs"]
mod doctor;
#[path = "ipv6/fixtures.rs"]
mod fixtures;
#[path = "ipv6/tracing.rs"]
mod tracing;

const CLIENT_TIMEOUT: Duration = Duration::from_secs(1);

/// `spec` made dual-stack, with kube-proxy in `mode` on `datapath` nodes.
fn build(mode: ProxyMode, datapath: Datapath, spec: LabSpec) -> Lab {
    let mut spec = spec.with_datapath(datapath).dual_stack();
    spec.kube_proxy.mode = mode;
    build_lab(spec)
}

fn web6() -> IpAddr {
    lab::dual_stack::service_ip6(presets::WEB_SERVICE_IP).into()
}

/// curl from `from` to `ip`:80; Some(body) when it answered.
fn curl(lab: &Lab, from: &str, ip: impl Into<IpAddr>) -> Option<String> {
    let out = lab
        .http_get(from, ip, presets::WEB_PORT, CLIENT_TIMEOUT)
        .expect("running curl");
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Sets `net.bridge.bridge-nf-call-ip6tables` in `node`'s namespace (the
/// lab's own: /proc/sys/net resolves per namespace).
fn set_bridge_nf_ip6(lab: &Lab, node: &str, on: bool) {
    let v = if on { "1" } else { "0" };
    lab.run(
        node,
        &[
            "sh",
            "-c",
            &format!("echo {v} > /proc/sys/net/bridge/bridge-nf-call-ip6tables"),
        ],
    )
    .expect("writing the sysctl in the lab node");
}

/// The dual-stack lab itself, before any tracing: both families reach the
/// Service and the other node's pod, each family's rules carry the
/// Service's own address, and (bridged) seed 000 happens over IPv6 alone
/// when only `bridge-nf-call-ip6tables` is 0.
fn lab_serves_both_families(mode: ProxyMode, datapath: Datapath) {
    let lab = build(
        mode,
        datapath,
        presets::seed000(presets::Seed000 {
            bridge_nf_call_iptables: true,
            backend: Backend::SameNode,
        }),
    );
    let client6 = lab.pod_ip6(presets::CLIENT_POD).unwrap();
    let body = curl(&lab, presets::CLIENT_POD, web6()).expect("curl over IPv6 answers");
    assert!(
        body.contains("pod=backend") && body.contains(&format!("client=[{client6}]:")),
        "{body}"
    );
    let body = curl(&lab, presets::CLIENT_POD, presets::WEB_SERVICE_IP).expect("IPv4 answers");
    assert!(
        body.contains(&format!("client={}:", presets::CLIENT_IP)),
        "{body}"
    );
    // Across the overlay (flannel-v6.1 or host routes) to the other node's pod.
    let remote6 = lab.pod_ip6(presets::REMOTE_BACKEND_POD).unwrap();
    let body = curl(&lab, presets::CLIENT_POD, remote6).expect("pod to pod over IPv6");
    assert!(body.contains("pod=backend-b"), "{body}");

    let backend6 = lab.pod_ip6(presets::BACKEND_POD).unwrap();
    match mode {
        ProxyMode::Iptables => {
            let nat6 = lab.ip6tables_save_table(presets::NODE_A, "nat").unwrap();
            assert!(
                nat6.contains(&format!("-d {}/128 -p tcp", web6())),
                "{nat6}"
            );
            assert!(
                nat6.contains(&format!("--to-destination [{backend6}]:80")),
                "{nat6}"
            );
            let nat4 = lab.iptables_save_table(presets::NODE_A, "nat").unwrap();
            assert!(!nat4.contains("fd00:"), "{nat4}");
        }
        ProxyMode::Nftables => {
            let t = lab
                .run(
                    presets::NODE_A,
                    &["nft", "list", "table", "ip6", "kube-proxy"],
                )
                .unwrap();
            assert!(t.contains(&format!("dnat to [{backend6}]:80")), "{t}");
        }
    }

    if datapath == Datapath::Bridge {
        set_bridge_nf_ip6(&lab, presets::NODE_A, false);
        assert!(
            curl(&lab, presets::CLIENT_POD, web6()).is_none(),
            "seed 000 over IPv6: the bridged reply is never reverse-NATed"
        );
        assert!(
            curl(&lab, presets::CLIENT_POD, presets::WEB_SERVICE_IP).is_some(),
            "IPv4 is untouched by bridge-nf-call-ip6tables"
        );
    }
}

both_modes!(lab_bridged: root_dual_stack_lab_bridged, root_dual_stack_lab_bridged_nft);
fn lab_bridged(mode: ProxyMode) {
    lab_serves_both_families(mode, Datapath::Bridge);
}

both_modes!(lab_routed: root_dual_stack_lab_routed, root_dual_stack_lab_routed_nft);
fn lab_routed(mode: ProxyMode) {
    lab_serves_both_families(mode, Datapath::Routed);
}
