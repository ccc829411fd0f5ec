//! Pods made the way a node makes them (issue 29): a containerd of the
//! node's own, in the node's network namespace, creates each pod through its
//! CRI exactly as kubelet calls it (`RunPodSandbox` with the pod's metadata,
//! then `CreateContainer`/`StartContainer` for its server), and its CRI
//! plugin wires the sandbox with the CNI `bridge` plugin and flannel's
//! delegate config (`cni0`, `hairpinMode`, `host-local`,
//! `isDefaultGateway`). So the pods get a real CRI netns
//! (`/run/netns/cni-…`), real CNI veths and real pod metadata, and nattrace
//! can be checked against the same wiring a flannel node has.
//!
//! Everything containerd keeps (root, state, socket, CNI config, host-local's
//! leases, the pods' logs) is under `/tmp/<lab id>-<node>-cri`. Left on the
//! machine while a pod runs, as on any containerd host: the sandbox's netns
//! bind mount in /run/netns, the shim's socket in /run/containerd/s, runc's
//! state in /run/containerd/runc and libcni's result cache in /var/lib/cni;
//! each goes when its sandbox is removed. The pods' cgroups are under
//! `<each cgroup mount>/<lab id>/kubepods/besteffort/pod<UID>`.
//!
//! A lab whose test process was killed leaves containerd's processes in the
//! node namespace (killed with it by [`crate::cleanup_stale`]) and its pods'
//! processes in their `cni-…` namespaces: each node's directory lists those
//! namespaces (`netns.list`), so [`cleanup_stale`] can remove them too.
//!
//! The container images are built here, offline: a static pause (a few
//! lines of C, `cc -static`) in an OCI image made with buildah (its own
//! storage, not the machine's). A server container runs the lab's own
//! `lab-server` from the host, bind-mounted with the host's /usr and /lib.
use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, CreateContainerRequest, ImageSpec, LinuxPodSandboxConfig,
    Mount, PodSandboxConfig, PodSandboxMetadata, PodSandboxStatusRequest, RemovePodSandboxRequest,
    RunPodSandboxRequest, StartContainerRequest, StopPodSandboxRequest, VersionRequest,
};
use tonic::transport::{Channel, Endpoint, Uri};

use crate::error::{LabError, Result};
use crate::kubelet::{k8s_name, remove_cgroups, uid_of};
use crate::netns::{self, Netns};
use crate::servers::lab_server_path;
use crate::spec::{NodeSpec, Server};

/// The sandbox (and server container) image, as containerd is told to use it.
pub const PAUSE_IMAGE: &str = "localhost/nattrace-lab-pause:1";

/// flannel's CNI network name (its delegate config's `name`).
pub const CNI_NETWORK: &str = "cbr0";

/// containerd starts in well under a second; under two busy cores, longer.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// One CRI call (a sandbox start runs runc and the CNI plugins).
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// The pause: sleeps until told to stop, as kubernetes' pause does.
const PAUSE_C: &str = r#"#include <signal.h>
#include <unistd.h>
static void bye(int s) { (void)s; _exit(0); }
int main(void) {
  signal(SIGTERM, bye);
  signal(SIGINT, bye);
  for (;;) pause();
}
"#;

/// One pod sandbox the lab created through the CRI.
#[derive(Debug, Clone)]
pub struct CriPod {
    /// The lab's name for it (its [`crate::PodSpec`] name).
    pub target: String,
    /// `namespace/name`, as in its sandbox metadata.
    pub k8s_name: String,
    pub uid: String,
    pub sandbox_id: String,
    /// Its netns as `ip netns` names it (`cni-<uuid>`).
    pub netns: String,
    /// What host-local gave it.
    pub ip: Ipv4Addr,
    config: PodSandboxConfig,
}

/// A node's containerd and the pods it runs. Dropping it removes the pods
/// (StopPodSandbox, RemovePodSandbox), stops containerd and removes its
/// directory.
#[derive(Debug)]
pub struct CriNode {
    node: String,
    lab_id: String,
    dir: PathBuf,
    containerd: Option<Child>,
    runtime: tokio::runtime::Runtime,
    channel: Channel,
    pods: Mutex<Vec<CriPod>>,
    hairpin: bool,
}

fn io_err(what: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> LabError {
    move |e| LabError::Spec(format!("{what}: {e}"))
}

fn cri_err(what: impl std::fmt::Display) -> impl FnOnce(tonic::Status) -> LabError {
    move |e| LabError::Spec(format!("CRI {what}: {}", e.message()))
}

/// Runs `cmd`, its failure named with what it printed.
fn checked(cmd: &mut Command, what: &str) -> Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(io_err(format!("running {what}")))?;
    if !out.status.success() {
        return Err(LabError::Spec(format!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The pause image as an OCI archive, built once per machine (keyed by the
/// source, so a changed pause is rebuilt) and shared by every lab.
pub fn pause_image_archive() -> Result<PathBuf> {
    static BUILT: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = built.as_ref().filter(|p| p.is_file()) {
        return Ok(p.clone());
    }
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (PAUSE_C, PAUSE_IMAGE).hash(&mut h);
    let archive = std::env::temp_dir().join(format!("nattrace-lab-pause-{:016x}.tar", h.finish()));
    if !archive.is_file() {
        // Another test process may build the same archive: each builds in
        // its own directory and renames the result into place.
        let work = std::env::temp_dir().join(format!(
            "{}{}-pause-build",
            netns::NAME_PREFIX,
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&work);
        std::fs::create_dir_all(&work).map_err(io_err("creating the pause build directory"))?;
        let result = build_pause_image(&work, &archive);
        let _ = std::fs::remove_dir_all(&work);
        result?;
    }
    *built = Some(archive.clone());
    Ok(archive)
}

fn build_pause_image(work: &Path, archive: &Path) -> Result<()> {
    let src = work.join("pause.c");
    std::fs::write(&src, PAUSE_C).map_err(io_err("writing pause.c"))?;
    let bin = work.join("pause");
    checked(
        Command::new("cc")
            .arg("-static")
            .arg("-Os")
            .arg("-o")
            .arg(&bin)
            .arg(&src),
        "cc -static pause.c (libc6-dev's static libc)",
    )?;
    let (root, runroot) = (work.join("storage"), work.join("run"));
    let buildah = |args: &[&str]| -> Result<String> {
        checked(
            Command::new("buildah")
                .arg("--root")
                .arg(&root)
                .arg("--runroot")
                .arg(&runroot)
                .arg("--storage-driver")
                .arg("vfs")
                .args(args),
            &format!("buildah {}", args.first().copied().unwrap_or("")),
        )
    };
    let working = buildah(&["from", "scratch"])?;
    buildah(&["copy", &working, &bin.to_string_lossy(), "/pause"])?;
    buildah(&["config", "--entrypoint", r#"["/pause"]"#, &working])?;
    buildah(&[
        "commit",
        "--quiet",
        "--format",
        "oci",
        &working,
        PAUSE_IMAGE,
    ])?;
    let partial = work.join("pause.tar");
    buildah(&[
        "push",
        "--quiet",
        PAUSE_IMAGE,
        &format!("oci-archive:{}:{PAUSE_IMAGE}", partial.display()),
    ])?;
    std::fs::rename(&partial, archive)
        .or_else(|_| std::fs::copy(&partial, archive).map(|_| ()))
        .map_err(io_err(format!("placing {}", archive.display())))
}

/// flannel's CNI config (its `10-flannel.conflist` with the delegate it
/// writes for the `bridge` plugin) for a node's pod CIDR.
fn flannel_conflist(node: &NodeSpec, mtu: u32, hairpin: bool, ipam_dir: &Path) -> String {
    let cidr = node.pod_cidr.trunc();
    serde_json::json!({
        "name": CNI_NETWORK,
        "cniVersion": "0.3.1",
        "plugins": [
            {
                "type": "bridge",
                "name": CNI_NETWORK,
                "bridge": "cni0",
                "mtu": mtu,
                "hairpinMode": hairpin,
                "ipMasq": false,
                "isGateway": true,
                "isDefaultGateway": true,
                "ipam": {
                    "type": "host-local",
                    "dataDir": ipam_dir,
                    "ranges": [[{ "subnet": cidr.to_string(), "gateway": node.gateway().to_string() }]],
                    "routes": [{ "dst": crate::presets::CLUSTER_CIDR.trunc().to_string() }]
                }
            },
            { "type": "portmap", "capabilities": { "portMappings": true } }
        ]
    })
    .to_string()
}

fn containerd_config(dir: &Path) -> String {
    let d = dir.display();
    format!(
        r#"version = 2
root = "{d}/root"
state = "{d}/state"
# Nothing of the machine's: no other snapshotters, no plugins that reach out.
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.overlayfs", "io.containerd.internal.v1.opt", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "{d}/containerd.sock"
[ttrpc]
  address = "{d}/containerd.sock.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # An apparmor profile would be loaded into the machine's kernel.
  disable_apparmor = true
  enable_selinux = false
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    # Works on any filesystem (the machine's /tmp may be overlay itself).
    snapshotter = "native"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{d}/cni"
"#
    )
}

impl CriNode {
    /// Starts the node's containerd (in `node_ns`) and imports the images.
    pub(crate) fn start(lab_id: &str, node: &NodeSpec, node_ns: &Netns, mtu: u32) -> Result<Self> {
        for tool in ["containerd", "ctr", "runc", "buildah"] {
            if which_tool(tool).is_none() {
                return Err(LabError::Spec(format!(
                    "{tool} is not installed (`cargo xtask setup` installs containerd, runc and buildah)"
                )));
            }
        }
        if !Path::new("/usr/lib/cni/bridge").is_file() {
            return Err(LabError::Spec(
                "no CNI bridge plugin in /usr/lib/cni (`cargo xtask setup` installs containernetworking-plugins)".into(),
            ));
        }
        let archive = pause_image_archive()?;
        let dir = std::env::temp_dir().join(format!("{lab_id}-{}-cri", node.name));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["cni", "ipam", "pods"] {
            std::fs::create_dir_all(dir.join(sub))
                .map_err(io_err(format!("creating {}", dir.join(sub).display())))?;
        }
        // Every pod of a flannel node shares the bridge plugin's one config.
        let hairpin = node.pods.iter().any(|p| p.hairpin);
        std::fs::write(
            dir.join("cni/10-flannel.conflist"),
            flannel_conflist(node, mtu, hairpin, &dir.join("ipam")),
        )
        .map_err(io_err("writing the CNI config"))?;
        std::fs::write(dir.join("config.toml"), containerd_config(&dir))
            .map_err(io_err("writing containerd's config"))?;
        let log = std::fs::File::create(dir.join("containerd.log"))
            .map_err(io_err("creating containerd.log"))?;
        let err_log = log.try_clone().map_err(io_err("containerd.log"))?;
        let mut cmd = node_ns.command("containerd")?;
        cmd.arg("--config")
            .arg(dir.join("config.toml"))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err_log)
            .process_group(0);
        let child = cmd
            .spawn()
            .map_err(io_err(format!("starting containerd in {}", node_ns.name())))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(io_err("a tokio runtime for the CRI client"))?;
        let socket = dir.join("containerd.sock");
        let mut me = CriNode {
            node: node.name.clone(),
            lab_id: lab_id.to_string(),
            channel: runtime.block_on(async {
                // Connects lazily: the first call waits for the socket below.
                let s = socket.clone();
                Endpoint::from_static("http://[::]:50051").connect_with_connector_lazy(
                    tower::service_fn(move |_: Uri| {
                        let s = s.clone();
                        async move {
                            Ok::<_, std::io::Error>(TokioIo::new(
                                tokio::net::UnixStream::connect(s).await?,
                            ))
                        }
                    }),
                )
            }),
            runtime,
            dir,
            containerd: Some(child),
            pods: Mutex::new(Vec::new()),
            hairpin,
        };
        me.wait_ready()?;
        me.import_image(&archive)?;
        Ok(me)
    }

    fn client(&self) -> RuntimeServiceClient<Channel> {
        RuntimeServiceClient::new(self.channel.clone())
    }

    fn call<T>(&self, fut: impl std::future::Future<Output = T>) -> Result<T> {
        self.runtime.block_on(async {
            tokio::time::timeout(CALL_TIMEOUT, fut)
                .await
                .map_err(|_| LabError::Spec(format!("a CRI call took over {CALL_TIMEOUT:?}")))
        })
    }

    /// Until the CRI answers `Version` (containerd listening and its CRI
    /// plugin up), or containerd exits.
    fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let mut client = self.client();
            let answer = self.call(async move {
                client
                    .version(VersionRequest {
                        version: "v1".into(),
                    })
                    .await
            })?;
            if answer.is_ok() {
                return Ok(());
            }
            if let Some(Ok(Some(status))) = self.containerd.as_mut().map(Child::try_wait) {
                return Err(LabError::Spec(format!(
                    "containerd on {} exited ({status}): {}",
                    self.node,
                    self.log_tail()
                )));
            }
            if Instant::now() > deadline {
                return Err(LabError::Spec(format!(
                    "containerd's CRI on {} did not answer within {START_TIMEOUT:?}: {}",
                    self.node,
                    self.log_tail()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(8)..].join("\n")
    }

    /// The CRI socket (what `nattrace --cri-socket` is given).
    pub fn socket(&self) -> PathBuf {
        self.dir.join("containerd.sock")
    }

    /// Whether the bridge plugin's `hairpinMode` is on for this node.
    pub fn hairpin(&self) -> bool {
        self.hairpin
    }

    /// The pods created so far.
    pub fn pods(&self) -> Vec<CriPod> {
        self.pods.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Creates the pod `target` as kubelet does: RunPodSandbox with its
    /// metadata (namespace, name, UID), log directory and cgroup parent.
    /// The lab creates its spec's pods so; a test may add one while a
    /// trace runs (no server, no Service: a client), removed with the node.
    pub fn run_pod(&self, target: &str) -> Result<CriPod> {
        let k8s = k8s_name(target);
        let (namespace, name) = k8s.split_once('/').expect("k8s_name has a namespace");
        let uid = uid_of(&self.lab_id, target);
        let log_dir = self
            .dir
            .join("pods")
            .join(format!("{namespace}_{name}_{uid}"));
        std::fs::create_dir_all(&log_dir).map_err(io_err("creating the pod's log directory"))?;
        let mut config = self.sandbox_config(namespace, name, &uid, &log_dir);
        config.hostname = target.into();
        let sandbox_id = self.run_sandbox(&config)?;
        self.pod_of_sandbox(target, &k8s, uid, sandbox_id.clone(), config)
            .inspect_err(|_| {
                // Not yet in `pods`, so Drop would not remove it.
                let _ = self.remove_sandbox(&sandbox_id);
            })
    }

    /// The sandbox's address and netns, from its verbose status, recorded.
    fn pod_of_sandbox(
        &self,
        target: &str,
        k8s: &str,
        uid: String,
        sandbox_id: String,
        config: PodSandboxConfig,
    ) -> Result<CriPod> {
        let mut client = self.client();
        let id = sandbox_id.clone();
        let status = self
            .call(async move {
                client
                    .pod_sandbox_status(PodSandboxStatusRequest {
                        pod_sandbox_id: id,
                        verbose: true,
                    })
                    .await
            })?
            .map_err(cri_err(format!("PodSandboxStatus {k8s}")))?
            .into_inner();
        let ip = status
            .status
            .as_ref()
            .and_then(|s| s.network.as_ref())
            .and_then(|n| n.ip.parse::<Ipv4Addr>().ok())
            .ok_or_else(|| LabError::Spec(format!("sandbox of {k8s} has no IPv4 address")))?;
        let netns = status
            .info
            .get("info")
            .and_then(|i| sandbox_netns(i))
            .ok_or_else(|| LabError::Spec(format!("sandbox of {k8s}: no netns in its status")))?;
        let pod = CriPod {
            target: target.into(),
            k8s_name: k8s.into(),
            uid,
            sandbox_id,
            netns,
            ip,
            config,
        };
        self.pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(pod.clone());
        self.write_netns_list();
        Ok(pod)
    }

    /// A pod's sandbox config as kubelet fills it: metadata, log
    /// directory, and a cgroup parent named after the pod's UID.
    fn sandbox_config(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        log_dir: &Path,
    ) -> PodSandboxConfig {
        PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: name.into(),
                uid: uid.into(),
                namespace: namespace.into(),
                attempt: 0,
            }),
            log_directory: log_dir.display().to_string(),
            linux: Some(LinuxPodSandboxConfig {
                cgroup_parent: format!("/{}/kubepods/besteffort/pod{uid}", self.lab_id),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// RunPodSandbox: the sandbox's id.
    fn run_sandbox(&self, config: &PodSandboxConfig) -> Result<String> {
        let what = config
            .metadata
            .as_ref()
            .map(|m| format!("RunPodSandbox {}/{}", m.namespace, m.name))
            .unwrap_or_default();
        let mut client = self.client();
        let request = RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: String::new(),
        };
        let id = self
            .call(async move { client.run_pod_sandbox(request).await })?
            .map_err(cri_err(what))?
            .into_inner()
            .pod_sandbox_id;
        self.note_id(&id);
        Ok(id)
    }

    /// Every sandbox and container id, for [`cleanup_stale`] after a
    /// killed test: the shim's socket and runc's state are kept by id
    /// outside the node's directory.
    fn note_id(&self, id: &str) {
        use std::io::Write as _;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(IDS_LIST))
        {
            let _ = writeln!(f, "{id}");
        }
    }

    /// CreateContainer in the sandbox, then StartContainer: its id.
    fn create_and_start(
        &self,
        sandbox_id: &str,
        config: ContainerConfig,
        sandbox: &PodSandboxConfig,
    ) -> Result<String> {
        let name = config
            .metadata
            .as_ref()
            .map(|m| m.name.clone())
            .unwrap_or_default();
        let mut client = self.client();
        let request = CreateContainerRequest {
            pod_sandbox_id: sandbox_id.into(),
            config: Some(config),
            sandbox_config: Some(sandbox.clone()),
        };
        let id = self
            .call(async move { client.create_container(request).await })?
            .map_err(cri_err(format!("CreateContainer {name}")))?
            .into_inner()
            .container_id;
        self.note_id(&id);
        let mut client = self.client();
        let container_id = id.clone();
        self.call(async move {
            client
                .start_container(StartContainerRequest { container_id })
                .await
        })?
        .map_err(cri_err(format!("StartContainer {name}")))?;
        Ok(id)
    }

    /// Every pod's netns, for [`cleanup_stale`] after a killed test.
    fn write_netns_list(&self) {
        let pods = self.pods();
        let mut text = String::new();
        for p in &pods {
            let _ = writeln!(text, "{}", p.netns);
        }
        let _ = std::fs::write(self.dir.join("netns.list"), text);
    }

    /// Starts `server` in the pod as a container (CreateContainer with the
    /// sandbox's config, StartContainer) and returns once it printed
    /// "ready" to its CRI log.
    pub(crate) fn start_server(&self, target: &str, index: usize, server: &Server) -> Result<()> {
        let pod = self
            .pods()
            .into_iter()
            .find(|p| p.target == target)
            .ok_or_else(|| LabError::Spec(format!("{target} is no CRI pod of {}", self.node)))?;
        let binary = lab_server_path()?;
        let mut mounts = vec![Mount {
            container_path: "/lab-server".into(),
            host_path: binary.display().to_string(),
            readonly: true,
            ..Default::default()
        }];
        // lab-server is linked against the host's libc.
        for dir in ["/usr", "/lib", "/lib64"] {
            if Path::new(dir).exists() {
                mounts.push(Mount {
                    container_path: dir.into(),
                    host_path: dir.into(),
                    readonly: true,
                    ..Default::default()
                });
            }
        }
        let log = format!("server-{index}.log");
        let config = ContainerConfig {
            metadata: Some(ContainerMetadata {
                name: format!("server-{index}"),
                attempt: 0,
            }),
            image: Some(ImageSpec {
                image: PAUSE_IMAGE.into(),
                ..Default::default()
            }),
            command: vec!["/lab-server".into()],
            args: server.args(target),
            mounts,
            log_path: log.clone(),
            ..Default::default()
        };
        self.create_and_start(&pod.sandbox_id, config, &pod.config)?;
        // The CRI log: `<time> stdout F ready` once the socket is bound.
        let path = PathBuf::from(&pod.config.log_directory).join(log);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            if text.lines().any(|l| l.ends_with(" stdout F ready")) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(LabError::ServerNotReady {
                    server: server.describe(),
                    pod: target.into(),
                    detail: format!(
                        "no \"ready\" in its CRI log {} within {START_TIMEOUT:?}: {}",
                        path.display(),
                        text.trim()
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Removes a pod as kubelet does when it is deleted: StopPodSandbox
    /// (which tears its network down through the CNI), then
    /// RemovePodSandbox.
    pub fn remove_pod(&self, target: &str) -> Result<()> {
        let pod = {
            let mut pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
            let at = pods
                .iter()
                .position(|p| p.target == target)
                .ok_or_else(|| {
                    LabError::Spec(format!("{target} is no CRI pod of {}", self.node))
                })?;
            pods.remove(at)
        };
        let result = self.remove_sandbox(&pod.sandbox_id);
        self.write_netns_list();
        result.map_err(|e| LabError::Spec(format!("removing {}: {e}", pod.k8s_name)))
    }

    fn remove_sandbox(&self, id: &str) -> Result<()> {
        let mut client = self.client();
        let pod_sandbox_id = id.to_string();
        self.call(async move {
            client
                .stop_pod_sandbox(StopPodSandboxRequest { pod_sandbox_id })
                .await
        })?
        .map_err(cri_err("StopPodSandbox"))?;
        let mut client = self.client();
        let pod_sandbox_id = id.to_string();
        self.call(async move {
            client
                .remove_pod_sandbox(RemovePodSandboxRequest { pod_sandbox_id })
                .await
        })?
        .map_err(cri_err("RemovePodSandbox"))?;
        Ok(())
    }
}

/// The sandbox's netns name from containerd's verbose status
/// (`runtimeSpec.linux.namespaces[type=network].path`).
fn sandbox_netns(info: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(info).ok()?;
    let path = v["runtimeSpec"]["linux"]["namespaces"]
        .as_array()?
        .iter()
        .find(|n| n["type"] == "network")?["path"]
        .as_str()?
        .to_string();
    Some(Path::new(&path).file_name()?.to_string_lossy().into_owned())
}

fn which_tool(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(tool))
        .find(|p| p.is_file())
}

/// Whether the mount holding `path` is shared or a slave (mountinfo's
/// optional fields), so a container may take its later mounts (rslave).
fn propagates(path: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter_map(|l| {
            let (left, _) = l.split_once(" - ")?;
            let fields: Vec<&str> = left.split_whitespace().collect();
            let point = Path::new(fields.get(4)?);
            path.starts_with(point).then(|| {
                let shared = fields[6..]
                    .iter()
                    .any(|f| f.starts_with("shared:") || f.starts_with("master:"));
                (point.components().count(), shared)
            })
        })
        .max_by_key(|(depth, _)| *depth)
        .is_some_and(|(_, shared)| shared)
}

/// Mount points of every cgroup hierarchy (v1 controllers and v2).
fn cgroup_mounts() -> Vec<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let fs = right.split_whitespace().next()?;
            let point = left.split_whitespace().nth(4)?;
            (fs == "cgroup" || fs == "cgroup2").then(|| PathBuf::from(point))
        })
        .collect()
}

/// Unmounts whatever is still mounted below `dir` (a killed containerd
/// leaves its snapshots' bind mounts), deepest first.
fn unmount_below(dir: &Path) {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut points: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4).map(PathBuf::from))
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in points {
        let _ = nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// Where the lab's node lists its sandbox and container ids.
const IDS_LIST: &str = "ids.list";

/// What containerd 1.6 keeps by id outside its own directories, and a
/// killed one leaves: runc's state (`/run/containerd/runc/<ns>/<id>`) and
/// the shim's socket, `/run/containerd/s/<sha256 of ADDRESS/NS/ID>`
/// (runtime/v2/shim/util_unix.go `SocketAddress`).
pub fn runtime_state(socket: &Path, id: &str) -> [PathBuf; 2] {
    use sha2::Digest as _;
    let key = socket.join("k8s.io").join(id);
    let hash = sha2::Sha256::digest(key.as_os_str().as_encoded_bytes());
    let name: String = hash.iter().map(|b| format!("{b:02x}")).collect();
    [
        Path::new("/run/containerd/runc/k8s.io").join(id),
        Path::new("/run/containerd/s").join(name),
    ]
}

fn remove_runtime_state(socket: &Path, id: &str) {
    if id.is_empty() || id.contains('/') {
        return;
    }
    let [runc, shim] = runtime_state(socket, id);
    let _ = std::fs::remove_dir_all(runc);
    let _ = std::fs::remove_file(shim);
}

/// The sandbox and container ids a node of lab directory `dir` created.
pub fn ids_of(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join(IDS_LIST))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// Kills what runs in a `cni-…` namespace and deletes it.
fn remove_netns(name: &str) {
    let ns = Netns::existing(name);
    let me = std::process::id() as i32;
    for pid in ns.pids().into_iter().filter(|p| *p != me) {
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    ns.delete();
}

fn remove_lab_cgroups(lab_id: &str) {
    for mount in cgroup_mounts() {
        let root = mount.join(lab_id);
        if root.is_dir() {
            remove_cgroups(&root);
        }
    }
}

impl Drop for CriNode {
    fn drop(&mut self) {
        for pod in self.pods() {
            if let Err(e) = self.remove_sandbox(&pod.sandbox_id) {
                eprintln!("lab: {e}; removing {}'s netns by hand", pod.k8s_name);
            }
            // Gone when the CRI removed it; by hand otherwise.
            remove_netns(&pod.netns);
        }
        if let Some(mut child) = self.containerd.take() {
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            netns::kill_group(&mut child);
        }
        unmount_below(&self.dir);
        let _ = std::fs::remove_dir_all(&self.dir);
        remove_lab_cgroups(&self.lab_id);
    }
}

/// Removes what containerd nodes of labs whose test process is gone left:
/// their pods' namespaces (and what runs in them), mounts, directories and
/// cgroups. Their containerd and shims ran in the node's namespace and
/// went with it.
pub fn cleanup_stale() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.ends_with("-cri") || !netns::of_a_dead_lab(&name) {
            continue;
        }
        let dir = e.path();
        let list = std::fs::read_to_string(dir.join("netns.list")).unwrap_or_default();
        for ns in list.lines().filter(|l| l.starts_with("cni-")) {
            remove_netns(ns);
        }
        for id in ids_of(&dir) {
            remove_runtime_state(&dir.join("containerd.sock"), &id);
        }
        unmount_below(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        // `ntlab-<pid>-<n>-<rand>`: the first four dash-separated parts.
        let lab_id: Vec<&str> = name.splitn(5, '-').take(4).collect();
        remove_lab_cgroups(&lab_id.join("-"));
    }
}

/// What a host container gets from the node, as the DaemonSet mounts it
/// (deploy/daemonset.yaml) plus the node's root at /host, as `kubectl
/// debug node --profile=sysadmin` gives it: (host path, container path,
/// propagate mounts made later on the host).
pub const HOST_MOUNTS: &[(&str, &str, bool)] = &[
    ("/sys/kernel/btf", "/sys/kernel/btf", false),
    ("/sys/fs/bpf", "/sys/fs/bpf", true),
    ("/sys/kernel/tracing", "/sys/kernel/tracing", false),
    ("/run/netns", "/run/netns", true),
    ("/lib/modules", "/lib/modules", false),
    ("/", "/host", true),
];

/// A privileged container in the node's network and PID namespaces (a
/// DaemonSet's `hostNetwork`/`hostPID` pod): its own sandbox, removed on
/// drop.
#[derive(Debug)]
pub struct HostContainer<'a> {
    node: &'a CriNode,
    sandbox_id: String,
    container_id: String,
    log: PathBuf,
}

/// A stream's lines from a CRI log (`<time> <stream> <P|F> <text>`; a
/// line the runtime split is `P` parts ending with an `F`).
pub fn cri_log_lines(text: &str, stream: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut partial = String::new();
    for line in text.lines() {
        let mut parts = line.splitn(4, ' ');
        let (Some(_), Some(s), Some(tag)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if s != stream {
            continue;
        }
        partial.push_str(parts.next().unwrap_or(""));
        if tag == "F" {
            out.push(std::mem::take(&mut partial));
        }
    }
    out
}

impl CriNode {
    /// Imports an OCI archive into this node's containerd (`ctr images
    /// import`, as an image is side-loaded onto a node).
    pub fn import_image(&self, archive: &Path) -> Result<()> {
        checked(
            Command::new("ctr")
                .arg("--address")
                .arg(self.socket())
                .args([
                    "-n",
                    "k8s.io",
                    "images",
                    "import",
                    "--snapshotter",
                    "native",
                ])
                .arg(archive),
            "ctr images import",
        )
        .map(|_| ())
    }

    /// Runs `image` with `args` the way the DaemonSet runs nattrace:
    /// privileged, the node's network and PID namespaces, read-only root,
    /// [`HOST_MOUNTS`] and `extra` mounts (host path, container path).
    pub fn run_host_container(
        &self,
        name: &str,
        image: &str,
        args: &[String],
        extra: &[(PathBuf, String)],
    ) -> Result<HostContainer<'_>> {
        use k8s_cri::v1::{
            LinuxContainerConfig, LinuxContainerSecurityContext, LinuxSandboxSecurityContext,
            MountPropagation, NamespaceMode, NamespaceOption,
        };
        let uid = uid_of(&self.lab_id, name);
        let log_dir = self.dir.join("pods").join(format!("nattrace_{name}_{uid}"));
        std::fs::create_dir_all(&log_dir).map_err(io_err("creating the pod's log directory"))?;
        let host = || NamespaceOption {
            network: NamespaceMode::Node as i32,
            pid: NamespaceMode::Node as i32,
            ipc: NamespaceMode::Node as i32,
            ..Default::default()
        };
        // No hostname: kubelet sets none for a hostNetwork pod, whose UTS
        // namespace is the node's (runc refuses one there).
        let mut config = self.sandbox_config("nattrace", name, &uid, &log_dir);
        if let Some(linux) = config.linux.as_mut() {
            linux.security_context = Some(LinuxSandboxSecurityContext {
                namespace_options: Some(host()),
                privileged: true,
                ..Default::default()
            });
        }
        let sandbox_id = self.run_sandbox(&config)?;
        let mut mounts: Vec<Mount> = HOST_MOUNTS
            .iter()
            .filter(|(host, ..)| Path::new(host).exists())
            .map(|(host, inside, propagate)| Mount {
                container_path: (*inside).into(),
                host_path: (*host).into(),
                readonly: true,
                // rslave needs a shared (or slave) host mount, as a node's
                // systemd makes them; this machine's may be private.
                propagation: if *propagate && propagates(Path::new(host)) {
                    MountPropagation::PropagationHostToContainer as i32
                } else {
                    MountPropagation::PropagationPrivate as i32
                },
                ..Default::default()
            })
            .collect();
        mounts.extend(extra.iter().map(|(host, inside)| Mount {
            container_path: inside.clone(),
            host_path: host.display().to_string(),
            readonly: true,
            ..Default::default()
        }));
        let container = ContainerConfig {
            metadata: Some(ContainerMetadata {
                name: name.into(),
                attempt: 0,
            }),
            image: Some(ImageSpec {
                image: image.into(),
                ..Default::default()
            }),
            args: args.to_vec(),
            mounts,
            log_path: format!("{name}.log"),
            linux: Some(LinuxContainerConfig {
                security_context: Some(LinuxContainerSecurityContext {
                    privileged: true,
                    readonly_rootfs: true,
                    namespace_options: Some(host()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut me = HostContainer {
            node: self,
            sandbox_id: sandbox_id.clone(),
            container_id: String::new(),
            log: log_dir.join(format!("{name}.log")),
        };
        // From here on a failure still removes the sandbox (Drop).
        me.container_id = self.create_and_start(&sandbox_id, container, &config)?;
        Ok(me)
    }
}

impl HostContainer<'_> {
    fn status(&self) -> Result<k8s_cri::v1::ContainerStatusResponse> {
        let mut client = self.node.client();
        let container_id = self.container_id.clone();
        self.node
            .call(async move {
                client
                    .container_status(k8s_cri::v1::ContainerStatusRequest {
                        container_id,
                        verbose: true,
                    })
                    .await
            })?
            .map_err(cri_err("ContainerStatus"))
            .map(tonic::Response::into_inner)
    }

    /// The container's process in the node's PID namespace (hostPID).
    pub fn pid(&self) -> Result<u32> {
        let status = self.status()?;
        status
            .info
            .get("info")
            .and_then(|i| serde_json::from_str::<serde_json::Value>(i).ok())
            .and_then(|v| v["pid"].as_u64())
            .and_then(|p| u32::try_from(p).ok())
            .filter(|p| *p != 0)
            .ok_or_else(|| LabError::Spec("the container has no pid (not running)".into()))
    }

    /// Its stdout lines and its stderr so far, from its CRI log.
    pub fn output(&self) -> (Vec<String>, String) {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        (
            cri_log_lines(&text, "stdout"),
            cri_log_lines(&text, "stderr").join("\n"),
        )
    }

    /// Until a stdout line satisfies `pred` (returned), or the container
    /// exits, or `timeout`.
    pub fn wait_stdout(&self, timeout: Duration, pred: impl Fn(&str) -> bool) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let (out, err) = self.output();
            if let Some(line) = out.iter().find(|l| pred(l)) {
                return Ok(line.clone());
            }
            if self.exit_code()?.is_some() || Instant::now() > deadline {
                return Err(LabError::Spec(format!(
                    "the container printed no such line; stdout: {}\nstderr: {err}",
                    out.join("\n")
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Its exit code once it exited.
    pub fn exit_code(&self) -> Result<Option<i32>> {
        let status = self.status()?;
        Ok(status
            .status
            .filter(|s| s.state == k8s_cri::v1::ContainerState::ContainerExited as i32)
            .map(|s| s.exit_code))
    }

    /// Until it exits: its exit code.
    pub fn wait_exit(&self, timeout: Duration) -> Result<i32> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(code) = self.exit_code()? {
                return Ok(code);
            }
            if Instant::now() > deadline {
                return Err(LabError::Spec(format!(
                    "the container did not exit within {timeout:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for HostContainer<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.node.remove_sandbox(&self.sandbox_id) {
            eprintln!("lab: removing a host container's sandbox: {e}");
        }
    }
}
