//! Ready-made labs for the seed incidents (docs/SEEDS.md). The addresses
//! are the incidents' own: everything lives in lab namespaces, so they
//! collide with nothing.

use std::net::Ipv4Addr;

use crate::cidr::{Ipv4Cidr, cidr};
use crate::spec::{
    CniChains, KubeProxyConfig, LabSpec, NodeSpec, OutsideSpec, Overlay, PodSpec, Protocol,
    ServiceSpec,
};

/// The node the client pod runs on.
pub const NODE_A: &str = "node-a";
/// The second node (flannel vxlan peer).
pub const NODE_B: &str = "node-b";
/// Pod CIDR of [`NODE_A`] (gateway .1 on cni0).
pub const NODE_A_POD_CIDR: Ipv4Cidr = Ipv4Cidr::new(Ipv4Addr::new(100, 96, 54, 0), 24);
/// Pod CIDR of [`NODE_B`].
pub const NODE_B_POD_CIDR: Ipv4Cidr = Ipv4Cidr::new(Ipv4Addr::new(100, 96, 55, 0), 24);
/// kops' default cluster CIDR (kube-proxy `--cluster-cidr`).
pub const CLUSTER_CIDR: Ipv4Cidr = Ipv4Cidr::new(Ipv4Addr::new(100, 96, 0, 0), 11);
/// kops' default Service CIDR.
pub const SERVICE_CIDR: Ipv4Cidr = Ipv4Cidr::new(Ipv4Addr::new(100, 64, 0, 0), 13);

/// Seed 000's PodA, the client, on [`NODE_A`].
pub const CLIENT_POD: &str = "client";
/// PodA's IP.
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(100, 96, 54, 240);
/// Seed 000's PodB, the backend on the client's node.
pub const BACKEND_POD: &str = "backend";
/// PodB's IP.
pub const BACKEND_IP: Ipv4Addr = Ipv4Addr::new(100, 96, 54, 247);
/// The backend on [`NODE_B`].
pub const REMOTE_BACKEND_POD: &str = "backend-b";
/// Its IP.
pub const REMOTE_BACKEND_IP: Ipv4Addr = Ipv4Addr::new(100, 96, 55, 21);
/// Seed 000's Service IP (`default/web:http`).
pub const WEB_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(100, 67, 30, 133);
/// Its port.
pub const WEB_PORT: u16 = 80;

/// The cluster DNS Service IP (seed 001, kops' kube-dns address).
pub const DNS_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(100, 64, 0, 10);
/// DNS pod on [`NODE_A`].
pub const DNS_POD: &str = "coredns";
/// Its IP.
pub const DNS_POD_IP: Ipv4Addr = Ipv4Addr::new(100, 96, 54, 10);
/// DNS pod on [`NODE_B`].
pub const REMOTE_DNS_POD: &str = "coredns-b";
/// Its IP.
pub const REMOTE_DNS_POD_IP: Ipv4Addr = Ipv4Addr::new(100, 96, 55, 10);
/// The name the DNS pods answer (with [`WEB_SERVICE_IP`]).
pub const DNS_NAME: &str = "web.default.svc.cluster.local";

/// The office client of seed 003 (namespace [`crate::OUTSIDE`]).
pub const OUTSIDE_CLIENT: Ipv4Cidr = Ipv4Cidr::new(Ipv4Addr::new(10, 8, 0, 10), 24);

/// Where the chosen endpoint runs, relative to the client pod.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// On the client's node: the reply is bridged on cni0 (seed 000's failure
    /// when bridge-nf-call-iptables=0).
    #[default]
    SameNode,
    /// On the other node: the reply is routed in from flannel.1 and always
    /// passes netfilter.
    OtherNode,
}

impl Backend {
    fn pin(self) -> usize {
        match self {
            Backend::SameNode => 0,
            Backend::OtherNode => 1,
        }
    }
}

/// Options of [`seed000`].
#[derive(Clone, Copy, Debug)]
pub struct Seed000 {
    /// `net.bridge.bridge-nf-call-iptables` on both nodes.
    pub bridge_nf_call_iptables: bool,
    /// Which endpoint the Service is pinned to.
    pub backend: Backend,
}

impl Default for Seed000 {
    fn default() -> Self {
        Seed000 {
            bridge_nf_call_iptables: true,
            backend: Backend::SameNode,
        }
    }
}

fn two_nodes(bridge_nf_call_iptables: bool) -> (NodeSpec, NodeSpec) {
    (
        NodeSpec::new(NODE_A, NODE_A_POD_CIDR).bridge_nf_call_iptables(bridge_nf_call_iptables),
        NodeSpec::new(NODE_B, NODE_B_POD_CIDR).bridge_nf_call_iptables(bridge_nf_call_iptables),
    )
}

fn kops_kube_proxy() -> KubeProxyConfig {
    KubeProxyConfig {
        cluster_cidr: Some(CLUSTER_CIDR),
        masquerade_all: false,
        omit_hairpin_masquerade: false,
        ..KubeProxyConfig::default()
    }
}

/// Seed 000: pod [`CLIENT_POD`] curls `default/web:http`
/// ([`WEB_SERVICE_IP`]:80), whose endpoints are [`BACKEND_POD`] (same node)
/// and [`REMOTE_BACKEND_POD`] (other node), pinned by `backend`.
pub fn seed000(opts: Seed000) -> LabSpec {
    let (a, b) = two_nodes(opts.bridge_nf_call_iptables);
    let a = a
        .pod(PodSpec::new(CLIENT_POD, CLIENT_IP))
        .pod(PodSpec::new(BACKEND_POD, BACKEND_IP).http(WEB_PORT));
    let b = b.pod(PodSpec::new(REMOTE_BACKEND_POD, REMOTE_BACKEND_IP).http(WEB_PORT));
    let mut spec = LabSpec::new(vec![a, b]).service(web_service(opts.backend));
    spec.kube_proxy = kops_kube_proxy();
    spec
}

fn web_service(backend: Backend) -> ServiceSpec {
    local_web_service()
        .endpoint(REMOTE_BACKEND_POD, WEB_PORT)
        .pin(backend.pin())
}

/// `default/web:http` with [`BACKEND_POD`] as its only endpoint.
fn local_web_service() -> ServiceSpec {
    ServiceSpec::new(
        "default",
        "web",
        "http",
        WEB_SERVICE_IP,
        WEB_PORT,
        Protocol::Tcp,
    )
    .endpoint(BACKEND_POD, WEB_PORT)
}

/// Options of [`dns`].
#[derive(Clone, Copy, Debug)]
pub struct Dns {
    /// `net.bridge.bridge-nf-call-iptables` on both nodes.
    pub bridge_nf_call_iptables: bool,
    /// Which DNS pod the Service is pinned to.
    pub backend: Backend,
}

impl Default for Dns {
    fn default() -> Self {
        Dns {
            bridge_nf_call_iptables: true,
            backend: Backend::SameNode,
        }
    }
}

/// Seed 001: pod [`CLIENT_POD`] queries `kube-system/kube-dns:dns`
/// ([`DNS_SERVICE_IP`]:53/udp), served by [`DNS_POD`] (same node) or
/// [`REMOTE_DNS_POD`] (other node); both answer [`DNS_NAME`].
pub fn dns(opts: Dns) -> LabSpec {
    let (a, b) = two_nodes(opts.bridge_nf_call_iptables);
    let a = a
        .pod(PodSpec::new(CLIENT_POD, CLIENT_IP))
        .pod(PodSpec::new(DNS_POD, DNS_POD_IP).dns(53, DNS_NAME, WEB_SERVICE_IP));
    let b =
        b.pod(PodSpec::new(REMOTE_DNS_POD, REMOTE_DNS_POD_IP).dns(53, DNS_NAME, WEB_SERVICE_IP));
    let service = ServiceSpec::new(
        "kube-system",
        "kube-dns",
        "dns",
        DNS_SERVICE_IP,
        53,
        Protocol::Udp,
    )
    .endpoint(DNS_POD, 53)
    .endpoint(REMOTE_DNS_POD, 53)
    .pin(opts.backend.pin());
    let mut spec = LabSpec::new(vec![a, b]).service(service);
    spec.kube_proxy = kops_kube_proxy();
    spec
}

/// Options of [`seed003`].
#[derive(Clone, Copy, Debug)]
pub struct Seed003 {
    /// kube-proxy `masqueradeAll` (the report's fix).
    pub masquerade_all: bool,
    /// Where the pinned endpoint runs relative to [`NODE_B`], the node the
    /// router sends Service traffic to: `OtherNode` (the default, the
    /// report's failing case) pins [`BACKEND_POD`] on node-a, `SameNode`
    /// pins [`REMOTE_BACKEND_POD`] on node-b.
    pub backend: Backend,
}

impl Default for Seed003 {
    fn default() -> Self {
        Seed003 {
            masquerade_all: false,
            backend: Backend::OtherNode,
        }
    }
}

/// Seed 003: the [`crate::OUTSIDE`] client ([`OUTSIDE_CLIENT`]) reaches
/// `default/web:http` through the router, whose route for [`SERVICE_CIDR`]
/// points at [`NODE_B`]. kube-proxy has no `--cluster-cidr` (as in the
/// report), so without `masquerade_all` the outside client is not SNATed and
/// a backend on node-a replies straight to the router: the connection fails.
pub fn seed003(opts: Seed003) -> LabSpec {
    let (a, b) = two_nodes(true);
    let a = a.pod(PodSpec::new(BACKEND_POD, BACKEND_IP).http(WEB_PORT));
    let b = b.pod(PodSpec::new(REMOTE_BACKEND_POD, REMOTE_BACKEND_IP).http(WEB_PORT));
    // web_service pins relative to node-a; this scenario is seen from node-b.
    let from_node_b = match opts.backend {
        Backend::SameNode => Backend::OtherNode,
        Backend::OtherNode => Backend::SameNode,
    };
    let mut spec = LabSpec::new(vec![a, b]).service(web_service(from_node_b));
    spec.kube_proxy = KubeProxyConfig {
        cluster_cidr: None,
        masquerade_all: opts.masquerade_all,
        omit_hairpin_masquerade: false,
        // flanneld --ip-masq would masquerade the outside client's request
        // on its way to another node's pod and so hide the incident: the
        // report's nodes did not masquerade it.
        cni_chains: CniChains::Flannel { ip_masq: false },
        ..KubeProxyConfig::default()
    };
    spec.overlay = Overlay::Vxlan;
    spec.outside = Some(OutsideSpec {
        client: OUTSIDE_CLIENT,
        service_cidr: SERVICE_CIDR,
        service_route_via: NODE_B.to_string(),
    });
    spec
}

/// A single node with one client and one HTTP backend, for quick experiments.
pub fn single_node(bridge_nf_call_iptables: bool) -> LabSpec {
    let node = NodeSpec::new(NODE_A, cidr("100.96.54.0/24"))
        .bridge_nf_call_iptables(bridge_nf_call_iptables)
        .pod(PodSpec::new(CLIENT_POD, CLIENT_IP))
        .pod(PodSpec::new(BACKEND_POD, BACKEND_IP).http(WEB_PORT));
    let mut spec = LabSpec::new(vec![node]).service(local_web_service());
    spec.kube_proxy = kops_kube_proxy();
    spec
}

/// Options of [`hairpin`].
#[derive(Clone, Copy, Debug)]
pub struct Hairpin {
    /// `hairpin_mode` on the pod's bridge port (kubelet's hairpin-veth).
    pub hairpin_mode: bool,
    /// KUBE-SEP's `-s <podIP> -j KUBE-MARK-MASQ` (kube-proxy always writes it).
    pub masquerade: bool,
}

impl Default for Hairpin {
    fn default() -> Self {
        Hairpin {
            hairpin_mode: true,
            masquerade: true,
        }
    }
}

/// Seed 004 case 3: pod [`BACKEND_POD`] calls its own Service
/// `default/web:http` and is load-balanced to itself (the only endpoint).
pub fn hairpin(opts: Hairpin) -> LabSpec {
    let node = NodeSpec::new(NODE_A, NODE_A_POD_CIDR).pod(
        PodSpec::new(BACKEND_POD, BACKEND_IP)
            .http(WEB_PORT)
            .hairpin(opts.hairpin_mode),
    );
    let mut spec = LabSpec::new(vec![node]).service(local_web_service());
    spec.kube_proxy = KubeProxyConfig {
        omit_hairpin_masquerade: !opts.masquerade,
        ..kops_kube_proxy()
    };
    spec
}

/// `default/web-empty:http`: a Service whose pods are all gone (or not
/// ready), so kube-proxy REJECTs it in filter `KUBE-SERVICES`.
pub const EMPTY_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(100, 67, 30, 140);

/// [`no_endpoints`]' NodePort of `default/web:http`.
pub const WEB_NODE_PORT: u16 = 30080;
/// [`no_endpoints`]' NodePort of `default/web-empty:http`.
pub const EMPTY_NODE_PORT: u16 = 30081;

/// A bridged node with [`CLIENT_POD`], `default/web:http` served by
/// [`BACKEND_POD`], and `default/web-empty:http` ([`EMPTY_SERVICE_IP`]:80)
/// without endpoints; both are NodePort Services ([`WEB_NODE_PORT`],
/// [`EMPTY_NODE_PORT`]).
pub fn no_endpoints() -> LabSpec {
    let mut spec = single_node(true).service(
        ServiceSpec::new(
            "default",
            "web-empty",
            "http",
            EMPTY_SERVICE_IP,
            WEB_PORT,
            Protocol::Tcp,
        )
        .node_port(EMPTY_NODE_PORT),
    );
    spec.services[0].node_port = Some(WEB_NODE_PORT);
    spec.nodes[0].pod_cidr = NODE_A_POD_CIDR;
    spec
}

/// `default/web:http` as nattrace's `--svc` takes it.
pub fn web_svc() -> String {
    format!("{WEB_SERVICE_IP}:{WEB_PORT}")
}
