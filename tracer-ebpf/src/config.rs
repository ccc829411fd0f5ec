//! The CONFIG map userspace writes before attaching: the running kernel's
//! struct offsets (from its BTF) and the node namespace. Its own module so
//! the filter and the skb reader both use it without importing each other.
use tracer_common::{Config, KernelOffsets};

use crate::CONFIG;

#[inline(always)]
pub fn config() -> Option<&'static Config> {
    CONFIG.get(0)
}

#[inline(always)]
pub fn offsets() -> Option<&'static KernelOffsets> {
    config().map(|c| &c.offsets)
}
