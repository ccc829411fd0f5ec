//! The traced namespace's side of `Tracer::start`: its facts (read on a
//! thread of their own from the start) and the attachments made inside it
//! after the programs loaded.
use std::collections::BTreeSet;

use aya::Ebpf;

use super::{
    TraceError, TraceOptions, Tracer, attach,
    netns::{self, Netns, NetnsError},
    nf_link,
    table::ProgramSpec,
    tc::{Synced, TcAttachments},
};
use crate::{facts::NodeFacts, timing};

/// The tc links made early, or why the namespace could not be entered.
pub(super) type TcxSynced = Result<Synced, NetnsError>;

/// Loads and attaches the tracepoint (kprobe) programs here while, with
/// tcx, a thread makes the tc links: each waits for an RCU grace period
/// (tc.rs), time the verifier fills. The scope ends that thread before the
/// caller's `ebpf`, whose program fds it uses, could drop. The second result
/// is None when tc is left to [`Tracer::attach_in_node`] (clsact).
pub(super) fn load_global_and_attach_tcx(
    ebpf: &mut Ebpf,
    plan: &[&'static ProgramSpec],
    tc: &mut TcAttachments,
    facts: &NodeFacts,
    netns: &Netns,
    pod_veths: &BTreeSet<u32>,
    btf: &aya::Btf,
) -> (Result<Vec<String>, TraceError>, Option<TcxSynced>) {
    let tcx_programs = tc.is_tcx().then(|| tc.tcx_programs(ebpf).ok()).flatten();
    std::thread::scope(|s| {
        let early = tcx_programs.map(|programs| {
            s.spawn(move || {
                let _t = timing::step("tcx links (own thread)");
                netns.run(|| tc.sync_tcx(programs, &facts.interfaces, pod_veths))
            })
        });
        let t = timing::step("tracepoint/kprobe programs: load + verify + attach");
        let attached = attach::load_global(ebpf, plan, btf);
        drop(t);
        let early = early.map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
        (attached, early)
    })
}

impl Tracer {
    /// What is namespace-scoped and not done yet, in one visit to the
    /// traced namespace: the netfilter links, and with `late_tc` (the pod
    /// veths: clsact, or tcx programs that could not be prepared early) tc.
    pub(super) fn attach_in_node(
        &mut self,
        opts: &TraceOptions,
        plan: &[&'static ProgramSpec],
        nf_programs: Option<&nf_link::NfPrograms>,
        late_tc: Option<&BTreeSet<u32>>,
    ) -> Result<Synced, TraceError> {
        let Tracer {
            netns,
            facts,
            tc,
            nf_links,
            priorities,
            ebpf,
            ..
        } = self;
        let _t = timing::step("in the node netns: netfilter links (+ tc if clsact)");
        netns.run(|| -> Result<Synced, TraceError> {
            // Netfilter before clsact filters: a full priority window ends
            // the attempt (or switches `auto` to kprobes) before they touched
            // any interface. tcx links made early are detached with the
            // dropped Tracer then.
            if let Some(nf) = nf_programs {
                attach::attach_netfilter(
                    nf,
                    plan,
                    attach::nf_families(&opts.services),
                    nf_links,
                    priorities,
                )?;
            }
            Ok(match late_tc {
                Some(pod_veths) => tc.sync(ebpf, &facts.interfaces, pod_veths),
                None => Synced::default(),
            })
        })?
    }
}

/// [`read_facts`] on a thread of its own, from the start: one netlink dump
/// of every link (20-70 ms with 200 pods on a busy VM) off the way to tc.
pub(super) fn start_reading_facts(
    spec: Option<String>,
) -> std::thread::JoinHandle<Result<(NodeFacts, BTreeSet<u32>), TraceError>> {
    std::thread::spawn(move || {
        let _t = timing::step("node facts: link dump, sysctls (own thread)");
        let netns = Netns::open(spec.as_deref())?;
        let mut facts = NodeFacts::default();
        let pod_veths = netns.run(|| read_facts(&mut facts))??;
        Ok((facts, pod_veths))
    })
}

/// The namespace's sysctls now (an established flow went wrong: they may
/// have changed since start); runs inside it.
pub(super) fn read_sysctls() -> crate::facts::Sysctls {
    crate::facts::Sysctls {
        bridge_nf_call_iptables: netns::read_sysctl_bool(
            "/proc/sys/net/bridge/bridge-nf-call-iptables",
        ),
        bridge_nf_call_ip6tables: netns::read_sysctl_bool(
            "/proc/sys/net/bridge/bridge-nf-call-ip6tables",
        ),
        ip_forward: netns::read_sysctl_bool("/proc/sys/net/ipv4/ip_forward"),
    }
}

/// Reads the namespace's facts; runs inside it (/proc/sys/net is per thread
/// netns). Returns its pod veths (for tc).
pub(super) fn read_facts(facts: &mut NodeFacts) -> Result<BTreeSet<u32>, TraceError> {
    let links = netns::list_links()?;
    facts.interfaces = links.interfaces;
    facts.bridge_nf_call_iptables =
        netns::read_sysctl_bool("/proc/sys/net/bridge/bridge-nf-call-iptables");
    facts.ip_forward = netns::read_sysctl_bool("/proc/sys/net/ipv4/ip_forward");
    facts.bridge_nf_call_ip6tables =
        netns::read_sysctl_bool("/proc/sys/net/bridge/bridge-nf-call-ip6tables");
    facts.conntrack = Some(crate::facts::ConntrackTable::read());
    Ok(links.pod_veths)
}
