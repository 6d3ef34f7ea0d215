//! The process allocator: mimalloc behind our own `GlobalAlloc` front ([`Allocator`]), and the
//! release of its free memory the RAM store asks for ([`release_free_memory`]). The binary's
//! only `unsafe`, each block with its reason.
#![allow(unsafe_code)]

/// The process allocator (`#[global_allocator]` in `main.rs`): mimalloc
/// (<https://github.com/microsoft/mimalloc>, MIT), run without transparent huge pages (see
/// [`ironsan_backend::no_transparent_huge_pages`], which `main` calls first).
///
/// Why (docs/PERFORMANCE.md, "mimalloc"): a command still allocates a few buffers (a read's
/// Data-In, a write's Data-Out, the RAM store's 512 KiB chunks); against glibc's allocator
/// the same binary took about a tenth less CPU per 4K read or write and per 512K read, with
/// the same memory per idle session. glibc kept no freed 512 KiB buffer for reuse unless
/// told to (`mallopt`, which is unsafe once threads run); mimalloc does by itself.
///
/// Rust asks every allocation with its alignment. mimalloc's `mi_malloc_aligned` (what the
/// `mimalloc` crate calls for all of them) takes a slow generic path for any block over 1 KiB,
/// whatever the alignment: a 4 KiB read buffer cost about 250 instructions more than with
/// `mi_malloc` (callgrind, docs/PERFORMANCE.md). mimalloc's blocks are 16-byte aligned once
/// they are 16 bytes or more (`MI_MAX_ALIGN_SIZE`, the first block of a page starts 16-aligned
/// and every size class from 16 bytes is a multiple of 16) and 8-aligned below, so a layout
/// whose alignment is at most 16 and at most its size gets plain `mi_malloc`, as std's own
/// `System` allocator does with `malloc`; anything else the aligned calls.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Allocator;

/// The largest alignment plain `mi_malloc` guarantees (mimalloc's `MI_MAX_ALIGN_SIZE`) for a
/// block at least that large; smaller power-of-two sizes are aligned to their size.
const MI_MIN_ALIGN: usize = 16;

impl Allocator {
    /// Whether a block of `size` bytes from plain `mi_malloc`/`mi_zalloc`/`mi_realloc` is
    /// aligned to `align` (the rule above); the one place `alloc`, `alloc_zeroed` and
    /// `realloc` decide between the plain and the `_aligned` calls.
    #[inline]
    fn plain(align: usize, size: usize) -> bool {
        align <= MI_MIN_ALIGN && align <= size
    }
}

// SAFETY: every block handed out comes from mimalloc with at least the layout's size and
// alignment (`plain` above gives the rule under which `mi_malloc`'s natural alignment
// suffices; other layouts use the `_aligned` calls), and every block is returned to mimalloc
// with `mi_free`, which accepts blocks from any of these calls. mimalloc is thread-safe.
unsafe impl std::alloc::GlobalAlloc for Allocator {
    #[inline]
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        use libmimalloc_sys as mi;
        // SAFETY: plain calls into mimalloc with a size and a power-of-two alignment.
        unsafe {
            if Self::plain(layout.align(), layout.size()) {
                mi::mi_malloc(layout.size()).cast()
            } else {
                mi::mi_malloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        use libmimalloc_sys as mi;
        // SAFETY: as in `alloc`; the block comes back zeroed.
        unsafe {
            if Self::plain(layout.align(), layout.size()) {
                mi::mi_zalloc(layout.size()).cast()
            } else {
                mi::mi_zalloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: std::alloc::Layout) {
        // SAFETY: the caller passes a block this allocator returned (GlobalAlloc's contract),
        // i.e. one from mimalloc, which `mi_free` takes whatever call made it.
        unsafe { libmimalloc_sys::mi_free(ptr.cast()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        use libmimalloc_sys as mi;
        // SAFETY: `ptr` is a live block of this allocator (the caller's contract); the new
        // block keeps the old alignment under the same rule as `alloc`.
        unsafe {
            if Self::plain(layout.align(), new_size) {
                mi::mi_realloc(ptr.cast(), new_size).cast()
            } else {
                mi::mi_realloc_aligned(ptr.cast(), new_size, layout.align()).cast()
            }
        }
    }
}

/// Hand mimalloc's free memory back to the kernel (`mi_collect`): the RAM store calls it after
/// a RAM LUN freed many chunks ([`ironsan_backend::set_free_memory_release`]), so the process
/// really shrinks. mimalloc gives freed memory back on its own only while the process keeps
/// allocating; an idle target would keep it.
pub(crate) fn release_free_memory() {
    // SAFETY: mi_collect takes no pointers; it walks mimalloc's own structures (each
    // thread's heap is only collected by its thread; the arenas under their locks) and
    // returns unused pages to the kernel.
    unsafe { libmimalloc_sys::mi_collect(true) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::{GlobalAlloc, Layout};

    /// Every layout a program can ask for comes back aligned, usable to its full size,
    /// zeroed when asked, and keeps its bytes and alignment through `realloc`, on both paths
    /// (plain `mi_malloc` and the aligned calls). Each size is allocated many times so blocks
    /// come from different places in mimalloc's pages.
    #[test]
    fn allocator_honours_every_alignment_and_keeps_bytes_through_realloc() {
        let a = Allocator;
        let sizes = [
            1usize,
            2,
            3,
            4,
            7,
            8,
            12,
            16,
            24,
            40,
            48,
            80,
            96,
            112,
            144,
            1000,
            1024,
            1040,
            4096,
            4100,
            6144,
            12288,
            20480,
            65536,
            524288,
            1 << 21,
        ];
        for &size in &sizes {
            for align in [1usize, 2, 4, 8, 16, 32, 64, 2048, 4096] {
                // A Rust layout's size is a multiple of its alignment.
                let size = size.div_ceil(align) * align;
                let layout = Layout::from_size_align(size, align).expect("layout");
                let mut held = Vec::new();
                for round in 0..64u8 {
                    // SAFETY: a non-zero-size layout; the block is freed below with it.
                    let p = unsafe {
                        if round % 2 == 0 {
                            a.alloc(layout)
                        } else {
                            a.alloc_zeroed(layout)
                        }
                    };
                    assert!(!p.is_null(), "size {size} align {align}");
                    assert_eq!(p as usize % align, 0, "size {size} align {align}");
                    // SAFETY: `p` is a live block of `size` bytes.
                    let block = unsafe { std::slice::from_raw_parts_mut(p, size) };
                    if round % 2 == 1 {
                        assert!(block.iter().all(|&b| b == 0), "zeroed {size}/{align}");
                    }
                    block.fill(round);
                    held.push((p, round));
                }
                for (p, round) in held {
                    // SAFETY: `p` is live with `layout`; the new block has `2 * size` bytes.
                    let q = unsafe { a.realloc(p, layout, size * 2) };
                    assert!(!q.is_null());
                    assert_eq!(q as usize % align, 0, "realloc size {size} align {align}");
                    // SAFETY: the first `size` bytes were carried over by realloc.
                    let kept = unsafe { std::slice::from_raw_parts(q, size) };
                    assert!(kept.iter().all(|&b| b == round), "realloc kept bytes");
                    let grown = Layout::from_size_align(size * 2, align).expect("layout");
                    // SAFETY: `q` is live with the grown layout.
                    unsafe { a.dealloc(q, grown) };
                }
            }
        }
    }
}
