//! Output that cannot stall the event loop: bytes go to a bounded queue that
//! a thread of its own writes out. A reader that stops reading (a pager left
//! open, a stuck `| ssh`, a FIFO nobody reads) blocks only that thread, so
//! signals, detaching and the kernel's ring buffer are still served; what
//! does not fit in the queue is dropped and counted, never silently.
use std::{
    collections::VecDeque,
    fs::File,
    io::{self, Write},
    path::Path,
    sync::{
        Arc, Condvar, Mutex, MutexGuard,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

/// Tests shrink the queues to make them overflow with little traffic.
pub fn queue_bytes(default: usize) -> usize {
    std::env::var("NATTRACE_TEST_QUEUE_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// What happens to a chunk that does not fit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overflow {
    /// Drop it and count its lines (live stdout, the recording: whole lines,
    /// so what is written stays valid).
    Drop,
    /// Wait for room (`analyze`: nothing is live, a slow pager sets the pace).
    Block,
    /// Give the target up, as after a write error (pcapng: a dropped block
    /// could be an interface description and would corrupt the file).
    Abandon,
}

#[derive(Default)]
struct State {
    chunks: VecDeque<Vec<u8>>,
    /// Bytes queued or being written.
    queued: usize,
    closed: bool,
    /// The first write error (as kind + text: io::Error is not Clone); the
    /// target is given up after it.
    error: Option<(io::ErrorKind, String)>,
    dropped_lines: u64,
    /// The chunk being written now, kept where [`WriteQueue::drain`] can
    /// count its lines if it gives up: counted for every chunk, the lines
    /// were ~3% of the process's time per healthy connection (memchr over
    /// every byte printed), for a figure only a stalled exit reads.
    writing: Option<Arc<Vec<u8>>>,
    /// Bumped after every write(2), to tell a slow reader from a stalled one.
    progress: u64,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    /// Set once `State::error` is: [`WriteQueue::check`] runs after every
    /// line printed, and taking the lock there, which the writer thread
    /// takes after every write(2), was 0.2 µs per healthy connection in the
    /// bench's profile (the lock's cache line moving between the two
    /// threads' CPUs).
    failed: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records the target's first error (under the lock, as `st`).
    fn fail(&self, st: &mut State, error: (io::ErrorKind, String)) {
        st.error = Some(error);
        self.failed.store(true, Ordering::Release);
    }
}

/// A bounded queue of byte chunks and the thread writing them to a target.
/// Dropping it lets the thread finish what is queued; nothing waits for it
/// (a blocked write dies with the process).
pub struct WriteQueue {
    shared: Arc<Shared>,
    limit: usize,
    overflow: Overflow,
}

/// How [`WriteQueue::drain`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Drained {
    /// Everything queued was written (or the target failed: nothing more will be).
    pub done: bool,
    /// Lines still queued when it gave up.
    pub unwritten_lines: u64,
}

impl WriteQueue {
    pub fn spawn(
        name: &str,
        target: Box<dyn Write + Send>,
        limit: usize,
        overflow: Overflow,
    ) -> io::Result<Self> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            failed: AtomicBool::new(false),
        });
        let theirs = shared.clone();
        std::thread::Builder::new()
            .name(format!("nattrace-{name}"))
            .spawn(move || writer(&theirs, target))?;
        Ok(Self {
            shared,
            limit,
            overflow,
        })
    }

    /// Queues `chunk` (whole lines, unless the target is [`Overflow::Abandon`]).
    /// Err once the target failed or was given up.
    pub fn push(&self, chunk: Vec<u8>) -> io::Result<()> {
        if chunk.is_empty() {
            return self.check();
        }
        let mut st = self.shared.lock();
        loop {
            if let Some((kind, msg)) = &st.error {
                return Err(io::Error::new(*kind, msg.clone()));
            }
            // A chunk larger than the whole queue still goes through alone.
            if st.queued == 0 || st.queued + chunk.len() <= self.limit {
                break;
            }
            match self.overflow {
                Overflow::Drop => {
                    st.dropped_lines += lines(&chunk);
                    return Ok(());
                }
                Overflow::Abandon => {
                    let msg = format!("the reader fell more than {} KiB behind", self.limit >> 10);
                    self.shared
                        .fail(&mut st, (io::ErrorKind::WouldBlock, msg.clone()));
                    st.chunks.clear();
                    self.shared.changed.notify_all();
                    return Err(io::Error::new(io::ErrorKind::WouldBlock, msg));
                }
                Overflow::Block => {
                    st = self
                        .shared
                        .changed
                        .wait(st)
                        .unwrap_or_else(|e| e.into_inner());
                }
            }
        }
        st.queued += chunk.len();
        st.chunks.push_back(chunk);
        self.shared.changed.notify_all();
        Ok(())
    }

    /// The target's write error, if it had one.
    pub fn check(&self) -> io::Result<()> {
        if !self.shared.failed.load(Ordering::Acquire) {
            return Ok(());
        }
        match &self.shared.lock().error {
            Some((kind, msg)) => Err(io::Error::new(*kind, msg.clone())),
            None => Ok(()),
        }
    }

    /// Bytes the queued chunks hold allocated, against `queued` bytes of
    /// lines: what a stalled reader really costs.
    #[cfg(test)]
    pub fn queued_capacity(&self) -> (usize, usize) {
        let st = self.shared.lock();
        (st.chunks.iter().map(Vec::capacity).sum(), st.queued)
    }

    /// Lines dropped because the queue was full.
    pub fn dropped_lines(&self) -> u64 {
        self.shared.lock().dropped_lines
    }

    /// Waits until everything queued is written, but not past `deadline`
    /// nor longer than `stall` without any write completing.
    pub fn drain(&self, deadline: Instant, stall: Duration) -> Drained {
        let mut st = self.shared.lock();
        let mut seen = st.progress;
        let mut last_progress = Instant::now();
        loop {
            if st.queued == 0 || st.error.is_some() {
                return Drained {
                    done: true,
                    unwritten_lines: 0,
                };
            }
            if st.progress != seen {
                seen = st.progress;
                last_progress = Instant::now();
            }
            let now = Instant::now();
            let until = deadline.min(last_progress + stall);
            if now >= until {
                return Drained {
                    done: false,
                    unwritten_lines: st.writing.as_deref().map_or(0, |c| lines(c))
                        + st.chunks.iter().map(|c| lines(c)).sum::<u64>(),
                };
            }
            st = self
                .shared
                .changed
                .wait_timeout(st, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Drop for WriteQueue {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.changed.notify_all();
    }
}

/// memchr's vectorized search (bytewise it was a tenth of the process's
/// time per connection, when every chunk was counted).
fn lines(chunk: &[u8]) -> u64 {
    memchr::memchr_iter(b'\n', chunk).count() as u64
}

fn writer(shared: &Shared, mut target: Box<dyn Write + Send>) {
    loop {
        let chunk = {
            let mut st = shared.lock();
            while st.chunks.is_empty() && !st.closed && st.error.is_none() {
                st = shared.changed.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            if st.error.is_some() {
                return;
            }
            let Some(chunk) = st.chunks.pop_front() else {
                return;
            };
            let chunk = Arc::new(chunk);
            st.writing = Some(chunk.clone());
            chunk
        };
        let result = target.write_all(&chunk).and_then(|()| target.flush());
        let mut st = shared.lock();
        st.queued = st.queued.saturating_sub(chunk.len());
        st.writing = None;
        st.progress += 1;
        if let Err(e) = result {
            shared.fail(&mut st, (e.kind(), e.to_string()));
            st.chunks.clear();
            st.queued = 0;
        }
        shared.changed.notify_all();
        if st.error.is_some() {
            return;
        }
    }
}

/// An `io::Write` for the formatters that collects bytes and hands them to
/// a [`WriteQueue`] as whole lines: on `flush`, or once enough has piled up
/// (then up to the last newline). Its errors are the target's, reported on
/// the next write or flush after they happen.
pub struct QueueWriter {
    queue: WriteQueue,
    buf: Vec<u8>,
}

/// A chunk big enough that a write(2) per chunk costs nothing.
const CHUNK: usize = 256 * 1024;
/// A chunk's buffer: room for the line that takes it past [`CHUNK`].
const CHUNK_CAPACITY: usize = CHUNK + CHUNK / 4;

impl QueueWriter {
    pub fn new(queue: WriteQueue) -> Self {
        Self {
            queue,
            buf: Vec::new(),
        }
    }

    pub fn queue(&self) -> &WriteQueue {
        &self.queue
    }
}

impl Write for QueueWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        // Straight to a whole chunk: grown by doubling, every chunk was
        // copied ~6 times on its way to 256 KiB (callgrind: 1.6k
        // instructions per `ok` line).
        let want = self.buf.len() + data.len();
        if want > self.buf.capacity() {
            self.buf
                .reserve_exact(want.max(CHUNK_CAPACITY) - self.buf.len());
        }
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHUNK
            && let Some(last) = self.buf.iter().rposition(|&b| b == b'\n')
        {
            let mut next = Vec::with_capacity(CHUNK_CAPACITY);
            next.extend_from_slice(&self.buf[last + 1..]);
            self.buf.truncate(last + 1);
            self.queue.push(std::mem::replace(&mut self.buf, next))?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        // A tick's few lines leave in a vector of their size and the
        // chunk-sized buffer stays for the next ones: the queue's limit
        // counts bytes, not capacity, so a stalled reader must not collect
        // a mostly empty chunk per tick.
        let chunk = if self.buf.len() >= CHUNK / 2 {
            std::mem::take(&mut self.buf)
        } else {
            let few = self.buf.to_vec();
            self.buf.clear();
            few
        };
        self.queue.push(chunk)
    }
}

/// Our own descriptor for stdout: the writer thread never touches std's
/// `Stdout` (its buffer and lock), so exiting while that thread is stuck in
/// write(2) cannot block on them.
pub fn stdout_file() -> io::Result<File> {
    use std::os::fd::AsFd as _;
    Ok(File::from(io::stdout().as_fd().try_clone_to_owned()?))
}

/// Creates (truncates) an output file: see [`super::files::create_output`].
pub fn create_output(path: &Path) -> io::Result<File> {
    super::files::create_output(path)
}

/// [`stdout_file`] for stderr.
pub fn stderr_file() -> io::Result<File> {
    use std::os::fd::AsFd as _;
    Ok(File::from(io::stderr().as_fd().try_clone_to_owned()?))
}
