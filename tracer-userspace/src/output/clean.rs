//! The one place user-visible text is made safe for a terminal. Interface
//! names (a pod may rename its own `eth0` to `"\e[2J"`), Service names and
//! chains from kube-proxy's rules, and everything read back from a
//! recording are not ours: printed raw, a control character would clear
//! root's screen, set its title or overwrite a line with `\r`. Text output,
//! `analyze`, `doctor` and the warnings all print through [`sanitize`] (or
//! [`Clean`], the same as an `io::Write`); JSON needs none of this, serde
//! escapes control characters itself.
use std::{borrow::Cow, io};

/// Whether `c` must not reach a terminal: C0 (ESC, `\r`, BEL, …) except a
/// newline and a tab, DEL, and C1 (U+0080..U+009F, e.g. the one-character
/// CSI U+009B).
fn is_unsafe(c: char) -> bool {
    (c.is_control() && c != '\n' && c != '\t') || ('\u{80}'..='\u{9f}').contains(&c)
}

/// `text` with each control character written out as `\xNN` (C0, DEL) or
/// `\u{NN}` (C1), so what it was stays visible and nothing is interpreted.
pub fn sanitize(text: &str) -> Cow<'_, str> {
    sanitize_keeping(text, &[])
}

/// [`sanitize`], except that the exact escape sequences in `keep` (the
/// text output's own colours) are left as they are: a name that holds one
/// of those can only colour text, never move the cursor or set a title.
pub fn sanitize_keeping<'a>(text: &'a str, keep: &[&str]) -> Cow<'a, str> {
    if !text.chars().any(is_unsafe) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if let Some(k) = keep.iter().find(|k| rest.starts_with(**k)) {
            out.push_str(k);
            rest = &rest[k.len()..];
            continue;
        }
        if is_unsafe(c) {
            let n = u32::from(c);
            if n < 0x80 {
                out.push_str(&format!("\\x{n:02x}"));
            } else {
                out.push_str(&format!("\\u{{{n:x}}}"));
            }
        } else {
            out.push(c);
        }
        rest = &rest[c.len_utf8()..];
    }
    Cow::Owned(out)
}

/// `nattrace: warning: <line>` on stderr, sanitized (for code that is not
/// live: a live session's warnings go through `session::watch::Notices`,
/// which sanitizes the same way).
pub fn warn(line: impl std::fmt::Display) {
    to_stderr(format!(
        "nattrace: warning: {}\n",
        sanitize(&line.to_string())
    ));
}

/// One whole line in one write(2). `eprintln!` with arguments writes each
/// piece on its own (stderr is unbuffered), and the session's notices go
/// to stderr from a writer thread of their own: under load one of its
/// lines landed inside a warning ("nattrace: warning: nattrace: tc on 4
/// …", a test beside stress-ng). A pipe keeps a write of up to PIPE_BUF
/// bytes whole (pipe(7)).
pub fn to_stderr(line: String) {
    use std::io::Write as _;
    let _ = io::stderr().lock().write_all(line.as_bytes());
}

/// A log record as one of our own stderr lines, in the same style as
/// [`warn`] (issue 28: not env_logger's `[… WARN nattrace::…]`):
/// `nattrace: warning: …`, `nattrace: error: …`; the debug levels (only
/// with RUST_LOG) also name the module.
pub fn log_line(level: log::Level, target: &str, message: &str) -> String {
    let message = sanitize(message);
    match level {
        log::Level::Error => format!("nattrace: error: {message}"),
        log::Level::Warn => format!("nattrace: warning: {message}"),
        other => format!(
            "nattrace: {}: {target}: {message}",
            other.as_str().to_lowercase()
        ),
    }
}

/// `nattrace: <line>` on stderr, sanitized (errors quote paths and
/// recordings).
pub fn say(line: impl std::fmt::Display) {
    to_stderr(format!("nattrace: {}\n", sanitize(&line.to_string())));
}

/// An `io::Write` that sanitizes what goes through it. Formatters write
/// whole `&str` fragments, so a write never splits a character; bytes that
/// are not UTF-8 are written as the replacement character.
pub struct Clean<W: io::Write> {
    inner: W,
    keep: &'static [&'static str],
}

impl<W: io::Write> Clean<W> {
    pub fn new(inner: W, keep: &'static [&'static str]) -> Self {
        Self { inner, keep }
    }

    pub fn get_mut(&mut self) -> &mut W {
        &mut self.inner
    }

    pub fn into_inner(self) -> W {
        self.inner
    }
}

impl<W: io::Write> io::Write for Clean<W> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        // Nearly every line: UTF-8 without a byte that could start a
        // character to write out, so written as it is. Character by
        // character, an `ok` flow's four lines cost ~6.8k instructions
        // (issue 25, callgrind).
        if !super::scan::any(data, &super::scan::TERMINAL) && std::str::from_utf8(data).is_ok() {
            self.inner.write_all(data)?;
            return Ok(data.len());
        }
        let text = String::from_utf8_lossy(data);
        self.inner
            .write_all(sanitize_keeping(&text, self.keep).as_bytes())?;
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    #[test]
    fn control_characters_are_written_out() {
        assert_eq!(sanitize("eth0"), "eth0");
        assert_eq!(sanitize("\x1b[2J\x1b[41mX"), "\\x1b[2J\\x1b[41mX");
        assert_eq!(sanitize("a\rb\x07\x7f"), "a\\x0db\\x07\\x7f");
        assert_eq!(sanitize("\u{9b}31m"), "\\u{9b}31m");
        assert_eq!(sanitize("two\nlines\tand a tab"), "two\nlines\tand a tab");
        assert_eq!(sanitize("ünïcode → ok"), "ünïcode → ok");
    }

    #[test]
    fn only_the_kept_sequences_pass() {
        let keep = ["\x1b[31m", "\x1b[0m"];
        assert_eq!(
            sanitize_keeping("\x1b[31mred\x1b[0m \x1b]0;title\x07", &keep),
            "\x1b[31mred\x1b[0m \\x1b]0;title\\x07"
        );
    }

    #[test]
    fn the_writer_sanitizes() {
        let mut w = Clean::new(Vec::new(), &[]);
        let name = "\x1b[2Jevil\r";
        write!(w, "if {name}").unwrap();
        assert_eq!(w.into_inner(), b"if \\x1b[2Jevil\\x0d");
    }
}

#[cfg(test)]
mod log_style {
    use super::log_line;

    #[test]
    fn log_records_read_like_the_other_warnings() {
        assert_eq!(
            log_line(
                log::Level::Warn,
                "nattrace::probes",
                "could not mute a decided flow: x"
            ),
            "nattrace: warning: could not mute a decided flow: x"
        );
        assert_eq!(
            log_line(log::Level::Error, "nattrace", "boom \x1b[2J"),
            "nattrace: error: boom \\x1b[2J"
        );
        assert_eq!(
            log_line(
                log::Level::Debug,
                "nattrace::probes::tc",
                "interface x is gone"
            ),
            "nattrace: debug: nattrace::probes::tc: interface x is gone"
        );
    }
}
