//! Struct member offsets of the running kernel, read from its BTF.
//!
//! Rust eBPF emits no CO-RE relocations, so the kernel programs read
//! `sk_buff`, `net_device`, ... at offsets handed to them in the object's
//! read-only global `KERNEL_OFFSETS` (probes/load.rs). Those
//! offsets differ between kernels (sk_buff.head is at byte 192 on 6.18 and
//! 200 on 6.1/6.12), so they are looked up here at start, never compiled in.
mod raw;

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use raw::{RawBtf, TypeRec, View};
use tracer_common::KernelOffsets;

pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";
const MODULE_BTF_DIR: &str = "/sys/kernel/btf";
/// include/linux/netdevice.h: the private area of a device without a
/// `priv` member starts at sizeof(struct net_device) rounded up to this.
const NETDEV_ALIGN: u32 = 32;

#[derive(Debug, thiserror::Error)]
pub enum BtfError {
    #[error(
        "this kernel exposes no BTF at {0} (needs CONFIG_DEBUG_INFO_BTF=y, standard on current distribution kernels)"
    )]
    NoBtf(PathBuf),
    #[error("cannot parse kernel BTF {path}: {msg}")]
    Parse { path: PathBuf, msg: String },
    #[error("kernel BTF has no struct {0}")]
    NoType(String),
    #[error("kernel BTF: struct {ty} has no member {member}")]
    NoMember { ty: String, member: String },
    #[error("kernel BTF: {ty}.{member} is a bitfield, not byte-addressable")]
    Bitfield { ty: String, member: String },
}

/// The kernel's BTF: vmlinux plus the module BTF loaded on demand (split BTF
/// on top of vmlinux, e.g. `nf_conntrack` when it is a module).
pub struct KernelBtf {
    vmlinux: RawBtf,
    modules: HashMap<String, Option<RawBtf>>,
}

impl KernelBtf {
    pub fn load() -> Result<Self, BtfError> {
        Self::load_from(Path::new(VMLINUX_BTF))
    }

    pub fn load_from(path: &Path) -> Result<Self, BtfError> {
        if !path.exists() {
            return Err(BtfError::NoBtf(path.to_owned()));
        }
        let parse_err = |msg: String| BtfError::Parse {
            path: path.to_owned(),
            msg,
        };
        let bytes = std::fs::read(path).map_err(|e| parse_err(e.to_string()))?;
        let vmlinux = RawBtf::parse(bytes, None).map_err(parse_err)?;
        Ok(KernelBtf {
            vmlinux,
            modules: HashMap::new(),
        })
    }

    /// vmlinux's type ids of the typedefs `names` (None: not in it).
    pub fn vmlinux_typedef_ids(&self, names: &[String]) -> Vec<Option<u32>> {
        self.vmlinux().typedef_ids(names)
    }

    fn vmlinux(&self) -> View<'_> {
        View {
            base: &self.vmlinux,
            split: None,
        }
    }

    /// Module BTF, or None when the module is not loaded (or built in, in
    /// which case its types are in vmlinux).
    fn module(&mut self, name: &str) -> Option<View<'_>> {
        let vmlinux = &self.vmlinux;
        let split = self
            .modules
            .entry(name.to_owned())
            .or_insert_with(|| {
                let path = Path::new(MODULE_BTF_DIR).join(name);
                if !path.exists() {
                    return None;
                }
                std::fs::read(&path)
                    .map_err(|e| e.to_string())
                    .and_then(|bytes| RawBtf::parse(bytes, Some(vmlinux)))
                    .map_err(|e| log::warn!("cannot parse {}: {e}", path.display()))
                    .ok()
            })
            .as_ref()?;
        Some(View {
            base: vmlinux,
            split: Some(split),
        })
    }

    /// Byte offset of `path` (dot-separated, e.g. `ns.inum`) inside `struct ty`,
    /// looking through anonymous unions/structs as C does.
    pub fn offset(&self, ty: &str, path: &str) -> Result<u32, BtfError> {
        offset_in(self.vmlinux(), ty, path)
    }

    /// vmlinux's enum `name` as (value, enumerator name) pairs, e.g.
    /// `skb_drop_reason`; None when it has no such enum.
    pub fn enum_values(&self, name: &str) -> Option<Vec<(u32, String)>> {
        let view = self.vmlinux();
        let values = view.enum_values(name)?;
        Some(
            values
                .into_iter()
                .filter_map(|(name_off, v)| {
                    let name = String::from_utf8_lossy(view.name(name_off)).into_owned();
                    u32::try_from(v).ok().map(|v| (v, name))
                })
                .collect(),
        )
    }

    /// Like [`offset`](Self::offset), in vmlinux or else in `module`'s BTF.
    pub fn offset_in_module(
        &mut self,
        module: &str,
        ty: &str,
        path: &str,
    ) -> Result<u32, BtfError> {
        match offset_in(self.vmlinux(), ty, path) {
            Err(BtfError::NoType(_)) => match self.module(module) {
                Some(btf) => offset_in(btf, ty, path),
                None => Err(BtfError::NoType(format!(
                    "{ty} (module {module} not loaded)"
                ))),
            },
            other => other,
        }
    }

    pub fn size_in_module(&mut self, module: &str, ty: &str) -> Result<u32, BtfError> {
        match find_struct(self.vmlinux(), ty) {
            Ok(s) => Ok(s.size_or_type),
            Err(BtfError::NoType(_)) => match self.module(module) {
                Some(btf) => find_struct(btf, ty).map(|s| s.size_or_type),
                None => Err(BtfError::NoType(format!(
                    "{ty} (module {module} not loaded)"
                ))),
            },
            Err(e) => Err(e),
        }
    }

    /// Everything the kernel programs need. The netfilter-link backend only
    /// needs sk_buff/net_device/net; the conntrack offsets (kprobe backend)
    /// are left 0 when nf_conntrack is not loaded.
    pub fn kernel_offsets(&mut self) -> Result<KernelOffsets, BtfError> {
        let mut o = KernelOffsets {
            sk_buff_head: self.offset("sk_buff", "head")?,
            sk_buff_data: self.offset("sk_buff", "data")?,
            sk_buff_network_header: self.offset("sk_buff", "network_header")?,
            sk_buff_dev: self.offset("sk_buff", "dev")?,
            net_device_ifindex: self.offset("net_device", "ifindex")?,
            net_device_nd_net: self.offset("net_device", "nd_net")?,
            net_ns_inum: self.offset("net", "ns.inum")?,
            nf_hook_state_hook: self.offset("nf_hook_state", "hook")?,
            nf_hook_state_pf: self.offset("nf_hook_state", "pf")?,
            nf_hook_state_net: self.offset("nf_hook_state", "net")?,
            ..Default::default()
        };
        if let Err(e) = self.conntrack_offsets(&mut o) {
            // Left 0: the kernel programs then skip NAT events, and the
            // loader says why (conntrack_missing).
            o.nf_conn_tuplehash = 0;
            o.sk_buff_nfct = 0;
            log::debug!("conntrack offsets unavailable (kprobe backend only): {e}");
        }
        o.net_device_flags = self.offset("net_device", "flags")?;
        o.net_device_rtnl_link_ops = self.offset("net_device", "rtnl_link_ops")?;
        o.rtnl_link_ops_kind = self.offset("rtnl_link_ops", "kind")?;
        o.net_device_priv = match self.offset("net_device", "priv") {
            Ok(off) => off,
            Err(_) => find_struct(self.vmlinux(), "net_device")?
                .size_or_type
                .next_multiple_of(NETDEV_ALIGN),
        };
        // `peer` has been veth_priv's first member since veth.c began; the
        // module's BTF, when it is loaded, confirms it.
        o.veth_priv_peer = self
            .offset_in_module("veth", "veth_priv", "peer")
            .unwrap_or(0);
        o.head_is_mem = u32::from(self.head_is_mem());
        match self.offset_in_module("bridge", "net_bridge_port", "dev") {
            Ok(off) => o.net_bridge_port_dev = off,
            // br_forward then reports skb->dev (the ingress port) instead.
            Err(e) => log::debug!("net_bridge_port.dev unavailable: {e}"),
        }
        Ok(o)
    }

    /// Whether a tp_btf program's load of `skb->head` gives memory it may
    /// load from ([`KernelOffsets::head_is_mem`]). The verifier's change
    /// (kernel 6.17, "bpf: rdonly_untrusted_mem for btf id walk pointer
    /// leafs") came with `enum bpf_features` and its first value, which
    /// says so in vmlinux's BTF, as the kernel's selftests read it
    /// (tools/testing/selftests/bpf/progs/mem_rdonly_untrusted.c).
    fn head_is_mem(&self) -> bool {
        self.enum_values("bpf_features")
            .is_some_and(|v| v.iter().any(|(_, n)| n == "BPF_FEAT_RDONLY_CAST_TO_VOID"))
    }

    /// Why the NAT kprobes cannot read conntrack entries, if they cannot.
    pub fn conntrack_missing(&mut self) -> Option<String> {
        let mut o = KernelOffsets::default();
        self.conntrack_offsets(&mut o).err().map(|e| e.to_string())
    }

    fn conntrack_offsets(&mut self, o: &mut KernelOffsets) -> Result<(), BtfError> {
        const M: &str = "nf_conntrack";
        const H: &str = "nf_conntrack_tuple_hash";
        o.nf_conn_tuplehash = self.offset_in_module(M, "nf_conn", "tuplehash")?;
        o.nf_conn_status = self.offset_in_module(M, "nf_conn", "status")?;
        o.nf_conntrack_tuple_hash_size = self.size_in_module(M, H)?;
        o.tuple_src_u3 = self.offset_in_module(M, H, "tuple.src.u3")?;
        o.tuple_src_u = self.offset_in_module(M, H, "tuple.src.u")?;
        o.tuple_dst_u3 = self.offset_in_module(M, H, "tuple.dst.u3")?;
        o.tuple_dst_u = self.offset_in_module(M, H, "tuple.dst.u")?;
        o.sk_buff_nfct = self.offset("sk_buff", "_nfct")?;
        Ok(())
    }
}

fn find_struct<'a>(btf: View<'a>, name: &str) -> Result<TypeRec<'a>, BtfError> {
    btf.find_composite(name)
        .ok_or_else(|| BtfError::NoType(name.to_owned()))
}

/// Finds `name` in `s`, descending into anonymous members; returns its bit
/// offset from the start of `s`, its type id and whether it is a bitfield.
fn find_member(btf: View<'_>, s: &TypeRec<'_>, name: &str) -> Option<(u32, u32, bool)> {
    for m in s.members() {
        let m_name = btf.name(m.name_off);
        if m_name == name.as_bytes() {
            return Some((m.bit_offset, m.type_id, m.bitfield_size != 0));
        }
        if m_name.is_empty()
            && let Some(inner) = btf.strip_modifiers(m.type_id).filter(TypeRec::is_composite)
            && let Some((off, t, bf)) = find_member(btf, &inner, name)
        {
            return Some((m.bit_offset + off, t, bf));
        }
    }
    None
}

fn offset_in(btf: View<'_>, ty: &str, path: &str) -> Result<u32, BtfError> {
    let mut current = find_struct(btf, ty)?;
    let mut bits = 0u32;
    let mut parts = path.split('.').peekable();
    while let Some(part) = parts.next() {
        let no_member = || BtfError::NoMember {
            ty: ty.to_owned(),
            member: path.to_owned(),
        };
        let (off, member_type, bitfield) =
            find_member(btf, &current, part).ok_or_else(no_member)?;
        if bitfield || off % 8 != 0 {
            return Err(BtfError::Bitfield {
                ty: ty.to_owned(),
                member: path.to_owned(),
            });
        }
        bits += off;
        if parts.peek().is_some() {
            current = btf
                .strip_modifiers(member_type)
                .filter(TypeRec::is_composite)
                .ok_or_else(no_member)?;
        }
    }
    Ok(bits / 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The running kernel's BTF. Without it nattrace cannot start at all,
    /// so what is left to test is that loading says so.
    fn kernel() -> Option<KernelBtf> {
        if !Path::new(VMLINUX_BTF).exists() {
            let err = KernelBtf::load()
                .err()
                .expect("no vmlinux BTF, yet it loaded");
            assert!(matches!(err, BtfError::NoBtf(_)), "{err}");
            eprintln!(
                "skipped: this kernel has no {VMLINUX_BTF} (CONFIG_DEBUG_INFO_BTF); only its error was checked"
            );
            return None;
        }
        Some(KernelBtf::load().expect("parse vmlinux BTF"))
    }

    /// The drop reasons' numbering comes from here where tracefs is not
    /// mounted (session `kernel_drop_reasons`): it must be the kernel's.
    #[test]
    fn drop_reasons_from_btf_match_the_kernel() {
        let Some(k) = kernel() else { return };
        let pairs = k
            .enum_values("skb_drop_reason")
            .expect("enum skb_drop_reason");
        let code = |n: &str| pairs.iter().find(|(_, name)| name == n).map(|(v, _)| *v);
        assert_eq!(code("SKB_NOT_DROPPED_YET"), Some(0), "{pairs:?}");
        assert_eq!(code("SKB_DROP_REASON_NOT_SPECIFIED"), Some(2), "{pairs:?}");
        assert!(code("SKB_DROP_REASON_NETFILTER_DROP").is_some());
        assert!(code("SKB_DROP_REASON_NEIGH_FAILED").is_some());
        let format = "/sys/kernel/tracing/events/skb/kfree_skb/format";
        match std::fs::read_to_string(format) {
            Ok(text) => {
                let traced = crate::collector::DropReasons::parse_tracefs_format(&text)
                    .expect("tracefs table");
                let from_btf = crate::collector::DropReasons::from_pairs(pairs.clone());
                for (v, name) in traced.pairs() {
                    assert_eq!(
                        from_btf.name(v).map(|n| n.as_str()),
                        Some(name),
                        "reason {v}"
                    );
                }
            }
            Err(e) => eprintln!("{format}: {e}; compared with no tracefs table"),
        }
    }

    #[test]
    fn resolves_plausible_offsets() {
        let Some(mut k) = kernel() else { return };
        let o = k.kernel_offsets().expect("offsets");
        // Layout facts that hold on every 6.x kernel: data follows head,
        // dev sits in the first cache line, ns.inum near the start of struct net.
        assert_eq!(o.sk_buff_data, o.sk_buff_head + 8);
        assert!(o.sk_buff_dev > 0 && o.sk_buff_dev < 64, "{o:?}");
        assert!(o.sk_buff_network_header > 150 && o.sk_buff_network_header < o.sk_buff_head);
        // The programs read both with one 32-byte read from network_header's
        // word (tracer-ebpf skb.rs `head_and_network_header`); two otherwise.
        assert!(
            o.sk_buff_head + 8 <= (o.sk_buff_network_header & !7) + 32,
            "{o:?}"
        );
        assert!(o.net_device_ifindex > 0 && o.net_device_nd_net > 0);
        // The private area follows every other member; veth's peer leads it.
        assert!(o.net_device_priv > o.net_device_nd_net, "{o:?}");
        assert!(o.net_device_priv > o.net_device_rtnl_link_ops, "{o:?}");
        assert_eq!(o.veth_priv_peer, 0, "{o:?}");
        // kind follows the ops list's list_head (on 6.18 also srcu, the
        // module and its link count: 40).
        assert!((16..=64).contains(&o.rtnl_link_ops_kind), "{o:?}");
        assert!(o.net_ns_inum > 0 && o.net_ns_inum < 512, "{o:?}");
        assert!(o.nf_hook_state_net > o.nf_hook_state_pf, "{o:?}");
        if o.nf_conn_tuplehash != 0 {
            // The tuple follows a two-pointer hlist_nulls_node; src before dst.
            assert_eq!(o.tuple_src_u3, 16, "{o:?}");
            assert!(o.tuple_dst_u3 > o.tuple_src_u && o.tuple_dst_u > o.tuple_dst_u3);
            assert!(o.nf_conntrack_tuple_hash_size >= 56, "{o:?}");
            // status follows tuplehash[IP_CT_DIR_MAX].
            assert!(
                o.nf_conn_status >= o.nf_conn_tuplehash + 2 * o.nf_conntrack_tuple_hash_size,
                "{o:?}"
            );
        }
        // Measured: sk_buff.head is at bit 1536 on this project's 6.18 build
        // machines and at 200 bytes on Debian's 6.1/6.12 (docs/MACHINE.md).
        let version = crate::probes::table::KernelFeatures::probe().version;
        match (version.0, version.1) {
            (6, 18) => assert_eq!((o.sk_buff_head, o.head_is_mem), (192, 1), "{o:?}"),
            (6, 1) | (6, 12) => assert_eq!((o.sk_buff_head, o.head_is_mem), (200, 0), "{o:?}"),
            _ => eprintln!(
                "not checked: sk_buff.head's measured offset (kernel {version:?} was never measured)"
            ),
        }
    }

    #[test]
    fn missing_names_are_errors() {
        let Some(k) = kernel() else { return };
        assert!(matches!(
            k.offset("no_such_struct_xyz", "a"),
            Err(BtfError::NoType(_))
        ));
        assert!(matches!(
            k.offset("sk_buff", "no_such_member"),
            Err(BtfError::NoMember { .. })
        ));
        // pkt_type is a 3-bit field.
        assert!(matches!(
            k.offset("sk_buff", "pkt_type"),
            Err(BtfError::Bitfield { .. })
        ));
    }

    #[test]
    fn missing_btf_is_a_clear_error() {
        let err = KernelBtf::load_from(Path::new("/nonexistent/vmlinux"))
            .err()
            .unwrap();
        assert!(matches!(err, BtfError::NoBtf(_)));
        assert!(err.to_string().contains("CONFIG_DEBUG_INFO_BTF"));
    }
}
