//! What a SIGKILLed nattrace leaves behind, and removing it. tcx, netfilter
//! and raw tracepoint links are owned by file descriptors and die with the
//! process; clsact filters (pre-6.6 kernels, or NATTRACE_FORCE_CLSACT=1) are
//! not, and keep running our program.
//!
//! Ours = a `bpf` filter whose program name is one of nattrace's tc programs
//! AND whose handle is [`FILTER_HANDLE`] (nobody else picks that value)
//! AND that no live nattrace claims. Anything else is left alone. A clsact
//! qdisc is removed only when we removed a filter from it and no filter at
//! all is left on it: an empty clsact does nothing, and one holding someone
//! else's filters is theirs.
//!
//! Live = a running nattrace (another instance tracing the same node) holds
//! the filter's program. Two signs, either suffices: (1) the instance binds
//! the abstract unix socket [`live_socket_name`]`(prog_id)` in the traced
//! namespace for as long as it runs; abstract names are per network
//! namespace, visible whatever the PID namespace (nattrace in another
//! container), and vanish with the process, also on SIGKILL; (2) some
//! process we can see holds the program open (`/proc/*/fdinfo`), which also
//! covers instances from before (1) existed. A filter with neither is an
//! orphan of a killed nattrace.
use std::{
    collections::HashSet,
    io,
    os::{linux::net::SocketAddrExt, unix::net::SocketAddr, unix::net::UnixListener},
};

use netlink_packet_core::{NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST};
use netlink_packet_route::{
    RouteNetlinkMessage,
    tc::{TcAttribute, TcFilterBpfOption, TcHandle, TcMessage, TcOption},
};

use super::netns::{self, Netns, NetnsError};

/// The tc filter handle nattrace attaches with ("natt").
pub const FILTER_HANDLE: u32 = 0x6e61_7474;
/// nattrace's tc programs (the kernel keeps the name the loader gave).
const PROGRAM_NAMES: &[&str] = &["tc_ingress", "tc_egress"];

const INGRESS: TcHandle = TcHandle {
    major: 0xffff,
    minor: TcHandle::MIN_INGRESS,
};
const EGRESS: TcHandle = TcHandle {
    major: 0xffff,
    minor: TcHandle::MIN_EGRESS,
};

#[derive(Debug, Clone, PartialEq, Eq)]
struct Filter {
    parent: TcHandle,
    handle: TcHandle,
    info: u32,
    kind: String,
    prog_name: Option<String>,
    prog_id: Option<u32>,
}

impl Filter {
    fn is_nattrace(&self) -> bool {
        self.kind == "bpf"
            && u32::from(self.handle) == FILTER_HANDLE
            && self
                .prog_name
                .as_deref()
                .is_some_and(|n| PROGRAM_NAMES.contains(&n))
    }
}

/// Removes leftovers in the namespace `spec` (None = current) and returns
/// one description per removed object ("tc filter tc_ingress on eth0").
pub fn remove_leftovers(spec: Option<&str>) -> Result<Vec<String>, NetnsError> {
    let ns = Netns::open(spec)?;
    let live = live_program_ids();
    ns.run(|| remove_in_current(&live))?
}

fn remove_in_current(live: &HashSet<u32>) -> Result<Vec<String>, NetnsError> {
    let mut removed = Vec::new();
    // This runs at every start: one qdisc dump instead of two filter dumps
    // per interface, since only a clsact qdisc can hold a leftover filter.
    let with_clsact = interfaces_with_clsact()?;
    for iface in netns::list_interfaces()? {
        if !with_clsact.contains(&iface.ifindex) {
            continue;
        }
        let mut took_ours = false;
        let mut left = 0usize;
        for parent in [INGRESS, EGRESS] {
            // EINVAL/ENOENT: no clsact on this device.
            let Ok(filters) = list_filters(iface.ifindex, parent) else {
                continue;
            };
            for f in filters {
                let held = f
                    .prog_id
                    .is_some_and(|id| live.contains(&id) || claimed_by_live_instance(id));
                if f.is_nattrace() && !held {
                    delete_filter(iface.ifindex, &f)?;
                    took_ours = true;
                    removed.push(format!(
                        "tc filter {} on {}",
                        f.prog_name.as_deref().unwrap_or("?"),
                        iface.name
                    ));
                } else {
                    left += 1;
                }
            }
        }
        if took_ours && left == 0 && netns::delete_clsact(iface.ifindex).is_ok() {
            removed.push(format!("clsact qdisc on {}", iface.name));
        }
    }
    Ok(removed)
}

/// The abstract socket name a live nattrace binds for its tc program `prog_id`.
fn live_socket_name(prog_id: u32) -> String {
    format!("nattrace-tc-prog-{prog_id}")
}

/// Claims the tc program `prog_id` for this process, in the calling
/// thread's network namespace, until the listener is dropped (see the
/// module comment).
pub(super) fn claim_program(prog_id: u32) -> io::Result<UnixListener> {
    let addr = SocketAddr::from_abstract_name(live_socket_name(prog_id))?;
    UnixListener::bind_addr(&addr)
}

fn claimed_by_live_instance(prog_id: u32) -> bool {
    match claim_program(prog_id) {
        // Free: the probe's own listener closes here.
        Ok(_) => false,
        Err(e) => e.kind() == io::ErrorKind::AddrInUse,
    }
}

/// Filters on the clsact hooks of `ifindex`, and whether each is nattrace's.
/// Err: no clsact there (or netlink failed).
pub(super) fn clsact_filters(ifindex: u32) -> Result<Vec<bool>, NetnsError> {
    let mut out = Vec::new();
    for parent in [INGRESS, EGRESS] {
        out.extend(
            list_filters(ifindex, parent)?
                .iter()
                .map(Filter::is_nattrace),
        );
    }
    Ok(out)
}

/// Indexes of the interfaces that have a clsact qdisc.
fn interfaces_with_clsact() -> Result<HashSet<u32>, NetnsError> {
    let replies = netns::netlink_request(
        RouteNetlinkMessage::GetQueueDiscipline(TcMessage::default()),
        NLM_F_REQUEST | NLM_F_DUMP,
    )?;
    Ok(replies
        .into_iter()
        .filter_map(|reply| match reply {
            RouteNetlinkMessage::NewQueueDiscipline(m)
                if m.attributes
                    .iter()
                    .any(|a| matches!(a, TcAttribute::Kind(k) if k == "clsact")) =>
            {
                u32::try_from(m.header.index).ok()
            }
            _ => None,
        })
        .collect())
}

/// Filters of one clsact hook; a dump lists each filter once per
/// (priority, handle) plus a header entry without options, which is skipped.
fn list_filters(ifindex: u32, parent: TcHandle) -> Result<Vec<Filter>, NetnsError> {
    let mut msg = TcMessage::with_index(ifindex as i32);
    msg.header.parent = parent;
    let replies = netns::netlink_request(
        RouteNetlinkMessage::GetTrafficFilter(msg),
        NLM_F_REQUEST | NLM_F_DUMP,
    )?;
    let mut out = Vec::new();
    for reply in replies {
        let RouteNetlinkMessage::NewTrafficFilter(m) = reply else {
            continue;
        };
        let mut f = Filter {
            parent,
            handle: m.header.handle,
            info: m.header.info,
            kind: String::new(),
            prog_name: None,
            prog_id: None,
        };
        let mut has_options = false;
        for attr in &m.attributes {
            match attr {
                TcAttribute::Kind(k) => f.kind = k.clone(),
                TcAttribute::Options(opts) => {
                    has_options = true;
                    for o in opts {
                        match o {
                            TcOption::Bpf(TcFilterBpfOption::ProgName(n)) => {
                                f.prog_name = Some(n.clone());
                            }
                            TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => f.prog_id = Some(*id),
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        if has_options || u32::from(f.handle) != 0 {
            out.push(f);
        }
    }
    Ok(out)
}

fn delete_filter(ifindex: u32, f: &Filter) -> Result<(), NetnsError> {
    let mut msg = TcMessage::with_index(ifindex as i32);
    msg.header.parent = f.parent;
    msg.header.handle = f.handle;
    msg.header.info = f.info;
    msg.attributes.push(TcAttribute::Kind(f.kind.clone()));
    netns::netlink_request(
        RouteNetlinkMessage::DelTrafficFilter(msg),
        NLM_F_REQUEST | NLM_F_ACK,
    )?;
    Ok(())
}

/// BPF program ids held open by any process (fdinfo `prog_id:`), i.e. in
/// use by a running loader such as another nattrace.
fn live_program_ids() -> HashSet<u32> {
    let mut ids = HashSet::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return ids;
    };
    for p in procs.flatten() {
        let name = p.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(p.path().join("fdinfo")) else {
            continue;
        };
        for fd in fds.flatten() {
            // Only BPF fds carry prog_id; skip the read for plain files by
            // checking the link target first.
            let target = std::fs::read_link(p.path().join("fd").join(fd.file_name()));
            if !target.is_ok_and(|t| t.to_string_lossy().starts_with("anon_inode:")) {
                continue;
            }
            if let Ok(info) = std::fs::read_to_string(fd.path())
                && let Some(id) = info
                    .lines()
                    .find_map(|l| l.strip_prefix("prog_id:"))
                    .and_then(|v| v.trim().parse().ok())
            {
                ids.insert(id);
            }
        }
    }
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filter(kind: &str, handle: u32, name: &str) -> Filter {
        Filter {
            parent: INGRESS,
            handle: TcHandle::from(handle),
            info: 0,
            kind: kind.into(),
            prog_name: Some(name.into()),
            prog_id: Some(7),
        }
    }

    #[test]
    fn a_claim_is_seen_until_dropped() {
        // Abstract sockets need no privileges; the id is one no kernel
        // hands out this early, so no real nattrace collides.
        let id = u32::MAX - u32::from(std::process::id() as u16);
        assert!(!claimed_by_live_instance(id));
        let claim = claim_program(id).unwrap();
        assert!(claimed_by_live_instance(id));
        drop(claim);
        assert!(!claimed_by_live_instance(id));
    }

    #[test]
    fn only_our_handle_name_and_kind_are_ours() {
        assert!(filter("bpf", FILTER_HANDLE, "tc_ingress").is_nattrace());
        assert!(!filter("bpf", 1, "tc_ingress").is_nattrace());
        assert!(!filter("bpf", FILTER_HANDLE, "cil_from_netdev").is_nattrace());
        assert!(!filter("u32", FILTER_HANDLE, "tc_ingress").is_nattrace());
    }
}
