//! A merged flow's verdict and cause, from every node's half. The
//! client-facing node (the one that DNATed the request, listed first) has
//! the last word on what the client got, unless the other nodes' hops tell
//! why: seed 003's reply leaving the backend's node straight to the client
//! while the DNATing node never sees it is one story, not two.
use std::net::SocketAddr;

use crate::collector::{Cause, CauseId, Dir, FlowReport, Hop, Name, PacketEvidence, Verdict};

pub(super) struct Decided {
    pub verdict: Verdict,
    pub cause: Option<Cause>,
    pub detail: String,
    /// The hop where the client got the reply, when another node's half
    /// showed it: (node, ts_ns) of that hop.
    pub judged: Option<(Name, u64)>,
}

/// `parts[0]` is the DNATing node's report; `packets` the merged evidence.
pub(super) fn decide(parts: &[(&Name, &FlowReport)], packets: &[PacketEvidence]) -> Decided {
    let (_, base) = parts[0];
    if let Some(d) = asymmetric_return_path(parts, packets) {
        return d;
    }
    // A drop another node saw explains a request that got no reply (or
    // whose opening this node did not see: the drop is positive evidence).
    if matches!(
        base.verdict,
        Verdict::NoReply | Verdict::Unseen | Verdict::Undecided
    ) && let Some((_, other)) = parts[1..]
        .iter()
        .find(|(_, r)| r.verdict == Verdict::Dropped)
    {
        return Decided {
            verdict: other.verdict,
            cause: other.cause.clone(),
            detail: other.detail.clone(),
            judged: None,
        };
    }
    Decided {
        verdict: base.verdict,
        cause: base.cause.clone(),
        detail: base.detail.clone(),
        judged: None,
    }
}

fn egress(h: &Hop) -> bool {
    h.node_ns && matches!(h.hook, "tc-egress" | "dev-tx")
}

fn ingress(h: &Hop) -> bool {
    h.node_ns && matches!(h.hook, "tc-ingress" | "dev-rx")
}

fn on<'a>(h: &'a Hop, node: &Name) -> Option<&'a Hop> {
    (h.node.as_ref() == Some(node)).then_some(h)
}

fn ifname(h: &Hop) -> String {
    h.ifname
        .as_ref()
        .map_or_else(|| format!("if{}", h.ifindex), ToString::to_string)
}

/// Seed 003 from both ends: the DNATing node sent the request on to another
/// node, that node delivered it to the backend and sent the reply out with
/// the backend's address straight towards the client, and the DNATing node
/// — which holds the conntrack entry that would reverse the NAT — saw no
/// reply at all.
fn asymmetric_return_path(
    parts: &[(&Name, &FlowReport)],
    packets: &[PacketEvidence],
) -> Option<Decided> {
    let (dnat_node, base) = parts[0];
    let backend: SocketAddr = base.backend?;
    // The other node's reply leaving straight to the client is positive
    // evidence, also for a half cut by the stop.
    if !matches!(
        base.verdict,
        Verdict::NoReply | Verdict::ReplyNotReverseNated | Verdict::Undecided
    ) {
        return None;
    }
    let hops = |dir: Dir| {
        packets
            .iter()
            .filter(move |p| p.dir == dir)
            .flat_map(move |p| p.hops.iter().map(move |h| (p, h)))
    };
    if hops(Dir::Reply).any(|(_, h)| h.node_ns && on(h, dnat_node).is_some()) {
        return None;
    }
    let (request, sent) = hops(Dir::Request)
        .find(|(_, h)| egress(h) && h.dst == backend && on(h, dnat_node).is_some())?;
    let at = hops(Dir::Request)
        .find(|(_, h)| {
            on(h, dnat_node).is_some() && h.nat_stage == Some("after-nat") && h.dst == backend
        })
        .and_then(|(_, h)| h.nf_hook)
        .map(|nf| format!(" at {nf}"))
        .unwrap_or_default();
    let (reply, left) = hops(Dir::Reply).rfind(|(_, h)| {
        egress(h) && h.node.as_ref() != Some(dnat_node) && h.src == backend && h.dst == base.client
    })?;
    let other = left.node.clone()?;
    let came_in = hops(Dir::Request)
        .find(|(_, h)| ingress(h) && h.dst == backend && on(h, &other).is_some())
        .map(|(_, h)| format!(" by {}", ifname(h)))
        .unwrap_or_default();
    let text = format!(
        "{dnat_node} DNATed the {} to {backend}{at} and sent it to {other} by {}; {other} received it{came_in} and delivered it to the backend, and the {} left {other} by {} with source {backend} straight towards the client {}, never passing back through {dnat_node}, which holds the connection's conntrack entry: the reply was never reverse-NATed to {} (asymmetric return path)",
        request.kind,
        ifname(sent),
        reply.kind,
        ifname(left),
        base.client,
        base.service,
    );
    let clause = format!(
        "the reply left {other} by {} straight to the client, bypassing {dnat_node}, which DNATed the request (asymmetric return path)",
        ifname(left)
    );
    // What the client got, where any recording saw the client's own
    // namespace (the one its request was sent from): the reply arriving
    // there with another source than the Service's.
    let client_ns = hops(Dir::Request)
        .find(|(_, h)| !h.node_ns && h.hook == "dev-tx" && h.src == base.client)
        .map(|(_, h)| h.netns);
    let judged = hops(Dir::Reply).find(|(_, h)| {
        !h.node_ns
            && Some(h.netns) == client_ns
            && h.hook == "dev-rx"
            && h.dst == base.client
            && h.src != base.service
    });
    let unnated = judged.is_some()
        || parts
            .iter()
            .any(|(_, r)| r.verdict == Verdict::ReplyNotReverseNated);
    let (verdict, head) = if unnated {
        (
            Verdict::ReplyNotReverseNated,
            format!(
                "{} reached the client with source {backend} instead of {}",
                reply.kind, base.service
            ),
        )
    } else {
        (
            Verdict::NoReply,
            format!(
                "{} DNATed to {backend} by {dnat_node}; no reply came back through {dnat_node}",
                request.kind
            ),
        )
    };
    Some(Decided {
        verdict,
        judged: judged.and_then(|(_, h)| Some((h.node.clone()?, h.ts_ns))),
        detail: format!("{head}; {clause}"),
        cause: Some(Cause {
            id: CauseId::AsymmetricReturnPath,
            text,
            clause,
            hint: CauseId::AsymmetricReturnPath.hint().into(),
        }),
    })
}
