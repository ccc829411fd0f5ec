//! The causes nattrace names, one row each: its id, the verdicts it can
//! explain, the check that recognises it in a decided flow, the incident
//! behind it (README's "What nattrace recognises") and its fix. The rows
//! are tried in order and the first whose check matches wins, so more
//! specific rows come first. A new incident adds a `CauseId` variant and a
//! row; the checks live in `checks/`.
use serde::{Serialize, Serializer};

use super::{
    checks::backend::{backend_port_closed, backend_unreachable},
    checks::path::{hairpin_mode_off, hairpin_not_masqueraded, reply_bypasses_dnat_node},
    checks::{
        Found, RuleCtx, bridged_reply_sysctl_off, bridged_reply_sysctl_on, dropped_by_netfilter,
        dropped_by_rp_filter, no_endpoints, no_reply_through_node, not_dnated,
        service_not_netfilter,
    },
    verdict::Verdict,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CauseId {
    /// The Service is load-balanced by IPVS or an eBPF data plane on this
    /// node, not by netfilter NAT: no NAT-based cause applies.
    ServiceNotNetfilter,
    /// Seed 003 seen from the backend's node: the request came in already
    /// DNATed by another node, the reply left here straight to the client.
    ReplyBypassesDnatNode,
    /// Seed 004 case 3 without kube-proxy's `-s <podIP> -j KUBE-MARK-MASQ`.
    HairpinNotMasqueraded,
    /// Seed 004 case 3 with `hairpin_mode` off on the pod's bridge port.
    HairpinModeOff,
    /// Seed 000/001: the reply was bridged between two pods without netfilter.
    BridgeNfCallIptablesOff,
    /// Seed 000/001 over IPv6: bridged past ip6tables (`ip6_rules`).
    BridgeNfCallIp6tablesOff,
    /// Same evidence, but the sysctl read 1 at start: it changed, or another
    /// namespace owns the bridge.
    ReplyBridgedWithoutNetfilter,
    /// Seed 003: DNATed here, the reply went back another way.
    NoReplyThroughNode,
    /// kube-proxy REJECTs the Service port: it has no endpoints.
    NoEndpoints,
    /// The request reached the nat table but no DNAT rule matched.
    NotDnated,
    DroppedByNetfilter,
    DroppedByRpFilter,
    /// Issue 11: DNATed to a backend that is gone (stale endpoint) or unreachable.
    BackendUnreachable,
    /// Issue 11: the backend answered the SYN with RST (pod alive, port closed).
    BackendPortClosed,
    /// Issue 21: mid-stream, conntrack no longer NATs the connection (its
    /// entry deleted or the packets INVALID): dropped by kube-proxy's
    /// INVALID rule, or the reply reached the client un-reverse-NATed.
    ConntrackInvalid,
    /// Seed 003 told from both nodes (issue 14): one node DNATed the
    /// request, the backend's node sent the reply straight to the client.
    AsymmetricReturnPath,
}

pub(crate) struct CauseRow {
    pub id: CauseId,
    /// The id in JSON and the README.
    pub name: &'static str,
    pub verdicts: &'static [Verdict],
    pub check: fn(&RuleCtx<'_>) -> Option<Found>,
    /// The incident behind the cause, for the README's table.
    pub incident: &'static str,
    pub fix: &'static str,
}

pub(crate) const CAUSES: &[CauseRow] = &[
    // First: every NAT-based cause below would mislead for such a Service.
    CauseRow {
        id: CauseId::ServiceNotNetfilter,
        name: "service_not_netfilter",
        verdicts: &[
            Verdict::ReplyNotReverseNated,
            Verdict::NoReply,
            Verdict::Dropped,
            Verdict::Refused,
        ],
        check: service_not_netfilter,
        incident: "Service load-balanced by IPVS (kube-ipvs0) or an eBPF data plane (Cilium, Calico), not netfilter",
        fix: "follow the Service with the data plane's own tools (ipvsadm -Ln --stats; cilium-dbg service list, bpftool map dump): nattrace judges netfilter NAT only",
    },
    CauseRow {
        id: CauseId::ReplyBypassesDnatNode,
        name: "reply_bypasses_dnat_node",
        verdicts: &[Verdict::ReplyNotReverseNated],
        check: reply_bypasses_dnat_node,
        incident: "seed 003 seen from the backend's node: request arrives already DNATed, reply leaves with the pod's address",
        fix: "make replies return through the node that DNATed the request: kube-proxy masqueradeAll: true on the nodes the traffic enters by (or externalTrafficPolicy: Cluster), or route the Service CIDR so requests enter where the backend runs",
    },
    CauseRow {
        id: CauseId::HairpinNotMasqueraded,
        name: "hairpin_not_masqueraded",
        verdicts: &[Verdict::ReplyNotReverseNated, Verdict::Dropped],
        check: hairpin_not_masqueraded,
        incident: "seed 004 case 3: pod → own Service → itself, KUBE-SEP's masquerade rule missing",
        fix: "restore kube-proxy's KUBE-SEP rule `-s <podIP>/32 -j KUBE-MARK-MASQ` (let kube-proxy resync its rules), or set masqueradeAll: true",
    },
    CauseRow {
        id: CauseId::HairpinModeOff,
        name: "hairpin_mode_off",
        verdicts: &[Verdict::NoReply, Verdict::Dropped],
        check: hairpin_mode_off,
        incident: "seed 004 case 3: pod → own Service → itself, bridge port hairpin_mode off",
        fix: "turn hairpin mode on for pod bridge ports: kubelet --hairpin-mode=hairpin-veth (or promiscuous-bridge), or the CNI bridge plugin's \"hairpinMode\": true; now: ip link set <port> type bridge_slave hairpin on",
    },
    CauseRow {
        id: CauseId::BridgeNfCallIptablesOff,
        name: "bridge_nf_call_iptables_off",
        verdicts: &[Verdict::ReplyNotReverseNated],
        check: bridged_reply_sysctl_off,
        incident: "seed 000/001: same-node reply bridged past netfilter (br_netfilter off), TCP or DNS; or switched off while running (issue 21: phase established, the node's sysctls read again when the flow breaks mid-stream)",
        fix: "load br_netfilter and set net.bridge.bridge-nf-call-iptables=1 in the node namespace (before kubelet starts)",
    },
    CauseRow {
        id: CauseId::BridgeNfCallIp6tablesOff,
        name: "bridge_nf_call_ip6tables_off",
        verdicts: &[Verdict::ReplyNotReverseNated],
        check: super::checks::ip6::bridged_reply6_sysctl_off,
        incident: "seed 000/001 over IPv6: same-node reply bridged past ip6tables (bridge-nf-call-ip6tables=0), TCP or DNS",
        fix: "load br_netfilter and set net.bridge.bridge-nf-call-ip6tables=1 in the node namespace (before kubelet starts)",
    },
    CauseRow {
        id: CauseId::ConntrackInvalid,
        name: "conntrack_invalid",
        verdicts: &[Verdict::ReplyNotReverseNated, Verdict::Dropped],
        check: super::established::conntrack_invalid,
        incident: "issue 21: mid-stream the connection's conntrack entry is gone (conntrack -D/-F, a kube-proxy restart, a timeout with nf_conntrack_tcp_loose=0) or its packets fall out of the TCP window: INVALID, NAT skips them; kube-proxy's `KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP` drops them, or the reply reaches the client un-reverse-NATed and the client resets",
        fix: "keep conntrack tracking long-lived connections: net.netfilter.nf_conntrack_tcp_be_liberal=1 (out-of-window packets stay ESTABLISHED; kube-proxy ≥ 1.29 with conntrack.tcpBeLiberal then leaves out its INVALID DROP rule) and nf_conntrack_tcp_loose=1 (the default: a mid-stream packet picks an entry up again); do not flush entries of live connections (conntrack -F/-D); `conntrack -S` shows the invalid counter",
    },
    CauseRow {
        id: CauseId::ReplyBridgedWithoutNetfilter,
        name: "reply_bridged_without_netfilter",
        verdicts: &[Verdict::ReplyNotReverseNated],
        check: bridged_reply_sysctl_on,
        incident: "seed 000 evidence although bridge-nf-call-iptables read 1 (changed, or another namespace owns the bridge)",
        fix: "check net.bridge.bridge-nf-call-iptables (ip6tables for IPv6) in the namespace that owns the bridge (it must be 1) and that br_netfilter is loaded",
    },
    // Before the path causes below: a request that never left the node, or
    // was flooded because its backend's MAC is gone, is no routing problem.
    CauseRow {
        id: CauseId::BackendUnreachable,
        name: "backend_unreachable",
        verdicts: &[Verdict::NoReply, Verdict::Dropped],
        check: backend_unreachable,
        incident: "stale endpoint: backend pod deleted or unreachable, its KUBE-SEP rule still in place (neighbour resolution fails, the bridge has no port for its MAC, or no route to it)",
        fix: "the endpoint is stale: check `kubectl get endpointslices` for the Service (is the backend's address still listed?), and the backend pod's readiness and termination (kubectl get pod -o wide, describe: deleted, evicted, node gone?); kube-proxy drops the KUBE-SEP rule once the endpoint is removed",
    },
    CauseRow {
        id: CauseId::BackendPortClosed,
        name: "backend_port_closed",
        verdicts: &[Verdict::Refused],
        check: backend_port_closed,
        incident: "backend pod alive but nothing listens on the target port: it answers with RST",
        fix: "the backend pod runs but nothing listens on the port: check the Service's targetPort against the container's port, the container's logs and its readiness probe (a pod should not be ready before it listens)",
    },
    CauseRow {
        id: CauseId::NoReplyThroughNode,
        name: "no_reply_through_node",
        verdicts: &[Verdict::NoReply],
        check: no_reply_through_node,
        incident: "seed 003 seen from the DNATing node: asymmetric return path",
        fix: "make replies return through the DNATing node: SNAT here (kube-proxy masqueradeAll: true, or externalTrafficPolicy: Cluster), or route the Service CIDR to the backend's node",
    },
    CauseRow {
        id: CauseId::NoEndpoints,
        name: "no_endpoints",
        verdicts: &[Verdict::Dropped, Verdict::NoReply],
        check: no_endpoints,
        incident: "Service without endpoints: kube-proxy's REJECT answers ICMP port unreachable (curl: connection refused)",
        fix: "the Service has no ready endpoints: check its EndpointSlices (kubectl get endpointslices -n <namespace> -l kubernetes.io/service-name=<name>), that its selector matches running pods and that they pass their readiness probes",
    },
    CauseRow {
        id: CauseId::NotDnated,
        name: "not_dnated",
        verdicts: &[Verdict::NoReply],
        check: not_dnated,
        incident: "Service without endpoints / rules not programmed",
        fix: "check that the Service has ready endpoints (kubectl get endpointslices) and that kube-proxy programmed its rules (iptables-save | grep the Service IP)",
    },
    CauseRow {
        id: CauseId::DroppedByNetfilter,
        name: "dropped_by_netfilter",
        verdicts: &[Verdict::Dropped],
        check: dropped_by_netfilter,
        incident: "a DROP/REJECT rule (NetworkPolicy, firewall)",
        fix: "find the DROP/REJECT rule on that hook: iptables-save / nft list ruleset (NetworkPolicy, KUBE-FIREWALL, KUBE-FORWARD chains)",
    },
    CauseRow {
        id: CauseId::DroppedByRpFilter,
        name: "dropped_by_rp_filter",
        verdicts: &[Verdict::Dropped],
        check: dropped_by_rp_filter,
        incident: "reverse-path filter drops an asymmetric packet",
        fix: "make the return path symmetric, or loosen reverse-path filtering: net.ipv4.conf.all.rp_filter=2 and net.ipv4.conf.<interface>.rp_filter=2 (the stricter of the two applies)",
    },
    // One node's events cannot show it: only the cross-node merge
    // (`crate::merge`) names it, so its check never matches a single flow.
    CauseRow {
        id: CauseId::AsymmetricReturnPath,
        name: "asymmetric_return_path",
        verdicts: &[Verdict::ReplyNotReverseNated, Verdict::NoReply],
        check: |_| None,
        incident: "seed 003 from both nodes' recordings (`nattrace analyze b.rec a.rec`): one node DNATs, the backend's node replies straight to the client",
        fix: "make replies return through the DNATing node: SNAT here (kube-proxy masqueradeAll: true, or externalTrafficPolicy: Cluster), or route the Service CIDR to the backend's node",
    },
];

impl CauseId {
    fn row(self) -> &'static CauseRow {
        CAUSES
            .iter()
            .find(|r| r.id == self)
            .expect("every CauseId has a row in CAUSES")
    }

    /// Every cause, in the order the rules try them.
    pub fn all() -> impl Iterator<Item = CauseId> {
        CAUSES.iter().map(|r| r.id)
    }

    pub fn as_str(self) -> &'static str {
        self.row().name
    }

    pub fn hint(self) -> &'static str {
        self.row().fix
    }

    pub fn incident(self) -> &'static str {
        self.row().incident
    }

    /// The verdicts this cause explains.
    pub fn verdicts(self) -> &'static [Verdict] {
        self.row().verdicts
    }
}

impl Serialize for CauseId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// The README's "What nattrace recognises" table, one row per cause.
pub fn markdown_table() -> String {
    let mut out = String::from("| incident | verdict | cause | fix |\n|---|---|---|---|\n");
    for r in CAUSES {
        let verdicts: Vec<String> = r
            .verdicts
            .iter()
            .map(|v| format!("`{}`", v.as_str()))
            .collect();
        out.push_str(&format!(
            "| {} | {} | `{}` | {} |\n",
            r.incident,
            verdicts.join(" / "),
            r.name,
            r.fix.replace('|', "\\|")
        ));
    }
    out
}

/// A cause as reported: `text` is the full sentence, `clause` the short
/// form that goes into the flow's one-line detail.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Cause {
    pub id: CauseId,
    pub text: String,
    #[serde(skip)]
    pub clause: String,
    pub hint: &'static str,
}

pub(crate) fn infer(ctx: &RuleCtx<'_>) -> Option<Cause> {
    CAUSES
        .iter()
        .filter(|r| r.verdicts.contains(&ctx.verdict))
        .find_map(|r| {
            (r.check)(ctx).map(|(clause, text)| Cause {
                id: r.id,
                text,
                clause,
                hint: r.fix,
            })
        })
}
