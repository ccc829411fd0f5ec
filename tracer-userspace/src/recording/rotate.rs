//! `--write FILE --write-keep N`: when FILE reaches `--write-max-mb` it
//! becomes FILE.1 (FILE.1 becomes FILE.2, …, FILE.(N-1) is deleted) and a
//! new FILE starts with its own header, so every file is a recording
//! `nattrace analyze` reads on its own. The old file's writer thread keeps
//! its descriptor: what it still had queued lands in FILE.1.
use std::{
    io,
    path::{Path, PathBuf},
};

/// FILE.i (FILE itself for 0).
pub fn rotated_name(path: &Path, i: usize) -> PathBuf {
    if i == 0 {
        return path.to_owned();
    }
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".{i}"));
    PathBuf::from(name)
}

/// Makes room for a new FILE, keeping `keep` files in all (FILE included).
pub fn shift(path: &Path, keep: usize) -> io::Result<()> {
    let oldest = rotated_name(path, keep.saturating_sub(1));
    match std::fs::remove_file(&oldest) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    for i in (0..keep.saturating_sub(1)).rev() {
        match std::fs::rename(rotated_name(path, i), rotated_name(path, i + 1)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shifting_keeps_n_files() {
        let dir = std::env::temp_dir().join(format!("nattrace-rotate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("rec");
        for round in 0..5 {
            std::fs::write(&file, format!("{round}")).unwrap();
            shift(&file, 3).unwrap();
        }
        let read = |i| std::fs::read_to_string(rotated_name(&file, i)).ok();
        assert_eq!(read(0), None);
        assert_eq!(read(1).as_deref(), Some("4"));
        assert_eq!(read(2).as_deref(), Some("3"));
        assert_eq!(read(3), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
