//! The causes nattrace names, one row each: its id, the verdicts it can
//! explain, the check that recognises it in a decided flow, the incident
//! behind it (README's "What nattrace recognises") and its fix. The rows
//! are tried in order and the first whose check matches wins, so more
//! specific rows come first. A new incident adds a `CauseId` variant and a
//! row; the checks live in `checks/`.
use std::borrow::Cow;

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
    /// Issue 21: mid-stream the backend answered with a bare RST (its
    /// socket for the connection is gone: crashed or restarted).
    BackendRestarted,
    /// Right after the handshake the backend reset the connection before
    /// answering anything: its listener had no room in the accept queue.
    ListenQueueOverflow,
    /// Mid-stream the backend closed the connection (FIN) and reset the
    /// client's later data: the keep-alive race, or a process that exited.
    /// The socket was closed, not lost without a close.
    BackendClosed,
    /// Issue 21: mid-stream a DROP/REJECT rule of the node's filter table
    /// (NetworkPolicy, firewall) dropped the flow, named as written.
    DroppedByRule,
    /// Issue 24: NodePort / LB / external IP of an externalTrafficPolicy
    /// Local Service with no endpoint on this node: kube-proxy drops it.
    NoLocalEndpoints,
    /// Issue 24: a Cluster-policy NodePort / LB / external IP flow DNATed
    /// here left without the SNAT kube-proxy's external chain asks for.
    ExternalNotMasqueraded,
    /// Issue 22: DNATed by a conntrack entry to an address that is no longer
    /// among the Service's endpoints in kube-proxy's rules.
    StaleConntrackEntry,
    /// Issue 22: dropped by conntrack's confirmation after the last rule: a
    /// clashing entry (SNAT source-port collision, the DNS race).
    ConntrackInsertFailed,
    /// Issue 23: packets dropped as too big for a link, and the ICMP
    /// fragmentation-needed / packet-too-big never reached their sender.
    PmtuBlackhole,
    /// Issue 23: an ICMP error about the flow reached the client with its
    /// quoted header still naming the backend.
    IcmpErrorNotReverseNated,
    /// Issue 22: a new connection's first packet dropped at conntrack's own
    /// hook, before any NAT, while the table was at nf_conntrack_max.
    ConntrackTableFull,
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
    // Before conntrack_invalid: a netfilter drop mid-stream that a rule of
    // the filter table explains is that rule's, not INVALID's.
    CauseRow {
        id: CauseId::DroppedByRule,
        name: "dropped_by_rule",
        verdicts: &[Verdict::Dropped],
        check: super::checks::midstream::dropped_by_rule,
        incident: "issue 21: mid-stream a NetworkPolicy or firewall DROP/REJECT rule (a KUBE-NWPLCY-… chain, FORWARD) added after the connection opened drops its packets; the rule is named as iptables-save writes it (the filter rules are read again when the flow fails)",
        fix: "the named rule drops the connection: if the NetworkPolicy is intended, the connection is cut on purpose (clients reconnect and are refused); if not, fix the policy's selectors or ports (kubectl get networkpolicy -A; the CNI's policy logs) or remove the firewall rule (iptables -S <chain>)",
    },
    CauseRow {
        id: CauseId::ConntrackInvalid,
        name: "conntrack_invalid",
        verdicts: &[Verdict::ReplyNotReverseNated, Verdict::Dropped],
        check: super::checks::midstream::conntrack_invalid,
        incident: "issue 21: mid-stream the connection's conntrack entry is gone (conntrack -D/-F, a kube-proxy restart, a timeout with nf_conntrack_tcp_loose=0) or its packets fall out of the TCP window: INVALID, NAT skips them; kube-proxy's `KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP` drops them, or the reply reaches the client un-reverse-NATed and the client resets (kubernetes#74839). Which of the two is named from conntrack itself: the flow's entry looked up over ctnetlink in the node namespace when the flow failed (recorded as a `ct_entry` line) — gone: deleted, flushed or expired; in place with the opening's DNAT: the packet was out of the TCP window; replaced: picked up again mid-stream (nf_conntrack_tcp_loose=1) without the opening's NAT — with nf_conntrack_tcp_loose and nf_conntrack_tcp_be_liberal as read then",
        fix: "keep conntrack tracking long-lived connections: net.netfilter.nf_conntrack_tcp_be_liberal=1 (out-of-window packets stay ESTABLISHED; kube-proxy, iptables and nftables modes, reads it when it starts and installs no INVALID DROP rule while it is set: \"nf_conntrack_tcp_be_liberal set, not installing DROP rules for INVALID packets\", pkg/proxy/iptables/proxier.go NewProxier; nftables mode: setupNFTables adds `ct state invalid drop` to its `forward` chain under the same condition — restart kube-proxy after setting it) and nf_conntrack_tcp_loose=1 (the default: a mid-stream packet picks an entry up again); do not flush entries of live connections (conntrack -F/-D); `conntrack -S` shows the invalid counter",
    },
    CauseRow {
        id: CauseId::ReplyBridgedWithoutNetfilter,
        name: "reply_bridged_without_netfilter",
        verdicts: &[Verdict::ReplyNotReverseNated],
        check: bridged_reply_sysctl_on,
        incident: "seed 000 evidence although bridge-nf-call-iptables read 1 (changed, or another namespace owns the bridge)",
        fix: "check net.bridge.bridge-nf-call-iptables (ip6tables for IPv6) in the namespace that owns the bridge (it must be 1) and that br_netfilter is loaded",
    },
    // Before the drop and path causes: the ICMP error says what the drop
    // or the missing reply alone cannot (issue 23).
    CauseRow {
        id: CauseId::IcmpErrorNotReverseNated,
        name: "icmp_error_not_reverse_nated",
        verdicts: &[Verdict::Dropped, Verdict::NoReply],
        check: super::checks::icmp::icmp_error_not_reverse_nated,
        incident: "an ICMP error about the flow (fragmentation needed, host or port unreachable) reaches the client with its quoted header still carrying the backend's address: the client's stack discards it",
        fix: "make the error pass conntrack's NAT on its way back like the connection's replies (nf_nat_icmp_reply_translation): the same path as the replies (bridge-nf-call-iptables=1 for bridged pods, no NOTRACK/raw-table exemption for ICMP, symmetric routing through the DNATing node)",
    },
    CauseRow {
        id: CauseId::PmtuBlackhole,
        name: "pmtu_blackhole",
        verdicts: &[Verdict::Dropped, Verdict::NoReply],
        check: super::checks::icmp::pmtu_blackhole,
        incident: "path-MTU black hole: the pods' MTU is larger than a link on the path (the overlay, the uplink) and the ICMP fragmentation needed / packet too big never reaches the sender (a rule drops it, rp_filter, no route): the handshake works, large transfers stall",
        fix: "set the CNI's MTU to what the path carries (the overlay's MTU minus its header: vxlan 50 bytes; compare `ip link` of the pod veths, cni0/flannel.1 and the uplink, or run `nattrace doctor`), or let the error through: allow ICMP type 3 code 4 (iptables -p icmp --icmp-type fragmentation-needed) and ICMPv6 type 2 (packet-too-big) in every firewall on the path",
    },
    // Before backend_unreachable, whose evidence (a DNAT to a gone pod) it
    // shares: there the rule still DNATs to the pod, here only the entry.
    CauseRow {
        id: CauseId::StaleConntrackEntry,
        name: "stale_conntrack_entry",
        verdicts: &[Verdict::NoReply, Verdict::Dropped],
        check: super::checks::stale_entry::stale_conntrack_entry,
        incident: "issue 22: stale conntrack entry after an endpoint change: a client that keeps its source port (UDP, DNS, statsd) or a TCP entry that outlived its pod is still DNATed to the old backend, which kube-proxy's rules no longer list",
        fix: "delete the stale entry in the node's network namespace with the `conntrack -D -p <proto> --orig-src … --orig-port-src … --orig-dst <Service IP> --orig-port-dst <port> --reply-src <stale backend>` command printed for the flow; kube-proxy normally deletes UDP entries to removed endpoints (pkg/proxy/conntrack/cleanup.go), never TCP ones",
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
    // Before backend_port_closed: a RST after an `ok` opening is no closed port.
    CauseRow {
        id: CauseId::BackendClosed,
        name: "backend_closed",
        verdicts: &[Verdict::Refused],
        check: super::checks::midstream::backend_closed,
        incident: "mid-stream the backend closed the connection (its FIN passed the node) and the client wrote after: the backend's kernel resets data sent to a closed socket (RFC 1122), the client gets ECONNRESET or EPIPE — the keep-alive race (a server idle timeout shorter than the client's connection pool's; found in the bench's iperf3 runs), or the server's process exited and its kernel closed its sockets",
        fix: "not a network or kube-proxy fault: the server ends connections the client still uses — make the client's idle timeout for pooled connections shorter than the server's keep-alive timeout (or have the server send `Connection: close` / HTTP/2 GOAWAY first), and retry idempotent requests on a reset of a reused connection; if the backend pod restarted at that time (kubectl get pod: RESTARTS), its process exiting closed the connection: see backend_restarted's fix",
    },
    // Before backend_restarted: the same bare RST, before the backend sent a byte.
    CauseRow {
        id: CauseId::ListenQueueOverflow,
        name: "listen_queue_overflow",
        verdicts: &[Verdict::Refused, Verdict::Dropped, Verdict::NoReply],
        check: super::checks::midstream::listen_queue_overflow,
        incident: "the handshake completed but the backend's listener had no room left in its accept queue (a server that does not accept() as fast as connections come): with net.ipv4.tcp_abort_on_overflow=1 it resets the client's first segment (a bare RST within 1 s, nothing answered before; reported `ok` until the opening stopped taking a reset within its settle time as its own evidence), the client's first read fails with ECONNRESET; at 0, the default, it drops the segment (TCP_LISTEN_OVERFLOW) and the client's request hangs; a SYN that finds the queue full is dropped without a trace (no drop event: a SYN received in the backend's namespace and never answered), the client's connect() times out",
        fix: "the backend's server does not accept connections as fast as they come: in its pod, `nstat -az TcpExtListenOverflows TcpExtListenDrops` rises and `ss -ltn` shows the listener's Recv-Q at its backlog (Send-Q); raise the server's listen backlog and net.core.somaxconn in the pod, add replicas, or find what stalls its accept loop; net.ipv4.tcp_abort_on_overflow=1 makes these resets (at 0 the kernel drops the segment and the client retries, slower but without an error)",
    },
    CauseRow {
        id: CauseId::BackendRestarted,
        name: "backend_restarted",
        verdicts: &[Verdict::Refused],
        check: super::checks::midstream::backend_restarted,
        incident: "issue 21: mid-stream the backend lost the connection's socket (process crashed or restarted, pod replaced with the same address): the client's next segment gets a bare RST (NO_SOCKET without a listener), the client ECONNRESET; an application's own abort (SO_LINGER 0, RST|ACK) and a normal close are not failures",
        fix: "the backend lost the connection: check the backend pod's restarts and why (kubectl get pod: RESTARTS; kubectl describe pod: OOMKilled, liveness probe failures; the previous container's logs: kubectl logs --previous); drain connections before a pod stops (preStop hook, terminationGracePeriodSeconds), and make clients of long-lived connections reconnect on ECONNRESET",
    },
    CauseRow {
        id: CauseId::BackendPortClosed,
        name: "backend_port_closed",
        verdicts: &[Verdict::Refused],
        check: backend_port_closed,
        incident: "backend pod alive but nothing listens on the target port: it answers with RST",
        fix: "the backend pod runs but nothing listens on the port: check the Service's targetPort against the container's port, the container's logs and its readiness probe (a pod should not be ready before it listens)",
    },
    // Before no_reply_through_node: the same evidence, but kube-proxy asked
    // for the SNAT that would have brought the reply back.
    CauseRow {
        id: CauseId::ExternalNotMasqueraded,
        name: "external_not_masqueraded",
        verdicts: &[Verdict::NoReply],
        check: super::checks::north_south::external_not_masqueraded,
        incident: "issue 24: NodePort / LoadBalancer / external IP with externalTrafficPolicy: Cluster DNATed to another node's backend without the SNAT kube-proxy marks it for: the backend answers the outside client directly",
        fix: "restore kube-proxy's masquerade: the KUBE-POSTROUTING `-m mark --mark 0x4000/0x4000 -j MASQUERADE` rule (nftables: chain masquerading), and make sure nothing clears the 0x4000 mark between KUBE-EXT- and POSTROUTING (let kube-proxy resync its rules)",
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
        id: CauseId::NoLocalEndpoints,
        name: "no_local_endpoints",
        verdicts: &[Verdict::Dropped, Verdict::NoReply],
        check: super::checks::north_south::no_local_endpoints,
        incident: "issue 24: NodePort / LoadBalancer / external IP of an externalTrafficPolicy: Local Service, no endpoint on this node: kube-proxy's \"has no local endpoints\" DROP (filter KUBE-EXTERNAL-SERVICES, nftables no-endpoint-nodeports / no-endpoint-services), the client times out",
        fix: "run an endpoint of the Service on this node, or let the load balancer's health check on healthCheckNodePort take this node out (kube-proxy answers 503 there), or set externalTrafficPolicy: Cluster (the client's address is then masqueraded)",
    },
    // Before no_endpoints and dropped_by_netfilter, which share its drop
    // reason: this drop is before the first netfilter point, and the table
    // was full (checks/table_full.rs).
    CauseRow {
        id: CauseId::ConntrackTableFull,
        name: "conntrack_table_full",
        verdicts: &[Verdict::Dropped],
        check: super::checks::table_full::conntrack_table_full,
        incident: "issue 22: conntrack's table is full (kubernetes#18604): a new connection's first packet is dropped at conntrack's own PREROUTING/OUTPUT hook before any NAT (NETFILTER_DROP, \"nf_conntrack: table full, dropping packet\"), while nf_conntrack_count is at nf_conntrack_max or conntrack -S drop/early_drop rise; established connections go on",
        fix: "raise the limit: sysctl -w net.netfilter.nf_conntrack_max=<more> on the node (one limit for every namespace, set in the host's) and in kube-proxy, which sets it when it starts: --conntrack-max-per-core / conntrack.maxPerCore × CPUs, at least conntrack.min (cmd/kube-proxy/app/conntrack.go, getConntrackMax); find what fills the table: conntrack -L | awk '{for (i = 1; i <= NF; i++) if ($i ~ /^dst=/) { print $1, $i; break }}' | sort | uniq -c | sort -rn | head; shorten the timeouts that keep idle entries (net.netfilter.nf_conntrack_tcp_timeout_established, kube-proxy conntrack.tcpEstablishedTimeout; nf_conntrack_tcp_timeout_time_wait, nf_conntrack_udp_timeout); watch conntrack -S drop/early_drop",
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
    // Before dropped_by_netfilter: the same drop reason, but after the last
    // rule of the path (checks/insert_failed.rs).
    CauseRow {
        id: CauseId::ConntrackInsertFailed,
        name: "conntrack_insert_failed",
        verdicts: &[Verdict::Dropped],
        check: super::checks::insert_failed::conntrack_insert_failed,
        incident: "issue 22: conntrack drops a new connection's packet at confirmation, after every rule (NETFILTER_DROP after POSTROUTING's SNAT, insert_failed rises): a SNAT source-port collision (a small or exhausted masquerade port range), or the A/AAAA DNS race on kernels before 5.6",
        fix: "SNAT collisions: masquerade with fully random source ports (iptables -j MASQUERADE --random-fully; kube-proxy and most CNIs use it where the kernel has it, kubernetes PR #78547), widen the SNAT port range or add SNAT addresses; the DNS race (two queries from one socket on two CPUs): fixed by clash resolution in Linux 4.19 (ed07d9a021df, same NAT) and 5.6 (6a757c07e51f, different endpoints), else NodeLocal DNSCache, or resolv.conf options single-request-reopen / use-vc; watch `conntrack -S` insert_failed",
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
    /// The row's fix, or one made for this flow (the exact command).
    pub hint: Cow<'static, str>,
}

pub(crate) fn infer(ctx: &RuleCtx<'_>) -> Option<Cause> {
    // Most reports are `ok`, which no row names today: walking the table's
    // verdict lists to find that out cost ~480 instructions per healthy
    // connection (callgrind). Computed from the table, so a row for `ok`
    // added later is still asked.
    const OK_HAS_CAUSES: bool = names(Verdict::Ok);
    if !OK_HAS_CAUSES && ctx.verdict == Verdict::Ok {
        return None;
    }
    CAUSES
        .iter()
        .filter(|r| r.verdicts.contains(&ctx.verdict))
        .find_map(|r| {
            (r.check)(ctx).map(|(clause, text)| Cause {
                id: r.id,
                text,
                clause,
                hint: flow_fix(r.id, ctx).unwrap_or(Cow::Borrowed(r.fix)),
            })
        })
}

/// Whether a row of [`CAUSES`] applies to `v`.
const fn names(v: Verdict) -> bool {
    let mut i = 0;
    while i < CAUSES.len() {
        let verdicts = CAUSES[i].verdicts;
        let mut j = 0;
        while j < verdicts.len() {
            if verdicts[j] as u8 == v as u8 {
                return true;
            }
            j += 1;
        }
        i += 1;
    }
    false
}

/// A fix written for the flow, for the causes whose fix is a command only
/// the flow can fill in.
fn flow_fix(id: CauseId, ctx: &RuleCtx<'_>) -> Option<Cow<'static, str>> {
    match id {
        CauseId::StaleConntrackEntry => super::checks::stale_entry::fix(ctx),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::{CAUSES, Verdict, names};

    /// The const scan that lets `ok` reports skip the table agrees with the
    /// table, for every verdict.
    #[test]
    fn names_is_the_table() {
        for v in Verdict::ALL {
            let listed = CAUSES.iter().any(|r| r.verdicts.contains(&v));
            assert_eq!(names(v), listed, "{v:?}");
        }
    }
}
