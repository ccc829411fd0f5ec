//! nattrace's kernel programs. One module per hook family; all of them parse
//! the packet into a [`emit::Packet`] and hand it to [`filter::observe`],
//! which applies the shared Service filter (docs/DESIGN.md) and emits events.
#![no_std]
#![no_main]

mod config;
mod emit;
mod filter;
mod held;
mod icmp;
mod kprobes;
mod netfilter;
mod packet;
mod prefilter;
mod skb;
mod tc;
mod tracepoints;
mod watch;

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
};
use tracer_common::{Config, EndpointKey, EndpointState, InflightPacket, ServiceKey, stat};

/// Services to trace; value = index in the `--svc` list (255: from
/// kube-proxy's rules). 256 is far more than anyone passes with `--svc`;
/// userspace resizes it at load for `--all-services` and keeps it in step
/// with kube-proxy's rules (tracer-userspace/src/probes/services.rs).
#[map]
static SERVICES: HashMap<ServiceKey, u8> = HashMap::with_max_entries(256, 0);

/// Client sides of traced flows. LRU so a long trace never fills up: the
/// oldest (finished) flows are evicted first.
#[map]
static ENDPOINTS: LruHashMap<EndpointKey, EndpointState> = LruHashMap::with_max_entries(65536, 0);

/// Matched skbs by kernel address, to recognise a packet whose both endpoints
/// NAT rewrote. Entries only need to live while a packet crosses the node.
#[map]
static INFLIGHT: LruHashMap<u64, InflightPacket> = LruHashMap::with_max_entries(16384, 0);

#[map]
static CONFIG: Array<Config> = Array::with_max_entries(1, 0);

/// Interfaces of the traced namespace whose tc programs are attached (by
/// ifindex). The device tracepoints stand in for tc on the others (while
/// tc is being attached, or where it could not be).
#[map]
static TC_IFACES: HashMap<u32, u8> = HashMap::with_max_entries(16384, 0);

/// Byte size is replaced by userspace at load time (`--ringbuf` / TraceOptions).
#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(256 * 1024, 0);

#[map]
static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(stat::COUNT, 0);

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
