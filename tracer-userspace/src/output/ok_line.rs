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

/// A boolean value with the fixed bytes before and after it, one literal
/// either way.
macro_rules! flag {
    ($out:expr, $b:expr, $before:literal, $after:literal) => {
        lit(
            $out,
            if $b {
                concat!($before, "true", $after)
            } else {
                concat!($before, "false", $after)
            },
        )
    };
}

/// Whether [`write`] can write `r`'s abridged line: the fields it leaves
/// to serde (a broken connection's, ICMP errors) are absent.
pub(super) fn fits(r: &FlowReport) -> bool {
    r.phase.is_opening() && r.established.is_none() && r.icmp_errors.is_empty()
}

/// `r`'s abridged line (as `json::JsonFlow` with `Packets::Proof`), without
/// its newline. The fixed bytes between two values (the comma, the next
/// key, the quotes around a string value) go out as one literal each: key
/// by key, with a quote pushed on each side of a value, the line took ~33
/// copies and as many capacity checks (callgrind: ~2k of its ~6.4k
/// instructions).
pub(super) fn write(out: &mut Vec<u8>, r: &FlowReport) {
    let mut seen = Written::default();
    lit(out, r#"{"kind":"flow","verdict":""#);
    name(out, r.verdict.as_str());
    lit(out, r#"","proto":""#);
    name(out, r.proto.as_str());
    lit(out, r#"","client":""#);
    seen.addr(out, &r.client);
    lit(out, r#"","service":""#);
    seen.addr(out, &r.service);
    lit(out, r#"","backend":"#);
    seen.opt_addr(out, r.backend.as_ref());
    lit(out, r#","snat":"#);
    seen.opt_addr(out, r.snat.as_ref());
    flag!(out, r.hairpin, r#","hairpin":"#, r#","k8s_service":"#);
    opt_str(out, r.k8s_service.as_deref());
    if let Some(p) = &r.client_pod {
        lit(out, r#","client_pod":"#);
        string(out, p.as_str());
    }
    if let Some(p) = &r.backend_pod {
        lit(out, r#","backend_pod":"#);
        string(out, p.as_str());
    }
    lit(out, r#","svc_chain":"#);
    opt_str(out, r.kube.as_ref().map(|k| &*k.svc_chain));
    lit(out, r#","sep_chain":"#);
    opt_str(out, r.kube.as_ref().and_then(|k| k.sep_chain.as_deref()));
    lit(out, r#","cause":"#);
    opt_str(out, r.cause.as_ref().map(|c| c.id.as_str()));
    lit(out, r#","cause_text":"#);
    opt_str(out, r.cause.as_ref().map(|c| c.text.as_str()));
    lit(out, r#","hint":"#);
    opt_str(out, r.cause.as_ref().map(|c| c.hint.as_ref()));
    lit(out, r#","detail":"#);
    string(out, &r.detail);
    flag!(out, r.incomplete, r#","incomplete":"#, "");
    if !r.opening_seen {
        lit(out, r#","opening_seen":false"#);
    }
    flag!(out, r.truncated, r#","truncated":"#, r#","first_ts_ns":"#);
    num(out, r.first_ts_ns);
    lit(out, r#","decided_ts_ns":"#);
    num(out, r.decided_ts_ns);
    lit(out, r#","attempts":"#);
    list(out, &r.attempts, |out, a| attempt(out, &seen, a));
    lit(out, r#","packets_abridged":true,"packets":"#);
    list(out, &r.packets, |out, p| packet(out, &seen, p));
    out.push(b'}');
}

/// The flow's own addresses as this line wrote them, by where their text
/// is in it: an attempt's backend and a proving hop's source and
/// destination are almost always one of them, and copying the text back
/// costs a fraction of writing it again (callgrind: ~160 instructions per
/// IPv4 address written, 8-10 addresses per `ok` line).
#[derive(Default)]
struct Written {
    known: [(Option<SocketAddr>, usize, usize); 4],
    n: usize,
}

impl Written {
    /// Writes `a` and remembers where (the flow's ends, written first).
    fn addr(&mut self, out: &mut Vec<u8>, a: &SocketAddr) {
        let start = out.len();
        addr_text::push(out, a);
        if let Some(slot) = self.known.get_mut(self.n) {
            *slot = (Some(*a), start, out.len());
            self.n += 1;
        }
    }

    fn opt_addr(&mut self, out: &mut Vec<u8>, a: Option<&SocketAddr>) {
        quoted_or_null(out, a, |out, a| self.addr(out, a));
    }

    /// `a`'s text, copied from earlier in the line when it was written
    /// there.
    fn again(&self, out: &mut Vec<u8>, a: &SocketAddr) {
        match self.known[..self.n]
            .iter()
            .find(|k| k.0.as_ref() == Some(a))
        {
            Some(&(_, start, end)) => out.extend_from_within(start..end),
            None => addr_text::push(out, a),
        }
    }

    fn opt_again(&self, out: &mut Vec<u8>, a: Option<&SocketAddr>) {
        quoted_or_null(out, a, |out, a| self.again(out, a));
    }
}

/// An optional value: its text between quotes, or `null`.
fn quoted_or_null<T>(out: &mut Vec<u8>, a: Option<T>, text: impl FnOnce(&mut Vec<u8>, T)) {
    match a {
        Some(a) => {
            out.push(b'"');
            text(out, a);
            out.push(b'"');
        }
        None => lit(out, "null"),
    }
}

fn attempt(out: &mut Vec<u8>, seen: &Written, a: &Attempt) {
    lit(out, r#"{"at_ns":"#);
    num(out, a.at_ns);
    lit(out, r#","backend":"#);
    seen.opt_again(out, a.backend.as_ref());
    lit(out, r#","sep_chain":"#);
    opt_str(out, a.sep_chain.as_deref());
    flag!(out, a.answered, r#","answered":"#, r#","dropped":"#);
    opt_str(out, a.dropped.as_ref().map(|n| n.as_str()));
    out.push(b'}');
}

/// A hop an abridged `ok` line keeps: where NAT rewrote the packet or
/// where the reply was judged (also the filter of serde's abridged line,
/// `json::ProofHops`).
pub(super) fn proves_ok(h: &Hop) -> bool {
    h.client_side || h.nat_stage == Some("after-nat")
}

/// `json::PacketProof`: the hops that prove the verdict only.
fn packet(out: &mut Vec<u8>, seen: &Written, p: &PacketEvidence) {
    lit(out, r#"{"kind":""#);
    name(out, p.kind);
    lit(out, r#"","dir":""#);
    name(out, p.dir.as_str());
    lit(out, r#"","tcp_flags":"#);
    num(out, p.tcp_flags.into());
    lit(out, r#","seq":"#);
    num(out, p.seq.into());
    lit(out, r#","ack":"#);
    num(out, p.ack.into());
    lit(out, r#","ip_id":"#);
    num(out, p.ip_id.into());
    match p.dns_id {
        Some(id) => {
            lit(out, r#","dns_id":"#);
            num(out, id.into());
            lit(out, r#","hops":["#);
        }
        None => lit(out, r#","dns_id":null,"hops":["#),
    }
    let proof = p.hops.iter().filter(|h| proves_ok(h));
    for (i, h) in proof.enumerate() {
        if i > 0 {
            out.push(b',');
        }
        hop(out, seen, h);
    }
    lit(out, "]}");
}

fn hop(out: &mut Vec<u8>, seen: &Written, h: &Hop) {
    lit(out, r#"{"ts_ns":"#);
    num(out, h.ts_ns);
    lit(out, r#","hook":""#);
    name(out, h.hook);
    lit(out, r#"","nf_hook":"#);
    opt_name(out, h.nf_hook);
    lit(out, r#","nat_stage":"#);
    opt_name(out, h.nat_stage);
    lit(out, r#","ifindex":"#);
    num(out, h.ifindex.into());
    lit(out, r#","ifname":"#);
    opt_str(out, h.ifname.as_ref().map(|n| n.as_str()));
    lit(out, r#","netns":"#);
    num(out, h.netns.into());
    flag!(out, h.node_ns, r#","node_ns":"#, r#","src":""#);
    seen.again(out, &h.src);
    lit(out, r#"","dst":""#);
    seen.again(out, &h.dst);
    lit(out, r#"","drop_reason":"#);
    opt_str(out, h.drop_reason.as_ref().map(|n| n.as_str()));
    flag!(out, h.client_side, r#","client_side":"#, "");
    if let Some(n) = &h.node {
        lit(out, r#","node":"#);
        string(out, n.as_str());
    }
    if let Some(p) = &h.pod {
        lit(out, r#","pod":"#);
        string(out, p.as_str());
    }
    out.push(b'}');
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

/// The line's fixed bytes: keys are plain identifiers, so nothing in a
/// literal needs an escape.
#[inline(always)]
fn lit(out: &mut Vec<u8>, s: &'static str) {
    out.extend_from_slice(s.as_bytes());
}

/// One of the program's own names (verdicts, hooks, packet kinds), between
/// quotes its literals carry: nothing in them is escaped, so they skip the
/// scan.
#[inline(always)]
fn name(out: &mut Vec<u8>, v: &'static str) {
    debug_assert!(!needs_escape(v.as_bytes()), "{v}");
    out.extend_from_slice(v.as_bytes());
}

fn opt_name(out: &mut Vec<u8>, v: Option<&'static str>) {
    quoted_or_null(out, v, name);
}

fn opt_str(out: &mut Vec<u8>, v: Option<&str>) {
    match v {
        Some(v) => string(out, v),
        None => lit(out, "null"),
    }
}

fn num(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
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

/// Whether JSON must escape a byte of `s` (a control byte, `"` or `\\`).
/// The line's strings are 4-70 bytes: with SSE2 from sixteen bytes on
/// (word by word the scan was ~75 instructions of each, callgrind).
fn needs_escape(s: &[u8]) -> bool {
    if cfg!(target_arch = "x86_64") && s.len() >= 16 {
        super::scan::any(s, &super::scan::JSON)
    } else {
        needs_escape_words(s)
    }
}

/// [`needs_escape`] eight bytes at a time: bytewise, the scan was most of
/// the line's string cost (the detail sentence alone is ~90 bytes). The
/// word tests are the usual "has a byte below n / a zero byte" ones, which
/// never miss such a byte; a false hit would only send the string through
/// serde_json. The tail is one more word too (the last eight bytes again,
/// or the short string padded with spaces): bytewise, up to seven bytes
/// cost more than the words before them in most of the line's names
/// (callgrind).
fn needs_escape_words(s: &[u8]) -> bool {
    const ONES: u64 = u64::from_ne_bytes([1; 8]);
    const HIGH: u64 = ONES * 0x80;
    let zero_byte = |x: u64| x.wrapping_sub(ONES) & !x & HIGH != 0;
    let hit = |x: u64| {
        x.wrapping_sub(ONES * 0x20) & !x & HIGH != 0
            || zero_byte(x ^ (ONES * u64::from(b'"')))
            || zero_byte(x ^ (ONES * u64::from(b'\\')))
    };
    let word = |w: &[u8]| u64::from_ne_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
    let mut words = s.chunks_exact(8);
    for w in &mut words {
        if hit(word(w)) {
            return true;
        }
    }
    match words.remainder().len() {
        0 => false,
        // Overlapping bytes already passed: testing them again changes nothing.
        _ if s.len() >= 8 => hit(word(&s[s.len() - 8..])),
        n => {
            let mut last = [b' '; 8];
            last[..n].copy_from_slice(s);
            hit(word(&last))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{needs_escape, needs_escape_words};

    /// Both scans agree with the bytewise test for each byte value at each
    /// place of a block, and in the tail.
    #[test]
    fn needs_escape_is_the_bytewise_test() {
        for len in [1usize, 2, 7, 8, 9, 15, 16, 17, 23, 31, 32, 33, 47, 70] {
            for at in 0..len {
                for b in 0..=255u8 {
                    let mut s = vec![b'a'; len];
                    s[at] = b;
                    let bytewise = s.iter().any(|&b| b < 0x20 || b == b'"' || b == b'\\');
                    assert_eq!(needs_escape(&s), bytewise, "byte {b:#x} at {at} of {len}");
                    assert_eq!(needs_escape_words(&s), bytewise, "words: {b:#x} at {at}");
                }
            }
        }
        // Bytes at or above 0x80 (UTF-8) beside a plain one never hit.
        assert!(!needs_escape("héllo wörld, ünïcode ok".as_bytes()));
        assert!(needs_escape("tab\there".as_bytes()));
    }
}
