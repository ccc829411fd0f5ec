//! The traced namespace's side of `Tracer::start`: its facts (read on a
//! thread of their own from the start) and the attachments made inside it
//! after the programs loaded.
use std::collections::BTreeSet;

use super::{
    TraceError, TraceOptions, Tracer, attach,
    netns::{self, Netns},
    nf_link,
    table::ProgramSpec,
    tc::Synced,
};
use crate::{facts::NodeFacts, timing};

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
    Ok(links.pod_veths)
}
