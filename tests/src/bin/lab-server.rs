//! The servers that run inside lab pods, in one small std-only binary so the
//! lab also works in a minimal guest initramfs (busybox, no python):
//!
//! ```text
//! lab-server http PORT [--name TEXT]   answer every GET with a page naming the pod
//!                                      (GET /stream: a line every 0.3 s until the client goes)
//!                                      (GET /echo: each line sent back as "echo LINE";
//!                                      a line "reset-me" closes with RST, SO_LINGER 0,
//!                                      "close-me" closes with FIN)
//! lab-server writer IP PORT LOCALPORT   a client of GET /echo from LOCALPORT: each line
//!                                      on stdin is sent and its echo printed; "abort"
//!                                      resets, "close" closes, "write-after-close" has
//!                                      the server close, then writes; read stalls print "stalled"
//! lab-server backlog PORT N            listen with a backlog of N, TCP_DEFER_ACCEPT, and
//!                                      never accept (a stalled accept loop: the queue fills)
//! lab-server burst IP PORT FILL N      FILL connections each with its request, then N opened
//!                                      before their requests are sent; prints each one's
//!                                      fate (filled, reset, open, failed), then "done", and
//!                                      keeps them until stdin closes
//! lab-server dns PORT NAME A.B.C.D     answer A queries for NAME over UDP
//! lab-server ra IFNAME LIFETIME        send one IPv6 Router Advertisement on IFNAME
//! lab-server hold QUEUE                hold the packets an NFQUEUE rule queues to QUEUE,
//!                                      each printed as "held ACK" (its TCP ack number),
//!                                      until stdin reads "release"; then let all through
//! ```
//!
//! Both print `ready` on stdout once the socket is bound, so the lab knows the
//! pod can be reached before a test sends traffic.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::ExitCode;
use std::thread;
use std::time::Duration;

const USAGE: &str = "usage: lab-server http PORT [--name TEXT] | lab-server writer IP PORT LOCALPORT | lab-server backlog PORT N | lab-server burst IP PORT FILL N | lab-server dns PORT NAME A.B.C.D | lab-server ra IFNAME LIFETIME | lab-server hold QUEUE";

/// A client that connects and sends nothing must not pin a thread forever.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["http", port] => parse_port(port).and_then(|p| http(p, "lab-server")),
        ["http", port, "--name", name] => parse_port(port).and_then(|p| http(p, name)),
        ["writer", ip, port, local] => parse_port(port)
            .and_then(|p| parse_port(local).map(|l| (p, l)))
            .and_then(|(p, l)| writer(ip, p, l)),
        ["backlog", port, n] => parse_port(port).and_then(|p| backlog(p, parse_count(n)?)),
        ["burst", ip, port, fill, n] => {
            parse_port(port).and_then(|p| burst(ip, p, parse_count(fill)?, parse_count(n)?))
        }
        ["dns", port, name, answer] => parse_port(port).and_then(|p| {
            let ip: Ipv4Addr = answer
                .parse()
                .map_err(|_| format!("{answer:?} is not an IPv4 address"))?;
            dns(p, name, ip)
        }),
        ["ra", ifname, lifetime] => lifetime
            .parse()
            .map_err(|_| format!("{lifetime:?} is not a lifetime in seconds"))
            .and_then(|l| router_advertisement(ifname, l)),
        ["hold", queue] => parse_count(queue).and_then(hold),
        _ => Err(USAGE.to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lab-server: {e}");
            ExitCode::from(2)
        }
    }
}

fn parse_port(s: &str) -> Result<u16, String> {
    s.parse().map_err(|_| format!("{s:?} is not a port number"))
}

fn parse_count(s: &str) -> Result<u16, String> {
    s.parse().map_err(|_| format!("{s:?} is not a count"))
}

fn ready() -> Result<(), String> {
    let mut out = io::stdout().lock();
    writeln!(out, "ready")
        .and_then(|()| out.flush())
        .map_err(|e| format!("writing \"ready\": {e}"))
}

fn http(port: u16, name: &str) -> Result<(), String> {
    // std sets SO_REUSEADDR, so a restarted server rebinds despite TIME_WAIT.
    // `[::]` serves IPv4 too (net.ipv6.bindv6only is 0 in a new namespace);
    // a kernel without IPv6 gets the IPv4 socket.
    let listener = TcpListener::bind((Ipv6Addr::UNSPECIFIED, port))
        .or_else(|_| TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)))
        .map_err(|e| format!("binding tcp port {port}: {e}"))?;
    ready()?;
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let name = name.to_string();
        // Thread per connection: a stalled client (e.g. seed 000, whose
        // handshake never completes) must not block the next one.
        thread::spawn(move || {
            let _ = serve_http(stream, &name);
        });
    }
    Ok(())
}

fn serve_http(mut stream: TcpStream, name: &str) -> io::Result<()> {
    stream.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    let mut request = Vec::new();
    let mut buf = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 16 * 1024 {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        request.extend_from_slice(&buf[..n]);
    }
    let (local, peer) = (stream.local_addr()?, stream.peer_addr()?);
    // An IPv4 client of the dual-stack socket is `::ffff:a.b.c.d`: print a.b.c.d.
    let peer = SocketAddr::new(peer.ip().to_canonical(), peer.port());
    let body = format!(
        "pod={name} ip={} client={peer}\n",
        local.ip().to_canonical()
    );
    let (status, body) = if request.starts_with(b"GET ") || request.starts_with(b"HEAD ") {
        ("200 OK", body)
    } else {
        ("405 Method Not Allowed", "only GET\n".to_string())
    };
    if request.starts_with(b"GET /stream") {
        return stream_lines(stream, name);
    }
    if request.starts_with(b"GET /echo") {
        return echo_lines(stream);
    }
    if request.starts_with(b"GET /big") || request.starts_with(b"PUT ") {
        return big(stream, name, &request);
    }
    let head_only = request.starts_with(b"HEAD ");
    let mut response = format!(
        "HTTP/1.0 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    if !head_only {
        response.push_str(&body);
    }
    stream.write_all(response.as_bytes())?;
    stream.flush()
}

/// Large transfers (issue 23, path-MTU labs): `GET /big` answers 256 KiB,
/// a `PUT` reads its `Content-Length` bytes of body and answers how many
/// arrived. Either needs full-size packets all the way.
fn big(mut stream: TcpStream, name: &str, request: &[u8]) -> io::Result<()> {
    const BIG: usize = 256 * 1024;
    let text = String::from_utf8_lossy(request);
    let body = if request.starts_with(b"PUT ") {
        let want: usize = text
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse().ok())?
            })
            .unwrap_or(0);
        let head = request
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .map_or(request.len(), |p| p + 4);
        let mut got = request.len() - head;
        let mut buf = [0u8; 16 * 1024];
        while got < want {
            let n = stream.read(&mut buf)?;
            if n == 0 {
                break;
            }
            got += n;
        }
        format!("pod={name} got {got} bytes\n")
    } else {
        "x".repeat(BIG - 1) + "\n"
    };
    let response = format!(
        "HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes())?;
    stream.flush()
}

/// A long-lived connection (issue 21): one line every 0.3 s, HTTP/1.0
/// without a length, until writing fails (the client left or the
/// connection broke) or ten minutes passed.
fn stream_lines(mut stream: TcpStream, name: &str) -> io::Result<()> {
    stream
        .write_all(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n")?;
    for n in 0..2000u32 {
        stream.write_all(format!("pod={name} line {n}\n").as_bytes())?;
        stream.flush()?;
        thread::sleep(Duration::from_millis(300));
    }
    Ok(())
}

/// A long-lived connection the client writes to (issue 21): each line is
/// answered, so the client's read stalls or fails when the path breaks.
fn echo_lines(mut stream: TcpStream) -> io::Result<()> {
    stream.set_read_timeout(None)?;
    stream.write_all(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n")?;
    let mut reader = io::BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    loop {
        line.clear();
        if io::BufRead::read_line(&mut reader, &mut line)? == 0 {
            return Ok(());
        }
        if line.trim() == "reset-me" {
            // The application's own reset: close with RST|ACK.
            socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO))?;
            return Ok(());
        }
        if line.trim() == "close-me" {
            // The application ends the connection: a FIN (nothing unread).
            return Ok(());
        }
        stream.write_all(format!("echo {}\n", line.trim()).as_bytes())?;
    }
}

/// How long the writer waits for an echo before it prints `stalled`.
const ECHO_WAIT: Duration = Duration::from_secs(3);

/// The client of `echo_lines`, bound to `local` so a test knows its flow.
/// Prints `connected`, then per stdin line its echo, `stalled` (no echo in
/// ECHO_WAIT, the connection kept), `error: KIND` (and exits) or `eof`.
fn writer(ip: &str, port: u16, local: u16) -> Result<(), String> {
    use socket2::{Domain, Socket, Type};
    let ip: std::net::IpAddr = ip.parse().map_err(|e| format!("{ip}: {e}"))?;
    let to = SocketAddr::new(ip, port);
    let sock = Socket::new(Domain::for_address(to), Type::STREAM, None)
        .map_err(|e| format!("socket: {e}"))?;
    sock.set_reuse_address(true).map_err(|e| e.to_string())?;
    let any: std::net::IpAddr = if ip.is_ipv4() {
        Ipv4Addr::UNSPECIFIED.into()
    } else {
        Ipv6Addr::UNSPECIFIED.into()
    };
    sock.bind(&SocketAddr::new(any, local).into())
        .map_err(|e| format!("binding port {local}: {e}"))?;
    sock.connect_timeout(&to.into(), Duration::from_secs(10))
        .map_err(|e| format!("connecting to {to}: {e}"))?;
    let mut stream: TcpStream = sock.into();
    stream
        .write_all(b"GET /echo HTTP/1.0\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut reader = io::BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
    let mut line = String::new();
    // The response head, up to its blank line.
    loop {
        line.clear();
        let n = io::BufRead::read_line(&mut reader, &mut line).map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("the server closed before its response".into());
        }
        if line.trim().is_empty() {
            break;
        }
    }
    stream
        .set_read_timeout(Some(ECHO_WAIT))
        .map_err(|e| e.to_string())?;
    say("connected");
    let mut cmd = String::new();
    loop {
        cmd.clear();
        if io::stdin().read_line(&mut cmd).map_err(|e| e.to_string())? == 0 {
            return Ok(());
        }
        match cmd.trim() {
            "abort" => {
                let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
                drop(reader);
                drop(stream);
                say("aborted");
                return Ok(());
            }
            "write-after-close" => {
                // The keep-alive race: the server closes (close-me), the
                // client reads its FIN and writes once more; the server's
                // kernel resets that data, which the next write reports.
                let _ = stream.write_all(b"close-me\n");
                let mut rest = Vec::new();
                let _ = io::Read::read_to_end(&mut reader, &mut rest);
                if let Err(e) = stream.write_all(b"late\n") {
                    say(&format!("error: {:?}", e.kind()));
                    return Ok(());
                }
                // Until the RST is in (SO_ERROR), bounded by ECHO_WAIT.
                let until = std::time::Instant::now() + ECHO_WAIT;
                while std::time::Instant::now() < until {
                    if let Ok(Some(e)) = stream.take_error() {
                        say(&format!("error: {:?}", e.kind()));
                        return Ok(());
                    }
                    thread::sleep(Duration::from_millis(5));
                }
                say("no reset");
                return Ok(());
            }
            "close" => {
                let _ = stream.shutdown(std::net::Shutdown::Write);
                let mut rest = Vec::new();
                let _ = io::Read::read_to_end(&mut reader, &mut rest);
                say("closed");
                return Ok(());
            }
            text => {
                // "A then B": B written 5 ms after A, as its own segment.
                for (i, part) in text.split(" then ").enumerate() {
                    if i > 0 {
                        thread::sleep(Duration::from_millis(5));
                    }
                    if let Err(e) = stream.write_all(format!("{part}\n").as_bytes()) {
                        say(&format!("error: {:?}", e.kind()));
                        return Ok(());
                    }
                }
                line.clear();
                match io::BufRead::read_line(&mut reader, &mut line) {
                    Ok(0) => {
                        say("eof");
                        return Ok(());
                    }
                    Ok(_) => say(line.trim()),
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                        ) =>
                    {
                        say("stalled")
                    }
                    Err(e) => {
                        say(&format!("error: {:?}", e.kind()));
                        return Ok(());
                    }
                }
            }
        }
    }
}

/// A listener whose application never accepts, with TCP_DEFER_ACCEPT (as
/// nginx's `listen … deferred`): a connection takes its place in the
/// accept queue when its first data arrives, not at the handshake's ACK,
/// and stays there, as behind a stalled accept loop, until it is full.
fn backlog(port: u16, n: u16) -> Result<(), String> {
    use std::os::fd::AsRawFd as _;
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
        .map_err(|e| format!("socket: {e}"))?;
    sock.set_reuse_address(true).map_err(|e| e.to_string())?;
    let secs: libc::c_int = 30;
    // SAFETY: a valid socket and an int option of the size given.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_DEFER_ACCEPT,
            (&raw const secs).cast(),
            std::mem::size_of_val(&secs) as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(format!("TCP_DEFER_ACCEPT: {}", io::Error::last_os_error()));
    }
    sock.bind(&SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)).into())
        .map_err(|e| format!("binding tcp port {port}: {e}"))?;
    sock.listen(i32::from(n))
        .map_err(|e| format!("listen: {e}"))?;
    ready()?;
    loop {
        thread::sleep(Duration::from_secs(3600));
    }
}

/// How long an opened connection of `burst` is read before it counts as
/// `open`: the listener resets a request as it arrives.
const RESET_WAIT: Duration = Duration::from_secs(1);

/// A request on each connection, as a client sends it right after connect().
const BURST_REQUEST: &[u8] = b"GET / HTTP/1.0\r\n\r\n";

/// `fill` connections, each opened and its request sent (each takes a
/// place in a never-accepting listener's queue), then `n` opened one after
/// another and only then their requests sent: each prints `filled PORT`,
/// then `reset PORT` (opened, its read failed with ECONNRESET), `open
/// PORT` (nothing within RESET_WAIT) or `failed PORT ERROR`; then `done`.
/// The connections are kept until stdin closes.
fn burst(ip: &str, port: u16, fill: u16, n: u16) -> Result<(), String> {
    let ip: Ipv4Addr = ip.parse().map_err(|e| format!("{ip}: {e}"))?;
    let to = SocketAddr::from((ip, port));
    let open = || {
        TcpStream::connect_timeout(&to, RESET_WAIT * 5)
            .map_err(|e| format!("connecting to {to}: {e}"))
    };
    let local = |s: &TcpStream| s.local_addr().map_or(0, |a| a.port());
    let mut kept = Vec::new();
    for _ in 0..fill {
        let mut s = open()?;
        s.write_all(BURST_REQUEST).map_err(|e| e.to_string())?;
        say(&format!("filled {}", local(&s)));
        kept.push(s);
    }
    let mut burst = Vec::new();
    for _ in 0..n {
        burst.push(open()?);
    }
    for s in &mut burst {
        // A reset of an earlier one does not stop the next request.
        let _ = s.write_all(BURST_REQUEST);
    }
    for mut s in burst {
        let port = local(&s);
        s.set_read_timeout(Some(RESET_WAIT))
            .map_err(|e| e.to_string())?;
        let mut byte = [0u8];
        match s.read(&mut byte) {
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => say(&format!("reset {port}")),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                say(&format!("open {port}"))
            }
            Err(e) => say(&format!("failed {port} {e}")),
            Ok(0) => say(&format!("failed {port} closed by the server")),
            Ok(_) => say(&format!("open {port}")),
        }
        kept.push(s);
    }
    say("done");
    let _ = io::stdin().read_to_end(&mut Vec::new());
    drop(kept);
    Ok(())
}

/// A network's delay, made to order: packets queued to `queue` wait in
/// the kernel (nfnetlink_queue holds a queued packet until its verdict;
/// nothing is dropped, so no drop is traced) until the test says
/// `release`, as a segment held up in a busy network or a busy node. Each
/// is printed with its TCP ack number, so a test can tell a repeated
/// segment (a retransmission's answer) from a new one.
fn hold(queue: u16) -> Result<(), String> {
    use std::sync::mpsc::TryRecvError;
    let mut q = nfq::Queue::open().map_err(|e| format!("nfqueue: {e}"))?;
    q.bind(queue)
        .map_err(|e| format!("binding queue {queue}: {e}"))?;
    q.set_nonblocking(true);
    let (tx, commands) = std::sync::mpsc::channel();
    thread::spawn(move || {
        for line in io::stdin().lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    ready()?;
    let mut held: Vec<nfq::Message> = Vec::new();
    let mut released = false;
    loop {
        let stdin_closed = match commands.try_recv() {
            Ok(line) => {
                released |= line.trim() == "release";
                false
            }
            Err(TryRecvError::Empty) => false,
            Err(TryRecvError::Disconnected) => true,
        };
        if released || stdin_closed {
            for mut m in held.drain(..) {
                m.set_verdict(nfq::Verdict::Accept);
                q.verdict(m).map_err(|e| format!("verdict: {e}"))?;
            }
        }
        if stdin_closed {
            return Ok(());
        }
        match q.recv() {
            Ok(mut m) if released => {
                m.set_verdict(nfq::Verdict::Accept);
                q.verdict(m).map_err(|e| format!("verdict: {e}"))?;
            }
            Ok(m) => {
                say(&format!("held {}", tcp_ack(m.get_payload())));
                held.push(m);
            }
            // Nothing queued: the next look at stdin, a moment later.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(2))
            }
            Err(e) => return Err(format!("nfqueue: {e}")),
        }
    }
}

/// The TCP ack number of an IPv4 packet (0 if it is none).
fn tcp_ack(ip: &[u8]) -> u32 {
    let ihl = usize::from(ip.first().copied().unwrap_or(0) & 0x0f) * 4;
    ip.get(ihl + 8..ihl + 12)
        .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
        .unwrap_or(0)
}

fn say(line: &str) {
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn dns(port: u16, name: &str, answer: Ipv4Addr) -> Result<(), String> {
    let sock = UdpSocket::bind((Ipv6Addr::UNSPECIFIED, port))
        .or_else(|_| UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port)))
        .map_err(|e| format!("binding udp port {port}: {e}"))?;
    ready()?;
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    let mut buf = [0u8; 4096];
    loop {
        let Ok((n, peer)) = sock.recv_from(&mut buf) else {
            continue;
        };
        if let Some(reply) = dns_reply(&buf[..n], &name, answer) {
            let _ = sock.send_to(&reply, peer);
        }
    }
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

/// The reply to one query: an A record for `name`, NOERROR without answers
/// for other types of `name`, NXDOMAIN for anything else; `None` for what is
/// not a single-question query (never answer a reply: no loops).
fn dns_reply(query: &[u8], name: &str, answer: Ipv4Addr) -> Option<Vec<u8>> {
    if query.len() < 12 {
        return None;
    }
    let (id, flags, qdcount) = (be16(query, 0), be16(query, 2), be16(query, 4));
    if flags & 0x8000 != 0 || qdcount != 1 {
        return None;
    }
    let mut i = 12;
    let mut labels = Vec::new();
    loop {
        let len = *query.get(i)? as usize;
        i += 1;
        if len == 0 {
            break;
        }
        // Compression pointers never appear in a question we care about.
        if len & 0xc0 != 0 {
            return None;
        }
        labels.push(String::from_utf8_lossy(query.get(i..i + len)?).to_ascii_lowercase());
        i += len;
    }
    let qtype = be16(query.get(i..i + 4)?, 0);
    let question = &query[12..i + 4];
    let matches = labels.join(".") == name;
    let with_answer = matches && qtype == 1;
    let rcode = if matches { 0 } else { 3 };
    // QR, AA, RA; RD copied from the query.
    let out_flags: u16 = 0x8000 | 0x0400 | 0x0080 | (flags & 0x0100) | rcode;
    let mut reply = Vec::with_capacity(12 + question.len() + 16);
    for word in [id, out_flags, 1, u16::from(with_answer), 0, 0] {
        reply.extend_from_slice(&word.to_be_bytes());
    }
    reply.extend_from_slice(question);
    if with_answer {
        // Name: pointer to the question's name at offset 12; type A, class IN, TTL 30.
        reply.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 30, 0, 4]);
        reply.extend_from_slice(&answer.octets());
    }
    Some(reply)
}

/// Sends one Router Advertisement (RFC 4861 4.2: default router for
/// `lifetime` seconds, no options) to all nodes on `ifname`, as a router's
/// radvd would. A raw ICMPv6 socket: the kernel fills in the checksum, and
/// the hop limit must be 255 or receivers drop it (net/ipv6/ndisc.c `ndisc_rcv`).
fn router_advertisement(ifname: &str, lifetime: u16) -> Result<(), String> {
    let err = |what: &str| format!("{what}: {}", io::Error::last_os_error());
    let name = std::ffi::CString::new(ifname).map_err(|_| "bad interface name".to_string())?;
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if ifindex == 0 {
        return Err(err(ifname));
    }
    let fd = unsafe { libc::socket(libc::AF_INET6, libc::SOCK_RAW, libc::IPPROTO_ICMPV6) };
    if fd < 0 {
        return Err(err("raw ICMPv6 socket"));
    }
    let set = |opt: libc::c_int, value: libc::c_int| unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_IPV6,
            opt,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if set(libc::IPV6_MULTICAST_HOPS, 255) != 0 || set(libc::IPV6_MULTICAST_IF, ifindex as i32) != 0
    {
        unsafe { libc::close(fd) };
        return Err(err("setsockopt"));
    }
    // type 134, code 0, checksum, cur hop limit 64, flags 0, router
    // lifetime, reachable time 0, retrans timer 0.
    let mut ra = [0u8; 16];
    ra[0] = 134;
    ra[4] = 64;
    ra[6..8].copy_from_slice(&lifetime.to_be_bytes());
    let mut to: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    to.sin6_family = libc::AF_INET6 as libc::sa_family_t;
    to.sin6_addr.s6_addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1).octets();
    to.sin6_scope_id = ifindex;
    let sent = unsafe {
        libc::sendto(
            fd,
            ra.as_ptr().cast(),
            ra.len(),
            0,
            (&to as *const libc::sockaddr_in6).cast(),
            std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
        )
    };
    let result = if sent == ra.len() as isize {
        Ok(())
    } else {
        Err(err("sending the RA"))
    };
    unsafe { libc::close(fd) };
    result
}
