//! One story across nodes (issue 14): recordings of several nodes, each
//! decided by its own collector, merged into cross-node flows. Pure: the
//! records come in as values, the flows go out as [`FlowReport`]s whose hops
//! carry their node, so every output (text, JSON, pcapng) shows them.
//!
//! The same packet is recognised on each node by what neither NAT nor the
//! overlay rewrites: TCP flags, seq/ack, IP id (and the DNS id). The nodes'
//! clocks are never compared: within a node, hops keep that node's order;
//! across nodes, a request goes through the node that DNATed it first and a
//! reply through it last. Verdict and cause are decided from both halves
//! ([`verdict`]).
//!
//! When the nodes share a kernel (labs, kind), each recording also holds the
//! other nodes' device-tracepoint events (raw tracepoints are global): a
//! hop in another recorded node's namespace is left to that node's own
//! recording, and a hop in a third namespace recorded twice is kept once,
//! with the node whose own hops of that packet are nearest in time (an
//! identical event in two recordings proves one shared clock).
mod verdict;

#[cfg(test)]
mod tests;

use std::collections::HashMap;

use crate::{
    collector::{Dir, FlowReport, Hop, Name, PacketEvidence, Summary},
    recording::{
        Header, RecordingError,
        replay::{Records, replay},
    },
};

/// One node's decided flows.
pub struct NodeFlows {
    pub name: Name,
    /// Its namespace inode (how other recordings on the same kernel name it).
    pub netns_inode: u32,
    pub reports: Vec<FlowReport>,
    pub summary: Summary,
}

/// Decides one node's recording the way `analyze` of one file does
/// ([`replay`]: a tick at every `stats` record, finish at `end` or at the
/// last time seen, open flows incomplete without `end`).
pub fn decide_node(
    name: &str,
    header: &Header,
    records: &mut impl Records,
) -> Result<NodeFlows, RecordingError> {
    let mut reports = Vec::new();
    let done = replay(header.collector_config()?, records, None, |r| {
        reports.append(r);
        Ok::<_, std::convert::Infallible>(())
    });
    let Ok(done) = done;
    Ok(NodeFlows {
        name: Name(name.into()),
        netns_inode: header.facts.netns_inode,
        reports,
        summary: done.summary,
    })
}

/// What identifies one packet on every node it crosses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    tcp_flags: u8,
    seq: u32,
    ack: u32,
    ip_id: u16,
    dns_id: Option<u16>,
}

impl Key {
    fn of(p: &PacketEvidence) -> Self {
        Key {
            tcp_flags: p.tcp_flags,
            seq: p.seq,
            ack: p.ack,
            ip_id: p.ip_id,
            dns_id: p.dns_id,
        }
    }

    /// All zero (a UDP datagram with IP id 0): names no packet in particular.
    fn is_distinctive(&self) -> bool {
        self.seq != 0 || self.ack != 0 || self.ip_id != 0 || self.dns_id.is_some()
    }
}

/// (node, report) index.
type Ref = (usize, usize);

/// Every node's flows, merged: a flow seen on several nodes is one report
/// whose hops are labelled with their node; one seen on a single node is
/// that node's report, labelled.
pub fn merge(nodes: &[NodeFlows]) -> (Vec<FlowReport>, Summary) {
    let groups = group(nodes);
    let mut out: Vec<FlowReport> = groups.iter().map(|g| merge_group(nodes, g)).collect();
    // Output order only (each flow's time is its DNATing node's): nothing
    // is decided from comparing two nodes' clocks.
    out.sort_by_key(|r| r.first_ts_ns);
    let mut summary = Summary::default();
    for n in nodes {
        let s = &n.summary;
        summary.lost_events += s.lost_events;
        summary.skipped_runs += s.skipped_runs;
        summary.muted_packets += s.muted_packets;
        summary.events += s.events;
        summary.duplicate_events += s.duplicate_events;
        summary.late_events += s.late_events;
        summary.unmatched_events += s.unmatched_events;
        summary.evicted_flows += s.evicted_flows;
        summary.foreign_flows += s.foreign_flows;
        summary.buffered_flows += s.buffered_flows;
        summary.flushed_events += s.flushed_events;
        summary.pulled_events += s.pulled_events;
        summary.held_discarded += s.held_discarded;
        summary.held_spilled += s.held_spilled;
        summary.held_map_full += s.held_map_full;
    }
    for r in &out {
        summary.flows += 1;
        summary.by_verdict.add(r.verdict);
        summary.incomplete_flows += u64::from(r.incomplete);
    }
    (out, summary)
}

/// Reports of different nodes that share a packet are one flow (union-find).
fn group(nodes: &[NodeFlows]) -> Vec<Vec<Ref>> {
    let refs: Vec<Ref> = nodes
        .iter()
        .enumerate()
        .flat_map(|(n, nf)| (0..nf.reports.len()).map(move |r| (n, r)))
        .collect();
    let mut parent: Vec<usize> = (0..refs.len()).collect();
    fn root(parent: &mut [usize], mut i: usize) -> usize {
        while parent[i] != i {
            parent[i] = parent[parent[i]];
            i = parent[i];
        }
        i
    }
    let mut seen: HashMap<(crate::collector::Proto, Key), usize> = HashMap::new();
    for (i, &(n, r)) in refs.iter().enumerate() {
        let report = &nodes[n].reports[r];
        for p in &report.packets {
            let key = Key::of(p);
            if !key.is_distinctive() {
                continue;
            }
            match seen.get(&(report.proto, key)) {
                Some(&j)
                    if refs[j].0 != n
                        && compatible(report, &nodes[refs[j].0].reports[refs[j].1]) =>
                {
                    let (a, b) = (root(&mut parent, i), root(&mut parent, j));
                    parent[a] = b;
                }
                Some(_) => {}
                None => {
                    seen.insert((report.proto, key), i);
                }
            }
        }
    }
    let mut groups: HashMap<usize, Vec<Ref>> = HashMap::new();
    for (i, r) in refs.iter().enumerate() {
        groups.entry(root(&mut parent, i)).or_default().push(*r);
    }
    let mut out: Vec<Vec<Ref>> = groups.into_values().collect();
    out.sort();
    out
}

/// Two nodes' reports of one connection agree on the backend when both know it.
fn compatible(a: &FlowReport, b: &FlowReport) -> bool {
    match (a.backend, b.backend) {
        (Some(x), Some(y)) => x == y,
        _ => true,
    }
}

/// The node that DNATed the request: it saw it in its own namespace still
/// addressed to the Service. Else the first node given.
fn dnat_part(nodes: &[NodeFlows], g: &[Ref]) -> usize {
    g.iter()
        .position(|&(n, r)| {
            let rep = &nodes[n].reports[r];
            rep.backend.is_some()
                && rep.packets.iter().any(|p| {
                    p.dir == Dir::Request
                        && p.hops.iter().any(|h| h.node_ns && h.dst == rep.service)
                })
        })
        .unwrap_or(0)
}

fn merge_group(nodes: &[NodeFlows], g: &[Ref]) -> FlowReport {
    // The client-facing node first: its report is the base.
    let mut g = g.to_vec();
    let first = dnat_part(nodes, &g);
    g.swap(0, first);
    let inodes: Vec<u32> = g.iter().map(|&(n, _)| nodes[n].netns_inode).collect();
    // A recording holding events of another recorded node's namespace was
    // made on the same kernel (raw tracepoints are global): one clock.
    let shared_kernel = g.iter().any(|&(n, r)| {
        let own = nodes[n].netns_inode;
        nodes[n].reports[r]
            .packets
            .iter()
            .flat_map(|p| &p.hops)
            .any(|h| !h.node_ns && h.netns != own && inodes.contains(&h.netns))
    });
    let tolerance = if shared_kernel { SAME_EVENT_NS } else { 0 };
    // Each part's packets with their hops labelled. A hop in another
    // recorded node's namespace (tracepoints of a shared kernel) is that
    // node's: dropped when its own recording is in this flow (it has the
    // hop, with tc and netfilter around it), else labelled with it.
    let parts: Vec<Vec<PacketEvidence>> = g
        .iter()
        .map(|&(n, r)| {
            let own = nodes[n].netns_inode;
            nodes[n].reports[r]
                .packets
                .iter()
                .map(|p| {
                    let mut p = p.clone();
                    p.hops
                        .retain(|h| h.node_ns || h.netns == own || !inodes.contains(&h.netns));
                    for h in &mut p.hops {
                        h.node = Some(nodes[n].name.clone());
                        // Where the reply was judged is the client-facing
                        // node's call (or the merged verdict's, below).
                        h.client_side &= n == g[0].0;
                        if h.node_ns || h.netns == own {
                            continue;
                        }
                        if let Some(other) = nodes.iter().find(|x| x.netns_inode == h.netns) {
                            h.node = Some(other.name.clone());
                            h.node_ns = true;
                        }
                    }
                    p
                })
                .collect()
        })
        .collect();
    let packets = merge_packets(&parts, tolerance);
    let reports: Vec<(&Name, &FlowReport)> = g
        .iter()
        .map(|&(n, r)| (&nodes[n].name, &nodes[n].reports[r]))
        .collect();
    let base = reports[0].1;
    let decided = verdict::decide(&reports, &packets);
    let mut packets = packets;
    if let Some((node, ts)) = &decided.judged {
        for h in packets.iter_mut().flat_map(|p| &mut p.hops) {
            h.client_side = h.node.as_ref() == Some(node) && h.ts_ns == *ts;
        }
    }
    FlowReport {
        verdict: decided.verdict,
        cause: decided.cause,
        detail: decided.detail,
        snat: reports.iter().find_map(|(_, r)| r.snat),
        incomplete: reports.iter().any(|(_, r)| r.incomplete),
        truncated: reports.iter().any(|(_, r)| r.truncated),
        packets,
        ..base.clone()
    }
}

/// One list of packets from each node's: a packet seen on several nodes
/// once, with every node's hops; a packet only one node saw goes after the
/// previous packet that node shares with the others (its own order holds).
fn merge_packets(parts: &[Vec<PacketEvidence>], tolerance: u64) -> Vec<PacketEvidence> {
    // Each packet with each part's hops (None: that part has not claimed it).
    let mut merged: Vec<(PacketEvidence, Vec<Option<Vec<Hop>>>)> = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        let mut after: Option<usize> = None;
        for p in part {
            let key = Key::of(p);
            let at = merged.iter().enumerate().position(|(j, (m, hops))| {
                hops[i].is_none()
                    && Key::of(m) == key
                    && m.dir == p.dir
                    && after.is_none_or(|a| j > a)
            });
            let j = at.unwrap_or_else(|| {
                let j = after.map_or(merged.len(), |a| a + 1);
                let mut m = p.clone();
                m.hops = Vec::new();
                merged.insert(j, (m, vec![None; parts.len()]));
                j
            });
            merged[j].1[i] = Some(p.hops.clone());
            after = Some(j);
        }
    }
    merged
        .into_iter()
        .map(|(mut p, per_node)| {
            p.hops = order_hops(
                p.dir,
                per_node
                    .into_iter()
                    .map(Option::unwrap_or_default)
                    .collect(),
                tolerance,
            );
            p
        })
        .collect()
}

/// A request crosses the DNATing node (part 0) first, a reply last; within
/// a node, hops keep its order. A hop recorded by two nodes (same kernel)
/// stays with the node whose own hops are nearest to it.
fn order_hops(dir: Dir, mut per_node: Vec<Vec<Hop>>, tolerance: u64) -> Vec<Hop> {
    let n = per_node.len();
    for i in 0..n {
        for j in i + 1..n {
            let dups: Vec<Hop> = per_node[j]
                .iter()
                .filter(|h| per_node[i].iter().any(|x| same_event(x, h, tolerance)))
                .cloned()
                .collect();
            for d in dups {
                let drop = if distance(&per_node[i], &d) <= distance(&per_node[j], &d) {
                    j
                } else {
                    i
                };
                per_node[drop].retain(|h| !same_event(h, &d, tolerance));
            }
        }
    }
    let order: Vec<usize> = match dir {
        Dir::Request => (0..n).collect(),
        Dir::Reply => (0..n).rev().collect(),
    };
    let mut out = Vec::new();
    for i in order {
        let mut hops = std::mem::take(&mut per_node[i]);
        hops.sort_by_key(|h| h.ts_ns);
        out.extend(hops);
    }
    out
}

/// Two nattraces on one kernel each stamp an event with their own
/// `bpf_ktime_get_ns` call: the same event differs by microseconds, while
/// a retransmission through the same point comes 200 ms or more later.
const SAME_EVENT_NS: u64 = 1_000_000;

/// The same kernel event in two recordings of one kernel (everything but
/// the node and the stamp); `tolerance` 0 on separate machines.
fn same_event(a: &Hop, b: &Hop, tolerance: u64) -> bool {
    a.ts_ns.abs_diff(b.ts_ns) <= tolerance
        && a.netns == b.netns
        && a.ifindex == b.ifindex
        && a.hook == b.hook
        && a.nf_hook == b.nf_hook
        && a.nat_stage == b.nat_stage
        && a.src == b.src
        && a.dst == b.dst
}

/// How far `h` is from the nearest hop a node saw in its own namespace.
fn distance(hops: &[Hop], h: &Hop) -> u64 {
    hops.iter()
        .filter(|x| x.node_ns)
        .map(|x| x.ts_ns.abs_diff(h.ts_ns))
        .min()
        .unwrap_or(u64::MAX)
}
