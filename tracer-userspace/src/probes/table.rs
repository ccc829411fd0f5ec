//! Every kernel program nattrace knows, what it attaches to, which backend
//! uses it, and what it needs from the running kernel. The loader walks this
//! table once; rows whose needs are not met become one [`Skipped`] line each.
use std::path::Path;

use aya::{programs::TcAttachType, util::KernelVersion};
use tracer_common::nf_hook;

use super::Skipped;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// tc + BPF netfilter links + raw tracepoints (kernel >= 6.4).
    Netfilter,
    /// tc + kprobes on nf_hook_slow / nf_nat_manip_pkt / br_forward + raw tracepoints.
    Kprobe,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Netfilter => "netfilter",
            Backend::Kprobe => "kprobe",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attach {
    /// On every interface of the traced namespace (tcx, or clsact before 6.6).
    Tc(TcAttachType),
    /// A netfilter hook of the traced namespace (IPv4).
    Netfilter { hook: u8, priority: i32 },
    /// Global raw tracepoint.
    RawTracepoint(&'static str),
    /// Kernel function entry, global. With `unless`, only when the kernel
    /// lacks that symbol (a fallback for an older kernel's function).
    Kprobe {
        symbol: &'static str,
        unless: Option<&'static str>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// Always satisfiable: tcx on >= 6.6, else a clsact qdisc.
    Tc,
    NetfilterLink,
    Kprobes,
    RawTracepoint,
}

pub struct ProgramSpec {
    /// Function name in the eBPF object.
    pub name: &'static str,
    pub attach: Attach,
    pub backends: &'static [Backend],
    pub need: Need,
    /// Short label for the preamble.
    pub label: &'static str,
}

const BOTH: &[Backend] = &[Backend::Netfilter, Backend::Kprobe];
const NF: &[Backend] = &[Backend::Netfilter];
const KP: &[Backend] = &[Backend::Kprobe];

// NAT brackets: conntrack runs at -200, DNAT at -100 (PREROUTING/OUTPUT),
// SNAT at 100 (POSTROUTING/INPUT).
const fn nf(name: &'static str, hook: u8, priority: i32, label: &'static str) -> ProgramSpec {
    ProgramSpec {
        name,
        attach: Attach::Netfilter { hook, priority },
        backends: NF,
        need: Need::NetfilterLink,
        label,
    }
}

pub const PROGRAMS: &[ProgramSpec] = &[
    ProgramSpec {
        name: "tc_ingress",
        attach: Attach::Tc(TcAttachType::Ingress),
        backends: BOTH,
        need: Need::Tc,
        label: "tc ingress",
    },
    ProgramSpec {
        name: "tc_egress",
        attach: Attach::Tc(TcAttachType::Egress),
        backends: BOTH,
        need: Need::Tc,
        label: "tc egress",
    },
    nf(
        "nf_pre_before",
        nf_hook::PRE_ROUTING,
        -150,
        "PREROUTING -150",
    ),
    nf("nf_pre_after", nf_hook::PRE_ROUTING, -99, "PREROUTING -99"),
    nf("nf_out_before", nf_hook::LOCAL_OUT, -150, "OUTPUT -150"),
    nf("nf_out_after", nf_hook::LOCAL_OUT, -99, "OUTPUT -99"),
    nf("nf_fwd", nf_hook::FORWARD, 0, "FORWARD 0"),
    nf(
        "nf_post_before",
        nf_hook::POST_ROUTING,
        99,
        "POSTROUTING 99",
    ),
    nf(
        "nf_post_after",
        nf_hook::POST_ROUTING,
        101,
        "POSTROUTING 101",
    ),
    nf("nf_in_before", nf_hook::LOCAL_IN, 99, "INPUT 99"),
    nf("nf_in_after", nf_hook::LOCAL_IN, 101, "INPUT 101"),
    ProgramSpec {
        name: "netif_receive_skb",
        attach: Attach::RawTracepoint("netif_receive_skb"),
        backends: BOTH,
        need: Need::RawTracepoint,
        label: "raw_tp netif_receive_skb",
    },
    ProgramSpec {
        name: "net_dev_start_xmit",
        attach: Attach::RawTracepoint("net_dev_start_xmit"),
        backends: BOTH,
        need: Need::RawTracepoint,
        label: "raw_tp net_dev_start_xmit",
    },
    ProgramSpec {
        name: "kfree_skb",
        attach: Attach::RawTracepoint("kfree_skb"),
        backends: BOTH,
        need: Need::RawTracepoint,
        label: "raw_tp kfree_skb",
    },
    // nf_hook_slow first: the NAT probes read the hook it records.
    kp(
        "kp_nf_hook_slow",
        "nf_hook_slow",
        None,
        "kprobe nf_hook_slow",
    ),
    kp(
        "kp_nf_nat_manip_pkt",
        "nf_nat_manip_pkt",
        None,
        "kprobe nf_nat_manip_pkt",
    ),
    // nf_nat_manip_pkt exists since 5.1; before, the rewrite is only
    // reachable through nf_nat_packet.
    kp(
        "kp_nf_nat_packet",
        "nf_nat_packet",
        Some("nf_nat_manip_pkt"),
        "kprobe nf_nat_packet",
    ),
    kp("kp_br_forward", "br_forward", None, "kprobe br_forward"),
];

const fn kp(
    name: &'static str,
    symbol: &'static str,
    unless: Option<&'static str>,
    label: &'static str,
) -> ProgramSpec {
    ProgramSpec {
        name,
        attach: Attach::Kprobe { symbol, unless },
        backends: KP,
        need: Need::Kprobes,
        label,
    }
}

/// `--backend`: which one the user asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackendChoice {
    #[default]
    Auto,
    Netfilter,
    Kprobe,
}

/// The backend to run and why (for the preamble), or why the forced one
/// cannot run here (one line, naming the missing kernel feature).
pub fn choose(choice: BackendChoice, kernel: &KernelFeatures) -> Result<(Backend, String), String> {
    let nf = kernel.check(Need::NetfilterLink);
    let kp = kernel.check(Need::Kprobes);
    match choice {
        BackendChoice::Netfilter => nf
            .map(|()| (Backend::Netfilter, "forced with --backend".to_owned()))
            .map_err(|_| {
                "BPF netfilter links not available in this kernel (needs >= 6.4)".to_owned()
            }),
        BackendChoice::Kprobe => kp
            .map(|()| (Backend::Kprobe, "forced with --backend".to_owned()))
            .map_err(|_| "kprobes not available in this kernel (CONFIG_KPROBES)".to_owned()),
        BackendChoice::Auto => Ok(match (nf, kp) {
            (Ok(()), _) => (
                Backend::Netfilter,
                "BPF netfilter links available".to_owned(),
            ),
            (Err(_), Ok(())) => (
                Backend::Kprobe,
                "no BPF netfilter links before 6.4".to_owned(),
            ),
            // tc and the tracepoints still show where packets went.
            (Err(_), Err(_)) => (
                Backend::Netfilter,
                "no BPF netfilter links before 6.4 and no kprobes: tc and tracepoints only"
                    .to_owned(),
            ),
        }),
    }
}

/// What the running kernel offers, probed once at start.
#[derive(Clone, Copy, Debug)]
pub struct KernelFeatures {
    pub version: (u8, u8, u16),
    pub kprobes: bool,
    pub tcx: bool,
    pub netfilter_links: bool,
}

impl KernelFeatures {
    pub fn probe() -> Self {
        // LINUX_VERSION_CODE layout: major << 16 | minor << 8 | patch.
        let version = KernelVersion::current()
            .map(|v| {
                let c = v.code();
                ((c >> 16) as u8, (c >> 8) as u8, (c & 0xff) as u16)
            })
            .unwrap_or((0, 0, 0));
        let mut features = Self::from_parts(
            version,
            // aya attaches kprobes through this PMU; it is missing when
            // CONFIG_KPROBES is off (these build machines).
            Path::new("/sys/bus/event_source/devices/kprobe/type").exists(),
        );
        // Distributions backport BPF netfilter links: ask the kernel rather
        // than trust the version.
        if let Some(loads) = super::nf_link::probe_support() {
            features.netfilter_links = loads;
        }
        features
    }

    pub fn from_parts(version: (u8, u8, u16), kprobes: bool) -> Self {
        KernelFeatures {
            version,
            kprobes,
            tcx: version >= (6, 6, 0),
            netfilter_links: (version.0, version.1) >= (6, 4),
        }
    }

    /// Err = one human reason why `need` is not met.
    pub fn check(&self, need: Need) -> Result<(), String> {
        match need {
            Need::Tc | Need::RawTracepoint => Ok(()),
            Need::NetfilterLink if self.netfilter_links => Ok(()),
            Need::NetfilterLink => Err("BPF netfilter links need kernel >= 6.4".to_owned()),
            Need::Kprobes if self.kprobes => Ok(()),
            Need::Kprobes => Err(
                "kprobes not available in this kernel (CONFIG_KPROBES; no /sys/bus/event_source/devices/kprobe/type)"
                    .to_owned(),
            ),
        }
    }
}

/// Rows of `backend` that this kernel can run, plus one Skipped per row it cannot.
pub fn plan(
    backend: Backend,
    kernel: &KernelFeatures,
    in_object: impl Fn(&str) -> bool,
) -> (Vec<&'static ProgramSpec>, Vec<Skipped>) {
    let mut run = Vec::new();
    let mut skipped = Vec::new();
    for spec in PROGRAMS.iter().filter(|p| p.backends.contains(&backend)) {
        let verdict = kernel.check(spec.need).and_then(|()| {
            if in_object(spec.name) {
                Ok(())
            } else {
                Err("not built into this nattrace (not implemented yet)".to_owned())
            }
        });
        match verdict {
            Ok(()) => run.push(spec),
            Err(reason) => skipped.push(Skipped {
                program: spec.label.to_owned(),
                reason,
            }),
        }
    }
    (run, skipped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn old_kernel_skips_netfilter_links_with_a_reason() {
        let k = KernelFeatures::from_parts((6, 1, 0), true);
        let (run, skipped) = plan(Backend::Netfilter, &k, |_| true);
        assert!(run.iter().all(|p| p.need != Need::NetfilterLink));
        assert_eq!(skipped.len(), 9);
        assert!(skipped[0].reason.contains("6.4"));
        assert!(!k.tcx);
    }

    #[test]
    fn new_kernel_runs_everything_of_the_netfilter_backend() {
        let k = KernelFeatures::from_parts((6, 18, 0), false);
        let (run, skipped) = plan(Backend::Netfilter, &k, |_| true);
        assert_eq!(run.len(), 14);
        assert!(skipped.is_empty());
        assert!(k.tcx);
    }

    #[test]
    fn kprobe_backend_without_kprobes_says_why() {
        let k = KernelFeatures::from_parts((6, 18, 0), false);
        let (_, skipped) = plan(Backend::Kprobe, &k, |_| true);
        assert_eq!(skipped.len(), 4);
        assert!(skipped.iter().all(|s| s.reason.contains("CONFIG_KPROBES")));
    }

    #[test]
    fn backend_choice() {
        let host = KernelFeatures::from_parts((6, 18, 0), false);
        let old = KernelFeatures::from_parts((6, 1, 0), true);
        let mid = KernelFeatures::from_parts((6, 12, 0), true);
        let bare = KernelFeatures::from_parts((5, 10, 0), false);
        let pick = |c, k: &KernelFeatures| choose(c, k).map(|(b, _)| b);
        assert_eq!(pick(BackendChoice::Auto, &host), Ok(Backend::Netfilter));
        assert_eq!(pick(BackendChoice::Auto, &mid), Ok(Backend::Netfilter));
        let (b, why) = choose(BackendChoice::Auto, &old).unwrap();
        assert_eq!(b, Backend::Kprobe);
        assert!(why.contains("6.4"), "{why}");
        assert_eq!(pick(BackendChoice::Auto, &bare), Ok(Backend::Netfilter));
        assert_eq!(
            choose(BackendChoice::Kprobe, &host).unwrap_err(),
            "kprobes not available in this kernel (CONFIG_KPROBES)"
        );
        assert_eq!(pick(BackendChoice::Kprobe, &mid), Ok(Backend::Kprobe));
        assert!(
            choose(BackendChoice::Netfilter, &old)
                .unwrap_err()
                .contains("6.4")
        );
    }

    #[test]
    fn kprobe_backend_on_old_kernel_plans_tc_tracepoints_and_kprobes() {
        let k = KernelFeatures::from_parts((6, 1, 0), true);
        let (run, skipped) = plan(Backend::Kprobe, &k, |_| true);
        assert!(skipped.is_empty());
        assert_eq!(run.len(), 9);
        // nf_hook_slow must be attached before the NAT probes that read its slot.
        let first_kp = run
            .iter()
            .position(|p| matches!(p.attach, Attach::Kprobe { .. }))
            .unwrap();
        assert_eq!(run[first_kp].name, "kp_nf_hook_slow");
    }

    #[test]
    fn table_names_are_unique() {
        let mut names: Vec<_> = PROGRAMS.iter().map(|p| p.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), PROGRAMS.len());
    }
}
