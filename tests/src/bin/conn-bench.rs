//! Short-connection load for the benchmarks and the load test: std only, so
//! its own cost is a connect, a read and a close, nothing more.
//!
//! ```text
//! conn-bench server PORT [--max-secs S]
//! conn-bench client IP PORT --count N [--secs S] [--parallel P] [--timeout-ms T]
//! ```
//!
//! The server prints `ready` once bound, then answers every connection with a
//! few bytes and closes first (so TIME_WAIT stays on the server side and the
//! client's ports come free at once). The client prints one JSON line:
//! `{"attempted":..,"ok":..,"failed":..,"secs":..,"per_sec":..}`.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

const USAGE: &str = "usage: conn-bench server PORT [--max-secs S] | \
                     conn-bench client IP PORT --count N [--secs S] [--parallel P] [--timeout-ms T]";

/// A forgotten server must not outlive a crashed bench by much.
const DEFAULT_SERVER_SECS: u64 = 900;
const REPLY: &[u8] = b"ok\n";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("server") => server(&args[1..]),
        Some("client") => client(&args[1..]),
        _ => Err(USAGE.to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("conn-bench: {e}");
            ExitCode::from(2)
        }
    }
}

fn flag<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> Result<T, String> {
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("{name} needs a value\n{USAGE}")),
    }
}

fn server(args: &[String]) -> Result<(), String> {
    let port: u16 = args
        .first()
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| USAGE.to_string())?;
    let max_secs: u64 = flag(args, "--max-secs", DEFAULT_SERVER_SECS)?;
    let listener = TcpListener::bind((Ipv4Addr::UNSPECIFIED, port))
        .map_err(|e| format!("binding tcp port {port}: {e}"))?;
    thread::spawn(move || {
        thread::sleep(Duration::from_secs(max_secs));
        std::process::exit(0);
    });
    {
        let mut out = io::stdout().lock();
        writeln!(out, "ready")
            .and_then(|()| out.flush())
            .map_err(|e| format!("writing \"ready\": {e}"))?;
    }
    // One thread: accept + write + close is microseconds, and a second core
    // is better left to the client and the tracer being measured.
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let _ = stream.set_nodelay(true);
        let _ = stream.write_all(REPLY);
    }
    Ok(())
}

struct ClientOpts {
    addr: SocketAddr,
    count: u64,
    secs: f64,
    parallel: u64,
    timeout: Duration,
}

fn client(args: &[String]) -> Result<(), String> {
    let ip: Ipv4Addr = args
        .first()
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| USAGE.to_string())?;
    let port: u16 = args
        .get(1)
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| USAGE.to_string())?;
    let opts = ClientOpts {
        addr: SocketAddr::from((ip, port)),
        count: flag(args, "--count", 0)?,
        secs: flag(args, "--secs", 10.0)?,
        parallel: flag(args, "--parallel", 1u64)?.max(1),
        timeout: Duration::from_millis(flag(args, "--timeout-ms", 1000)?),
    };
    if opts.count == 0 {
        return Err(format!("--count must be > 0\n{USAGE}"));
    }
    let (attempted, ok, elapsed) = run_client(&opts);
    let secs = elapsed.as_secs_f64();
    println!(
        "{{\"attempted\":{attempted},\"ok\":{ok},\"failed\":{},\"secs\":{secs:.6},\"per_sec\":{:.1}}}",
        attempted - ok,
        ok as f64 / secs.max(1e-9)
    );
    Ok(())
}

/// Workers take tickets from one counter, so the total never exceeds
/// `count` however the work is split, and all stop at the deadline.
fn run_client(opts: &ClientOpts) -> (u64, u64, Duration) {
    let tickets = Arc::new(AtomicU64::new(0));
    let ok = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(opts.secs);
    thread::scope(|s| {
        for _ in 0..opts.parallel {
            let (tickets, ok) = (Arc::clone(&tickets), Arc::clone(&ok));
            s.spawn(move || {
                while Instant::now() < deadline
                    && tickets.fetch_add(1, Ordering::Relaxed) < opts.count
                {
                    if one_connection(opts.addr, opts.timeout) {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    let elapsed = start.elapsed();
    // A ticket below `count` is a connection made; a worker stopping on the
    // count draws one ticket past it, one stopping on the deadline draws none.
    let attempted = tickets.load(Ordering::Relaxed).min(opts.count);
    (attempted, ok.load(Ordering::Relaxed), elapsed)
}

fn one_connection(addr: SocketAddr, timeout: Duration) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, timeout) else {
        return false;
    };
    if stream.set_read_timeout(Some(timeout)).is_err() {
        return false;
    }
    let mut buf = [0u8; 16];
    let mut got = 0;
    // Read to EOF: the connection only counts once the server's close arrived.
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return got >= REPLY.len(),
            Ok(n) => got += n,
            Err(_) => return false,
        }
    }
}
