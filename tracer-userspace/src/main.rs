//! `nattrace`: the command line. Parsing and validation only; the work is in the library.
use std::{io::IsTerminal as _, path::PathBuf, process::ExitCode, time::Duration};

use clap::{Parser, ValueEnum};
use nattrace::{
    analyze::{self, AnalyzeOptions},
    output::text::TextStyle,
    probes::table::BackendChoice,
    service_lookup::SvcArg,
    session::{self, OutputFormat, SessionOptions},
};

#[derive(Parser, Debug)]
#[command(
    name = "nattrace",
    version,
    subcommand_negates_reqs = true,
    args_conflicts_with_subcommands = true,
    group = clap::ArgGroup::new("traced").required(true).multiple(true).args(["services", "all_services"]),
    about = "Follow connections to a Kubernetes Service through this node's kernel (tc, netfilter NAT, bridge) and say, per flow, whether the reply came back correctly, un-reverse-NATed, not at all, or was dropped — and why."
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,

    /// Service to trace (repeatable): NAMESPACE/NAME[:PORT] (port by name or number; every address of the Service as kube-proxy's rules on this node give them: ClusterIPs, NodePorts, LoadBalancer and external IPs), or an address IP[:PORT] (a ClusterIP, NODEIP:NODEPORT, an LB IP). No port = all ports, TCP and UDP.
    #[arg(long = "svc", value_name = "NS/NAME[:PORT]|IP[:PORT]", value_parser = parse_service)]
    services: Vec<SvcArg>,

    /// Trace every Service in kube-proxy's rules (iptables or nftables mode), following Services added and removed while running.
    #[arg(long)]
    all_services: bool,

    /// With --all-services, re-read kube-proxy's rules this often (seconds).
    #[arg(long, value_name = "SECS", default_value = "5", value_parser = parse_interval_secs, requires = "all_services")]
    rules_interval: Duration,

    /// Serve Prometheus metrics on ADDR:PORT at /metrics (e.g. 0.0.0.0:9464).
    #[arg(long, value_name = "ADDR:PORT")]
    metrics_addr: Option<std::net::SocketAddr>,

    /// At most this many flows are held; past it the oldest is evicted (and counted).
    #[arg(long, value_name = "N", default_value_t = nattrace::continuous::DEFAULT_MAX_FLOWS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=10_000_000))]
    max_flows: usize,

    /// Network namespace of the node to trace: a name under /run/netns or a path (default: the current one).
    #[arg(long, value_name = "NAME|PATH", value_parser = parse_netns)]
    netns: Option<String>,

    /// Stop after this many seconds (default: until Ctrl-C or SIGTERM).
    #[arg(long, value_name = "SECS", value_parser = parse_duration_secs, allow_negative_numbers = true)]
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

    /// Colour in text output (auto: on a terminal, unless NO_COLOR is set).
    #[arg(long, value_enum, default_value_t = Color::Auto)]
    color: Color,

    /// Text output: each flow on one line instead of a headline and indented lines.
    #[arg(long)]
    wide: bool,

    /// Print no line for an `ok` flow (it is still counted: summary, metrics, exit status).
    #[arg(long)]
    hide_ok: bool,

    /// Kernel ring-buffer size in KiB (a power of two, at least 4 KiB page).
    #[arg(long, value_name = "KIB", default_value_t = 4096, value_parser = parse_ringbuf_kib)]
    ringbuf_kib: u32,

    /// How to watch netfilter: BPF netfilter links (kernel >= 6.4) or kprobes; auto picks the first the kernel supports.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,

    /// Record every event (and what is needed to re-decide the flows) to FILE, for `nattrace analyze`.
    #[arg(long, value_name = "FILE", value_parser = parse_out_path)]
    write: Option<PathBuf>,

    /// Once the --write file reaches this many MiB: stop recording (keep tracing), or rotate with --write-keep.
    #[arg(long, value_name = "MB", default_value = "1024", value_parser = parse_mib)]
    write_max_mb: u64,

    /// Rotate the --write file at --write-max-mb, keeping N files in all (FILE, FILE.1, ... FILE.(N-1)).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1000), requires = "write")]
    write_keep: usize,

    /// Write every packet of each decided flow at every point it passed to FILE as pcapng (for Wireshark).
    #[arg(long, value_name = "FILE", value_parser = parse_out_path)]
    pcap: Option<PathBuf>,

    /// No "waiting for connections" line, live status line or periodic progress lines on stderr.
    #[arg(short, long)]
    quiet: bool,

    /// This node's name in the --write recording (default: the --netns name, else the hostname); `analyze` of several nodes' recordings labels each hop with it.
    #[arg(long, value_name = "NAME", value_parser = parse_node_name)]
    node_name: Option<String>,

    /// The node's root filesystem, where kubelet's pod directories (var/log/pods) name the pods of clients and backends (default: /, else /host when only that has them, as in `kubectl debug node`).
    #[arg(long, value_name = "DIR", value_parser = parse_host_root)]
    host_root: Option<PathBuf>,

    /// The container runtime's CRI socket, asked first for the pods' names (default: run/containerd/containerd.sock, else var/run/crio/crio.sock, under the host root).
    #[arg(long, value_name = "PATH", value_parser = parse_cri_socket)]
    cri_socket: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum BackendArg {
    Auto,
    Netfilter,
    Kprobe,
}

#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Check the node's static facts behind broken Service traffic (read-only); exit 1 if any breaks it.
    Doctor {
        /// Network namespace of the node: a name under /run/netns or a path (default: the current one).
        #[arg(long, value_name = "NAME|PATH", value_parser = parse_netns)]
        netns: Option<String>,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        output: Format,
    },
    /// Re-decide the flows of a recording made with --write, with the same output as the live run; given several nodes' recordings, decide each flow across all of them.
    Analyze {
        /// The recording(s): one per node; `-` reads one from stdin.
        #[arg(value_name = "FILE", value_parser = parse_in_file, required = true, num_args = 1..)]
        files: Vec<PathBuf>,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        output: Format,
        /// Show every packet of each flow with every point it passed.
        #[arg(short, long)]
        verbose: bool,
        /// Colour in text output (auto: on a terminal, unless NO_COLOR is set).
        #[arg(long, value_enum, default_value_t = Color::Auto)]
        color: Color,
        /// Text output: each flow on one line instead of a headline and indented lines.
        #[arg(long)]
        wide: bool,
        /// Print no line for an `ok` flow (it is still counted: summary, exit status).
        #[arg(long)]
        hide_ok: bool,
        /// Also write the flows' packets to OUT as pcapng.
        #[arg(long, value_name = "OUT", value_parser = parse_out_path)]
        pcap: Option<PathBuf>,
    },
    /// Remove what a killed nattrace left attached (clsact tc filters), and nothing else.
    Cleanup {
        /// Network namespace of the node: a name under /run/netns or a path (default: the current one).
        #[arg(long, value_name = "NAME|PATH", value_parser = parse_netns)]
        netns: Option<String>,
    },
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
        return Err(
            "must be more than 0 and at most 604800 seconds (one week); without --duration nattrace runs until Ctrl-C"
                .into(),
        );
    }
    Ok(Duration::from_secs_f64(secs))
}

fn parse_service(s: &str) -> Result<SvcArg, String> {
    SvcArg::parse(s)
}

/// Refuses what is certainly not a network namespace (a directory, a
/// regular file, another kind of namespace). What cannot be opened here is
/// left to the tracer, which says why (no such name, needs root).
fn parse_netns(s: &str) -> Result<String, String> {
    use std::os::fd::AsRawFd as _;
    if s.is_empty() {
        return Err(
            "not a network namespace: give a name under /run/netns or a path like /proc/PID/ns/net"
                .into(),
        );
    }
    let path = if s.contains('/') {
        PathBuf::from(s)
    } else {
        std::path::Path::new("/run/netns").join(s)
    };
    let Ok(file) = std::fs::File::open(&path) else {
        // Unopenable (e.g. another process's /proc/PID/ns/pid as a user):
        // its name still tells a /proc/PID/ns/<kind> link of another kind.
        let in_proc_ns = path.parent().and_then(|p| p.file_name()) == Some("ns".as_ref());
        let kind = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        const OTHER_KINDS: [&str; 9] = [
            "cgroup",
            "ipc",
            "mnt",
            "pid",
            "pid_for_children",
            "time",
            "time_for_children",
            "user",
            "uts",
        ];
        if in_proc_ns && OTHER_KINDS.contains(&kind) {
            return Err(format!(
                "a {kind} namespace, not a network namespace: give a name under /run/netns or a path like /proc/PID/ns/net"
            ));
        }
        return Ok(s.to_owned());
    };
    // Namespace files live on nsfs (include/uapi/linux/magic.h NSFS_MAGIC).
    const NSFS_MAGIC: i64 = 0x6e73_6673;
    // include/uapi/linux/nsfs.h: NS_GET_NSTYPE _IO(0xb7, 0x3).
    const NS_GET_NSTYPE: libc::c_ulong = 0xb703;
    let fd = file.as_raw_fd();
    // SAFETY: statfs is plain data filled in by the kernel.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid fd and a pointer to a statfs.
    if unsafe { libc::fstatfs(fd, &mut fs) } != 0 {
        return Ok(s.to_owned());
    }
    let not_ns = || {
        format!(
            "not a network namespace ({} is not a namespace file): give a name under /run/netns or a path like /proc/PID/ns/net",
            path.display()
        )
    };
    if fs.f_type as i64 != NSFS_MAGIC {
        return Err(not_ns());
    }
    // SAFETY: an ioctl without arguments on a valid fd.
    let kind = unsafe { libc::ioctl(fd, NS_GET_NSTYPE as _) };
    if kind >= 0 && kind != libc::CLONE_NEWNET {
        return Err(
            "another kind of namespace, not a network namespace: give a name under /run/netns or a path like /proc/PID/ns/net"
                .to_owned(),
        );
    }
    Ok(s.to_owned())
}

/// A label for output: printable, short.
fn parse_host_root(s: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(s);
    if p.is_dir() {
        Ok(p)
    } else {
        Err(format!(
            "{s} is not a directory: give the node's root filesystem (e.g. /host)"
        ))
    }
}

fn parse_cri_socket(s: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(s);
    if nattrace::pods::cri::is_socket(&p) {
        Ok(p)
    } else {
        Err(format!(
            "{s} is not a socket: give the container runtime's CRI socket (e.g. /run/containerd/containerd.sock)"
        ))
    }
}

fn parse_node_name(s: &str) -> Result<String, String> {
    if s.is_empty() || s.len() > 253 || s.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(format!(
            "'{}' is not a node name (1 to 253 printable characters, no spaces)",
            s.escape_debug()
        ));
    }
    Ok(s.to_owned())
}

/// MiB (fractions allowed: rotation tests use small files) → bytes.
fn parse_mib(s: &str) -> Result<u64, String> {
    let mib: f64 = s
        .parse()
        .map_err(|_| format!("'{s}' is not a size in MiB (e.g. 1024)"))?;
    if !(0.01..=1_048_576.0).contains(&mib) {
        return Err("must be between 0.01 and 1048576 MiB".into());
    }
    Ok((mib * 1024.0 * 1024.0) as u64)
}

fn parse_interval_secs(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|_| format!("'{s}' is not a number of seconds (e.g. 5)"))?;
    if !(0.1..=3600.0).contains(&secs) {
        return Err("must be between 0.1 and 3600 seconds".into());
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

/// A file we will create: its directory must exist (checked before attaching anything).
fn parse_out_path(s: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(s);
    if s.is_empty() || path.is_dir() {
        return Err(format!("'{s}' is not a file name"));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    if !dir.is_dir() {
        return Err(format!("directory '{}' does not exist", dir.display()));
    }
    Ok(path)
}

fn parse_in_file(s: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(s);
    if s == nattrace::recording::STDIN {
        return Ok(path);
    }
    match std::fs::File::open(&path) {
        Ok(f) if f.metadata().is_ok_and(|m| m.is_file()) => Ok(path),
        Ok(_) => Err(format!("'{s}' is not a regular file")),
        Err(e) => Err(format!("cannot read '{s}': {e}")),
    }
}

fn color_on(c: Color) -> bool {
    match c {
        Color::Always => true,
        Color::Never => false,
        // no-color.org: set and not empty means no colour.
        Color::Auto => {
            std::io::stdout().is_terminal()
                && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
        }
    }
}

fn format_of(f: Format) -> OutputFormat {
    match f {
        Format::Text => OutputFormat::Text,
        Format::Json => OutputFormat::Json,
    }
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
    // The message is the first paragraph (a missing-argument error names the
    // argument on the next line); usage and tips follow after a blank line.
    let rendered = err.render().to_string();
    let message: Vec<&str> = rendered
        .lines()
        .take_while(|line| !line.trim().is_empty())
        .map(str::trim)
        .collect();
    let message = message.join(" ");
    let message = message.trim_start_matches("error: ");
    nattrace::output::clean::say(format_args!("{message} (see nattrace --help)"));
    ExitCode::from(2)
}

fn main() -> ExitCode {
    nattrace::timing::init();
    // One warning style: `nattrace: warning: …`, as the session's own.
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format(|buf, record| {
            use std::io::Write as _;
            let line = nattrace::output::clean::log_line(
                record.level(),
                record.target(),
                &record.args().to_string(),
            );
            writeln!(buf, "{line}")
        })
        .target(env_logger::Target::Pipe(Box::new(session::LogWriter)))
        .init();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => return usage_error(err),
    };
    match cli.command {
        Some(Command::Analyze {
            files,
            output,
            verbose,
            color,
            wide,
            hide_ok,
            pcap,
        }) => {
            let stdin = std::path::Path::new(nattrace::recording::STDIN);
            if files.iter().filter(|f| *f == stdin).count() > 1 {
                nattrace::output::clean::say(
                    "analyze: '-' (stdin) can be given once: stdin holds one recording",
                );
                return ExitCode::from(2);
            }
            let opts = AnalyzeOptions {
                path: files[0].clone(),
                format: format_of(output),
                verbose,
                text: TextStyle {
                    color: color_on(color),
                    wide,
                },
                hide_ok,
                pcap,
            };
            let result = if files.len() > 1 {
                analyze::run_nodes(&opts, &files)
            } else {
                analyze::run(&opts)
            };
            return match result {
                Ok(outcome) => ExitCode::from(outcome.exit_status()),
                Err(err) => {
                    nattrace::output::clean::say(err);
                    ExitCode::from(2)
                }
            };
        }
        Some(Command::Cleanup { netns }) => return cleanup(netns.as_deref()),
        _ => {}
    }
    if let Some(Command::Doctor { netns, output }) = cli.command {
        return ExitCode::from(nattrace::doctor::run(
            netns.as_deref(),
            matches!(output, Format::Json),
        ));
    }
    let text = TextStyle {
        color: color_on(cli.color),
        wide: cli.wide,
    };
    let options = SessionOptions {
        services: cli
            .services
            .iter()
            .filter_map(|s| match s {
                SvcArg::Addr(a) => Some(*a),
                SvcArg::Name(_) => None,
            })
            .collect(),
        service_names: cli
            .services
            .into_iter()
            .filter_map(|s| match s {
                SvcArg::Name(n) => Some(n),
                SvcArg::Addr(_) => None,
            })
            .collect(),
        netns: cli.netns,
        duration: cli.duration,
        reply_timeout: Duration::from_millis(cli.reply_timeout),
        format: format_of(cli.output),
        verbose: cli.verbose,
        hide_ok: cli.hide_ok,
        text,
        ringbuf_bytes: cli.ringbuf_kib * 1024,
        backend: match cli.backend {
            BackendArg::Auto => BackendChoice::Auto,
            BackendArg::Netfilter => BackendChoice::Netfilter,
            BackendArg::Kprobe => BackendChoice::Kprobe,
        },
        write: cli.write,
        write_max_bytes: Some(cli.write_max_mb),
        pcap: cli.pcap,
        node_name: cli.node_name,
        host_root: cli.host_root,
        cri_socket: cli.cri_socket,
        continuous: nattrace::continuous::ContinuousOptions {
            all_services: cli.all_services,
            rules_interval: cli.rules_interval,
            metrics_addr: cli.metrics_addr,
            max_flows: cli.max_flows,
            write_keep: cli.write_keep,
        },
        expected: Vec::new(),
        quiet: cli.quiet,
    };
    match session::run(options) {
        Ok(outcome) => ExitCode::from(outcome.exit_status()),
        Err(err) => {
            nattrace::output::clean::say(err);
            ExitCode::from(2)
        }
    }
}

fn cleanup(netns: Option<&str>) -> ExitCode {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("nattrace: cleanup needs root (CAP_NET_ADMIN): run it with sudo");
        return ExitCode::from(2);
    }
    match nattrace::probes::cleanup::remove_leftovers(netns) {
        Ok(removed) if removed.is_empty() => {
            println!("nattrace: nothing left behind by nattrace");
            ExitCode::SUCCESS
        }
        Ok(removed) => {
            for r in removed {
                println!(
                    "nattrace: removed {}",
                    nattrace::output::clean::sanitize(&r.to_string())
                );
            }
            ExitCode::SUCCESS
        }
        Err(err) => {
            nattrace::output::clean::say(err);
            ExitCode::from(2)
        }
    }
}
