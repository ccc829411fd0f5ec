//! tc attachments on the interfaces of the traced namespace. Every method
//! here must run inside that namespace (see [`super::netns::Netns::run`]):
//! aya resolves interface names and opens its netlink sockets in the calling
//! thread's namespace, and so does detaching a clsact filter.
//!
//! Creating or closing a tcx link waits for an RCU grace period in the
//! kernel (the device's program array is swapped, then synchronized) while
//! holding the RTNL lock: 5-25 ms each on these VMs, whatever we do in
//! userspace, and concurrent attaches only queue on the lock. With two links
//! per interface a node with many pods takes seconds, so past [`INLINE_MAX`]
//! interfaces the links are created on a background thread while tracing
//! already runs: until an interface is in the kernel's TC_IFACES map, the
//! device tracepoints report its packets instead (tracer-ebpf/src/tracepoints.rs).
//!
//! Pods' veths get no tc: the device tracepoints, which fire on every
//! device in every namespace anyway, report their packets. On a veth they
//! see exactly what tc would (a veth has no qdisc: drivers/net/veth.c
//! `veth_setup` sets IFF_NO_QUEUE, so nothing runs between tc egress and
//! `net_dev_start_xmit`, or between `netif_receive_skb` and tc ingress; a
//! shaping qdisc someone adds, e.g. the bandwidth CNI plugin's, only delays
//! the transmit event, and its drops are `kfree_skb` events), and the
//! collector takes either (collector/types.rs `node_ingress`/`node_egress`).
//! So tc there would only add two program calls to every packet that
//! crosses the node (issue 25: 11 calls per bridged packet with it, 9
//! without) and one RCU grace period per link to attach and to detach
//! ([`TcAttachments::detach_all`]: Ctrl-C on a node with 300 pods took
//! 6-11 s with tc on every veth). tc stays on the node's own interfaces
//! (uplinks, bridges, overlay devices), where a qdisc may queue between tc
//! and the transmit tracepoint.
//! Lab tests give the same verdicts and causes both ways (DESIGN.md).
use std::{
    collections::{BTreeMap, BTreeSet},
    io,
    os::fd::{AsFd, AsRawFd, OwnedFd, RawFd},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
};

use aya::{
    Ebpf,
    programs::{
        Link, SchedClassifier, TcAttachType,
        tc::{NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle},
    },
};

use aya_obj::generated::{bpf_attach_type, bpf_attr, bpf_cmd};

use super::{Skipped, netns, nf_link::sys_bpf};
use crate::facts::Interface;

/// tcx links are owned by their fds; clsact filters are detached by aya over netlink.
enum Links {
    /// Held only to keep the links: closing the fds detaches them.
    Tcx {
        _fds: Vec<OwnedFd>,
    },
    Clsact(Vec<SchedClassifierLink>),
}

struct IfaceLinks {
    name: String,
    links: Links,
    /// We added the clsact qdisc (pre-6.6 kernels), so we remove it.
    own_clsact: bool,
}

/// Interfaces attached on the calling thread; more go to a background thread.
const INLINE_MAX: usize = 16;

type TcxResults = Vec<(Interface, Result<Vec<OwnedFd>, String>)>;

/// tcx links being created in the background.
struct Pending {
    ifindexes: Vec<u32>,
    results: mpsc::Receiver<TcxResults>,
    /// Set when we detach before it is done: links not created yet are skipped.
    cancel: Arc<AtomicBool>,
}

pub struct TcAttachments {
    tcx: bool,
    programs: Vec<(&'static str, TcAttachType)>,
    ifaces: BTreeMap<u32, IfaceLinks>,
    pending: Option<Pending>,
    /// clsact mode: our claims on our programs, so another nattrace's
    /// leftover cleanup leaves our filters alone (cleanup.rs).
    claims: Vec<std::os::unix::net::UnixListener>,
    /// Pod veths left to the device tracepoints at the last sync.
    by_tracepoints: usize,
    /// Pod veths get tc too: only with NATTRACE_TC_EVERYWHERE=1, for the
    /// tests of tc itself (leftovers on every interface, the slow detach).
    tc_on_pods: bool,
}

/// What a [`TcAttachments::sync`] or [`TcAttachments::collect`] changed.
#[derive(Default)]
pub struct Synced {
    /// Names and ifindexes of the interfaces attached now.
    pub added: Vec<(String, u32)>,
    pub gone: Vec<u32>,
    pub failed: Vec<Skipped>,
}

impl TcAttachments {
    pub fn new(tcx: bool, programs: Vec<(&'static str, TcAttachType)>) -> Self {
        TcAttachments {
            tcx,
            programs,
            ifaces: BTreeMap::new(),
            pending: None,
            claims: Vec::new(),
            by_tracepoints: 0,
            tc_on_pods: std::env::var_os("NATTRACE_TC_EVERYWHERE").is_some(),
        }
    }

    /// Pod veths watched by the device tracepoints instead of tc.
    pub fn tracepoint_count(&self) -> usize {
        self.by_tracepoints
    }

    /// tcx links (kernel >= 6.6), not clsact filters.
    pub fn is_tcx(&self) -> bool {
        self.tcx
    }

    pub fn mode(&self) -> &'static str {
        if self.tcx { "tcx" } else { "clsact" }
    }

    pub fn interface_count(&self) -> usize {
        self.ifaces.len()
    }

    /// Interfaces still being attached in the background.
    /// Whether tc is attached to `ifindex` now.
    pub fn covers(&self, ifindex: u32) -> bool {
        self.ifaces.contains_key(&ifindex)
    }

    pub fn pending_count(&self) -> usize {
        self.pending.as_ref().map_or(0, |p| p.ifindexes.len())
    }

    pub fn has_programs(&self) -> bool {
        !self.programs.is_empty()
    }

    /// Before the first clsact filter: claim our programs in this namespace.
    fn claim_programs(&mut self, ebpf: &Ebpf) -> Result<(), String> {
        if !self.claims.is_empty() {
            return Ok(());
        }
        for &(name, _) in &self.programs {
            let prog: &SchedClassifier = ebpf
                .program(name)
                .ok_or("program missing from object")?
                .try_into()
                .map_err(|e| format!("{e}"))?;
            let id = prog.info().map_err(|e| format!("{e}"))?.id();
            let claim = super::cleanup::claim_program(id)
                .map_err(|e| format!("cannot claim program {id}: {e}"))?;
            self.claims.push(claim);
        }
        Ok(())
    }

    /// Pre-6.6 kernels: a clsact filter per program, through aya.
    fn attach_clsact(&self, ebpf: &mut Ebpf, iface: &Interface) -> Result<IfaceLinks, String> {
        let mut links = Vec::new();
        // A clsact another nattrace created is treated as ours too:
        // whichever instance leaves last removes it (when empty). One that
        // existed before any nattrace stays.
        let own_clsact = super::cleanup::add_marked_clsact(iface.ifindex, &iface.name)
            .map_err(|e| e.to_string())?
            || super::cleanup::clsact_marked(iface.ifindex);
        for &(name, attach_type) in &self.programs {
            let result = (|| {
                let prog: &mut SchedClassifier = ebpf
                    .program_mut(name)
                    .ok_or("program missing from object")?
                    .try_into()
                    .map_err(|e| format!("{e}"))?;
                // A handle nobody else uses marks the filter as ours, so
                // a later run can remove it if this one is SIGKILLed.
                let options = TcAttachOptions::Netlink(NlOptions {
                    handle: TcHandle::from(super::cleanup::FILTER_HANDLE),
                    ..NlOptions::default()
                });
                let id = prog
                    .attach_with_options(&iface.name, attach_type, options)
                    .map_err(|e| format!("{e}"))?;
                prog.take_link(id).map_err(|e| format!("{e}"))
            })();
            match result {
                Ok(link) => links.push(link),
                Err(e) => {
                    let done = IfaceLinks {
                        name: iface.name.clone(),
                        links: Links::Clsact(links),
                        own_clsact,
                    };
                    release(iface.ifindex, done);
                    return Err(e);
                }
            }
        }
        Ok(IfaceLinks {
            name: iface.name.clone(),
            links: Links::Clsact(links),
            own_clsact,
        })
    }

    /// Program fds and tcx attach types of our tc programs.
    pub fn tcx_programs(&self, ebpf: &Ebpf) -> Result<Vec<(RawFd, bpf_attach_type)>, String> {
        let mut programs = Vec::new();
        for &(name, attach_type) in &self.programs {
            let prog: &SchedClassifier = ebpf
                .program(name)
                .ok_or("program missing from object")?
                .try_into()
                .map_err(|e| format!("{e}"))?;
            let fd = prog.fd().map_err(|e| format!("{e}"))?;
            let kind = match attach_type {
                TcAttachType::Ingress => bpf_attach_type::BPF_TCX_INGRESS,
                TcAttachType::Egress => bpf_attach_type::BPF_TCX_EGRESS,
                TcAttachType::Custom(_) => return Err("custom tc attach type".into()),
            };
            programs.push((fd.as_fd().as_raw_fd(), kind));
        }
        Ok(programs)
    }

    fn keep(&mut self, results: TcxResults, out: &mut Synced) {
        for (iface, result) in results {
            match result {
                Ok(fds) => {
                    out.added.push((iface.name.clone(), iface.ifindex));
                    self.ifaces.insert(
                        iface.ifindex,
                        IfaceLinks {
                            name: iface.name,
                            links: Links::Tcx { _fds: fds },
                            own_clsact: false,
                        },
                    );
                }
                Err(reason) => out.failed.push(Skipped {
                    program: format!("tc on {}", iface.name),
                    reason,
                }),
            }
        }
    }

    /// Takes in what the background attach finished; with `wait`, waits for it.
    pub fn collect(&mut self, wait: bool) -> Synced {
        let mut out = Synced::default();
        let Some(pending) = &self.pending else {
            return out;
        };
        let got = if wait {
            pending.results.recv().ok()
        } else {
            match pending.results.try_recv() {
                Ok(r) => Some(r),
                Err(mpsc::TryRecvError::Empty) => return out,
                Err(mpsc::TryRecvError::Disconnected) => None,
            }
        };
        let pending = self.pending.take().expect("checked above");
        match got {
            Some(results) => self.keep(results, &mut out),
            None => out.failed.push(Skipped {
                program: format!("tc on {} interfaces", pending.ifindexes.len()),
                reason: "the attaching thread died".into(),
            }),
        }
        out
    }

    /// Attaches to every interface in `ifaces` not attached yet and forgets
    /// those that disappeared; many new ones are attached in the background
    /// (see [`collect`](Self::collect)). `pod_veths` get none (module
    /// comment). Must run in the traced namespace.
    pub fn sync(
        &mut self,
        ebpf: &mut Ebpf,
        ifaces: &[Interface],
        pod_veths: &BTreeSet<u32>,
    ) -> Synced {
        let mut out = Synced::default();
        let Some(todo) = self.todo(ifaces, pod_veths, &mut out) else {
            return out;
        };
        if !self.tcx {
            if let Err(reason) = self.claim_programs(ebpf) {
                out.failed.extend(todo.iter().map(|i| Skipped {
                    program: format!("tc on {}", i.name),
                    reason: reason.clone(),
                }));
                return out;
            }
            self.attach_clsact_all(ebpf, todo, &mut out);
            return out;
        }
        match self.tcx_programs(ebpf) {
            Ok(programs) => self.attach_tcx_todo(programs, todo, &mut out),
            Err(reason) => out.failed.extend(todo.iter().map(|i| Skipped {
                program: format!("tc on {}", i.name),
                reason: reason.clone(),
            })),
        }
        out
    }

    /// [`sync`](Self::sync) in tcx mode with the program fds taken before
    /// ([`tcx_programs`](Self::tcx_programs)), so it needs no `Ebpf` and can
    /// run while other programs still load (`Tracer::start`). The fds must
    /// stay open until this returns and, with many interfaces, until
    /// [`collect`](Self::collect) has the background attach's results.
    pub fn sync_tcx(
        &mut self,
        programs: Vec<(RawFd, bpf_attach_type)>,
        ifaces: &[Interface],
        pod_veths: &BTreeSet<u32>,
    ) -> Synced {
        let mut out = Synced::default();
        if let Some(todo) = self.todo(ifaces, pod_veths, &mut out) {
            self.attach_tcx_todo(programs, todo, &mut out);
        }
        out
    }

    /// The interfaces to attach now (None: nothing to do), after forgetting
    /// the gone ones and counting those left to the device tracepoints.
    fn todo(
        &mut self,
        ifaces: &[Interface],
        pod_veths: &BTreeSet<u32>,
        out: &mut Synced,
    ) -> Option<Vec<Interface>> {
        self.forget_gone(ifaces, out);
        if self.pending.is_some() {
            // Picked up by a later sync, once the background attach is done.
            return None;
        }
        let left_to_tracepoints =
            |i: &Interface| !self.tc_on_pods && pod_veths.contains(&i.ifindex);
        self.by_tracepoints = ifaces
            .iter()
            .filter(|i| left_to_tracepoints(i) && !self.ifaces.contains_key(&i.ifindex))
            .count();
        let todo: Vec<Interface> = ifaces
            .iter()
            .filter(|i| !self.ifaces.contains_key(&i.ifindex) && !left_to_tracepoints(i))
            .cloned()
            .collect();
        (!todo.is_empty()).then_some(todo)
    }

    fn attach_tcx_todo(
        &mut self,
        programs: Vec<(RawFd, bpf_attach_type)>,
        todo: Vec<Interface>,
        out: &mut Synced,
    ) {
        if todo.len() <= INLINE_MAX {
            let results = attach_tcx(&programs, todo, &AtomicBool::new(false));
            self.keep(results, out);
            return;
        }
        self.attach_tcx_in_background(programs, todo, out);
    }

    /// Forgets the interfaces no longer in `ifaces`.
    fn forget_gone(&mut self, ifaces: &[Interface], out: &mut Synced) {
        let gone: Vec<u32> = self
            .ifaces
            .keys()
            .filter(|i| !ifaces.iter().any(|f| f.ifindex == **i))
            .copied()
            .collect();
        for ifindex in gone {
            if let Some(links) = self.ifaces.remove(&ifindex) {
                log::debug!("interface {} is gone", links.name);
                out.gone.push(ifindex);
                // The kernel already removed the device's filters/qdisc.
                drop(links.links);
            }
        }
    }

    /// Attaches the clsact filters (kernels without tcx) on each of `todo`.
    fn attach_clsact_all(&mut self, ebpf: &mut Ebpf, todo: Vec<Interface>, out: &mut Synced) {
        for iface in todo {
            match self.attach_clsact(ebpf, &iface) {
                Ok(links) => {
                    out.added.push((iface.name.clone(), iface.ifindex));
                    self.ifaces.insert(iface.ifindex, links);
                }
                Err(reason) => out.failed.push(Skipped {
                    program: format!("tc on {}", iface.name),
                    reason,
                }),
            }
        }
    }

    /// Attaches tcx links on many interfaces from a thread of their own;
    /// [`collect`](Self::collect) picks up the results.
    fn attach_tcx_in_background(
        &mut self,
        programs: Vec<(RawFd, bpf_attach_type)>,
        todo: Vec<Interface>,
        out: &mut Synced,
    ) {
        // A plain thread started from this one is in the same network
        // namespace. The program fds stay open: `Tracer` waits for this
        // thread (collect(true)) before it drops the programs.
        let (tx, rx) = mpsc::channel();
        let ifindexes = todo.iter().map(|i| i.ifindex).collect();
        let cancel = Arc::new(AtomicBool::new(false));
        let cancelled = cancel.clone();
        let spawned = std::thread::Builder::new()
            .name("nattrace-tcx".into())
            .spawn(move || {
                let started = std::time::Instant::now();
                let n = todo.len();
                let results = attach_tcx(&programs, todo, &cancelled);
                log::debug!("tcx links on {n} interfaces took {:?}", started.elapsed());
                let _ = tx.send(results);
            });
        match spawned {
            Ok(_) => {
                self.pending = Some(Pending {
                    ifindexes,
                    results: rx,
                    cancel,
                })
            }
            Err(e) => out.failed.push(Skipped {
                program: "tc".into(),
                reason: format!("cannot start the attaching thread: {e}"),
            }),
        }
    }

    /// Closing a tcx link costs one RCU grace period under the RTNL lock
    /// (kernel/bpf/tcx.c tcx_link_release: rtnl_lock, bpf_mprog_detach,
    /// tcx_entry_sync = synchronize_rcu, rtnl_unlock), so links close one at
    /// a time whatever we do: closing 612 links (306 interfaces) took 9.2 s
    /// from one thread and 8.4 s from eight on this 2-core VM (~14 ms each).
    /// Exiting without closing them would leave the same work to the kernel
    /// at exit, so nattrace waits; the session writes its output meanwhile.
    /// That is one reason the pod veths get no tc (module comment): with 306
    /// interfaces Ctrl-C → exit went from 7.7 s to 0.15 s
    /// (tests/tests/tracer/many.rs).
    pub fn detach_all(&mut self) {
        if let Some(p) = &self.pending {
            p.cancel.store(true, Ordering::Relaxed);
        }
        let _ = self.collect(true);
        for (ifindex, links) in std::mem::take(&mut self.ifaces) {
            release(ifindex, links);
        }
    }
}

/// Every program on every interface of `todo`. Per interface: its links, or
/// why not (then none are kept).
fn attach_tcx(
    programs: &[(RawFd, bpf_attach_type)],
    todo: Vec<Interface>,
    cancel: &AtomicBool,
) -> TcxResults {
    todo.into_iter()
        .map(|iface| {
            // On error the links made so far close with their fds (detached).
            let links = programs
                .iter()
                .map(|&(fd, kind)| {
                    if cancel.load(Ordering::Relaxed) {
                        return Err("cancelled: nattrace is exiting".to_owned());
                    }
                    tcx_attach(fd, kind, iface.ifindex).map_err(|e| format!("tcx attach: {e}"))
                })
                .collect();
            (iface, links)
        })
        .collect()
}

/// `bpf(BPF_LINK_CREATE)` of a tcx link at the head of the device's chain
/// (BPF_F_BEFORE with no relative program = first), so we see the packet
/// before a CNI program redirects or rewrites it; we always pass it on.
fn tcx_attach(prog_fd: RawFd, kind: bpf_attach_type, ifindex: u32) -> io::Result<OwnedFd> {
    const BPF_F_BEFORE: u32 = 1 << 3;
    // SAFETY: bpf_attr is plain data; all-zero is its documented "unset".
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: writing plain-integer union fields.
    unsafe {
        let lc = &mut attr.link_create;
        lc.__bindgen_anon_1.prog_fd = prog_fd as u32;
        lc.__bindgen_anon_2.target_ifindex = ifindex;
        lc.attach_type = kind as u32;
        lc.flags = BPF_F_BEFORE;
    }
    sys_bpf(bpf_cmd::BPF_LINK_CREATE, &mut attr)
}

fn release(ifindex: u32, links: IfaceLinks) {
    let IfaceLinks {
        name,
        links,
        own_clsact,
    } = links;
    // tcx links close with their fd (dropped here); clsact filters are deleted over netlink, which is why this runs in the
    // target namespace.
    if let Links::Clsact(links) = links {
        for link in links {
            if let Err(e) = link.detach() {
                log::warn!("could not detach nattrace's tc program from {name}: {e}");
            }
        }
    }
    // Only when empty: a filter another tool (or another nattrace) added
    // meanwhile keeps it, and with it that filter.
    if own_clsact && super::cleanup::clsact_filters(ifindex).is_ok_and(|f| f.is_empty()) {
        match netns::delete_clsact(ifindex) {
            Ok(()) => super::cleanup::unmark_clsact(ifindex),
            Err(e) => {
                log::warn!("could not remove the clsact qdisc nattrace added to {name}: {e}")
            }
        }
    }
}
