//! Whether a line holds a byte its output must treat specially: JSON's
//! escapes (`ok_line`) and what must not reach a terminal (`clean`). Both
//! scan every byte an output writes, most of it plain ASCII that passes:
//! on x86_64 sixteen bytes at a time with SSE2 (part of its baseline, so
//! no runtime check), bytewise elsewhere and for short strings.

/// The bytes looked for: a control byte (below 0x20) other than `allowed`,
/// or one of `special`.
pub(super) struct Bytes {
    allowed: [u8; 2],
    special: [u8; 2],
}

/// What a JSON string must escape: a control byte, `"` or `\`.
pub(super) const JSON: Bytes = Bytes {
    // A space is no control byte: nothing exempted.
    allowed: [b' ', b' '],
    special: [b'"', b'\\'],
};

/// What may hold a character [`super::clean`] writes out: a control byte
/// but a newline or a tab, DEL, and 0xc2, the first byte of U+0080..U+00BF
/// in UTF-8 (C1 controls among them; the others take the slow path too).
pub(super) const TERMINAL: Bytes = Bytes {
    allowed: [b'\n', b'\t'],
    special: [0x7f, 0xc2],
};

impl Bytes {
    fn has(&self, b: u8) -> bool {
        (b < 0x20 && !self.allowed.contains(&b)) || self.special.contains(&b)
    }
}

/// Whether `s` holds one of `set`'s bytes.
pub(super) fn any(s: &[u8], set: &Bytes) -> bool {
    #[cfg(target_arch = "x86_64")]
    if s.len() >= 16 {
        // SAFETY: SSE2 is part of x86_64's baseline: every such CPU has it.
        return unsafe { sse2::any(s, set) };
    }
    s.iter().any(|&b| set.has(b))
}

#[cfg(target_arch = "x86_64")]
mod sse2 {
    use std::arch::x86_64::{
        __m128i, _mm_andnot_si128, _mm_cmpeq_epi8, _mm_min_epu8, _mm_movemask_epi8, _mm_or_si128,
        _mm_set_epi64x, _mm_set1_epi8,
    };

    use super::Bytes;

    /// `s` is at least sixteen bytes long.
    #[target_feature(enable = "sse2")]
    pub(super) fn any(s: &[u8], set: &Bytes) -> bool {
        let byte = |b: u8| _mm_set1_epi8(b as i8);
        let (allowed, special) = (
            [byte(set.allowed[0]), byte(set.allowed[1])],
            [byte(set.special[0]), byte(set.special[1])],
        );
        let hit = |b: &[u8]| {
            let v = block(b);
            // A byte at most 0x1f is its own minimum with 0x1f.
            let control = _mm_cmpeq_epi8(_mm_min_epu8(v, byte(0x1f)), v);
            let allowed =
                _mm_or_si128(_mm_cmpeq_epi8(v, allowed[0]), _mm_cmpeq_epi8(v, allowed[1]));
            let special =
                _mm_or_si128(_mm_cmpeq_epi8(v, special[0]), _mm_cmpeq_epi8(v, special[1]));
            _mm_movemask_epi8(_mm_or_si128(_mm_andnot_si128(allowed, control), special)) != 0
        };
        let mut blocks = s.chunks_exact(16);
        if blocks.any(hit) {
            return true;
        }
        // The last sixteen bytes again: overlapping ones already passed.
        !blocks.remainder().is_empty() && hit(&s[s.len() - 16..])
    }

    /// The sixteen bytes at `b`'s start.
    #[target_feature(enable = "sse2")]
    fn block(b: &[u8]) -> __m128i {
        let half = |h: &[u8]| i64::from_ne_bytes([h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]]);
        _mm_set_epi64x(half(&b[8..16]), half(&b[..8]))
    }
}

#[cfg(test)]
mod tests {
    use super::{Bytes, JSON, TERMINAL, any};

    /// Each set's scan agrees with its bytewise test for each byte value at
    /// each place of a block, and in the tail.
    #[test]
    fn the_scan_is_the_bytewise_test() {
        let sets: [(&str, &Bytes); 2] = [("json", &JSON), ("terminal", &TERMINAL)];
        for (name, set) in sets {
            for len in [1usize, 15, 16, 17, 31, 32, 33, 47, 70] {
                for at in 0..len {
                    for b in 0..=255u8 {
                        let mut s = vec![b'a'; len];
                        s[at] = b;
                        let bytewise = s.iter().any(|&b| set.has(b));
                        assert_eq!(any(&s, set), bytewise, "{name}: {b:#x} at {at} of {len}");
                    }
                }
            }
        }
        assert!(!any(
            "ünïcode → ok, two\nlines\tand a tab".as_bytes(),
            &TERMINAL
        ));
        assert!(any(
            "a C1 control: \u{9b}31m, sixteen+".as_bytes(),
            &TERMINAL
        ));
        assert!(any("\"quoted\" and sixteen bytes".as_bytes(), &JSON));
    }
}
