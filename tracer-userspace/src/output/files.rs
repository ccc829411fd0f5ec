//! Opening the files nattrace writes (`--write`, `--pcap`, rotated
//! recordings) so that root writing them cannot be turned against the node
//! or the evidence (issue 26):
//! - never through a symlink: `O_NOFOLLOW` in the open(2) itself, so no
//!   check-then-open race with someone planting one in `/tmp`;
//! - never into a file someone else owns or may write (a pre-created 0666
//!   file would hand them the pcap), nor into one with other hard links;
//! - only a regular file (or a FIFO of ours: a reader process), never a
//!   device or a procfs/sysfs file (`--write /proc/version`);
//! - an existing file that passes is truncated (the SRE asked for that
//!   path) and made 0600; a new one is created 0600 whatever the umask;
//! - no output over an input or over another output ([`check_distinct`]).
use std::{
    fs::{File, OpenOptions},
    io,
    os::unix::fs::{MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
};

/// Filesystems whose "files" are kernel interfaces, not storage.
const PSEUDO_FS: &[(i64, &str)] = &[
    (0x9fa0, "procfs"),
    (0x6265_6572, "sysfs"),
    (0x6462_6720, "debugfs"),
    (0x7472_6163, "tracefs"),
    (0xcafe_4a11, "bpffs"),
    (0x2701_1994, "cgroup2"),
    (0x0027_e0eb, "cgroup"),
    (0x7363_6673, "securityfs"),
    (0x6265_6570, "configfs"),
];

fn refuse(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, why)
}

/// Creates or truncates an output file under the rules above (errors do
/// not name it: callers do). A FIFO is opened non-blocking, so a FIFO
/// nobody has open for reading is an error now instead of an open(2) that
/// never returns; the writes are blocking again (on the writer thread).
pub fn create_output(path: &Path) -> io::Result<File> {
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .mode(0o600)
        // std sets O_CLOEXEC itself; no O_TRUNC before the checks below.
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            // fs/fifo.c fifo_open: O_WRONLY|O_NONBLOCK without a reader is ENXIO.
            Some(libc::ENXIO) => {
                io::Error::new(e.kind(), "it is a FIFO no process has open for reading")
            }
            // fs/namei.c: O_NOFOLLOW on a symlink as the last component is ELOOP.
            Some(libc::ELOOP) => refuse(
                "it is a symbolic link, which nattrace does not follow (give the real path)"
                    .to_owned(),
            ),
            _ => e,
        })?;
    let meta = file.metadata()?;
    let me = nix::unistd::geteuid().as_raw();
    let kind = meta.file_type();
    use std::os::unix::fs::FileTypeExt as _;
    if !kind.is_file() && !kind.is_fifo() {
        return Err(refuse(
            "it is not a regular file (a device, socket or directory)".to_owned(),
        ));
    }
    if meta.uid() != me {
        return Err(refuse(format!(
            "it is owned by uid {}, not by this user (uid {me}): remove it or choose another path",
            meta.uid()
        )));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(refuse(format!(
            "it is writable by {} (mode {:o}): remove it or choose another path",
            if meta.mode() & 0o002 != 0 {
                "every user"
            } else {
                "its group"
            },
            meta.mode() & 0o7777
        )));
    }
    if kind.is_file() {
        if meta.nlink() > 1 {
            return Err(refuse(format!(
                "it has {} hard links: writing it would change the other names too",
                meta.nlink()
            )));
        }
        if meta.mode() & 0o200 == 0 {
            return Err(refuse(format!(
                "it is read-only (mode {:o})",
                meta.mode() & 0o7777
            )));
        }
        let fs = nix::sys::statfs::fstatfs(&file).map_err(io::Error::from)?;
        let magic = fs.filesystem_type().0 as i64;
        if let Some((_, name)) = PSEUDO_FS.iter().find(|(m, _)| *m == magic) {
            return Err(refuse(format!(
                "it is a kernel file on {name}, not storage"
            )));
        }
        file.set_len(0)?;
        if meta.mode() & 0o077 != 0 {
            file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        }
    }
    use std::os::fd::AsRawFd as _;
    let fd = file.as_raw_fd();
    // SAFETY: F_GETFL/F_SETFL on a descriptor we own.
    let cleared = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) == 0
    };
    if !cleared {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}

/// What a path names, to tell two paths of one file apart from two files:
/// device and inode when it exists (so hard links and symlinks match),
/// else its canonical parent and name.
#[derive(Debug, PartialEq, Eq)]
enum Identity {
    Inode(u64, u64),
    Path(PathBuf),
}

fn identity(path: &Path) -> Identity {
    if let Ok(meta) = std::fs::metadata(path) {
        return Identity::Inode(meta.dev(), meta.ino());
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let parent = std::fs::canonicalize(parent).unwrap_or_else(|_| parent.to_owned());
    Identity::Path(match path.file_name() {
        Some(name) => parent.join(name),
        None => parent,
    })
}

/// One file `nattrace` reads or writes, named as the command line names it.
pub struct Named<'a> {
    pub what: &'a str,
    pub path: &'a Path,
}

/// Refuses an output that is an input or another output (`analyze X.rec
/// --pcap X.rec` would turn the incident's recording into a pcapng).
/// Returns the one line to print.
pub fn check_distinct(outputs: &[Named<'_>], inputs: &[Named<'_>]) -> Result<(), String> {
    for (i, out) in outputs.iter().enumerate() {
        let id = identity(out.path);
        let clash = inputs
            .iter()
            .chain(&outputs[..i])
            .find(|other| identity(other.path) == id);
        if let Some(other) = clash {
            return Err(format!(
                "{} {} is the same file as {} {}: give it another path",
                out.what,
                out.path.display(),
                other.what,
                other.path.display()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("nattrace-files-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn named<'a>(what: &'a str, path: &'a Path) -> Named<'a> {
        Named { what, path }
    }

    #[test]
    fn an_output_over_an_input_or_another_output_is_refused() {
        let d = dir("distinct");
        let rec = d.join("x.rec");
        std::fs::write(&rec, "header").unwrap();
        let link = d.join("hard.rec");
        std::fs::hard_link(&rec, &link).unwrap();
        let sym = d.join("sym.rec");
        std::os::unix::fs::symlink(&rec, &sym).unwrap();
        let input = [named("recording", &rec)];
        for out in [&rec, &link, &sym] {
            let err = check_distinct(&[named("--pcap", out)], &input).unwrap_err();
            assert!(err.contains("is the same file as recording"), "{err}");
        }
        // Not created yet: the same path spelled two ways.
        let new = d.join("new.pcapng");
        let spelled = d.join(".").join("new.pcapng");
        let err =
            check_distinct(&[named("--write", &new), named("--pcap", &spelled)], &[]).unwrap_err();
        assert!(err.contains("--pcap"), "{err}");
        assert!(check_distinct(&[named("--pcap", &d.join("other"))], &input).is_ok());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn symlinks_devices_kernel_files_and_shared_files_are_refused() {
        let d = dir("create");
        let target = d.join("target");
        std::fs::write(&target, "precious").unwrap();
        let sym = d.join("sym");
        std::os::unix::fs::symlink(&target, &sym).unwrap();
        let err = create_output(&sym).unwrap_err().to_string();
        assert!(err.contains("symbolic link"), "{err}");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "precious");
        let err = create_output(Path::new("/dev/null"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a regular file"), "{err}");
        // Owned by root and 0444: refused for root too.
        if nix::unistd::geteuid().is_root() {
            let err = create_output(Path::new("/proc/version"))
                .unwrap_err()
                .to_string();
            assert!(err.contains("read-only") || err.contains("procfs"), "{err}");
        }
        let open = d.join("open");
        std::fs::write(&open, "x").unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o666)).unwrap();
        let err = create_output(&open).unwrap_err().to_string();
        assert!(err.contains("writable by every user"), "{err}");
        let linked = d.join("linked");
        std::fs::hard_link(&target, &linked).unwrap();
        let err = create_output(&linked).unwrap_err().to_string();
        assert!(err.contains("hard links"), "{err}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn new_and_existing_files_are_ours_alone() {
        let d = dir("mode");
        let new = d.join("new");
        drop(create_output(&new).unwrap());
        assert_eq!(std::fs::metadata(&new).unwrap().mode() & 0o777, 0o600);
        let old = d.join("old");
        std::fs::write(&old, "previous run").unwrap();
        std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o644)).unwrap();
        drop(create_output(&old).unwrap());
        let meta = std::fs::metadata(&old).unwrap();
        assert_eq!(meta.len(), 0, "an existing file of ours is truncated");
        assert_eq!(meta.mode() & 0o777, 0o600);
        let _ = std::fs::remove_dir_all(&d);
    }
}
