//! Root test: every program of both backends passes this kernel's verifier,
//! even where it cannot be attached (the build machines have no kprobes, see
//! docs/MACHINE.md), and a forced backend the kernel cannot run is refused
//! with one line naming the missing feature. Skips when not root.
use nattrace::{
    probes::{
        TraceError, TraceOptions, Tracer, check_load,
        table::{Backend, BackendChoice, KernelFeatures, Need, PROGRAMS},
    },
    service::Service,
};

fn root() -> bool {
    let root = nix::unistd::geteuid().is_root();
    if !root {
        eprintln!("skipped: needs root");
    }
    root
}

#[test]
fn every_kprobe_program_loads() {
    if !root() {
        return;
    }
    let loaded = check_load(Backend::Kprobe).expect("kprobe backend programs load");
    for spec in PROGRAMS
        .iter()
        .filter(|p| p.backends.contains(&Backend::Kprobe))
    {
        assert!(loaded.contains(&spec.name), "{} not loaded", spec.name);
    }
    assert!(loaded.contains(&"kp_nf_nat_manip_pkt") && loaded.contains(&"kp_br_forward"));
}

#[test]
fn every_netfilter_program_loads() {
    if !root() {
        return;
    }
    let features = KernelFeatures::probe();
    if let Err(reason) = features.check(Need::NetfilterLink) {
        eprintln!("skipped: {reason} (kernel {:?})", features.version);
        return;
    }
    let loaded = check_load(Backend::Netfilter).expect("netfilter backend programs load");
    for spec in PROGRAMS
        .iter()
        .filter(|p| p.backends.contains(&Backend::Netfilter))
    {
        assert!(loaded.contains(&spec.name), "{} not loaded", spec.name);
    }
}

#[test]
fn forced_kprobe_backend_without_kprobes_is_one_line() {
    if !root() {
        return;
    }
    if KernelFeatures::probe().kprobes {
        eprintln!("skipped: this kernel has kprobes, so the kprobe backend is not refused");
        return;
    }
    let opts = TraceOptions {
        services: vec![Service {
            addr: std::net::Ipv4Addr::new(198, 51, 100, 9).into(),
            port: None,
        }],
        netns: None,
        ringbuf_bytes: 1 << 16,
        backend: BackendChoice::Kprobe,
        all_services: false,
        // Every packet: these tests check each observation point.
        buffer: false,
        reply_timeout_ns: 3_000_000_000,
        benign_drops: [0; 4],
        closed_drops: [0; 4],
    };
    match Tracer::start(&opts) {
        Err(e @ TraceError::Unsupported(_)) => assert_eq!(
            e.to_string(),
            "kprobes not available in this kernel (CONFIG_KPROBES)"
        ),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("kprobe backend started without kprobes"),
    }
}
