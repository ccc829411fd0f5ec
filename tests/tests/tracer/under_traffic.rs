//! Started while a SYN stream already runs to the Service (issue 26 item
//! 5): flows that began before tracing, or while the programs were still
//! attaching, are never `no_reply` on absent evidence. The lab is healthy
//! (every SYN gets its SYN-ACK, which the sender's kernel answers with an
//! RST, as hping3 -S makes it), so any `no_reply` is a false one.

use std::time::{Duration, Instant};

use lab::presets::{self, CLIENT_IP, CLIENT_POD, NODE_A, WEB_PORT, WEB_SERVICE_IP};

use lab::presets::web_svc;

use super::{args, build_lab, flows, start, tracing_lock};

/// SYNs from a raw socket (no socket of the sender's own: its kernel
/// answers the SYN-ACK with an RST), about 2000 a second, new port each.
const SYN_STREAM: &str = r#"
import socket, struct, sys, time
src, dst, dport = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
S, D = socket.inet_aton(src), socket.inet_aton(dst)
def csum(b):
    t = sum(struct.unpack('!%dH' % (len(b) // 2), b))
    t = (t >> 16) + (t & 0xffff)
    t += t >> 16
    return ~t & 0xffff
n = 0
while True:
    port = 20000 + n % 40000
    h = struct.pack('!HHIIBBHHH', port, dport, n * 7919, 0, 5 << 4, 2, 64240, 0, 0)
    c = csum(S + D + struct.pack('!BBH', 0, 6, len(h)) + h)
    s.sendto(h[:16] + struct.pack('!H', c) + h[18:], (dst, 0))
    n += 1
    if n % 20 == 0:
        time.sleep(0.01)
"#;

#[test]
fn root_started_under_a_syn_stream_no_flow_is_a_false_no_reply() {
    require_root!();
    let lab = build_lab(presets::seed000(presets::Seed000::default()));
    let _lock = tracing_lock();
    lab.spawn(
        CLIENT_POD,
        &[
            "python3",
            "-c",
            SYN_STREAM,
            &CLIENT_IP.to_string(),
            &WEB_SERVICE_IP.to_string(),
            &WEB_PORT.to_string(),
        ],
    )
    .expect("SYN stream");
    // Running: its connections are in the node's conntrack table.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !lab
        .conntrack(NODE_A)
        .is_ok_and(|t| t.contains(&format!("src={CLIENT_IP}")))
    {
        assert!(
            Instant::now() < deadline,
            "the SYN stream never reached the node"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut t = start(
        &args(
            &lab,
            &[web_svc()],
            &["--duration", "3", "--reply-timeout", "1000"],
        ),
        &[],
    );
    let done = t
        .wait(super::ATTACH_TIMEOUT)
        .unwrap_or_else(|e| panic!("{e:#}"));
    let flows = flows(&done);
    assert!(
        flows.len() > 100,
        "{} flows: {}",
        flows.len(),
        done.describe()
    );
    let false_no_reply: Vec<_> = flows
        .iter()
        .filter(|f| f["verdict"] == "no_reply")
        .collect();
    let unseen = flows.iter().filter(|f| f["opening_seen"] == false).count();
    assert!(
        false_no_reply.is_empty(),
        "{} of {} flows no_reply in a healthy lab ({unseen} with the opening unseen); first: {}",
        false_no_reply.len(),
        flows.len(),
        false_no_reply[0]
    );
    // The unseen ones are marked, those the stop cut (sent within the
    // reply timeout of the end, no SYN-ACK yet) are undecided, and the rest
    // are judged as usual.
    let reply_timeout_ns = 1_000_000_000u64;
    for f in &flows {
        if f["verdict"] == "undecided" {
            let (first, decided) = (f["first_ts_ns"].as_u64(), f["decided_ts_ns"].as_u64());
            assert!(
                matches!((first, decided), (Some(a), Some(b)) if b - a < reply_timeout_ns),
                "undecided, yet sent more than the reply timeout before the stop: {f}"
            );
        } else if f["opening_seen"] == false {
            assert!(f["verdict"] == "unseen" || f["verdict"] == "ok", "{f}");
        } else {
            assert_eq!(f["verdict"], "ok", "{f}");
        }
    }
    // Nothing failed: unseen and undecided flows are no failure.
    assert_eq!(done.status.code(), Some(0), "{}", done.describe());
}
