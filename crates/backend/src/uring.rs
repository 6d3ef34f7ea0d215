//! io_uring for file backends: reads, writes and `fdatasync` that would block (O_DIRECT,
//! page-cache misses, writes to a device) are submitted from the connection's own thread and
//! complete through an eventfd that the tokio reactor watches, so no I/O thread is woken per
//! command. Part of the syscall layer (with `sys.rs`): the only other file in the backends
//! with `unsafe`.
//!
//! Ownership rule (what makes the `unsafe` sound): from submission until its completion is
//! reaped, an operation's memory (its buffer, its file, whatever the caller asked to keep) is
//! owned by the ring's table, not by the future that asked for it. Dropping that future only
//! drops the receiver of the result; the buffer is freed when the kernel is done with it. A
//! ring torn down with operations still in flight (a runtime shut down under it) leaks their
//! buffers rather than free memory the kernel may still write.
//!
//! Completions: the kernel posts a read's or write's completion from the task that submitted
//! it (task work), which then signals the eventfd; a driver task on the tokio runtime of the
//! first operation reaps the queue and wakes the waiting futures, so a batch of completions
//! costs one wake-up of the runtime, not a hop through another thread per command.
#![allow(unsafe_code)]

use crate::Keep;
use bytes::Bytes;
use io_uring::{opcode, types, IoUring};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::{oneshot, Notify, OwnedSemaphorePermit, Semaphore};

/// Submission queue entries; at most this many operations are in flight per ring (the
/// completion queue has twice as many slots, so it never overflows).
const ENTRIES: u32 = 256;

/// Memory the kernel reads or writes while an operation is in flight: a buffer of its own
/// (a read's, or an aligned copy for O_DIRECT) or the caller's shared bytes.
#[derive(Debug)]
pub(crate) enum Buf {
    None,
    Owned(Vec<u8>),
    Shared(Bytes),
}

impl Buf {
    /// The bytes a write takes from.
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Buf::None => &[],
            Buf::Owned(v) => v,
            Buf::Shared(b) => b,
        }
    }
}

struct Pending {
    done: oneshot::Sender<Done>,
    buf: Buf,
    keep: Option<Keep>,
    _file: Arc<File>,
    _permit: OwnedSemaphorePermit,
}

/// An operation's result (a byte count or `-errno`) with the memory it owned.
type Done = (i32, Buf, Option<Keep>);

#[derive(Default)]
struct Table {
    ops: Vec<Option<Pending>>,
    free: Vec<usize>,
}

struct Shared {
    ring: IoUring,
    /// Guards the table and every access to the submission queue (one pusher at a time).
    table: Mutex<Table>,
    eventfd: OwnedFd,
    /// A driver task is running (on some tokio runtime).
    driving: AtomicBool,
    /// The eventfd could not be registered with a runtime: never submit (the thread pool
    /// does the I/O).
    unusable: AtomicBool,
    closing: AtomicBool,
    close: Notify,
}

impl Shared {
    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Take every completion off the queue and hand each result to its waiter.
    fn reap(&self) {
        let mut done = Vec::new();
        {
            let mut table = self.table();
            // SAFETY: only the driver task consumes the completion queue (one task, never
            // polled twice at once), and no other `CompletionQueue` exists while this one lives.
            let cq = unsafe { self.ring.completion_shared() };
            for cqe in cq {
                let idx = cqe.user_data() as usize;
                let op = table.ops.get_mut(idx).and_then(Option::take);
                if let Some(op) = op {
                    table.free.push(idx);
                    done.push((op, cqe.result()));
                }
            }
        }
        for (op, res) in done {
            let Pending {
                done, buf, keep, ..
            } = op;
            // The waiter may be gone (its future dropped): buffer and keep are dropped here.
            let _ = done.send((res, buf, keep));
        }
    }

    fn in_flight(&self) -> bool {
        self.table().ops.iter().any(Option::is_some)
    }

    /// Reset the eventfd's counter (non-blocking; nothing to read is fine).
    fn drain_eventfd(&self) {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into `v`, a live local of that size; the descriptor is the
        // eventfd this struct owns.
        let _ = unsafe {
            libc::read(
                self.eventfd.as_raw_fd(),
                (&mut v as *mut u64).cast::<libc::c_void>(),
                8,
            )
        };
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let table = self.table.get_mut().unwrap_or_else(|p| p.into_inner());
        for op in table.ops.drain(..).flatten() {
            // In flight when the ring goes away (its driver's runtime shut down): the kernel
            // may still write into the buffer, so it is never freed.
            std::mem::forget(op);
        }
    }
}

/// The eventfd, lent to tokio's reactor.
struct EventFd(Arc<Shared>);

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.eventfd.as_raw_fd()
    }
}

/// Clears `driving` when the driver task ends or is dropped with its runtime, so the next
/// operation starts a new one.
struct Driving(Arc<Shared>);

impl Drop for Driving {
    fn drop(&mut self) {
        self.0.driving.store(false, Ordering::Release);
    }
}

/// Register the eventfd with the current runtime's reactor; `None` where that cannot be done
/// (a runtime built without `enable_io`, whose reactor refuses by panicking).
fn register(shared: &Arc<Shared>) -> Option<tokio::io::unix::AsyncFd<EventFd>> {
    let shared = Arc::clone(shared);
    std::panic::catch_unwind(move || {
        // SAFETY: the eventfd is owned by `Shared`, which the `EventFd` keeps alive (an `Arc`)
        // for as long as the `AsyncFd` exists; nothing replaces or closes it in that time.
        unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(
                EventFd(shared),
                tokio::io::Interest::READABLE,
            )
        }
    })
    .ok()?
    .ok()
}

/// The driver task. `driving` comes in as an argument, so it is dropped with the future even
/// if a runtime shutting down drops the task before its first poll.
async fn drive(driving: Driving, afd: tokio::io::unix::AsyncFd<EventFd>) {
    let shared = &driving.0;
    loop {
        if shared.closing.load(Ordering::Acquire) && !shared.in_flight() {
            return;
        }
        tokio::select! {
            r = afd.readable() => match r {
                Ok(mut g) => {
                    shared.drain_eventfd();
                    g.clear_ready();
                }
                Err(_) => return,
            },
            _ = shared.close.notified() => {}
        }
        shared.reap();
    }
}

/// Why an operation could not be submitted.
#[derive(Debug)]
pub(crate) enum SubmitError {
    /// Not on a tokio runtime with I/O enabled: the caller runs the operation another way.
    NoRuntime,
    Io(io::Error),
}

/// One io_uring instance and its completion driver.
pub(crate) struct Ring {
    shared: Arc<Shared>,
    limit: Arc<Semaphore>,
    start: Mutex<()>,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ring")
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::Release);
        self.shared.close.notify_one();
    }
}

impl Ring {
    /// Set up a ring that supports read, write and fsync, with an eventfd for completions.
    /// Fails where io_uring is missing or disabled (`kernel.io_uring_disabled`, seccomp).
    pub(crate) fn new() -> io::Result<Ring> {
        // No IORING_SETUP_COOP_TASKRUN: with it the kernel queues a completion's task work on
        // the submitting thread without waking it (TWA_SIGNAL_NO_IPI), and the CQE and the
        // eventfd signal wait until that thread next enters the kernel. A tokio worker that
        // parks idle after submitting (a connection waiting on its one read) can sleep through
        // it for good: the read is never answered. Without the flag the completion wakes the
        // submitter (an IPI when it runs), which costs 13-24 % of O_DIRECT 4K IOPS on this VM
        // (docs/PERFORMANCE.md) and can never lose a completion.
        let mut b = IoUring::builder();
        b.setup_cqsize(ENTRIES * 2);
        let ring = b.build(ENTRIES)?;
        let mut probe = io_uring::Probe::new();
        ring.submitter().register_probe(&mut probe)?;
        for (code, name) in [
            (opcode::Read::CODE, "READ"),
            (opcode::Write::CODE, "WRITE"),
            (opcode::Fsync::CODE, "FSYNC"),
        ] {
            if !probe.is_supported(code) {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("io_uring without IORING_OP_{name}"),
                ));
            }
        }
        // SAFETY: eventfd(2) takes no pointers; a non-negative return is a new descriptor
        // that nothing else owns, so `OwnedFd` may take it.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: see above: `fd` is valid and owned by nobody else.
        let eventfd = unsafe { OwnedFd::from_raw_fd(fd) };
        ring.submitter().register_eventfd(eventfd.as_raw_fd())?;
        Ok(Ring {
            shared: Arc::new(Shared {
                ring,
                table: Mutex::new(Table::default()),
                eventfd,
                driving: AtomicBool::new(false),
                unusable: AtomicBool::new(false),
                closing: AtomicBool::new(false),
                close: Notify::new(),
            }),
            limit: Arc::new(Semaphore::new(ENTRIES as usize)),
            start: Mutex::new(()),
        })
    }

    /// Start the driver on the current tokio runtime if none runs; `Err(NoRuntime)` off a
    /// tokio runtime (or on one without I/O), where the caller must do its I/O another way.
    /// Nothing is submitted unless a driver is there to reap it.
    pub(crate) fn ensure_driver(&self) -> Result<(), SubmitError> {
        if self.shared.driving.load(Ordering::Acquire) {
            return Ok(());
        }
        if self.shared.unusable.load(Ordering::Relaxed) {
            return Err(SubmitError::NoRuntime);
        }
        let handle = tokio::runtime::Handle::try_current().map_err(|_| SubmitError::NoRuntime)?;
        // One starter at a time; `driving` is set only once a driver is really spawned, so
        // nobody submits into a ring that no driver will reap.
        let _start = self.start.lock().unwrap_or_else(|p| p.into_inner());
        if self.shared.driving.load(Ordering::Acquire) {
            return Ok(());
        }
        let Some(afd) = register(&self.shared) else {
            self.shared.unusable.store(true, Ordering::Relaxed);
            return Err(SubmitError::NoRuntime);
        };
        self.shared.driving.store(true, Ordering::Release);
        handle.spawn(drive(Driving(Arc::clone(&self.shared)), afd));
        Ok(())
    }

    /// Queue `entry` (whose memory `buf`, `file` and `keep` own) and wait for its result.
    ///
    /// # Safety
    /// Every pointer in `entry` must point into `buf`'s heap memory (which does not move when
    /// `buf` does) or be absent, with lengths inside it, and its descriptor must be `file`'s.
    async unsafe fn run(
        &self,
        entry: io_uring::squeue::Entry,
        buf: Buf,
        file: &Arc<File>,
        keep: Option<Keep>,
    ) -> Result<Done, SubmitError> {
        self.ensure_driver()?;
        let permit = Arc::clone(&self.limit)
            .acquire_owned()
            .await
            .map_err(|_| SubmitError::Io(io::Error::other("ring closed")))?;
        let (tx, rx) = oneshot::channel();
        {
            let mut table = self.shared.table();
            let idx = match table.free.pop() {
                Some(i) => i,
                None => {
                    table.ops.push(None);
                    table.ops.len() - 1
                }
            };
            if let Some(slot) = table.ops.get_mut(idx) {
                *slot = Some(Pending {
                    done: tx,
                    buf,
                    keep,
                    _file: Arc::clone(file),
                    _permit: permit,
                });
            }
            let entry = entry.user_data(idx as u64);
            // SAFETY: the table's lock is held, so this is the only access to the submission
            // queue; the entry's memory is owned by the table entry just filled (caller's
            // contract), which stays until the completion is reaped. The queue is dropped at
            // the end of the statement, publishing the new tail. It cannot be full: every push
            // is submitted before the lock is released, and the semaphore keeps the entries
            // not yet submitted (after a failed submit) below its size.
            if unsafe { self.shared.ring.submission_shared().push(&entry) }.is_err() {
                // Never pushed, so the kernel never saw its memory: the entry may go.
                table.ops.get_mut(idx).and_then(Option::take);
                table.free.push(idx);
                return Err(SubmitError::Io(io::Error::other(
                    "io_uring submission queue full",
                )));
            }
            self.submit().map_err(SubmitError::Io)?;
        }
        rx.await
            .map_err(|_| SubmitError::Io(io::Error::other("io_uring driver stopped")))
    }

    fn submit(&self) -> io::Result<()> {
        loop {
            match self.shared.ring.submit() {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Read up to `len` bytes at `offset` into `buf`'s spare capacity (after its current
    /// length); returns the buffer and how many bytes were appended (fewer only at the end of
    /// the file).
    pub(crate) async fn read_append(
        &self,
        file: &Arc<File>,
        mut buf: Vec<u8>,
        len: usize,
        offset: u64,
    ) -> Result<(Vec<u8>, usize), SubmitError> {
        let n =
            u32::try_from(len).map_err(|_| SubmitError::Io(io::Error::other("read too large")))?;
        buf.reserve(len);
        let ptr = buf.spare_capacity_mut().as_mut_ptr().cast::<u8>();
        let entry = opcode::Read::new(types::Fd(file.as_raw_fd()), ptr, n)
            .offset(offset)
            .build();
        // SAFETY: `ptr` is the start of `buf`'s spare capacity, at least `len` bytes (reserved
        // above); the Vec's heap block does not move when the Vec is moved into the table.
        let (res, back, _) = unsafe { self.run(entry, Buf::Owned(buf), file, None) }.await?;
        let Buf::Owned(mut buf) = back else {
            return Err(SubmitError::Io(io::Error::other(
                "io_uring returned another buffer",
            )));
        };
        if res < 0 {
            return Err(SubmitError::Io(io::Error::from_raw_os_error(-res)));
        }
        let got = (res as usize).min(len);
        let new_len = buf.len() + got;
        // SAFETY: the kernel wrote `got` bytes (its result, never more than `len`) at the start
        // of the spare capacity, and `new_len` is within the capacity reserved above.
        unsafe { buf.set_len(new_len) };
        Ok((buf, got))
    }

    /// Write `data.bytes()[range]` at `offset` (`dsync`: RWF_DSYNC); `keep` lives until the
    /// kernel is done and comes back with the buffer and the bytes written (fewer than asked:
    /// write the rest again).
    pub(crate) async fn write(
        &self,
        file: &Arc<File>,
        data: Buf,
        range: std::ops::Range<usize>,
        offset: u64,
        dsync: bool,
        keep: Option<Keep>,
    ) -> Result<(Buf, Option<Keep>, usize), SubmitError> {
        let bytes = data
            .bytes()
            .get(range)
            .ok_or_else(|| SubmitError::Io(io::Error::other("write range outside its buffer")))?;
        let n = u32::try_from(bytes.len())
            .map_err(|_| SubmitError::Io(io::Error::other("write too large")))?;
        let entry = opcode::Write::new(types::Fd(file.as_raw_fd()), bytes.as_ptr(), n)
            .offset(offset)
            .rw_flags(if dsync { libc::RWF_DSYNC } else { 0 })
            .build();
        // SAFETY: the entry points at `range` of the buffer moved into the table: a Vec's or a
        // `Bytes`' heap memory, which does not move with its owner and is not written while
        // shared.
        let (res, back, keep) = unsafe { self.run(entry, data, file, keep) }.await?;
        if res < 0 {
            return Err(SubmitError::Io(io::Error::from_raw_os_error(-res)));
        }
        Ok((back, keep, res as usize))
    }

    /// `fdatasync(file)`.
    pub(crate) async fn fdatasync(&self, file: &Arc<File>) -> Result<(), SubmitError> {
        let entry = opcode::Fsync::new(types::Fd(file.as_raw_fd()))
            .flags(types::FsyncFlags::DATASYNC)
            .build();
        // SAFETY: the entry carries no pointers; its descriptor is `file`'s.
        let (res, _, _) = unsafe { self.run(entry, Buf::None, file, None) }.await?;
        if res < 0 {
            return Err(SubmitError::Io(io::Error::from_raw_os_error(-res)));
        }
        Ok(())
    }
}
