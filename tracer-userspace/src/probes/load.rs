//! Loading nattrace's object: its maps sized and configured for this kernel
//! (struct offsets, the node's namespace) and the traced Services.
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, MapData},
};
use tracer_common::{Config, ServiceKey, proto};

use super::{OBJECT, TraceError, TraceOptions, aya_loader, kernel_err, services};
use crate::service::Service;

/// aya's loader, made on a thread of its own ([`super::aya_loader`]) while
/// the caller reads the kernel's BTF.
pub(super) struct Loading {
    loader: aya_loader::Pending,
}

pub(super) fn start_loader() -> Loading {
    let early = EARLY_LOADER.lock().ok().and_then(|mut l| l.take());
    early.unwrap_or_else(|| Loading {
        loader: aya_loader::spawn(),
    })
}

/// What the tp_btf programs are loaded with ([`super::tp_btf`]).
pub(super) fn tracepoint_btf(kernel: &crate::btf::KernelBtf) -> Result<aya::Btf, TraceError> {
    let _t = crate::timing::step("tp_btf typedef ids (nattrace's BTF reader)");
    super::tp_btf::tracepoint_btf(kernel)
}

/// A loader started by [`prepare_loader`], taken by the next [`start_loader`].
static EARLY_LOADER: std::sync::Mutex<Option<Loading>> = std::sync::Mutex::new(None);

/// Starts making aya's loader now, so its BTF parse also overlaps what the
/// caller does before `Tracer::start` (the leftover cleanup).
pub fn prepare_loader() {
    let loading = start_loader();
    if let Ok(mut early) = EARLY_LOADER.lock() {
        *early = Some(loading);
    }
}

/// Creates nattrace's maps and loads its object, configured for this kernel
/// and the traced Services.
pub(super) fn load_object(
    loader: &Loading,
    opts: &TraceOptions,
    offsets: tracer_common::KernelOffsets,
    node_netns: u32,
) -> Result<Ebpf, TraceError> {
    let t = crate::timing::step("waiting for aya's loader");
    let mut loader: EbpfLoader<'_> = loader.loader.wait();
    drop(t);
    loader
        .override_global(OFFSETS_GLOBAL, &offsets, true)
        .map_max_entries("EVENTS", opts.ringbuf_bytes);
    if opts.all_services {
        loader.map_max_entries("SERVICES", services::ALL_SERVICES_ENTRIES);
    }
    let _t = crate::timing::step("object parse + maps created + CONFIG");
    let mut ebpf = loader
        .load(OBJECT)
        .map_err(|e| TraceError::Kernel(format!("cannot create nattrace's eBPF maps: {e}")))?;
    write_config(&mut ebpf, node_netns, &opts.services)?;
    set_buffering(&mut ebpf, opts)?;
    Ok(ebpf)
}

/// The object's read-only global holding the kernel's struct offsets
/// (tracer-ebpf/src/config.rs): set before the load, since the verifier
/// checks the direct loads with their values.
pub(super) const OFFSETS_GLOBAL: &str = "KERNEL_OFFSETS";

pub(super) fn write_config(
    ebpf: &mut Ebpf,
    node_netns: u32,
    services: &[Service],
) -> Result<(), TraceError> {
    // Buffering off until `set_buffering` (a load check attaches nothing).
    let config = Config {
        node_netns,
        ..Config::default()
    };
    let mut array: Array<&mut MapData, Config> = Array::try_from(
        ebpf.map_mut("CONFIG")
            .ok_or_else(|| TraceError::Kernel("map CONFIG missing".into()))?,
    )
    .map_err(kernel_err("CONFIG"))?;
    array.set(0, config, 0).map_err(kernel_err("CONFIG"))?;

    let mut slots: Array<&mut MapData, u8> = Array::try_from(
        ebpf.map_mut("ADDR_SLOTS")
            .ok_or_else(|| TraceError::Kernel("map ADDR_SLOTS missing".into()))?,
    )
    .map_err(kernel_err("ADDR_SLOTS"))?;
    for svc in services {
        services::remember_addr(&mut slots, svc.kernel_addr()).map_err(kernel_err("ADDR_SLOTS"))?;
    }
    let mut map: HashMap<&mut MapData, ServiceKey, u8> = HashMap::try_from(
        ebpf.map_mut("SERVICES")
            .ok_or_else(|| TraceError::Kernel("map SERVICES missing".into()))?,
    )
    .map_err(kernel_err("SERVICES"))?;
    for (index, svc) in services.iter().enumerate() {
        for proto in [proto::TCP, proto::UDP] {
            let key = ServiceKey {
                addr: svc.kernel_addr(),
                port: svc.port.unwrap_or(0),
                proto,
                _pad: 0,
            };
            map.insert(key, index as u8, 0)
                .map_err(kernel_err("SERVICES"))?;
        }
    }
    Ok(())
}

/// The per-flow buffer's knobs (tracer-ebpf/src/held.rs), in CONFIG.
fn set_buffering(ebpf: &mut Ebpf, opts: &TraceOptions) -> Result<(), TraceError> {
    let mut array: Array<&mut MapData, Config> = Array::try_from(
        ebpf.map_mut("CONFIG")
            .ok_or_else(|| TraceError::Kernel("map CONFIG missing".into()))?,
    )
    .map_err(kernel_err("CONFIG"))?;
    let mut config = array.get(&0, 0).map_err(kernel_err("CONFIG"))?;
    config.buffer = u32::from(opts.buffer);
    config.reply_timeout_ns = opts.reply_timeout_ns;
    config.benign_drops = opts.benign_drops;
    config.closed_drops = opts.closed_drops;
    array.set(0, config, 0).map_err(kernel_err("CONFIG"))
}
