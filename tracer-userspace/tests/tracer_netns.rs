//! Root test of the loader against the running kernel: two namespaces of our
//! own joined by a veth pair, nattrace attached to one of them ("node"), real
//! TCP traffic, and event-level checks of what the kernel programs read from
//! kernel structs at BTF offsets (ifindex, netns inode, addresses, ports).
//! Nothing is touched in the root namespace. Skips (passes) when not root.
use std::{
    net::Ipv4Addr,
    os::unix::fs::MetadataExt,
    process::{Child, Command, Stdio},
    time::Duration,
};

use nattrace::{
    probes::{
        TraceOptions, Tracer,
        table::{KernelFeatures, Need},
    },
    service::Service,
};
use tracer_common::{
    EndpointKey, PacketEvent, direction, hook, nat_stage, nf_hook, tcp_flags, v4_mapped,
};

// Documentation range (RFC 5737): only ever used inside our namespaces.
const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
const NODE_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);

fn sh(args: &[&str]) {
    let status = Command::new(args[0])
        .args(&args[1..])
        .status()
        .expect("spawn");
    assert!(status.success(), "{args:?} failed");
}

/// Two namespaces and a veth pair; all removed on drop (also on panic).
struct Lab {
    client: String,
    node: String,
    server: Option<Child>,
}

impl Lab {
    fn new() -> Lab {
        let tag = format!(
            "nttr-{}-{}",
            std::process::id(),
            std::time::UNIX_EPOCH.elapsed().unwrap().subsec_micros()
        );
        let lab = Lab {
            client: format!("{tag}-c"),
            node: format!("{tag}-n"),
            server: None,
        };
        sh(&["ip", "netns", "add", &lab.client]);
        sh(&["ip", "netns", "add", &lab.node]);
        sh(&[
            "ip",
            "-n",
            &lab.client,
            "link",
            "add",
            "c0",
            "type",
            "veth",
            "peer",
            "name",
            "n0",
            "netns",
            &lab.node,
        ]);
        for (ns, dev, ip) in [(&lab.client, "c0", CLIENT_IP), (&lab.node, "n0", NODE_IP)] {
            sh(&[
                "ip",
                "-n",
                ns,
                "addr",
                "add",
                &format!("{ip}/24"),
                "dev",
                dev,
            ]);
            sh(&["ip", "-n", ns, "link", "set", dev, "up"]);
            sh(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        }
        lab
    }

    fn ifindex(&self, ns: &str, dev: &str) -> u32 {
        let out = Command::new("ip")
            .args(["-n", ns, "-j", "link", "show", "dev", dev])
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v[0]["ifindex"].as_u64().unwrap() as u32
    }

    fn inode(&self, ns: &str) -> u32 {
        std::fs::metadata(format!("/run/netns/{ns}")).unwrap().ino() as u32
    }

    fn start_server(&mut self, port: u16) {
        let code = format!(
            "import socket\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n\
             s.bind(('{NODE_IP}',{port}))\ns.listen()\nwhile True:\n c,_=s.accept()\n c.sendall(b'hi')\n c.close()\n"
        );
        let child = Command::new("ip")
            .args(["netns", "exec", &self.node, "python3", "-c", &code])
            .stdin(Stdio::null())
            .spawn()
            .expect("python3");
        let pid = child.id();
        self.server = Some(child);
        // `ip netns exec` execs python3 in place: the same pid listens.
        lab::wait::listening(pid, port).unwrap_or_else(|e| panic!("the server: {e:#}"));
    }

    /// `count` datagrams from CLIENT_IP:sport to NODE_IP:dport (nobody listens).
    fn udp_send(&self, sport: u16, dport: u16, count: u32) {
        let code = format!(
            "import socket,time\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n\
             s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\ns.bind(('{CLIENT_IP}',{sport}))\n\
             for i in range({count}):\n s.sendto(b'data',('{NODE_IP}',{dport}))\n time.sleep(0.05)\n"
        );
        sh(&["ip", "netns", "exec", &self.client, "python3", "-c", &code]);
    }

    /// One TCP connection from the client namespace; returns what it read.
    fn connect(&self, port: u16) -> String {
        let code = format!(
            "import socket\ns=socket.socket()\ns.settimeout(2)\n\
             try:\n s.connect(('{NODE_IP}',{port}))\n print(s.recv(10).decode())\nexcept Exception as e:\n print(type(e).__name__)\n"
        );
        let out = Command::new("ip")
            .args(["netns", "exec", &self.client, "python3", "-c", &code])
            .output()
            .expect("python3");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if let Some(mut child) = self.server.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        for ns in [&self.client, &self.node] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// Reads events until `done` holds for what was read so far (and the
/// tracer's counters): the event a check waits for, not a time. The ring
/// buffer wakes its reader only as it fills, so each round also drains it.
fn collect_until(
    tracer: &mut Tracer,
    rt: &tokio::runtime::Runtime,
    what: &str,
    done: impl Fn(&Tracer, &[PacketEvent]) -> bool,
) -> Vec<PacketEvent> {
    let mut out = Vec::new();
    lab::wait::until_true(what, lab::wait::FAIL_AFTER, || {
        tracer.drain(&mut out);
        if done(tracer, &out) {
            return true;
        }
        rt.block_on(async {
            let _ =
                tokio::time::timeout(Duration::from_millis(50), tracer.next_events(&mut out)).await;
        });
        done(tracer, &out)
    })
    .unwrap_or_else(|e| panic!("{e:#}; read {} events", out.len()));
    out
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

#[test]
fn events_carry_correct_kernel_fields() {
    if !is_root() {
        eprintln!("skipped: needs root (creates network namespaces, loads eBPF)");
        return;
    }
    let _ = env_logger::builder().is_test(true).try_init();
    let port = 18000 + (std::process::id() % 1000) as u16;
    let mut lab = Lab::new();
    lab.start_server(port);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();

    let opts = TraceOptions {
        services: vec![Service {
            addr: NODE_IP.into(),
            port: None,
        }],
        netns: Some(lab.node.clone()),
        ringbuf_bytes: 1 << 20,
        backend: Default::default(),
        all_services: false,
        // Every packet: these tests check each observation point.
        buffer: false,
        reply_timeout_ns: 3_000_000_000,
        benign_drops: [0; 4],
        closed_drops: [0; 4],
    };
    let mut tracer = start_checked(&opts);
    let (node_inode, client_inode) = (lab.inode(&lab.node), lab.inode(&lab.client));
    let (n0, c0) = (lab.ifindex(&lab.node, "n0"), lab.ifindex(&lab.client, "c0"));
    check_facts(&tracer, node_inode, n0);

    assert_eq!(lab.connect(port), "hi");
    // A closed port: the node drops the SYN (no socket) and answers RST.
    let closed = port + 1;
    assert_eq!(lab.connect(closed), "ConnectionRefusedError");
    // The closed port's drop is the last packet of the two connections.
    let events = collect_until(&mut tracer, &rt, "the closed port's drop", |_, ev| {
        ev.iter()
            .any(|e| e.hook == hook::DROP && e.dport == closed && e.netns == node_inode)
    });
    let ours: Vec<&PacketEvent> = events
        .iter()
        .filter(|e| e.netns == node_inode || e.netns == client_inode)
        .collect();
    check_kernel_fields(&ours, port, (node_inode, client_inode), (n0, c0));
    let stats = tracer.stats();
    assert!(stats.events as usize >= ours.len(), "{stats:?}");
    assert_eq!(stats.ringbuf_full, 0);

    check_muting(&mut tracer, &lab, &rt, port);
    check_new_interfaces_then_detach(tracer, &lab);
    check_clsact_path(&lab, &opts, &rt, port, n0);
}

/// Starts the tracer; on a kernel with BPF netfilter links nothing may be skipped.
fn start_checked(opts: &TraceOptions) -> Tracer {
    let tracer = Tracer::start(opts).expect("start tracer");
    for s in tracer.skipped() {
        eprintln!("skipped: {} ({})", s.program, s.reason);
    }
    eprintln!("attached: {:#?}", tracer.attached());
    // A kernel with BPF netfilter links runs every program of that backend.
    let features = KernelFeatures::probe();
    if features.check(Need::NetfilterLink).is_ok() {
        assert!(tracer.skipped().is_empty(), "{:?}", tracer.skipped());
    } else {
        eprintln!(
            "not checked: every program attached (kernel {:?} has no BPF netfilter links)",
            features.version
        );
    }
    tracer
}

fn check_facts(tracer: &Tracer, node_inode: u32, n0: u32) {
    let facts = tracer.facts().clone();
    assert_eq!(facts.netns_inode, node_inode);
    assert!(
        facts
            .interfaces
            .iter()
            .any(|i| i.name == "n0" && i.ifindex == n0 && i.kind == "veth")
    );
    assert_eq!(facts.ip_forward, Some(false));
}

/// Every observation point reports the SYN, its SYN-ACK and the closed
/// port's drop with the right hook, namespace, device and skb identity.
fn check_kernel_fields(
    ours: &[&PacketEvent],
    port: u16,
    (node_inode, client_inode): (u32, u32),
    (n0, c0): (u32, u32),
) {
    let closed = port + 1;
    for e in ours {
        eprintln!(
            "{:>10} {:<11} {:<13} ns={} if={} {}:{} -> {}:{} flags={:#04x} dir={} reason={}",
            hook::name(e.hook),
            nf_hook::name(e.nf_hook),
            nat_stage::name(e.nat_stage),
            e.netns,
            e.ifindex,
            nattrace::service::ip_of(e.saddr),
            e.sport,
            nattrace::service::ip_of(e.daddr),
            e.dport,
            e.tcp_flags,
            e.direction,
            e.drop_reason
        );
    }
    let syn = |e: &&&PacketEvent| {
        e.tcp_flags & tcp_flags::SYN != 0 && e.tcp_flags & tcp_flags::ACK == 0 && e.dport == port
    };
    let request = |e: &PacketEvent| {
        e.saddr == v4_mapped(CLIENT_IP.octets())
            && e.daddr == v4_mapped(NODE_IP.octets())
            && e.direction == direction::REQUEST
    };
    let has = |what: &str, pred: &dyn Fn(&PacketEvent) -> bool| {
        assert!(ours.iter().any(|e| pred(e)), "no {what} event");
    };
    // Client side: raw tracepoint in the client namespace; ifindex and netns
    // come from skb->dev->ifindex and dev->nd_net->ns.inum.
    has("DEV_TX of the SYN in the client netns", &|e| {
        syn(&&e)
            && request(e)
            && e.hook == hook::DEV_TX
            && e.netns == client_inode
            && e.ifindex == c0
    });
    // tc covers n0, so the receive tracepoint does not report it a second time.
    assert!(
        !ours
            .iter()
            .any(|e| e.hook == hook::DEV_RX && e.netns == node_inode && e.ifindex == n0),
        "DEV_RX on n0 duplicates tc ingress"
    );
    has("tc ingress of the SYN on n0", &|e| {
        syn(&&e)
            && request(e)
            && e.hook == hook::TC_INGRESS
            && e.ifindex == n0
            && e.netns == node_inode
            && e.skb != 0
    });
    for (hookno, stage) in [
        (nf_hook::PRE_ROUTING, nat_stage::BEFORE),
        (nf_hook::PRE_ROUTING, nat_stage::AFTER),
        (nf_hook::LOCAL_IN, nat_stage::BEFORE),
        (nf_hook::LOCAL_IN, nat_stage::AFTER),
    ] {
        has(
            &format!(
                "netfilter {} {}",
                nf_hook::name(hookno),
                nat_stage::name(stage)
            ),
            &|e| {
                syn(&&e)
                    && request(e)
                    && e.hook == hook::NETFILTER
                    && e.nf_hook == hookno
                    && e.nat_stage == stage
                    && e.ifindex == n0
            },
        );
    }
    has("SYN-ACK reply at OUTPUT", &|e| {
        e.hook == hook::NETFILTER
            && e.nf_hook == nf_hook::LOCAL_OUT
            && e.direction == direction::REPLY
            && e.sport == port
            && e.saddr == v4_mapped(NODE_IP.octets())
            && e.tcp_flags & tcp_flags::SYN != 0
    });
    has("SYN-ACK reply at tc egress of n0", &|e| {
        e.hook == hook::TC_EGRESS
            && e.ifindex == n0
            && e.direction == direction::REPLY
            && e.sport == port
    });
    has("drop of the SYN to the closed port (NO_SOCKET)", &|e| {
        e.hook == hook::DROP && e.dport == closed && e.netns == node_inode && e.drop_reason != 0
    });
    // The same skb is reported under one identity by tc, netfilter and the tracepoints.
    let tc_skb = ours
        .iter()
        .find(|e| syn(e) && e.hook == hook::TC_INGRESS)
        .unwrap()
        .skb;
    assert!(
        ours.iter()
            .any(|e| e.hook == hook::NETFILTER && e.skb == tc_skb)
    );
    let closed_syn_skb = ours
        .iter()
        .find(|e| {
            e.tcp_flags & (tcp_flags::SYN | tcp_flags::ACK) == tcp_flags::SYN
                && e.dport == closed
                && e.hook == hook::TC_INGRESS
        })
        .unwrap()
        .skb;
    assert!(
        ours.iter()
            .any(|e| e.hook == hook::DROP && e.dport == closed && e.skb == closed_syn_skb)
    );
}

/// After mute(), plain data packets of the flow are only counted, until a
/// failure (here the closed port's drop) that the watch sends.
fn check_muting(tracer: &mut Tracer, lab: &Lab, rt: &tokio::runtime::Runtime, port: u16) {
    let udp_port = 40000 + (std::process::id() % 1000) as u16;
    lab.udp_send(udp_port, port, 1);
    collect_until(tracer, rt, "the unmuted datagram", |_, ev| {
        ev.iter()
            .any(|e| e.proto == tracer_common::proto::UDP && e.sport == udp_port)
    });
    let client = EndpointKey {
        addr: v4_mapped(CLIENT_IP.octets()),
        port: udp_port,
        proto: tracer_common::proto::UDP,
        _pad: 0,
    };
    tracer.mute(client).unwrap();
    let muted_before = tracer.stats().muted;
    lab.udp_send(udp_port, port, 3);
    // The kernel counted the 3 datagrams as muted: what they emitted is in.
    let later = collect_until(tracer, rt, "3 muted datagrams counted", |t, _| {
        t.stats().muted >= muted_before + 3
    });
    // Nothing listens on the port: the node drops the first datagram
    // (NO_SOCKET), a failure the watch of a muted flow sends (WATCH) and
    // unmutes on, so the later datagrams go per packet. Before that drop
    // the datagram's points were only counted.
    let ours: Vec<_> = later.iter().filter(|e| e.sport == udp_port).collect();
    let first_drop = ours
        .iter()
        .filter(|e| e.hook == hook::DROP)
        .min_by_key(|e| e.ts_ns)
        .unwrap_or_else(|| panic!("the closed port's drop: {ours:#?}"));
    assert_ne!(
        first_drop.flags & tracer_common::event_flags::WATCH,
        0,
        "the watch sent the drop: {first_drop:#?}"
    );
    // The node's ICMP port unreachable about the datagram (sent before its
    // NO_SOCKET drop, udp_rcv → icmp_send) is an error about the flow, which
    // the kernel always sends (issue 23), muted or not.
    assert!(
        ours.iter().any(|e| e.icmp_type == 3 && e.icmp_code == 3),
        "the port unreachable about the datagram: {ours:#?}"
    );
    let emitted: Vec<_> = ours
        .iter()
        .filter(|e| e.hook != hook::DROP && e.icmp_type == 0 && e.ts_ns < first_drop.ts_ns)
        .collect();
    assert!(
        emitted.is_empty(),
        "muted flow still emitted data events: {emitted:#?}"
    );
    assert!(
        tracer.stats().muted >= muted_before + 3,
        "{:?}",
        tracer.stats()
    );
}

/// An interface created while tracing (a new pod) gets attached, and
/// dropping the tracer leaves no tcx program behind.
fn check_new_interfaces_then_detach(mut tracer: Tracer, lab: &Lab) {
    sh(&[
        "ip", "-n", &lab.node, "link", "add", "x0", "type", "veth", "peer", "name", "x1",
    ]);
    let mut added = tracer.poll_new_interfaces().unwrap();
    added.sort();
    assert_eq!(added, ["x0", "x1"]);
    assert!(tracer.poll_new_interfaces().unwrap().is_empty());

    drop(tracer);
    assert_eq!(
        tcx_programs(&lab.node, "n0"),
        0,
        "tcx programs left on n0 after drop"
    );
    assert_eq!(
        tcx_programs(&lab.node, "x0"),
        0,
        "tcx programs left on x0 after drop"
    );
}

/// The pre-6.6 path: clsact qdiscs. One that exists (n0) stays, one we
/// create (x0) is removed, and our filters go in both cases.
fn check_clsact_path(
    lab: &Lab,
    opts: &TraceOptions,
    rt: &tokio::runtime::Runtime,
    port: u16,
    n0: u32,
) {
    sh(&["ip", "-n", &lab.node, "link", "set", "x0", "up"]);
    sh(&["tc", "-n", &lab.node, "qdisc", "add", "dev", "n0", "clsact"]);
    // SAFETY: the only test in this binary; no other thread reads the environment.
    unsafe { std::env::set_var("NATTRACE_FORCE_CLSACT", "1") };
    let mut tracer = Tracer::start(opts).expect("start tracer (clsact)");
    unsafe { std::env::remove_var("NATTRACE_FORCE_CLSACT") };
    assert!(
        tracer.attached()[0].contains("clsact"),
        "{:?}",
        tracer.attached()
    );
    assert!(tc_show(&lab.node, &["filter", "show", "dev", "n0", "ingress"]).contains("tc_ingress"));
    assert!(tc_show(&lab.node, &["qdisc", "show", "dev", "x0"]).contains("clsact"));
    assert_eq!(lab.connect(port), "hi");
    collect_until(
        &mut tracer,
        rt,
        "tc ingress on n0 through clsact",
        |_, ev| {
            ev.iter()
                .any(|e| e.hook == hook::TC_INGRESS && e.ifindex == n0 && e.dport == port)
        },
    );
    drop(tracer);
    assert!(
        tc_show(&lab.node, &["qdisc", "show", "dev", "n0"]).contains("clsact"),
        "pre-existing clsact removed"
    );
    assert!(
        !tc_show(&lab.node, &["filter", "show", "dev", "n0", "ingress"]).contains("tc_ingress")
    );
    assert!(!tc_show(&lab.node, &["filter", "show", "dev", "n0", "egress"]).contains("tc_egress"));
    assert!(
        !tc_show(&lab.node, &["qdisc", "show", "dev", "x0"]).contains("clsact"),
        "our clsact left behind"
    );
}

fn tc_show(ns: &str, args: &[&str]) -> String {
    let out = Command::new("tc")
        .args(["-n", ns])
        .args(args)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Number of tcx programs on `dev` (ingress + egress) in namespace `ns`.
fn tcx_programs(ns: &str, dev: &str) -> usize {
    let node_ns = std::fs::File::open(format!("/run/netns/{ns}")).unwrap();
    let dev = dev.to_owned();
    std::thread::spawn(move || {
        nix::sched::setns(node_ns, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        let mut n = 0;
        for at in [
            aya::programs::TcAttachType::Ingress,
            aya::programs::TcAttachType::Egress,
        ] {
            let (_, progs) = aya::programs::SchedClassifier::query_tcx(&dev, at).unwrap();
            n += progs.len();
        }
        n
    })
    .join()
    .unwrap()
}
