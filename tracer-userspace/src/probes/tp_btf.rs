//! The BTF aya 0.14 needs to load a tp_btf program, without parsing
//! vmlinux's BTF for it.
//!
//! `BtfTracePoint::load(tracepoint, &Btf)` only asks the `Btf` for the type
//! id of the typedef `btf_trace_<tracepoint>` (aya programs/tp_btf.rs,
//! `id_by_type_name_kind`) and hands that id to the kernel as
//! `attach_btf_id`, which the kernel looks up in vmlinux. aya finds it by
//! parsing all of vmlinux's BTF (~150k types, 40-120 ms and ~15 MiB of
//! peak RSS on a start, BENCHMARKS.md), and that parse was on a start's
//! critical path (`EbpfLoader::new`'s own is skipped too, [`super::aya_loader`]).
//! nattrace's own reader (src/btf) has read vmlinux's
//! BTF already for the struct offsets; it finds the typedefs' ids, and
//! this module writes a BTF blob in which those ids name those typedefs
//! and every other id is a filler pointer. aya parses that blob in a few
//! milliseconds and returns the same ids, so the kernel gets the same
//! `attach_btf_id` as before. Format: Documentation/bpf/btf.rst.
use aya::Btf;

use super::{
    TraceError,
    table::{Attach, PROGRAMS},
};
use crate::btf::KernelBtf;

const MAGIC: u16 = 0xeb9f;
const HEADER_LEN: u32 = 24;
const TYPE_LEN: u32 = 12;
const KIND_PTR: u32 = 2;
const KIND_TYPEDEF: u32 = 8;

/// Every tp_btf tracepoint nattrace's programs attach to.
fn tracepoints() -> impl Iterator<Item = &'static str> {
    PROGRAMS.iter().filter_map(|p| match p.attach {
        Attach::BtfTracepoint(tp) => Some(tp),
        _ => None,
    })
}

/// The BTF aya's `BtfTracePoint::load` reads, for every tracepoint of the
/// program table this kernel has. One it lacks is left out, so its load
/// fails as with vmlinux's own BTF (aya: unknown BTF type name).
pub(super) fn tracepoint_btf(kernel: &KernelBtf) -> Result<Btf, TraceError> {
    let names: Vec<String> = tracepoints().map(|tp| format!("btf_trace_{tp}")).collect();
    let ids: Vec<(String, u32)> = kernel
        .vmlinux_typedef_ids(&names)
        .into_iter()
        .zip(names)
        .filter_map(|(id, name)| Some((name, id?)))
        .collect();
    Btf::parse(&blob(&ids), aya::Endianness::default())
        .map_err(|e| TraceError::Kernel(format!("cannot build the tp_btf programs' BTF: {e}")))
}

/// A BTF blob whose type `id` is the typedef `name` for each of `ids`, and
/// whose other types up to the highest id are pointers to void.
fn blob(ids: &[(String, u32)]) -> Vec<u8> {
    let last = ids.iter().map(|(_, id)| *id).max().unwrap_or(0);
    let mut strings = vec![0u8];
    // (id, name offset), by id: the type loop below meets them in order.
    let mut named: Vec<(u32, u32)> = Vec::with_capacity(ids.len());
    for (name, id) in ids {
        named.push((*id, strings.len() as u32));
        strings.extend_from_slice(name.as_bytes());
        strings.push(0);
    }
    named.sort_unstable();
    let mut named = named.into_iter().peekable();
    let type_len = last * TYPE_LEN;
    let mut b = Vec::with_capacity((HEADER_LEN + type_len) as usize + strings.len());
    b.extend_from_slice(&MAGIC.to_ne_bytes());
    b.extend_from_slice(&[1, 0]); // version, flags
    for v in [HEADER_LEN, 0, type_len, type_len, strings.len() as u32] {
        b.extend_from_slice(&v.to_ne_bytes());
    }
    // Ids start at 1 (0 is void).
    for id in 1..=last {
        let (name_off, kind) = match named.next_if(|&(at, _)| at == id) {
            Some((_, off)) => (off, KIND_TYPEDEF),
            None => (0, KIND_PTR),
        };
        for v in [name_off, kind << 24, 0] {
            b.extend_from_slice(&v.to_ne_bytes());
        }
    }
    b.extend_from_slice(&strings);
    b
}

#[cfg(test)]
mod tests {
    use aya_obj::btf::BtfKind;

    use super::*;

    /// aya reads the ids back from the blob, and a name not in it is an
    /// error, as with vmlinux's BTF.
    #[test]
    fn aya_finds_each_typedef_at_its_id() {
        let ids = vec![
            ("btf_trace_kfree_skb".to_string(), 7),
            ("btf_trace_net_dev_start_xmit".to_string(), 3),
        ];
        let btf = Btf::parse(&blob(&ids), aya::Endianness::default()).unwrap();
        for (name, id) in &ids {
            assert_eq!(
                btf.id_by_type_name_kind(name, BtfKind::Typedef).unwrap(),
                *id
            );
        }
        assert!(
            btf.id_by_type_name_kind("btf_trace_consume_skb", BtfKind::Typedef)
                .is_err()
        );
    }

    /// On this kernel (when it has BTF): the ids are vmlinux's, as aya's own
    /// parse of it finds them.
    #[test]
    fn the_ids_are_vmlinuxs() {
        let Ok(kernel) = KernelBtf::load() else {
            println!("skipped: no readable /sys/kernel/btf/vmlinux");
            return;
        };
        let ours = tracepoint_btf(&kernel).unwrap();
        let full = Btf::from_sys_fs().unwrap();
        for tp in tracepoints() {
            let name = format!("btf_trace_{tp}");
            assert_eq!(
                ours.id_by_type_name_kind(&name, BtfKind::Typedef).unwrap(),
                full.id_by_type_name_kind(&name, BtfKind::Typedef).unwrap(),
                "{name}"
            );
        }
    }
}
