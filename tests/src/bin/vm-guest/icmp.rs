//! Path MTU across the NAT (issue 23) on the guest's kernel with each of
//! its backends, the way `tests/tests/icmp.rs` runs it on 6.18: seed 000's
//! routed two-node lab, the backend on the other node, both nodes'
//! underlay shrunk to 1400 bytes under the pods' 1500. An upload through
//! the Service makes node-a send the client "fragmentation needed" about
//! the DNATed request; conntrack must translate the error's quote back to
//! the Service address (nf_nat_icmp_reply_translation: on the kprobe
//! backend its own probe sees that) for the client's socket to find it.
//!
//! One nattrace run per backend, two uploads in it:
//! - a rule on node-a drops those errors: the upload stalls (the client's
//!   symptom first) → `pmtu_blackhole`, the error dropped, never reaching
//!   the client;
//! - the rule removed, the healthy twin: the same upload completes (PMTU
//!   discovery through the NAT works) → `ok`, and the recording holds the
//!   error quoting the Service, i.e. translated back.
//!
//! The black hole goes first: a client that once got the error caches the
//! smaller MTU for the Service address and would not hit it again.
use std::fs::File;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, SocketAddrV4, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use lab::presets::{self, NODE_A, NODE_B, Seed000, WEB_PORT, WEB_SERVICE_IP};
use lab::tracer::{Echo, Finished, Nattrace};
use lab::{Datapath, Lab};
use serde_json::Value;

use super::{ATTACH_TIMEOUT, Checks};

const UNDERLAY_MTU: &str = "1400";
/// Far more than one window of full-size segments.
const UPLOAD_BYTES: usize = 512 * 1024;
/// A black-holed upload stalls; this is how long the client waits on a
/// write before it calls the upload stalled (curl's -m 4 on 6.18).
const STALL: Duration = Duration::from_secs(4);
/// Only bounds a hang (TCG on a loaded host).
const EVENT_TIMEOUT: Duration = Duration::from_secs(90);
/// How long the black hole's report may take to come live (the reply
/// timeout, 1 s, and the tick that decides it) before the twin goes on.
const LIVE_REPORT: Duration = Duration::from_secs(10);

const FRAG_RULE: [&str; 7] = [
    "OUTPUT",
    "-p",
    "icmp",
    "--icmp-type",
    "fragmentation-needed",
    "-j",
    "DROP",
];

pub fn run(checks: &mut Checks, nattrace: &Path, backends: &[&str]) {
    for &backend in backends {
        let name = format!("pmtu black hole and its healthy twin {backend}");
        let t = Instant::now();
        let result =
            one(nattrace, backend).map(|ok| format!("{ok} (in {:.1}s)", t.elapsed().as_secs_f64()));
        checks.record(&name, result.map_err(|e| format!("{e:#}")));
    }
}

fn lab() -> anyhow::Result<Lab> {
    let lab = Lab::build(
        presets::seed000(Seed000 {
            bridge_nf_call_iptables: true,
            backend: presets::Backend::OtherNode,
        })
        .with_datapath(Datapath::Routed),
    )
    .context("building the lab")?;
    for node in [NODE_A, NODE_B] {
        lab.run(node, &["ip", "link", "set", "eth0", "mtu", UNDERLAY_MTU])?;
    }
    Ok(lab)
}

/// PUTs UPLOAD_BYTES to the Service from inside the client pod (on a
/// thread of its own: setns moves only that thread). Ok(the server's
/// answer), or Err when the upload stalls or fails.
fn upload(client_ns: &Path) -> anyhow::Result<String> {
    let ns = client_ns.to_path_buf();
    std::thread::spawn(move || -> anyhow::Result<String> {
        let f = File::open(&ns).with_context(|| format!("opening {}", ns.display()))?;
        nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET)?;
        let addr = SocketAddr::V4(SocketAddrV4::new(WEB_SERVICE_IP, WEB_PORT));
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10))
            .with_context(|| format!("connect {addr}"))?;
        s.set_write_timeout(Some(STALL))?;
        s.set_read_timeout(Some(STALL))?;
        s.write_all(
            format!("PUT /up HTTP/1.0\r\nHost: {addr}\r\nContent-Length: {UPLOAD_BYTES}\r\n\r\n")
                .as_bytes(),
        )?;
        s.write_all(&vec![b'u'; UPLOAD_BYTES])
            .context("the upload stalled")?;
        let mut answer = String::new();
        s.read_to_string(&mut answer)
            .context("no answer to the upload")?;
        Ok(answer)
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the upload's thread panicked"))?
}

fn one(nattrace: &Path, backend: &str) -> anyhow::Result<String> {
    let lab = lab()?;
    let node = lab.node_netns(NODE_A)?.path();
    let client = lab.netns(presets::CLIENT_POD)?.path();
    let mut add = vec!["iptables-nft", "-I"];
    add.extend(FRAG_RULE);
    lab.run(NODE_A, &add)?;
    // The client's symptom first, untraced.
    if let Ok(answer) = upload(&client) {
        bail!("the upload went through the black hole: {answer}");
    }

    let record = PathBuf::from(format!("/tmp/vm-icmp-{backend}.rec"));
    let svc = format!("{WEB_SERVICE_IP}:{WEB_PORT}");
    let args = super::recorded_trace_args(backend, &[svc], &node, &record);
    let mut t = Nattrace::spawn_echoing(nattrace, &args, super::TRACER_ENV, Echo::Stderr)?;
    let first = t.wait_started(ATTACH_TIMEOUT)?;
    if !first.contains("\"kind\":\"start\"") {
        bail!("first line: {first}");
    }
    let stalled = upload(&client);
    // The stalled connection is closed by now; its report may come live
    // (the established watch) or only at the stop. Either is fine.
    let live = t
        .wait_line(LIVE_REPORT, |l| l.contains("\"pmtu_blackhole\""))
        .is_some();
    let mut del = vec!["iptables-nft", "-D"];
    del.extend(FRAG_RULE);
    lab.run(NODE_A, &del)?;
    let healthy = upload(&client);
    t.terminate();
    let done = t.wait(EVENT_TIMEOUT)?;
    let text = std::fs::read_to_string(&record).unwrap_or_default();
    let _ = std::fs::remove_file(&record);
    if let Ok(answer) = stalled {
        bail!("the traced upload went through the black hole: {answer}");
    }
    let answer = healthy.context("the upload once the errors pass")?;
    if !answer.contains(&format!("got {UPLOAD_BYTES} bytes")) {
        bail!("the server's answer: {answer}");
    }
    judge(&done, &text)
        .map(|ok| {
            format!(
                "{ok}; reported {}",
                if live { "live" } else { "at the stop" }
            )
        })
        .map_err(|e| anyhow::anyhow!("{e}\n{}", done.describe()))
}

fn judge(done: &Finished, record: &str) -> anyhow::Result<String> {
    if done.status.code() != Some(1) {
        bail!("exit status {}, expected 1", done.status);
    }
    let flows = done.flows()?;
    // The untraced first upload's socket, closed with its data unsent,
    // lives on orphaned and retransmits into the black hole: nattrace sees
    // it without its opening (`opening_seen: false`) and names it too.
    let (holes, orphans): (Vec<&Value>, Vec<&Value>) = flows
        .iter()
        .filter(|f| f["cause"] == "pmtu_blackhole")
        .partition(|f| f["opening_seen"] != false);
    let [hole] = holes[..] else {
        bail!(
            "{} pmtu_blackhole flows opened while tracing, expected 1",
            holes.len()
        );
    };
    let e = &hole["icmp_errors"][0];
    if e["mtu"] != 1400 || e["reached_sender"] != false || e["about"] != "request" {
        bail!("the black hole's ICMP error: {e}");
    }
    let cause = hole["cause_text"].as_str().unwrap_or_default();
    if !cause.contains("1400-byte link") {
        bail!("cause text without the link's MTU: {cause}");
    }
    let ok: Vec<&Value> = flows.iter().filter(|f| f["verdict"] == "ok").collect();
    // The orphaned socket may instead be judged on its last retransmission
    // alone, seen entering the node and no further: without its opening a
    // missing reply is no evidence, so it is `unseen` (README's verdicts).
    let unseen_orphans = flows
        .iter()
        .filter(|f| f["opening_seen"] == false && f["verdict"] == "unseen")
        .count();
    let others: Vec<&Value> = flows
        .iter()
        .filter(|f| f["verdict"] != "ok" && f["cause"] != "pmtu_blackhole")
        .filter(|f| !(f["opening_seen"] == false && f["verdict"] == "unseen"))
        .collect();
    if ok.is_empty() || !others.is_empty() {
        bail!(
            "{} ok flows, flagged besides the black hole: {others:?}",
            ok.len()
        );
    }
    // The healthy upload's error, seen quoting the Service: translated back.
    let svc = WEB_SERVICE_IP.to_string();
    let translated = record
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["kind"] == "event" && v["icmp_type"] == 3 && v["icmp_code"] == 4)
        .any(|v| v["daddr"] == svc.as_str());
    if !translated {
        bail!("no fragmentation needed quoting the Service {svc} in the recording");
    }
    Ok(format!(
        "black hole named ({}; and {} orphaned socket(s) of the untraced upload), \
         the twin ok with its error translated back to {svc}",
        hole["verdict"].as_str().unwrap_or("?"),
        orphans.len() + unseen_orphans
    ))
}
