//! Developer tasks. `cargo xtask <task>`; see README.md.
mod bench;
mod image;
mod setup;
mod tasks;
mod vm;
mod workspace;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "nattrace developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what a fresh machine lacks (idempotent; seconds when everything is present).
    Setup,
    /// Build, create the seed 000 lab node, and trace it healthy and broken.
    Demo,
    /// Run every test: setup, fmt, clippy (userspace and eBPF), unit tests; as root also the lab tests and guest kernels.
    Test(tasks::TestArgs),
    /// fmt --check and clippy -D warnings over userspace and the eBPF crate (no root needed).
    Lint,
    /// Record the seed scenarios on this kernel as the collector's fixtures, with golden `analyze` output.
    Fixtures,
    /// Boot Debian 6.1 and 6.12 kernels under QEMU and run the lab scenarios against each backend.
    VmTest(vm::VmTestArgs),
    /// Build the OCI image (static nattrace + the iptables/nft it runs) with buildah.
    Image(image::ImageArgs),
    /// Measure what nattrace costs a node (lab, release builds) and write BENCHMARKS.md.
    Bench(bench::BenchArgs),
    /// Build the static (musl) nattrace a node or a kind node container runs; prints its path.
    Musl,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().task {
        Task::Setup => setup::run(),
        Task::Demo => tasks::demo(),
        Task::Test(args) => tasks::test(args),
        Task::Lint => tasks::lint(),
        Task::Fixtures => tasks::fixtures(),
        Task::VmTest(args) => vm::run(args),
        Task::Bench(args) => bench::run(args),
        Task::Image(args) => image::run(args),
        Task::Musl => {
            println!("{}", vm::build_static_nattrace()?.display());
            Ok(())
        }
    }
}
