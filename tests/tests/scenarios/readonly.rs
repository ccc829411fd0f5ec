//! Read-only, proven (issue 10 item 6): `nattrace doctor` and a trace leave
//! the node exactly as they found it — no table created (nf_tables or
//! legacy x_tables), no module loaded, no sysctl written, no qdisc or tc
//! filter left behind.
use super::*;
use lab::IptablesBackend;

/// Everything about the node namespace that nattrace could change: the
/// nf_tables ruleset (stateless: counters move with traffic), the legacy
/// tables and their rules, the loaded modules (names: refcounts move with
/// other labs), the sysctls nattrace reads, links (with hairpin flags; not
/// the bridge timers or operstate, which the kernel moves on its own),
/// qdiscs and tc filters on every interface.
const SNAPSHOT: &str = r##"
echo '# nft'; nft -s list ruleset
echo '# ip_tables_names'; cat /proc/net/ip_tables_names
# (proc files have size 0: test -s cannot tell)
if grep -q . /proc/net/ip_tables_names; then
  echo '# legacy'; iptables-legacy-save | grep -v '^#' | sed 's/\[[0-9]*:[0-9]*\]//'
fi
echo '# modules'; if [ -e /proc/modules ]; then cut -d' ' -f1 /proc/modules | sort; else echo none; fi
echo '# sysctls'
for f in /proc/sys/net/bridge/bridge-nf-call-iptables /proc/sys/net/ipv4/ip_forward \
         /proc/sys/net/netfilter/nf_conntrack_max /proc/sys/net/ipv4/conf/*/rp_filter; do
  [ -e "$f" ] && echo "$f=$(cat "$f")"
done
echo '# links'; ip -d -o link show | sed -E 's/(hello|tcn|topology_change|gc|hold|message_age|forward_delay)_timer +[0-9.]+//g; s/ state [A-Z]+ / /'
echo '# qdiscs'; tc qdisc show
for dev in $(ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1); do
  echo "# filters $dev"
  tc filter show dev "$dev" ingress
  tc filter show dev "$dev" egress
done
"##;

fn snapshot(lab: &Lab) -> String {
    lab.run(presets::NODE_A, &["sh", "-c", SNAPSHOT])
        .expect("snapshot of the node")
}

fn assert_unchanged(before: &str, after: &str, what: &str) {
    if before != after {
        let diff: Vec<String> = after
            .lines()
            .filter(|l| !before.lines().any(|b| b == *l))
            .map(|l| format!("+ {l}"))
            .chain(
                before
                    .lines()
                    .filter(|l| !after.lines().any(|a| a == *l))
                    .map(|l| format!("- {l}")),
            )
            .collect();
        panic!("{what} changed the node:\n{}", diff.join("\n"));
    }
}

fn doctor_and_trace_leave_the_node_as_they_found_it(lab: &Lab) {
    let before = snapshot(lab);
    assert!(before.contains("# nft"), "{before}");
    let (code, report) = doctor::doctor(lab);
    assert!(code.is_some(), "{report}");
    assert_unchanged(&before, &snapshot(lab), "nattrace doctor");
    let done = trace(lab, presets::NODE_A, &web_svc(), &[], || {
        assert!(curl(lab, presets::CLIENT_POD));
        let _ = lab.http_get(
            presets::CLIENT_POD,
            presets::EMPTY_SERVICE_IP,
            presets::WEB_PORT,
            CLIENT_TIMEOUT,
        );
    });
    assert_eq!(done.status.code(), Some(0), "{}", done.describe());
    assert_unchanged(&before, &snapshot(lab), "a trace");
}

#[test]
fn root_doctor_and_trace_change_nothing_on_an_iptables_nft_node() {
    require_root!();
    let _lock = tracing_lock();
    let lab = build_lab(presets::no_endpoints());
    doctor_and_trace_leave_the_node_as_they_found_it(&lab);
}

#[test]
fn root_doctor_and_trace_change_nothing_on_an_iptables_legacy_node() {
    require_root!();
    let _lock = tracing_lock();
    let mut spec = presets::no_endpoints();
    spec.kube_proxy.iptables = IptablesBackend::Legacy;
    let lab = build_lab(spec);
    let before = snapshot(&lab);
    assert!(before.contains("# legacy"), "{before}");
    doctor_and_trace_leave_the_node_as_they_found_it(&lab);
}

/// kube-proxy in nftables mode: nattrace reads `nft -j list ruleset` and
/// must leave kube-proxy's table, kubelet's and flannel's iptables-nft
/// tables exactly as they were.
#[test]
fn root_doctor_and_trace_change_nothing_on_an_nftables_mode_node() {
    require_root!();
    let _lock = tracing_lock();
    let lab = build_in(ProxyMode::Nftables, presets::no_endpoints());
    let before = snapshot(&lab);
    assert!(before.contains("table ip kube-proxy"), "{before}");
    doctor_and_trace_leave_the_node_as_they_found_it(&lab);
}
