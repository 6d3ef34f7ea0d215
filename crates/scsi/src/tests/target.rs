//! The crate root (`lib.rs`): LUN encoding, dispatch to LUNs with no logical unit, and the
//! response contract under hostile input.

use super::*;
use crate::cdb;

/// xorshift64*: deterministic, dependency-free randomness for the property loop.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn lun_wire_encoding_round_trips_both_address_methods() {
    assert_eq!(lun_to_wire(5), 0x0005_0000_0000_0000);
    assert_eq!(lun_to_wire(300), 0x412C_0000_0000_0000);
    assert_eq!(lun_to_wire(MAX_LUN), 0x7FFF_0000_0000_0000);
    for l in [0, 1, 255, 256, 300, MAX_LUN] {
        assert_eq!(lun_from_wire(lun_to_wire(l)), Some(l));
    }
    assert_eq!(lun_from_wire(0x4005_0000_0000_0000), Some(5));
    assert_eq!(lun_from_wire(0x0105_0000_0000_0000), None); // bus 1
    assert_eq!(lun_from_wire(0x0000_0001_0000_0000), None); // second level
    assert_eq!(lun_from_wire(0xC000_0000_0000_0000), None); // extended
}

#[tokio::test]
async fn commands_to_missing_lun_are_logical_unit_not_supported() {
    let t = ram_target();
    for c in [vec![0u8; 6], cdb10(opcode::READ_10, 0, 1), vec![0xFF; 16]] {
        let r = run_on(&t, 3, &nexus(1), &c, &[]).await;
        assert_eq!(sense(&r), (ILLEGAL, 0x25, 0x00));
    }
}

#[tokio::test]
async fn random_cdbs_never_panic_and_keep_the_response_contract() {
    let t = ram_target();
    let ro = {
        let mut c = cfg(4096);
        c.read_only = true;
        target_over(Arc::new(NullBackend::new(16 << 40)), c)
    };
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let ops = [
        0x00u8, 0x03, 0x08, 0x0A, 0x12, 0x15, 0x16, 0x17, 0x1A, 0x1B, 0x1E, 0x25, 0x28, 0x2A, 0x2F,
        0x35, 0x41, 0x42, 0x55, 0x56, 0x57, 0x5A, 0x88, 0x89, 0x8A, 0x8F, 0x91, 0x93, 0x9E, 0xA0,
        0xA3, 0xA8, 0xAA, 0xAF,
    ];
    let mut seen = std::collections::HashMap::new();
    for i in 0..20_000u32 {
        let len = rng.below(34) as usize;
        let mut cdb: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        if !cdb.is_empty() && rng.below(4) != 0 {
            cdb[0] = ops[rng.below(ops.len() as u64) as usize];
            // Keep the control byte clean often enough to reach the handlers.
            if let Some(n) = cdb::cdb_length(cdb[0]) {
                if n <= cdb.len() && rng.below(2) == 0 {
                    cdb[n - 1] = 0;
                }
            }
            // Small lengths and LBAs reach the data paths more often.
            if rng.below(2) == 0 && cdb.len() > 9 {
                cdb[2..6].fill(0);
            }
        }
        let dlen = match rng.below(3) {
            0 => 0,
            1 => rng.below(64) as usize,
            _ => rng.below(70_000) as usize,
        };
        let data: Vec<u8> = (0..dlen).map(|_| rng.next() as u8).collect();
        let target = if i % 2 == 0 { &t } else { &ro };
        let lun = if rng.below(10) == 0 { 1 } else { 0 };
        let n = nexus(rng.below(3));
        let r = run_on(target, lun, &n, &cdb, &data).await;
        *seen.entry(r.status.0).or_insert(0u32) += 1;
        match r.status {
            Status::GOOD => assert!(r.sense.is_none()),
            Status::CHECK_CONDITION => {
                let s = r.sense.as_ref().unwrap();
                assert_eq!(s.len(), 18);
                assert!(r.data_in.is_empty());
            }
            Status::RESERVATION_CONFLICT | Status::CONDITION_MET => assert!(r.sense.is_none()),
            other => panic!("unexpected status {other:?} for {cdb:02x?}"),
        }
        assert!(r.data_in.len() <= MAX_TRANSFER_BYTES as usize);
        let _ = data_out_len(&cdb, 512);
        let _ = data_out_len(&cdb, 4096);
    }
    // The loop must reach the handlers, not only the early rejections.
    assert!(seen.get(&0).copied().unwrap_or(0) > 1000, "{seen:?}");
    assert!(seen.get(&2).copied().unwrap_or(0) > 1000, "{seen:?}");
}

#[tokio::test]
async fn allocation_length_bounds_every_data_in() {
    // For each command with an allocation length, data_in never exceeds it.
    let t = ram_target();
    for alloc in [0u16, 1, 3, 7, 17, 40] {
        let a = alloc.to_be_bytes();
        let a32 = u32::from(alloc).to_be_bytes();
        let cdbs = vec![
            inquiry(false, 0, alloc),
            inquiry(true, 0x83, alloc),
            inquiry(true, 0xB0, alloc),
            vec![0x03, 0, 0, 0, alloc as u8, 0],
            vec![0x1A, 0, 0x3F, 0, alloc as u8, 0],
            vec![0x5A, 0, 0x3F, 0, 0, 0, 0, a[0], a[1], 0],
            vec![
                0x9E, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, a32[0], a32[1], a32[2], a32[3], 0, 0,
            ],
            vec![
                0x9E, 0x12, 0, 0, 0, 0, 0, 0, 0, 0, a32[0], a32[1], a32[2], a32[3], 0, 0,
            ],
            vec![0xA3, 0x0C, 0, 0, 0, 0, a32[0], a32[1], a32[2], a32[3], 0, 0],
        ];
        for c in cdbs {
            let r = run(&t, &c).await;
            assert!(good(&r).len() <= usize::from(alloc), "{c:02x?}");
        }
    }
}
