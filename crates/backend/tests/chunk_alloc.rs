//! `ChunkAlloc` as this test binary's process allocator, as in `ironsan` itself: 512 KiB
//! blocks come from the huge-page slab (reused, zeroed when asked, moved by `realloc`), the RAM
//! backend's chunks live there, and unmapping them gives the memory back to the kernel.
//!
//! One test function: the slab is process-wide, and the steps below count its slots.

use bytes::Bytes;
use ironsan_backend::{BlockDevice, ChunkAlloc, RamBackend, WriteMode};

#[global_allocator]
static ALLOCATOR: ChunkAlloc = ChunkAlloc;

const SLOT: usize = 512 << 10;

/// The `/proc/self/smaps` entry of the mapping that holds `addr`: (Rss, AnonHugePages) in KiB.
fn mapping_of(addr: usize) -> (u64, u64) {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("read /proc/self/smaps");
    let mut inside = false;
    let (mut rss, mut huge) = (None, None);
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((lo, hi)) = first.split_once('-') {
            if let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            {
                if inside {
                    break;
                }
                inside = (lo..hi).contains(&addr);
                continue;
            }
        }
        if inside {
            let kib = || {
                line.split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse::<u64>().ok())
            };
            if line.starts_with("Rss:") {
                rss = kib();
            } else if line.starts_with("AnonHugePages:") {
                huge = kib();
            }
        }
    }
    (
        rss.expect("the mapping has an Rss line"),
        huge.expect("the mapping has an AnonHugePages line"),
    )
}

fn thp_possible() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .is_ok_and(|s| !s.contains("[never]"))
}

#[tokio::test(flavor = "current_thread")]
async fn slab_serves_512k_blocks_in_huge_pages_and_gives_them_back() {
    // A 512 KiB block is a slot: aligned to 512 KiB, counted, reused most recent first.
    let (used0, _) = ChunkAlloc::slots();
    let mut a: Vec<u8> = Vec::with_capacity(SLOT);
    a.resize(SLOT, 0xab);
    let pa = a.as_ptr() as usize;
    assert_eq!(pa % SLOT, 0, "a slot starts on a 512 KiB boundary");
    assert_eq!(ChunkAlloc::slots().0, used0 + 1);
    drop(a);
    assert_eq!(ChunkAlloc::slots().0, used0);

    // Zeroed allocation of a used slot really is zeroed.
    let z = vec![0u8; SLOT];
    assert_eq!(
        z.as_ptr() as usize,
        pa,
        "the slot just freed comes back first"
    );
    assert!(
        z.iter().all(|&b| b == 0),
        "a reused slot is zeroed for calloc"
    );
    drop(z);

    // Other sizes are the heap's, and realloc moves data in and out of the slab intact.
    let small: Vec<u8> = Vec::with_capacity(SLOT - 1);
    assert_eq!(
        ChunkAlloc::slots().0,
        used0,
        "only exactly 512 KiB is a slot"
    );
    drop(small);
    let mut grow: Vec<u8> = (0..SLOT / 2).map(|i| (i % 251) as u8).collect();
    grow.reserve_exact(SLOT / 2);
    assert_eq!(grow.capacity(), SLOT);
    assert_eq!(ChunkAlloc::slots().0, used0 + 1, "grown into a slot");
    grow.extend((SLOT / 2..SLOT).map(|i| (i % 251) as u8));
    grow.reserve_exact(SLOT);
    assert_eq!(ChunkAlloc::slots().0, used0, "grown out of the slot");
    assert!(grow.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
    drop(grow);

    // A RAM LUN's chunks: a 512 KiB write keeps its buffer (a slot) as the chunk, so 96 MiB
    // written are 192 slots, in 2 MiB pages where the kernel has transparent huge pages on.
    let chunks = 192u64;
    let ram = RamBackend::new(chunks * SLOT as u64);
    let mut first = 0;
    for i in 0..chunks {
        let buf = vec![i as u8 | 1; SLOT];
        if i == 0 {
            first = buf.as_ptr() as usize;
        }
        ram.write(i * SLOT as u64, Bytes::from(buf), WriteMode::Durable)
            .await
            .expect("write");
    }
    assert!(ChunkAlloc::slots().0 >= used0 + chunks as usize);
    let back = ram.read(5 * SLOT as u64, 4096).await.expect("read");
    assert!(back.iter().all(|&b| b == 5));
    let (rss, huge) = mapping_of(first);
    assert!(
        rss >= chunks * 512,
        "{rss} KiB resident for {chunks} chunks"
    );
    if thp_possible() {
        assert!(
            huge >= rss / 2,
            "transparent huge pages are on, yet only {huge} of {rss} KiB are in huge pages"
        );
    } else {
        eprintln!("transparent huge pages are off here: not checking AnonHugePages");
    }

    // Unmapping them all frees the slots and, past the backend's trim threshold (64 MiB),
    // gives their pages back to the kernel.
    ram.unmap(0, chunks * SLOT as u64).await.expect("unmap");
    assert!(ChunkAlloc::slots().0 <= used0, "every chunk's slot is free");
    let (rss_after, _) = mapping_of(first);
    assert!(
        rss_after < rss / 4,
        "{rss_after} KiB still resident after unmapping {rss} KiB"
    );
    assert!(
        ram.read(0, 4096)
            .await
            .expect("read")
            .iter()
            .all(|&b| b == 0),
        "unmapped reads zeros"
    );
}
