//! The traced network namespace: opening it, running code inside it, and
//! reading (never writing) what it looks like.
//!
//! tc and netfilter attachments, rtnetlink sockets and `/proc/sys/net` all
//! act on the network namespace of the *calling thread*, so those calls run
//! on a short-lived thread that `setns(CLONE_NEWNET)`s first. The rest of the
//! process (and raw tracepoint attachment, which must see the original mount
//! namespace's tracefs/bpffs) stays where it was. We never switch mount
//! namespaces (unlike `ip netns exec`).
use std::{
    collections::BTreeSet,
    fs::File,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd},
        unix::fs::MetadataExt,
    },
    path::{Path, PathBuf},
};

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage,
    NetlinkPayload,
};
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    address::AddressMessage,
    link::{InfoBridgePort, InfoPortData, LinkAttribute, LinkInfo, LinkMessage},
    nsid::{NsidAttribute, NsidMessage},
    tc::{TcAttribute, TcHandle, TcMessage},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};
use nix::sched::CloneFlags;

use crate::facts::Interface;

pub struct Netns {
    file: File,
    pub inode: u32,
    /// How the user named it (or "current").
    pub name: String,
    /// Whether it is the namespace we started in (then no setns is needed).
    current: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error(
        "no network namespace '{name}' ({path} does not exist); list them with `ip netns list`"
    )]
    NotFound { name: String, path: PathBuf },
    /// EACCES/EPERM opening or entering it: as a user, a one-line "needs
    /// root"; as root, what hid it (e.g. another process's /proc/PID/ns
    /// under ptrace rules).
    #[error("cannot {action} network namespace {name}: permission denied{hint}")]
    Denied {
        name: String,
        action: &'static str,
        hint: &'static str,
    },
    #[error("cannot open network namespace {path}: {error}")]
    Open {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("cannot enter network namespace {name}: {error}")]
    Setns { name: String, error: nix::Error },
    #[error("rtnetlink: {0}")]
    Netlink(std::io::Error),
}

impl Netns {
    /// `spec`: None = the current namespace, NAME = /run/netns/NAME, or a path
    /// (e.g. /proc/PID/ns/net of a kind node container).
    pub fn open(spec: Option<&str>) -> Result<Self, NetnsError> {
        let (name, path, current) = match spec {
            None => (
                "current".to_owned(),
                PathBuf::from("/proc/thread-self/ns/net"),
                true,
            ),
            Some(s) if s.contains('/') => (s.to_owned(), PathBuf::from(s), false),
            Some(s) => (s.to_owned(), Path::new("/run/netns").join(s), false),
        };
        // Not `path.exists()`: it says false for EACCES too (e.g. a user
        // naming /proc/1/ns/net), which read as "does not exist".
        let file = File::open(&path).map_err(|error| match error.kind() {
            std::io::ErrorKind::NotFound => NetnsError::NotFound {
                name: name.clone(),
                path: path.clone(),
            },
            std::io::ErrorKind::PermissionDenied => denied(&name, "open"),
            _ => NetnsError::Open {
                path: path.clone(),
                error,
            },
        })?;
        let meta = file.metadata().map_err(|error| NetnsError::Open {
            path: path.clone(),
            error,
        })?;
        let own = std::fs::metadata("/proc/thread-self/ns/net")
            .map(|m| m.ino())
            .ok();
        Ok(Netns {
            inode: meta.ino() as u32,
            current: current || own == Some(meta.ino()),
            name,
            file,
        })
    }

    /// The open namespace file (valid while `self` lives).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Runs `f` on a thread inside the namespace and returns its result.
    pub fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> Result<R, NetnsError> {
        if self.current {
            return Ok(f());
        }
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::setns(self.file.as_fd(), CloneFlags::CLONE_NEWNET).map_err(
                    |error| match error {
                        // setns(2) wants CAP_SYS_ADMIN over the namespace.
                        nix::Error::EPERM | nix::Error::EACCES => denied(&self.name, "enter"),
                        error => NetnsError::Setns {
                            name: self.name.clone(),
                            error,
                        },
                    },
                )?;
                Ok(f())
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }
}

fn denied(name: &str, action: &'static str) -> NetnsError {
    NetnsError::Denied {
        name: name.to_owned(),
        action,
        hint: if nix::unistd::geteuid().is_root() {
            // fs/proc/namespaces.c proc_ns_get_link: ptrace_may_access(),
            // which Yama or an LSM can refuse to root as well.
            " even as root: ptrace access to that process is refused (Yama or an LSM)"
        } else {
            "; needs root: run it with sudo"
        },
    }
}

/// A `/proc/sys` boolean of the calling thread's network namespace; None if
/// the file does not exist (e.g. br_netfilter not loaded).
pub fn read_sysctl_bool(path: &str) -> Option<bool> {
    let text = std::fs::read_to_string(path).ok()?;
    Some(text.trim() != "0")
}

pub(crate) fn netlink_request(
    msg: RouteNetlinkMessage,
    flags: u16,
) -> Result<Vec<RouteNetlinkMessage>, NetnsError> {
    let err = NetnsError::Netlink;
    let mut socket = Socket::new(NETLINK_ROUTE).map_err(err)?;
    socket.bind_auto().map_err(err)?;
    socket.connect(&SocketAddr::new(0, 0)).map_err(err)?;
    let mut packet = NetlinkMessage::new(NetlinkHeader::default(), NetlinkPayload::from(msg));
    packet.header.flags = flags;
    packet.header.sequence_number = 1;
    packet.finalize();
    let mut buf = vec![0; packet.buffer_len()];
    packet.serialize(&mut buf[..]);
    socket.send(&buf[..], 0).map_err(err)?;

    let mut replies = Vec::new();
    let mut rx = Vec::with_capacity(64 * 1024);
    loop {
        rx.clear();
        let size = socket.recv(&mut rx, 0).map_err(err)?;
        let mut offset = 0;
        while offset < size {
            let msg: NetlinkMessage<RouteNetlinkMessage> =
                NetlinkMessage::deserialize(&rx[offset..size])
                    .map_err(|e| NetnsError::Netlink(std::io::Error::other(e.to_string())))?;
            let len = msg.header.length as usize;
            match msg.payload {
                NetlinkPayload::Done(_) => return Ok(replies),
                NetlinkPayload::Error(e) => {
                    return match e.code {
                        None => Ok(replies), // an ACK
                        Some(_) => Err(NetnsError::Netlink(e.to_io())),
                    };
                }
                NetlinkPayload::InnerMessage(m) => replies.push(m),
                _ => {}
            }
            if len == 0 {
                break;
            }
            offset += len;
        }
        if flags & NLM_F_DUMP == 0 && flags & NLM_F_ACK == 0 {
            return Ok(replies);
        }
    }
}

/// The interfaces of the calling thread's network namespace.
pub fn list_interfaces() -> Result<Vec<Interface>, NetnsError> {
    Ok(dump_links()?.0)
}

/// One link dump of the calling thread's network namespace.
pub struct Links {
    pub interfaces: Vec<Interface>,
    /// veths whose peer lives in another network namespace and that carry no
    /// IPv4 address here: a pod's device, seen from the node. (rtnetlink's
    /// IFLA_LINK_NETNSID is set only when the peer's namespace differs:
    /// net/core/rtnetlink.c `rtnl_fill_link_netnsid` with veth's
    /// `get_link_net` = the peer's namespace.)
    pub pod_veths: BTreeSet<u32>,
}

/// The interfaces and which of them are pod veths (one link dump, plus an
/// address dump only when a veth's peer is elsewhere).
pub fn list_links() -> Result<Links, NetnsError> {
    let (interfaces, mut pod_veths) = dump_links()?;
    // A veth with an IPv4 address here is the node's own uplink (kind, lab
    // nodes: eth0's peer is in the host namespace); a pod veth's host side
    // has none, whatever the CNI (bridge, Calico, Cilium).
    if !pod_veths.is_empty() {
        let mut msg = AddressMessage::default();
        msg.header.family = AddressFamily::Inet;
        for reply in netlink_request(
            RouteNetlinkMessage::GetAddress(msg),
            NLM_F_DUMP | NLM_F_REQUEST,
        )? {
            if let RouteNetlinkMessage::NewAddress(addr) = reply
                && addr.header.family == AddressFamily::Inet
            {
                pod_veths.remove(&addr.header.index);
            }
        }
    }
    Ok(Links {
        interfaces,
        pod_veths,
    })
}

/// The calling thread's namespace's interfaces when it is a pod of the
/// namespace `node`: one of its links is a veth whose peer there is one of
/// `pod_veths`, or a macvlan or ipvlan whose parent is there. Such a link
/// carries IFLA_LINK_NETNSID, the id this namespace gives `node`
/// (RTM_GETNSID; the dump itself assigns it, net/core/rtnetlink.c
/// `rtnl_fill_link_netnsid` → `peernet2id_alloc`, so it is asked after),
/// and IFLA_LINK, the other side's ifindex. None for any other namespace:
/// one with no link to `node`, or linked by the node's uplink (a lab's
/// router, which is the network, not a pod).
pub fn pod_interfaces(
    node: BorrowedFd<'_>,
    pod_veths: &BTreeSet<u32>,
) -> Result<Option<Vec<Interface>>, NetnsError> {
    let links = link_dump()?;
    let mut msg = NsidMessage::default();
    msg.attributes
        .push(NsidAttribute::Fd(node.as_raw_fd() as u32));
    let id = netlink_request(RouteNetlinkMessage::GetNsId(msg), NLM_F_REQUEST)?
        .into_iter()
        .find_map(|r| match r {
            RouteNetlinkMessage::NewNsId(m) => m.attributes.into_iter().find_map(|a| match a {
                NsidAttribute::Id(id) => Some(id),
                _ => None,
            }),
            _ => None,
        });
    // -1: not assigned, so no link names it.
    let Some(id) = id.filter(|id| *id >= 0) else {
        return Ok(None);
    };
    let pod = links.iter().any(|l| {
        l.link_ns == Some(id)
            && (l.iface.kind != "veth" || l.other_side.is_some_and(|i| pod_veths.contains(&i)))
    });
    Ok(pod.then(|| links.into_iter().map(|l| l.iface).collect()))
}

/// A link of the dump and what it links to in another namespace.
struct Link {
    iface: Interface,
    /// IFLA_LINK_NETNSID: the other namespace's id, when the other side
    /// (veth peer, macvlan parent) is elsewhere.
    link_ns: Option<i32>,
    /// IFLA_LINK: the other side's ifindex.
    other_side: Option<u32>,
}

/// The link dump: interfaces (by ifindex) and the veths whose peer is in
/// another namespace.
fn dump_links() -> Result<(Vec<Interface>, BTreeSet<u32>), NetnsError> {
    let links = link_dump()?;
    let pod_veths = links
        .iter()
        .filter(|l| l.link_ns.is_some() && l.iface.kind == "veth")
        .map(|l| l.iface.ifindex)
        .collect();
    let mut out: Vec<Interface> = links.into_iter().map(|l| l.iface).collect();
    out.sort_by_key(|i| i.ifindex);
    Ok((out, pod_veths))
}

/// Every link of the calling thread's namespace.
fn link_dump() -> Result<Vec<Link>, NetnsError> {
    let replies = netlink_request(
        RouteNetlinkMessage::GetLink(LinkMessage::default()),
        NLM_F_DUMP | NLM_F_REQUEST,
    )?;
    let mut out = Vec::new();
    for reply in replies {
        let RouteNetlinkMessage::NewLink(link) = reply else {
            continue;
        };
        let mut iface = Interface {
            ifindex: link.header.index,
            ..Default::default()
        };
        let mut link_ns = None;
        let mut other_side = None;
        for attr in &link.attributes {
            match attr {
                LinkAttribute::IfName(name) => iface.name = name.clone(),
                LinkAttribute::LinkNetNsId(id) => link_ns = Some(*id),
                LinkAttribute::Link(ifindex) => other_side = Some(*ifindex),
                LinkAttribute::Controller(master) => iface.master = Some(*master),
                LinkAttribute::Mtu(mtu) => iface.mtu = *mtu,
                LinkAttribute::LinkInfo(infos) => {
                    for info in infos {
                        match info {
                            LinkInfo::Kind(kind) => iface.kind = kind.to_string(),
                            LinkInfo::PortData(InfoPortData::BridgePort(attrs)) => {
                                // From rtnetlink rather than /sys: /sys shows the
                                // mount namespace's view, not this netns.
                                iface.hairpin = attrs.iter().find_map(|a| match a {
                                    InfoBridgePort::HairpinMode(on) => Some(*on),
                                    _ => None,
                                });
                            }
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        out.push(Link {
            iface,
            link_ns,
            other_side,
        });
    }
    Ok(out)
}

fn clsact_message(ifindex: u32) -> TcMessage {
    let mut msg = TcMessage::with_index(ifindex as i32);
    msg.header.parent = TcHandle::CLSACT;
    msg.header.handle = TcHandle {
        major: 0xffff,
        minor: 0,
    };
    msg.attributes.push(TcAttribute::Kind("clsact".to_owned()));
    msg
}

/// Adds a clsact qdisc to `ifindex` in the calling thread's namespace.
/// Ok(false) = one already existed (it is not ours: we leave it on exit).
pub fn add_clsact(ifindex: u32) -> Result<bool, NetnsError> {
    match netlink_request(
        RouteNetlinkMessage::NewQueueDiscipline(clsact_message(ifindex)),
        NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
    ) {
        Ok(_) => Ok(true),
        Err(NetnsError::Netlink(e)) if e.raw_os_error() == Some(libc::EEXIST) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Deletes the clsact qdisc of `ifindex` in the calling thread's namespace
/// (only ever called for one we created).
pub fn delete_clsact(ifindex: u32) -> Result<(), NetnsError> {
    netlink_request(
        RouteNetlinkMessage::DelQueueDiscipline(clsact_message(ifindex)),
        NLM_F_REQUEST | NLM_F_ACK,
    )?;
    Ok(())
}
