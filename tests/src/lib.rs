//! The nattrace lab: a Kubernetes node (or several) built from network
//! namespaces, with kube-proxy's iptables rules and real servers, so the seed
//! incidents happen for real and the tracer can be tested against them.
//!
//! ```no_run
//! use std::time::Duration;
//! use lab::{Lab, presets};
//!
//! let lab = Lab::build(presets::seed000(presets::Seed000 {
//!     bridge_nf_call_iptables: false,
//!     backend: presets::Backend::SameNode,
//! }))?;
//! // nattrace --netns <this path> would trace node-a.
//! let node = lab.node_netns(presets::NODE_A)?.path();
//! let out = lab.http_get(presets::CLIENT_POD, presets::WEB_SERVICE_IP, 80, Duration::from_secs(2))?;
//! assert_eq!(out.status.code(), Some(28)); // timed out, as in seed 000
//! println!("{node:?}\n{}", lab.conntrack(presets::NODE_A)?);
//! # Ok::<(), lab::LabError>(())
//! ```
//!
//! Everything lives in namespaces named `ntlab-<pid>-<n>-<rand>-<target>`;
//! the root namespace is never modified, and dropping the [`Lab`] (also
//! during a panic) kills its processes and deletes its namespaces.

mod cidr;
pub mod cri;
pub mod dual_stack;
mod error;
pub mod hold;
pub mod kube_proxy;
pub mod kube_proxy_nft;
pub mod kubelet;
mod lab;
mod netns;
pub mod presets;
mod scratch;
mod servers;
mod spec;
mod topology;
mod topology6;
pub mod tracer;
pub mod wait;

/// `tracer-userspace/fixtures/`: the one home of the tracer's fixture data,
/// which some lab tests compare against the live lab (and rewrite on demand).
pub fn fixtures_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tracer-userspace/fixtures")
}

pub use cidr::{Ipv4Cidr, Ipv6Cidr, cidr};
pub use error::{LabError, Result};
pub use lab::{EXEC_TIMEOUT, Lab};
pub use netns::{NAME_PREFIX, NETNS_DIR, Netns, cleanup_stale};
pub use scratch::Scratch;
pub use servers::{LAB_SERVER_ENV, lab_server_path};
pub use spec::{
    CniChains, Datapath, EndpointSpec, ExternalSpec, IptablesBackend, KubeProxyConfig, LabSpec,
    NodeSpec, OutsideSpec, Overlay, PodSpec, Protocol, ProxyMode, ROUTED_GATEWAY, Runtime, Server,
    ServiceSpec,
};
pub use topology::{
    OUTSIDE, ROUTED_HOST_MAC, ROUTER, UNDERLAY, VXLAN_ID, VXLAN_MTU, VXLAN_PORT, host_veth,
    node_underlay_ip, router_underlay_ip, vxlan_mac,
};

/// Whether the current process can build labs (effective uid 0).
pub fn is_root() -> bool {
    unsafe { libc::geteuid() == 0 }
}

/// Whether a root-only test must skip (and so pass): without root it says so
/// on stderr, so that the pass is not mistaken for a run. `why`: what needs
/// root and how to run the test with it.
pub fn skip_without_root(why: &str) -> bool {
    let skip = !is_root();
    if skip {
        eprintln!("SKIPPED: {why}");
    }
    skip
}

/// [`Lab::build`] for tests, where a lab that cannot be built is a failure.
pub fn build_lab(spec: LabSpec) -> Lab {
    Lab::build(spec).unwrap_or_else(|e| panic!("building the lab failed: {e}"))
}

/// Declares a root test per kube-proxy mode for a scenario `fn body(ProxyMode)`:
/// `$iptables` (the original name) and `$nftables` (`_nft`). The calling test
/// file provides `require_root!`, which skips with its own message.
#[macro_export]
macro_rules! both_modes {
    ($body:ident: $iptables:ident, $nftables:ident) => {
        #[test]
        fn $iptables() {
            require_root!();
            $body($crate::ProxyMode::Iptables);
        }
        #[test]
        fn $nftables() {
            require_root!();
            $body($crate::ProxyMode::Nftables);
        }
    };
}
