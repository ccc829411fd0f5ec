//! The loading and attaching steps of `Tracer::start`, one function each,
//! and `check_load`, which loads a backend's programs without attaching.
use std::os::fd::OwnedFd;

use aya::{
    Btf, Ebpf,
    programs::{
        BtfTracePoint, KProbe, Program, ProgramError, RawTracePoint, SchedClassifier, TcAttachType,
    },
};

use super::{
    OBJECT, TraceError,
    load::{self, write_config},
    load_error,
    nf_link::{self, NfPrograms},
    preflight,
    table::{self, Attach, Backend, ChosenPriority, ProgramSpec},
};
use crate::{btf::KernelBtf, service::Service};

/// A loaded tc program, attached per interface by `TcAttachments`.
pub(super) type TcProgram = (&'static str, TcAttachType);

/// Program `name` of the object, as the kind its attach point needs.
fn program<'a, T>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut T, TraceError>
where
    &'a mut T: TryFrom<&'a mut Program, Error = ProgramError>,
{
    let prog = ebpf
        .program_mut(name)
        .ok_or_else(|| TraceError::Kernel(format!("{name} is not in the eBPF object")))?;
    prog.try_into()
        .map_err(|e| TraceError::Kernel(format!("{name}: {e}")))
}

/// The plan's netfilter programs being verified on a thread of their own.
pub(super) type NfLoading = std::thread::JoinHandle<Result<NfPrograms, nf_link::NfLinkError>>;

/// Starts loading the plan's netfilter programs (None when it has none) on
/// another thread: the kernel's verifier takes most of start-up, and the
/// other programs load meanwhile (docs/DESIGN.md, "Start-up"). Relocation
/// reads `ebpf`'s maps, so this runs before the maps are taken out of it.
pub(super) fn start_netfilter_load(
    ebpf: &Ebpf,
    plan: &[&'static ProgramSpec],
) -> Result<Option<NfLoading>, TraceError> {
    let nf_names = table::netfilter_programs(plan.iter().copied());
    if nf_names.is_empty() {
        return Ok(None);
    }
    let prepared = nf_link::NfPrepared::new(OBJECT, ebpf, &nf_names).map_err(nf_load_error)?;
    std::thread::Builder::new()
        .name("nattrace-nf-load".into())
        .spawn(move || {
            let _t = crate::timing::step("netfilter programs: load + verify (own thread)");
            prepared.load()
        })
        .map(Some)
        .map_err(|e| TraceError::Kernel(format!("cannot start a loading thread: {e}")))
}

/// Waits for [`start_netfilter_load`]'s programs.
pub(super) fn finish_netfilter_load(
    loading: Option<NfLoading>,
) -> Result<Option<NfPrograms>, TraceError> {
    let Some(loading) = loading else {
        return Ok(None);
    };
    match loading.join() {
        Ok(result) => result.map(Some).map_err(nf_load_error),
        Err(_) => Err(TraceError::Kernel(
            "the thread loading the netfilter programs panicked".into(),
        )),
    }
}

fn nf_load_error(e: nf_link::NfLinkError) -> TraceError {
    // The verifier log is long: one line for the user, the rest logged.
    log::error!("{e}");
    TraceError::Kernel(e.to_string().lines().next().unwrap_or_default().to_owned())
}

/// Loads the plan's tc programs, which are attached per interface later
/// (first, so tc can attach while the other programs load).
pub(super) fn load_tc(
    ebpf: &mut Ebpf,
    plan: &[&'static ProgramSpec],
) -> Result<Vec<TcProgram>, TraceError> {
    let mut tc_programs = Vec::new();
    for spec in plan {
        if let Attach::Tc(attach_type) = spec.attach {
            let prog: &mut SchedClassifier = program(ebpf, spec.name)?;
            prog.load().map_err(|e| load_error(spec.name, e))?;
            tc_programs.push((spec.name, attach_type));
        }
    }
    Ok(tc_programs)
}

/// Loads and attaches the global programs (tracepoints, kprobes: no
/// namespace switch). Returns the attached labels.
pub(super) fn load_global(
    ebpf: &mut Ebpf,
    plan: &[&'static ProgramSpec],
    btf: &Btf,
) -> Result<Vec<String>, TraceError> {
    load_in_parallel(ebpf, plan, btf)?;
    let mut attached = Vec::new();
    for spec in plan {
        match spec.attach {
            Attach::BtfTracepoint(_) => {
                let prog: &mut BtfTracePoint = program(ebpf, spec.name)?;
                prog.attach().map_err(|e| load_error(spec.name, e))?;
                attached.push(spec.label.to_owned());
            }
            Attach::Kprobe { symbol, .. } => {
                // Global, like the raw tracepoints: no namespace switch.
                let prog: &mut KProbe = program(ebpf, spec.name)?;
                prog.attach(symbol, 0)
                    .map_err(|e| load_error(spec.name, e))?;
                attached.push(spec.label.to_owned());
            }
            // Tracer::check_receive, once a device needs it.
            Attach::UnpairedReceive(_) | Attach::Tc(_) | Attach::Netfilter { .. } => {}
        }
    }
    Ok(attached)
}

/// Loads and attaches an [`Attach::UnpairedReceive`] program. Loaded only
/// now, not with the others: most nodes never need it, and its
/// verification (20-35 ms of a CPU on this VM) would sit on the start's
/// path of a 2-core node. [`check_load`] still verifies it.
pub(super) fn attach_unpaired_receive(
    ebpf: &mut Ebpf,
    spec: &ProgramSpec,
) -> Result<(), TraceError> {
    let Attach::UnpairedReceive(tp) = spec.attach else {
        return Err(TraceError::Kernel(format!(
            "{} is not a receive tracepoint",
            spec.name
        )));
    };
    let prog: &mut RawTracePoint = program(ebpf, spec.name)?;
    prog.load().map_err(|e| load_error(spec.name, e))?;
    prog.attach(tp).map_err(|e| load_error(spec.name, e))?;
    Ok(())
}

/// Loads the plan's tracepoint and kprobe programs, each on its own
/// thread: the kernel verifies them one per CPU (as root no verifier lock
/// is taken, kernel/bpf/verifier.c bpf_check), beside the netfilter
/// programs' thread.
fn load_in_parallel(
    ebpf: &mut Ebpf,
    plan: &[&'static ProgramSpec],
    btf: &Btf,
) -> Result<(), TraceError> {
    let global: Vec<(&str, Option<&str>)> = plan
        .iter()
        .filter_map(|p| match p.attach {
            Attach::BtfTracepoint(tp) => Some((p.name, Some(tp))),
            Attach::Kprobe { .. } => Some((p.name, None)),
            _ => None,
        })
        .collect();
    let programs: Vec<(&str, Option<&str>, &mut Program)> = ebpf
        .programs_mut()
        .filter_map(|(name, prog)| {
            let (_, tp) = global.iter().find(|(n, _)| *n == name)?;
            Some((name, *tp, prog))
        })
        .collect();
    let load = |name: &str, tp: Option<&str>, prog: &mut Program| {
        // Per program: an old verifier's slow one is otherwise hidden in
        // the step's total (6.1 under TCG took minutes for one).
        let began = std::time::Instant::now();
        let loaded = match (&mut *prog, tp) {
            (Program::BtfTracePoint(p), Some(tp)) => {
                p.load(tp, btf).map_err(|e| load_error(name, e))
            }
            (Program::KProbe(p), _) => p.load().map_err(|e| load_error(name, e)),
            _ => Err(TraceError::Kernel(format!(
                "{name}: not a tp_btf tracepoint or kprobe"
            ))),
        };
        // The kernel's count of instructions it walked: what the time
        // grows with, comparable across kernels and machines. Asked for
        // (a bpf syscall) only when the line is printed.
        if log::log_enabled!(log::Level::Debug) {
            let insns = prog
                .info()
                .ok()
                .and_then(|i| i.verified_instruction_count());
            log::debug!(
                "start-up: {name} loaded and verified in {:.1} ms ({} instructions processed)",
                began.elapsed().as_secs_f64() * 1e3,
                insns.map_or("?".to_owned(), |n| n.to_string())
            );
        }
        loaded
    };
    std::thread::scope(|s| {
        let threads: Vec<_> = programs
            .into_iter()
            .map(|(name, tp, prog)| s.spawn(move || load(name, tp, prog)))
            .collect();
        threads
            .into_iter()
            .try_for_each(|t| t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
    })
}

/// Attaches the plan's netfilter programs, each at a free priority in its
/// window. Runs inside the traced namespace.
pub(super) fn attach_netfilter(
    nf: &NfPrograms,
    plan: &[&'static ProgramSpec],
    families: Vec<u32>,
    nf_links: &mut Vec<OwnedFd>,
    priorities: &mut Vec<ChosenPriority>,
) -> Result<(), TraceError> {
    for (pf, spec) in families
        .into_iter()
        .flat_map(|pf| plan.iter().map(move |spec| (pf, spec)))
    {
        if let Attach::Netfilter { hook, window } = spec.attach {
            let label = match pf {
                nf_link::NFPROTO_IPV6 => format!("IPv6 {}", spec.label),
                _ => spec.label.to_owned(),
            };
            let (fd, priority) = nf_link::attach_in_window(nf, spec.name, &label, pf, hook, window)
                .map_err(|e| match e {
                    nf_link::NfLinkError::WindowFull { .. } => TraceError::NfAttach(e.to_string()),
                    other => TraceError::NfAttach(format!("kernel refused: {other}")),
                })?;
            nf_links.push(fd);
            priorities.push(ChosenPriority {
                point: label,
                priority,
                default: window.preferred,
            });
        }
    }
    Ok(())
}

/// The netfilter families to attach links for: IPv4 always, IPv6 only when
/// an IPv6 Service is traced, so an IPv4-only trace adds nothing to the
/// node's IPv6 hooks.
pub(super) fn nf_families(services: &[Service]) -> Vec<u32> {
    let mut pfs = vec![nf_link::NFPROTO_IPV4];
    if services.iter().any(|s| s.addr.is_ipv6()) {
        pfs.push(nf_link::NFPROTO_IPV6);
    }
    pfs
}

/// Loads every program of `backend` into the kernel (so the verifier checks
/// it against this kernel) without attaching anything, and returns their
/// names. This is how a kernel without kprobes still proves the kprobe
/// programs load.
pub fn check_load(backend: Backend) -> Result<Vec<&'static str>, TraceError> {
    preflight()?;
    let mut kernel = KernelBtf::load()?;
    let offsets = kernel.kernel_offsets()?;
    let btf = load::tracepoint_btf(&kernel)?;
    let mut ebpf = super::aya_loader::made()
        .override_global(load::OFFSETS_GLOBAL, &offsets, true)
        .load(OBJECT)
        .map_err(|e| TraceError::Kernel(format!("cannot create nattrace's eBPF maps: {e}")))?;
    write_config(&mut ebpf, 0, &[])?;
    let mut loaded = Vec::new();
    let rows = || {
        table::PROGRAMS
            .iter()
            .filter(move |p| p.backends.contains(&backend))
    };
    let nf_names = table::netfilter_programs(rows());
    for spec in rows() {
        let loaded_one = match spec.attach {
            Attach::Netfilter { .. } => continue,
            Attach::Tc(_) => program::<SchedClassifier>(&mut ebpf, spec.name)?.load(),
            Attach::UnpairedReceive(_) => program::<RawTracePoint>(&mut ebpf, spec.name)?.load(),
            Attach::BtfTracepoint(tp) => {
                program::<BtfTracePoint>(&mut ebpf, spec.name)?.load(tp, &btf)
            }
            Attach::Kprobe { .. } => program::<KProbe>(&mut ebpf, spec.name)?.load(),
        };
        loaded_one.map_err(|e| load_error(spec.name, e))?;
        loaded.push(spec.name);
    }
    if !nf_names.is_empty() {
        NfPrograms::load(OBJECT, &ebpf, &nf_names)
            .map_err(|e| TraceError::Kernel(e.to_string()))?;
        loaded.extend(nf_names);
    }
    Ok(loaded)
}
