//! What nattrace writes and prints cannot be turned against the node or the
//! evidence (issue 26): no terminal escapes from names it did not choose,
//! no output over an input, no file it did not mean to write, no kernel
//! address in a recording, and a non-zero exit when output was lost. Tests
//! that need another user or a mount run only as root and say so otherwise.
use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

fn nattrace() -> Command {
    Command::new(env!("CARGO_BIN_EXE_nattrace"))
}

/// A recorded fixture by file name, wherever the crate keeps its fixtures.
fn fixture(name: &str) -> PathBuf {
    fn find(dir: &Path, name: &str) -> Option<PathBuf> {
        for entry in std::fs::read_dir(dir).ok()?.flatten() {
            let path = entry.path();
            if path.file_name().is_some_and(|n| n == name) {
                return Some(path);
            }
            if path.is_dir()
                && !path.ends_with("target")
                && let Some(found) = find(&path, name)
            {
                return Some(found);
            }
        }
        None
    }
    find(Path::new(env!("CARGO_MANIFEST_DIR")), name)
        .unwrap_or_else(|| panic!("fixture {name} not found"))
}

/// A directory of this test's own, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!(
            "nattrace-out-{tag}-{}-{:x}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Bytes a terminal would act on: C0 but newline and tab, DEL, and C1
/// (UTF-8 `C2 80`..`C2 9F`).
fn control_bytes(out: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(out);
    text.lines()
        .filter(|l| {
            l.chars()
                .any(|c| (c.is_control() && c != '\t') || ('\u{80}'..='\u{9f}').contains(&c))
        })
        .map(|l| format!("{l:?}"))
        .collect()
}

const EVIL: &str = "\\u001b[2J\\u001b]0;pwned\\u0007\\r\\u009b31m";

/// Issue 26 item 1: a pod that renames its interface, or a recording that
/// names a Service or check with escapes, must not reach root's terminal.
#[test]
fn analyze_prints_no_terminal_escapes_from_names_in_a_recording() {
    let dir = TempDir::new("escapes");
    let text = std::fs::read_to_string(fixture("root_hairpin_mode_off_is_named.rec")).unwrap();
    let evil = text
        .replace("\"name\":\"veth0\"", &format!("\"name\":\"veth0{EVIL}\""))
        .replace("\"name\":\"cni0\"", &format!("\"name\":\"cni0{EVIL}\""))
        .replace(
            "\"checks_line\":\"checks: ",
            &format!("\"checks_line\":\"checks{EVIL}: "),
        )
        .replace(
            "ntlab-1304-2-ee63-node-a",
            &format!("ntlab-1304-2-ee63-node-a{EVIL}"),
        );
    assert_ne!(evil, text, "the fixture changed: nothing was replaced");
    let rec = dir.path("evil.rec");
    std::fs::write(&rec, &evil).unwrap();
    for color in ["never", "always"] {
        let out: Output = nattrace()
            .args(["analyze", "-v", "--color", color])
            .arg(&rec)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("veth0\\x1b[2J"), "{stdout}");
        let mut bad = control_bytes(&out.stdout);
        if color == "always" {
            // Our own colours are the only escapes left.
            let ours = [
                "\x1b[32m", "\x1b[31m", "\x1b[33m", "\x1b[2m", "\x1b[1m", "\x1b[0m",
            ];
            bad = control_bytes(
                ours.iter()
                    .fold(stdout.to_string(), |s, c| s.replace(c, ""))
                    .as_bytes(),
            );
        }
        bad.extend(control_bytes(&out.stderr));
        assert!(bad.is_empty(), "raw control characters printed: {bad:#?}");
    }
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Exit 2 with one line on stderr containing each of `want`.
fn assert_one_line_exit_2(out: &Output, want: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "stderr: {stderr}");
    for w in want {
        assert!(stderr.contains(w), "{w:?} not in: {stderr}");
    }
}

/// Runs `args` as `nobody` (only as root).
fn as_nobody(args: &[&str]) {
    let status = Command::new("runuser")
        .args(["-u", "nobody", "--"])
        .args(args)
        .status()
        .expect("runuser");
    assert!(status.success(), "as nobody: {args:?}");
}

/// Issue 26 item 2: `analyze X.rec --pcap X.rec` turned the incident's
/// recording into a pcapng; a hard link or symlink to it is the same file.
#[test]
fn analyze_refuses_a_pcap_over_its_recording() {
    let dir = TempDir::new("over");
    let rec = dir.path("x.rec");
    std::fs::copy(fixture("root_hairpin_mode_off_is_named.rec"), &rec).unwrap();
    let before = std::fs::read(&rec).unwrap();
    let hard = dir.path("hard.rec");
    std::fs::hard_link(&rec, &hard).unwrap();
    for pcap in [&rec, &hard] {
        let out = nattrace()
            .arg("analyze")
            .arg(&rec)
            .arg("--pcap")
            .arg(pcap)
            .output()
            .unwrap();
        assert_one_line_exit_2(&out, &["is the same file as the recording"]);
        assert!(out.stdout.is_empty());
    }
    // Several nodes' recordings: none may be the pcap either.
    let other = dir.path("b.rec");
    std::fs::copy(&rec, &other).unwrap();
    let out = nattrace()
        .arg("analyze")
        .arg(&other)
        .arg(&rec)
        .arg("--pcap")
        .arg(&hard)
        .output()
        .unwrap();
    assert_one_line_exit_2(&out, &["is the same file as the recording"]);
    assert_eq!(
        std::fs::read(&rec).unwrap(),
        before,
        "the recording changed"
    );
}

/// Issue 26 item 2, live: `--write F --pcap F` (also spelled differently,
/// and F.1 of a rotation) is refused before anything is attached.
#[test]
fn live_refuses_outputs_that_are_one_file() {
    let dir = TempDir::new("live-same");
    let f = dir.path("f");
    let spelled = dir.0.join(".").join("f");
    let rotated = dir.path("f.1");
    for (pcap, keep) in [(&f, "1"), (&spelled, "1"), (&rotated, "3")] {
        let out = nattrace()
            .args(["--svc", "192.0.2.1:80", "--duration", "1", "--write"])
            .arg(&f)
            .arg("--pcap")
            .arg(pcap)
            .args(["--write-keep", keep])
            .output()
            .unwrap();
        assert_one_line_exit_2(&out, &["is the same file as --write"]);
    }
    assert!(!f.exists(), "refused, yet created");
}

/// Issue 26 item 3: as `nobody`, plant a symlink to root's file where root
/// will `--write`/`--pcap`, and a world-writable file, and a file of
/// nobody's own: each is refused in one line, the target untouched.
#[test]
fn root_output_files_do_not_follow_planted_symlinks_or_write_others_files() {
    if !is_root() {
        eprintln!("skipped: needs root (to plant files as nobody)");
        return;
    }
    let dir = TempDir::new("planted");
    // Everyone may create here. Not sticky: in a sticky directory (/tmp)
    // fs.protected_regular/protected_symlinks may refuse some of these
    // opens already; nattrace must not depend on those sysctls.
    std::fs::set_permissions(&dir.0, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let secret = dir.path("secret");
    std::fs::write(&secret, "root's").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_owned();
    let link = dir.path("incident.rec");
    as_nobody(&["ln", "-s", &s(&secret), &s(&link)]);
    let open = dir.path("open.pcapng");
    as_nobody(&["sh", "-c", &format!("umask 0; : > {}", s(&open))]);
    let theirs = dir.path("theirs.rec");
    as_nobody(&["touch", &s(&theirs)]);
    let cases: [(&str, &Path, &str); 5] = [
        ("--write", &link, "symbolic link"),
        ("--pcap", &link, "symbolic link"),
        ("--pcap", &open, "owned by uid 65534"),
        ("--write", &theirs, "owned by uid 65534"),
        ("--write", Path::new("/proc/version"), "/proc/version"),
    ];
    for (flag, path, why) in cases {
        let out = nattrace()
            .args(["--svc", "192.0.2.1:80", "--duration", "1", flag])
            .arg(path)
            .output()
            .unwrap();
        assert_one_line_exit_2(&out, &[why]);
    }
    let out = nattrace()
        .arg("analyze")
        .arg(fixture("root_hairpin_mode_off_is_named.rec"))
        .arg("--pcap")
        .arg(&link)
        .output()
        .unwrap();
    assert_one_line_exit_2(&out, &["symbolic link"]);
    assert_eq!(std::fs::read_to_string(&secret).unwrap(), "root's");
    assert_eq!(std::fs::metadata(&open).unwrap().len(), 0);
    // A device and a FIFO of someone else's are not files to write either.
    let out = nattrace()
        .args(["analyze"])
        .arg(fixture("root_hairpin_mode_off_is_named.rec"))
        .args(["--pcap", "/dev/null"])
        .output()
        .unwrap();
    assert_one_line_exit_2(&out, &["not a regular file"]);
}

/// Issue 26 items 3 and 4: what nattrace writes is 0600 whatever the umask
/// (a recording names the node's addresses and rules).
#[test]
fn analyze_pcap_is_created_0600_under_umask_022() {
    use std::os::unix::fs::MetadataExt as _;
    let dir = TempDir::new("mode");
    let pcap = dir.path("out.pcapng");
    let out = nattrace()
        .arg("analyze")
        .arg(fixture("root_hairpin_mode_off_is_named.rec"))
        .arg("--pcap")
        .arg(&pcap)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_eq!(std::fs::metadata(&pcap).unwrap().mode() & 0o777, 0o600);
}

/// Every recorded fixture (real kernel runs: `skb` is a kernel address).
fn recorded_fixtures() -> Vec<PathBuf> {
    let dir = fixture("root_hairpin_mode_off_is_named.rec")
        .parent()
        .unwrap()
        .to_owned();
    let mut all: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "rec"))
        .collect();
    all.sort();
    all
}

/// Issue 26 item 4: a recording written now carries per-run numbers where
/// the kernel's `sk_buff` addresses were, and decides exactly as the
/// addresses did (same packet, same number); old recordings still read.
#[test]
fn recordings_carry_no_kernel_address_and_decide_the_same() {
    use nattrace::recording::{Reader, Record, RecordingWriter};
    use std::os::unix::fs::MetadataExt as _;
    let dir = TempDir::new("skb");
    let fixtures = recorded_fixtures();
    assert!(fixtures.len() >= 5, "{fixtures:?}");
    for path in fixtures {
        let (reader, header) = Reader::open(&path).unwrap();
        let out = dir.path(path.file_name().unwrap().to_str().unwrap());
        let mut w = RecordingWriter::create(&out, &header, None).unwrap();
        let mut addresses = std::collections::HashSet::new();
        for record in reader {
            match record {
                Record::Event(ev) => {
                    if ev.skb != 0 {
                        addresses.insert(ev.skb);
                    }
                    w.event(&ev)
                }
                Record::Interface(i) => w.interface(i.netns, i.ifindex, &i.name),
                Record::Stats(s) => w.stats(s),
                Record::Rules(r) => w.rules(&r),
                Record::Sysctls(s) => w.sysctls(s),
                Record::Conntrack(t) => w.conntrack(t),
                Record::Pods(p) => w.pods(&p),
                Record::CtEntry(l) => w.ct_entry(&l),
                Record::End(s) => w.end(s),
                Record::Capped { .. } | Record::Rotated { .. } => {}
            }
        }
        let forever = std::time::Duration::from_secs(60);
        assert!(w.drain(std::time::Instant::now() + forever, forever));
        assert!(
            addresses.iter().any(|a| *a > u32::MAX as u64),
            "{path:?}: the fixture has kernel addresses"
        );
        assert_eq!(std::fs::metadata(&out).unwrap().mode() & 0o777, 0o600);
        let text = std::fs::read_to_string(&out).unwrap();
        for line in text
            .lines()
            .filter(|l| l.starts_with("{\"kind\":\"event\""))
        {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let skb = v["skb"].as_u64().unwrap();
            assert!(
                skb < 1 << 32 && !addresses.contains(&skb) || skb == 0,
                "{path:?}: a kernel address was written: {line}"
            );
        }
        let analyze = |p: &Path| {
            nattrace()
                .args(["analyze", "-v", "--output", "json"])
                .arg(p)
                .output()
                .unwrap()
        };
        let (old, new) = (analyze(&path), analyze(&out));
        assert_eq!(old.status.code(), new.status.code(), "{path:?}");
        assert!(!old.stdout.is_empty(), "{path:?}: {old:?}");
        assert_eq!(
            String::from_utf8_lossy(&old.stdout),
            String::from_utf8_lossy(&new.stdout),
            "{path:?}: decided differently"
        );
    }
}

/// Issue 26 item 9: a closed stdout (`| head` gone) is warned about once
/// and is exit 3, not 0.
#[test]
fn analyze_to_a_closed_stdout_warns_once_and_exits_3() {
    use std::os::fd::OwnedFd;
    let (read, write): (OwnedFd, OwnedFd) = nix::unistd::pipe().unwrap();
    drop(read);
    let out = nattrace()
        .args(["analyze", "-v"])
        .arg(fixture(
            "root_seed000_broken_every_same_node_connection_is_not_reverse_nated.rec",
        ))
        .stdout(std::process::Stdio::from(write))
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert_eq!(
        stderr.matches("writing to stdout failed").count(),
        1,
        "{stderr}"
    );
}

/// Issue 26 item 9: a header and then a cut-off event holds no readable
/// event (README: exit 2); an event with a hook this nattrace does not know
/// is counted, warned about and exit 3, never dropped silently.
#[test]
fn cut_off_and_unknown_hook_events_are_not_silent() {
    let dir = TempDir::new("cut");
    let text = std::fs::read_to_string(fixture("root_hairpin_mode_off_is_named.rec")).unwrap();
    let mut lines = text.lines();
    let header = lines.next().unwrap();
    let event = lines
        .find(|l| l.starts_with("{\"kind\":\"event\""))
        .unwrap();
    let cut = dir.path("cut.rec");
    std::fs::write(&cut, format!("{header}\n{}", &event[..event.len() / 2])).unwrap();
    let out = nattrace().arg("analyze").arg(&cut).output().unwrap();
    assert_one_line_exit_2(&out, &["holds no readable event"]);

    let odd = dir.path("hook.rec");
    let bad = event.replace("\"hook\":5,", "\"hook\":200,");
    assert_ne!(bad, event);
    std::fs::write(&odd, text.replacen(event, &bad, 1)).unwrap();
    let out = nattrace().arg("analyze").arg(&odd).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert_eq!(stderr.matches("unknown hook 200").count(), 1, "{stderr}");
}

/// Runs `script` as root in a mount namespace of its own with a `size`
/// tmpfs at `dir` (gone with the namespace): a full disk without touching
/// the node's mounts.
fn on_small_tmpfs(dir: &Path, size: &str, script: &str) -> Output {
    Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c"])
        .arg(format!(
            "mount -t tmpfs -o size={size},mode=0700 nattrace-test {d} && {script}",
            d = dir.display()
        ))
        .output()
        .expect("unshare")
}

/// Issue 26 items 9 and 10: a pcapng on a full disk is exit 3 with one
/// warning, and what was written reads cleanly in tshark (cut back to its
/// last whole block, never mid-packet).
#[test]
fn root_pcap_on_a_full_disk_exits_3_and_reads_cleanly() {
    if !is_root() {
        eprintln!("skipped: needs root (a tmpfs in a mount namespace)");
        return;
    }
    if Command::new("tshark").arg("-v").output().is_err() {
        eprintln!("skipped: tshark is not installed");
        return;
    }
    let dir = TempDir::new("full-pcap");
    let small = dir.path("small");
    std::fs::create_dir(&small).unwrap();
    let rec = fixture("root_seed000_broken_every_same_node_connection_is_not_reverse_nated.rec");
    // One page: this recording's pcapng is about 9 KB (one block per
    // packet and address pair).
    let out = on_small_tmpfs(
        &small,
        "4k",
        &format!(
            "{bin} analyze {rec} --pcap {small}/out.pcapng > /dev/null; rc=$?; cp {small}/out.pcapng {dir}/kept.pcapng; exit $rc",
            bin = env!("CARGO_BIN_EXE_nattrace"),
            rec = rec.display(),
            small = small.display(),
            dir = dir.0.display()
        ),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert_eq!(stderr.matches("No space left").count(), 1, "{stderr}");
    let kept = dir.path("kept.pcapng");
    assert!(std::fs::metadata(&kept).unwrap().len() > 0);
    let tshark = Command::new("tshark")
        .arg("-r")
        .arg(&kept)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&tshark.stderr);
    assert!(tshark.status.success(), "tshark: {said}");
    assert!(!said.contains("cut short"), "tshark: {said}");
    assert!(!tshark.stdout.is_empty(), "no packet kept");
}

/// Issue 26 item 9, live: the recording failing on a full disk is exit 3
/// with one warning (the trace goes on).
#[test]
fn root_recording_on_a_full_disk_exits_3() {
    if !is_root() {
        eprintln!("skipped: needs root (a tmpfs in a mount namespace)");
        return;
    }
    let dir = TempDir::new("full-rec");
    // Traced in a network namespace of its own (only lo): nothing of the
    // node's is attached to; the stats lines every 200 ms fill the disk.
    let out = on_small_tmpfs(
        &dir.0,
        "16k",
        &format!(
            "head -c 8192 /dev/zero > {d}/filler && exec unshare -n {bin} --svc 192.0.2.1:80 --duration 4 --write {d}/r.rec",
            d = dir.0.display(),
            bin = env!("CARGO_BIN_EXE_nattrace"),
        ),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert_eq!(
        stderr.matches("No space left on device").count(),
        1,
        "{stderr}"
    );
}

/// Re-records `path` through the writer (as a live session writes it),
/// with `limit` bytes per file and `keep` files when rotating.
fn rerecord(path: &Path, out: &Path, limit: Option<u64>, keep: usize) {
    use nattrace::recording::{Reader, Record, RecordingWriter};
    let (reader, header) = Reader::open(path).unwrap();
    let mut w = RecordingWriter::create(out, &header, limit).unwrap();
    w.keep_files(keep);
    for record in reader {
        match record {
            Record::Event(ev) => w.event(&ev),
            Record::Interface(i) => w.interface(i.netns, i.ifindex, &i.name),
            Record::Stats(s) => w.stats(s),
            Record::Rules(r) => w.rules(&r),
            Record::Sysctls(s) => w.sysctls(s),
            Record::Conntrack(t) => w.conntrack(t),
            Record::Pods(p) => w.pods(&p),
            Record::CtEntry(l) => w.ct_entry(&l),
            Record::End(s) => w.end(s),
            Record::Capped { .. } | Record::Rotated { .. } => {}
        }
    }
    let forever = std::time::Duration::from_secs(60);
    assert!(w.drain(std::time::Instant::now() + forever, forever));
    assert_eq!(w.take_warning(), None);
}

/// Issue 26 item 11: `analyze r.rec.2 r.rec.1 r.rec` is one node's one run
/// (same `run_id`, in `file_seq` order, whatever order they are given in),
/// decided as if never rotated: flows crossing a rotation are decided whole.
#[test]
fn rotated_files_are_read_as_one_recording() {
    let dir = TempDir::new("rotated");
    let src = fixture("root_seed000_broken_every_same_node_connection_is_not_reverse_nated.rec");
    let whole = dir.path("whole.rec");
    rerecord(&src, &whole, None, 1);
    let size = std::fs::metadata(&whole).unwrap().len();
    let rec = dir.path("r.rec");
    rerecord(&src, &rec, Some(size / 3), 8);
    let files: Vec<PathBuf> = (0..8)
        .map(|i| {
            if i == 0 {
                rec.clone()
            } else {
                dir.path(&format!("r.rec.{i}"))
            }
        })
        .filter(|p| p.exists())
        .collect();
    assert!(files.len() >= 3, "{files:?}");
    let analyze = |paths: &[PathBuf]| {
        nattrace()
            .args(["analyze", "-v", "--output", "json"])
            .args(paths)
            .output()
            .unwrap()
    };
    let one = analyze(std::slice::from_ref(&whole));
    let oldest_first: Vec<PathBuf> = files.iter().rev().cloned().collect();
    for order in [oldest_first, files.clone()] {
        let rotated = analyze(&order);
        let stderr = String::from_utf8_lossy(&rotated.stderr);
        assert!(stderr.contains("as one rotated recording"), "{stderr}");
        assert!(!stderr.contains("truncated"), "{stderr}");
        assert_eq!(rotated.status.code(), one.status.code(), "{stderr}");
        assert_eq!(
            String::from_utf8_lossy(&rotated.stdout),
            String::from_utf8_lossy(&one.stdout),
            "the rotated files decided differently"
        );
    }
    // Each file alone still reads (and says it goes on elsewhere).
    let alone = analyze(&files[1..2]);
    assert!(String::from_utf8_lossy(&alone.stderr).contains("rotated at"));
}

/// The `run_id` in a recording's header.
fn run_id(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let header: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    header["run_id"].as_str().unwrap().to_owned()
}

/// A restart with `--write-keep` (a DaemonSet's pod restarting) keeps the
/// previous run's newest file as FILE.1 instead of truncating it.
#[test]
fn root_a_restart_with_write_keep_rotates_the_previous_run() {
    if !is_root() {
        eprintln!("skipped: needs root (a trace in a network namespace of its own)");
        return;
    }
    let dir = TempDir::new("restart");
    let rec = dir.path("r.rec");
    let trace = || {
        // Only lo, in a network namespace of its own: nothing of the node's.
        let out = Command::new("unshare")
            .args(["-n", env!("CARGO_BIN_EXE_nattrace")])
            .args([
                "--svc",
                "192.0.2.1:80",
                "--duration",
                "1",
                "--write-keep",
                "3",
            ])
            .arg("--write")
            .arg(&rec)
            .output()
            .unwrap();
        // Nothing connects to 192.0.2.1: exit 4 (README, "no connection
        // was seen to a --svc"), with both files written.
        assert_eq!(out.status.code(), Some(4), "{out:?}");
    };
    trace();
    let first = run_id(&rec);
    trace();
    let older = dir.path("r.rec.1");
    assert_eq!(run_id(&older), first, "the first run's file was not kept");
    assert_ne!(run_id(&rec), first);
    // Two runs: two recordings, not one rotation.
    let out = nattrace()
        .args(["analyze", "--output", "json"])
        .arg(&older)
        .arg(&rec)
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("as one rotated recording"),
        "{out:?}"
    );
}

/// Issue 28 item 5, words: the start line and the summary speak of the
/// Service and the node; the namespace inode, why this probe backend and the
/// kernel buffer's counters are for `-v` (and JSON, unchanged).
#[test]
fn the_start_line_and_summary_leave_nattraces_internals_to_verbose() {
    let rec = fixture("root_bridge_nf_off_mid_stream_iptables.rec");
    let run = |verbose: bool| {
        let mut cmd = nattrace();
        cmd.arg("analyze").arg(&rec);
        if verbose {
            cmd.arg("-v");
        }
        let out = cmd.output().unwrap();
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let (plain, verbose) = (run(false), run(true));
    let line = |text: &str, start: &str| {
        text.lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("no {start} line in:\n{text}"))
            .to_string()
    };
    let start = line(&plain, "nattrace: tracing ");
    assert!(
        start.contains("100.67.30.133:80")
            && start.contains(" in netns ")
            && start.contains("bridge-nf-call-iptables=1"),
        "{start}"
    );
    for word in ["inode", "backend", "BPF"] {
        assert!(!start.contains(word), "{word} in: {start}");
    }
    let summary = line(&plain, "summary: ");
    assert!(
        !summary.contains("held") && !summary.contains("buffer"),
        "{summary}"
    );
    let start = line(&verbose, "nattrace: tracing ");
    assert!(
        start.contains("netns inode ")
            && start.contains("netfilter probes (BPF netfilter links available)"),
        "{start}"
    );
    let summary = line(&verbose, "summary: ");
    assert!(summary.contains("; kernel buffer: "), "{summary}");
}

/// Issue 28 item 3: colour only on a terminal (under a pseudo-terminal from
/// util-linux `script`), never when piped, and not with NO_COLOR set
/// (no-color.org); `--color always` still asks for it.
#[test]
fn text_colour_is_for_a_terminal_without_no_color() {
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!("skipped: util-linux `script` is not installed (no pseudo-terminal)");
        return;
    }
    let rec = fixture("root_seed000_broken_every_same_node_connection_is_not_reverse_nated.rec");
    let on_tty = |no_color: bool, extra: &str| {
        let cmd = format!(
            "{} analyze {} {extra}",
            env!("CARGO_BIN_EXE_nattrace"),
            rec.display()
        );
        let mut script = Command::new("script");
        script
            .args(["-qec", &cmd, "/dev/null"])
            .env_remove("NO_COLOR");
        if no_color {
            script.env("NO_COLOR", "1");
        }
        let out = script.output().unwrap();
        assert!(
            out.status.success() || out.status.code() == Some(1),
            "{out:?}"
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let tty = on_tty(false, "");
    assert!(tty.contains("reply_not_reverse_nated"), "{tty}");
    assert!(tty.contains("\x1b[31m"), "no colour on a terminal: {tty}");
    assert!(
        !on_tty(true, "").contains('\x1b'),
        "colour despite NO_COLOR"
    );
    assert!(on_tty(true, "--color always").contains("\x1b[31m"));
    let piped = nattrace().arg("analyze").arg(&rec).output().unwrap();
    assert!(!piped.stdout.contains(&0x1b), "colour in a pipe");
}
