//! JSON lines: one `{"kind":"flow",...}` object per decided flow and a last
//! `{"kind":"summary",...}`. Field names are an interface (tests and users
//! parse them): add fields, do not rename them.
use std::{io, net::SocketAddr};

use serde::Serialize;

use crate::collector::addr_text;
use crate::collector::{
    Attempt, Dir, Established, FlowReport, Hop, IcmpError, Name, PacketEvidence, Phase, Proto,
    Summary, Verdict,
};

#[derive(Serialize)]
struct JsonFlow<'a> {
    kind: &'static str,
    verdict: Verdict,
    proto: Proto,
    #[serde(serialize_with = "addr_text::serialize")]
    client: SocketAddr,
    #[serde(serialize_with = "addr_text::serialize")]
    service: SocketAddr,
    #[serde(serialize_with = "addr_text::serialize_opt")]
    backend: Option<SocketAddr>,
    #[serde(serialize_with = "addr_text::serialize_opt")]
    snat: Option<SocketAddr>,
    hairpin: bool,
    /// kube-proxy's name of the Service port (`namespace/name:port`).
    k8s_service: Option<&'a str>,
    /// The client's and the backend's pods (`namespace/name`), when they
    /// are pods of the node; absent when unknown.
    #[serde(skip_serializing_if = "Option::is_none")]
    client_pod: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    backend_pod: Option<&'a str>,
    svc_chain: Option<&'a str>,
    sep_chain: Option<&'a str>,
    cause: Option<&'static str>,
    cause_text: Option<&'a str>,
    hint: Option<&'a str>,
    detail: &'a str,
    incomplete: bool,
    /// False: nattrace did not see the flow open (started before tracing,
    /// or while attaching); its verdict rests only on what it saw since.
    /// Written only when false, so existing lines keep their shape.
    #[serde(skip_serializing_if = "is_true")]
    opening_seen: bool,
    truncated: bool,
    first_ts_ns: u64,
    decided_ts_ns: u64,
    /// Each transmission of the opening request (SYN retransmits) and the
    /// backend DNAT chose for it: retransmits can be load-balanced again.
    attempts: &'a [Attempt],
    /// True when `packets` keeps only the hops that prove an `ok` verdict.
    packets_abridged: bool,
    packets: Packets<'a>,
    /// `"established"`: the opening was `ok`, the connection broke later.
    #[serde(skip_serializing_if = "Phase::is_opening")]
    phase: Phase,
    #[serde(skip_serializing_if = "Option::is_none")]
    established: Option<Established>,
    /// ICMP/ICMPv6 errors about the flow's packets, each with its hops
    /// (always whole: they are rare and each is evidence).
    #[serde(skip_serializing_if = "<[IcmpError]>::is_empty")]
    icmp_errors: &'a [IcmpError],
}

/// An `ok` flow is most of the output on a busy node and its full hop list
/// says nothing a reader needs (issue 7: output is what costs the node CPU),
/// so without -v it carries only the hops that prove the verdict: where NAT
/// rewrote the packet and where the reply was judged. Problem flows always
/// carry every hop.
#[derive(Serialize)]
#[serde(untagged)]
enum Packets<'a> {
    Full(&'a [PacketEvidence]),
    Proof(Vec<PacketProof<'a>>),
}

#[derive(Serialize)]
struct PacketProof<'a> {
    kind: &'static str,
    dir: Dir,
    tcp_flags: u8,
    seq: u32,
    ack: u32,
    ip_id: u16,
    dns_id: Option<u16>,
    hops: ProofHops<'a>,
}

/// The hops that prove an `ok` verdict, filtered while serializing: a
/// `Vec` per packet was an allocation per packet on every healthy flow.
struct ProofHops<'a>(&'a [Hop]);

impl Serialize for ProofHops<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().filter(|h| super::ok_line::proves_ok(h)))
    }
}

impl<'a> PacketProof<'a> {
    fn of(p: &'a PacketEvidence) -> Self {
        PacketProof {
            kind: p.kind,
            dir: p.dir,
            tcp_flags: p.tcp_flags,
            seq: p.seq,
            ack: p.ack,
            ip_id: p.ip_id,
            dns_id: p.dns_id,
            hops: ProofHops(&p.hops),
        }
    }
}

#[derive(Serialize)]
struct JsonSummary<'a> {
    kind: &'static str,
    #[serde(flatten)]
    summary: &'a Summary,
    /// Lines a live session dropped because stdout was not read fast enough.
    dropped_output_lines: u64,
}

pub struct JsonOutput<W: io::Write> {
    out: W,
    verbose: bool,
    /// One flow's line, serialized here and written whole: serde_json's
    /// dozens of small writes per line cost more through `W` than into a
    /// `Vec` (perf: QueueWriter::write was the process's top symbol).
    line: Vec<u8>,
}

impl<W: io::Write> JsonOutput<W> {
    /// `verbose`: every hop of every flow (-v); otherwise `ok` flows are abridged.
    pub fn new(out: W, verbose: bool) -> Self {
        Self {
            out,
            verbose,
            line: Vec::with_capacity(4096),
        }
    }

    pub fn flow(&mut self, r: &FlowReport) -> io::Result<()> {
        let abridged = !self.verbose && r.verdict == Verdict::Ok;
        self.line.clear();
        if abridged && super::ok_line::fits(r) {
            super::ok_line::write(&mut self.line, r);
        } else {
            self.serde_line(r, abridged)?;
        }
        self.line.push(b'\n');
        self.out.write_all(&self.line)
    }

    /// The flow's line through serde (every line but the common `ok` one,
    /// which [`super::ok_line`] writes byte for byte the same).
    fn serde_line(&mut self, r: &FlowReport, abridged: bool) -> io::Result<()> {
        let packets = if abridged {
            Packets::Proof(r.packets.iter().map(PacketProof::of).collect())
        } else {
            Packets::Full(&r.packets)
        };
        let line = JsonFlow {
            kind: "flow",
            verdict: r.verdict,
            proto: r.proto,
            client: r.client,
            service: r.service,
            backend: r.backend,
            snat: r.snat,
            hairpin: r.hairpin,
            k8s_service: r.k8s_service.as_deref(),
            client_pod: r.client_pod.as_ref().map(Name::as_str),
            backend_pod: r.backend_pod.as_ref().map(Name::as_str),
            svc_chain: r.kube.as_ref().map(|k| &*k.svc_chain),
            sep_chain: r.kube.as_ref().and_then(|k| k.sep_chain.as_deref()),
            cause: r.cause.as_ref().map(|c| c.id.as_str()),
            cause_text: r.cause.as_ref().map(|c| c.text.as_str()),
            hint: r.cause.as_ref().map(|c| c.hint.as_ref()),
            detail: &r.detail,
            incomplete: r.incomplete,
            opening_seen: r.opening_seen,
            truncated: r.truncated,
            first_ts_ns: r.first_ts_ns,
            decided_ts_ns: r.decided_ts_ns,
            attempts: &r.attempts,
            packets_abridged: abridged,
            packets,
            phase: r.phase,
            established: r.established,
            icmp_errors: &r.icmp_errors,
        };
        serde_json::to_writer(&mut self.line, &line)?;
        Ok(())
    }

    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    /// `dropped_lines`: output lines a live session dropped because stdout
    /// was not read fast enough.
    pub fn summary(&mut self, s: &Summary, dropped_lines: u64) -> io::Result<()> {
        serde_json::to_writer(
            &mut self.out,
            &JsonSummary {
                kind: "summary",
                summary: s,
                dropped_output_lines: dropped_lines,
            },
        )?;
        self.out.write_all(b"\n")?;
        self.out.flush()
    }

    /// The target, for lines that are not flows (the preamble).
    pub fn writer(&mut self) -> &mut W {
        &mut self.out
    }

    pub fn into_inner(self) -> W {
        self.out
    }
}

fn is_true(b: &bool) -> bool {
    *b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recording::{Reader, replay::decide_all};

    fn recordings(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                recordings(&p, out);
            } else if p.extension().is_some_and(|x| x == "rec") {
                out.push(p);
            }
        }
    }

    /// The hand-written `ok` line is serde's, byte for byte, on every flow
    /// of every recorded fixture that it writes (and it writes most).
    #[test]
    fn ok_line_is_serdes_on_every_fixture() {
        let mut files = Vec::new();
        recordings(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures"),
            &mut files,
        );
        assert!(files.len() > 20, "{files:?}");
        let mut compared = 0;
        for f in &files {
            let Ok((mut reader, header)) = Reader::open(f) else {
                continue;
            };
            let (reports, _) = decide_all(&mut reader, &header, None);
            let mut out = JsonOutput::new(Vec::new(), false);
            for r in reports.iter().filter(|r| r.verdict == Verdict::Ok) {
                if !crate::output::ok_line::fits(r) {
                    continue;
                }
                out.line.clear();
                out.serde_line(r, true).unwrap();
                let serde = std::mem::take(&mut out.line);
                let mut fast = Vec::new();
                crate::output::ok_line::write(&mut fast, r);
                assert_eq!(
                    String::from_utf8_lossy(&fast),
                    String::from_utf8_lossy(&serde),
                    "{}",
                    f.display()
                );
                compared += 1;
            }
        }
        assert!(compared > 30, "{compared} ok lines compared");
        println!("{compared} ok lines compared in {} recordings", files.len());
    }

    /// Strings that need escapes, and the optional fields a fixture may
    /// not have (pods, node names, a cause on an `ok` flow): still serde's.
    #[test]
    fn ok_line_escapes_and_optionals_are_serdes() {
        let text = include_str!(crate::fixture!(
            "recorded/root_hairpin_with_masquerade_is_ok.rec"
        ));
        let (mut reader, header) =
            Reader::new(std::io::Cursor::new(text.as_bytes())).expect("a recording");
        let (reports, _) = decide_all(&mut reader, &header, None);
        let mut r = reports
            .into_iter()
            .find(|r| r.verdict == Verdict::Ok)
            .expect("an ok flow");
        r.detail = "quote \" back\\slash \n tab\t bell\u{7} unicode → ✓".into();
        r.client_pod = Some("default/client \"x\"".into());
        r.backend_pod = Some("default/web-0".into());
        r.opening_seen = false;
        for p in &mut r.packets {
            for h in &mut p.hops {
                h.node = Some(crate::collector::Name("node-\"a\"".into()));
                h.pod = Some("ns/pod\u{1}".into());
            }
        }
        let mut out = JsonOutput::new(Vec::new(), false);
        out.serde_line(&r, true).unwrap();
        let mut fast = Vec::new();
        crate::output::ok_line::write(&mut fast, &r);
        assert_eq!(
            String::from_utf8_lossy(&fast),
            String::from_utf8_lossy(&out.line)
        );
    }
}
