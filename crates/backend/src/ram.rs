//! RAM: a sparse in-memory device of 512 KiB chunks. Memory is allocated per chunk on first
//! write, so a large RAM LUN costs only what is written; unmapping a whole chunk frees it.
//! Volatile by nature, and says so.
//!
//! A write of exactly one aligned chunk keeps the buffer the data arrived in as the chunk
//! instead of copying it (copying a 512 KiB write into a cold store cost a third of the
//! target's CPU); the whole-chunk pieces of a larger write are copied into blocks of their
//! own, so no chunk pins a larger buffer.
//!
//! Reads of [`ZERO_COPY_MIN`] bytes or more that lie in one allocated chunk are not copied:
//! the returned `Bytes` shares the chunk (Data-In goes from the store straight to the
//! socket); so are reads from [`SMALL_SHARE_MIN`] bytes while few of them are outstanding
//! ([`SMALL_SHARES_MAX`]). Chunks are copy-on-write: a write or unmap to a chunk that a read still holds
//! replaces the chunk with a modified copy, so the read keeps the contents it saw.
//!
//! Large reads of ranges with no chunk at all are not even read: on connections that allow
//! it they answer with a range of the process's empty, sealed zero file, which the transport
//! sends with `sendfile` as the kernel's zero page (`read_in_place`; `zeros_in_place` in the
//! crate root).

use crate::IntMap;
use crate::{BlockDevice, Capabilities, FileRange, InPlaceRead, IoFuture, WriteMode};
use bytes::{Bytes, BytesMut};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

const CHUNK_SHIFT: u32 = 19; // 512 KiB chunks
const CHUNK: u64 = 1 << CHUNK_SHIFT;
const SHARDS: usize = 64;
/// Unmapped chunk memory that is handed back to the kernel at once (see `unmap_sync`).
const TRIM_AFTER: u64 = 64 << 20;

/// How the process allocator hands its free memory back to the kernel where it does not do
/// so by itself while the process is idle; set by whoever installs that allocator
/// ([`set_free_memory_release`]).
static FREE_MEMORY_RELEASE: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

/// Have the RAM store call `release` whenever it has freed [`TRIM_AFTER`] bytes of chunks, to
/// hand the process allocator's free memory back to the kernel so unmapping a RAM LUN really
/// shrinks the process: the `ironsan` binary sets mimalloc's `mi_collect` (mimalloc gives
/// freed memory back by itself only while the process keeps allocating; an idle target would
/// keep it). glibc's `malloc_trim` is called after it in any case, for chunks in glibc's heap
/// (under the system allocator, as in this crate's own tests). Set once: a later call changes
/// nothing and returns `false`.
pub fn set_free_memory_release(release: fn()) -> bool {
    FREE_MEMORY_RELEASE.set(release).is_ok()
}

/// Hand the allocator's free memory back to the kernel ([`set_free_memory_release`]).
fn release_free_memory() {
    if let Some(release) = FREE_MEMORY_RELEASE.get() {
        release();
    }
    crate::sys::malloc_trim();
}

/// Reads at least this long (within one allocated chunk) share the chunk instead of copying.
/// Smaller reads copy: the copy is cheap, a shared chunk makes the next write to it copy the
/// whole chunk, and a read holding a chunk keeps a whole chunk alive while the transmit budget
/// counts only the read's length (at this size at most 4x what the budget says).
const ZERO_COPY_MIN: usize = CHUNK as usize / 4;

/// Smaller reads, from this size, share their chunk too while fewer than [`SMALL_SHARES_MAX`]
/// such reads are outstanding in the process; past that they copy. Sharing a 4 KiB read spares
/// its allocation and the copy out of a cold store (5-9 % of the target's CPU per 4K random
/// read, docs/PERFORMANCE.md), and such a read is held only until its Data-In is written to
/// the socket, usually within the same receive. The cap is what keeps it safe: a small read
/// can keep a whole chunk alive (should a write replace the chunk meanwhile) while the
/// transmit budget counts only its length, so an initiator that stops reading its socket could
/// otherwise pin thousands of chunks per connection; with the cap, reads pin at most
/// `SMALL_SHARES_MAX` chunks (128 MiB) beyond the store, whatever the initiators do.
const SMALL_SHARE_MIN: usize = 4096;
const SMALL_SHARES_MAX: usize = 256;

/// Outstanding small reads that share a chunk, in every RAM LUN of the process.
static SMALL_SHARES: AtomicUsize = AtomicUsize::new(0);

type Chunk = Arc<Box<[u8]>>;

/// A chunk as the owner of a `Bytes` a read returns.
struct SharedChunk(Chunk);

impl AsRef<[u8]> for SharedChunk {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// A chunk shared by a read under [`SMALL_SHARE_MIN`]..[`ZERO_COPY_MIN`] bytes, counted in
/// [`SMALL_SHARES`] until the read's bytes are dropped.
struct SmallShare(Chunk);

impl SmallShare {
    /// A share of `chunk` for a read of `len` bytes, if it is long enough and fewer than
    /// [`SMALL_SHARES_MAX`] are outstanding. The check and
    /// the count are two steps, so concurrent readers may pass the cap by one each.
    fn try_new(chunk: &Chunk, len: usize) -> Option<SmallShare> {
        if len < SMALL_SHARE_MIN || SMALL_SHARES.load(Ordering::Relaxed) >= SMALL_SHARES_MAX {
            return None;
        }
        SMALL_SHARES.fetch_add(1, Ordering::Relaxed);
        Some(SmallShare(Arc::clone(chunk)))
    }
}

impl AsRef<[u8]> for SmallShare {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for SmallShare {
    fn drop(&mut self) {
        SMALL_SHARES.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A sparse RAM disk.
pub struct RamBackend {
    size: AtomicU64,
    shards: Vec<RwLock<IntMap<u64, Chunk>>>,
    /// Bytes of chunks unmapped since free memory was last given back to the kernel.
    freed_since_trim: AtomicU64,
}

impl std::fmt::Debug for RamBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RamBackend")
            .field("size", &self.size())
            .finish()
    }
}

/// Split `[offset, offset+len)` into per-chunk pieces: (chunk index, offset in chunk, length).
fn pieces(offset: u64, len: u64) -> impl Iterator<Item = (u64, usize, usize)> {
    let mut pos = offset;
    let end = offset.saturating_add(len);
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let idx = pos >> CHUNK_SHIFT;
        let within = pos & (CHUNK - 1);
        let n = (CHUNK - within).min(end - pos);
        pos += n;
        Some((idx, within as usize, n as usize))
    })
}

/// Whether `b` is all zeros. OR-folds fixed-size blocks (which the compiler turns into vector
/// instructions) and stops at the first block with a bit set; a byte-wise `all` with its early
/// exit does not vectorise and cost more than the copy it tries to avoid.
fn is_zero(b: &[u8]) -> bool {
    let mut blocks = b.chunks_exact(256);
    let blocks_zero = blocks
        .by_ref()
        .all(|c| c.iter().fold(0u8, |acc, &x| acc | x) == 0);
    blocks_zero && blocks.remainder().iter().all(|&x| x == 0)
}

impl RamBackend {
    pub fn new(size: u64) -> Self {
        RamBackend {
            size: AtomicU64::new(size),
            shards: (0..SHARDS)
                .map(|_| RwLock::new(IntMap::default()))
                .collect(),
            freed_since_trim: AtomicU64::new(0),
        }
    }

    fn shard(&self, idx: u64) -> &RwLock<IntMap<u64, Chunk>> {
        &self.shards[(idx as usize) % SHARDS]
    }

    /// Whether chunk `idx` is allocated (written and not unmapped since).
    fn has_chunk(&self, idx: u64) -> bool {
        self.shard(idx)
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(&idx)
    }

    /// Bytes of memory currently allocated for data.
    pub fn allocated(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| s.read().map(|m| m.len() as u64).unwrap_or(0) * CHUNK)
            .sum()
    }

    fn read_sync(&self, offset: u64, len: usize) -> Bytes {
        let mut it = pieces(offset, len as u64);
        if let (Some((idx, within, n)), None) = (it.next(), it.next()) {
            // Within one chunk (the usual case): one lookup.
            let shard = self.shard(idx).read().unwrap_or_else(|p| p.into_inner());
            return match shard.get(&idx) {
                Some(chunk) if len >= ZERO_COPY_MIN => {
                    Bytes::from_owner(SharedChunk(Arc::clone(chunk))).slice(within..within + n)
                }
                Some(chunk) => match SmallShare::try_new(chunk, len) {
                    Some(share) => Bytes::from_owner(share).slice(within..within + n),
                    None => Bytes::copy_from_slice(&chunk[within..within + n]),
                },
                None => {
                    drop(shard);
                    crate::zeros(len)
                }
            };
        }
        // A read that starts in a hole takes zeroed memory (calloc: fresh pages cost no
        // memset) and copies the allocated pieces over it; one that starts in data appends
        // piece by piece (allocated chunks copied, holes zero-filled, nothing written twice).
        let starts_in_hole = pieces(offset, len as u64)
            .next()
            .is_some_and(|(idx, _, _)| !self.has_chunk(idx));
        if starts_in_hole {
            let mut out = BytesMut::zeroed(len);
            let mut at = 0usize;
            for (idx, within, n) in pieces(offset, len as u64) {
                let shard = self.shard(idx).read().unwrap_or_else(|p| p.into_inner());
                if let Some(chunk) = shard.get(&idx) {
                    out[at..at + n].copy_from_slice(&chunk[within..within + n]);
                }
                at += n;
            }
            return out.freeze();
        }
        let mut out = BytesMut::with_capacity(len);
        for (idx, within, n) in pieces(offset, len as u64) {
            let shard = self.shard(idx).read().unwrap_or_else(|p| p.into_inner());
            match shard.get(&idx) {
                Some(chunk) => out.extend_from_slice(&chunk[within..within + n]),
                None => out.resize(out.len() + n, 0),
            }
        }
        out.freeze()
    }

    fn write_sync(&self, offset: u64, data: Bytes) {
        // Each piece is split off the front; the last (usually the only) one is the caller's
        // buffer itself, so a write of exactly one aligned chunk arrives at `put` whole.
        let alone = data.len() as u64 == CHUNK;
        let mut rest = data;
        for (idx, within, n) in pieces(offset, rest.len() as u64) {
            self.put(idx, within, rest.split_to(n), alone);
        }
    }

    /// Write `src` at `within` in chunk `idx`. A piece that is a whole chunk becomes the
    /// chunk: when it is the whole write (`alone`) and this is the only reference to its
    /// buffer (the server's Data-Out buffer of a 512 KiB write), that buffer is kept instead
    /// of copied; otherwise it is copied once into a chunk-sized block (a piece of a larger
    /// buffer is not kept: shrinking that buffer in place is up to the allocator, and
    /// mimalloc keeps the whole block). The chunk it replaces is dropped, or lives on in a
    /// read that still holds it. A smaller piece is copied into the chunk.
    fn put(&self, idx: u64, within: usize, src: Bytes, alone: bool) {
        let mut shard = self.shard(idx).write().unwrap_or_else(|p| p.into_inner());
        let whole = src.len() as u64 == CHUNK;
        if !whole {
            if let Some(chunk) = shard.get_mut(&idx) {
                // Copy-on-write: a read may still hold this chunk.
                Arc::make_mut(chunk)[within..within + src.len()].copy_from_slice(&src);
                return;
            }
        }
        if !shard.contains_key(&idx) && is_zero(&src) {
            return; // zeros over a hole change nothing observable
        }
        let chunk: Box<[u8]> = if whole && alone {
            let v = Vec::from(src);
            if v.capacity() == v.len() {
                v.into_boxed_slice()
            } else {
                Box::from(&v[..])
            }
        } else if whole {
            Box::from(&src[..])
        } else {
            let mut c = vec![0u8; CHUNK as usize].into_boxed_slice();
            c[within..within + src.len()].copy_from_slice(&src);
            c
        };
        shard.insert(idx, Arc::new(chunk));
    }

    fn unmap_sync(&self, offset: u64, len: u64) {
        let mut freed = 0u64;
        for (idx, within, n) in pieces(offset, len) {
            let mut shard = self.shard(idx).write().unwrap_or_else(|p| p.into_inner());
            if within == 0 && n as u64 == CHUNK {
                if shard.remove(&idx).is_some() {
                    freed += CHUNK;
                }
            } else if let Some(chunk) = shard.get_mut(&idx) {
                Arc::make_mut(chunk)[within..within + n].fill(0);
            }
        }
        // Chunks live in the allocator's heap (they may be adopted I/O buffers), and the
        // allocator keeps freed heap memory for reuse: once enough has been freed, hand the
        // free pages back to the kernel so unmapping a RAM LUN really shrinks the process.
        if freed > 0
            && self.freed_since_trim.fetch_add(freed, Ordering::Relaxed) + freed >= TRIM_AFTER
        {
            self.freed_since_trim.store(0, Ordering::Relaxed);
            release_free_memory();
        }
    }
}

impl BlockDevice for RamBackend {
    fn kind(&self) -> &'static str {
        "ram"
    }
    fn size(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }
    /// Shrinking frees the chunks past the new end and zeroes the rest of the last one, so
    /// growing again reads zeros.
    fn resize(&self, new_size: u64) -> Result<(), crate::BackendError> {
        let old = self.size.swap(new_size, Ordering::AcqRel);
        if new_size < old {
            self.unmap_sync(new_size, old - new_size);
        }
        Ok(())
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            volatile: true,
            unmap: true,
            alignment: 1,
            discards_writes: false,
            write_zeroes: false,
        }
    }
    fn read(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
        let data = self.read_sync(offset, len);
        Box::pin(async move { Ok(data) })
    }
    /// A range with no allocated chunk (nothing written there yet, or unmapped) is sent from
    /// the shared zero file when the connection allows it (no copy at all);
    /// anything else is read as usual. A write that lands after this answer is concurrent
    /// with the read, which may then return either contents, as SAM allows for overlapping
    /// commands (the copy-on-write chunks give a read the contents at its start too).
    /// The zero file is asked for first, so a connection or kernel that cannot use it pays no
    /// chunk lookups here.
    fn read_in_place(&self, offset: u64, len: usize, how: InPlaceRead) -> Option<FileRange> {
        let zeros = crate::zeros_in_place(len, how)?;
        pieces(offset, len as u64)
            .all(|(idx, _, _)| !self.has_chunk(idx))
            .then_some(zeros)
    }
    fn write(&self, offset: u64, data: Bytes, _mode: WriteMode) -> IoFuture<'_, ()> {
        self.write_sync(offset, data);
        Box::pin(async { Ok(()) })
    }
    fn flush(&self) -> IoFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }
    fn unmap(&self, offset: u64, len: u64) -> IoFuture<'_, ()> {
        self.unmap_sync(offset, len);
        Box::pin(async { Ok(()) })
    }
    /// Allocated 512 KiB chunks are mapped, the rest deallocated.
    fn map_status(&self, offset: u64, len: u64) -> IoFuture<'_, Vec<(u64, u64, bool)>> {
        let mut out = Vec::new();
        let mut pos = offset;
        for (idx, _within, n) in pieces(offset, len) {
            crate::push_extent(&mut out, pos, n as u64, self.has_chunk(idx));
            pos += n as u64;
        }
        Box::pin(async move { Ok(out) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn holes_answer_from_a_sealed_zero_file_and_data_does_not() {
        use std::os::unix::fs::FileExt;
        let be = RamBackend::new(2 << 30);
        be.write(CHUNK, Bytes::from(vec![9u8; 4096]), WriteMode::Cached)
            .await
            .unwrap();
        if !crate::zero_page_reads_supported() {
            let hole = be.read_in_place(2 * CHUNK, 2 << 20, crate::SendFrom::PageCache.into());
            assert!(hole.is_none(), "before Linux 6.5 holes are copied");
            return;
        }
        let zero_page = InPlaceRead {
            min: 0,
            from: crate::SendFrom::Mapping,
            zero_page: true,
        };
        let r = be
            .read_in_place(2 * CHUNK, 2 << 20, zero_page)
            .expect("four chunks never written: the zero file");
        assert_eq!((r.offset, r.len), (0, 2 << 20));
        assert!(r.map.is_none(), "sent with sendfile");
        let mut got = vec![1u8; 2 << 20];
        r.file.read_exact_at(&mut got, r.offset).unwrap();
        assert!(is_zero(&got), "the zero file reads as zeros");
        let e = r.file.write_at(b"x", 0).expect_err("sealed against writes");
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        assert_eq!(r.file.metadata().unwrap().len(), 1 << 30);

        assert!(
            be.read_in_place(0, 2 * CHUNK as usize, zero_page).is_none(),
            "a range with a written chunk is read as usual"
        );
        let no = InPlaceRead {
            zero_page: false,
            ..zero_page
        };
        assert!(be.read_in_place(2 * CHUNK, 4096, no).is_none());
        assert!(
            be.read_in_place(0, (1 << 30) + 4096, zero_page).is_none(),
            "longer than the zero file"
        );
        // Unmapping the written chunk makes it a hole again.
        be.unmap(CHUNK, CHUNK).await.unwrap();
        assert!(be.read_in_place(0, 4 * CHUNK as usize, zero_page).is_some());
    }

    #[test]
    fn is_zero_sees_a_single_set_bit_anywhere() {
        for len in [0usize, 1, 255, 256, 257, 4096, 4097, 65_536 + 13] {
            let mut b = vec![0u8; len];
            assert!(is_zero(&b), "len {len}");
            for at in [0, len / 2, len.saturating_sub(1)] {
                if at < len {
                    b[at] = 0x10;
                    assert!(!is_zero(&b), "len {len}, bit at {at}");
                    b[at] = 0;
                }
            }
        }
    }

    #[tokio::test]
    async fn hole_reads_are_zeros_from_the_shared_buffer_and_see_later_writes() {
        let ram = RamBackend::new(4 * CHUNK);
        for (offset, len) in [
            (0u64, 512usize),
            (4096, 4096),
            (CHUNK - 4096, 4096),
            (0, CHUNK as usize),
        ] {
            let got = ram.read(offset, len).await.unwrap();
            assert_eq!(got.len(), len);
            assert!(is_zero(&got), "hole read at {offset}+{len}");
            // Within one chunk a hole read allocates nothing: it is the shared zeros.
            assert_eq!(got.as_ptr(), crate::zeros(1).as_ptr(), "at {offset}+{len}");
        }
        // Reads spanning chunks and holes still assemble zeros and data.
        ram.write(CHUNK, Bytes::from(vec![7u8; 4096]), WriteMode::Durable)
            .await
            .unwrap();
        let got = ram.read(CHUNK - 4096, 3 * 4096).await.unwrap();
        assert!(is_zero(&got[..4096]));
        assert!(got[4096..8192].iter().all(|&b| b == 7));
        assert!(is_zero(&got[8192..]));
        // A hole elsewhere still reads as zeros after chunk 1 was written.
        assert!(is_zero(&ram.read(2 * CHUNK, 4096).await.unwrap()));
    }

    #[tokio::test]
    async fn large_reads_share_chunks_and_writes_copy_on_write() {
        let ram = RamBackend::new(4 * CHUNK);
        let a: Vec<u8> = (0..2 * CHUNK as usize).map(|i| (i % 251) as u8).collect();
        ram.write(0, Bytes::from(a.clone()), WriteMode::Durable)
            .await
            .unwrap();
        // 512 KiB inside chunk 0 (shared), and 512 KiB across chunks 0/1 (copied).
        let inside = ram.read(4096, 512 * 1024).await.unwrap();
        let across = ram.read(CHUNK - 4096, 512 * 1024).await.unwrap();
        assert_eq!(&inside[..], &a[4096..4096 + 512 * 1024]);
        assert_eq!(&across[..], &a[(CHUNK - 4096) as usize..][..512 * 1024]);
        // Overwrite both ranges and unmap part of chunk 0: what was read stays as it was.
        ram.write(
            0,
            Bytes::from(vec![0xee; 2 * CHUNK as usize]),
            WriteMode::Durable,
        )
        .await
        .unwrap();
        ram.unmap(8192, 4096).await.unwrap();
        assert_eq!(&inside[..], &a[4096..4096 + 512 * 1024]);
        assert_eq!(&across[..], &a[(CHUNK - 4096) as usize..][..512 * 1024]);
        // And new reads see the new contents.
        let now = ram.read(4096, 512 * 1024).await.unwrap();
        assert!(now[..4096].iter().all(|&b| b == 0xee));
        assert!(now[4096..8192].iter().all(|&b| b == 0));
        assert!(now[8192..].iter().all(|&b| b == 0xee));
        // A chunk nobody holds is written in place: still one chunk per MiB.
        drop((inside, across, now));
        assert_eq!(ram.allocated(), 2 * CHUNK);
    }

    #[tokio::test]
    async fn small_reads_share_chunks_up_to_a_cap_and_keep_what_they_saw() {
        let ram = RamBackend::new(4 * CHUNK);
        let a: Vec<u8> = (0..CHUNK as usize).map(|i| (i % 253) as u8).collect();
        ram.write(0, Bytes::from(a.clone()), WriteMode::Durable)
            .await
            .unwrap();
        // Hold more small reads of one block than the cap allows to share: two reads of the
        // same bytes have the same address only if both share the chunk.
        let held: Vec<Bytes> = (0..SMALL_SHARES_MAX + 64)
            .map(|_| ram.read_sync(8192, 4096))
            .collect();
        let first = held[0].as_ptr();
        let shared = held.iter().filter(|b| b.as_ptr() == first).count();
        assert!(shared > 1, "small reads share the chunk");
        // Other tests may hold shares too, so more than 64 may copy, never fewer.
        assert!(
            shared <= SMALL_SHARES_MAX + 1,
            "{shared} shared, over the cap"
        );
        assert!(held.iter().all(|b| b[..] == a[8192..8192 + 4096]));
        // A write to the chunk they hold leaves every read as it was (copy-on-write).
        ram.write(8192, Bytes::from(vec![0x5a; 4096]), WriteMode::Durable)
            .await
            .unwrap();
        assert!(held.iter().all(|b| b[..] == a[8192..8192 + 4096]));
        assert!(ram.read_sync(8192, 4096).iter().all(|&b| b == 0x5a));
        // Reads under the minimum copy, and dropping the reads gives the shares back.
        let tiny = (ram.read_sync(0, 512), ram.read_sync(0, 512));
        assert_ne!(tiny.0.as_ptr(), tiny.1.as_ptr());
        drop(held);
        let again = (ram.read_sync(0, 4096), ram.read_sync(0, 4096));
        assert_eq!(again.0.as_ptr(), again.1.as_ptr(), "shares given back");
        assert_eq!(&again.0[..], &a[..4096]);
    }

    #[tokio::test]
    async fn zero_writes_to_unallocated_chunks_allocate_nothing() {
        let ram = RamBackend::new(4 * CHUNK);
        ram.write(
            0,
            Bytes::from(vec![0u8; CHUNK as usize]),
            WriteMode::Durable,
        )
        .await
        .unwrap();
        assert_eq!(ram.allocated(), 0);
        let mut data = vec![0u8; 4096];
        data[4095] = 1;
        ram.write(CHUNK, Bytes::from(data), WriteMode::Durable)
            .await
            .unwrap();
        assert_eq!(ram.allocated(), CHUNK);
    }

    #[tokio::test]
    async fn reads_back_writes_across_chunks_and_zeros_elsewhere() {
        let ram = RamBackend::new(8 * CHUNK);
        let data: Vec<u8> = (0..3 * CHUNK as usize)
            .map(|i| (i % 251) as u8 + 1)
            .collect();
        ram.write(CHUNK / 2, Bytes::from(data.clone()), WriteMode::Durable)
            .await
            .unwrap();
        let back = ram.read(CHUNK / 2, data.len()).await.unwrap();
        assert_eq!(&back[..], &data[..]);
        let zeros = ram.read(6 * CHUNK, 4096).await.unwrap();
        assert!(zeros.iter().all(|&b| b == 0));
        assert_eq!(ram.allocated(), 4 * CHUNK);
        ram.unmap(0, 8 * CHUNK).await.unwrap();
        assert_eq!(ram.allocated(), 0);
        assert!(ram
            .read(CHUNK / 2, 100)
            .await
            .unwrap()
            .iter()
            .all(|&b| b == 0));
    }

    #[tokio::test]
    async fn map_status_reports_allocated_chunks_as_mapped() {
        let ram = RamBackend::new(4 * CHUNK);
        ram.write(CHUNK + 5, Bytes::from(vec![1u8; 10]), WriteMode::Durable)
            .await
            .unwrap();
        let m = ram.map_status(0, 4 * CHUNK).await.unwrap();
        assert_eq!(
            m,
            vec![
                (0, CHUNK, false),
                (CHUNK, CHUNK, true),
                (2 * CHUNK, 2 * CHUNK, false)
            ]
        );
        ram.unmap(0, 4 * CHUNK).await.unwrap();
        assert_eq!(
            ram.map_status(512, 1024).await.unwrap(),
            vec![(512, 1024, false)]
        );
    }

    #[tokio::test]
    async fn huge_sparse_device_costs_nothing_until_written() {
        let ram = RamBackend::new(16 << 40);
        ram.write(
            (16 << 40) - 512,
            Bytes::from(vec![7u8; 512]),
            WriteMode::Durable,
        )
        .await
        .unwrap();
        assert_eq!(ram.allocated(), CHUNK);
        assert_eq!(
            &ram.read((16 << 40) - 512, 512).await.unwrap()[..],
            &[7u8; 512][..]
        );
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
    }

    #[tokio::test]
    async fn whole_chunk_writes_keep_the_buffer_and_stay_copy_on_write() {
        let ram = RamBackend::new(4 * CHUNK);
        // The only reference to a chunk-sized buffer: it becomes the chunk, not copied.
        let data = Bytes::from(pattern(CHUNK as usize, 1));
        let at = data.as_ptr();
        ram.write(CHUNK, data, WriteMode::Durable).await.unwrap();
        let back = ram.read(CHUNK, CHUNK as usize).await.unwrap();
        assert_eq!(back.as_ptr(), at, "the chunk is the written buffer");
        assert!(back[..] == pattern(CHUNK as usize, 1)[..]);
        // A buffer the caller still holds is copied: the caller's bytes and the chunk differ
        // in identity, agree in content.
        let kept = Bytes::from(pattern(CHUNK as usize, 2));
        ram.write(2 * CHUNK, kept.clone(), WriteMode::Durable)
            .await
            .unwrap();
        let back2 = ram.read(2 * CHUNK, CHUNK as usize).await.unwrap();
        assert_ne!(back2.as_ptr(), kept.as_ptr());
        assert!(back2[..] == kept[..]);
        // A small write into the adopted chunk while a read holds it: the read keeps what it
        // saw, a new read sees the change.
        ram.write(
            CHUNK + 4096,
            Bytes::from(vec![0xAB; 4096]),
            WriteMode::Durable,
        )
        .await
        .unwrap();
        assert!(back[..] == pattern(CHUNK as usize, 1)[..]);
        let now = ram.read(CHUNK, CHUNK as usize).await.unwrap();
        assert!(now[4096..8192].iter().all(|&b| b == 0xAB));
        assert!(now[..4096] == back[..4096] && now[8192..] == back[8192..]);
        // A chunk-sized write that is not aligned is split and copied like any other.
        let off = Bytes::from(pattern(CHUNK as usize, 3));
        ram.write(CHUNK / 2, off.clone(), WriteMode::Durable)
            .await
            .unwrap();
        let back3 = ram.read(CHUNK / 2, CHUNK as usize).await.unwrap();
        assert!(back3[..] == off[..]);
        // Zeros over a hole allocate nothing, whole chunk or not.
        let before = ram.allocated();
        ram.write(
            3 * CHUNK,
            Bytes::from(vec![0u8; CHUNK as usize]),
            WriteMode::Durable,
        )
        .await
        .unwrap();
        assert_eq!(ram.allocated(), before);
    }

    #[tokio::test]
    async fn pieces_of_a_larger_write_are_copied_into_blocks_of_their_own() {
        // A 2 MiB write is four whole chunks; none may keep (a part of) the 2 MiB buffer, or a
        // chunk would pin the whole block in an allocator that does not shrink in place.
        let ram = RamBackend::new(4 * CHUNK);
        let data = Bytes::from(pattern(4 * CHUNK as usize, 4));
        let span = data.as_ptr() as usize..data.as_ptr() as usize + data.len();
        ram.write(0, data, WriteMode::Durable).await.unwrap();
        for i in 0..4 {
            let back = ram.read(i * CHUNK, CHUNK as usize).await.unwrap();
            assert!(
                !span.contains(&(back.as_ptr() as usize)),
                "chunk {i} lives in the written buffer"
            );
            let want = pattern(4 * CHUNK as usize, 4);
            assert!(back[..] == want[(i * CHUNK) as usize..][..CHUNK as usize]);
        }
    }

    fn rss_kib() -> u64 {
        std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap()
    }

    /// Chunks live in the heap (adopted I/O buffers do); unmapping many of them gives the
    /// memory back to the kernel instead of leaving it in the allocator's free lists.
    #[tokio::test]
    async fn unmapping_many_chunks_shrinks_the_process() {
        // 256 MiB. Freeing one large mapped buffer first raises glibc's dynamic mmap
        // threshold above the chunk size, so the chunks come from the heap as in the server.
        const N: u64 = 512;
        drop(std::hint::black_box(vec![1u8; 4 << 20]));
        let ram = RamBackend::new(N * CHUNK);
        // Small allocations kept alive between the chunks, as a busy server has them: the
        // freed chunks cannot merge into the top of the heap and shrink it by themselves.
        let mut pins = Vec::new();
        for i in 0..N {
            ram.write(
                i * CHUNK,
                Bytes::from(pattern(CHUNK as usize, 5)),
                WriteMode::Durable,
            )
            .await
            .unwrap();
            pins.push(std::hint::black_box(Box::new([i as u8; 64])));
        }
        let full = rss_kib();
        ram.unmap(0, N * CHUNK).await.unwrap();
        let after = rss_kib();
        drop(pins);
        assert_eq!(ram.allocated(), 0);
        assert!(
            full.saturating_sub(after) >= 128 * 1024,
            "RSS {full} KiB with 256 MiB written, {after} KiB after unmapping it all"
        );
    }
}
