//! The container runtime's CRI (issue 29): the sandboxes kubelet asked for,
//! each with its pod's metadata, its addresses and its network namespace.
//! What kubelet itself knows, so it is asked first; the cgroups and
//! kubelet's pod directories ([`super::scan`]) fill in what it does not say.
//!
//! The netns is not a CRI field: containerd (1.6 to 2.x) and CRI-O both
//! put the sandbox's OCI runtime spec in the verbose status's `info` key,
//! with the netns path in `linux.namespaces`, and the sandbox's pid beside
//! it (CRI-O's is 0 for a sandbox without an infra process).
use std::{
    collections::HashMap,
    net::IpAddr,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    time::Duration,
};

use hyper_util::rt::TokioIo;
use k8s_cri::v1::{
    ListPodSandboxRequest, NamespaceMode, PodSandboxFilter, PodSandboxState, PodSandboxStateValue,
    PodSandboxStatusRequest, PodSandboxStatusResponse, VersionRequest,
    runtime_service_client::RuntimeServiceClient,
};
use tonic::transport::{Endpoint, Uri};

use super::{PodEntry, PodSource, Roots};

/// Where containerd and CRI-O listen, relative to the host root.
pub const SOCKETS: [&str; 2] = ["run/containerd/containerd.sock", "var/run/crio/crio.sock"];

/// For the whole query: a runtime this slow is wedged, and every call
/// holds up the tracer's event loop.
pub const TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum CriError {
    #[error("cannot start the CRI client: {0}")]
    Runtime(std::io::Error),
    #[error("cannot connect: {}", chain(.0))]
    Connect(tonic::transport::Error),
    #[error("{}", status_text(.0))]
    Call(#[from] tonic::Status),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

impl CriError {
    /// A hung runtime, as opposed to one that refused at once.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Self::Timeout(_))
    }
}

/// tonic's transport errors say "transport error" and keep the cause
/// (no such file, permission denied) in their sources.
fn chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut next = err.source();
    while let Some(e) = next {
        out.push_str(": ");
        out.push_str(&e.to_string());
        next = e.source();
    }
    out
}

fn status_text(s: &tonic::Status) -> String {
    // Docker's containerd has the CRI plugin disabled: Unimplemented,
    // "unknown service runtime.v1.RuntimeService".
    if s.message().is_empty() {
        format!("{:?}", s.code())
    } else {
        format!("{:?}: {}", s.code(), s.message())
    }
}

/// The first of [`SOCKETS`] under `host` that is a socket.
pub fn find_socket(host: &Path) -> Option<PathBuf> {
    SOCKETS.iter().map(|s| host.join(s)).find(|p| is_socket(p))
}

pub fn is_socket(p: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt as _;
    std::fs::metadata(p).is_ok_and(|m| m.file_type().is_socket())
}

/// What the runtime said, before the netns is looked up on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listing {
    /// `containerd 1.6.20`, from the Version call.
    pub runtime: String,
    pub sandboxes: Vec<Sandbox>,
}

/// One READY pod sandbox.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sandbox {
    /// `namespace/name`.
    pub pod: String,
    pub uid: String,
    pub addrs: Vec<IpAddr>,
    pub info: SandboxInfo,
    /// `hostNetwork: true`: the node's namespace, the node's addresses.
    pub host_network: bool,
}

/// The parts of the verbose status's `info` that locate the netns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SandboxInfo {
    pub pid: Option<u32>,
    /// As the runtime sees it (`/var/run/netns/cni-…`).
    pub netns_path: Option<String>,
    /// The spec lists namespaces but no network one: the runtime's own.
    pub no_netns: bool,
}

/// The verbose status's `info` map: its `info` key is JSON (containerd's
/// and CRI-O's alike); anything missing or malformed leaves a field empty.
pub fn parse_info(info: &HashMap<String, String>) -> SandboxInfo {
    let Some(v) = info
        .get("info")
        .and_then(|s| serde_json::from_str::<serde_json::Value>(s).ok())
    else {
        return SandboxInfo::default();
    };
    let pid = v["pid"]
        .as_u64()
        .and_then(|p| u32::try_from(p).ok())
        .filter(|p| *p > 0);
    let namespaces = v["runtimeSpec"]["linux"]["namespaces"].as_array();
    let network = namespaces.and_then(|ns| ns.iter().find(|n| n["type"] == "network"));
    SandboxInfo {
        pid,
        netns_path: network
            .and_then(|n| n["path"].as_str())
            .filter(|p| !p.is_empty())
            .map(str::to_owned),
        no_netns: namespaces.is_some() && network.is_none(),
    }
}

/// One status answer as a [`Sandbox`]; None without pod metadata.
pub fn sandbox_of(resp: PodSandboxStatusResponse) -> Option<Sandbox> {
    let status = resp.status?;
    let meta = status.metadata?;
    let mut addrs = Vec::new();
    if let Some(net) = status.network {
        let extra = net.additional_ips.into_iter().map(|p| p.ip);
        for ip in std::iter::once(net.ip).chain(extra) {
            if let Ok(a) = ip.parse::<IpAddr>()
                && !addrs.contains(&a)
            {
                addrs.push(a);
            }
        }
    }
    let host_network = status
        .linux
        .and_then(|l| l.namespaces)
        .and_then(|n| n.options)
        .is_some_and(|o| o.network == NamespaceMode::Node as i32);
    Some(Sandbox {
        pod: format!("{}/{}", meta.namespace, meta.name),
        uid: meta.uid,
        addrs,
        info: parse_info(&resp.info),
        host_network,
    })
}

/// The sandbox's netns inode on this node: the runtime's netns path under
/// the host root (checked to be a namespace file: an unpropagated mount
/// leaves an empty file there), else its pid's `ns/net` in /proc.
pub fn netns_inode(roots: &Roots, info: &SandboxInfo) -> Option<u32> {
    let from_path = info.netns_path.as_deref().and_then(|p| {
        let rel = p.trim_start_matches('/');
        // /var/run is a symlink to /run on the node; under a host root
        // that absolute link would resolve into our own /run.
        let alt = rel.strip_prefix("var/").filter(|r| r.starts_with("run/"));
        std::iter::once(rel)
            .chain(alt)
            .find_map(|r| nsfs_inode(&roots.host.join(r)))
    });
    from_path.or_else(|| {
        info.pid
            .and_then(|pid| super::netns_of(&roots.proc.join(pid.to_string())))
    })
}

fn nsfs_inode(p: &Path) -> Option<u32> {
    let fs = nix::sys::statfs::statfs(p).ok()?;
    if fs.filesystem_type() != nix::sys::statfs::NSFS_MAGIC {
        return None;
    }
    u32::try_from(std::fs::metadata(p).ok()?.ino()).ok()
}

impl Listing {
    /// As index entries: the node's own namespace (hostNetwork pods) left
    /// out; a sandbox whose netns is not found here keeps netns 0 (its
    /// addresses still name it).
    pub fn entries(&self, roots: &Roots, node_netns: u32) -> Vec<PodEntry> {
        self.sandboxes
            .iter()
            .filter(|s| !s.host_network && !s.info.no_netns)
            .filter_map(|s| {
                let netns = netns_inode(roots, &s.info).unwrap_or(0);
                (netns == 0 || netns != node_netns).then(|| PodEntry {
                    netns,
                    addrs: s.addrs.clone(),
                    pod: Some(s.pod.clone()),
                    uid: Some(s.uid.clone()).filter(|u| !u.is_empty()),
                    netns_name: None,
                    named_by: Some(PodSource::Cri),
                })
            })
            .collect()
    }
}

/// The pods the runtime at `socket` runs, as seen from this machine's root
/// and /proc: for tests and tools; the session goes through
/// [`super::scan::Rescan`].
pub fn list(socket: &Path) -> Result<Vec<PodEntry>, CriError> {
    let roots = Roots::node(Some(Path::new("/")));
    let own = super::netns_of(Path::new("/proc/self")).unwrap_or(0);
    Ok(query(socket, TIMEOUT)?.entries(&roots, own))
}

/// Asks the runtime, within `timeout`. Blocking, and callable from inside
/// the session's runtime: the gRPC calls run on a thread of their own with
/// their own current-thread runtime (tokio refuses nested `block_on`).
pub fn query(socket: &Path, timeout: Duration) -> Result<Listing, CriError> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let socket = socket.to_path_buf();
    std::thread::Builder::new()
        .name("nattrace-cri".into())
        .spawn(move || {
            let res = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(CriError::Runtime)
                .and_then(|rt| {
                    rt.block_on(async {
                        tokio::time::timeout(timeout, ask(socket))
                            .await
                            .unwrap_or(Err(CriError::Timeout(timeout)))
                    })
                });
            let _ = tx.send(res);
        })
        .map_err(CriError::Runtime)?;
    // The thread's own timeout ends it; this one covers a thread that
    // never got to run it.
    rx.recv_timeout(timeout + Duration::from_millis(500))
        .unwrap_or(Err(CriError::Timeout(timeout)))
}

async fn ask(socket: PathBuf) -> Result<Listing, CriError> {
    // The URI is a placeholder: the connector below dials the socket.
    let channel = Endpoint::try_from("http://[::]:50051")
        .map_err(CriError::Connect)?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = socket.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(p).await?))
            }
        }))
        .await
        .map_err(CriError::Connect)?;
    let mut client = RuntimeServiceClient::new(channel);
    let v = client
        .version(VersionRequest {
            version: "v1".into(),
        })
        .await?
        .into_inner();
    let runtime = format!(
        "{} {}",
        v.runtime_name,
        v.runtime_version.trim_start_matches('v')
    );
    let ready = PodSandboxFilter {
        state: Some(PodSandboxStateValue {
            state: PodSandboxState::SandboxReady as i32,
        }),
        ..Default::default()
    };
    let items = client
        .list_pod_sandbox(ListPodSandboxRequest {
            filter: Some(ready),
        })
        .await?
        .into_inner()
        .items;
    // One stream each over the one connection: a node's hundred pods cost
    // one round trip's wait, not a hundred.
    let mut calls = tokio::task::JoinSet::new();
    for item in items {
        let mut c = client.clone();
        calls.spawn(async move {
            c.pod_sandbox_status(PodSandboxStatusRequest {
                pod_sandbox_id: item.id,
                verbose: true,
            })
            .await
        });
    }
    let mut sandboxes = Vec::new();
    while let Some(done) = calls.join_next().await {
        match done {
            Ok(Ok(resp)) => sandboxes.extend(sandbox_of(resp.into_inner())),
            // Removed between the list and its status.
            Ok(Err(s)) if s.code() == tonic::Code::NotFound => {}
            Ok(Err(s)) => return Err(s.into()),
            Err(e) => return Err(CriError::Runtime(std::io::Error::other(e))),
        }
    }
    sandboxes.sort_by(|a, b| a.pod.cmp(&b.pod));
    Ok(Listing { runtime, sandboxes })
}
