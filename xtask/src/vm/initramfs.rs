//! The guest's root filesystem: a newc cpio archive written directly.
//!
//! Writing the archive ourselves (instead of staging a tree for `cpio`) lets it
//! hold /dev/console and arbitrary paths with the right modes, without touching
//! the host filesystem and without root-owned leftovers in target/.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use super::kernel::Kernel;

/// Host programs copied into the guest together with the shared libraries they load.
const HOST_PROGRAMS: &[&str] = &[
    "/usr/sbin/ip",
    // The lab writes the vxlan overlay's fdb entries with it.
    "/usr/sbin/bridge",
    "/usr/sbin/xtables-nft-multi",
    "/usr/sbin/xtables-legacy-multi",
    "/usr/sbin/conntrack",
    // vm-guest fills a netfilter priority window with base chains to see
    // `--backend auto` fall back to kprobes.
    "/usr/sbin/nft",
];

/// iptables plugins (matches, targets) are dlopen()ed, so ldd of the binary misses them.
const XTABLES_DIR: &str = "/usr/lib/x86_64-linux-gnu/xtables";

/// Names under /usr/sbin that the xtables multi-call binaries answer to.
/// Plain `iptables` is the nft backend, as on current Debian and most nodes.
const XTABLES_LINKS: &[(&str, &str)] = &[
    ("iptables", "xtables-nft-multi"),
    ("iptables-save", "xtables-nft-multi"),
    ("iptables-restore", "xtables-nft-multi"),
    ("iptables-nft", "xtables-nft-multi"),
    ("iptables-nft-save", "xtables-nft-multi"),
    ("iptables-nft-restore", "xtables-nft-multi"),
    ("iptables-legacy", "xtables-legacy-multi"),
    ("iptables-legacy-save", "xtables-legacy-multi"),
    ("iptables-legacy-restore", "xtables-legacy-multi"),
    // The dual-stack lab writes kube-proxy's IPv6 rules too (vm-guest/ipv6.rs).
    ("ip6tables", "xtables-nft-multi"),
    ("ip6tables-save", "xtables-nft-multi"),
    ("ip6tables-restore", "xtables-nft-multi"),
    ("ip6tables-nft-save", "xtables-nft-multi"),
    ("ip6tables-nft-restore", "xtables-nft-multi"),
];

const INIT: &str = include_str!("init.sh");
const SMOKE: &str = include_str!("smoke.sh");

#[derive(Clone)]
enum Entry {
    Dir,
    File { mode: u32, data: Vec<u8> },
    Symlink(String),
    CharDev { major: u32, minor: u32 },
}

/// Archive contents keyed by path (no leading slash); BTreeMap order puts every
/// directory before what it contains, which is the order the kernel unpacks in.
#[derive(Clone, Default)]
pub struct Tree {
    entries: BTreeMap<String, Entry>,
}

impl Tree {
    fn add(&mut self, path: &str, entry: Entry) {
        let path = path.trim_start_matches('/').to_string();
        let mut parent = Path::new(&path).parent();
        while let Some(p) = parent.filter(|p| !p.as_os_str().is_empty()) {
            self.entries
                .entry(p.to_string_lossy().into_owned())
                .or_insert(Entry::Dir);
            parent = p.parent();
        }
        self.entries.insert(path, entry);
    }

    /// Writes the tree below `root` (an image's mounted root filesystem);
    /// device nodes are left to the container runtime.
    pub fn write_under(&self, root: &Path) -> Result<()> {
        for (path, entry) in &self.entries {
            let dest = root.join(path);
            match entry {
                Entry::Dir => fs::create_dir_all(&dest)?,
                Entry::File { mode, data } => {
                    fs::write(&dest, data)?;
                    fs::set_permissions(&dest, fs::Permissions::from_mode(*mode))?;
                }
                Entry::Symlink(target) => std::os::unix::fs::symlink(target, &dest)?,
                Entry::CharDev { .. } => {}
            }
        }
        Ok(())
    }

    pub fn dir(&mut self, path: &str) {
        self.add(path, Entry::Dir);
    }

    pub fn file(&mut self, path: &str, mode: u32, data: Vec<u8>) {
        self.add(path, Entry::File { mode, data });
    }

    fn symlink(&mut self, path: &str, target: &str) {
        self.add(path, Entry::Symlink(target.to_string()));
    }

    /// Copies a host file (following symlinks) to the same path in the guest.
    fn host_file(&mut self, path: &Path) -> Result<()> {
        let data = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let mode = fs::metadata(path)?.permissions().mode() & 0o7777;
        self.file(&path.to_string_lossy(), mode, data);
        Ok(())
    }

    /// A host ELF plus every shared library `ldd` says it loads, at the same paths.
    fn host_program(&mut self, path: &Path) -> Result<()> {
        self.host_file(path)?;
        for lib in ldd(path)? {
            if !self
                .entries
                .contains_key(lib.to_string_lossy().trim_start_matches('/'))
            {
                self.host_file(&lib)?;
            }
        }
        Ok(())
    }

    pub fn to_cpio(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (ino, (path, entry)) in self.entries.iter().enumerate() {
            let (mode, data, rdev): (u32, &[u8], (u32, u32)) = match entry {
                Entry::Dir => (0o040755, &[], (0, 0)),
                Entry::File { mode, data } => (0o100000 | mode, data, (0, 0)),
                Entry::Symlink(t) => (0o120777, t.as_bytes(), (0, 0)),
                Entry::CharDev { major, minor } => (0o020600, &[], (*major, *minor)),
            };
            write_entry(&mut out, ino as u32 + 1, path, mode, data, rdev);
        }
        write_entry(&mut out, 0, "TRAILER!!!", 0, &[], (0, 0));
        out
    }
}

fn write_entry(out: &mut Vec<u8>, ino: u32, name: &str, mode: u32, data: &[u8], rdev: (u32, u32)) {
    let nlink = if mode & 0o170000 == 0o040000 { 2 } else { 1 };
    let fields = [
        ino,
        mode,
        0, // uid
        0, // gid
        nlink,
        0, // mtime: fixed, so the same inputs give the same archive
        data.len() as u32,
        0, // dev major
        0, // dev minor
        rdev.0,
        rdev.1,
        name.len() as u32 + 1,
        0, // check
    ];
    out.extend_from_slice(b"070701");
    for f in fields {
        out.extend_from_slice(format!("{f:08x}").as_bytes());
    }
    out.extend_from_slice(name.as_bytes());
    out.push(0);
    pad4(out);
    out.extend_from_slice(data);
    pad4(out);
}

fn pad4(out: &mut Vec<u8>) {
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

fn ldd(path: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(path)
        .output()
        .context("running ldd")?;
    if !out.status.success() {
        bail!("ldd {} failed", path.display());
    }
    // Lines look like "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or
    // "/lib64/ld-linux-x86-64.so.2 (0x...)"; the vDSO has no path and is skipped.
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().find(|w| w.starts_with('/')))
        .map(PathBuf::from)
        .collect())
}

/// Host `programs` with their libraries, plus what iptables needs beside
/// them: the multi-call names, its dlopen()ed plugins, /etc lookup files.
/// Shared by the guests and the container image (`cargo xtask image`).
pub fn add_host_tools(t: &mut Tree, programs: &[&str]) -> Result<()> {
    for prog in programs {
        t.host_program(Path::new(prog))
            .with_context(|| format!("{prog} is missing (cargo xtask setup)"))?;
    }
    for (name, target) in XTABLES_LINKS {
        t.symlink(&format!("usr/sbin/{name}"), target);
    }
    for e in fs::read_dir(XTABLES_DIR).with_context(|| format!("reading {XTABLES_DIR}"))? {
        t.host_program(&e?.path())?;
    }
    // iptables looks these up by name; without them it warns and some matches fail.
    for f in ["/etc/protocols", "/etc/services", "/etc/ethertypes"] {
        if Path::new(f).exists() {
            t.host_file(Path::new(f))?;
        }
    }
    Ok(())
}

/// What goes into the guest besides the kernel's modules.
pub struct Payload {
    /// Static binaries, installed as /bin/<file name>.
    pub binaries: Vec<PathBuf>,
    /// Shell command line /init runs; its exit status is the guest's verdict.
    pub command: String,
}

/// Everything but the kernel's modules: the same for every guest, so it is
/// gathered (dozens of `ldd` runs) once per vm-test run.
pub fn base(payload: &Payload) -> Result<Tree> {
    let mut t = Tree::default();
    for d in [
        "dev", "proc", "sys", "tmp", "run", "var/run", "mnt", "etc", "root",
    ] {
        t.dir(d);
    }
    // The kernel opens /dev/console for init's stdio before anything can mount
    // devtmpfs; without the node, init would run with no output at all.
    t.add("dev/console", Entry::CharDev { major: 5, minor: 1 });

    t.host_file(Path::new("/usr/bin/busybox"))
        .context("busybox-static is missing (cargo xtask setup)")?;
    t.symlink("bin/sh", "/usr/bin/busybox");
    add_host_tools(&mut t, HOST_PROGRAMS)?;
    t.file(
        "etc/passwd",
        0o644,
        b"root:x:0:0:root:/root:/bin/sh\n".to_vec(),
    );
    t.file("etc/group", 0o644, b"root:x:0:\n".to_vec());

    for bin in &payload.binaries {
        let name = bin.file_name().unwrap().to_string_lossy();
        let data = fs::read(bin).with_context(|| format!("reading payload {}", bin.display()))?;
        t.file(&format!("bin/{name}"), 0o755, data);
    }
    t.file("init", 0o755, INIT.as_bytes().to_vec());
    t.file("bin/vm-smoke", 0o755, SMOKE.as_bytes().to_vec());
    t.file(
        "etc/payload",
        0o644,
        format!("{}\n", payload.command).into_bytes(),
    );
    Ok(t)
}

/// The base plus this kernel's modules, as a cpio archive.
pub fn build(base: &Tree, kernel: &Kernel) -> Result<Vec<u8>> {
    let mut t = base.clone();
    let mut modules = String::new();
    for m in &kernel.modules {
        let name = m.file_name().unwrap().to_string_lossy();
        t.file(&format!("lib/modules/{name}"), 0o644, fs::read(m)?);
        modules.push_str(&format!("/lib/modules/{name}\n"));
    }
    t.file("etc/modules.order", 0o644, modules.into_bytes());
    t.file(
        "etc/kernel-label",
        0o644,
        format!("{}\n", kernel.series.label()).into_bytes(),
    );
    Ok(t.to_cpio())
}
