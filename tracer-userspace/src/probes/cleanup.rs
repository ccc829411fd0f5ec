//! What a SIGKILLed nattrace leaves behind, and removing it. tcx, netfilter
//! and raw tracepoint links are owned by file descriptors and die with the
//! process; clsact filters (pre-6.6 kernels, or NATTRACE_FORCE_CLSACT=1) are
//! not, and keep running our program.
//!
//! Ours = a `bpf` filter whose program name is one of nattrace's tc programs
//! AND whose handle is [`FILTER_HANDLE`] (nobody else picks that value)
//! AND that no live nattrace claims. Anything else is left alone. A clsact
//! qdisc is removed only when nattrace created it (a mark under
//! [`STATE_DIR`], below) and no filter at all is left on it: one that
//! existed before (even empty) or holds someone else's filters is theirs.
//!
//! A qdisc carries nothing we could tag it with, so which clsact nattrace
//! created is remembered in a file per (network namespace inode, ifindex)
//! under [`STATE_DIR`] (tmpfs: gone at reboot, like the qdisc). The mark is
//! written *before* the qdisc is added and removed if it existed already,
//! so a SIGKILL at any moment leaves nothing the next start cannot clean;
//! only a kill between the kernel's "exists" answer and the unlink (a few
//! microseconds) would leave a mark on someone else's clsact, which is
//! then removed only if it is empty.
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
    io::{self, Write as _},
    os::{
        linux::net::SocketAddrExt,
        unix::{
            fs::{DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _},
            net::SocketAddr,
            net::UnixListener,
        },
    },
    path::PathBuf,
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
    let ifaces = netns::list_interfaces()?;
    forget_stale_marks(&ifaces, &with_clsact);
    for iface in ifaces {
        if !with_clsact.contains(&iface.ifindex) {
            continue;
        }
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
        // Also without a filter of ours: a kill between adding the qdisc
        // and attaching. Not while its creator runs (it is attaching now).
        let ours = clsact_mark(iface.ifindex)
            .is_some_and(|m| m.name == iface.name && !process_alive(m.pid));
        if left == 0 && ours && netns::delete_clsact(iface.ifindex).is_ok() {
            unmark_clsact(iface.ifindex);
            removed.push(format!("clsact qdisc on {}", iface.name));
        }
    }
    Ok(removed)
}

/// Where nattrace remembers the clsact qdiscs it created (see the module
/// comment).
pub const STATE_DIR: &str = "/run/nattrace";

/// The mark of `ifindex` in the calling thread's network namespace.
fn mark_path(ifindex: u32) -> Option<PathBuf> {
    let ns = std::fs::metadata("/proc/thread-self/ns/net").ok()?.ino();
    Some(PathBuf::from(STATE_DIR).join(format!("clsact-{ns}-{ifindex}")))
}

struct Mark {
    pid: i32,
    name: String,
}

fn clsact_mark(ifindex: u32) -> Option<Mark> {
    let text = std::fs::read_to_string(mark_path(ifindex)?).ok()?;
    let (pid, name) = text.trim_end().split_once(' ')?;
    Some(Mark {
        pid: pid.parse().ok()?,
        name: name.to_owned(),
    })
}

/// Marks of this namespace whose device or qdisc is gone (deleted while
/// nattrace ran, or after a kill): a later device with the same index and
/// a clsact of someone else's must not look like ours.
fn forget_stale_marks(ifaces: &[crate::facts::Interface], with_clsact: &HashSet<u32>) {
    let Some(prefix) = mark_path(0).and_then(|p| {
        let name = p.file_name()?.to_str()?.to_owned();
        Some(name.strip_suffix('0')?.to_owned())
    }) else {
        return;
    };
    let Ok(dir) = std::fs::read_dir(STATE_DIR) else {
        return;
    };
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(ifindex) = name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .and_then(|i| i.parse::<u32>().ok())
        else {
            continue;
        };
        let mark = clsact_mark(ifindex);
        let current = ifaces.iter().any(|i| {
            i.ifindex == ifindex
                && with_clsact.contains(&ifindex)
                && mark.as_ref().is_some_and(|m| m.name == i.name)
        });
        if !current && !mark.is_some_and(|m| process_alive(m.pid)) {
            unmark_clsact(ifindex);
        }
    }
}

/// Whether nattrace created the clsact on `ifindex` (this instance or
/// another one).
pub(super) fn clsact_marked(ifindex: u32) -> bool {
    clsact_mark(ifindex).is_some()
}

fn process_alive(pid: i32) -> bool {
    pid > 0
        && pid != std::process::id() as i32
        && std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Adds a clsact qdisc to `ifindex` (calling thread's namespace), marked
/// as nattrace's first. Ok(false) = one already existed (not ours).
pub(super) fn add_marked_clsact(ifindex: u32, name: &str) -> Result<bool, NetnsError> {
    let marked = mark_path(ifindex).and_then(|path| {
        // Never over another instance's mark (it made the qdisc).
        let write = || {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)?
                .write_all(format!("{} {name}\n", std::process::id()).as_bytes())
        };
        let res = write().or_else(|e| {
            if e.kind() == io::ErrorKind::AlreadyExists {
                return Err(e);
            }
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(STATE_DIR)
                .and_then(|()| write())
        });
        match res {
            Ok(()) => Some(path),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => None,
            Err(e) => {
                log::warn!(
                    "cannot remember the clsact qdisc on {name} in {STATE_DIR} ({e}): \
                     after a SIGKILL, `nattrace cleanup` would leave it (empty)"
                );
                None
            }
        }
    });
    let created = netns::add_clsact(ifindex);
    if !matches!(created, Ok(true))
        && let Some(path) = &marked
    {
        let _ = std::fs::remove_file(path);
    }
    created
}

/// Forgets the mark once the qdisc is removed.
pub(super) fn unmark_clsact(ifindex: u32) {
    if let Some(path) = mark_path(ifindex) {
        let _ = std::fs::remove_file(path);
        // Best effort: empty again, as before nattrace ran.
        let _ = std::fs::remove_dir(STATE_DIR);
    }
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
