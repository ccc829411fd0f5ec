//! BPF netfilter links (kernel >= 6.4) by hand, because aya 0.14 cannot load
//! BPF_PROG_TYPE_NETFILTER programs.
//!
//! The programs are compiled into the same object as everything else (filed
//! under `socket/...` sections, which aya parses but we never ask it to load).
//! Here we re-parse the object with aya-obj, point its map references at the
//! maps aya already created for that object (so all programs share SERVICES,
//! EVENTS, ...), link bpf-to-bpf calls, and issue
//! `bpf(BPF_PROG_LOAD, prog_type=NETFILTER, expected_attach_type=BPF_NETFILTER)`
//! and `bpf(BPF_LINK_CREATE, netfilter={pf, hooknum, priority})` ourselves.
//! The object's BTF goes with them, with each program's func_info: without
//! it the kernel takes every bpf-to-bpf callee for a static one and walks
//! the global `judge` (filter.rs) again on every path that calls it
//! (kernel/bpf/verifier.c `check_func_call`); with it, once.
//!
//! Links are fd-owned: closing the fd detaches. A link attaches in the
//! network namespace of the calling thread.
//!
//! Priorities: since 6.4, `nf_hook_entries_grow()` in net/netfilter/core.c
//! refuses a BPF hook whose priority equals that of ANY hook already on that
//! hook in the namespace:
//!
//! ```c
//! if (reg->priority == orig_ops[i]->priority &&
//!     reg->hook_ops_type == NF_HOOK_OP_BPF)
//!         return ERR_PTR(-EBUSY);
//! ```
//!
//! ("Restrict BPF hook type to force a unique priority, not shared at attach
//! time"; ordinary hooks are not restricted, so iptables or nft may later
//! register at our priority, and are then inserted before us: the insertion
//! loop below that check keeps an old entry first only while
//! `reg->priority > orig_ops[i]->priority`). So the loader tries the
//! priorities of a [`Window`] in turn and takes the first the kernel accepts.
use std::{
    collections::{HashMap, HashSet},
    ffi::CString,
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
};

use aya::{Ebpf, maps::Map};

use aya_obj::generated::{bpf_attach_type, bpf_attr, bpf_cmd, bpf_insn, bpf_prog_type};

pub const NFPROTO_IPV4: u32 = 2;
/// IPv6 has its own hooks (ip6tables, `table ip6`) at the same hook numbers
/// and the same priority landmarks (enum nf_ip6_hook_priorities,
/// include/uapi/linux/netfilter_ipv6.h), so the same programs and windows
/// serve both; only the links are per family.
pub const NFPROTO_IPV6: u32 = 10;

/// The priorities a netfilter observation point may take (inclusive) and
/// the one it tries first. Since 6.4 a BPF netfilter link may not share its
/// priority with any hook already registered on that hook in the namespace
/// (see this module's notes), so a fixed value fails on nodes where iptables,
/// nftables or another tracer already sit there; the loader walks
/// [`Window::candidates`] until the kernel accepts one.
///
/// Landmarks (enum nf_ip_hook_priorities, include/uapi/linux/netfilter_ipv4.h):
/// raw -300, conntrack -200, mangle -150, nat DNAT -100, filter 0,
/// security 50, nat SNAT 100, conntrack helper 300, confirm INT_MAX. Others
/// seen on nodes: kube-proxy nftables mode's filter chains at -110 (and
/// -90 on OUTPUT), firewalld at the table priorities + 10.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub min: i32,
    pub max: i32,
    pub preferred: i32,
}

impl Window {
    /// Deterministic search order: the preferred value, then upwards to
    /// `max`, then downwards from just below the preferred value to `min`.
    pub fn candidates(self) -> impl Iterator<Item = i32> {
        (self.preferred..=self.max).chain((self.min..self.preferred).rev())
    }

    pub fn contains(self, priority: i32) -> bool {
        (self.min..=self.max).contains(&priority)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NfLinkError {
    #[error("cannot re-parse the eBPF object: {0}")]
    Parse(String),
    #[error("cannot relocate netfilter programs: {0}")]
    Relocate(String),
    #[error("program {0} is not in the eBPF object")]
    NoProgram(String),
    #[error("map {0} used by the netfilter programs was not created by aya")]
    NoMap(String),
    #[error("the kernel rejected the eBPF object's BTF: {0}")]
    Btf(io::Error),
    #[error("the kernel rejected netfilter program {name}: {error}{log}")]
    Load {
        name: String,
        error: io::Error,
        log: String,
    },
    #[error(
        "cannot attach netfilter program {name} (hook {hooknum}, priority {priority}): {error}"
    )]
    Attach {
        name: String,
        hooknum: u32,
        priority: i32,
        error: io::Error,
    },
    #[error(
        "every netfilter priority from {} to {} at {hook} is taken by other hooks, nattrace needs one free there for its {label} point (iptables-save, nft list ruleset and nft list hooks show who sits there)",
        window.min,
        window.max
    )]
    WindowFull {
        label: String,
        hook: &'static str,
        window: Window,
    },
}

/// Loaded netfilter programs by name.
pub struct NfPrograms {
    fds: HashMap<String, OwnedFd>,
}

fn map_fd(map: &Map) -> Option<BorrowedFd<'_>> {
    match map {
        Map::Array(d)
        | Map::HashMap(d)
        | Map::LruHashMap(d)
        | Map::PerCpuArray(d)
        | Map::PerCpuHashMap(d)
        | Map::RingBuf(d) => Some(d.fd().as_fd()),
        _ => None,
    }
}

pub(super) fn sys_bpf(cmd: bpf_cmd, attr: &mut bpf_attr) -> io::Result<OwnedFd> {
    // SAFETY: attr is a fully initialised bpf_attr of the size we pass; the
    // kernel only reads memory the attr points to (insns, license, log_buf).
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd as libc::c_long,
            attr as *mut bpf_attr,
            std::mem::size_of::<bpf_attr>(),
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: on success these commands return a new fd that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(ret as i32) })
}

/// Netfilter programs relocated and ready for `BPF_PROG_LOAD`, with their
/// own duplicates of the map fds their instructions name: they can be
/// verified on another thread while the caller goes on (and even drops the
/// maps) without a closed fd number being reused under them.
pub struct NfPrepared {
    programs: Vec<Prepared>,
    btf: Option<OwnedFd>,
    _map_fds: Vec<OwnedFd>,
}

/// One program's instructions and the BTF records that go with them (as
/// bytes, `*_rec_size` each; none when the rec size is 0).
#[derive(Default)]
struct Prepared {
    name: String,
    insns: Vec<bpf_insn>,
    func_info: Vec<u8>,
    func_info_rec_size: usize,
    line_info: Vec<u8>,
    line_info_rec_size: usize,
}

/// Loads the object's BTF as aya would (sanitised for this kernel's BTF
/// features); None when the kernel or the object has none, and the programs
/// then load without func_info, as before global functions.
fn load_btf(obj: &mut aya_obj::Object) -> Result<Option<OwnedFd>, NfLinkError> {
    let Some(features) = aya::features().btf() else {
        return Ok(None);
    };
    let Some(btf) = obj
        .fixup_and_sanitize_btf(features)
        .map_err(|e| NfLinkError::Relocate(format!("BTF: {e}")))?
    else {
        return Ok(None);
    };
    let raw = btf.to_bytes();
    // SAFETY: as in sys_bpf's callers; `raw` outlives the syscall.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    unsafe {
        let u = &mut attr.__bindgen_anon_7;
        u.btf = raw.as_ptr() as u64;
        u.btf_size = raw.len() as u32;
    }
    sys_bpf(bpf_cmd::BPF_BTF_LOAD, &mut attr)
        .map(Some)
        .map_err(NfLinkError::Btf)
}

impl NfPrepared {
    /// Relocates `names` from `elf` against the maps of `ebpf` (which must
    /// have been loaded from the same bytes and still own all its maps).
    pub fn new(elf: &[u8], ebpf: &Ebpf, names: &[&str]) -> Result<Self, NfLinkError> {
        let mut obj = aya_obj::Object::parse(elf).map_err(|e| NfLinkError::Parse(e.to_string()))?;
        let obj_maps: HashMap<String, aya_obj::Map> = obj.maps.drain().collect();
        let mut map_fds = Vec::new();
        let mut fds = Vec::new();
        for name in obj_maps.keys() {
            let fd = ebpf
                .map(name)
                .and_then(map_fd)
                .ok_or_else(|| NfLinkError::NoMap(name.clone()))?
                .try_clone_to_owned()
                .map_err(|e| NfLinkError::Relocate(format!("dup of map {name}: {e}")))?;
            fds.push((name.as_str(), fd.as_raw_fd(), &obj_maps[name]));
            map_fds.push(fd);
        }
        let text_sections: HashSet<usize> = obj.functions.keys().map(|(s, _)| *s).collect();
        obj.relocate_maps(fds.into_iter(), &text_sections)
            .map_err(|e| NfLinkError::Relocate(e.to_string()))?;
        obj.relocate_calls(&text_sections)
            .map_err(|e| NfLinkError::Relocate(e.to_string()))?;
        let btf = load_btf(&mut obj)?;
        let mut programs = Vec::new();
        for &name in names {
            let prog = obj
                .programs
                .get(name)
                .ok_or_else(|| NfLinkError::NoProgram(name.to_owned()))?;
            let f = &obj.functions[&prog.function_key()];
            programs.push(Prepared {
                name: name.to_owned(),
                insns: f.instructions.clone(),
                func_info: f.func_info.func_info_bytes(),
                func_info_rec_size: f.func_info_rec_size,
                line_info: f.line_info.line_info_bytes(),
                line_info_rec_size: f.line_info_rec_size,
            });
        }
        Ok(NfPrepared {
            programs,
            btf,
            _map_fds: map_fds,
        })
    }

    /// Loads them (the kernel verifies each: most of their cost), half on
    /// another thread: as root the verifier takes no global lock
    /// (kernel/bpf/verifier.c bpf_check), so two verify at once.
    pub fn load(self) -> Result<NfPrograms, NfLinkError> {
        let license = CString::new("GPL").expect("no NUL");
        let btf = self.btf.as_ref().map(|fd| fd.as_fd());
        let load_all = |programs: &[Prepared]| {
            programs
                .iter()
                .map(|p| {
                    let began = std::time::Instant::now();
                    let fd = load_one(p, btf, &license)?;
                    log_verified(&p.name, began, &fd);
                    Ok((p.name.clone(), fd))
                })
                .collect::<Result<Vec<_>, NfLinkError>>()
        };
        let (first, second) = self.programs.split_at(self.programs.len() / 2);
        let (a, b) = std::thread::scope(|s| {
            let other = s.spawn(|| load_all(first));
            let b = load_all(second);
            (
                other
                    .join()
                    .unwrap_or_else(|p| std::panic::resume_unwind(p)),
                b,
            )
        });
        Ok(NfPrograms {
            fds: a?.into_iter().chain(b?).collect(),
        })
    }
}

impl NfPrograms {
    /// Loads `names` from `elf`, sharing the maps of `ebpf` (which must have
    /// been loaded from the same bytes and still own all its maps).
    pub fn load(elf: &[u8], ebpf: &Ebpf, names: &[&str]) -> Result<Self, NfLinkError> {
        NfPrepared::new(elf, ebpf, names)?.load()
    }

    /// Attaches `name` at `hooknum` (enum nf_inet_hooks) of family `pf`
    /// (NFPROTO_IPV4/IPV6) with `priority`, in the calling thread's network
    /// namespace.
    pub fn attach(
        &self,
        name: &str,
        pf: u32,
        hooknum: u32,
        priority: i32,
    ) -> Result<OwnedFd, NfLinkError> {
        let prog = self
            .fds
            .get(name)
            .ok_or_else(|| NfLinkError::NoProgram(name.to_owned()))?;
        // SAFETY: bpf_attr is plain data; all-zero is its documented "unset".
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: writing union fields of plain integers.
        unsafe {
            let lc = &mut attr.link_create;
            lc.__bindgen_anon_1.prog_fd = prog.as_raw_fd() as u32;
            lc.attach_type = bpf_attach_type::BPF_NETFILTER as u32;
            let nf = &mut lc.__bindgen_anon_3.netfilter;
            nf.pf = pf;
            nf.hooknum = hooknum;
            nf.priority = priority;
            nf.flags = 0;
        }
        sys_bpf(bpf_cmd::BPF_LINK_CREATE, &mut attr).map_err(|error| NfLinkError::Attach {
            name: name.to_owned(),
            hooknum,
            priority,
            error,
        })
    }
}

/// Tries `window`'s priorities in order (see [`Window::candidates`]) and
/// returns the link and the priority taken. Only EBUSY (priority taken)
/// moves on; any other refusal is final.
pub fn attach_in_window(
    programs: &NfPrograms,
    name: &str,
    label: &str,
    pf: u32,
    hooknum: u8,
    window: Window,
) -> Result<(OwnedFd, i32), NfLinkError> {
    first_free(window, |priority| {
        programs.attach(name, pf, u32::from(hooknum), priority)
    })
    .ok_or_else(|| NfLinkError::WindowFull {
        label: label.to_owned(),
        hook: tracer_common::nf_hook::name(hooknum),
        window,
    })?
}

/// The first candidate of `window` that `try_attach` does not refuse with
/// EBUSY: Some(its result), or None when all of them are taken.
fn first_free<T>(
    window: Window,
    mut try_attach: impl FnMut(i32) -> Result<T, NfLinkError>,
) -> Option<Result<(T, i32), NfLinkError>> {
    for priority in window.candidates() {
        match try_attach(priority) {
            Ok(link) => return Some(Ok((link, priority))),
            Err(NfLinkError::Attach { error, .. }) if error.raw_os_error() == Some(libc::EBUSY) => {
                log::debug!("netfilter priority {priority} is taken");
            }
            Err(e) => return Some(Err(e)),
        }
    }
    None
}

/// Whether this kernel loads BPF_PROG_TYPE_NETFILTER programs (they came
/// with netfilter links, in 6.4 or a backport). None = cannot tell (e.g. not
/// privileged).
pub fn probe_support() -> Option<bool> {
    // r0 = NF_ACCEPT; exit
    let insns = [
        bpf_insn {
            code: 0xb7,
            _bitfield_align_1: [],
            _bitfield_1: bpf_insn::new_bitfield_1(0, 0),
            off: 0,
            imm: 1,
        },
        bpf_insn {
            code: 0x95,
            _bitfield_align_1: [],
            _bitfield_1: bpf_insn::new_bitfield_1(0, 0),
            off: 0,
            imm: 0,
        },
    ];
    let license = CString::new("GPL").expect("no NUL");
    let probe = Prepared {
        name: "nattrace_probe".to_owned(),
        insns: insns.to_vec(),
        ..Default::default()
    };
    match load_one(&probe, None, &license) {
        Ok(_) => Some(true),
        Err(NfLinkError::Load { error, .. }) if error.raw_os_error() == Some(libc::EINVAL) => {
            Some(false)
        }
        Err(_) => None,
    }
}

/// As the tp_btf and kprobe programs' line (attach.rs): the kernel's count
/// of instructions it walked, read from the program's fdinfo, only when
/// the line is printed.
fn log_verified(name: &str, began: std::time::Instant, fd: &OwnedFd) {
    if !log::log_enabled!(log::Level::Debug) {
        return;
    }
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd()));
    let insns = info.ok().and_then(|i| {
        i.lines()
            .find_map(|l| l.strip_prefix("verified_insns:"))
            .map(|v| v.trim().to_owned())
    });
    log::debug!(
        "start-up: {name} loaded and verified in {:.1} ms ({} instructions processed)",
        began.elapsed().as_secs_f64() * 1e3,
        insns.as_deref().unwrap_or("?")
    );
}

fn load_one(
    p: &Prepared,
    btf: Option<BorrowedFd<'_>>,
    license: &CString,
) -> Result<OwnedFd, NfLinkError> {
    let (name, insns) = (p.name.as_str(), &p.insns);
    let attempt = |log: Option<&mut Vec<u8>>| {
        // SAFETY: as above.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: writing plain-integer union fields; the pointers stay valid
        // for the duration of the syscall.
        unsafe {
            let a = &mut attr.__bindgen_anon_3;
            a.prog_type = bpf_prog_type::BPF_PROG_TYPE_NETFILTER as u32;
            a.expected_attach_type = bpf_attach_type::BPF_NETFILTER as u32;
            a.insn_cnt = insns.len() as u32;
            a.insns = insns.as_ptr() as u64;
            a.license = license.as_ptr() as u64;
            for (dst, src) in a.prog_name.iter_mut().zip(name.bytes().take(15)) {
                *dst = src as libc::c_char;
            }
            if let Some(btf) = btf {
                a.prog_btf_fd = btf.as_raw_fd() as u32;
                if let Some(n) = p.func_info.len().checked_div(p.func_info_rec_size) {
                    a.func_info = p.func_info.as_ptr() as u64;
                    a.func_info_cnt = n as u32;
                    a.func_info_rec_size = p.func_info_rec_size as u32;
                }
                if let Some(n) = p.line_info.len().checked_div(p.line_info_rec_size) {
                    a.line_info = p.line_info.as_ptr() as u64;
                    a.line_info_cnt = n as u32;
                    a.line_info_rec_size = p.line_info_rec_size as u32;
                }
            }
            if let Some(log) = log {
                a.log_level = 1;
                a.log_size = log.len() as u32;
                a.log_buf = log.as_mut_ptr() as u64;
            }
        }
        sys_bpf(bpf_cmd::BPF_PROG_LOAD, &mut attr)
    };
    match attempt(None) {
        Ok(fd) => Ok(fd),
        Err(first) => {
            // Load again only to get the verifier's explanation.
            let mut buf = vec![0u8; 1 << 20];
            let _ = attempt(Some(&mut buf));
            let log = log_tail(&buf);
            Err(NfLinkError::Load {
                name: name.to_owned(),
                error: first,
                log,
            })
        }
    }
}

/// The last lines of a verifier log, for the error. The log is a C string:
/// the verifier moves its end back over what it wrote for a path it
/// abandons (kernel/bpf/log.c `bpf_vlog_reset` stores a NUL at the new
/// end), so older text can follow the first NUL. Read past it, the tail was
/// that stale text and left out the reason (6.18, a program over the
/// combined stack size: the reason was before the NUL).
fn log_tail(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let text = String::from_utf8_lossy(&buf[..end]);
    let tail: Vec<&str> = text.lines().rev().take(20).collect();
    if tail.is_empty() {
        return String::new();
    }
    format!(
        "\nverifier log (tail):\n{}",
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape 6.18 returned for nf_pre over the combined stack: the
    /// reason, a NUL, then older lines of an abandoned path.
    #[test]
    fn the_log_ends_at_its_first_nul() {
        let mut buf = b"Func#5 ('judge') is safe for any args that match its prototype\n\
            combined stack size of 2 calls is 544. Too large\n\
            processed 58130 insns (limit 1000000)\n"
            .to_vec();
        buf.push(0);
        buf.extend_from_slice(b"ter.rs:460\n2838: (bf) r8 = r3\n");
        buf.resize(4096, 0);
        let tail = log_tail(&buf);
        assert!(tail.contains("544. Too large"), "{tail}");
        assert!(!tail.contains("2838"), "{tail}");
        assert_eq!(log_tail(&[0; 16]), "");
    }

    fn busy(priority: i32) -> NfLinkError {
        NfLinkError::Attach {
            name: "p".into(),
            hooknum: 0,
            priority,
            error: io::Error::from_raw_os_error(libc::EBUSY),
        }
    }

    const W: Window = Window {
        min: -5,
        max: 5,
        preferred: 3,
    };

    #[test]
    fn takes_the_preferred_priority_when_free() {
        let got = first_free(W, Ok).unwrap().unwrap();
        assert_eq!(got, (3, 3));
    }

    #[test]
    fn skips_taken_priorities_upwards_then_downwards() {
        let taken = [3, 4, 5, 2];
        let mut tried = Vec::new();
        let got = first_free(W, |p| {
            tried.push(p);
            if taken.contains(&p) {
                Err(busy(p))
            } else {
                Ok(())
            }
        })
        .unwrap()
        .unwrap();
        assert_eq!(got.1, 1);
        assert_eq!(tried, [3, 4, 5, 2, 1]);
    }

    #[test]
    fn a_full_window_is_none_and_other_errors_are_final() {
        assert!(first_free(W, |p| Err::<(), _>(busy(p))).is_none());
        let mut calls = 0;
        let got = first_free(W, |p| {
            calls += 1;
            Err::<(), _>(NfLinkError::Attach {
                name: "p".into(),
                hooknum: 0,
                priority: p,
                error: io::Error::from_raw_os_error(libc::EINVAL),
            })
        });
        assert!(matches!(got, Some(Err(NfLinkError::Attach { .. }))));
        assert_eq!(calls, 1);
    }

    #[test]
    fn window_full_is_one_line_naming_hook_and_range() {
        let e = NfLinkError::WindowFull {
            label: "FORWARD".into(),
            hook: "FORWARD",
            window: super::super::table::FORWARD,
        };
        let line = e.to_string();
        assert!(!line.contains('\n'));
        assert!(line.contains("from -199 to -1 at FORWARD"), "{line}");
    }
}
