//! The CNI's own chains beside kube-proxy's.

use super::node::Net;
use super::{MASQ_MARK, Table};

/// flannel's rules (flannel `pkg/trafficmngr/iptables`: `forwardRules` and,
/// with `--ip-masq`, `masqRules` for one cluster CIDR), appended to the
/// built-in chains as flanneld does. The IPv6 rules (`masqIP6Rules`, the
/// same `forwardRules`) differ only in the multicast range.
pub(super) fn flannel(filter: &mut Table, nat: &mut Table, node: &Net, ip_masq: bool) {
    let net = &node.cluster_network;
    let pod = &node.pod_cidr;
    let multicast = node.multicast;
    const FWD: &str = r#"-m comment --comment "flanneld forward""#;
    filter.chain("FLANNEL-FWD");
    filter.rule("FORWARD", &format!("{FWD} -j FLANNEL-FWD"));
    filter.rule("FLANNEL-FWD", &format!("-s {net} {FWD} -j ACCEPT"));
    filter.rule("FLANNEL-FWD", &format!("-d {net} {FWD} -j ACCEPT"));
    if !ip_masq {
        return;
    }
    const MASQ: &str = r#"-m comment --comment "flanneld masq""#;
    nat.chain("FLANNEL-POSTRTG");
    nat.rule("POSTROUTING", &format!("{MASQ} -j FLANNEL-POSTRTG"));
    // Traffic kube-proxy marked is masqueraded by KUBE-POSTROUTING already.
    nat.rule(
        "FLANNEL-POSTRTG",
        &format!("-m mark --mark {MASQ_MARK} {MASQ} -j RETURN"),
    );
    nat.rule(
        "FLANNEL-POSTRTG",
        &format!("-s {pod} -d {net} {MASQ} -j RETURN"),
    );
    nat.rule(
        "FLANNEL-POSTRTG",
        &format!("-s {net} -d {pod} {MASQ} -j RETURN"),
    );
    nat.rule(
        "FLANNEL-POSTRTG",
        &format!("! -s {net} -d {pod} {MASQ} -j RETURN"),
    );
    nat.rule(
        "FLANNEL-POSTRTG",
        &format!("-s {net} ! -d {multicast} {MASQ} -j MASQUERADE --random-fully"),
    );
    nat.rule(
        "FLANNEL-POSTRTG",
        &format!("! -s {net} -d {net} {MASQ} -j MASQUERADE --random-fully"),
    );
}

/// Calico's (felix, iptables data plane) raw and mangle entry chains: the
/// jump rules carry felix's fixed rule hashes; the chain bodies are the
/// untracked/host-endpoint skeleton felix writes for a node without host
/// endpoints or untracked policy (no ipset or rpfilter matches, so the lab
/// needs no extra kernel modules).
pub(super) fn calico(raw: &mut Table, mangle: &mut Table) {
    for chain in [
        "cali-OUTPUT",
        "cali-PREROUTING",
        "cali-from-host-endpoint",
        "cali-to-host-endpoint",
    ] {
        raw.chain(chain);
    }
    raw.rule(
        "PREROUTING",
        r#"-m comment --comment "cali:6gwbT8clXdHdC1b1" -j cali-PREROUTING"#,
    );
    raw.rule(
        "OUTPUT",
        r#"-m comment --comment "cali:tVnHkvAo15HuiPy0" -j cali-OUTPUT"#,
    );
    raw.rule(
        "cali-PREROUTING",
        r#"-m comment --comment "cali:XFX5xbM8B9qR10JG" -j MARK --set-xmark 0x0/0xf0000"#,
    );
    raw.rule(
        "cali-PREROUTING",
        r#"-i cali+ -m comment --comment "cali:EWMPb0zVROM-woQp" -j MARK --set-xmark 0x40000/0x40000"#,
    );
    raw.rule(
        "cali-PREROUTING",
        r#"-m comment --comment "cali:ImU0-4Rl2WoOI9Ou" -m mark --mark 0x0/0x40000 -j cali-from-host-endpoint"#,
    );
    raw.rule(
        "cali-PREROUTING",
        r#"-m comment --comment "cali:lV4V2MPoMBf0hl9T" -m mark --mark 0x10000/0x10000 -j ACCEPT"#,
    );
    raw.rule(
        "cali-OUTPUT",
        r#"-m comment --comment "cali:njdnLwYeGqBJyMxW" -j MARK --set-xmark 0x0/0xf0000"#,
    );
    raw.rule(
        "cali-OUTPUT",
        r#"-m comment --comment "cali:rz86uTUcEZAfFsh7" -j cali-to-host-endpoint"#,
    );
    raw.rule(
        "cali-OUTPUT",
        r#"-m comment --comment "cali:pN0F5zD0b8yf9W1Z" -m mark --mark 0x10000/0x10000 -j ACCEPT"#,
    );

    for chain in [
        "cali-POSTROUTING",
        "cali-PREROUTING",
        "cali-from-host-endpoint",
        "cali-to-host-endpoint",
    ] {
        mangle.chain(chain);
    }
    mangle.rule(
        "PREROUTING",
        r#"-m comment --comment "cali:6gwbT8clXdHdC1b1" -j cali-PREROUTING"#,
    );
    mangle.rule(
        "POSTROUTING",
        r#"-m comment --comment "cali:O3lYWMrLQYEMJtB5" -j cali-POSTROUTING"#,
    );
    mangle.rule(
        "cali-PREROUTING",
        r#"-m comment --comment "cali:6BJqBjBC7crtA-7-" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"#,
    );
    mangle.rule(
        "cali-PREROUTING",
        r#"-m comment --comment "cali:KX7AGNd6rMcDUai6" -m mark --mark 0x10000/0x10000 -j ACCEPT"#,
    );
    mangle.rule(
        "cali-PREROUTING",
        r#"-m comment --comment "cali:wNH7KsA3ILKJBsY9" -j cali-from-host-endpoint"#,
    );
    mangle.rule(
        "cali-PREROUTING",
        r#"-m comment --comment "cali:Cg96MgVuoPm7UMRo" -m comment --comment "Host endpoint policy accepted packet." -m mark --mark 0x10000/0x10000 -j ACCEPT"#,
    );
    mangle.rule(
        "cali-POSTROUTING",
        r#"-m comment --comment "cali:NX-7roTexQ3fGRfU" -m mark --mark 0x10000/0x10000 -j RETURN"#,
    );
    mangle.rule(
        "cali-POSTROUTING",
        r#"-m comment --comment "cali:nnqPh8lh2VOogSzX" -j MARK --set-xmark 0x0/0xf0000"#,
    );
    mangle.rule(
        "cali-POSTROUTING",
        r#"-m comment --comment "cali:nquN8Jw8Tz72pcBW" -m conntrack --ctstate DNAT -j cali-to-host-endpoint"#,
    );
    mangle.rule(
        "cali-POSTROUTING",
        r#"-m comment --comment "cali:jWrgvDQQ2Zgm8q4y" -m comment --comment "Host endpoint policy accepted packet." -m mark --mark 0x10000/0x10000 -j RETURN"#,
    );
}
