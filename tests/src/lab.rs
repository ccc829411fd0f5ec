//! The [`Lab`] handle: builds a [`LabSpec`], runs commands in its namespaces,
//! and removes everything it created when dropped (also while unwinding from
//! a panic in the test that owns it).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::process::{Child, Output, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use crate::cidr::Ipv4Cidr;
use crate::cri::CriNode;
use crate::dual_stack::POD_NETWORK6;
use crate::error::{LabError, Result};
use crate::kube_proxy::{self, NodeNet, NodeNet6, ResolvedService};
use crate::kube_proxy_nft;
use crate::netns::{self, Netns};
use crate::servers;
use crate::spec::{LabSpec, NodeSpec, Overlay, ProxyMode, Runtime};
use crate::topology;

/// Default limit for [`Lab::exec`]: generous for curl/dig with their own
/// timeouts, but a hung command must not hang the test suite.
pub const EXEC_TIMEOUT: Duration = Duration::from_secs(60);

/// A running lab. Dropping it kills its processes and deletes its namespaces.
#[derive(Debug)]
pub struct Lab {
    id: String,
    spec: LabSpec,
    /// (target name, namespace) in creation order.
    namespaces: Vec<(String, Netns)>,
    /// Background processes (servers, [`Lab::spawn`]); a Mutex so `spawn`
    /// works through `&Lab` from several test threads.
    processes: Mutex<Vec<Child>>,
    /// The containerd of each [`Runtime::Containerd`] node.
    cri: Vec<CriNode>,
}

impl Lab {
    /// Builds the lab: namespaces, links, sysctls, kube-proxy rules, servers.
    /// On error, whatever was already created is removed before returning.
    pub fn build(spec: LabSpec) -> Result<Lab> {
        let uid = unsafe { libc::geteuid() };
        if uid != 0 {
            return Err(LabError::NotRoot { uid });
        }
        topology::validate(&spec)?;
        // Fail before creating anything when the pods' servers cannot be started.
        if spec
            .nodes
            .iter()
            .flat_map(|n| &n.pods)
            .any(|p| !p.servers.is_empty())
        {
            servers::lab_server_path()?;
        }
        netns::cleanup_stale();
        let mut lab = Lab {
            id: netns::unique_lab_id(),
            spec,
            namespaces: Vec::new(),
            processes: Mutex::new(Vec::new()),
            cri: Vec::new(),
        };
        topology::create(&mut lab)?;
        lab.start_cri_pods()?;
        lab.install_kube_proxy()?;
        lab.start_servers()?;
        Ok(lab)
    }

    /// The unique id all of this lab's namespace names start with.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The description the lab was built from.
    pub fn spec(&self) -> &LabSpec {
        &self.spec
    }

    pub(crate) fn add_netns(&mut self, target: &str) -> Result<()> {
        let ns = Netns::create(&format!("{}-{target}", self.id))?;
        self.namespaces.push((target.to_string(), ns));
        Ok(())
    }

    /// The namespace of a node, a pod, [`crate::ROUTER`] or [`crate::OUTSIDE`].
    pub fn netns(&self, target: &str) -> Result<&Netns> {
        self.namespaces
            .iter()
            .find(|(t, _)| t == target)
            .map(|(_, ns)| ns)
            .ok_or_else(|| LabError::UnknownTarget {
                name: target.to_string(),
                known: self.targets().join(", "),
            })
    }

    /// A node's namespace (what `nattrace --netns` is pointed at).
    pub fn node_netns(&self, node: &str) -> Result<&Netns> {
        if !self.spec.nodes.iter().any(|n| n.name == node) {
            return Err(LabError::UnknownTarget {
                name: node.to_string(),
                known: self
                    .spec
                    .nodes
                    .iter()
                    .map(|n| n.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        self.netns(node)
    }

    /// Names accepted by [`Lab::netns`] and [`Lab::exec`].
    pub fn targets(&self) -> Vec<&str> {
        self.namespaces.iter().map(|(t, _)| t.as_str()).collect()
    }

    /// The namespace names as `ip netns list` shows them.
    pub fn netns_names(&self) -> Vec<String> {
        self.namespaces
            .iter()
            .map(|(_, ns)| ns.name().to_string())
            .collect()
    }

    /// A pod's IP.
    pub fn pod_ip(&self, pod: &str) -> Option<Ipv4Addr> {
        self.spec
            .nodes
            .iter()
            .flat_map(|n| &n.pods)
            .find(|p| p.name == pod)
            .map(|p| p.ip)
    }

    /// A pod's IPv6 address (dual-stack labs).
    pub fn pod_ip6(&self, pod: &str) -> Option<Ipv6Addr> {
        self.spec
            .nodes
            .iter()
            .flat_map(|n| &n.pods)
            .find(|p| p.name == pod)
            .and_then(|p| p.ip6)
    }

    /// Pids of the background processes the lab started and still owns.
    pub fn pids(&self) -> Vec<u32> {
        self.processes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(Child::id)
            .collect()
    }

    /// Runs `args` in `target`'s namespace and waits (at most [`EXEC_TIMEOUT`]).
    /// A non-zero exit is returned in the `Output`, not as an error.
    pub fn exec(&self, target: &str, args: &[&str]) -> Result<Output> {
        self.exec_timeout(target, args, EXEC_TIMEOUT)
    }

    /// [`Lab::exec`] with an explicit limit; the command is killed after it.
    pub fn exec_timeout(&self, target: &str, args: &[&str], timeout: Duration) -> Result<Output> {
        netns::run(Some(self.netns(target)?), args, None, timeout)
    }

    /// Runs `args` in `target` and returns stdout; a non-zero exit is an
    /// error carrying stderr.
    pub fn run(&self, target: &str, args: &[&str]) -> Result<String> {
        netns::run_checked(Some(self.netns(target)?), args, None)
    }

    /// A NetworkPolicy-style DROP of new TCP traffic to `dst`:`port`, inserted
    /// first in filter FORWARD on `node` (what a policy controller writes).
    pub fn deny_forward_to(
        &self,
        node: &str,
        dst: impl Into<IpAddr>,
        port: u16,
        comment: &str,
    ) -> Result<String> {
        let dst = dst.into();
        let tool = if dst.is_ipv6() {
            "ip6tables"
        } else {
            "iptables"
        };
        let (dst, port) = (kube_proxy::host_cidr(dst), port.to_string());
        self.run(
            node,
            &[
                tool,
                "-w",
                "5",
                "-I",
                "FORWARD",
                "1",
                "-d",
                &dst,
                "-p",
                "tcp",
                "--dport",
                &port,
                "-m",
                "comment",
                "--comment",
                comment,
                "-j",
                "DROP",
            ],
        )
    }

    /// Starts `args` in the background in `target` (stdio to /dev/null);
    /// the process (and its process group) is killed when the lab is dropped.
    pub fn spawn(&self, target: &str, args: &[&str]) -> Result<u32> {
        let ns = self.netns(target)?;
        let (program, rest) = args
            .split_first()
            .ok_or_else(|| LabError::Spec("empty command".into()))?;
        let mut cmd = ns.command(program)?;
        cmd.args(rest)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let child = cmd.spawn().map_err(|source| LabError::Spawn {
            command: netns::describe(args),
            netns: ns.name().to_string(),
            source,
        })?;
        let pid = child.id();
        self.processes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(child);
        Ok(pid)
    }

    /// `curl` from `target` to `http://ip:port/` with `--max-time`.
    /// Exit code 28 means the transfer timed out (seed 000's symptom).
    pub fn http_get(
        &self,
        target: &str,
        ip: impl Into<IpAddr>,
        port: u16,
        max_time: Duration,
    ) -> Result<Output> {
        let url = format!("http://{}/", std::net::SocketAddr::new(ip.into(), port));
        let secs = format!("{:.1}", max_time.as_secs_f64());
        self.exec_timeout(
            target,
            &["curl", "-sS", "--max-time", &secs, &url],
            max_time + Duration::from_secs(5),
        )
    }

    /// `dig @server name A +time=secs +tries=1` from `target`.
    pub fn dig(
        &self,
        target: &str,
        server: impl Into<IpAddr>,
        name: &str,
        time: Duration,
    ) -> Result<Output> {
        let at = format!("@{}", server.into());
        let t = format!("+time={}", time.as_secs().max(1));
        self.exec_timeout(
            target,
            &["dig", &at, name, "A", &t, "+tries=1"],
            time + Duration::from_secs(5),
        )
    }

    /// `conntrack -L` in a node's namespace (the entries, one per line).
    pub fn conntrack(&self, node: &str) -> Result<String> {
        self.node_netns(node)?;
        self.run(node, &["conntrack", "-L"])
    }

    /// `iptables-save -t nat` in a node's namespace, through the backend the
    /// lab wrote its rules with.
    pub fn iptables_save(&self, node: &str) -> Result<String> {
        self.iptables_save_table(node, "nat")
    }

    /// `ip6tables-save -t <table>` in a node's namespace (the lab's backend).
    pub fn ip6tables_save_table(&self, node: &str, table: &str) -> Result<String> {
        self.node_netns(node)?;
        let save = self.spec.kube_proxy.iptables.save6();
        self.run(node, &[save, "-t", table])
    }

    /// `iptables-save -t <table>` in a node's namespace (the lab's backend).
    pub fn iptables_save_table(&self, node: &str, table: &str) -> Result<String> {
        self.node_netns(node)?;
        let save = self.spec.kube_proxy.iptables.save();
        self.run(node, &[save, "-t", table])
    }

    /// The `nft -f` ruleset of kube-proxy's nftables mode for node `index`.
    pub fn kube_proxy_nft_rules(&self, index: usize) -> String {
        kube_proxy_nft::render(
            &self.spec.kube_proxy,
            &self.resolved_services_on(self.spec.nodes.get(index).map(|n| n.name.as_str())),
            topology::node_underlay_ip(index),
        )
    }

    fn resolved_services(&self) -> Vec<ResolvedService> {
        self.resolved_services_on(None)
    }

    /// [`Self::resolved_services`] for node `node`'s rules: which endpoints
    /// run there (externalTrafficPolicy Local).
    fn resolved_services_on(&self, node: Option<&str>) -> Vec<ResolvedService> {
        let on_node = |pod: &str| {
            node.and_then(|n| self.spec.nodes.iter().find(|s| s.name == n))
                .is_some_and(|n| n.pods.iter().any(|p| p.name == pod))
        };
        self.spec
            .services
            .iter()
            .map(|svc| ResolvedService {
                port_name: svc.port_name_string(),
                cluster_ip: svc.cluster_ip.into(),
                port: svc.port,
                protocol: svc.protocol,
                endpoints: svc
                    .endpoints
                    .iter()
                    .map(|ep| (self.pod_ip(&ep.pod).expect("validated").into(), ep.port))
                    .collect(),
                pinned: svc.pinned,
                node_port: svc.node_port,
                external: svc.external.clone(),
                local: svc.endpoints.iter().map(|ep| on_node(&ep.pod)).collect(),
            })
            .collect()
    }

    /// The IPv6 halves of the dual-stack Services, with their pods' IPv6
    /// addresses (what kube-proxy's IPv6 proxier sees), for node `node`'s
    /// rules: its NodePorts' traffic policy and which endpoints run there.
    /// The LoadBalancer and external IPs are IPv4 ones: not in these rules.
    fn resolved_services6(&self, node: Option<&str>) -> Vec<ResolvedService> {
        let on_node = |pod: &str| {
            node.and_then(|n| self.spec.nodes.iter().find(|s| s.name == n))
                .is_some_and(|n| n.pods.iter().any(|p| p.name == pod))
        };
        self.spec
            .services
            .iter()
            .filter_map(|svc| {
                Some(ResolvedService {
                    port_name: svc.port_name_string(),
                    cluster_ip: svc.cluster_ip6?.into(),
                    port: svc.port,
                    protocol: svc.protocol,
                    endpoints: svc
                        .endpoints
                        .iter()
                        .filter_map(|ep| Some((self.pod_ip6(&ep.pod)?.into(), ep.port)))
                        .collect(),
                    pinned: svc.pinned,
                    node_port: svc.node_port,
                    external: crate::spec::ExternalSpec {
                        local_policy: svc.external.local_policy,
                        health_check_node_port: svc.external.health_check_node_port,
                        external_ips: Vec::new(),
                        lb_ips: Vec::new(),
                    },
                    local: svc
                        .endpoints
                        .iter()
                        .filter(|ep| self.pod_ip6(&ep.pod).is_some())
                        .map(|ep| on_node(&ep.pod))
                        .collect(),
                })
            })
            .collect()
    }

    /// The `nft -f` input of kube-proxy's `table ip6 kube-proxy` for node `index`.
    pub fn kube_proxy_nft_rules6(&self, index: usize) -> String {
        kube_proxy_nft::render6(
            &self.spec.kube_proxy,
            &self.resolved_services6(self.spec.nodes.get(index).map(|n| n.name.as_str())),
            crate::dual_stack::node_underlay_ip6(index),
            self.spec
                .kube_proxy
                .cluster_cidr
                .map(|_| POD_NETWORK6.to_string()),
        )
    }

    fn node_spec(&self, node: &str) -> Result<&NodeSpec> {
        self.spec
            .nodes
            .iter()
            .find(|n| n.name == node)
            .ok_or_else(|| LabError::UnknownTarget {
                name: node.to_string(),
                known: self.targets().join(", "),
            })
    }

    /// The `ip6tables-restore` input of a dual-stack node (see
    /// [`Lab::node_rules`]); None for an IPv4-only node.
    pub fn node_rules6(&self, node: &str) -> Result<Option<String>> {
        let spec = self.node_spec(node)?;
        Ok(spec.pod_cidr6.map(|pod_cidr| {
            kube_proxy::render_node6(
                &self.spec.kube_proxy,
                &self.resolved_services6(Some(node)),
                NodeNet6 {
                    pod_cidr,
                    cluster_network: POD_NETWORK6,
                },
            )
        }))
    }

    /// kube-proxy's own nat table (the same on every node of this lab).
    pub fn kube_proxy_rules(&self) -> String {
        kube_proxy::render_nat(&self.spec.kube_proxy, &self.resolved_services())
    }

    /// Everything the lab writes with `iptables-restore` on `node`: kube-proxy's
    /// filter and nat tables, kubelet's chains, the canaries and the CNI's chains.
    pub fn node_rules(&self, node: &str) -> Result<String> {
        let spec = self.node_spec(node)?;
        Ok(kube_proxy::render_node(
            &self.spec.kube_proxy,
            &self.resolved_services_on(Some(node)),
            NodeNet {
                pod_cidr: spec.pod_cidr,
                cluster_network: self.cluster_network(),
            },
        ))
    }

    /// The cluster's pod network: kube-proxy's `--cluster-cidr`, or else the
    /// smallest prefix holding every node's pod CIDR (flannel's `Network`).
    fn cluster_network(&self) -> Ipv4Cidr {
        if let Some(c) = self.spec.kube_proxy.cluster_cidr {
            return c.trunc();
        }
        let first = self.spec.nodes[0].pod_cidr;
        let mut prefix = first.prefix();
        while prefix > 0
            && !self.spec.nodes.iter().all(|n| {
                Ipv4Cidr::new(first.network(), prefix).contains(n.pod_cidr.network())
                    && n.pod_cidr.prefix() >= prefix
            })
        {
            prefix -= 1;
        }
        Ipv4Cidr::new(first.network(), prefix).trunc()
    }

    /// Deletes a pod the way a terminated pod disappears while its endpoint
    /// is still programmed: its processes and its namespace (and so its veth
    /// pair) go, kube-proxy's rules for it stay. Returns once the node's end
    /// of the veth is gone.
    pub fn delete_pod(&mut self, pod: &str) -> Result<()> {
        let node = self.pod_node(pod)?;
        // The node's end of the pod's veth, by ifindex ("eth0@if7"), so this
        // works whatever the datapath names it.
        let link = self.run(pod, &["ip", "-o", "link", "show", "dev", "eth0"])?;
        let peer = link
            .split_once("@if")
            .and_then(|(_, rest)| rest.split(':').next())
            .and_then(|i| i.parse::<u32>().ok())
            .ok_or_else(|| LabError::Spec(format!("no veth peer in {pod}'s eth0: {link}")))?;
        let at = self
            .namespaces
            .iter()
            .position(|(t, _)| t == pod)
            .ok_or_else(|| LabError::Spec(format!("pod {pod} was already deleted")))?;
        let (_, ns) = self.namespaces.remove(at);
        if let Some(cri) = self.cri_of_pod(pod) {
            // As kubelet deletes a pod: the sandbox stopped (the CNI DEL
            // removes its veth) and removed.
            cri.remove_pod(pod)?;
        } else {
            let me = std::process::id() as i32;
            for pid in ns.pids().into_iter().filter(|p| *p != me) {
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            ns.delete();
        }
        // The namespace is torn down asynchronously (cleanup_net runs from a
        // workqueue): wait for its veth to vanish from the node.
        let prefix = format!("{peer}: ");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let links = self.run(&node, &["ip", "-o", "link", "show"])?;
            if !links.lines().any(|l| l.starts_with(&prefix)) {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                return Err(LabError::Spec(format!(
                    "the veth (ifindex {peer}) of deleted pod {pod} is still on {node} after 10 s"
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills every process of a pod but keeps its namespace: the pod's
    /// address still answers ARP, but its ports are closed (RST).
    pub fn stop_pod_servers(&self, pod: &str) -> Result<()> {
        self.pod_node(pod)?;
        let ns = self.netns(pod)?;
        let me = std::process::id() as i32;
        for pid in ns.pids().into_iter().filter(|p| *p != me) {
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while ns.pids().into_iter().any(|p| p != me) {
            if std::time::Instant::now() > deadline {
                return Err(LabError::Spec(format!("servers of {pod} survive SIGKILL")));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// The node a pod runs on.
    fn pod_node(&self, pod: &str) -> Result<String> {
        self.spec
            .nodes
            .iter()
            .find(|n| n.pods.iter().any(|p| p.name == pod))
            .map(|n| n.name.clone())
            .ok_or_else(|| LabError::UnknownTarget {
                name: pod.to_string(),
                known: self.targets().join(", "),
            })
    }

    /// Creates a Service while the lab runs, as kube-proxy's next sync
    /// would: every node's rules are rewritten with it (one
    /// `iptables-restore`, and in nftables mode one `nft -f` transaction
    /// that replaces kube-proxy's table).
    pub fn add_service(&mut self, service: crate::ServiceSpec) -> Result<()> {
        self.spec.services.push(service);
        self.reinstall_kube_proxy()
    }

    /// Deletes the Service port with this cluster IP and port, the same way.
    pub fn remove_service(&mut self, cluster_ip: std::net::Ipv4Addr, port: u16) -> Result<()> {
        let before = self.spec.services.len();
        self.spec
            .services
            .retain(|s| !(s.cluster_ip == cluster_ip && s.port == port));
        if self.spec.services.len() == before {
            return Err(LabError::Spec(format!(
                "no Service {cluster_ip}:{port} in this lab"
            )));
        }
        self.reinstall_kube_proxy()
    }

    /// Replaces the Service port with `service`'s cluster IP and port (new
    /// endpoints), the way kube-proxy's next sync does: every node's rules
    /// rewritten at once. Conntrack entries are left as they are (kube-proxy
    /// would also delete UDP entries to removed endpoints: the stale-entry
    /// incident is that not happening).
    pub fn replace_service(&mut self, service: crate::ServiceSpec) -> Result<()> {
        let at = self
            .spec
            .services
            .iter()
            .position(|s| s.cluster_ip == service.cluster_ip && s.port == service.port)
            .ok_or_else(|| {
                LabError::Spec(format!(
                    "no Service {}:{} in this lab",
                    service.cluster_ip, service.port
                ))
            })?;
        self.spec.services[at] = service;
        self.reinstall_kube_proxy()
    }

    fn reinstall_kube_proxy(&self) -> Result<()> {
        self.write_kube_proxy(true)
    }

    /// kube-proxy's rules (iptables or nftables mode), kubelet's chains and
    /// the CNI's, on every node.
    fn install_kube_proxy(&self) -> Result<()> {
        self.write_kube_proxy(false)
    }

    /// `replace`: kube-proxy's nftables table exists and is replaced whole
    /// (`iptables-restore` replaces the tables it writes anyway).
    fn write_kube_proxy(&self, replace: bool) -> Result<()> {
        let restore = self.spec.kube_proxy.iptables.restore();
        for (index, node) in self.spec.nodes.iter().enumerate() {
            let ns = Some(self.netns(&node.name)?);
            let rules = self.node_rules(&node.name)?;
            // -w: legacy iptables takes a host-wide lock; parallel labs queue on it.
            netns::run_checked(ns, &[restore, "-w", "5"], Some(rules.as_bytes()))?;
            let rules6 = self.node_rules6(&node.name)?;
            if let Some(rules6) = &rules6 {
                let restore6 = self.spec.kube_proxy.iptables.restore6();
                netns::run_checked(ns, &[restore6, "-w", "5"], Some(rules6.as_bytes()))?;
            }
            if self.spec.kube_proxy.mode == ProxyMode::Nftables {
                let mut table = self.kube_proxy_nft_rules(index);
                if rules6.is_some() {
                    table.push_str(&self.kube_proxy_nft_rules6(index));
                }
                if replace {
                    // One `nft -f` is one transaction: no moment without it.
                    if rules6.is_some() {
                        table.insert_str(0, "delete table ip6 kube-proxy\n");
                    }
                    table.insert_str(0, "delete table ip kube-proxy\n");
                }
                netns::run_checked(ns, &["nft", "-f", "-"], Some(table.as_bytes()))?;
            }
        }
        Ok(())
    }

    /// Each containerd node's containerd, then its pods through the CRI
    /// in the spec's order; the spec takes the addresses host-local gave.
    fn start_cri_pods(&mut self) -> Result<()> {
        let mtu = if self.spec.overlay == Overlay::Vxlan {
            topology::VXLAN_MTU
        } else {
            1500
        };
        for n in 0..self.spec.nodes.len() {
            if self.spec.nodes[n].runtime != Runtime::Containerd {
                continue;
            }
            let node = self.spec.nodes[n].clone();
            let cri = CriNode::start(&self.id, &node, self.netns(&node.name)?, mtu)?;
            self.cri.push(cri);
            for (p, pod) in node.pods.iter().enumerate() {
                let made = self.cri.last().expect("just pushed").run_pod(&pod.name)?;
                self.namespaces
                    .push((pod.name.clone(), Netns::existing(&made.netns)));
                self.spec.nodes[n].pods[p].ip = made.ip;
                if !pod.sysctls.is_empty() {
                    topology::set_sysctls(self.netns(&pod.name)?, &pod.sysctls, None)?;
                }
            }
        }
        Ok(())
    }

    /// The containerd of `node`, if the CRI makes its pods.
    pub fn cri(&self, node: &str) -> Option<&CriNode> {
        let at = self
            .spec
            .nodes
            .iter()
            .filter(|n| n.runtime == Runtime::Containerd)
            .position(|n| n.name == node)?;
        self.cri.get(at)
    }

    fn cri_of_pod(&self, pod: &str) -> Option<&CriNode> {
        self.cri(&self.pod_node(pod).ok()?)
    }

    fn start_servers(&self) -> Result<()> {
        for pod in self.spec.nodes.iter().flat_map(|n| &n.pods) {
            if let Some(cri) = self.cri_of_pod(&pod.name) {
                for (i, server) in pod.servers.iter().enumerate() {
                    cri.start_server(&pod.name, i, server)?;
                }
                continue;
            }
            for server in &pod.servers {
                let child = servers::start(self.netns(&pod.name)?, &pod.name, server)?;
                self.processes
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(child);
            }
        }
        Ok(())
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        // The CRI removes its pods (and their namespaces) first, as a node
        // draining does; containerd lives in the node namespace below.
        self.cri.clear();
        let children = std::mem::take(self.processes.get_mut().unwrap_or_else(|e| e.into_inner()));
        for mut child in children {
            netns::kill_group(&mut child);
        }
        // Anything else still living in a lab namespace (started through
        // `exec` and detached) would keep the namespace alive after deletion.
        let me = std::process::id() as i32;
        for (_, ns) in &self.namespaces {
            for pid in ns.pids().into_iter().filter(|p| *p != me) {
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        for (_, ns) in self.namespaces.iter().rev() {
            ns.delete();
        }
    }
}
