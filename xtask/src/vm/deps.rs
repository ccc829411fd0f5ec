//! What `cargo xtask vm-test` needs on the host; `cargo xtask setup` installs these.

/// Debian packages. iproute2, iptables and conntrack are copied into the guest
/// from the host (with their shared libraries), so they must be installed here.
pub const APT_PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "busybox-static",
    "xz-utils",
    "zstd",
    "iproute2",
    "iptables",
    "conntrack",
];

/// The guest has no libc of ours, so payload binaries are linked statically against musl.
pub const RUSTUP_TARGETS: &[&str] = &["x86_64-unknown-linux-musl"];

/// The target triple payload binaries are built for (one of `RUSTUP_TARGETS`).
pub const PAYLOAD_TARGET: &str = "x86_64-unknown-linux-musl";
