//! tc attachments on the interfaces of the traced namespace. Every method
//! here must run inside that namespace (see [`super::netns::Netns::run`]):
//! aya resolves interface names and opens its netlink sockets in the calling
//! thread's namespace, and so does detaching a clsact filter.
use std::collections::BTreeMap;

use aya::{
    Ebpf,
    programs::{
        Link, LinkOrder, SchedClassifier, TcAttachType,
        tc::{NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle},
    },
};

use super::{Skipped, netns};
use crate::facts::Interface;

struct IfaceLinks {
    name: String,
    links: Vec<SchedClassifierLink>,
    /// We added the clsact qdisc (pre-6.6 kernels), so we remove it.
    own_clsact: bool,
}

pub struct TcAttachments {
    tcx: bool,
    programs: Vec<(&'static str, TcAttachType)>,
    ifaces: BTreeMap<u32, IfaceLinks>,
}

impl TcAttachments {
    pub fn new(tcx: bool, programs: Vec<(&'static str, TcAttachType)>) -> Self {
        TcAttachments {
            tcx,
            programs,
            ifaces: BTreeMap::new(),
        }
    }

    pub fn mode(&self) -> &'static str {
        if self.tcx { "tcx" } else { "clsact" }
    }

    pub fn interface_count(&self) -> usize {
        self.ifaces.len()
    }

    pub fn has_programs(&self) -> bool {
        !self.programs.is_empty()
    }

    fn attach_one(&self, ebpf: &mut Ebpf, iface: &Interface) -> Result<IfaceLinks, String> {
        let mut done = IfaceLinks {
            name: iface.name.clone(),
            links: Vec::new(),
            own_clsact: false,
        };
        if !self.tcx {
            done.own_clsact = netns::add_clsact(iface.ifindex).map_err(|e| e.to_string())?;
        }
        for &(name, attach_type) in &self.programs {
            let result = (|| {
                let prog: &mut SchedClassifier = ebpf
                    .program_mut(name)
                    .ok_or("program missing from object")?
                    .try_into()
                    .map_err(|e| format!("{e}"))?;
                let options = if self.tcx {
                    // First in the chain, so we see the packet before a CNI
                    // program redirects or rewrites it; we always pass it on.
                    TcAttachOptions::TcxOrder(LinkOrder::first())
                } else {
                    // A handle nobody else uses marks the filter as ours, so
                    // a later run can remove it if this one is SIGKILLed.
                    TcAttachOptions::Netlink(NlOptions {
                        handle: TcHandle::from(super::cleanup::FILTER_HANDLE),
                        ..NlOptions::default()
                    })
                };
                let id = prog
                    .attach_with_options(&iface.name, attach_type, options)
                    .map_err(|e| format!("{e}"))?;
                prog.take_link(id).map_err(|e| format!("{e}"))
            })();
            match result {
                Ok(link) => done.links.push(link),
                Err(e) => {
                    release(iface.ifindex, done);
                    return Err(e);
                }
            }
        }
        Ok(done)
    }

    /// Attaches to every interface in `ifaces` not attached yet and forgets
    /// those that disappeared. Returns the newly attached names and one
    /// Skipped per interface that could not be attached.
    pub fn sync(&mut self, ebpf: &mut Ebpf, ifaces: &[Interface]) -> (Vec<String>, Vec<Skipped>) {
        let mut added = Vec::new();
        let mut failed = Vec::new();
        let gone: Vec<u32> = self
            .ifaces
            .keys()
            .filter(|i| !ifaces.iter().any(|f| f.ifindex == **i))
            .copied()
            .collect();
        for ifindex in gone {
            if let Some(links) = self.ifaces.remove(&ifindex) {
                log::debug!("interface {} is gone", links.name);
                // The kernel already removed the device's filters/qdisc.
                drop(links.links);
            }
        }
        for iface in ifaces {
            if self.ifaces.contains_key(&iface.ifindex) {
                continue;
            }
            match self.attach_one(ebpf, iface) {
                Ok(links) => {
                    added.push(iface.name.clone());
                    self.ifaces.insert(iface.ifindex, links);
                }
                Err(reason) => failed.push(Skipped {
                    program: format!("tc on {}", iface.name),
                    reason,
                }),
            }
        }
        (added, failed)
    }

    pub fn detach_all(&mut self) {
        for (ifindex, links) in std::mem::take(&mut self.ifaces) {
            release(ifindex, links);
        }
    }
}

fn release(ifindex: u32, links: IfaceLinks) {
    let IfaceLinks {
        name,
        links,
        own_clsact,
    } = links;
    // tcx links close with their fd; clsact filters are deleted over netlink,
    // which is why this runs in the target namespace.
    for link in links {
        if let Err(e) = link.detach() {
            log::warn!("could not detach nattrace's tc program from {name}: {e}");
        }
    }
    if own_clsact && let Err(e) = netns::delete_clsact(ifindex) {
        log::warn!("could not remove the clsact qdisc nattrace added to {name}: {e}");
    }
}
