//! Debian guest kernels: pick, download, unpack, extract `vmlinux`, collect modules.
//!
//! Everything lands in the cache directory and each step writes into a temporary
//! name first, so an interrupted run never leaves a half-made artifact that a
//! later run would trust.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

/// Modules the lab needs, in a load order that works (docs/MACHINE.md).
/// Dependencies read from each module's modinfo are loaded first regardless.
pub const MODULES: &[&str] = &[
    "llc",
    "stp",
    "bridge",
    "br_netfilter",
    "veth",
    // Seed 000's two nodes are joined by a flannel-style vxlan overlay.
    "vxlan",
    "crc32c-intel",
    "crc32c_generic",
    "libcrc32c",
    "nf_defrag_ipv4",
    "nf_defrag_ipv6",
    "nf_conntrack",
    "nf_nat",
    "nf_conntrack_netlink",
    "nfnetlink",
    "nf_tables",
    "nft_chain_nat",
    "nft_compat",
    "x_tables",
    "ip_tables",
    "iptable_nat",
    "iptable_filter",
    "xt_MASQUERADE",
    "xt_nat",
    "xt_mark",
    "xt_comment",
    "xt_tcpudp",
    "xt_addrtype",
    "xt_conntrack",
    // kube-proxy picks among endpoints with `-m statistic --mode random`.
    "xt_statistic",
    // The rest of a node's layout (tests/src/kube_proxy/node.rs): kube-proxy's
    // filter table with its no-endpoints REJECT and conntrack matches (which
    // iptables-nft turns into native `ct` and `reject` expressions), the mangle
    // canaries, and the legacy variant's tables and REJECT target.
    "nft_ct",
    "nf_reject_ipv4",
    "nft_reject",
    "nft_reject_ipv4",
    "iptable_mangle",
    "ipt_REJECT",
    "sch_ingress",
    "cls_bpf",
    // A late ACK held in a pod (lab::hold): an NFQUEUE rule in its raw table.
    "iptable_raw",
    "nfnetlink_queue",
    "xt_NFQUEUE",
    "nft_queue",
];

/// A kernel series the harness knows how to fetch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Series {
    #[value(name = "6.1")]
    V6_1,
    #[value(name = "6.12")]
    V6_12,
}

impl Series {
    pub fn label(self) -> &'static str {
        match self {
            Series::V6_1 => "6.1",
            Series::V6_12 => "6.12",
        }
    }

    /// The numeric part that orders this series' packages, or None if `pkg` is not
    /// a plain signed amd64 image of the series (-dbg, -unsigned, cloud, rt, meta).
    fn package_rank(self, pkg: &str) -> Option<u64> {
        let (prefix, suffix) = match self {
            Series::V6_1 => ("linux-image-6.1.0-", "-amd64"),
            Series::V6_12 => ("linux-image-6.12.", "+deb12-amd64"),
        };
        let n = pkg.strip_prefix(prefix)?.strip_suffix(suffix)?;
        n.parse().ok()
    }
}

/// A kernel ready to boot: its ELF image and its modules in load order.
pub struct Kernel {
    pub series: Series,
    pub release: String,
    pub vmlinux: PathBuf,
    /// Uncompressed `.ko` files, dependencies before dependents.
    pub modules: Vec<PathBuf>,
}

pub fn prepare(series: Series, cache: &Path) -> Result<Kernel> {
    let pkg = newest_package(series)?;
    let deb = download(&pkg, &cache.join("debs"))?;
    let root = unpack(&deb, &cache.join("unpacked"))?;
    let release = module_release(&root)?;
    let out = cache.join("kernels").join(&release);
    fs::create_dir_all(&out)?;
    let vmlinux = out.join("vmlinux");
    if !vmlinux.exists() {
        let vmlinuz = root.join("boot").join(format!("vmlinuz-{release}"));
        let elf = extract_vmlinux(&vmlinuz)?;
        write_atomic(&vmlinux, &elf)?;
    }
    let modules = collect_modules(
        &root.join("lib/modules").join(&release),
        &out.join("modules"),
    )?;
    Ok(Kernel {
        series,
        release,
        vmlinux,
        modules,
    })
}

fn newest_package(series: Series) -> Result<String> {
    let out = Command::new("apt-cache")
        .args(["search", "--names-only", "^linux-image-6\\.1"])
        .output()
        .context("running apt-cache (is this Debian?)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let best = text
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter_map(|p| series.package_rank(p).map(|r| (r, p.to_string())))
        .max();
    match best {
        Some((_, pkg)) => Ok(pkg),
        None => bail!(
            "apt-cache knows no linux-image package for {} (run `apt-get update`)",
            series.label()
        ),
    }
}

/// Reuses a cached .deb of exactly this package; apt names files `<pkg>_<version>_<arch>.deb`.
fn download(pkg: &str, dir: &Path) -> Result<PathBuf> {
    fs::create_dir_all(dir)?;
    if let Some(deb) = find_deb(pkg, dir)? {
        return Ok(deb);
    }
    // Per package: the kernels are prepared in parallel threads.
    let tmp = dir.join(format!(".download-{pkg}"));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp)?;
    eprintln!("vm-test: apt-get download {pkg}");
    // Sandbox user root: apt's default _apt user can't write into target/, and
    // says so in a warning on every download.
    run(Command::new("apt-get")
        .args(["download", "-qq", "-o", "APT::Sandbox::User=root", pkg])
        .current_dir(&tmp))?;
    let deb =
        find_deb(pkg, &tmp)?.with_context(|| format!("apt-get download {pkg} left no .deb"))?;
    let dest = dir.join(deb.file_name().unwrap());
    fs::rename(&deb, &dest)?;
    fs::remove_dir_all(&tmp)?;
    Ok(dest)
}

fn find_deb(pkg: &str, dir: &Path) -> Result<Option<PathBuf>> {
    let prefix = format!("{pkg}_");
    for e in fs::read_dir(dir)? {
        let name = e?.file_name().to_string_lossy().into_owned();
        if name.starts_with(&prefix) && name.ends_with(".deb") {
            return Ok(Some(dir.join(name)));
        }
    }
    Ok(None)
}

fn unpack(deb: &Path, dir: &Path) -> Result<PathBuf> {
    let stem = deb.file_stem().unwrap().to_string_lossy().into_owned();
    let dest = dir.join(&stem);
    if dest.exists() {
        return Ok(dest);
    }
    let tmp = dir.join(format!(".{stem}.tmp"));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp)?;
    eprintln!("vm-test: dpkg-deb -x {}", deb.display());
    run(Command::new("dpkg-deb").arg("-x").arg(deb).arg(&tmp))?;
    fs::rename(&tmp, &dest)?;
    Ok(dest)
}

fn module_release(root: &Path) -> Result<String> {
    let dir = root.join("lib/modules");
    let mut names = fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<Result<Vec<_>>>()?;
    match names.len() {
        1 => Ok(names.pop().unwrap()),
        n => bail!(
            "expected one kernel release under {}, found {n}",
            dir.display()
        ),
    }
}

/// scripts/extract-vmlinux: try every compressed-stream magic in the bzImage until
/// one decompresses to an ELF. The setup code before the payload and the trailer
/// after it are why the offset has to be searched and trailing garbage tolerated.
pub fn extract_vmlinux(vmlinuz: &Path) -> Result<Vec<u8>> {
    let image = fs::read(vmlinuz).with_context(|| format!("reading {}", vmlinuz.display()))?;
    let formats: [(&[u8], &[&str]); 2] = [
        (b"\xfd7zXZ\x00", &["xz", "-dc", "--single-stream"]),
        (b"\x28\xb5\x2f\xfd", &["zstd", "-dc"]),
    ];
    for (magic, cmd) in formats {
        for pos in find_all(&image, magic) {
            let out = pipe_through(cmd, &image[pos..])?;
            if out.starts_with(b"\x7fELF") {
                return Ok(out);
            }
        }
    }
    bail!(
        "no xz or zstd stream in {} decompresses to an ELF",
        vmlinuz.display()
    )
}

fn find_all(hay: &[u8], needle: &[u8]) -> Vec<usize> {
    hay.windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle)
        .map(|(i, _)| i)
        .collect()
}

/// Runs a decompressor on `input`, returning what it wrote even if it then
/// complained: zstd exits non-zero on the bytes after the frame, after decoding it.
fn pipe_through(cmd: &[&str], input: &[u8]) -> Result<Vec<u8>> {
    let mut child = Command::new(cmd[0])
        .args(&cmd[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("running {} (cargo xtask setup installs it)", cmd[0]))?;
    let mut stdin = child.stdin.take().unwrap();
    let data = input.to_vec();
    // A decompressor that stops early closes its stdin; writing from a thread keeps
    // that from deadlocking against our read of its stdout.
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&data);
    });
    let out = child.wait_with_output()?;
    let _ = writer.join();
    Ok(out.stdout)
}

/// Decompresses the wanted modules (and what they depend on) into `out`,
/// returning them in load order. Modules the kernel lacks or has built in are skipped.
fn collect_modules(moddir: &Path, out: &Path) -> Result<Vec<PathBuf>> {
    let mut files = BTreeMap::new();
    index_modules(&moddir.join("kernel"), &mut files)?;
    fs::create_dir_all(out)?;

    let mut order = Vec::new();
    let mut seen = BTreeSet::new();
    for name in MODULES {
        add_with_deps(&normalize(name), &files, out, &mut seen, &mut order)?;
    }
    Ok(order)
}

/// Module names treat `-` and `_` alike (crc32c-intel is loaded as crc32c_intel).
fn normalize(name: &str) -> String {
    name.replace('-', "_")
}

fn index_modules(dir: &Path, files: &mut BTreeMap<String, PathBuf>) -> Result<()> {
    for e in fs::read_dir(dir)? {
        let e = e?;
        let path = e.path();
        if e.file_type()?.is_dir() {
            index_modules(&path, files)?;
            continue;
        }
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(stem) = name
            .strip_suffix(".ko")
            .or_else(|| name.strip_suffix(".ko.xz"))
        {
            files.insert(normalize(stem), path);
        }
    }
    Ok(())
}

fn add_with_deps(
    name: &str,
    files: &BTreeMap<String, PathBuf>,
    out: &Path,
    seen: &mut BTreeSet<String>,
    order: &mut Vec<PathBuf>,
) -> Result<()> {
    if !seen.insert(name.to_string()) {
        return Ok(());
    }
    let Some(src) = files.get(name) else {
        return Ok(());
    };
    let dest = out.join(format!("{name}.ko"));
    if !dest.exists() {
        let bytes = if src.extension().is_some_and(|e| e == "xz") {
            let raw = fs::read(src)?;
            let ko = pipe_through(&["xz", "-dc"], &raw)?;
            if !ko.starts_with(b"\x7fELF") {
                bail!("xz -dc {} gave no ELF", src.display());
            }
            ko
        } else {
            fs::read(src)?
        };
        write_atomic(&dest, &bytes)?;
    }
    for dep in modinfo_depends(&fs::read(&dest)?) {
        add_with_deps(&dep, files, out, seen, order)?;
    }
    order.push(dest);
    Ok(())
}

/// The `depends=` entry of the .modinfo section; Debian's image package has no
/// modules.dep (depmod makes it at install time, and we never install).
fn modinfo_depends(ko: &[u8]) -> Vec<String> {
    ko.split(|&b| b == 0)
        .filter_map(|s| s.strip_prefix(b"depends="))
        .flat_map(|s| {
            String::from_utf8_lossy(s)
                .split(',')
                .map(normalize)
                .collect::<Vec<_>>()
        })
        .filter(|s| !s.is_empty())
        .collect()
}

pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path)?;
    Ok(())
}

pub fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}
