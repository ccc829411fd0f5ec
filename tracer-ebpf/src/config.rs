//! What userspace sets before the programs load: the running kernel's
//! struct offsets (from its BTF) as a frozen global, and in the CONFIG map
//! the node namespace and the buffer's knobs. Its own module so the filter
//! and the skb reader both use it without importing each other.
use core::cell::UnsafeCell;

use tracer_common::{Config, KernelOffsets};

use crate::CONFIG;

/// Written by the loader into the object before it loads
/// (`EbpfLoader::override_global`). In `.rodata`, which aya creates
/// read-only for programs and freezes: the verifier then reads each offset
/// as a known constant (kernel/bpf/verifier.c `check_mem_access` →
/// `bpf_map_direct_read`, for a map `bpf_map_is_rdonly`), which a direct
/// load through a BTF pointer needs (`check_ptr_to_btf_access` refuses a
/// variable offset). A map's value would be an unknown scalar. In an
/// `UnsafeCell` only so LLVM cannot fold the zeros it is compiled with:
/// nothing here writes it.
#[unsafe(no_mangle)]
#[unsafe(link_section = ".rodata")]
static KERNEL_OFFSETS: Offsets = Offsets(UnsafeCell::new(unsafe { core::mem::zeroed() }));

#[repr(transparent)]
struct Offsets(UnsafeCell<KernelOffsets>);

// SAFETY: never written by the programs (see above).
unsafe impl Sync for Offsets {}

#[inline(always)]
pub fn config() -> Option<&'static Config> {
    CONFIG.get(0)
}

#[inline(always)]
pub fn offsets() -> &'static KernelOffsets {
    // SAFETY: read-only for the programs (see above).
    unsafe { &*KERNEL_OFFSETS.0.get() }
}
