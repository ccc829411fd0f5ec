//! Causes: why a flow got its verdict, as a table of rules. Each rule looks
//! at one decided flow (its evidence plus the node facts) and either names a
//! cause or passes; the first rule that matches wins, so more specific rules
//! come first. New incidents (issue 4: hairpin_mode off, missing masquerade,
//! ...) add a `CauseId` variant with its hint and one `Rule` entry.
use serde::Serialize;
use tracer_common::{hook, nat_stage, nf_hook};

use super::{
    backend_rules::{backend_port_closed, backend_unreachable},
    drop_reason::{DropReasons, KnownReasons},
    flow::Flow,
    ifnames::IfNames,
    path_rules::{bridge_of, hairpin_mode_off, hairpin_not_masqueraded, reply_bypasses_dnat_node},
    report::Verdict,
    types::{Dir, Obs, Proto, node_egress, node_ingress, packet_kind},
};
use crate::{facts::NodeFacts, ruleset::KubeProxyRules};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
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
}

impl CauseId {
    pub const ALL: &'static [CauseId] = &[
        CauseId::ReplyBypassesDnatNode,
        CauseId::HairpinNotMasqueraded,
        CauseId::HairpinModeOff,
        CauseId::BridgeNfCallIptablesOff,
        CauseId::BridgeNfCallIp6tablesOff,
        CauseId::ReplyBridgedWithoutNetfilter,
        CauseId::NoReplyThroughNode,
        CauseId::NoEndpoints,
        CauseId::NotDnated,
        CauseId::DroppedByNetfilter,
        CauseId::DroppedByRpFilter,
        CauseId::ServiceNotNetfilter,
        CauseId::BackendUnreachable,
        CauseId::BackendPortClosed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CauseId::ServiceNotNetfilter => "service_not_netfilter",
            CauseId::ReplyBypassesDnatNode => "reply_bypasses_dnat_node",
            CauseId::HairpinNotMasqueraded => "hairpin_not_masqueraded",
            CauseId::HairpinModeOff => "hairpin_mode_off",
            CauseId::BridgeNfCallIptablesOff => "bridge_nf_call_iptables_off",
            CauseId::BridgeNfCallIp6tablesOff => "bridge_nf_call_ip6tables_off",
            CauseId::ReplyBridgedWithoutNetfilter => "reply_bridged_without_netfilter",
            CauseId::NoReplyThroughNode => "no_reply_through_node",
            CauseId::NoEndpoints => "no_endpoints",
            CauseId::NotDnated => "not_dnated",
            CauseId::DroppedByNetfilter => "dropped_by_netfilter",
            CauseId::DroppedByRpFilter => "dropped_by_rp_filter",
            CauseId::BackendUnreachable => "backend_unreachable",
            CauseId::BackendPortClosed => "backend_port_closed",
        }
    }

    pub fn hint(self) -> &'static str {
        match self {
            CauseId::ServiceNotNetfilter => {
                "follow the Service with the data plane's own tools (ipvsadm -Ln --stats; cilium-dbg service list, bpftool map dump): nattrace judges netfilter NAT only"
            }
            CauseId::ReplyBypassesDnatNode => {
                "make replies return through the node that DNATed the request: kube-proxy masqueradeAll: true on the nodes the traffic enters by (or externalTrafficPolicy: Cluster), or route the Service CIDR so requests enter where the backend runs"
            }
            CauseId::HairpinNotMasqueraded => {
                "restore kube-proxy's KUBE-SEP rule `-s <podIP>/32 -j KUBE-MARK-MASQ` (let kube-proxy resync its rules), or set masqueradeAll: true"
            }
            CauseId::HairpinModeOff => {
                "turn hairpin mode on for pod bridge ports: kubelet --hairpin-mode=hairpin-veth (or promiscuous-bridge), or the CNI bridge plugin's \"hairpinMode\": true; now: ip link set <port> type bridge_slave hairpin on"
            }
            CauseId::BridgeNfCallIptablesOff => {
                "load br_netfilter and set net.bridge.bridge-nf-call-iptables=1 in the node namespace (before kubelet starts)"
            }
            CauseId::BridgeNfCallIp6tablesOff => {
                "load br_netfilter and set net.bridge.bridge-nf-call-ip6tables=1 in the node namespace (before kubelet starts)"
            }
            CauseId::ReplyBridgedWithoutNetfilter => {
                "check net.bridge.bridge-nf-call-iptables (ip6tables for IPv6) in the namespace that owns the bridge (it must be 1) and that br_netfilter is loaded"
            }
            CauseId::NoReplyThroughNode => {
                "make replies return through the DNATing node: SNAT here (kube-proxy masqueradeAll: true, or externalTrafficPolicy: Cluster), or route the Service CIDR to the backend's node"
            }
            CauseId::NoEndpoints => {
                "the Service has no ready endpoints: check its EndpointSlices (kubectl get endpointslices -n <namespace> -l kubernetes.io/service-name=<name>), that its selector matches running pods and that they pass their readiness probes"
            }
            CauseId::NotDnated => {
                "check that the Service has ready endpoints (kubectl get endpointslices) and that kube-proxy programmed its rules (iptables-save | grep the Service IP)"
            }
            CauseId::DroppedByNetfilter => {
                "find the DROP/REJECT rule on that hook: iptables-save / nft list ruleset (NetworkPolicy, KUBE-FIREWALL, KUBE-FORWARD chains)"
            }
            CauseId::DroppedByRpFilter => {
                "reverse-path filtering dropped it: fix the return route, or set net.ipv4.conf.<interface>.rp_filter=2 (loose)"
            }
            CauseId::BackendUnreachable => {
                "the endpoint is stale: check `kubectl get endpointslices` for the Service (is the backend's address still listed?), and the backend pod's readiness and termination (kubectl get pod -o wide, describe: deleted, evicted, node gone?); kube-proxy drops the KUBE-SEP rule once the endpoint is removed"
            }
            CauseId::BackendPortClosed => {
                "the backend pod runs but nothing listens on the port: check the Service's targetPort against the container's port, the container's logs and its readiness probe (a pod should not be ready before it listens)"
            }
        }
    }
}

impl CauseId {
    /// The incident behind the cause, for the README's table.
    pub fn incident(self) -> &'static str {
        match self {
            CauseId::ServiceNotNetfilter => {
                "Service load-balanced by IPVS (kube-ipvs0) or an eBPF data plane (Cilium, Calico), not netfilter"
            }
            CauseId::ReplyBypassesDnatNode => {
                "seed 003 seen from the backend's node: request arrives already DNATed, reply leaves with the pod's address"
            }
            CauseId::HairpinNotMasqueraded => {
                "seed 004 case 3: pod → own Service → itself, KUBE-SEP's masquerade rule missing"
            }
            CauseId::HairpinModeOff => {
                "seed 004 case 3: pod → own Service → itself, bridge port hairpin_mode off"
            }
            CauseId::BridgeNfCallIptablesOff => {
                "seed 000/001: same-node reply bridged past netfilter (br_netfilter off), TCP or DNS"
            }
            CauseId::BridgeNfCallIp6tablesOff => {
                "seed 000/001 over IPv6: same-node reply bridged past ip6tables (bridge-nf-call-ip6tables=0), TCP or DNS"
            }
            CauseId::ReplyBridgedWithoutNetfilter => {
                "seed 000 evidence although bridge-nf-call-iptables read 1 (changed, or another namespace owns the bridge)"
            }
            CauseId::NoReplyThroughNode => {
                "seed 003 seen from the DNATing node: asymmetric return path"
            }
            CauseId::NoEndpoints => {
                "Service without endpoints: kube-proxy's REJECT answers ICMP port unreachable (curl: connection refused)"
            }
            CauseId::NotDnated => "Service without endpoints / rules not programmed",
            CauseId::DroppedByNetfilter => "a DROP/REJECT rule (NetworkPolicy, firewall)",
            CauseId::DroppedByRpFilter => "reverse-path filter drops an asymmetric packet",
            CauseId::BackendUnreachable => {
                "stale endpoint: backend pod deleted or unreachable, its KUBE-SEP rule still in place (neighbour resolution fails, the bridge has no port for its MAC, or no route to it)"
            }
            CauseId::BackendPortClosed => {
                "backend pod alive but nothing listens on the target port: it answers with RST"
            }
        }
    }

    /// The verdicts this cause explains.
    pub fn verdicts(self) -> &'static [Verdict] {
        RULES
            .iter()
            .find(|r| r.id == self)
            .map_or(&[], |r| r.verdicts)
    }
}

/// The README's "What nattrace recognises" table, one row per cause.
pub fn markdown_table() -> String {
    let mut out = String::from("| incident | verdict | cause | fix |\n|---|---|---|---|\n");
    for id in CauseId::ALL {
        let verdicts: Vec<String> = id
            .verdicts()
            .iter()
            .map(|v| format!("`{}`", v.as_str()))
            .collect();
        out.push_str(&format!(
            "| {} | {} | `{}` | {} |\n",
            id.incident(),
            verdicts.join(" / "),
            id.as_str(),
            id.hint().replace('|', "\\|")
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

pub(crate) struct RuleCtx<'a> {
    pub flow: &'a Flow,
    pub verdict: Verdict,
    pub facts: &'a NodeFacts,
    pub known: &'a KnownReasons,
    pub node_netns: u32,
    pub reply_timeout_ns: u64,
    /// The first real drop of the flow (dropped verdict).
    pub drop: Option<&'a Obs>,
    pub kube: &'a KubeProxyRules,
    pub ifnames: &'a IfNames,
    /// Drop reason names, for the cause texts.
    pub reasons: &'a DropReasons,
    /// When the verdict is being decided (event time).
    pub decided_ts: u64,
}

impl RuleCtx<'_> {
    pub(super) fn first_request_kind(&self) -> &'static str {
        first_request_kind(self)
    }

    pub(super) fn is_node(&self, netns: u32) -> bool {
        netns == 0 || netns == self.node_netns
    }

    pub(super) fn kind(&self, packet: u8) -> &'static str {
        let p = &self.flow.packets[packet as usize];
        packet_kind(p.key.proto, p.key.tcp_flags, p.dir)
    }

    pub(super) fn reason(&self, value: u32) -> String {
        self.reasons
            .name(value)
            .map_or_else(|| format!("reason {value}"), |n| n.to_string())
    }

    /// The name of a node interface (`if<N>` if unknown).
    pub(super) fn ifname(&self, ifindex: u32) -> String {
        self.ifnames.describe(self.node_netns, ifindex)
    }
}

/// (short clause, full text)
type Found = (String, String);

struct Rule {
    id: CauseId,
    verdicts: &'static [Verdict],
    check: fn(&RuleCtx<'_>) -> Option<Found>,
}

const RULES: &[Rule] = &[
    // First: every NAT-based cause below would mislead for such a Service.
    Rule {
        id: CauseId::ServiceNotNetfilter,
        verdicts: &[
            Verdict::ReplyNotReverseNated,
            Verdict::NoReply,
            Verdict::Dropped,
            Verdict::Refused,
        ],
        check: service_not_netfilter,
    },
    Rule {
        id: CauseId::ReplyBypassesDnatNode,
        verdicts: &[Verdict::ReplyNotReverseNated],
        check: reply_bypasses_dnat_node,
    },
    Rule {
        id: CauseId::HairpinNotMasqueraded,
        verdicts: &[Verdict::ReplyNotReverseNated, Verdict::Dropped],
        check: hairpin_not_masqueraded,
    },
    Rule {
        id: CauseId::HairpinModeOff,
        verdicts: &[Verdict::NoReply, Verdict::Dropped],
        check: hairpin_mode_off,
    },
    Rule {
        id: CauseId::BridgeNfCallIptablesOff,
        verdicts: &[Verdict::ReplyNotReverseNated],
        check: bridged_reply_sysctl_off,
    },
    Rule {
        id: CauseId::BridgeNfCallIp6tablesOff,
        verdicts: &[Verdict::ReplyNotReverseNated],
        check: super::ip6_rules::bridged_reply6_sysctl_off,
    },
    Rule {
        id: CauseId::ReplyBridgedWithoutNetfilter,
        verdicts: &[Verdict::ReplyNotReverseNated],
        check: bridged_reply_sysctl_on,
    },
    // Before the path causes below: a request that never left the node, or
    // was flooded because its backend's MAC is gone, is no routing problem.
    Rule {
        id: CauseId::BackendUnreachable,
        verdicts: &[Verdict::NoReply, Verdict::Dropped],
        check: backend_unreachable,
    },
    Rule {
        id: CauseId::BackendPortClosed,
        verdicts: &[Verdict::Refused],
        check: backend_port_closed,
    },
    Rule {
        id: CauseId::NoReplyThroughNode,
        verdicts: &[Verdict::NoReply],
        check: no_reply_through_node,
    },
    Rule {
        id: CauseId::NoEndpoints,
        verdicts: &[Verdict::Dropped, Verdict::NoReply],
        check: no_endpoints,
    },
    Rule {
        id: CauseId::NotDnated,
        verdicts: &[Verdict::NoReply],
        check: not_dnated,
    },
    Rule {
        id: CauseId::DroppedByNetfilter,
        verdicts: &[Verdict::Dropped],
        check: dropped_by_netfilter,
    },
    Rule {
        id: CauseId::DroppedByRpFilter,
        verdicts: &[Verdict::Dropped],
        check: dropped_by_rp_filter,
    },
];

pub(crate) fn infer(ctx: &RuleCtx<'_>) -> Option<Cause> {
    RULES
        .iter()
        .filter(|r| r.verdicts.contains(&ctx.verdict))
        .find_map(|r| {
            (r.check)(ctx).map(|(clause, text)| Cause {
                id: r.id,
                text,
                clause,
                hint: r.id.hint(),
            })
        })
}

/// The reply that reached the client entered a bridge port and left by
/// another port of the same bridge, and no netfilter hook saw it.
pub(super) fn bridged_reply(ctx: &RuleCtx<'_>) -> Option<Found> {
    let reply = ctx.flow.client_reply?;
    let obs: Vec<&Obs> = ctx.flow.packet_obs(reply.packet).collect();
    if obs.iter().any(|o| o.hook == hook::NETFILTER) {
        return None;
    }
    let port_of = |o: &&Obs, is: fn(u8) -> bool| {
        (is(o.hook) && ctx.is_node(o.netns))
            .then(|| bridge_of(ctx.facts, o.ifindex))
            .flatten()
            .map(|m| (o.ifindex, m))
    };
    let (in_port, bridge) = obs.iter().find_map(|o| port_of(o, node_ingress))?;
    let out_port = obs
        .iter()
        .filter_map(|o| port_of(o, node_egress))
        .find(|&(i, m)| m == bridge && i != in_port)
        .map(|(i, _)| i);
    let bridged_by_kprobe = obs.iter().any(|o| o.hook == hook::BR_FORWARD);
    if out_port.is_none() && !bridged_by_kprobe {
        return None;
    }
    let br = ctx.ifname(bridge);
    let to = out_port
        .map(|i| format!(" to {}", ctx.ifname(i)))
        .unwrap_or_default();
    let clause = format!("it crossed {br} without passing netfilter");
    let text = format!(
        "the {} crossed the bridge {br} from {}{to} without passing any netfilter hook",
        ctx.kind(reply.packet),
        ctx.ifname(in_port)
    );
    Some((clause, text))
}

fn bridged_reply_sysctl_off(ctx: &RuleCtx<'_>) -> Option<Found> {
    // IPv6 frames obey bridge-nf-call-ip6tables instead (ip6_rules).
    if ctx.facts.bridge_passes_netfilter() || ctx.flow.service.addr.is_ipv6() {
        return None;
    }
    let (clause, text) = bridged_reply(ctx)?;
    let why = match ctx.facts.bridge_nf_call_iptables {
        None => "br_netfilter is not loaded (no net.bridge.bridge-nf-call-iptables)",
        _ => "net.bridge.bridge-nf-call-iptables is 0",
    };
    Some((
        clause,
        format!("{text}; {why} in namespace {}", ctx.facts.netns_name),
    ))
}

fn bridged_reply_sysctl_on(ctx: &RuleCtx<'_>) -> Option<Found> {
    let (clause, text) = bridged_reply(ctx)?;
    let knob = if ctx.flow.service.addr.is_ipv6() {
        "bridge-nf-call-ip6tables"
    } else {
        "bridge-nf-call-iptables"
    };
    Some((
        clause,
        format!(
            "{text}, although net.bridge.{knob} was 1 in namespace {} at start (changed since, or another namespace owns the bridge?)",
            ctx.facts.netns_name
        ),
    ))
}

fn first_request_kind(ctx: &RuleCtx<'_>) -> &'static str {
    ctx.flow
        .packets
        .iter()
        .position(|p| p.dir == Dir::Request)
        .map_or("request", |i| ctx.kind(i as u8))
}

fn no_reply_through_node(ctx: &RuleCtx<'_>) -> Option<Found> {
    let backend = ctx.flow.backend?;
    // An asymmetric return path needs a request that left the node; one
    // that never did (held for neighbour resolution) is no routing problem.
    let left = ctx.flow.obs.iter().any(|o| {
        ctx.flow.packets[o.packet as usize].dir == Dir::Request
            && ctx.is_node(o.netns)
            && node_egress(o.hook)
    });
    if !left {
        return None;
    }
    // Decided before a neighbour failure on the way could have been
    // reported (tracing stopped): the backend may just be gone.
    if super::backend_rules::hold_until(ctx.flow, ctx.node_netns, ctx.known)
        .is_some_and(|t| ctx.decided_ts < t)
    {
        return None;
    }
    if ctx
        .flow
        .packets
        .iter()
        .any(|p| p.dir == Dir::Reply && p.in_node)
    {
        return None;
    }
    // Seen by the global tracepoints only: the reply took another way.
    let elsewhere = ctx
        .flow
        .obs
        .iter()
        .find(|o| {
            ctx.flow.packets[o.packet as usize].dir == Dir::Reply
                && o.dst == ctx.flow.client
                && o.hook == hook::DEV_RX
        })
        .map(|o| {
            format!(
                "; the client got a {} from {} by another path",
                ctx.kind(o.packet),
                o.src
            )
        })
        .unwrap_or_default();
    let at = ctx
        .flow
        .obs
        .iter()
        .find(|o| o.dst == backend && o.hook == hook::NETFILTER)
        .map(|o| format!(" at {}", nf_hook::name(o.nf_hook)))
        .unwrap_or_default();
    Some((
        "DNATed here, the reply never came back through this node".to_string(),
        format!(
            "the {} was DNATed here to {backend}{at}, but no reply came back through this node within {} ms (asymmetric return path){elsewhere}",
            first_request_kind(ctx),
            ctx.reply_timeout_ns / 1_000_000
        ),
    ))
}

/// Not DNATed, and kube-proxy's ruleset REJECTs this Service IP:port for
/// having no endpoints. REJECT answers with ICMP port unreachable and
/// returns NF_DROP, so the kernel frees the request with reason
/// NETFILTER_DROP (net/netfilter/core.c, nf_hook_slow).
fn no_endpoints(ctx: &RuleCtx<'_>) -> Option<Found> {
    if ctx.flow.backend.is_some() {
        return None;
    }
    let proto = Proto::from_raw(ctx.flow.proto)?;
    let reject = ctx
        .kube
        .no_endpoints_for(ctx.flow.service.socket_addr(), proto.as_str())?;
    let what = first_request_kind(ctx);
    let how = match ctx.drop {
        Some(drop) if Some(drop.drop_reason) == ctx.known.netfilter_drop => format!(
            "netfilter dropped the {what} {} and kube-proxy's REJECT answered with ICMP port unreachable (the client sees \"connection refused\")",
            drop_place(ctx.flow, drop, ctx.ifnames)
        ),
        Some(_) => return None,
        None => format!("the {what} was never DNATed and got no reply"),
    };
    let (namespace, name) = reject
        .port_name
        .split_once('/')
        .map(|(ns, rest)| (ns, rest.rsplit_once(':').map_or(rest, |(n, _)| n)))
        .unwrap_or(("<namespace>", &reject.port_name));
    Some((
        format!("{} has no endpoints", reject.port_name),
        format!(
            "{} ({}) has no endpoints: {how}; rejected by `{}`; check kubectl get endpointslices -n {namespace} -l kubernetes.io/service-name={name}",
            reject.port_name, ctx.flow.service, reject.rule
        ),
    ))
}

fn service_not_netfilter(ctx: &RuleCtx<'_>) -> Option<Found> {
    let ip = ctx.flow.service.addr;
    let by = ctx
        .kube
        .outside_netfilter
        .iter()
        .find(|o| o.ip == ip)
        .map(|o| o.by.as_str())?;
    Some((
        format!("{ip} is translated by {by}, not netfilter"),
        format!(
            "{ip} is translated on this node by {by}, not by netfilter NAT: nattrace saw the packets but cannot judge that NAT, so this verdict does not say why the Service failed"
        ),
    ))
}

fn not_dnated(ctx: &RuleCtx<'_>) -> Option<Found> {
    if ctx.flow.backend.is_some() {
        return None;
    }
    let o = ctx.flow.obs.iter().find(|o| {
        o.hook == hook::NETFILTER
            && o.nat_stage == nat_stage::AFTER
            && matches!(o.nf_hook, nf_hook::PRE_ROUTING | nf_hook::LOCAL_OUT)
            && o.dst == ctx.flow.service
    })?;
    Some((
        "no DNAT rule matched".to_string(),
        format!(
            "the {} passed the nat table at {} with destination still {}: no DNAT rule matched on this node",
            first_request_kind(ctx),
            nf_hook::name(o.nf_hook),
            ctx.flow.service
        ),
    ))
}

/// Where a dropped packet was last seen before the drop, e.g. "after netfilter FORWARD".
pub(crate) fn drop_place(flow: &Flow, drop: &Obs, ifnames: &IfNames) -> String {
    let before = flow
        .obs
        .iter()
        .filter(|o| o.packet == drop.packet && o.ts_ns <= drop.ts_ns && o.hook != hook::DROP)
        .max_by_key(|o| o.ts_ns);
    match before {
        Some(o) if o.hook == hook::NETFILTER => {
            format!("after netfilter {}", nf_hook::name(o.nf_hook))
        }
        Some(o) if o.ifindex == 0 => format!("after {}", hook::name(o.hook)),
        Some(o) => format!(
            "after {} on {}",
            hook::name(o.hook),
            ifnames.describe(o.netns, o.ifindex)
        ),
        None => "before any other observation point".to_string(),
    }
}

fn dropped_with(ctx: &RuleCtx<'_>, reason: Option<u32>, by: &str) -> Option<Found> {
    let drop = ctx.drop?;
    if reason != Some(drop.drop_reason) {
        return None;
    }
    let ns = if ctx.is_node(drop.netns) {
        format!("the node namespace {}", ctx.facts.netns_name)
    } else {
        format!("namespace {}", drop.netns)
    };
    let place = drop_place(ctx.flow, drop, ctx.ifnames);
    Some((
        format!("{by} dropped it"),
        format!(
            "{by} dropped the {} in {ns} {place} ({} → {})",
            ctx.kind(drop.packet),
            drop.src,
            drop.dst
        ),
    ))
}

fn dropped_by_netfilter(ctx: &RuleCtx<'_>) -> Option<Found> {
    dropped_with(ctx, ctx.known.netfilter_drop, "a netfilter rule")
}

fn dropped_by_rp_filter(ctx: &RuleCtx<'_>) -> Option<Found> {
    dropped_with(ctx, ctx.known.rp_filter, "reverse-path filtering")
}
