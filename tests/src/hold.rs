//! A network's delay, made to order: `lab-server hold` in a pod holds the
//! pure ACKs an NFQUEUE rule queues to it until the test releases them.
//! The close's last ACK held this way comes twice (the retransmitted FIN
//! answered again from TIME_WAIT) and reaches a socket the first one freed,
//! as it does on a loaded node (tests/tests/established_more.rs,
//! vm-guest's established checks).
use std::io::Write as _;
use std::net::Ipv4Addr;
use std::process::{Child, ChildStdin, Stdio};
use std::sync::mpsc::Receiver;
use std::time::Duration;

use anyhow::{Context as _, bail};

use crate::{Lab, lab_server_path};

/// The NFQUEUE number `lab-server hold` binds in a pod.
const QUEUE: &str = "7";

/// `Tcp: OutRsts` of `pod`'s namespace (/proc/net/snmp read from inside it).
pub fn out_rsts(lab: &Lab, pod: &str) -> anyhow::Result<u64> {
    let snmp = lab.run(pod, &["cat", "/proc/net/snmp"])?;
    let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
    let (names, values) = (tcp.next().unwrap_or(""), tcp.next().unwrap_or(""));
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(n, _)| *n == "OutRsts")
        .and_then(|(_, v)| v.parse().ok())
        .context("Tcp: OutRsts in /proc/net/snmp")
}

/// Waits until `pod` has sent a reset since it had sent `before` (its
/// kernel's answer to a late segment).
pub fn wait_reset(lab: &Lab, pod: &str, before: u64, timeout: Duration) -> anyhow::Result<()> {
    crate::wait::until(format!("a reset from {pod}"), timeout, || {
        out_rsts(lab, pod).is_ok_and(|n| n > before).then_some(())
    })
}

/// `lab-server hold` in a pod, holding the pure ACKs it gets from `src`
/// port `sport` to port `dport` (an NFQUEUE rule, removed with the pod's
/// namespace). Held at PREROUTING, as if late on the wire: after it, at
/// INPUT, a packet keeps the socket early demux found for it
/// (net/ipv4/ip_input.c `ip_rcv_finish_core`), and TCP uses that socket
/// though it closed meanwhile (net/ipv4/tcp_ipv4.c `tcp_v4_rcv` →
/// `skb_steal_sock`): the late ACK met it in TCP_CLOSE, not NO_SOCKET.
pub struct Hold {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    /// The ack numbers held so far.
    pub acks: Vec<String>,
}

impl Hold {
    pub fn start(
        lab: &Lab,
        pod: &str,
        src: Ipv4Addr,
        sport: u16,
        dport: u16,
    ) -> anyhow::Result<Hold> {
        let server = lab_server_path()?;
        let mut cmd = lab.netns(pod)?.command(&server.to_string_lossy())?;
        cmd.args(["hold", QUEUE])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().context("starting lab-server hold")?;
        let stdin = child.stdin.take().context("piped stdin")?;
        let lines = crate::wait::lines(child.stdout.take().context("piped stdout")?);
        let mut h = Hold {
            child,
            stdin,
            lines,
            acks: Vec::new(),
        };
        let first = h.next(Duration::from_secs(30))?;
        if first != "ready" {
            bail!("lab-server hold: {first}");
        }
        let rule = format!(
            "iptables -t raw -I PREROUTING -p tcp -s {src} --sport {sport} --dport {dport} \
             --tcp-flags ALL ACK -j NFQUEUE --queue-num {QUEUE}"
        );
        let args: Vec<&str> = rule.split_whitespace().collect();
        lab.run(pod, &args).context("the pod's NFQUEUE rule")?;
        Ok(h)
    }

    fn next(&mut self, timeout: Duration) -> anyhow::Result<String> {
        self.lines
            .recv_timeout(timeout)
            .with_context(|| format!("nothing from lab-server hold in {timeout:?}"))
    }

    /// Waits until two held ACKs acknowledge the same byte: the answer to
    /// a retransmission held behind the first.
    pub fn wait_repeated(&mut self, timeout: Duration) -> anyhow::Result<()> {
        while !(1..self.acks.len()).any(|i| self.acks[i..].contains(&self.acks[i - 1])) {
            let line = self.next(timeout)?;
            let Some(ack) = line.strip_prefix("held ") else {
                bail!("lab-server hold: {line}");
            };
            self.acks.push(ack.to_string());
        }
        Ok(())
    }

    /// Lets the held packets through, and every later one.
    pub fn release(&mut self) -> anyhow::Result<()> {
        writeln!(self.stdin, "release")?;
        self.stdin.flush()?;
        Ok(())
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
