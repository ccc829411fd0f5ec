//! The loader: loads nattrace's kernel programs, attaches what the running
//! kernel supports (see [`table`]) in the traced network namespace, and hands
//! out the events, counters and node facts. Dropping the [`Tracer`] detaches
//! everything it attached and removes what it created, nothing else.
mod attach;
mod aya_loader;
pub mod cleanup;
mod held;
pub mod ifnames;
mod kprobes;
mod load;
pub mod netns;
pub mod nf_link;
mod node;
mod receive;
pub mod services;
pub mod table;
mod tc;
mod tp_btf;

use std::{
    collections::BTreeSet,
    io,
    os::fd::{AsFd as _, AsRawFd as _, OwnedFd},
};

use aya::{
    Ebpf,
    maps::{Array, HashMap, MapData, PerCpuArray, RingBuf},
};
use tokio::io::{Interest, unix::AsyncFd};
use tracer_common::{EndpointKey, EndpointState, PacketEvent, hook, stat};

pub use self::{attach::check_load, load::prepare_loader};
use self::{
    netns::{Netns, NetnsError},
    table::{Backend, BackendChoice, ChosenPriority, KernelFeatures},
    tc::{Synced, TcAttachments},
};
use crate::{
    btf::{BtfError, KernelBtf},
    facts::NodeFacts,
    service::Service,
    timing,
};

/// Pod veths from which the start says they are watched by the device
/// tracepoints (every pod veth is: probes/tc.rs).
const SAY_TRACEPOINTS_FROM: usize = 64;

/// How often the reader looks at the ring buffer when the kernel did not wake
/// it. Each look is a timer, an epoll wait and a context switch: at 10 ms
/// those were ~0.6 µs of a healthy connection's ~3.8 in the tracer process
/// (BENCHMARKS.md). The collector's reorder window does not depend on it: the
/// ring is read in reservation order and an event's time is taken after its
/// reservation, so a longer batch holds no older event than a shorter one.
/// A filling buffer still wakes the reader at once (tracer-ebpf emit.rs).
const POLL_INTERVAL: std::time::Duration = std::time::Duration::from_millis(50);

/// The kernel object built by build.rs (aya-build).
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/tracer"));

/// The embedded kernel object, for tests that inspect it without a kernel
/// (tests/stack_depth.rs: what an old verifier would refuse).
pub fn object() -> &'static [u8] {
    OBJECT
}

pub struct TraceOptions {
    pub services: Vec<Service>,
    /// `--netns NAME|PATH`; None = the current namespace.
    pub netns: Option<String>,
    /// Ring-buffer size: a power of two, at least one page.
    pub ringbuf_bytes: u32,
    /// `--backend`.
    pub backend: BackendChoice,
    /// `--all-services`: SERVICES is sized for every Service of a cluster
    /// and `services` may be empty (see [`Tracer::sync_services`]).
    pub all_services: bool,
    /// Hold a pod's TCP handshake in the kernel until it proves healthy or
    /// not (off with `-v`: every packet); see tracer-ebpf/src/held.rs.
    pub buffer: bool,
    /// `--reply-timeout` in ns: the kernel sends a held flow whose reply
    /// comes later than userspace pulls it.
    pub reply_timeout_ns: u64,
    /// `Config::benign_drops`: drop reasons the watch of an established
    /// flow counts instead of sending (`DropReasons::benign_bitmap`).
    pub benign_drops: [u64; 4],
    /// `Config::closed_drops`: drop reasons that end a late segment once
    /// both sides closed (`DropReasons::closed_bitmap`).
    pub closed_drops: [u64; 4],
}

/// `recursion_misses` of a program's fdinfo (kernel/bpf/syscall.c
/// `bpf_prog_show_fdinfo`, 5.12+): raw tracepoint programs are skipped
/// when the same program is already running on the CPU
/// (kernel/trace/bpf_trace.c `__bpf_trace_run`: `prog->active`), kprobe
/// programs when any kprobe program is (`trace_call_bpf`: `bpf_prog_active`).
/// A kfree_skb in a softirq that interrupts the program's run for another
/// drop is never seen. aya 0.14's `ProgramInfo` does not expose the field.
pub fn skipped_runs_of(fdinfo: &str) -> u64 {
    fdinfo
        .lines()
        .find_map(|l| l.strip_prefix("recursion_misses:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// A program of the table that is not running, and why (one line for the CLI).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Skipped {
    pub program: String,
    pub reason: String,
}

/// Kernel-side counters summed over CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct KernelStats {
    pub events: u64,
    /// Events lost because the ring buffer was full.
    pub ringbuf_full: u64,
    pub muted: u64,
    pub flow_map_full: u64,
    pub read_errors: u64,
    /// IPv6 packets whose TCP/UDP header the programs could not reach
    /// (non-first fragments, ESP/AH, more extension headers than walked).
    pub ipv6_unfollowed: u64,
    /// Held events of healthy connections discarded in the kernel.
    pub held_discarded: u64,
    /// Held flows whose buffer filled up and was sent (not a loss).
    pub held_spilled: u64,
    /// Connections sent per packet because the held-flow map was full.
    pub held_map_full: u64,
    /// Runs of the tracing programs the kernel skipped: a program fired on
    /// a CPU where it was already running (a softirq's drop interrupting
    /// a task's), see [`skipped_runs_of`]. Each may have been a traced
    /// packet's event.
    pub skipped_runs: u64,
}

/// See [`Tracer::tc_state`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcState {
    pub mode: &'static str,
    pub attached: usize,
    pub pending: usize,
    pub tracepoints: usize,
    pub skipped: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("needs root (CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON): run it with sudo")]
    NotRoot,
    #[error("cannot read kernel struct layouts: {0}")]
    NoBtf(#[from] BtfError),
    #[error("{0}")]
    NoSuchNetns(NetnsError),
    #[error("invalid option: {0}")]
    Invalid(String),
    #[error("kernel refused: {0}")]
    Kernel(String),
    /// A forced backend this kernel cannot run; names the missing feature.
    #[error("{0}")]
    Unsupported(String),
    /// A netfilter link could not attach (`--backend auto` may fall back
    /// to kprobes on it).
    #[error("{0}")]
    NfAttach(String),
}

impl From<NetnsError> for TraceError {
    fn from(e: NetnsError) -> Self {
        match e {
            NetnsError::NotFound { .. } | NetnsError::Open { .. } | NetnsError::Denied { .. } => {
                TraceError::NoSuchNetns(e)
            }
            other => TraceError::Kernel(other.to_string()),
        }
    }
}

fn kernel_err<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> TraceError + '_ {
    move |e| TraceError::Kernel(format!("{what}: {e}"))
}

pub struct Tracer {
    backend: Backend,
    /// Why this backend (for the preamble).
    backend_reason: String,
    netns: Netns,
    facts: NodeFacts,
    skipped: Vec<Skipped>,
    /// Labels of the non-tc programs attached (netfilter ones with their priority).
    attached: Vec<String>,
    /// The priority each netfilter link got.
    priorities: Vec<ChosenPriority>,
    tc: TcAttachments,
    nf_links: Vec<OwnedFd>,
    ring: Option<RingBuf<MapData>>,
    async_ring: Option<AsyncFd<RingBuf<MapData>>>,
    /// How many records the ring can hold at most: one read takes no more.
    ring_records: usize,
    stats: PerCpuArray<MapData, u64>,
    endpoints: HashMap<MapData, EndpointKey, EndpointState>,
    held: held::HeldMap,
    /// Interfaces with tc attached, for the device tracepoints (main.rs, TC_IFACES).
    tc_ifaces: HashMap<MapData, u32, u8>,
    /// The Service filter, for `--all-services` updates.
    services: services::ServiceMap,
    /// When the receive tracepoint is needed (receive.rs).
    receive: receive::Receive,
    /// The node's pod veths at the last link dump (netns.rs `Links`).
    pod_veths: BTreeSet<u32>,
    // Last: dropping it detaches the raw tracepoints and unloads programs.
    ebpf: Ebpf,
}

/// What every tracing entry point needs before touching the kernel: root,
/// and kernel BTF (offsets come from it). Cheap, so callers can run it before
/// anything else that needs privileges (e.g. the leftover cleanup).
pub fn preflight() -> Result<(), TraceError> {
    if !nix::unistd::geteuid().is_root() {
        return Err(TraceError::NotRoot);
    }
    let vmlinux = std::path::Path::new(crate::btf::VMLINUX_BTF);
    if !vmlinux.exists() {
        return Err(BtfError::NoBtf(vmlinux.to_owned()).into());
    }
    Ok(())
}

impl Tracer {
    pub fn start(opts: &TraceOptions) -> Result<Tracer, TraceError> {
        preflight()?;
        validate(opts)?;
        let kernel = KernelFeatures::probe();
        let (backend, backend_reason) =
            table::choose(opts.backend, &kernel).map_err(TraceError::Unsupported)?;
        match Self::start_backend(opts, &kernel, backend, backend_reason) {
            // Whatever the failed attempt attached was detached when its
            // Tracer dropped.
            Err(TraceError::NfAttach(error)) => {
                match table::fallback_after_nf_attach_failure(opts.backend, &kernel, &error) {
                    Some((backend, reason)) => Self::start_backend(opts, &kernel, backend, reason),
                    None => Err(TraceError::NfAttach(error)),
                }
            }
            other => other,
        }
    }

    fn start_backend(
        opts: &TraceOptions,
        kernel: &KernelFeatures,
        backend: Backend,
        backend_reason: String,
    ) -> Result<Tracer, TraceError> {
        let netns = Netns::open(opts.netns.as_deref())?;
        let reading_facts = node::start_reading_facts(opts.netns.clone());
        let loading = load::start_loader();
        let t = timing::step("kernel BTF: offsets");
        let mut btf = KernelBtf::load()?;
        let offsets = btf.kernel_offsets()?;
        let tp_btf = load::tracepoint_btf(&btf)?;
        let ct_tuples = offsets.sk_buff_nfct != 0 && offsets.nf_conn_tuplehash != 0;
        drop(t);
        log::debug!("kernel {:?}, offsets {offsets:?}", kernel.version);
        let mut ebpf = load::load_object(&loading, opts, offsets, netns.inode)?;

        let (mut plan, mut skipped) = table::plan(backend, kernel, ct_tuples, |name| {
            ebpf.program(name).is_some()
        });
        if backend == Backend::Kprobe {
            kprobes::resolve(&mut plan, &mut skipped, &mut btf);
        }

        // Relocated against aya's maps before any is taken; verified by the
        // kernel on their own thread while the other programs load here.
        let nf_loading = attach::start_netfilter_load(&ebpf, &plan)?;

        let ring =
            RingBuf::try_from(take_map(&mut ebpf, "EVENTS")?).map_err(kernel_err("EVENTS"))?;
        let stats =
            PerCpuArray::try_from(take_map(&mut ebpf, "STATS")?).map_err(kernel_err("STATS"))?;
        let endpoints = HashMap::try_from(take_map(&mut ebpf, "ENDPOINTS")?)
            .map_err(kernel_err("ENDPOINTS"))?;
        let held = held::HeldMap::new(
            HashMap::try_from(take_map(&mut ebpf, "HELD")?).map_err(kernel_err("HELD"))?,
        );
        let tc_ifaces = HashMap::try_from(take_map(&mut ebpf, "TC_IFACES")?)
            .map_err(kernel_err("TC_IFACES"))?;
        let services = services::ServiceMap::new(
            HashMap::try_from(take_map(&mut ebpf, "SERVICES")?).map_err(kernel_err("SERVICES"))?,
            Array::try_from(take_map(&mut ebpf, "ADDR_SLOTS")?)
                .map_err(kernel_err("ADDR_SLOTS"))?,
            crate::service::traced_ports(&opts.services, None),
        );

        let tc_programs = attach::load_tc(&mut ebpf, &plan)?;
        // NATTRACE_FORCE_CLSACT=1 exercises the pre-6.6 path on new kernels (tests).
        let mut tc = TcAttachments::new(
            kernel.tcx && std::env::var_os("NATTRACE_FORCE_CLSACT").is_none(),
            tc_programs,
        );
        let (node, pod_veths) = reading_facts
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))?;
        let netns_inode = netns.inode;
        let facts = NodeFacts {
            netns_inode: netns.inode,
            netns_name: netns.name.clone(),
            ..node
        };
        let (attached, early) = node::load_global_and_attach_tcx(
            &mut ebpf, &plan, &mut tc, &facts, &netns, &pod_veths, &tp_btf,
        );
        // On error `tracer` is dropped, which detaches whatever was attached so far.
        let mut tracer = Tracer {
            backend,
            backend_reason,
            facts,
            netns,
            skipped: Vec::new(),
            attached: Vec::new(),
            priorities: Vec::new(),
            tc,
            nf_links: Vec::new(),
            ring: Some(ring),
            async_ring: None,
            ring_records: ring_records(opts.ringbuf_bytes),
            stats,
            endpoints,
            held,
            tc_ifaces,
            services,
            receive: receive::Receive::new(&plan, netns_inode),
            pod_veths: BTreeSet::new(),
            ebpf,
        };
        tracer.attached = attached?;
        let early = early.transpose()?;
        if let Some(synced) = &early {
            tracer.note_tc(synced);
            skipped.extend(synced.failed.iter().cloned());
        }
        let t = timing::step("waiting for the netfilter programs");
        let nf_programs = attach::finish_netfilter_load(nf_loading)?;
        drop(t);

        let late_tc = early.is_none().then_some(&pod_veths);
        let synced = tracer.attach_in_node(opts, &plan, nf_programs.as_ref(), late_tc)?;
        tracer.note_tc(&synced);
        skipped.extend(synced.failed);
        let nf_labels: Vec<String> = tracer
            .priorities
            .iter()
            .map(|c| format!("{} {}", c.point, c.priority))
            .collect();
        tracer.attached.extend(nf_labels);
        // The netfilter program fds may close now: links keep them alive.
        drop(nf_programs);
        tracer.skipped = skipped;
        tracer.pod_veths = pod_veths;
        // Starts the look at the pods' namespaces; a later tick attaches.
        tracer.check_receive(true);
        log::debug!("attached: {}", tracer.attached().join("; "));
        Ok(tracer)
    }

    pub fn facts(&self) -> &NodeFacts {
        &self.facts
    }

    /// The node's sysctls read again (an established flow went wrong); the
    /// facts keep them. None when the namespace cannot be entered.
    /// conntrack's own counters in the traced namespace (per namespace:
    /// read from inside it).
    pub fn conntrack_stats(&self) -> Option<crate::doctor::conntrack_stats::ConntrackStats> {
        self.netns
            .run(crate::doctor::conntrack_stats::ConntrackStats::read)
            .ok()
            .flatten()
    }

    /// conntrack's table and counters in the traced namespace, read now
    /// (checks/table_full.rs).
    pub fn conntrack_table(&self) -> Option<crate::facts::ConntrackTable> {
        self.netns.run(crate::facts::ConntrackTable::read).ok()
    }

    /// A flow's conntrack entry in the traced namespace, looked up now
    /// (crate::ctnetlink). None when the namespace cannot be entered.
    pub fn ct_lookup(
        &self,
        tuple: crate::ctnetlink::CtTuple,
        unnated: crate::ctnetlink::CtTuple,
    ) -> Option<crate::ctnetlink::CtLookup> {
        self.netns
            .run(move || crate::ctnetlink::lookup(tuple, unnated))
            .ok()
    }

    /// kube-proxy's rules in the traced namespace, read now (blocking:
    /// `iptables-save`/`nft` take milliseconds to a second on a big node).
    pub fn reread_rules(&self) -> crate::ruleset::KubeProxyRules {
        crate::ruleset::read_in(&self.netns)
    }

    pub fn reread_sysctls(&mut self) -> Option<crate::facts::Sysctls> {
        let s = self.netns.run(node::read_sysctls).ok()?;
        self.facts.set_sysctls(s);
        Some(s)
    }

    pub fn skipped(&self) -> &[Skipped] {
        &self.skipped
    }

    pub fn attached(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.tc.has_programs() {
            let pending = match self.tc.pending_count() {
                0 => String::new(),
                n => format!(", {n} more being attached"),
            };
            out.push(format!(
                "tc ingress+egress on {} interfaces of netns {} ({}{pending})",
                self.tc.interface_count(),
                self.facts.netns_name,
                self.tc.mode()
            ));
        }
        let nf: Vec<&str> = self
            .attached
            .iter()
            .filter(|l| {
                !["raw_tp", "tp_btf", "tc", "kprobe"]
                    .iter()
                    .any(|kind| l.starts_with(kind))
            })
            .map(String::as_str)
            .collect();
        if !nf.is_empty() {
            out.push(format!("netfilter links: {}", nf.join(", ")));
        }
        out.extend(
            self.attached
                .iter()
                .filter(|l| {
                    ["raw_tp", "tp_btf", "kprobe"]
                        .iter()
                        .any(|kind| l.starts_with(kind))
                })
                .cloned(),
        );
        out
    }

    /// The priority each netfilter link got (empty with the kprobe backend).
    pub fn priorities(&self) -> &[ChosenPriority] {
        &self.priorities
    }

    pub fn backend(&self) -> &'static str {
        self.backend.name()
    }

    /// Why [`backend`](Self::backend) was chosen, e.g. "no BPF netfilter links before 6.4".
    pub fn backend_reason(&self) -> &str {
        &self.backend_reason
    }

    /// Waits until the kernel has written events, then drains them into `out`.
    pub async fn next_events(&mut self, out: &mut Vec<PacketEvent>) -> io::Result<()> {
        let inode = self.facts.netns_inode;
        let max = self.ring_records;
        if self.async_ring.is_none() {
            // Created here, not in start(): AsyncFd needs a running tokio reactor.
            let ring = self.ring.take().expect("ring buffer present");
            // SAFETY: the RingBuf owns its map fd (MapData holds the OwnedFd)
            // and never replaces it, so the fd stays valid and the same for
            // the AsyncFd's whole life.
            match unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) } {
                Ok(fd) => self.async_ring = Some(fd),
                Err(e) => {
                    let (ring, error) = e.into_parts();
                    self.ring = Some(ring);
                    return Err(error);
                }
            }
        }
        let ring = self.async_ring.as_mut().expect("just set");
        let before = out.len();
        loop {
            drain_ring(ring.get_mut(), out, inode, max);
            if out.len() > before {
                return Ok(());
            }
            // The kernel wakes us only when the buffer is filling up
            // (filter.rs, wakeup_flag): otherwise look every POLL_INTERVAL.
            tokio::select! {
                guard = ring.readable_mut() => {
                    let mut guard = guard?;
                    drain_ring(guard.get_inner_mut(), out, inode, max);
                    guard.clear_ready();
                    // Events committed between the drain and clear_ready
                    // raised no new edge: pick them up now.
                    drain_ring(guard.get_inner_mut(), out, inode, max);
                    if out.len() > before {
                        return Ok(());
                    }
                }
                _ = tokio::time::sleep(POLL_INTERVAL) => {}
            }
        }
    }

    /// Whatever is in the ring buffer now, without waiting.
    pub fn drain(&mut self, out: &mut Vec<PacketEvent>) {
        let inode = self.facts.netns_inode;
        let max = self.ring_records;
        if let Some(ring) = self.ring.as_mut() {
            drain_ring(ring, out, inode, max);
        } else if let Some(ring) = self.async_ring.as_mut() {
            drain_ring(ring.get_mut(), out, inode, max);
        }
    }

    pub fn stats(&self) -> KernelStats {
        let sum = |index: u32| -> u64 {
            self.stats
                .get(&index, 0)
                .map(|values| values.iter().sum())
                .unwrap_or(0)
        };
        KernelStats {
            events: sum(stat::EVENTS),
            ringbuf_full: sum(stat::RINGBUF_FULL),
            muted: sum(stat::MUTED_PACKETS),
            flow_map_full: sum(stat::FLOW_MAP_FULL),
            read_errors: sum(stat::READ_ERRORS),
            ipv6_unfollowed: sum(stat::IPV6_UNFOLLOWED),
            held_discarded: sum(stat::HELD_DISCARDED),
            held_spilled: sum(stat::HELD_SPILLED),
            held_map_full: sum(stat::HELD_MAP_FULL),
            skipped_runs: self.skipped_runs(),
        }
    }

    fn skipped_runs(&self) -> u64 {
        self.ebpf
            .programs()
            .filter_map(|(_, p)| p.fd().ok())
            .filter_map(|fd| {
                let path = format!("/proc/self/fdinfo/{}", fd.as_fd().as_raw_fd());
                std::fs::read_to_string(path).ok()
            })
            .map(|info| skipped_runs_of(&info))
            .sum()
    }

    /// From now on, plain data packets of this flow are only counted
    /// (KernelStats::muted); SYN, RST and drops are still reported.
    pub fn mute(&mut self, client: EndpointKey) -> Result<(), TraceError> {
        let mut state = match self.endpoints.get(&client, 0) {
            Ok(state) => state,
            // Evicted or never seen: nothing to mute.
            Err(aya::maps::MapError::KeyNotFound) => return Ok(()),
            Err(e) => return Err(TraceError::Kernel(format!("ENDPOINTS lookup: {e}"))),
        };
        if state.muted != 0 {
            // Already muted by the kernel (tracer-ebpf/src/filter.rs).
            return Ok(());
        }
        state.muted = 1;
        self.endpoints
            .insert(client, state, 0)
            .map_err(|e| TraceError::Kernel(format!("ENDPOINTS update: {e}")))
    }

    /// Makes the kernel's Service filter trace exactly `wanted` (the
    /// `--svc` ports and kube-proxy's), changing only the difference.
    pub fn sync_services(
        &mut self,
        wanted: &BTreeSet<crate::service::ServicePort>,
    ) -> services::ServicesSynced {
        self.services.sync(wanted)
    }

    /// tc's attachment state, for metrics: (mode, attached, being attached,
    /// watched by device tracepoints instead, programs that failed).
    pub fn tc_state(&self) -> TcState {
        TcState {
            mode: self.tc.mode(),
            attached: self.tc.interface_count(),
            pending: self.tc.pending_count(),
            tracepoints: self.tc.tracepoint_count(),
            skipped: self.skipped.len(),
        }
    }

    /// Service ports the kernel matches now.
    pub fn traced_services(&self) -> usize {
        self.services.len()
    }

    /// Attaches tc to interfaces that appeared since the last call (a new
    /// pod's veth) and returns their names.
    pub fn poll_new_interfaces(&mut self) -> Result<Vec<String>, TraceError> {
        let Tracer {
            netns,
            facts,
            tc,
            ebpf,
            ..
        } = self;
        let (synced, pod_veths) = netns.run(|| -> Result<_, TraceError> {
            let links = netns::list_links()?;
            facts.interfaces = links.interfaces;
            Ok((
                tc.sync(ebpf, &facts.interfaces, &links.pod_veths),
                links.pod_veths,
            ))
        })??;
        self.pod_veths = pod_veths;
        let mut names = self.note_tc(&synced);
        names.extend(self.check_receive(true));
        Ok(names)
    }

    /// Attaches the receive tracepoint once a device needs it (receive.rs);
    /// returns its label then. Not while tc is still being attached in the
    /// background: its interfaces are not uncovered, only not done yet.
    /// `look`: also start the next look at new pods' namespaces.
    fn check_receive(&mut self, look: bool) -> Option<String> {
        // Called every tick: once attached, not even the interface scan.
        if !self.receive.wanted() {
            return None;
        }
        let in_node = if self.tc.pending_count() == 0 {
            self.facts
                .interfaces
                .iter()
                .find(|i| receive::unpaired(i) && !self.tc.covers(i.ifindex))
        } else {
            None
        };
        let (spec, why) = self
            .receive
            .due(&self.netns, &self.pod_veths, in_node, look)?;
        match attach::attach_unpaired_receive(&mut self.ebpf, spec) {
            Ok(()) => {
                self.receive.done();
                let label = format!("{} (for {why})", spec.label);
                log::debug!("attached {label}");
                self.attached.push(label.clone());
                Some(label)
            }
            Err(e) => {
                // Said once: the next poll would fail the same way.
                self.receive.done();
                log::warn!("{}: {e}", spec.label);
                None
            }
        }
    }

    /// Takes in the tc links a background attach finished (start-up with
    /// many interfaces); cheap, call it often.
    /// Returns how many interfaces were attached now.
    pub fn collect_tc(&mut self) -> usize {
        let synced = self.tc.collect(false);
        self.note_tc(&synced).len()
    }

    /// The receive tracepoint's label if a finished look at the pods'
    /// namespaces just had it attached; cheap, call it often.
    pub fn collect_receive(&mut self) -> Option<String> {
        self.check_receive(false)
    }

    /// On a big node, how tc and the device tracepoints share the
    /// interfaces (probes/tc.rs): one line for the start; None when tc is
    /// on every interface.
    pub fn tc_split_note(&self) -> Option<String> {
        match self.tc.tracepoint_count() {
            // Said where it explains a fast exit on a big node; on a small
            // one it would be one more start line for nothing.
            m if m < SAY_TRACEPOINTS_FROM => None,
            m => Some(format!(
                "tc on {} node interfaces; {m} pod veths watched by device tracepoints",
                self.tc_interface_count()
            )),
        }
    }

    /// Interfaces with tc links (or filters) now: what detaching costs.
    pub fn tc_interface_count(&self) -> usize {
        self.tc.interface_count() + self.tc.pending_count()
    }

    /// Tells the kernel which interfaces tc covers now, records failures,
    /// and returns the names of the interfaces attached.
    fn note_tc(&mut self, synced: &Synced) -> Vec<String> {
        for ifindex in &synced.gone {
            let _ = self.tc_ifaces.remove(ifindex);
        }
        let mut names = Vec::new();
        for (name, ifindex) in &synced.added {
            if let Err(e) = self.tc_ifaces.insert(ifindex, 1, 0) {
                log::warn!("TC_IFACES update for {name}: {e}");
            }
            names.push(name.clone());
        }
        for f in &synced.failed {
            log::warn!("{}: {}", f.program, f.reason);
            if !self.skipped.contains(f) {
                self.skipped.push(f.clone());
            }
        }
        names
    }
}

impl Drop for Tracer {
    fn drop(&mut self) {
        let Tracer { netns, tc, .. } = self;
        if let Err(e) = netns.run(|| tc.detach_all()) {
            log::warn!("could not detach tc programs: {e}");
        }
        // Netfilter links detach when their fds close; the raw tracepoints
        // and programs go with `ebpf`.
        self.nf_links.clear();
    }
}

fn validate(opts: &TraceOptions) -> Result<(), TraceError> {
    if opts.services.is_empty() && !opts.all_services {
        return Err(TraceError::Invalid(
            "no Service to trace: pass --svc IP[:PORT] or --all-services".into(),
        ));
    }
    if opts.services.len() > 255 {
        return Err(TraceError::Invalid(format!(
            "{} Services given, at most 255 can be traced at once",
            opts.services.len()
        )));
    }
    let b = opts.ringbuf_bytes;
    if !b.is_power_of_two() || b < 4096 {
        return Err(TraceError::Invalid(format!(
            "ring buffer size {b} must be a power of two of at least 4096 bytes (e.g. 4194304)"
        )));
    }
    Ok(())
}

fn load_error(name: &str, e: aya::programs::ProgramError) -> TraceError {
    // The verifier log is long; keep the error one line and log the rest.
    log::error!("{name}: {e:?}");
    TraceError::Kernel(format!("cannot load program {name}: {e}"))
}

fn take_map(ebpf: &mut Ebpf, name: &str) -> Result<aya::maps::Map, TraceError> {
    ebpf.take_map(name)
        .ok_or_else(|| TraceError::Kernel(format!("map {name} missing from the eBPF object")))
}

/// tc and netfilter programs run only in the traced namespace and leave
/// netns 0; a drop without a device has no namespace to report.
fn fill_node_netns(ev: &mut PacketEvent, netns_inode: u32) {
    if ev.netns == 0 && !(ev.hook == hook::DROP && ev.ifindex == 0) {
        ev.netns = netns_inode;
    }
}

/// The most records a ring of `bytes` can hold (each has an 8-byte header
/// and at least one event). One read takes no more than that: everything
/// in the ring when the read began, never what the kernel writes meanwhile.
/// Reading until the ring is empty never ended while the kernel wrote
/// faster than the collector decided (the read runs before the decisions):
/// the batch grew without bound and no signal or `--duration` was seen
/// (measured: a `--duration 3` trace under a SYN flood on a loaded 2-core
/// VM ran for 85–150 s). A bounded read returns to the event loop, which
/// then sees the clock and the signals; the rest is read on its next turn.
fn ring_records(bytes: u32) -> usize {
    (bytes as usize / (8 + size_of::<PacketEvent>())).max(1)
}

fn drain_ring(
    ring: &mut RingBuf<MapData>,
    out: &mut Vec<PacketEvent>,
    netns_inode: u32,
    max_records: usize,
) {
    for _ in 0..max_records {
        let Some(item) = ring.next() else {
            break;
        };
        // One event, or a flushed flow buffer: several in one record
        // (tracer-ebpf/src/held.rs).
        for chunk in item.chunks_exact(size_of::<PacketEvent>()) {
            // SAFETY: the kernel wrote a PacketEvent (repr(C), any bit pattern valid).
            let mut ev: PacketEvent = unsafe { std::ptr::read_unaligned(chunk.as_ptr().cast()) };
            fill_node_netns(&mut ev, netns_inode);
            out.push(ev);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::skipped_runs_of;

    #[test]
    fn skipped_runs_come_from_the_programs_fdinfo() {
        // As 6.18 prints it for a raw tracepoint program.
        let info = "pos:\t0\nflags:\t02000002\nmnt_id:\t16\nino:\t2071\nprog_type:\t17\n\
                    prog_jited:\t1\nprog_tag:\t6c5d1e5b1f7b3e4d\nmemlock:\t8192\nprog_id:\t97\n\
                    run_time_ns:\t0\nrun_cnt:\t0\nrecursion_misses:\t3\nverified_insns:\t412\n";
        assert_eq!(skipped_runs_of(info), 3);
        // Before 5.12 there is no such line: none known.
        assert_eq!(skipped_runs_of("prog_type:\t17\nprog_id:\t97\n"), 0);
    }
}
