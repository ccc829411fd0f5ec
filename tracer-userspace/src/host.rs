//! The node's files when nattrace runs in a container. `kubectl debug
//! node/NAME --profile=sysadmin` shares the node's network and PID
//! namespaces and mounts the node's root at `/host`, but its `/sys` is a
//! fresh sysfs (BTF is there; tracefs and bpffs are not) and its `/lib` is
//! the image's. Files nattrace only reads are looked up there as a second
//! choice; the DaemonSet (deploy/) mounts them at their usual places.
use std::path::{Path, PathBuf};

/// Where `kubectl debug node` mounts the node's root filesystem.
pub const HOST_ROOT: &str = "/host";

/// `path` if it exists, else the node's copy under [`HOST_ROOT`] if that
/// exists, else `path` (so errors name the usual place).
pub fn node_path(path: &str) -> PathBuf {
    node_path_in(Path::new(HOST_ROOT), path)
}

fn node_path_in(host_root: &Path, path: &str) -> PathBuf {
    let own = PathBuf::from(path);
    if own.exists() {
        return own;
    }
    let host = host_root.join(path.trim_start_matches('/'));
    if host.exists() { host } else { own }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_path_first_then_the_host_root_copy() {
        let dir = std::env::temp_dir().join(format!("nattrace-host-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sys/kernel/tracing")).unwrap();
        // Present here: this one.
        assert_eq!(
            node_path_in(&dir, "/proc/self"),
            PathBuf::from("/proc/self")
        );
        // Only under the host root: that copy.
        let missing = "/sys/kernel/tracing-nattrace-test";
        assert_eq!(node_path_in(&dir, missing), PathBuf::from(missing));
        std::fs::create_dir_all(dir.join(missing.trim_start_matches('/'))).unwrap();
        assert_eq!(
            node_path_in(&dir, missing),
            dir.join("sys/kernel/tracing-nattrace-test")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
