//! The metrics endpoint: a few lines of HTTP/1.1 on the session's tokio
//! runtime (GET /metrics, one response per connection), so a scrape costs
//! no framework and never touches the event loop's work beyond encoding.
use std::{sync::Arc, time::Duration};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
};

use super::metrics::Metrics;

/// A request head larger than this is not a scraper's.
const MAX_HEAD: usize = 8 * 1024;
/// A client that neither sends its request nor reads the answer in this
/// long is dropped (a scrape of a few KiB takes milliseconds).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// A scraper sends its request at once: an idle connection gives its slot
/// back after this long.
const HEAD_TIMEOUT: Duration = Duration::from_secs(2);
/// Connections answered at once; one more is accepted and closed at once.
/// Each costs an fd, and the tracer's own (rtnetlink for new interfaces,
/// netns, ring buffer, outputs) must never run short because of idle
/// clients (under `--nofile=256`, 400 of them took them all). A node has a
/// scraper or two.
pub const MAX_CLIENTS: usize = 16;

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The Prometheus text format (0.0.4) of an OpenMetrics exposition, for
/// clients that do not ask for OpenMetrics (`curl`, `promtool check
/// metrics`, older scrapers): a counter's family is named with its
/// `_total` suffix there, and there is no `# EOF`. prometheus-client only
/// writes OpenMetrics.
fn prometheus_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{prefix}{name}_total {tail}"))
        });
        match renamed {
            Some(l) => out.push_str(&l),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CLIENTS));
    loop {
        let sock = match listener.accept().await {
            Ok((sock, _)) => sock,
            Err(e) => {
                // EMFILE and the like: wait instead of spinning.
                log::warn!("metrics endpoint: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        // Accepted and closed rather than left in the backlog: the
        // backlog would hold a later scraper behind idle clients.
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            log::debug!("metrics endpoint: {MAX_CLIENTS} clients already, closing one more");
            drop(sock);
            continue;
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            if let Ok(Err(e)) = tokio::time::timeout(CLIENT_TIMEOUT, answer(sock, &metrics)).await {
                log::debug!("metrics endpoint: {e}");
            }
            drop(slot);
        });
    }
}

/// The method and path of a request head, once it is complete.
fn request_line(head: &[u8]) -> Option<(&str, &str)> {
    let text = std::str::from_utf8(head).ok()?;
    let line = text.lines().next()?;
    let mut parts = line.split(' ');
    let (method, target) = (parts.next()?, parts.next()?);
    Some((method, target.split('?').next().unwrap_or(target)))
}

/// Whether the request's Accept header asks for OpenMetrics (Prometheus
/// itself does).
fn wants_openmetrics(head: &[u8]) -> bool {
    String::from_utf8_lossy(head).lines().any(|l| {
        l.split_once(':').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("accept") && v.contains("application/openmetrics-text")
        })
    })
}

fn response(
    method: &str,
    path: &str,
    openmetrics: bool,
    metrics: &Metrics,
) -> (&'static str, &'static str, String) {
    match (method, path) {
        ("GET" | "HEAD", "/metrics") if openmetrics => ("200 OK", OPENMETRICS, metrics.encode()),
        ("GET" | "HEAD", "/metrics") => (
            "200 OK",
            PROMETHEUS_TEXT,
            prometheus_text(&metrics.encode()),
        ),
        ("GET" | "HEAD", "/") => (
            "200 OK",
            "text/plain; charset=utf-8",
            "nattrace: metrics at /metrics\n".to_owned(),
        ),
        ("GET" | "HEAD", _) => (
            "404 Not Found",
            "text/plain; charset=utf-8",
            "not found: metrics are at /metrics\n".to_owned(),
        ),
        _ => (
            "405 Method Not Allowed",
            "text/plain; charset=utf-8",
            "only GET\n".to_owned(),
        ),
    }
}

async fn answer(mut sock: TcpStream, metrics: &Metrics) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let Ok(n) = tokio::time::timeout(HEAD_TIMEOUT, sock.read(&mut buf)).await else {
            return Ok(());
        };
        let n = n?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > MAX_HEAD {
            let _ = sock
                .write_all(b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
                .await;
            return Ok(());
        }
    }
    let Some((method, path)) = request_line(&head) else {
        sock.write_all(
            b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
        )
        .await?;
        return Ok(());
    };
    let (status, content_type, body) = response(method, path, wants_openmetrics(&head), metrics);
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if method != "HEAD" {
        out.extend_from_slice(body.as_bytes());
    }
    sock.write_all(&out).await?;
    sock.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        let m = Metrics::new("netfilter");
        assert_eq!(
            request_line(b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n"),
            Some(("GET", "/metrics"))
        );
        assert_eq!(response("GET", "/metrics", false, &m).0, "200 OK");
        assert_eq!(response("GET", "/nope", false, &m).0, "404 Not Found");
        assert_eq!(
            response("POST", "/metrics", false, &m).0,
            "405 Method Not Allowed"
        );
        assert!(wants_openmetrics(
            b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5\r\n\r\n"
        ));
        assert!(!wants_openmetrics(
            b"GET /metrics HTTP/1.1\r\nAccept: */*\r\n\r\n"
        ));
    }

    #[test]
    fn counters_are_named_with_total_in_the_prometheus_text_format() {
        let om = "# HELP x_flows Flows.\n# TYPE x_flows counter\nx_flows_total{a=\"b\"} 1\n# HELP x_live Live.\n# TYPE x_live gauge\nx_live 2\n# EOF\n";
        assert_eq!(
            prometheus_text(om),
            "# HELP x_flows_total Flows.\n# TYPE x_flows_total counter\nx_flows_total{a=\"b\"} 1\n# HELP x_live Live.\n# TYPE x_live gauge\nx_live 2\n"
        );
        assert_eq!(request_line(b"\xff\xfe\r\n\r\n"), None);
    }
}
