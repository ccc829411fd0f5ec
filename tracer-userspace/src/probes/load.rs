//! Loading nattrace's object: its maps sized and configured for this kernel
//! (struct offsets, the node's namespace) and the traced Services.
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, MapData},
};
use tracer_common::{Config, ServiceKey, proto};

use super::{OBJECT, TraceError, TraceOptions, kernel_err, services};
use crate::service::Service;

/// Creates nattrace's maps and loads its object, configured for this kernel
/// and the traced Services.
pub(super) fn load_object(
    opts: &TraceOptions,
    offsets: tracer_common::KernelOffsets,
    node_netns: u32,
) -> Result<Ebpf, TraceError> {
    // No CO-RE in these programs (offsets come from the kernel's BTF, read
    // by the caller), so aya need not parse it a second time.
    let mut loader = EbpfLoader::new();
    loader
        .btf(None)
        .map_max_entries("EVENTS", opts.ringbuf_bytes);
    if opts.all_services {
        loader.map_max_entries("SERVICES", services::ALL_SERVICES_ENTRIES);
    }
    let mut ebpf = loader
        .load(OBJECT)
        .map_err(|e| TraceError::Kernel(format!("cannot create nattrace's eBPF maps: {e}")))?;
    write_config(&mut ebpf, offsets, node_netns, &opts.services)?;
    set_buffering(&mut ebpf, opts)?;
    Ok(ebpf)
}

pub(super) fn write_config(
    ebpf: &mut Ebpf,
    offsets: tracer_common::KernelOffsets,
    node_netns: u32,
    services: &[Service],
) -> Result<(), TraceError> {
    // Buffering off until `set_buffering` (a load check attaches nothing).
    let config = Config {
        offsets,
        node_netns,
        ..Config::default()
    };
    let mut array: Array<&mut MapData, Config> = Array::try_from(
        ebpf.map_mut("CONFIG")
            .ok_or_else(|| TraceError::Kernel("map CONFIG missing".into()))?,
    )
    .map_err(kernel_err("CONFIG"))?;
    array.set(0, config, 0).map_err(kernel_err("CONFIG"))?;

    // aya's HashMap also opens LRU hash maps.
    let mut addrs: HashMap<&mut MapData, tracer_common::Addr, u8> = HashMap::try_from(
        ebpf.map_mut("ADDRS")
            .ok_or_else(|| TraceError::Kernel("map ADDRS missing".into()))?,
    )
    .map_err(kernel_err("ADDRS"))?;
    for svc in services {
        addrs
            .insert(svc.kernel_addr(), 1, 0)
            .map_err(kernel_err("ADDRS"))?;
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

/// The per-flow buffer's knobs (tracer-ebpf/src/pending.rs), in CONFIG.
fn set_buffering(ebpf: &mut Ebpf, opts: &TraceOptions) -> Result<(), TraceError> {
    let mut array: Array<&mut MapData, Config> = Array::try_from(
        ebpf.map_mut("CONFIG")
            .ok_or_else(|| TraceError::Kernel("map CONFIG missing".into()))?,
    )
    .map_err(kernel_err("CONFIG"))?;
    let mut config = array.get(&0, 0).map_err(kernel_err("CONFIG"))?;
    config.buffer = u32::from(opts.buffer);
    config.reply_timeout_ns = opts.reply_timeout_ns;
    array.set(0, config, 0).map_err(kernel_err("CONFIG"))
}
