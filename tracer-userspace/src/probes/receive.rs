//! Whether the `netif_receive_skb` tracepoint must be attached (issue 25:
//! one program call per veth crossing, not two). `net_dev_start_xmit`
//! reports the receive that a veth's or loopback's transmit leads to
//! (tracer-ebpf skb.rs `receiver`), and tc the node's own interfaces. A
//! device of any other kind outside the traced namespace (a macvlan or
//! ipvlan pod, an SR-IOV function, another lab node's VXLAN device), or a
//! node interface tc could not attach to, receives packets that no
//! transmit reports: only then is the tracepoint attached, and it stays.
//! Checked at start for every pod of the node (a namespace linked to it by
//! a pod veth or a macvlan's parent; not the network beyond its uplink,
//! nor another lab node on the same kernel), and on each interface poll
//! for the namespaces that appeared since.
use std::{
    collections::{BTreeSet, HashMap},
    fs::File,
    os::fd::{AsFd as _, OwnedFd},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use nix::sched::CloneFlags;

use super::{
    ifnames::scan_netns_files,
    netns,
    table::{Attach, ProgramSpec},
};
use crate::facts::Interface;

/// How long a new namespace is looked at again on each poll: a pod's
/// namespace exists before its CNI plugins add its devices (a macvlan by
/// Multus), and a poll may fall in between.
const SETTLE: Duration = Duration::from_secs(30);

/// A device whose receive only the receive tracepoint sees.
pub fn unpaired(iface: &Interface) -> bool {
    // Loopback has no link kind; it is "lo" in every namespace.
    iface.kind != "veth" && iface.name != "lo"
}

/// The receive tracepoint's program, and what has been looked at.
pub struct Receive {
    /// None: the backend has no such program, or it is attached.
    pending: Option<&'static ProgramSpec>,
    /// Namespaces looked at, and when first (None: never to look at).
    seen: HashMap<u32, Option<Instant>>,
    /// The look at the pods' namespaces, off the caller's thread: on a
    /// node of 1,000 pods it is a /proc walk and 1,000 link dumps, about
    /// 0.4 s, which start-up (and a tick) would otherwise wait for.
    scan: Option<JoinHandle<Scan>>,
}

/// What one background look found.
struct Scan {
    /// Namespaces looked at for the first time, and when.
    first_seen: Vec<(u32, Instant)>,
    /// The first unpaired device of a pod, described.
    found: Option<String>,
}

impl Receive {
    /// `node`: the traced namespace's inode.
    pub fn new(plan: &[&'static ProgramSpec], node: u32) -> Self {
        Self {
            pending: plan
                .iter()
                .copied()
                .find(|p| matches!(p.attach, Attach::UnpairedReceive(_))),
            // The traced namespace's interfaces are tc's.
            seen: HashMap::from([(node, None)]),
            scan: None,
        }
    }

    /// The program to attach now, and why: `in_node` (a node interface tc
    /// does not cover) or else the first unpaired device of a pod of
    /// `node` (netns.rs `pod_interfaces`), "name (kind) in netns N", that
    /// a finished background look found. With `look`, starts the next look
    /// when none runs: one link dump per namespace younger than
    /// [`SETTLE`]. Nothing once attached.
    pub fn due(
        &mut self,
        node: &netns::Netns,
        pod_veths: &BTreeSet<u32>,
        in_node: Option<&Interface>,
        look: bool,
    ) -> Option<(&'static ProgramSpec, String)> {
        let spec = self.pending?;
        if let Some(i) = in_node {
            return Some((spec, describe(i, None)));
        }
        if let Some(scan) = self.scan.take_if(|h| h.is_finished()) {
            // A look that panicked found nothing; the next one looks again.
            if let Ok(Scan { first_seen, found }) = scan.join() {
                self.seen
                    .extend(first_seen.into_iter().map(|(n, t)| (n, Some(t))));
                if let Some(why) = found {
                    return Some((spec, why));
                }
            }
        }
        if look && self.scan.is_none() {
            self.scan = start_look(node, pod_veths, &self.seen);
        }
        None
    }

    /// Whether the program still waits to be attached (else there is
    /// nothing to check).
    pub fn wanted(&self) -> bool {
        self.pending.is_some()
    }

    /// The program is attached (or failed to): nothing more to look at.
    pub fn done(&mut self) {
        self.pending = None;
        self.seen = HashMap::new();
        // A running look ends by itself; its result is not wanted.
        self.scan = None;
    }
}

/// Starts a look at the namespaces not seen yet or younger than
/// [`SETTLE`], on a thread of its own: it enters each in turn (setns), so
/// the caller's namespace stays as it is.
fn start_look(
    node: &netns::Netns,
    pod_veths: &BTreeSet<u32>,
    seen: &HashMap<u32, Option<Instant>>,
) -> Option<JoinHandle<Scan>> {
    let node: OwnedFd = node.fd().try_clone_to_owned().ok()?;
    let pod_veths = pod_veths.clone();
    let seen = seen.clone();
    std::thread::Builder::new()
        .name("nattrace-pods".into())
        .spawn(move || look(&node, &pod_veths, &seen))
        .ok()
}

fn look(node: &OwnedFd, pod_veths: &BTreeSet<u32>, seen: &HashMap<u32, Option<Instant>>) -> Scan {
    let now = Instant::now();
    let mut first_seen = Vec::new();
    for (inode, path) in scan_netns_files() {
        let first = match seen.get(&inode) {
            Some(None) => continue,
            Some(Some(t)) => *t,
            None => {
                first_seen.push((inode, now));
                now
            }
        };
        if now.duration_since(first) > SETTLE {
            continue;
        }
        let Ok(file) = File::open(&path) else {
            continue;
        };
        if nix::sched::setns(file.as_fd(), CloneFlags::CLONE_NEWNET).is_err() {
            continue;
        }
        let Ok(Some(links)) = netns::pod_interfaces(node.as_fd(), pod_veths) else {
            continue;
        };
        if let Some(i) = links.iter().find(|i| unpaired(i)) {
            return Scan {
                first_seen,
                found: Some(describe(i, Some(inode))),
            };
        }
    }
    Scan {
        first_seen,
        found: None,
    }
}

fn describe(i: &Interface, netns: Option<u32>) -> String {
    let kind = if i.kind.is_empty() { "device" } else { &i.kind };
    match netns {
        Some(n) => format!("{} ({kind}) in netns {n}", i.name),
        None => format!("{} ({kind}) without tc", i.name),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iface(name: &str, kind: &str) -> Interface {
        Interface {
            name: name.to_owned(),
            kind: kind.to_owned(),
            ..Default::default()
        }
    }

    #[test]
    fn only_veths_and_loopback_are_paired() {
        assert!(!unpaired(&iface("eth0", "veth")));
        assert!(!unpaired(&iface("lo", "")));
        for (name, kind) in [
            ("flannel.1", "vxlan"),
            ("eth0", "macvlan"),
            ("eth0", "ipvlan"),
            ("ens5", ""),
        ] {
            assert!(unpaired(&iface(name, kind)), "{name} {kind}");
        }
    }
}
