//! The bookkeeping of the huge-page slab behind [`crate::ChunkAlloc`]: 512 KiB slots carved
//! from one region of address space that the kernel backs with 2 MiB pages.
//!
//! Why: a 4 KiB read from a large RAM LUN copies from a random place in the store, and with
//! 4 KiB pages nearly every such copy misses the TLB (on a VM the miss walks two sets of page
//! tables). With the store in 2 MiB pages the walk mostly stays in cache (docs/PERFORMANCE.md,
//! "RAM store in huge pages"). The slots are exactly the RAM backend's chunk size, and the
//! server's receive buffer of a 512 KiB write is that size too, so a whole-chunk write still
//! keeps its buffer as the chunk (`ram.rs`) and the buffer is already in a huge page.
//!
//! This module only counts: addresses are numbers, and the memory itself is mapped and
//! touched by the caller through [`Memory`] (`sys.rs` for the process; a fake in the tests).

/// The size of every slot: the RAM backend's chunk.
pub const SLOT: usize = 512 << 10;
/// The kernel's transparent huge page on x86-64 and most arm64 kernels. With another size
/// the slab still works; only the release granularity is off.
pub const HUGE_PAGE: usize = 2 << 20;
const SLOTS_PER_PAGE: usize = HUGE_PAGE / SLOT;

/// The address space a process's slab may use at most: 256 GiB of slots (the region is
/// reserved, not allocated: only pages written to cost memory). Slots beyond it come from
/// the ordinary heap.
pub const MAX_SLOTS: usize = (256usize << 30) / SLOT;

/// A slot's state bits.
const FREE: u8 = 1;
/// Its memory is known to read as zeros (never written since the kernel provided it).
const ZEROED: u8 = 2;

/// The memory under the slab.
pub trait Memory {
    /// Reserve up to `max` bytes of address space aligned to [`HUGE_PAGE`], backed lazily (and
    /// in huge pages where the kernel can): its start and length, `None` if none can be had.
    fn reserve(&mut self, max: usize) -> Option<(usize, usize)>;
    /// Give the pages of `[addr, addr + len)` back to the kernel; they read as zeros after.
    fn discard(&mut self, addr: usize, len: usize);
}

/// Free and used 512 KiB slots of one reserved region.
pub struct Slab<const N: usize> {
    /// Start of the region; 0 until the first slot is asked for.
    base: usize,
    /// Slots the region has room for; 0 when it could not be reserved.
    capacity: usize,
    /// Slots handed out at least once (`[0, carved)`); the rest have never been touched.
    carved: usize,
    /// Free slots below `carved`, the most recently freed on top (its memory is warm).
    free: [u32; N],
    free_len: usize,
    state: [u8; N],
    /// Reserving failed once: do not try again on every allocation.
    unavailable: bool,
}

impl<const N: usize> Slab<N> {
    pub const fn new() -> Self {
        Self {
            base: 0,
            capacity: 0,
            carved: 0,
            free: [0; N],
            free_len: 0,
            state: [0; N],
            unavailable: false,
        }
    }

    /// A free slot's address and whether it is known to be zeroed; `None` when the slab is
    /// full or has no memory (the caller then uses the ordinary heap).
    pub fn take(&mut self, mem: &mut impl Memory) -> Option<(usize, bool)> {
        if self.base == 0 && !self.unavailable {
            match mem.reserve(N * SLOT) {
                Some((base, len)) if base != 0 && len >= SLOT => {
                    self.base = base;
                    self.capacity = (len / SLOT).min(N);
                }
                _ => self.unavailable = true,
            }
        }
        let (idx, fresh) = if let Some(top) = self.free_len.checked_sub(1) {
            self.free_len = top;
            (*self.free.get(top)? as usize, false)
        } else if self.carved < self.capacity {
            self.carved += 1;
            (self.carved - 1, true)
        } else {
            return None;
        };
        let st = self.state.get_mut(idx)?;
        let zeroed = fresh || *st & ZEROED != 0;
        *st = 0;
        Some((self.base + idx * SLOT, zeroed))
    }

    /// The slot index of `addr` if it is the start of one of this slab's slots.
    fn index(&self, addr: usize) -> Option<usize> {
        let off = addr.checked_sub(self.base)?;
        let idx = off / SLOT;
        (self.base != 0 && off % SLOT == 0 && idx < self.carved).then_some(idx)
    }

    /// Whether `addr` is one of this slab's slots.
    #[cfg(test)]
    fn owns(&self, addr: usize) -> bool {
        self.index(addr).is_some()
    }

    /// Put the slot at `addr` back on the free list; `false` (and nothing changes) if it is not
    /// a used slot of this slab.
    pub fn give(&mut self, addr: usize) -> bool {
        let Some(idx) = self.index(addr) else {
            return false;
        };
        match (self.state.get_mut(idx), self.free.get_mut(self.free_len)) {
            (Some(st), Some(slot)) if *st & FREE == 0 => {
                *st = FREE;
                *slot = idx as u32;
                self.free_len += 1;
                true
            }
            _ => false,
        }
    }

    /// Give every huge page whose slots are all free back to the kernel; returns the bytes
    /// released. Such slots read as zeros afterwards, so a zeroed allocation needs no memset.
    pub fn release(&mut self, mem: &mut impl Memory) -> usize {
        let mut released = 0;
        let pages = self.carved / SLOTS_PER_PAGE;
        for page in 0..pages {
            let first = page * SLOTS_PER_PAGE;
            let Some(states) = self.state.get_mut(first..first + SLOTS_PER_PAGE) else {
                break;
            };
            let all_free = states.iter().all(|s| s & FREE != 0);
            let all_zeroed = states.iter().all(|s| s & ZEROED != 0);
            if all_free && !all_zeroed {
                mem.discard(self.base + first * SLOT, HUGE_PAGE);
                states.iter_mut().for_each(|s| *s = FREE | ZEROED);
                released += HUGE_PAGE;
            }
        }
        released
    }

    /// Slots in use and slots free (below the high-water mark), for tests and diagnostics.
    pub fn counts(&self) -> (usize, usize) {
        (self.carved - self.free_len, self.free_len)
    }
}

impl<const N: usize> Default for Slab<N> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Address space that is never touched: the slab only does arithmetic on it.
    #[derive(Default)]
    struct Fake {
        reserved: Vec<usize>,
        discarded: Vec<(usize, usize)>,
        refuse: bool,
        /// The most the fake grants (0: whatever is asked).
        limit: usize,
    }

    impl Memory for Fake {
        fn reserve(&mut self, max: usize) -> Option<(usize, usize)> {
            self.reserved.push(max);
            let len = if self.limit > 0 { self.limit } else { max };
            (!self.refuse).then_some((BASE, len))
        }
        fn discard(&mut self, addr: usize, len: usize) {
            self.discarded.push((addr, len));
        }
    }

    const BASE: usize = 64 * HUGE_PAGE;

    #[test]
    fn slots_are_carved_in_order_then_reused_most_recent_first() {
        let mut mem = Fake::default();
        let mut slab = Box::new(Slab::<16>::new());
        let a = slab.take(&mut mem).unwrap();
        let b = slab.take(&mut mem).unwrap();
        assert_eq!(a, (BASE, true), "a slot never used is the kernel's zeros");
        assert_eq!(b, (BASE + SLOT, true));
        assert_eq!(mem.reserved, vec![16 * SLOT], "reserved once, for N slots");
        assert!(slab.owns(BASE + SLOT) && !slab.owns(BASE + SLOT + 4096));
        assert!(!slab.owns(BASE + 2 * SLOT), "not carved yet");
        assert!(slab.give(a.0) && slab.give(b.0));
        assert!(!slab.give(b.0), "a double free is refused");
        assert_eq!(slab.counts(), (0, 2));
        assert_eq!(slab.take(&mut mem), Some((BASE + SLOT, false)));
        assert_eq!(slab.take(&mut mem), Some((BASE, false)));
        assert_eq!(slab.take(&mut mem), Some((BASE + 2 * SLOT, true)));
        assert_eq!(slab.counts(), (3, 0));
    }

    #[test]
    fn a_full_or_unreservable_slab_says_no() {
        let mut mem = Fake {
            limit: 4 * SLOT + 4096,
            ..Fake::default()
        };
        let mut slab = Box::new(Slab::<16>::new());
        for i in 0..4 {
            assert_eq!(slab.take(&mut mem).unwrap().0, BASE + i * SLOT);
        }
        assert_eq!(slab.take(&mut mem), None, "room for 4 slots only");
        assert!(!slab.give(BASE + 8 * SLOT), "outside the slab");

        let mut refused = Fake {
            refuse: true,
            ..Fake::default()
        };
        let mut slab = Box::new(Slab::<16>::new());
        assert_eq!(slab.take(&mut refused), None);
        assert_eq!(slab.take(&mut refused), None);
        assert_eq!(refused.reserved.len(), 1, "no second attempt");
        assert!(!slab.owns(0) && !slab.give(0));
    }

    #[test]
    fn only_wholly_free_huge_pages_are_released_and_then_read_as_zeros() {
        let mut mem = Fake::default();
        let mut slab = Box::new(Slab::<16>::new());
        let slots: Vec<usize> = (0..8).map(|_| slab.take(&mut mem).unwrap().0).collect();
        // Page 0 wholly free, page 1 still has one slot in use.
        for &s in &slots[..7] {
            assert!(slab.give(s));
        }
        assert_eq!(slab.release(&mut mem), HUGE_PAGE);
        assert_eq!(mem.discarded, vec![(BASE, HUGE_PAGE)]);
        assert_eq!(slab.release(&mut mem), 0, "nothing new to release");
        // The free list still holds page 0's slots, now known zero.
        let mut got = Vec::new();
        while let Some(t) = slab.take(&mut mem) {
            if t.0 >= BASE + 8 * SLOT {
                break;
            }
            got.push(t);
        }
        got.sort();
        assert_eq!(
            got,
            vec![
                (BASE, true),
                (BASE + SLOT, true),
                (BASE + 2 * SLOT, true),
                (BASE + 3 * SLOT, true),
                (BASE + 4 * SLOT, false),
                (BASE + 5 * SLOT, false),
                (BASE + 6 * SLOT, false),
            ]
        );
    }
}
