//! `nattrace`: the command line. Parsing and validation only; the work is in the library.
use std::{io::IsTerminal as _, process::ExitCode, time::Duration};

use clap::{Parser, ValueEnum};
use nattrace::{
    service::Service,
    session::{self, OutputFormat, SessionOptions},
};

#[derive(Parser, Debug)]
#[command(
    name = "nattrace",
    version,
    about = "Follow connections to a Kubernetes Service through this node's kernel (tc, netfilter NAT, bridge) and say, per flow, whether the reply came back correctly, un-reverse-NATed, not at all, or was dropped — and why."
)]
struct Cli {
    /// Service cluster IP to trace, optionally with a port (repeatable). No port = all ports, TCP and UDP.
    #[arg(long = "svc", value_name = "IP[:PORT]", required = true)]
    services: Vec<Service>,

    /// Network namespace of the node to trace: a name under /run/netns or a path (default: the current one).
    #[arg(long, value_name = "NAME|PATH")]
    netns: Option<String>,

    /// Stop after this many seconds (default: until Ctrl-C or SIGTERM).
    #[arg(long, value_name = "SECS", value_parser = parse_duration_secs)]
    duration: Option<Duration>,

    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    output: Format,

    /// A request that got no reply through this node within this many milliseconds is `no_reply`.
    #[arg(long, value_name = "MS", default_value_t = 3000, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    reply_timeout: u64,

    /// Show every packet of each flow with every point it passed.
    #[arg(short, long)]
    verbose: bool,

    /// Colour in text output.
    #[arg(long, value_enum, default_value_t = Color::Auto)]
    color: Color,

    /// Kernel ring-buffer size in KiB (a power of two, at least 4 KiB page).
    #[arg(long, value_name = "KIB", default_value_t = 4096, value_parser = parse_ringbuf_kib)]
    ringbuf_kib: u32,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Format {
    Text,
    Json,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Color {
    Auto,
    Always,
    Never,
}

fn parse_duration_secs(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|_| format!("'{s}' is not a number of seconds (e.g. --duration 30)"))?;
    if !(secs > 0.0 && secs <= 7.0 * 24.0 * 3600.0) {
        return Err(format!("'{s}' must be between 0 and one week"));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn parse_ringbuf_kib(s: &str) -> Result<u32, String> {
    let kib: u32 = s
        .parse()
        .map_err(|_| format!("'{s}' is not a size in KiB"))?;
    if kib < 4 || !kib.is_power_of_two() || kib > 1 << 20 {
        return Err(format!(
            "'{s}' must be a power of two between 4 and 1048576 KiB"
        ));
    }
    Ok(kib)
}

/// Clap's own error report is several lines; an on-call engineer gets one.
fn usage_error(err: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        err.kind(),
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion
    ) {
        let _ = err.print();
        return ExitCode::SUCCESS;
    }
    let rendered = err.render().to_string();
    let first = rendered
        .lines()
        .next()
        .unwrap_or("invalid arguments")
        .trim_start_matches("error: ");
    eprintln!("nattrace: {first} (see nattrace --help)");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => return usage_error(err),
    };
    let color = match cli.color {
        Color::Always => true,
        Color::Never => false,
        Color::Auto => std::io::stdout().is_terminal(),
    };
    let options = SessionOptions {
        services: cli.services,
        netns: cli.netns,
        duration: cli.duration,
        reply_timeout: Duration::from_millis(cli.reply_timeout),
        format: match cli.output {
            Format::Text => OutputFormat::Text,
            Format::Json => OutputFormat::Json,
        },
        verbose: cli.verbose,
        color,
        ringbuf_bytes: cli.ringbuf_kib * 1024,
    };
    match session::run(options) {
        Ok(outcome) => ExitCode::from(outcome.exit_status()),
        Err(err) => {
            eprintln!("nattrace: {err}");
            ExitCode::from(2)
        }
    }
}
