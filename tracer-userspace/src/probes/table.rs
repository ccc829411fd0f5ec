//! Every kernel program nattrace knows, what it attaches to, which backend
//! uses it, and what it needs from the running kernel. The loader walks this
//! table once; rows whose needs are not met become one [`Skipped`] line each.
use std::path::Path;

use aya::{programs::TcAttachType, util::KernelVersion};
use tracer_common::nf_hook;

use super::{
    Skipped,
    nf_link::{Window, probe_support},
};

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
    /// A netfilter hook of the traced namespace (IPv4), at a free priority
    /// inside `window`.
    Netfilter { hook: u8, window: Window },
    /// Global BTF tracepoint (tp_btf): its pointer arguments typed by the
    /// verifier, so the program loads their members directly.
    BtfTracepoint(&'static str),
    /// Global raw tracepoint, loaded always but attached only while some
    /// device receives what no transmit reports (receive.rs).
    UnpairedReceive(&'static str),
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
    /// tp_btf: vmlinux BTF, which every start needs anyway (preflight).
    BtfTracepoint,
}

pub struct ProgramSpec {
    /// Function name in the eBPF object.
    pub name: &'static str,
    pub attach: Attach,
    pub backends: &'static [Backend],
    pub need: Need,
    /// Short label for the preamble.
    pub label: &'static str,
    pub nat_points: NatPoints,
}

/// The netfilter backend's NAT hooks (PREROUTING, OUTPUT, POSTROUTING,
/// INPUT) have two forms: one program after the rewrite that also reports
/// the packet before it, reading the side NAT rewrites as conntrack saw it
/// (tracer-ebpf netfilter.rs `try_netfilter_nat`; one program call per
/// packet instead of two, issue 25), or a program on each side of it, for
/// a kernel whose nf_conntrack layout is unknown (no module BTF, or
/// nf_conntrack not loaded at start). Which one runs is decided silently:
/// neither form is a missing feature.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NatPoints {
    /// Not a NAT-hook program: always.
    Any,
    /// Only with conntrack's tuples known.
    OneProgram,
    /// Only without them.
    Pair,
}

const BOTH: &[Backend] = &[Backend::Netfilter, Backend::Kprobe];
const NF: &[Backend] = &[Backend::Netfilter];
const KP: &[Backend] = &[Backend::Kprobe];

/// PREROUTING/OUTPUT before DNAT: after conntrack (-200), before nat (-100).
/// -175 is before mangle (-150), firewalld (-140) and kube-proxy's nftables
/// filter chains (-110), so a drop by any of them shows after this hop; no
/// common table uses it.
pub const BEFORE_DNAT: Window = Window {
    min: -199,
    max: -101,
    preferred: -175,
};
/// PREROUTING/OUTPUT after DNAT: after nat (-100), before filter (0). -99 is
/// right after the rewrite, before kube-proxy's nftables `filter-output-post-dnat` (-90).
pub const AFTER_DNAT: Window = Window {
    min: -99,
    max: -1,
    preferred: -99,
};
/// FORWARD (no NAT there): before the filter table (0) where KUBE-FORWARD,
/// NetworkPolicy and firewall DROPs live, and before kube-proxy's nftables
/// `filter-forward` (-110) and mangle (-150), so every such drop is
/// reported "after netfilter FORWARD" (collector/checks/mod.rs, drop_place). The
/// classic 0 is the filter table's own priority: taken on every node.
pub const FORWARD: Window = Window {
    min: -199,
    max: -1,
    preferred: -175,
};
/// POSTROUTING/INPUT before SNAT: after filter (0) and security (50), right
/// before nat (100).
pub const BEFORE_SNAT: Window = Window {
    min: 1,
    max: 99,
    preferred: 99,
};
/// POSTROUTING/INPUT after SNAT: after nat (100), before the conntrack
/// helper (300) and confirm (INT_MAX).
pub const AFTER_SNAT: Window = Window {
    min: 101,
    max: 299,
    preferred: 101,
};

// Each window lies strictly between its landmarks, and the before/after
// windows of one hook never overlap, so our own points keep their order
// whatever the search picks.
const _: () = {
    assert!(BEFORE_DNAT.min > -200 && BEFORE_DNAT.max < -100);
    assert!(AFTER_DNAT.min > -100 && AFTER_DNAT.max < 0);
    assert!(FORWARD.max < 0);
    assert!(BEFORE_SNAT.min > 0 && BEFORE_SNAT.max < 100);
    assert!(AFTER_SNAT.min > 100 && AFTER_SNAT.max < 300);
};

const fn nf(name: &'static str, hook: u8, window: Window, label: &'static str) -> ProgramSpec {
    nf_nat(name, hook, window, label, NatPoints::Any)
}

const fn nf_nat(
    name: &'static str,
    hook: u8,
    window: Window,
    label: &'static str,
    nat_points: NatPoints,
) -> ProgramSpec {
    ProgramSpec {
        name,
        attach: Attach::Netfilter { hook, window },
        backends: NF,
        need: Need::NetfilterLink,
        label,
        nat_points,
    }
}

pub const PROGRAMS: &[ProgramSpec] = &[
    ProgramSpec {
        name: "tc_ingress",
        attach: Attach::Tc(TcAttachType::Ingress),
        backends: BOTH,
        need: Need::Tc,
        label: "tc ingress",
        nat_points: NatPoints::Any,
    },
    ProgramSpec {
        name: "tc_egress",
        attach: Attach::Tc(TcAttachType::Egress),
        backends: BOTH,
        need: Need::Tc,
        label: "tc egress",
        nat_points: NatPoints::Any,
    },
    nf_nat(
        "nf_dnat",
        nf_hook::PRE_ROUTING,
        AFTER_DNAT,
        "PREROUTING after DNAT",
        NatPoints::OneProgram,
    ),
    nf_nat(
        "nf_dnat",
        nf_hook::LOCAL_OUT,
        AFTER_DNAT,
        "OUTPUT after DNAT",
        NatPoints::OneProgram,
    ),
    nf_nat(
        "nf_pre_before",
        nf_hook::PRE_ROUTING,
        BEFORE_DNAT,
        "PREROUTING before DNAT",
        NatPoints::Pair,
    ),
    nf_nat(
        "nf_pre_after",
        nf_hook::PRE_ROUTING,
        AFTER_DNAT,
        "PREROUTING after DNAT",
        NatPoints::Pair,
    ),
    nf_nat(
        "nf_out_before",
        nf_hook::LOCAL_OUT,
        BEFORE_DNAT,
        "OUTPUT before DNAT",
        NatPoints::Pair,
    ),
    nf_nat(
        "nf_out_after",
        nf_hook::LOCAL_OUT,
        AFTER_DNAT,
        "OUTPUT after DNAT",
        NatPoints::Pair,
    ),
    nf("nf_fwd", nf_hook::FORWARD, FORWARD, "FORWARD"),
    nf_nat(
        "nf_snat",
        nf_hook::POST_ROUTING,
        AFTER_SNAT,
        "POSTROUTING after SNAT",
        NatPoints::OneProgram,
    ),
    nf_nat(
        "nf_snat",
        nf_hook::LOCAL_IN,
        AFTER_SNAT,
        "INPUT after SNAT",
        NatPoints::OneProgram,
    ),
    nf_nat(
        "nf_post_before",
        nf_hook::POST_ROUTING,
        BEFORE_SNAT,
        "POSTROUTING before SNAT",
        NatPoints::Pair,
    ),
    nf_nat(
        "nf_post_after",
        nf_hook::POST_ROUTING,
        AFTER_SNAT,
        "POSTROUTING after SNAT",
        NatPoints::Pair,
    ),
    nf_nat(
        "nf_in_before",
        nf_hook::LOCAL_IN,
        BEFORE_SNAT,
        "INPUT before SNAT",
        NatPoints::Pair,
    ),
    nf_nat(
        "nf_in_after",
        nf_hook::LOCAL_IN,
        AFTER_SNAT,
        "INPUT after SNAT",
        NatPoints::Pair,
    ),
    ProgramSpec {
        name: "netif_receive_skb",
        attach: Attach::UnpairedReceive("netif_receive_skb"),
        backends: BOTH,
        need: Need::RawTracepoint,
        label: "raw_tp netif_receive_skb",
        nat_points: NatPoints::Any,
    },
    ProgramSpec {
        name: "net_dev_start_xmit",
        attach: Attach::BtfTracepoint("net_dev_start_xmit"),
        backends: BOTH,
        need: Need::BtfTracepoint,
        label: "tp_btf net_dev_start_xmit",
        nat_points: NatPoints::Any,
    },
    ProgramSpec {
        name: "kfree_skb",
        attach: Attach::BtfTracepoint("kfree_skb"),
        backends: BOTH,
        need: Need::BtfTracepoint,
        label: "tp_btf kfree_skb",
        nat_points: NatPoints::Any,
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
    // ICMP errors RELATED to a NATed connection: their quoted header is
    // translated here, not in nf_nat_manip_pkt (issue 23).
    kp(
        "kp_nf_nat_icmp_reply_translation",
        "nf_nat_icmp_reply_translation",
        None,
        "kprobe nf_nat_icmp_reply_translation",
    ),
    kp(
        "kp_nf_nat_icmpv6_reply_translation",
        "nf_nat_icmpv6_reply_translation",
        None,
        "kprobe nf_nat_icmpv6_reply_translation",
    ),
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
        nat_points: NatPoints::Any,
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

/// `--backend auto` when the netfilter links could not attach (e.g. every
/// priority of a window taken on this node): the kprobe backend if the
/// kernel has kprobes, with the reason for the start line. None = nothing to
/// fall back to (a forced backend, or no kprobes): report `error`.
pub fn fallback_after_nf_attach_failure(
    choice: BackendChoice,
    kernel: &KernelFeatures,
    error: &str,
) -> Option<(Backend, String)> {
    (choice == BackendChoice::Auto && kernel.check(Need::Kprobes).is_ok()).then(|| {
        (
            Backend::Kprobe,
            format!("BPF netfilter links could not attach ({error}): kprobes instead"),
        )
    })
}

/// The priority a netfilter observation point got, for the start line and
/// the recording.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChosenPriority {
    /// e.g. "PREROUTING before DNAT".
    pub point: String,
    pub priority: i32,
    pub default: i32,
}

/// The start line's note on priorities, only for those that differ from the
/// defaults (None when every point got its default).
pub fn priorities_note(chosen: &[ChosenPriority]) -> Option<String> {
    let moved: Vec<String> = chosen
        .iter()
        .filter(|c| c.priority != c.default)
        .map(|c| format!("{} {} (default {} taken)", c.point, c.priority, c.default))
        .collect();
    (!moved.is_empty()).then(|| format!("netfilter priorities: {}", moved.join(", ")))
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
        if let Some(loads) = probe_support() {
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
            Need::Tc | Need::RawTracepoint | Need::BtfTracepoint => Ok(()),
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

/// The netfilter programs `rows` attach, each once: one program may serve
/// several rows (`nf_dnat`, `nf_snat`), and is loaded once for all of them.
pub fn netfilter_programs<'a>(
    rows: impl IntoIterator<Item = &'a ProgramSpec>,
) -> Vec<&'static str> {
    let mut names = Vec::new();
    for p in rows {
        if matches!(p.attach, Attach::Netfilter { .. }) && !names.contains(&p.name) {
            names.push(p.name);
        }
    }
    names
}

/// Rows of `backend` that this kernel can run, plus one Skipped per row it
/// cannot. `ct_tuples`: the programs can read conntrack's tuples (the NAT
/// hooks then take one program each, [`NatPoints`]).
pub fn plan(
    backend: Backend,
    kernel: &KernelFeatures,
    ct_tuples: bool,
    in_object: impl Fn(&str) -> bool,
) -> (Vec<&'static ProgramSpec>, Vec<Skipped>) {
    let mut run = Vec::new();
    let mut skipped = Vec::new();
    let wanted = |p: &ProgramSpec| match p.nat_points {
        NatPoints::Any => true,
        NatPoints::OneProgram => ct_tuples,
        NatPoints::Pair => !ct_tuples,
    };
    for spec in PROGRAMS
        .iter()
        .filter(|p| p.backends.contains(&backend) && wanted(p))
    {
        let verdict = kernel.check(spec.need).and_then(|()| {
            if in_object(spec.name) {
                Ok(())
            } else {
                // Every row has its program (tests/kprobe_load.rs loads them
                // all); a miss means the embedded object is from another build.
                Err(
                    "missing from the embedded eBPF object (a mismatched build of tracer-ebpf)"
                        .to_owned(),
                )
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
        let (run, skipped) = plan(Backend::Netfilter, &k, true, |_| true);
        assert!(run.iter().all(|p| p.need != Need::NetfilterLink));
        assert_eq!(skipped.len(), 5);
        assert!(skipped[0].reason.contains("6.4"));
        assert!(!k.tcx);
    }

    #[test]
    fn new_kernel_runs_everything_of_the_netfilter_backend() {
        let k = KernelFeatures::from_parts((6, 18, 0), false);
        let (run, skipped) = plan(Backend::Netfilter, &k, true, |_| true);
        assert_eq!(run.len(), 10);
        assert!(skipped.is_empty());
        assert!(k.tcx);
        let names: Vec<_> = run.iter().map(|p| p.name).collect();
        assert!(names.contains(&"nf_dnat") && names.contains(&"nf_snat"));
        assert!(!names.contains(&"nf_post_before") && !names.contains(&"nf_pre_before"));
    }

    /// Without conntrack's layout each NAT hook takes a program on each
    /// side of the rewrite, and nothing says so as a skipped feature.
    #[test]
    fn without_conntrack_tuples_the_nat_hooks_take_a_pair() {
        let k = KernelFeatures::from_parts((6, 18, 0), false);
        let (run, skipped) = plan(Backend::Netfilter, &k, false, |_| true);
        assert_eq!(run.len(), 14);
        assert!(skipped.is_empty());
        let names: Vec<_> = run.iter().map(|p| p.name).collect();
        for hook in ["pre", "out", "post", "in"] {
            for side in ["before", "after"] {
                let pair = format!("nf_{hook}_{side}");
                assert!(names.contains(&pair.as_str()), "{pair}");
            }
        }
        assert!(!names.contains(&"nf_dnat") && !names.contains(&"nf_snat"));
        // With them, one program per NAT hook.
        let (run, _) = plan(Backend::Netfilter, &k, true, |_| true);
        let names: Vec<_> = run.iter().map(|p| p.name).collect();
        assert_eq!(run.len(), 10, "{names:?}");
        // Both hooks of a side share its program.
        for (one, hooks) in [
            ("nf_dnat", [nf_hook::PRE_ROUTING, nf_hook::LOCAL_OUT]),
            ("nf_snat", [nf_hook::POST_ROUTING, nf_hook::LOCAL_IN]),
        ] {
            let at: Vec<u8> = run
                .iter()
                .filter(|p| p.name == one)
                .filter_map(|p| match p.attach {
                    Attach::Netfilter { hook, .. } => Some(hook),
                    _ => None,
                })
                .collect();
            assert_eq!(at, hooks, "{one}");
        }
    }

    /// A program that serves several rows is loaded once.
    #[test]
    fn netfilter_programs_are_named_once() {
        let k = KernelFeatures::from_parts((6, 18, 0), false);
        let (run, _) = plan(Backend::Netfilter, &k, true, |_| true);
        assert_eq!(
            netfilter_programs(run.iter().copied()),
            ["nf_dnat", "nf_fwd", "nf_snat"]
        );
        let (run, _) = plan(Backend::Netfilter, &k, false, |_| true);
        assert_eq!(netfilter_programs(run.iter().copied()).len(), 9);
    }

    #[test]
    fn kprobe_backend_without_kprobes_says_why() {
        let k = KernelFeatures::from_parts((6, 18, 0), false);
        let (_, skipped) = plan(Backend::Kprobe, &k, true, |_| true);
        assert_eq!(skipped.len(), 6);
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
        let (run, skipped) = plan(Backend::Kprobe, &k, true, |_| true);
        assert!(skipped.is_empty());
        assert_eq!(run.len(), 11);
        // nf_hook_slow must be attached before the NAT probes that read its slot.
        let first_kp = run
            .iter()
            .position(|p| matches!(p.attach, Attach::Kprobe { .. }))
            .unwrap();
        assert_eq!(run[first_kp].name, "kp_nf_hook_slow");
    }

    #[test]
    fn auto_falls_back_to_kprobes_only_when_it_can() {
        let with_kp = KernelFeatures::from_parts((6, 12, 0), true);
        let host = KernelFeatures::from_parts((6, 18, 0), false);
        let err = "every netfilter priority from -199 to -1 at FORWARD is taken";
        let (b, why) =
            fallback_after_nf_attach_failure(BackendChoice::Auto, &with_kp, err).unwrap();
        assert_eq!(b, Backend::Kprobe);
        assert!(
            why.contains(err) && why.ends_with("kprobes instead"),
            "{why}"
        );
        // No kprobes here: the attach error is the answer.
        assert!(fallback_after_nf_attach_failure(BackendChoice::Auto, &host, err).is_none());
        // A forced backend is never swapped.
        assert!(
            fallback_after_nf_attach_failure(BackendChoice::Netfilter, &with_kp, err).is_none()
        );
    }

    #[test]
    fn windows_keep_each_point_on_its_side_of_nat_and_filter() {
        // The landmarks are checked at compile time (below the windows).
        for w in [BEFORE_DNAT, AFTER_DNAT, FORWARD, BEFORE_SNAT, AFTER_SNAT] {
            assert!(w.contains(w.preferred));
            let all: Vec<i32> = w.candidates().collect();
            assert_eq!(all.len() as i32, w.max - w.min + 1);
            assert!(all.iter().all(|p| w.contains(*p)));
            assert_eq!(all[0], w.preferred);
            // Classic tables' priorities are never a default.
            assert!(![-300, -200, -150, -100, 0, 50, 100, 300].contains(&w.preferred));
        }
    }

    #[test]
    fn the_note_names_only_moved_priorities() {
        let c = |point: &str, priority, default| ChosenPriority {
            point: point.into(),
            priority,
            default,
        };
        assert_eq!(priorities_note(&[c("FORWARD", -175, -175)]), None);
        assert_eq!(
            priorities_note(&[c("FORWARD", -174, -175), c("INPUT after SNAT", 101, 101)])
                .as_deref(),
            Some("netfilter priorities: FORWARD -174 (default -175 taken)")
        );
    }

    /// A program serves several rows only as a netfilter program at
    /// different hooks (`nf_dnat`, `nf_snat`); any other repeat is a slip.
    #[test]
    fn table_rows_are_unique() {
        let hook = |p: &ProgramSpec| match p.attach {
            Attach::Netfilter { hook, .. } => Some(hook),
            _ => None,
        };
        let mut rows: Vec<_> = PROGRAMS.iter().map(|p| (p.name, hook(p))).collect();
        rows.sort();
        rows.dedup();
        assert_eq!(rows.len(), PROGRAMS.len());
        for p in PROGRAMS {
            let repeats = PROGRAMS.iter().filter(|q| q.name == p.name).count();
            assert!(repeats == 1 || hook(p).is_some(), "{}", p.name);
        }
    }
}
