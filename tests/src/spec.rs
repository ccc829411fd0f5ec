//! The declarative description of a lab: nodes with pods, Services, the
//! kube-proxy configuration, the overlay between nodes and an optional
//! client outside the cluster.

use std::net::{Ipv4Addr, Ipv6Addr};

use crate::cidr::{Ipv4Cidr, Ipv6Cidr};

/// A whole lab. Build it with [`crate::Lab::build`].
#[derive(Clone, Debug)]
pub struct LabSpec {
    /// At least one node. Node and pod names share one name space, together
    /// with the reserved names `router` and `outside`.
    pub nodes: Vec<NodeSpec>,
    /// ClusterIP Services; kube-proxy rules for all of them go into every node.
    pub services: Vec<ServiceSpec>,
    /// Settings of the (simulated) kube-proxy on every node.
    pub kube_proxy: KubeProxyConfig,
    /// How nodes reach each other's pod CIDRs.
    pub overlay: Overlay,
    /// A client outside the cluster, behind the router (seed 003).
    pub outside: Option<OutsideSpec>,
}

impl LabSpec {
    /// A lab with the given nodes, no Services, kube-proxy defaults and vxlan.
    pub fn new(nodes: Vec<NodeSpec>) -> Self {
        LabSpec {
            nodes,
            services: Vec::new(),
            kube_proxy: KubeProxyConfig::default(),
            overlay: Overlay::Vxlan,
            outside: None,
        }
    }

    /// Adds a Service.
    pub fn service(mut self, service: ServiceSpec) -> Self {
        self.services.push(service);
        self
    }

    /// Every node with `datapath`; with [`Datapath::Routed`] the nodes also
    /// reach each other's pods by plain routes over the underlay
    /// ([`Overlay::HostGw`]), as kindnet and Calico's BGP mode do. Turns any
    /// preset into its routed-CNI variant.
    pub fn with_datapath(mut self, datapath: Datapath) -> Self {
        for node in &mut self.nodes {
            node.datapath = datapath;
        }
        if datapath == Datapath::Routed {
            self.overlay = Overlay::HostGw;
        }
        self
    }

    /// Every node's pods made by `runtime`: turns a preset into its
    /// containerd-CRI variant.
    pub fn with_runtime(mut self, runtime: Runtime) -> Self {
        for node in &mut self.nodes {
            node.runtime = runtime;
        }
        self
    }
}

/// One Kubernetes node: a namespace with `eth0` on the underlay, its pods'
/// host-side veths (ports of `cni0`, or routed: see [`Datapath`]) and (with
/// [`Overlay::Vxlan`]) `flannel.1`.
#[derive(Clone, Debug)]
pub struct NodeSpec {
    /// Short name, e.g. `node-a`; also the `exec` target for the node namespace.
    pub name: String,
    /// The node's pod CIDR; its first host address is the gateway on `cni0`.
    pub pod_cidr: Ipv4Cidr,
    /// `net.bridge.bridge-nf-call-iptables` in this node's namespace: whether
    /// bridged IPv4 traffic on `cni0` passes through iptables (seed 000).
    pub bridge_nf_call_iptables: bool,
    /// The node's IPv6 pod CIDR on a dual-stack lab (see [`LabSpec::dual_stack`]).
    pub pod_cidr6: Option<Ipv6Cidr>,
    /// `net.bridge.bridge-nf-call-ip6tables`: whether bridged IPv6 traffic
    /// on `cni0` passes through ip6tables (seed 000 over IPv6).
    pub bridge_nf_call_ip6tables: bool,
    /// `rp_filter` for `all`, `default` and every interface of the node.
    /// 0 by default: the lab's asymmetric paths (seed 003) must not be cut
    /// by reverse-path filtering unless a scenario asks for it.
    pub rp_filter: u8,
    /// Further sysctls for this node's namespace, `("net.ipv4.foo", "1")`;
    /// written after the links exist, so per-interface keys work.
    pub sysctls: Vec<(String, String)>,
    /// Pods scheduled on this node.
    pub pods: Vec<PodSpec>,
    /// How the CNI connects the pods: a bridge (default) or routed veths.
    pub datapath: Datapath,
    /// Who makes the pods: the lab itself (default) or containerd's CRI.
    pub runtime: Runtime,
}

/// Who creates a node's pods.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Runtime {
    /// The lab wires each pod's namespace and veth itself, at the
    /// addresses its [`PodSpec`] names: fast, and no runtime needed.
    #[default]
    HandWired,
    /// A containerd of the node's own (in the node's namespace) creates
    /// each pod through its CRI as kubelet does, and its CNI `bridge`
    /// plugin wires it with flannel's delegate config (see [`crate::cri`]).
    /// The pods' addresses are what host-local hands out: a [`PodSpec`]'s
    /// `ip` is replaced by it (read them with [`crate::Lab::pod_ip`]).
    /// Bridge datapath, IPv4 only.
    Containerd,
}

/// How a node's CNI plugs its pods in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Datapath {
    /// flannel / the bridge plugin: host veths `veth<i>` are ports of the
    /// `cni0` bridge, which holds the gateway (first host of the pod CIDR);
    /// pods have the pod CIDR's prefix and route via the gateway.
    #[default]
    Bridge,
    /// Routed (Calico; kindnet and the AWS VPC CNI work alike): no bridge.
    /// Each pod has `<ip>/32` on `eth0` and `default via 169.254.1.1`, a
    /// link-scope route to that address; the host veth
    /// (`cali<sha1("default.<pod>")[..11]>`, MAC `ee:ee:ee:ee:ee:ee`, no
    /// address) answers its ARP by proxy_arp, and the node routes
    /// `<ip>/32 dev cali…` back. Every packet between two pods of one node
    /// is routed (so it always passes netfilter); a pod reaching itself
    /// through its Service leaves and re-enters by the same veth.
    Routed,
}

impl NodeSpec {
    /// A node with bridge-nf-call-iptables=1 (what kubelet expects) and no pods.
    pub fn new(name: &str, pod_cidr: Ipv4Cidr) -> Self {
        NodeSpec {
            name: name.to_string(),
            pod_cidr,
            pod_cidr6: None,
            bridge_nf_call_iptables: true,
            bridge_nf_call_ip6tables: true,
            rp_filter: 0,
            sysctls: Vec::new(),
            pods: Vec::new(),
            datapath: Datapath::Bridge,
            runtime: Runtime::HandWired,
        }
    }

    /// Sets who creates the pods.
    pub fn runtime(mut self, runtime: Runtime) -> Self {
        self.runtime = runtime;
        self
    }

    /// Sets how the pods are connected.
    pub fn datapath(mut self, datapath: Datapath) -> Self {
        self.datapath = datapath;
        self
    }

    /// Adds a pod.
    pub fn pod(mut self, pod: PodSpec) -> Self {
        self.pods.push(pod);
        self
    }

    /// Sets `net.bridge.bridge-nf-call-iptables`.
    pub fn bridge_nf_call_iptables(mut self, on: bool) -> Self {
        self.bridge_nf_call_iptables = on;
        self
    }

    /// Sets `net.bridge.bridge-nf-call-ip6tables`.
    pub fn bridge_nf_call_ip6tables(mut self, on: bool) -> Self {
        self.bridge_nf_call_ip6tables = on;
        self
    }

    /// Adds a sysctl for the node namespace.
    pub fn sysctl(mut self, key: &str, value: &str) -> Self {
        self.sysctls.push((key.to_string(), value.to_string()));
        self
    }

    /// The IPv6 gateway on `cni0` (first host of the IPv6 pod CIDR).
    pub fn gateway6(&self) -> Option<Ipv6Addr> {
        self.pod_cidr6.map(|c| c.host(1))
    }

    /// The gateway address on `cni0` (first host of the pod CIDR; kept free
    /// on routed nodes too, where the pods use [`ROUTED_GATEWAY`]).
    pub fn gateway(&self) -> Ipv4Addr {
        self.pod_cidr.host(1)
    }
}

/// The link-local gateway of pods on a [`Datapath::Routed`] node (Calico's;
/// the AWS VPC CNI uses the same address). No interface holds it: the host
/// veth answers ARP for it by proxy.
pub const ROUTED_GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);

/// A pod: a namespace with `eth0`, a veth whose peer is in the node
/// namespace (a port of `cni0`, or routed: [`Datapath`]).
#[derive(Clone, Debug)]
pub struct PodSpec {
    /// Unique in the lab; the `exec` target for the pod.
    pub name: String,
    /// Inside the node's pod CIDR.
    pub ip: Ipv4Addr,
    /// Inside the node's IPv6 pod CIDR (dual-stack labs).
    pub ip6: Option<Ipv6Addr>,
    /// `hairpin_mode` on the pod's bridge port (needed for a pod reaching
    /// itself through a Service, seed 004 case 3). Bridge nodes only: a
    /// routed node has no bridge port to set it on.
    pub hairpin: bool,
    /// Servers started in the pod when the lab is built.
    pub servers: Vec<Server>,
    /// Sysctls for the pod's namespace, written after its links exist.
    pub sysctls: Vec<(String, String)>,
}

impl PodSpec {
    /// A pod without servers, hairpin off.
    pub fn new(name: &str, ip: Ipv4Addr) -> Self {
        PodSpec {
            name: name.to_string(),
            ip,
            ip6: None,
            hairpin: false,
            servers: Vec::new(),
            sysctls: Vec::new(),
        }
    }

    /// Adds a sysctl for the pod namespace.
    pub fn sysctl(mut self, key: &str, value: &str) -> Self {
        self.sysctls.push((key.to_string(), value.to_string()));
        self
    }

    /// Serves HTTP on `port`; the page names the pod and the client address.
    pub fn http(mut self, port: u16) -> Self {
        self.servers.push(Server::Http { port });
        self
    }

    /// Answers DNS A queries for `name` with `answer` on UDP `port`.
    pub fn dns(mut self, port: u16, name: &str, answer: Ipv4Addr) -> Self {
        self.servers.push(Server::Dns {
            port,
            name: name.to_string(),
            answer,
        });
        self
    }

    /// Sets hairpin mode on the pod's bridge port.
    pub fn hairpin(mut self, on: bool) -> Self {
        self.hairpin = on;
        self
    }
}

/// A server process started inside a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Server {
    /// HTTP/1.0 on TCP; `GET` returns `pod=<name> ip=<pod ip> client=<ip>:<port>`.
    Http {
        /// TCP port.
        port: u16,
    },
    /// DNS on UDP: A record for `name`, NXDOMAIN for anything else.
    Dns {
        /// UDP port.
        port: u16,
        /// The one name answered (no trailing dot needed).
        name: String,
        /// The address in the A record.
        answer: Ipv4Addr,
    },
}

/// L4 protocol of a Service port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

impl Protocol {
    /// Lower-case name as iptables and kube-proxy's chain hash use it.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        }
    }
}

/// One port of a ClusterIP Service (kube-proxy works per Service port).
#[derive(Clone, Debug)]
pub struct ServiceSpec {
    /// Kubernetes namespace, e.g. `default`.
    pub namespace: String,
    /// Service name, e.g. `web`.
    pub name: String,
    /// Port name, e.g. `http` (kube-proxy prints `ns/name:port`).
    pub port_name: String,
    /// The ClusterIP.
    pub cluster_ip: Ipv4Addr,
    /// The IPv6 ClusterIP of a dual-stack Service (`ipFamilyPolicy:
    /// PreferDualStack`); kube-proxy's IPv6 proxier renders it into ip6tables
    /// / `table ip6 kube-proxy` with the same Service port name.
    pub cluster_ip6: Option<Ipv6Addr>,
    /// The Service port.
    pub port: u16,
    /// TCP or UDP.
    pub protocol: Protocol,
    /// Endpoints in kube-proxy's order. Empty: a Service without endpoints,
    /// which kube-proxy REJECTs in filter `KUBE-SERVICES`.
    pub endpoints: Vec<EndpointSpec>,
    /// Index into `endpoints` that every connection goes to. The rules keep
    /// kube-proxy's shape (a `statistic` jump per endpoint but the last), only
    /// the probabilities become 0 before the pinned endpoint and 1 at it, so
    /// tests are deterministic while the ruleset still reads like a real node's.
    pub pinned: Option<usize>,
    /// `type: NodePort`: the port on every node address (`KUBE-NODEPORTS`
    /// in nat, or a `KUBE-EXTERNAL-SERVICES` REJECT without endpoints).
    pub node_port: Option<u16>,
    /// externalTrafficPolicy, LoadBalancer ingress and external IPs (issue 24).
    pub external: ExternalSpec,
}

/// How a Service is reached from outside the cluster (issue 24).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExternalSpec {
    /// `externalTrafficPolicy: Local`: no masquerade, only the rendering
    /// node's endpoints, and kube-proxy's "has no local endpoints" DROP on a
    /// node without one.
    pub local_policy: bool,
    /// `spec.externalIPs`.
    pub external_ips: Vec<Ipv4Addr>,
    /// `status.loadBalancer.ingress[].ip`.
    pub lb_ips: Vec<Ipv4Addr>,
    /// `spec.healthCheckNodePort` (Local policy).
    pub health_check_node_port: Option<u16>,
}

impl ServiceSpec {
    /// A Service port with no endpoints yet.
    pub fn new(
        namespace: &str,
        name: &str,
        port_name: &str,
        cluster_ip: Ipv4Addr,
        port: u16,
        protocol: Protocol,
    ) -> Self {
        ServiceSpec {
            namespace: namespace.to_string(),
            name: name.to_string(),
            port_name: port_name.to_string(),
            cluster_ip,
            cluster_ip6: None,
            port,
            protocol,
            endpoints: Vec::new(),
            pinned: None,
            node_port: None,
            external: ExternalSpec::default(),
        }
    }

    /// Makes it a NodePort Service on `port`.
    pub fn node_port(mut self, port: u16) -> Self {
        self.node_port = Some(port);
        self
    }

    /// Adds an endpoint: `pod`'s IP, `target_port`.
    pub fn endpoint(mut self, pod: &str, target_port: u16) -> Self {
        self.endpoints.push(EndpointSpec {
            pod: pod.to_string(),
            port: target_port,
        });
        self
    }

    /// Pins the endpoint at `index` (see [`ServiceSpec::pinned`]).
    pub fn pin(mut self, index: usize) -> Self {
        self.pinned = Some(index);
        self
    }

    /// `ns/name:port`, kube-proxy's ServicePortName string.
    pub fn port_name_string(&self) -> String {
        format!("{}/{}:{}", self.namespace, self.name, self.port_name)
    }
}

/// A Service endpoint, named by pod so the lab resolves its IP.
#[derive(Clone, Debug)]
pub struct EndpointSpec {
    /// Pod name.
    pub pod: String,
    /// Target port in the pod.
    pub port: u16,
}

/// The kube-proxy options that change the ruleset.
#[derive(Clone, Debug, Default)]
pub struct KubeProxyConfig {
    /// `--cluster-cidr`: adds `! -s <cidr> -j KUBE-MARK-MASQ` to each
    /// KUBE-SVC chain. `None` is a kube-proxy without it (seed 003's).
    pub cluster_cidr: Option<Ipv4Cidr>,
    /// `masqueradeAll`: every Service packet is marked for SNAT.
    pub masquerade_all: bool,
    /// Leaves out KUBE-SEP's `-s <endpoint> -j KUBE-MARK-MASQ`, so a pod
    /// reaching itself through its Service is not masqueraded (a broken or
    /// hand-edited ruleset, seed 004 case 3's failure).
    pub omit_hairpin_masquerade: bool,
    /// Which iptables binaries write the rules (the kernel side differs:
    /// nf_tables chains vs. x_tables tables, with their own hooks).
    pub iptables: IptablesBackend,
    /// The CNI's own chains written beside kube-proxy's.
    pub cni_chains: CniChains,
    /// Which kube-proxy backend writes the rules (`--proxy-mode`).
    pub mode: ProxyMode,
}

/// The iptables backend kube-proxy and kubelet write through.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IptablesBackend {
    /// `iptables-nft`: nf_tables tables `ip filter`/`ip nat`/`ip mangle`,
    /// whose base chains exist only once a rule is added to them.
    #[default]
    Nft,
    /// `iptables-legacy`: x_tables; a table, once instantiated in the
    /// namespace, hooks every chain it has (`/proc/net/ip_tables_names`).
    Legacy,
}

impl IptablesBackend {
    /// The `*-restore` binary for this backend.
    pub fn restore(self) -> &'static str {
        match self {
            IptablesBackend::Nft => "iptables-nft-restore",
            IptablesBackend::Legacy => "iptables-legacy-restore",
        }
    }

    /// The `ip6tables-*-restore` binary for this backend.
    pub fn restore6(self) -> &'static str {
        match self {
            IptablesBackend::Nft => "ip6tables-nft-restore",
            IptablesBackend::Legacy => "ip6tables-legacy-restore",
        }
    }

    /// The `ip6tables-*-save` binary for this backend.
    pub fn save6(self) -> &'static str {
        match self {
            IptablesBackend::Nft => "ip6tables-nft-save",
            IptablesBackend::Legacy => "ip6tables-legacy-save",
        }
    }

    /// The `*-save` binary for this backend.
    pub fn save(self) -> &'static str {
        match self {
            IptablesBackend::Nft => "iptables-nft-save",
            IptablesBackend::Legacy => "iptables-legacy-save",
        }
    }
}

/// The CNI chains on every node, beside kube-proxy's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CniChains {
    /// flannel: `FLANNEL-FWD` in filter FORWARD, and with `ip_masq`
    /// (kube-flannel.yml's `--ip-masq`) `FLANNEL-POSTRTG` in nat POSTROUTING.
    Flannel {
        /// flanneld `--ip-masq`.
        ip_masq: bool,
    },
    /// Calico's raw and mangle `cali-*` chains (PREROUTING/OUTPUT in raw,
    /// PREROUTING/POSTROUTING in mangle).
    Calico,
    /// No CNI chains.
    None,
}

impl Default for CniChains {
    fn default() -> Self {
        CniChains::Flannel { ip_masq: true }
    }
}

/// kube-proxy's `--proxy-mode` as the lab renders it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ProxyMode {
    /// `iptables-restore` of kube-proxy's filter, nat and mangle tables (its default).
    #[default]
    Iptables,
    /// `nft -f` of `table ip kube-proxy` (GA since 1.33), see [`crate::kube_proxy_nft`].
    Nftables,
}

/// How one node's pods reach another node's pods.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Overlay {
    /// flannel's vxlan backend: `flannel.1` (VNI 1, UDP 8472) in each node,
    /// `<pod cidr> via <cidr>.0 dev flannel.1 onlink` + static neigh/fdb.
    #[default]
    Vxlan,
    /// flannel's host-gw backend: `<pod cidr> via <node eth0 ip>`.
    HostGw,
}

/// A client outside the cluster (an office behind a VPN gateway, seed 003):
/// namespace `outside` behind namespace `router`, which routes the Service
/// CIDR to one node.
#[derive(Clone, Debug)]
pub struct OutsideSpec {
    /// The client's address; the router takes the first host of its prefix.
    pub client: Ipv4Cidr,
    /// The prefix the router sends to `service_route_via`.
    pub service_cidr: Ipv4Cidr,
    /// Name of the node that the Service CIDR is routed to.
    pub service_route_via: String,
}
