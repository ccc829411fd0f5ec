//! Root smoke test of IPv6 tracing, independent of the lab library: a
//! seed-000 node in namespaces — a client pod and a backend pod on the
//! node's `cni0` bridge, an ip6tables (nft) DNAT from the Service address to
//! the backend — and the `nattrace` binary tracing it by `--svc [v6]:port`.
//! Healthy (`bridge-nf-call-ip6tables=1` in the node namespace): `ok`.
//! Broken (`=0`): the backend's reply is bridged straight to the client
//! without passing ip6tables, so it is never reverse-NATed:
//! `reply_not_reverse_nated`. The healthy run traces the Service dual-stack
//! (its IPv4 and IPv6 ClusterIPs in one run); a last one sends UDP with an
//! IPv6 extension header. Everything happens in namespaces this test
//! creates and removes (also on panic).
use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
};

// Unique local addresses (RFC 4193), only ever used inside our namespaces.
const BRIDGE_IP: &str = "fd00:10:244::1";
const CLIENT_IP: &str = "fd00:10:244::2";
const BACKEND_IP: &str = "fd00:10:244::3";
const SERVICE_IP: &str = "fd00:10:96::a";
const BACKEND_PORT: u16 = 8080;
// The IPv4 side of the dual-stack pods and Service.
const BRIDGE_V4: &str = "10.244.0.1";
const CLIENT_V4: &str = "10.244.0.2";
const BACKEND_V4: &str = "10.244.0.3";
const SERVICE_V4: &str = "10.96.0.10";

fn root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn sh(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .expect("spawn");
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Node, client and backend namespaces; removed on drop (also on panic).
struct Lab {
    node: String,
    client: String,
    backend: String,
    server: Option<Child>,
}

impl Drop for Lab {
    fn drop(&mut self) {
        if let Some(mut s) = self.server.take() {
            let _ = s.kill();
            let _ = s.wait();
        }
        for ns in [&self.client, &self.backend, &self.node] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

impl Lab {
    fn new() -> Lab {
        let tag = format!(
            "nt6-{}-{}",
            std::process::id(),
            std::time::UNIX_EPOCH.elapsed().unwrap().subsec_micros()
        );
        let lab = Lab {
            node: format!("{tag}-n"),
            client: format!("{tag}-c"),
            backend: format!("{tag}-b"),
            server: None,
        };
        for ns in [&lab.node, &lab.client, &lab.backend] {
            sh(&["ip", "netns", "add", ns]);
            // DAD off before any link exists: `nodad` below covers the global
            // addresses only, and while cni0's kernel-made link-local is
            // tentative the node sends no neighbour solicitation for a
            // forwarded packet (net/ipv6/ndisc.c ndisc_send_ns(): no saddr
            // and ipv6_get_lladdr(.., IFA_F_TENTATIVE|IFA_F_OPTIMISTIC) fails
            // → return), so the first SYNs wait ~2 s in the neighbour queue
            // and a busy machine's connect timed out (6 of 15 runs).
            for key in [
                "net.ipv6.conf.all.accept_dad=0",
                "net.ipv6.conf.default.accept_dad=0",
            ] {
                sh(&["ip", "netns", "exec", ns, "sysctl", "-qw", key]);
            }
            sh(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        }
        let n = lab.node.as_str();
        sh(&["ip", "-n", n, "link", "add", "cni0", "type", "bridge"]);
        sh(&["ip", "-n", n, "link", "set", "cni0", "up"]);
        // nodad: no 1-2 s of duplicate address detection before the address works.
        let bridge_cidr = format!("{BRIDGE_IP}/64");
        sh(&[
            "ip",
            "-n",
            n,
            "addr",
            "add",
            &bridge_cidr,
            "dev",
            "cni0",
            "nodad",
        ]);
        sh(&[
            "ip",
            "-n",
            n,
            "addr",
            "add",
            &format!("{BRIDGE_V4}/24"),
            "dev",
            "cni0",
        ]);
        for (pod, veth, ip, v4) in [
            (&lab.client, "veth-client", CLIENT_IP, CLIENT_V4),
            (&lab.backend, "veth-backend", BACKEND_IP, BACKEND_V4),
        ] {
            sh(&[
                "ip", "-n", pod, "link", "add", "eth0", "type", "veth", "peer", "name", veth,
                "netns", n,
            ]);
            sh(&["ip", "-n", n, "link", "set", veth, "master", "cni0", "up"]);
            let cidr = format!("{ip}/64");
            sh(&[
                "ip", "-n", pod, "addr", "add", &cidr, "dev", "eth0", "nodad",
            ]);
            let v4 = format!("{v4}/24");
            sh(&["ip", "-n", pod, "addr", "add", &v4, "dev", "eth0"]);
            sh(&["ip", "-n", pod, "link", "set", "eth0", "up"]);
            sh(&["ip", "-n", pod, "route", "add", "default", "via", BRIDGE_V4]);
            sh(&[
                "ip", "-n", pod, "-6", "route", "add", "default", "via", BRIDGE_IP,
            ]);
        }
        lab.node_exec(&["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"]);
        lab.node_exec(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
        let v4_to = format!("{BACKEND_V4}:{BACKEND_PORT}");
        lab.node_exec(&[
            "iptables-nft",
            "-t",
            "nat",
            "-A",
            "PREROUTING",
            "-d",
            &format!("{SERVICE_V4}/32"),
            "-p",
            "tcp",
            "--dport",
            "80",
            "-j",
            "DNAT",
            "--to-destination",
            &v4_to,
        ]);
        // kube-proxy's DNATs, reduced to the rules that matter here.
        lab.dnat("tcp", 80, &format!("[{BACKEND_IP}]:{BACKEND_PORT}"));
        lab.dnat("udp", 53, &format!("[{BACKEND_IP}]:5353"));
        lab
    }

    fn dnat(&self, proto: &str, port: u16, to: &str) {
        let svc = format!("{SERVICE_IP}/128");
        let port = port.to_string();
        self.node_exec(&[
            "ip6tables-nft",
            "-t",
            "nat",
            "-A",
            "PREROUTING",
            "-d",
            &svc,
            "-p",
            proto,
            "--dport",
            &port,
            "-j",
            "DNAT",
            "--to-destination",
            to,
        ]);
    }

    fn node_exec(&self, args: &[&str]) {
        let mut all = vec!["ip", "netns", "exec", &self.node];
        all.extend_from_slice(args);
        sh(&all);
    }

    /// The per-namespace br_netfilter switch for IPv6, in the node namespace only.
    fn bridge_nf_call_ip6tables(&self, on: bool) {
        let v = format!("net.bridge.bridge-nf-call-ip6tables={}", u8::from(on));
        self.node_exec(&["sysctl", "-qw", &v]);
    }

    fn start_server(&mut self) {
        let code = format!(
            "import socket\ns=socket.socket(socket.AF_INET6)\n\
             s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n\
             s.bind(('::',{BACKEND_PORT}))\ns.listen()\nwhile True:\n c,_=s.accept()\n c.sendall(b'hi')\n c.close()\n"
        );
        let child = Command::new("ip")
            .args(["netns", "exec", &self.backend, "python3", "-c", &code])
            .stdin(Stdio::null())
            .spawn()
            .expect("python3");
        let pid = child.id();
        self.server = Some(child);
        // `ip netns exec` execs python3 in place: the same pid listens.
        // (A fixed 500 ms here once lost the race on a loaded machine: the
        // first connection timed out.)
        lab::wait::listening(pid, BACKEND_PORT).unwrap_or_else(|e| panic!("the server: {e:#}"));
    }

    /// One TCP connection from the client pod to the Service; what it read or the error's name.
    fn connect(&self) -> String {
        self.connect_to("AF_INET6", SERVICE_IP)
    }

    fn connect_to(&self, family: &str, service: &str) -> String {
        let code = format!(
            "import socket\ns=socket.socket(socket.{family})\ns.settimeout(2)\n\
             try:\n s.connect(('{service}',80))\n print(s.recv(10).decode())\n\
             except Exception as e:\n print(type(e).__name__)\n"
        );
        let out = Command::new("ip")
            .args(["netns", "exec", &self.client, "python3", "-c", &code])
            .output()
            .expect("python3");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// UDP datagrams to the Service's port 53 carrying a Destination
    /// Options extension header (a sticky IPV6_DSTOPTS: 8 bytes, PadN), so
    /// UDP is not right after the fixed header.
    fn udp_with_dstopts(&self) -> String {
        let code = format!(
            "import socket,time\ns=socket.socket(socket.AF_INET6,socket.SOCK_DGRAM)\n\
             s.setsockopt(socket.IPPROTO_IPV6,socket.IPV6_DSTOPTS,bytes([0,0,1,4,0,0,0,0]))\n\
             for i in range(3):\n s.sendto(b'query',('{SERVICE_IP}',53))\n time.sleep(0.05)\nprint('sent')\n"
        );
        let out = Command::new("ip")
            .args(["netns", "exec", &self.client, "python3", "-c", &code])
            .output()
            .expect("python3");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// Runs nattrace on the node while one connection is made; returns the
    /// client's result and nattrace's JSON flow lines.
    fn trace_one(&self) -> (String, Vec<serde_json::Value>) {
        self.trace(&format!("[{SERVICE_IP}]:80"), || self.connect())
    }

    /// Runs nattrace on the node (one `--svc` per space-separated value)
    /// during `traffic`, then finishes it with SIGUSR1: it exits once the
    /// traffic's flows are decided. (A fixed `--duration` can end before
    /// that on a loaded machine.)
    fn trace(
        &self,
        svc: &str,
        traffic: impl FnOnce() -> String,
    ) -> (String, Vec<serde_json::Value>) {
        let mut child = Command::new(env!("CARGO_BIN_EXE_nattrace"))
            .args(svc.split(' ').flat_map(|s| ["--svc", s]))
            .args(["--netns", &self.node, "--output", "json"])
            .args(["--reply-timeout", "1000"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("nattrace");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        // The first line is printed once every program is attached.
        let first = lines.next().and_then(Result::ok);
        assert!(
            first.is_some(),
            "nattrace printed nothing: {:?}",
            child.wait_with_output()
        );
        let got = traffic();
        // SAFETY: kill(2) on our own child, which has not been reaped.
        unsafe { libc::kill(child.id() as i32, libc::SIGUSR1) };
        let flows: Vec<serde_json::Value> = lines
            .map_while(Result::ok)
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(&l).ok())
            .filter(|v| v.get("verdict").is_some())
            .collect();
        let out = child.wait_with_output().expect("wait");
        assert!(
            out.status.code().is_some_and(|c| c <= 1),
            "nattrace failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        (got, flows)
    }
}

fn assert_one_flow(flows: &[serde_json::Value], verdict: &str) {
    let ours: Vec<_> = flows
        .iter()
        .filter(|f| f["service"] == format!("[{SERVICE_IP}]:80"))
        .collect();
    assert!(!ours.is_empty(), "no flow for the Service: {flows:#?}");
    for f in &ours {
        eprintln!("{f}");
        assert_eq!(f["verdict"], verdict, "{f:#}");
        let client = f["client"].as_str().unwrap();
        assert!(client.starts_with(&format!("[{CLIENT_IP}]:")), "{f:#}");
        assert_eq!(
            f["backend"],
            format!("[{BACKEND_IP}]:{BACKEND_PORT}"),
            "{f:#}"
        );
    }
}

#[test]
fn ipv6_service_healthy_then_reply_bridged_past_ip6tables() {
    if !root() {
        eprintln!("skipped: needs root (network namespaces, eBPF)");
        return;
    }
    let mut lab = Lab::new();
    lab.start_server();

    // Healthy, and the Service dual-stack: both ClusterIPs in one run.
    lab.bridge_nf_call_ip6tables(true);
    let both = format!("[{SERVICE_IP}]:80 {SERVICE_V4}:80");
    let (got, flows) = lab.trace(&both, || {
        let v6 = lab.connect();
        let v4 = lab.connect_to("AF_INET", SERVICE_V4);
        format!("{v6} {v4}")
    });
    assert_eq!(
        got, "hi hi",
        "healthy node: both families must get their answer"
    );
    assert_one_flow(&flows, "ok");
    let v4: Vec<_> = flows
        .iter()
        .filter(|f| f["service"] == format!("{SERVICE_V4}:80"))
        .collect();
    assert_eq!(v4.len(), 1, "{flows:#?}");
    assert_eq!(v4[0]["verdict"], "ok", "{:#}", v4[0]);
    assert_eq!(v4[0]["backend"], format!("{BACKEND_V4}:{BACKEND_PORT}"));

    // br_netfilter's switch is per namespace (struct brnf_net, 5.3+): the
    // value in the namespace owning the bridge decides whether bridged IPv6
    // frames go through the ip6tables hooks (net/bridge/br_netfilter_hooks.c,
    // br_nf_pre_routing: `if (!brnet->call_ip6tables && !br_opt_get(br,
    // BROPT_NF_CALL_IP6TABLES)) return NF_ACCEPT;`).
    lab.bridge_nf_call_ip6tables(false);
    let (got, flows) = lab.trace_one();
    assert_ne!(
        got, "hi",
        "broken node: the un-reverse-NATed reply must not connect"
    );
    assert_one_flow(&flows, "reply_not_reverse_nated");

    // An extension header between IPv6 and UDP: the programs step over it
    // (tracer-ebpf ipv6_l4), so the flow is seen before and after DNAT.
    // Nothing listens on 5353: the verdict is not the point here.
    let (sent, flows) = lab.trace(SERVICE_IP, || lab.udp_with_dstopts());
    assert_eq!(sent, "sent");
    let udp: Vec<_> = flows
        .iter()
        .filter(|f| f["service"] == format!("[{SERVICE_IP}]:53"))
        .collect();
    assert!(!udp.is_empty(), "no flow for the UDP Service: {flows:#?}");
    for f in udp {
        eprintln!("{f}");
        assert_eq!(f["backend"], format!("[{BACKEND_IP}]:5353"), "{f:#}");
    }
}
