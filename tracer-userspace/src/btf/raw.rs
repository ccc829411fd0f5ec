//! A minimal BTF reader: just enough to find a struct by name and walk its
//! members.
//!
//! General BTF libraries index every type by name up front (~150k types in
//! vmlinux, 100+ ms); nattrace asks for about ten members of eight structs,
//! so this reader only records where each type starts and scans linearly
//! on lookup. Format: Documentation/bpf/btf.rst in the kernel tree.

use std::{collections::HashMap, sync::OnceLock};

const MAGIC: u16 = 0xeb9f;
const HEADER_MIN: usize = 24;
const TYPE_LEN: usize = 12;

pub const KIND_INT: u32 = 1;
pub const KIND_PTR: u32 = 2;
pub const KIND_ARRAY: u32 = 3;
pub const KIND_STRUCT: u32 = 4;
pub const KIND_UNION: u32 = 5;
pub const KIND_ENUM: u32 = 6;
pub const KIND_FWD: u32 = 7;
pub const KIND_TYPEDEF: u32 = 8;
pub const KIND_VOLATILE: u32 = 9;
pub const KIND_CONST: u32 = 10;
pub const KIND_RESTRICT: u32 = 11;
pub const KIND_FUNC: u32 = 12;
pub const KIND_FUNC_PROTO: u32 = 13;
pub const KIND_VAR: u32 = 14;
pub const KIND_DATASEC: u32 = 15;
pub const KIND_FLOAT: u32 = 16;
pub const KIND_DECL_TAG: u32 = 17;
pub const KIND_TYPE_TAG: u32 = 18;
pub const KIND_ENUM64: u32 = 19;

/// One BTF blob (vmlinux, or a module's split BTF on top of it).
pub struct RawBtf {
    bytes: Vec<u8>,
    /// Byte offset in `bytes` of each type record, in type-id order.
    types: Vec<usize>,
    str_start: usize,
    str_len: usize,
    /// Type id of `types[0]`: 1 for vmlinux (0 is void), base count + 1
    /// for split BTF.
    first_id: u32,
    /// String offsets below this belong to the base BTF (split BTF only).
    first_str: usize,
    /// Struct and union names → index of the first with that name, built
    /// at the first lookup: one pass instead of one per lookup (start-up
    /// asks for ~17 members of 7 structs, 24-43 ms as linear scans).
    composites: OnceLock<HashMap<Box<[u8]>, usize>>,
}

/// A parsed type record: the fixed 12 bytes plus where its trailing data is.
#[derive(Clone, Copy)]
pub struct TypeRec<'a> {
    pub btf: &'a RawBtf,
    pub name_off: u32,
    pub kind: u32,
    pub vlen: u32,
    pub kind_flag: bool,
    /// `size` for struct/union/int, `type` for modifiers and typedefs.
    pub size_or_type: u32,
    extra: usize,
}

pub struct Member {
    pub name_off: u32,
    pub type_id: u32,
    pub bit_offset: u32,
    pub bitfield_size: u32,
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

impl RawBtf {
    /// `base` is the vmlinux BTF when `bytes` is a module's split BTF.
    pub fn parse(bytes: Vec<u8>, base: Option<&RawBtf>) -> Result<RawBtf, String> {
        let short = || "truncated BTF".to_owned();
        let magic = u16::from_ne_bytes(bytes.get(0..2).ok_or_else(short)?.try_into().unwrap());
        if magic != MAGIC {
            return Err(format!("bad BTF magic {magic:#x}"));
        }
        let hdr_len = u32_at(&bytes, 4).ok_or_else(short)? as usize;
        if hdr_len < HEADER_MIN {
            return Err(format!("BTF header too short ({hdr_len})"));
        }
        let field = |i: usize| {
            u32_at(&bytes, 8 + 4 * i)
                .map(|v| v as usize)
                .ok_or_else(short)
        };
        let (type_off, type_len, str_off, str_len) = (field(0)?, field(1)?, field(2)?, field(3)?);
        let type_start = hdr_len + type_off;
        let str_start = hdr_len + str_off;
        if type_start + type_len > bytes.len() || str_start + str_len > bytes.len() {
            return Err(short());
        }
        let mut types = Vec::with_capacity(type_len / 24);
        let mut at = type_start;
        while at < type_start + type_len {
            types.push(at);
            let info = u32_at(&bytes, at + 4).ok_or_else(short)?;
            let vlen = (info & 0xffff) as usize;
            at += TYPE_LEN + trailing_len((info >> 24) & 0x1f, vlen)?;
        }
        if at != type_start + type_len {
            return Err("BTF type section does not end on a type boundary".to_owned());
        }
        let (first_id, first_str) = match base {
            Some(b) => (b.first_id + b.types.len() as u32, b.first_str + b.str_len),
            None => (1, 0),
        };
        Ok(RawBtf {
            bytes,
            types,
            str_start,
            str_len,
            first_id,
            first_str,
            composites: OnceLock::new(),
        })
    }

    fn end_id(&self) -> u32 {
        self.first_id + self.types.len() as u32
    }

    fn rec(&self, index: usize) -> TypeRec<'_> {
        let at = self.types[index];
        // In bounds: parse() walked every record.
        let info = u32_at(&self.bytes, at + 4).unwrap();
        TypeRec {
            btf: self,
            name_off: u32_at(&self.bytes, at).unwrap(),
            kind: (info >> 24) & 0x1f,
            vlen: info & 0xffff,
            kind_flag: info >> 31 == 1,
            size_or_type: u32_at(&self.bytes, at + 8).unwrap(),
            extra: at + TYPE_LEN,
        }
    }

    /// The NUL-terminated string at `off` of this blob's own string section.
    fn local_str(&self, off: usize) -> Option<&[u8]> {
        let s = self
            .bytes
            .get(self.str_start + off..self.str_start + self.str_len)?;
        Some(&s[..s.iter().position(|&c| c == 0)?])
    }
}

/// Bytes of kind-specific data after a type's fixed 12 bytes.
fn trailing_len(kind: u32, vlen: usize) -> Result<usize, String> {
    Ok(match kind {
        KIND_INT | KIND_VAR | KIND_DECL_TAG => 4,
        KIND_ARRAY => 12,
        KIND_STRUCT | KIND_UNION | KIND_DATASEC | KIND_ENUM64 => 12 * vlen,
        KIND_ENUM | KIND_FUNC_PROTO => 8 * vlen,
        KIND_PTR | KIND_FWD | KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT
        | KIND_FUNC | KIND_FLOAT | KIND_TYPE_TAG => 0,
        _ => return Err(format!("unknown BTF kind {kind}")),
    })
}

/// vmlinux BTF, optionally with one module's split BTF on top: type ids and
/// string offsets past vmlinux's continue in the module's blob.
#[derive(Clone, Copy)]
pub struct View<'a> {
    pub base: &'a RawBtf,
    pub split: Option<&'a RawBtf>,
}

impl<'a> View<'a> {
    /// The blob searched by name: the module when there is one (vmlinux
    /// itself was searched first by the caller).
    fn top(&self) -> &'a RawBtf {
        self.split.unwrap_or(self.base)
    }

    pub fn name(&self, off: u32) -> &'a [u8] {
        let off = off as usize;
        let btf = match self.split {
            Some(s) if off >= s.first_str => s,
            _ => self.base,
        };
        btf.local_str(off - btf.first_str).unwrap_or_default()
    }

    pub fn type_by_id(&self, id: u32) -> Option<TypeRec<'a>> {
        [Some(self.base), self.split]
            .into_iter()
            .flatten()
            .find(|b| (b.first_id..b.end_id()).contains(&id))
            .map(|b| b.rec((id - b.first_id) as usize))
    }

    /// The first struct or union named `name` (not a forward declaration or
    /// a typedef of the same name).
    pub fn find_composite(&self, name: &str) -> Option<TypeRec<'a>> {
        let btf = self.top();
        let index = btf.composites.get_or_init(|| {
            let mut index = HashMap::new();
            for (i, t) in (0..btf.types.len()).map(|i| (i, btf.rec(i))) {
                if t.kind == KIND_STRUCT || t.kind == KIND_UNION {
                    index.entry(self.name(t.name_off).into()).or_insert(i);
                }
            }
            index
        });
        index.get(name.as_bytes()).map(|&i| btf.rec(i))
    }

    /// The type ids of the typedefs `names` (vmlinux's
    /// `btf_trace_<tracepoint>`, which a tp_btf program is attached by), in
    /// one pass over the types that stops when each is found.
    pub fn typedef_ids(&self, names: &[String]) -> Vec<Option<u32>> {
        let btf = self.top();
        let mut ids = vec![None; names.len()];
        for i in 0..btf.types.len() {
            if ids.iter().all(Option::is_some) {
                break;
            }
            let t = btf.rec(i);
            if t.kind != KIND_TYPEDEF {
                continue;
            }
            let name = self.name(t.name_off);
            for (id, wanted) in ids.iter_mut().zip(names) {
                if id.is_none() && name == wanted.as_bytes() {
                    *id = Some(btf.first_id + i as u32);
                }
            }
        }
        ids
    }

    /// The enumerators (name offset, value) of the enum `name` (BTF_KIND_ENUM
    /// or, for 64-bit values, BTF_KIND_ENUM64); None when there is none.
    pub fn enum_values(&self, name: &str) -> Option<Vec<(u32, i64)>> {
        let btf = self.top();
        let t = (0..btf.types.len()).map(|i| btf.rec(i)).find(|t| {
            (t.kind == KIND_ENUM || t.kind == KIND_ENUM64)
                && self.name(t.name_off) == name.as_bytes()
        })?;
        let b = &btf.bytes;
        let signed = t.kind_flag;
        (0..t.vlen as usize)
            .map(|i| {
                if t.kind == KIND_ENUM {
                    let at = t.extra + 8 * i;
                    let v = u32_at(b, at + 4)?;
                    let v = if signed {
                        i64::from(v as i32)
                    } else {
                        i64::from(v)
                    };
                    Some((u32_at(b, at)?, v))
                } else {
                    let at = t.extra + 12 * i;
                    let lo = u64::from(u32_at(b, at + 4)?);
                    let hi = u64::from(u32_at(b, at + 8)?);
                    Some((u32_at(b, at)?, ((hi << 32) | lo) as i64))
                }
            })
            .collect()
    }

    /// Follows typedefs and qualifiers, as C does for member access.
    pub fn strip_modifiers(&self, mut id: u32) -> Option<TypeRec<'a>> {
        // Bounded: a malformed blob could chain modifiers in a cycle.
        for _ in 0..64 {
            let t = self.type_by_id(id)?;
            match t.kind {
                KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG => {
                    id = t.size_or_type
                }
                _ => return Some(t),
            }
        }
        None
    }
}

impl TypeRec<'_> {
    pub fn is_composite(&self) -> bool {
        self.kind == KIND_STRUCT || self.kind == KIND_UNION
    }

    pub fn members(&self) -> impl Iterator<Item = Member> + '_ {
        let kind_flag = self.kind_flag;
        let n = if self.is_composite() { self.vlen } else { 0 } as usize;
        (0..n).map(move |i| {
            let at = self.extra + 12 * i;
            let b = &self.btf.bytes;
            let offset = u32_at(b, at + 8).unwrap();
            // kind_flag set: offset packs bitfield size (high 8 bits) and bit
            // offset (low 24); otherwise it is the bit offset alone.
            let (bit_offset, bitfield_size) = if kind_flag {
                (offset & 0xff_ffff, offset >> 24)
            } else {
                (offset, 0)
            };
            Member {
                name_off: u32_at(b, at).unwrap(),
                type_id: u32_at(b, at + 4).unwrap(),
                bit_offset,
                bitfield_size,
            }
        })
    }
}
