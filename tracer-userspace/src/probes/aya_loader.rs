//! aya's loader without its parse of vmlinux's BTF.
//!
//! aya 0.14's `EbpfLoader::new` parses all of vmlinux's BTF (aya bpf.rs,
//! `btf: Btf::from_sys_fs().ok()`), ~150k types: 55-75 ms of CPU on a start
//! that is CPU-bound on 2 cores (the verifier), for a parse nattrace throws
//! away (its object has no CO-RE: offsets come from nattrace's own BTF
//! reader, and the tp_btf programs' ids from [`super::tp_btf`]). Both of
//! aya 0.14's constructors parse, and the field is private. Upstream made it
//! lazy in aya-rs/aya#1639 (issue #1172), in releases that need a newer Rust
//! than this workspace's; when nattrace moves to one, this module goes and
//! `EbpfLoader::new()` stays.
//!
//! Until then the loader is made on a thread of its own, in a mount
//! namespace of that thread's own (`unshare(CLONE_NEWNS)` applies to the
//! calling thread: kernel/fork.c `ksys_unshare` refuses it only with
//! CLONE_THREAD/VM/SIGHAND in a multi-threaded process), where an empty
//! tmpfs covers `/sys/kernel/btf`: `from_sys_fs` finds no file and the
//! loader starts without BTF, which [`EbpfLoader::btf`]`(None)` asks for
//! anyway. The namespace's mounts are private first, so nothing propagates
//! to the node's, and the namespace ends with the thread. It costs what
//! copying the node's mount table costs (kernel/fork.c → fs/namespace.c
//! `copy_mnt_ns`, then the private walk): 0.2 ms on a bare VM, 10-35 ms
//! with 3,000 mounts (a busy node's pods' volumes) on a loaded 2-core one,
//! where the parse took 150 ms and more. Where the thread
//! may not unshare or mount (a container without CAP_SYS_ADMIN, a seccomp
//! profile), aya parses as before: the start is slower, nothing else
//! changes.
use aya::EbpfLoader;
use nix::mount::{MsFlags, mount};
use nix::sched::{CloneFlags, unshare};

const KERNEL_BTF_DIR: &str = "/sys/kernel/btf";

/// A loader being made on a thread of its own ([`spawn`]).
pub(super) struct Pending(std::sync::mpsc::Receiver<EbpfLoader<'static>>);

impl Pending {
    /// The loader, made here if its thread is gone.
    pub(super) fn wait(&self) -> EbpfLoader<'static> {
        self.0.recv().unwrap_or_else(|_| without_btf())
    }
}

/// A loader without kernel BTF, made on a new thread that ends after it.
pub(super) fn spawn() -> Pending {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    std::thread::spawn(move || {
        let t = crate::timing::step("aya EbpfLoader::new (own thread)");
        if let Err(e) = hide_kernel_btf() {
            log::debug!(
                "aya's loader parses vmlinux's BTF: cannot hide {KERNEL_BTF_DIR} on its thread ({e})"
            );
        }
        let l = without_btf();
        drop(t);
        // The receiver may be gone (a failed start): nothing to do then.
        let _ = tx.send(l);
    });
    Pending(rx)
}

/// A loader without kernel BTF, waited for.
pub(super) fn made() -> EbpfLoader<'static> {
    spawn().wait()
}

/// The loader on the calling thread, parse and all (the fallback when the
/// loader's thread is gone).
fn without_btf() -> EbpfLoader<'static> {
    let mut l = EbpfLoader::new();
    l.btf(None);
    l
}

/// This thread's own mount namespace, with `/sys/kernel/btf` empty in it.
fn hide_kernel_btf() -> nix::Result<()> {
    unshare(CloneFlags::CLONE_NEWNS)?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )?;
    mount(
        Some("nattrace"),
        KERNEL_BTF_DIR,
        Some("tmpfs"),
        MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None::<&str>,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The node's mount table is the same after a loader was made, and the
    /// loader's thread saw no vmlinux BTF. Root only (mounts), skipped
    /// with the reason otherwise.
    #[test]
    fn the_nodes_mounts_stay_and_the_thread_sees_no_vmlinux() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: not root (mount namespaces)");
            return;
        }
        let vmlinux = std::path::Path::new(KERNEL_BTF_DIR).join("vmlinux");
        if !vmlinux.exists() {
            eprintln!("skipped: this kernel has no {}", vmlinux.display());
            return;
        }
        let mounts = || std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let before = mounts();
        let seen = std::thread::scope(|s| {
            s.spawn(|| hide_kernel_btf().map(|()| vmlinux.exists()))
                .join()
                .unwrap()
        });
        assert_eq!(seen, Ok(false), "the thread still saw vmlinux's BTF");
        assert_eq!(mounts(), before, "the process's mounts changed");
        assert!(vmlinux.exists());
        let _ = made();
    }
}
