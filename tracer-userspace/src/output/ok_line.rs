//! The abridged `ok` flow line, written without serde (issue 25): most of
//! what a busy node prints, and through serde_json it cost ~28k
//! instructions per line (callgrind: a call chain per key, per value and
//! per escaped byte). Here keys are constants, numbers go through itoa and
//! a string is copied whole unless it has a byte JSON must escape (then
//! serde_json escapes it, so escapes stay its own). The bytes are serde's:
//! `json::tests` compares both writers on every flow of every recorded
//! fixture, so a field added to one and not the other fails there.
use std::net::SocketAddr;

use crate::collector::{Attempt, FlowReport, Hop, PacketEvidence, addr_text};

/// A key as written after another member: `,"name":`. The first member
/// of an object skips the comma. One copy per key instead of four pushes
/// (callgrind: ~1.2k instructions of an `ok` line went to keys).
macro_rules! k {
    ($name:literal) => {
        concat!(",\"", $name, "\":")
    };
}

/// Whether [`write`] can write `r`'s abridged line: the fields it leaves
/// to serde (a broken connection's, ICMP errors) are absent.
pub(super) fn fits(r: &FlowReport) -> bool {
    r.phase.is_opening() && r.established.is_none() && r.icmp_errors.is_empty()
}

/// `r`'s abridged line (as `json::JsonFlow` with `Packets::Proof`), without
/// its newline.
pub(super) fn write(out: &mut Vec<u8>, r: &FlowReport) {
    let mut o = Obj::open(out);
    o.raw(k!("kind"), b"\"flow\"");
    o.name(k!("verdict"), r.verdict.as_str());
    o.name(k!("proto"), r.proto.as_str());
    o.addr(k!("client"), &r.client);
    o.addr(k!("service"), &r.service);
    o.opt_addr(k!("backend"), r.backend.as_ref());
    o.opt_addr(k!("snat"), r.snat.as_ref());
    o.bool(k!("hairpin"), r.hairpin);
    o.opt_str(k!("k8s_service"), r.k8s_service.as_deref());
    if let Some(p) = &r.client_pod {
        o.str(k!("client_pod"), p);
    }
    if let Some(p) = &r.backend_pod {
        o.str(k!("backend_pod"), p);
    }
    o.opt_str(k!("svc_chain"), r.kube.as_ref().map(|k| &*k.svc_chain));
    o.opt_str(
        k!("sep_chain"),
        r.kube.as_ref().and_then(|k| k.sep_chain.as_deref()),
    );
    o.opt_str(k!("cause"), r.cause.as_ref().map(|c| c.id.as_str()));
    o.opt_str(k!("cause_text"), r.cause.as_ref().map(|c| c.text.as_str()));
    o.opt_str(k!("hint"), r.cause.as_ref().map(|c| c.hint.as_ref()));
    o.str(k!("detail"), &r.detail);
    o.bool(k!("incomplete"), r.incomplete);
    if !r.opening_seen {
        o.bool(k!("opening_seen"), false);
    }
    o.bool(k!("truncated"), r.truncated);
    o.u64(k!("first_ts_ns"), r.first_ts_ns);
    o.u64(k!("decided_ts_ns"), r.decided_ts_ns);
    o.key(k!("attempts"));
    list(o.out, &r.attempts, attempt);
    o.bool(k!("packets_abridged"), true);
    o.key(k!("packets"));
    list(o.out, &r.packets, packet);
    o.close();
}

fn attempt(out: &mut Vec<u8>, a: &Attempt) {
    let mut o = Obj::open(out);
    o.u64(k!("at_ns"), a.at_ns);
    o.opt_addr(k!("backend"), a.backend.as_ref());
    o.opt_str(k!("sep_chain"), a.sep_chain.as_deref());
    o.bool(k!("answered"), a.answered);
    o.opt_str(k!("dropped"), a.dropped.as_ref().map(|n| n.as_str()));
    o.close();
}

/// A hop an abridged `ok` line keeps: where NAT rewrote the packet or
/// where the reply was judged (also the filter of serde's abridged line,
/// `json::ProofHops`).
pub(super) fn proves_ok(h: &Hop) -> bool {
    h.client_side || h.nat_stage == Some("after-nat")
}

/// `json::PacketProof`: the hops that prove the verdict only.
fn packet(out: &mut Vec<u8>, p: &PacketEvidence) {
    let mut o = Obj::open(out);
    o.name(k!("kind"), p.kind);
    o.name(k!("dir"), p.dir.as_str());
    o.u64(k!("tcp_flags"), p.tcp_flags.into());
    o.u64(k!("seq"), p.seq.into());
    o.u64(k!("ack"), p.ack.into());
    o.u64(k!("ip_id"), p.ip_id.into());
    match p.dns_id {
        Some(id) => o.u64(k!("dns_id"), id.into()),
        None => o.raw(k!("dns_id"), b"null"),
    }
    o.key(k!("hops"));
    let out = &mut *o.out;
    out.push(b'[');
    let proof = p.hops.iter().filter(|h| proves_ok(h));
    for (i, h) in proof.enumerate() {
        if i > 0 {
            out.push(b',');
        }
        hop(out, h);
    }
    out.push(b']');
    o.close();
}

fn hop(out: &mut Vec<u8>, h: &Hop) {
    let mut o = Obj::open(out);
    o.u64(k!("ts_ns"), h.ts_ns);
    o.name(k!("hook"), h.hook);
    o.opt_name(k!("nf_hook"), h.nf_hook);
    o.opt_name(k!("nat_stage"), h.nat_stage);
    o.u64(k!("ifindex"), h.ifindex.into());
    o.opt_str(k!("ifname"), h.ifname.as_ref().map(|n| n.as_str()));
    o.u64(k!("netns"), h.netns.into());
    o.bool(k!("node_ns"), h.node_ns);
    o.addr(k!("src"), &h.src);
    o.addr(k!("dst"), &h.dst);
    o.opt_str(
        k!("drop_reason"),
        h.drop_reason.as_ref().map(|n| n.as_str()),
    );
    o.bool(k!("client_side"), h.client_side);
    if let Some(n) = &h.node {
        o.str(k!("node"), n.as_str());
    }
    if let Some(p) = &h.pod {
        o.str(k!("pod"), p.as_str());
    }
    o.close();
}

fn list<T>(out: &mut Vec<u8>, items: &[T], each: impl Fn(&mut Vec<u8>, &T)) {
    out.push(b'[');
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        each(out, item);
    }
    out.push(b']');
}

/// One JSON object being written: keys are plain identifiers (no escapes).
struct Obj<'a> {
    out: &'a mut Vec<u8>,
    first: bool,
}

impl<'a> Obj<'a> {
    fn open(out: &'a mut Vec<u8>) -> Self {
        out.push(b'{');
        Obj { out, first: true }
    }

    fn close(self) {
        self.out.push(b'}');
    }

    /// `k`: from [`k!`].
    fn key(&mut self, k: &str) {
        debug_assert!(
            k.starts_with(",\"") && k.ends_with("\":"),
            "{k}: not from k!"
        );
        let k = k.as_bytes();
        let k = if std::mem::take(&mut self.first) {
            &k[1..]
        } else {
            k
        };
        self.out.extend_from_slice(k);
    }

    fn raw(&mut self, k: &str, v: &[u8]) {
        self.key(k);
        self.out.extend_from_slice(v);
    }

    fn str(&mut self, k: &str, v: &str) {
        self.key(k);
        string(self.out, v);
    }

    /// One of the program's own names (verdicts, hooks, packet kinds):
    /// nothing in them is escaped, so they skip the scan.
    fn name(&mut self, k: &str, v: &'static str) {
        debug_assert!(!needs_escape(v.as_bytes()), "{v}");
        self.key(k);
        self.out.push(b'"');
        self.out.extend_from_slice(v.as_bytes());
        self.out.push(b'"');
    }

    fn opt_name(&mut self, k: &str, v: Option<&'static str>) {
        match v {
            Some(v) => self.name(k, v),
            None => self.raw(k, b"null"),
        }
    }

    fn opt_str(&mut self, k: &str, v: Option<&str>) {
        match v {
            Some(v) => self.str(k, v),
            None => self.raw(k, b"null"),
        }
    }

    fn u64(&mut self, k: &str, v: u64) {
        self.key(k);
        self.out
            .extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
    }

    fn bool(&mut self, k: &str, v: bool) {
        self.raw(k, if v { b"true" } else { b"false" });
    }

    fn addr(&mut self, k: &str, a: &SocketAddr) {
        self.key(k);
        self.out.push(b'"');
        addr_text::push(self.out, a);
        self.out.push(b'"');
    }

    fn opt_addr(&mut self, k: &str, a: Option<&SocketAddr>) {
        match a {
            Some(a) => self.addr(k, a),
            None => self.raw(k, b"null"),
        }
    }
}

/// A JSON string: copied whole when no byte needs an escape (names,
/// addresses, the detail sentence), else escaped by serde_json itself.
fn string(out: &mut Vec<u8>, s: &str) {
    if needs_escape(s.as_bytes()) {
        // Writing into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, s);
    } else {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    }
}

/// Whether JSON must escape a byte of `s` (a control byte, `"` or `\\`),
/// eight bytes at a time: bytewise, the scan was most of the line's string
/// cost (the detail sentence alone is ~90 bytes). The word tests are the
/// usual "has a byte below n / a zero byte" ones, which never miss such a
/// byte; a false hit would only send the string through serde_json.
fn needs_escape(s: &[u8]) -> bool {
    const ONES: u64 = u64::from_ne_bytes([1; 8]);
    const HIGH: u64 = ONES * 0x80;
    let zero_byte = |x: u64| x.wrapping_sub(ONES) & !x & HIGH != 0;
    let mut words = s.chunks_exact(8);
    for w in &mut words {
        let x = u64::from_ne_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
        let control = x.wrapping_sub(ONES * 0x20) & !x & HIGH != 0;
        if control
            || zero_byte(x ^ (ONES * u64::from(b'"')))
            || zero_byte(x ^ (ONES * u64::from(b'\\')))
        {
            return true;
        }
    }
    words
        .remainder()
        .iter()
        .any(|&b| b < 0x20 || b == b'"' || b == b'\\')
}

#[cfg(test)]
mod tests {
    use super::needs_escape;

    /// The word test agrees with the bytewise one for each byte value at
    /// each place of a word, and in the tail.
    #[test]
    fn needs_escape_is_the_bytewise_test() {
        for len in [1usize, 7, 8, 9, 16, 23] {
            for at in 0..len {
                for b in 0..=255u8 {
                    let mut s = vec![b'a'; len];
                    s[at] = b;
                    let bytewise = s.iter().any(|&b| b < 0x20 || b == b'"' || b == b'\\');
                    assert_eq!(needs_escape(&s), bytewise, "byte {b:#x} at {at} of {len}");
                }
            }
        }
        // Bytes at or above 0x80 (UTF-8) beside a plain one never hit.
        assert!(!needs_escape("héllo wörld, ünïcode ok".as_bytes()));
        assert!(needs_escape("tab\there".as_bytes()));
    }
}
