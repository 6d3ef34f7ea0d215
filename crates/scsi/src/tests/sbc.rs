//! SBC-3 block commands (`sbc.rs`): capacity, READ / WRITE, VERIFY, cache, provisioning, COMPARE
//! AND WRITE and the other block commands, the block VPD pages, and writes received in place.

use super::*;
use crate::cdb;
use crate::cdb::block_range;

fn ram_target_with_handle() -> (Target, Arc<RamBackend>) {
    let ram = Arc::new(RamBackend::new(1 << 20));
    (target_over(ram.clone(), cfg(512)), ram)
}

fn unmap_list(descs: &[(u64, u32)]) -> Vec<u8> {
    let mut d = Vec::new();
    d.extend_from_slice(&((6 + 16 * descs.len()) as u16).to_be_bytes());
    d.extend_from_slice(&((16 * descs.len()) as u16).to_be_bytes());
    d.extend_from_slice(&[0; 4]);
    for &(lba, n) in descs {
        d.extend_from_slice(&lba.to_be_bytes());
        d.extend_from_slice(&n.to_be_bytes());
        d.extend_from_slice(&[0; 4]);
    }
    d
}

fn caw(lba: u64, blocks: u8) -> Vec<u8> {
    let mut c = cdb16(opcode::COMPARE_AND_WRITE, lba, 0);
    c[13] = blocks;
    c
}

fn read_capacity_16_cdb() -> Vec<u8> {
    let mut c = vec![0x9E, 0x10];
    c.extend_from_slice(&[0; 8]);
    c.extend_from_slice(&32u32.to_be_bytes());
    c.extend_from_slice(&[0, 0]);
    c
}

// ---------------------------------------------------------------------------------------------
// READ CAPACITY and the physical block size
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn read_capacity_10_reports_last_lba_and_block_size() {
    let t = ram_target();
    let r = run(&t, &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0]).await;
    assert_eq!(good(&r), &[0, 0, 0x07, 0xFF, 0, 0, 0x02, 0x00][..]);
    let t = target_over(Arc::new(RamBackend::new(1 << 20)), cfg(4096));
    let r = run(&t, &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0]).await;
    assert_eq!(good(&r), &[0, 0, 0, 0xFF, 0, 0, 0x10, 0x00][..]);
}

#[tokio::test]
async fn read_capacity_10_saturates_when_capacity_exceeds_32_bits() {
    let t = null_16t();
    let r = run(&t, &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0]).await;
    assert_eq!(good(&r), &[0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0x02, 0x00][..]);
    // Exactly 2^32 blocks: last LBA FFFF_FFFFh is also reported as FFFF_FFFFh.
    let t = target_over(Arc::new(NullBackend::new(512 << 32)), cfg(512));
    let r = run(&t, &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0]).await;
    assert_eq!(&good(&r)[..4], &[0xFF; 4]);
    // 2^32 - 1 blocks: last LBA FFFF_FFFEh fits.
    let t = target_over(Arc::new(NullBackend::new(512 * 0xFFFF_FFFF)), cfg(512));
    let r = run(&t, &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0]).await;
    assert_eq!(&good(&r)[..4], &[0xFF, 0xFF, 0xFF, 0xFE]);
}

#[tokio::test]
async fn read_capacity_16_of_null_16t_is_byte_exact() {
    let t = null_16t();
    let mut c = vec![0x9E, 0x10];
    c.extend_from_slice(&[0; 8]);
    c.extend_from_slice(&32u32.to_be_bytes());
    c.extend_from_slice(&[0, 0]);
    let r = run(&t, &c).await;
    let mut want = [0u8; 32];
    want[..8].copy_from_slice(&((1u64 << 35) - 1).to_be_bytes());
    want[8..12].copy_from_slice(&512u32.to_be_bytes());
    want[14] = 0xC0; // LBPME, LBPRZ
    assert_eq!(good(&r), &want[..]);
    c[13] = 12;
    assert_eq!(good(&run(&t, &c).await), &want[..12]);
}

#[tokio::test]
async fn read_capacity_16_reports_physical_block_exponent_and_no_lbpme_without_unmap() {
    let mut b = TestBackend::new(1 << 20);
    b.unmap = false;
    b.alignment = 4096;
    let (t, _) = test_target(b, cfg(512));
    let mut c = vec![0x9E, 0x10];
    c.extend_from_slice(&[0; 8]);
    c.extend_from_slice(&32u32.to_be_bytes());
    c.extend_from_slice(&[0, 0]);
    let r = run(&t, &c).await;
    assert_eq!(good(&r)[13], 3);
    assert_eq!(good(&r)[14], 0);
}

#[tokio::test]
async fn read_capacity_lba_without_pmi_is_invalid_field() {
    let t = ram_target();
    let r = run(&t, &[0x25, 0, 0, 0, 0, 1, 0, 0, 0, 0]).await;
    invalid_cdb_field(&r, 2, None);
    let r = run(&t, &[0x25, 0, 0, 0, 0, 1, 0, 0, 1, 0]).await;
    good(&r);
    let mut c = cdb16(0x9E, 7, 32);
    c[1] = 0x10;
    invalid_cdb_field(&run(&t, &c).await, 2, None);
}

#[tokio::test]
async fn service_action_in_unknown_action_is_invalid_field() {
    let t = ram_target();
    let mut c = cdb16(0x9E, 0, 32);
    c[1] = 0x11;
    invalid_cdb_field(&run(&t, &c).await, 1, Some(4));
}

#[tokio::test]
async fn physical_block_defaults_to_the_logical_block() {
    let t = ram_target();
    assert_eq!(good(&run(&t, &read_capacity_16_cdb()).await)[13], 0);
}

#[tokio::test]
async fn configured_4k_physical_block_reports_exponent_3_and_granularity_8() {
    let mut c = cfg(512);
    c.physical_block_size = 4096;
    let t = target_over(Arc::new(RamBackend::new(1 << 20)), c);
    assert_eq!(good(&run(&t, &read_capacity_16_cdb()).await)[13], 3);
    let r = run(&t, &inquiry(true, 0xB0, 255)).await;
    let p = good(&r);
    assert_eq!(&p[6..8], &8u16.to_be_bytes()); // OPTIMAL TRANSFER LENGTH GRANULARITY
    assert_eq!(&p[28..32], &8u32.to_be_bytes()); // OPTIMAL UNMAP GRANULARITY
}

#[tokio::test]
async fn physical_block_not_larger_than_logical_or_not_a_power_of_two_is_ignored() {
    for phys in [512, 1000, 256] {
        let mut c = cfg(4096);
        c.physical_block_size = phys;
        let t = target_over(Arc::new(RamBackend::new(1 << 20)), c);
        assert_eq!(good(&run(&t, &read_capacity_16_cdb()).await)[13], 0);
    }
}

// ---------------------------------------------------------------------------------------------
// Block VPD pages
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn vpd_block_limits_reports_transfer_and_unmap_limits() {
    let t = ram_target();
    let r = run(&t, &inquiry(true, 0xB0, 255)).await;
    let p = good(&r);
    assert_eq!(p.len(), 64);
    assert_eq!(&p[..4], &[0x00, 0xB0, 0x00, 0x3C]);
    assert_eq!(p[4], 0x01); // WSNZ
    assert_eq!(p[5], 64); // MAXIMUM COMPARE AND WRITE LENGTH
    assert_eq!(&p[6..8], &8u16.to_be_bytes()); // 4 KiB granularity in 512-byte blocks
    assert_eq!(&p[8..12], &65536u32.to_be_bytes()); // 32 MiB
    assert_eq!(&p[12..16], &2048u32.to_be_bytes()); // 1 MiB
    assert_eq!(&p[20..24], &(1u32 << 20).to_be_bytes()); // 1 Mi blocks (libiscsi's ceiling)
    assert_eq!(&p[24..28], &256u32.to_be_bytes());
    assert_eq!(&p[28..32], &8u32.to_be_bytes());
    assert_eq!(&p[36..44], &(2u64 << 20).to_be_bytes());
    assert_eq!(&p[44..48], &0u32.to_be_bytes()); // MAXIMUM ATOMIC TRANSFER LENGTH: none
}

#[tokio::test]
async fn vpd_block_characteristics_reports_non_rotating() {
    let t = ram_target();
    let r = run(&t, &inquiry(true, 0xB1, 255)).await;
    let p = good(&r);
    assert_eq!(p.len(), 64);
    assert_eq!(&p[..6], &[0x00, 0xB1, 0x00, 0x3C, 0x00, 0x01]);
    assert_eq!(p[7], 0x50); // WABEREQ=01b, WACEREQ=01b
    assert!(p[8..].iter().all(|&b| b == 0));
}

#[tokio::test]
async fn vpd_logical_block_provisioning_follows_backend_unmap() {
    let t = ram_target();
    let r = run(&t, &inquiry(true, 0xB2, 255)).await;
    assert_eq!(
        good(&r),
        &[0x00, 0xB2, 0x00, 0x04, 0x00, 0xE4, 0x02, 0x00][..]
    );
    let mut b = TestBackend::new(1 << 20);
    b.unmap = false;
    let (t, _) = test_target(b, cfg(512));
    let r = run(&t, &inquiry(true, 0xB2, 255)).await;
    assert_eq!(good(&r), &[0x00, 0xB2, 0x00, 0x04, 0, 0, 0, 0][..]);
    let r = run(&t, &inquiry(true, 0xB0, 255)).await;
    assert!(good(&r)[20..32].iter().all(|&b| b == 0));
}

/// docs/INTEGRITY.md "Atomicity guarantee": Block Limits advertises no atomic writes (every
/// SBC-4 atomic field 0: MAXIMUM ATOMIC TRANSFER LENGTH, ATOMIC ALIGNMENT, ATOMIC TRANSFER
/// LENGTH GRANULARITY, MAXIMUM ATOMIC TRANSFER LENGTH WITH ATOMIC BOUNDARY, MAXIMUM ATOMIC
/// BOUNDARY SIZE), whatever the block size or backend alignment, and REPORT SUPPORTED
/// OPERATION CODES says WRITE ATOMIC (16) is not supported.
#[tokio::test]
async fn vpd_block_limits_advertises_no_atomic_writes() {
    let mut aligned = TestBackend::new(1 << 20);
    aligned.alignment = 4096;
    let targets = [
        ram_target(),
        target_over(Arc::new(RamBackend::new(1 << 20)), cfg(4096)),
        test_target(aligned, cfg(512)).0,
    ];
    for t in &targets {
        let r = run(t, &inquiry(true, 0xB0, 255)).await;
        let p = good(&r);
        assert_eq!(&p[..4], &[0x00, 0xB0, 0x00, 0x3C]);
        assert_eq!(p.len(), 64);
        for (name, at) in [
            ("MAXIMUM ATOMIC TRANSFER LENGTH", 44),
            ("ATOMIC ALIGNMENT", 48),
            ("ATOMIC TRANSFER LENGTH GRANULARITY", 52),
            ("MAXIMUM ATOMIC TRANSFER LENGTH WITH ATOMIC BOUNDARY", 56),
            ("MAXIMUM ATOMIC BOUNDARY SIZE", 60),
        ] {
            assert_eq!(&p[at..at + 4], &[0u8; 4], "{name}");
        }
        let r = run(t, &rsoc(1, opcode::WRITE_ATOMIC_16, 0, 64)).await;
        assert_eq!(good(&r)[1] & 0x07, 0x01, "WRITE ATOMIC (16): SUPPORT 001b");
    }
}

// ---------------------------------------------------------------------------------------------
// READ / WRITE
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn write_then_read_round_trips_for_every_cdb_size() {
    use opcode::*;
    let t = ram_target();
    let cases: [(Vec<u8>, Vec<u8>); 4] = [
        (cdb6(WRITE_6, 10, 2), cdb6(READ_6, 10, 2)),
        (cdb10(WRITE_10, 100, 3), cdb10(READ_10, 100, 3)),
        (cdb12(WRITE_12, 200, 4), cdb12(READ_12, 200, 4)),
        (cdb16(WRITE_16, 2047, 1), cdb16(READ_16, 2047, 1)),
    ];
    for (i, (w, r)) in cases.iter().enumerate() {
        let n = block_range(cdb::Cdb(w)).blocks as usize;
        let data = pattern(n * 512, i as u8);
        good(&run_data(&t, w, &data).await);
        assert_eq!(good(&run(&t, r).await), &data[..]);
    }
}

#[tokio::test]
async fn read6_transfer_length_zero_reads_256_blocks() {
    let t = ram_target();
    let data = pattern(256 * 512, 9);
    good(&run_data(&t, &cdb10(opcode::WRITE_10, 1, 256), &data).await);
    let r = run(&t, &cdb6(opcode::READ_6, 1, 0)).await;
    assert_eq!(good(&r), &data[..]);
}

#[tokio::test]
async fn write6_transfer_length_zero_writes_256_blocks() {
    let t = ram_target();
    let data = pattern(256 * 512, 3);
    good(&run_data(&t, &cdb6(opcode::WRITE_6, 0, 0), &data).await);
    assert_eq!(
        good(&run(&t, &cdb10(opcode::READ_10, 0, 256)).await),
        &data[..]
    );
    // READ(6) 256 blocks from LBA 1800 runs past the 2048-block end.
    assert_eq!(
        sense(&run(&t, &cdb6(opcode::READ_6, 1800, 0)).await),
        LBA_OOR
    );
}

#[tokio::test]
async fn transfer_length_zero_is_good_without_data() {
    use opcode::*;
    let t = ram_target();
    for c in [
        cdb10(READ_10, 5, 0),
        cdb12(READ_12, 5, 0),
        cdb16(READ_16, 2048, 0),
        cdb10(WRITE_10, 2048, 0),
        cdb16(WRITE_16, 0, 0),
    ] {
        assert!(good(&run(&t, &c).await).is_empty());
    }
}

#[tokio::test]
async fn read_beyond_capacity_is_lba_out_of_range() {
    use opcode::*;
    let t = ram_target();
    assert_eq!(sense(&run(&t, &cdb10(READ_10, 2048, 1)).await), LBA_OOR);
    assert_eq!(sense(&run(&t, &cdb10(READ_10, 2047, 2)).await), LBA_OOR);
    assert_eq!(sense(&run(&t, &cdb10(READ_10, 2049, 0)).await), LBA_OOR);
    assert_eq!(sense(&run(&t, &cdb12(READ_12, u32::MAX, 1)).await), LBA_OOR);
    assert_eq!(sense(&run(&t, &cdb6(READ_6, 0x1F_FFFF, 1)).await), LBA_OOR);
    good(&run(&t, &cdb10(READ_10, 2047, 1)).await);
}

#[tokio::test]
async fn lba_plus_length_wrapping_u64_is_lba_out_of_range() {
    use opcode::*;
    let t = null_16t();
    assert_eq!(
        sense(&run(&t, &cdb16(READ_16, u64::MAX - 1, 4)).await),
        LBA_OOR
    );
    assert_eq!(sense(&run(&t, &cdb16(READ_16, u64::MAX, 0)).await), LBA_OOR);
    assert_eq!(
        sense(&run_data(&t, &cdb16(WRITE_16, u64::MAX, 1), &[0; 512]).await),
        LBA_OOR
    );
    assert_eq!(
        sense(&run(&t, &cdb16(VERIFY_16, u64::MAX - 2, 8)).await),
        LBA_OOR
    );
    assert_eq!(
        sense(&run(&t, &cdb16(SYNCHRONIZE_CACHE_16, u64::MAX, 2)).await),
        LBA_OOR
    );
    good(&run(&t, &cdb16(READ_16, (1 << 35) - 1, 1)).await);
}

#[tokio::test]
async fn write_beyond_capacity_is_lba_out_of_range_and_writes_nothing() {
    let (t, b) = test_target(TestBackend::new(1 << 20), cfg(512));
    let r = run_data(&t, &cdb10(opcode::WRITE_10, 2047, 2), &[1; 1024]).await;
    assert_eq!(sense(&r), LBA_OOR);
    assert!(b.modes().is_empty());
}

#[tokio::test]
async fn write_to_read_only_lu_is_write_protected() {
    let mut c = cfg(512);
    c.read_only = true;
    let t = target_over(Arc::new(RamBackend::new(1 << 20)), c);
    let r = run_data(&t, &cdb10(opcode::WRITE_10, 0, 1), &[1; 512]).await;
    assert_eq!(sense(&r), (0x7, 0x27, 0x00));
    let r = run_data(&t, &cdb6(opcode::WRITE_6, 0, 1), &[1; 512]).await;
    assert_eq!(sense(&r), (0x7, 0x27, 0x00));
    good(&run(&t, &cdb10(opcode::READ_10, 0, 1)).await);
}

#[tokio::test]
async fn write_with_short_data_out_writes_only_the_whole_blocks_sent() {
    let (t, b) = test_target(TestBackend::new(1 << 20), cfg(512));
    // 1023 bytes for two blocks: one whole block is written, the rest is the iSCSI overflow.
    good(&run_data(&t, &cdb10(opcode::WRITE_10, 0, 2), &[1; 1023]).await);
    assert_eq!(b.modes().len(), 1);
    let rd = run(&t, &cdb10(opcode::READ_10, 0, 2)).await;
    let back = good(&rd);
    assert!(back[..512].iter().all(|&x| x == 1) && back[512..].iter().all(|&x| x == 0));
    // No data at all: nothing written, still GOOD.
    good(&run_data(&t, &cdb16(opcode::WRITE_16, 4, 1), &[]).await);
    assert_eq!(b.modes().len(), 1);
}

#[tokio::test]
async fn write_with_extra_data_out_uses_leading_bytes() {
    let t = ram_target();
    let data = pattern(1024, 1);
    good(&run_data(&t, &cdb10(opcode::WRITE_10, 4, 1), &data).await);
    assert_eq!(
        good(&run(&t, &cdb10(opcode::READ_10, 4, 2)).await)[..512],
        data[..512]
    );
    assert!(good(&run(&t, &cdb10(opcode::READ_10, 5, 1)).await)
        .iter()
        .all(|&b| b == 0));
}

#[tokio::test]
async fn protection_fields_are_invalid_field_bit_7() {
    use opcode::*;
    let t = ram_target();
    for op in [READ_10, WRITE_10, READ_16, WRITE_12, VERIFY_10] {
        let mut c = if op == READ_16 {
            cdb16(op, 0, 1)
        } else if op == WRITE_12 {
            cdb12(op, 0, 1)
        } else {
            cdb10(op, 0, 1)
        };
        c[1] = 0x20;
        invalid_cdb_field(&run_data(&t, &c, &[0; 512]).await, 1, Some(7));
    }
}

#[tokio::test]
async fn transfer_length_above_maximum_is_invalid_field() {
    let t = ram_target();
    invalid_cdb_field(&run(&t, &cdb16(opcode::READ_16, 0, 65537)).await, 10, None);
    invalid_cdb_field(
        &run(&t, &cdb12(opcode::READ_12, 0, u32::MAX)).await,
        6,
        None,
    );
}

#[tokio::test]
async fn dpo_and_fua_are_accepted() {
    let t = ram_target();
    let mut c = cdb10(opcode::READ_10, 0, 1);
    c[1] = 0x18;
    good(&run(&t, &c).await);
    let mut c = cdb10(opcode::WRITE_10, 0, 1);
    c[1] = 0x18;
    good(&run_data(&t, &c, &[0; 512]).await);
}

#[tokio::test]
async fn write_durability_follows_wce_and_fua() {
    let (t, b) = test_target(TestBackend::new(1 << 20), cfg(512));
    let w = cdb10(opcode::WRITE_10, 0, 1);
    let mut fua = w.clone();
    fua[1] = 0x08;
    good(&run_data(&t, &w, &[1; 512]).await); // WCE=0
    good(&run_data(&t, &fua, &[1; 512]).await);
    let mut c = cfg(512);
    c.write_cache = true;
    let (t2, b2) = test_target(TestBackend::new(1 << 20), c);
    good(&run_data(&t2, &w, &[1; 512]).await); // WCE=1
    good(&run_data(&t2, &fua, &[1; 512]).await);
    good(&run_data(&t2, &cdb6(opcode::WRITE_6, 0, 1), &[1; 512]).await);
    assert_eq!(b.modes(), vec![WriteMode::Durable, WriteMode::Durable]);
    assert_eq!(
        b2.modes(),
        vec![WriteMode::Cached, WriteMode::Durable, WriteMode::Cached]
    );
}

#[tokio::test]
async fn write_atomic_is_not_offered_until_it_is_crash_atomic() {
    let t = ram_target();
    let mut c = vec![0u8; 16];
    c[0] = opcode::WRITE_ATOMIC_16;
    c[13] = 2;
    assert_eq!(
        sense(&run_data(&t, &c, &[7u8; 1024]).await),
        (ILLEGAL, 0x20, 0x00)
    );
    let r = run(&t, &cdb10(opcode::READ_10, 0, 2)).await;
    assert!(good(&r).iter().all(|&b| b == 0), "nothing was written");
}

// ---------------------------------------------------------------------------------------------
// VERIFY, WRITE AND VERIFY, SYNCHRONIZE CACHE, START STOP UNIT
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn verify_without_bytchk_range_checks_and_reads() {
    use opcode::*;
    let (t, b) = test_target(TestBackend::new(1 << 20), cfg(512));
    good(&run(&t, &cdb10(VERIFY_10, 0, 8)).await);
    good(&run(&t, &cdb12(VERIFY_12, 2040, 8)).await);
    good(&run(&t, &cdb16(VERIFY_16, 2048, 0)).await);
    assert_eq!(sense(&run(&t, &cdb16(VERIFY_16, 2041, 8)).await), LBA_OOR);
    b.fail_with(BackendError::ReadError { offset: 512 * 3 });
    assert_eq!(
        sense(&run(&t, &cdb10(VERIFY_10, 3, 1)).await),
        (0x3, 0x11, 0x00)
    );
}

#[tokio::test]
async fn verify_bytchk_compares_with_data_out() {
    let t = ram_target();
    let data = pattern(2048, 5);
    good(&run_data(&t, &cdb10(opcode::WRITE_10, 10, 4), &data).await);
    let mut c = cdb10(opcode::VERIFY_10, 10, 4);
    c[1] = 0x02;
    good(&run_data(&t, &c, &data).await);
    let mut bad = data.clone();
    bad[1500] ^= 0xFF;
    let r = run_data(&t, &c, &bad).await;
    assert_eq!(sense(&r), (0xE, 0x1D, 0x00));
    let s = r.sense.unwrap();
    assert_eq!(s[0], 0xF0); // VALID
    assert_eq!(&s[3..7], &1500u32.to_be_bytes());
    invalid_cdb_field(&run_data(&t, &c, &data[..2047]).await, 7, None);
}

#[tokio::test]
async fn verify_bytchk_11_compares_every_block_with_one_block() {
    let t = ram_target();
    let block = pattern(512, 77);
    let mut data = block.repeat(3);
    good(&run_data(&t, &cdb16(opcode::WRITE_16, 0, 3), &data).await);
    let mut c = cdb16(opcode::VERIFY_16, 0, 3);
    c[1] = 0x06;
    good(&run_data(&t, &c, &block).await);
    data[512 * 2 + 7] ^= 1;
    good(&run_data(&t, &cdb16(opcode::WRITE_16, 0, 3), &data).await);
    let r = run_data(&t, &c, &block).await;
    assert_eq!(sense(&r), (0xE, 0x1D, 0x00));
    assert_eq!(&r.sense.unwrap()[3..7], &(1024u32 + 7).to_be_bytes());
}

#[tokio::test]
async fn verify_bytchk_10_is_invalid_field() {
    let t = ram_target();
    let mut c = cdb10(opcode::VERIFY_10, 0, 1);
    c[1] = 0x04;
    invalid_cdb_field(&run(&t, &c).await, 1, Some(2));
}

#[tokio::test]
async fn write_and_verify_writes_then_compares_with_bytchk() {
    let t = target_over(Arc::new(RamBackend::new(1 << 20)), cfg(512));
    for op in [opcode::WRITE_AND_VERIFY_10, opcode::WRITE_AND_VERIFY_16] {
        let mut c = if op == opcode::WRITE_AND_VERIFY_10 {
            cdb10(op, 8, 2).to_vec()
        } else {
            cdb16(op, 8, 2).to_vec()
        };
        c[1] |= 0x02; // BYTCHK
        good(&run_data(&t, &c, &[0x5a; 1024]).await);
        let rd = run(&t, &cdb10(opcode::READ_10, 8, 2)).await;
        assert!(good(&rd).iter().all(|&b| b == 0x5a));
    }
    let c = cdb10(opcode::WRITE_AND_VERIFY_10, 2047, 2);
    assert_eq!(
        sense(&run_data(&t, &c, &[1; 1024]).await),
        (ILLEGAL, 0x21, 0x00)
    );
}

#[tokio::test]
async fn synchronize_cache_flushes_after_range_check() {
    let (t, b) = test_target(TestBackend::new(1 << 20), cfg(512));
    good(&run(&t, &cdb10(opcode::SYNCHRONIZE_CACHE_10, 0, 0)).await);
    good(&run(&t, &cdb16(opcode::SYNCHRONIZE_CACHE_16, 2000, 48)).await);
    let mut immed = cdb10(opcode::SYNCHRONIZE_CACHE_10, 0, 10);
    immed[1] = 0x02;
    good(&run(&t, &immed).await);
    assert_eq!(b.flushes.load(Ordering::SeqCst), 3);
    assert_eq!(
        sense(&run(&t, &cdb10(opcode::SYNCHRONIZE_CACHE_10, 2000, 49)).await),
        LBA_OOR
    );
    assert_eq!(b.flushes.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn start_stop_unit_is_accepted_and_stop_flushes() {
    let (t, b) = test_target(TestBackend::new(1 << 20), cfg(512));
    good(&run(&t, &[0x1B, 0, 0, 0, 0x01, 0]).await); // start
    assert_eq!(b.flushes.load(Ordering::SeqCst), 0);
    good(&run(&t, &[0x1B, 1, 0, 0, 0x00, 0]).await); // stop, immed
    assert_eq!(b.flushes.load(Ordering::SeqCst), 1);
    good(&run(&t, &[0x1B, 0, 0, 0, 0x04, 0]).await); // stop, NO_FLUSH
    assert_eq!(b.flushes.load(Ordering::SeqCst), 1);
    invalid_cdb_field(&run(&t, &[0x1B, 0, 0, 0, 0x50, 0]).await, 4, Some(7));
}

// ---------------------------------------------------------------------------------------------
// WRITE SAME, UNMAP, GET LBA STATUS, SANITIZE
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn write_same_replicates_one_block() {
    let t = ram_target();
    let block = pattern(512, 42);
    good(&run_data(&t, &cdb10(opcode::WRITE_SAME_10, 100, 10), &block).await);
    let r = run(&t, &cdb10(opcode::READ_10, 99, 12)).await;
    let d = good(&r);
    assert!(d[..512].iter().all(|&b| b == 0));
    for i in 1..11 {
        assert_eq!(&d[i * 512..(i + 1) * 512], &block[..], "block {i}");
    }
    assert!(d[11 * 512..].iter().all(|&b| b == 0));
    // WRITE SAME(16) across more than one internal chunk.
    good(&run_data(&t, &cdb16(opcode::WRITE_SAME_16, 0, 2048), &block).await);
    let r = run(&t, &cdb16(opcode::READ_16, 0, 2048)).await;
    assert!(good(&r).chunks(512).all(|c| c == &block[..]));
}

#[tokio::test]
async fn write_same_with_unmap_deallocates_zero_blocks() {
    let (t, ram) = ram_target_with_handle();
    good(&run_data(&t, &cdb16(opcode::WRITE_SAME_16, 0, 2048), &[7; 512]).await);
    assert_eq!(ram.allocated(), 1 << 20);
    let mut c = cdb16(opcode::WRITE_SAME_16, 0, 2048);
    c[1] = 0x08; // UNMAP
    good(&run_data(&t, &c, &[0; 512]).await);
    assert_eq!(ram.allocated(), 0);
    // NDOB + UNMAP: no Data-Out at all.
    good(&run_data(&t, &cdb16(opcode::WRITE_SAME_16, 0, 2048), &[7; 512]).await);
    c[1] = 0x09;
    good(&run(&t, &c).await);
    assert_eq!(ram.allocated(), 0);
    // UNMAP with a non-zero block writes it instead.
    c[1] = 0x08;
    good(&run_data(&t, &c, &[1; 512]).await);
    assert!(good(&run(&t, &cdb10(opcode::READ_10, 2047, 1)).await)
        .iter()
        .all(|&b| b == 1));
}

#[tokio::test]
async fn write_same_field_errors() {
    use opcode::*;
    let t = ram_target();
    invalid_cdb_field(&run(&t, &cdb10(WRITE_SAME_10, 0, 1)).await, 7, None);
    let mut c = cdb10(WRITE_SAME_10, 0, 1);
    c[1] = 0x01;
    invalid_cdb_field(&run_data(&t, &c, &[0; 512]).await, 1, Some(0));
    c[1] = 0x10;
    invalid_cdb_field(&run_data(&t, &c, &[0; 512]).await, 1, Some(4));
    c[1] = 0x02;
    invalid_cdb_field(&run_data(&t, &c, &[0; 512]).await, 1, Some(2));
    let big = cdb16(WRITE_SAME_16, 0, (2 << 20) + 1);
    invalid_cdb_field(&run_data(&t, &big, &[0; 512]).await, 10, None);
    assert_eq!(
        sense(&run_data(&t, &cdb10(WRITE_SAME_10, 2040, 9), &[0; 512]).await),
        LBA_OOR
    );
    let mut ro = cfg(512);
    ro.read_only = true;
    let t = target_over(Arc::new(RamBackend::new(1 << 20)), ro);
    let r = run_data(&t, &cdb10(WRITE_SAME_10, 0, 1), &[0; 512]).await;
    assert_eq!(sense(&r), (0x7, 0x27, 0x00));
}

#[tokio::test]
async fn write_same_zero_blocks_is_invalid_field_wsnz() {
    let t = ram_target();
    let r = run_data(&t, &cdb10(opcode::WRITE_SAME_10, 0, 0), &[0; 512]).await;
    invalid_cdb_field(&r, 7, None);
    let r = run_data(&t, &cdb16(opcode::WRITE_SAME_16, 2048, 0), &[0; 512]).await;
    invalid_cdb_field(&r, 10, None);
}

#[tokio::test]
async fn write_same_zero_blocks_past_the_end_is_lba_out_of_range() {
    let t = ram_target();
    for lba in [2049u32, 0x8000_0000, u32::MAX] {
        let r = run_data(&t, &cdb10(opcode::WRITE_SAME_10, lba, 0), &[0; 512]).await;
        assert_eq!(sense(&r), LBA_OOR);
    }
}

#[tokio::test]
async fn write_same_with_more_or_less_than_one_block_of_data_is_invalid_field() {
    let t = ram_target();
    for len in [256, 1024] {
        let mut c = cdb10(opcode::WRITE_SAME_10, 0, 1);
        c[1] = 0x08; // UNMAP
        invalid_cdb_field(&run_data(&t, &c, &vec![0; len]).await, 7, None);
        let r = run_data(&t, &cdb16(opcode::WRITE_SAME_16, 0, 1), &vec![0; len]).await;
        invalid_cdb_field(&r, 10, None);
    }
}

#[tokio::test]
async fn write_same_ndob_with_data_is_invalid_field() {
    let t = ram_target();
    let mut c = cdb16(opcode::WRITE_SAME_16, 0, 1);
    c[1] = 0x01; // NDOB
    invalid_cdb_field(&run_data(&t, &c, &[0; 512]).await, 10, None);
    good(&run(&t, &c).await);
}

#[tokio::test]
async fn unmap_deallocates_and_reads_back_zeros() {
    let (t, ram) = ram_target_with_handle();
    good(&run_data(&t, &cdb16(opcode::WRITE_SAME_16, 0, 2048), &[9; 512]).await);
    let list = unmap_list(&[(0, 1024), (1024, 1000), (5, 0)]);
    good(&run_data(&t, &cdb10(opcode::UNMAP, 0, list.len() as u16), &list).await);
    let d = good(&run(&t, &cdb10(opcode::READ_10, 0, 2048)).await).to_vec();
    assert!(d[..2024 * 512].iter().all(|&b| b == 0));
    assert!(d[2024 * 512..].iter().all(|&b| b == 9));
    // A descriptor covering whole RAM backend chunks (512 KiB) frees them.
    let list = unmap_list(&[(0, 2048)]);
    good(&run_data(&t, &cdb10(opcode::UNMAP, 0, list.len() as u16), &list).await);
    assert_eq!(ram.allocated(), 0);
}

#[tokio::test]
async fn unmap_validates_every_descriptor_before_unmapping() {
    let (t, ram) = ram_target_with_handle();
    good(&run_data(&t, &cdb16(opcode::WRITE_SAME_16, 0, 2048), &[9; 512]).await);
    let list = unmap_list(&[(0, 2048), (2047, 2)]);
    let r = run_data(&t, &cdb10(opcode::UNMAP, 0, list.len() as u16), &list).await;
    assert_eq!(sense(&r), LBA_OOR);
    let list = unmap_list(&[(u64::MAX, 2)]);
    let r = run_data(&t, &cdb10(opcode::UNMAP, 0, list.len() as u16), &list).await;
    assert_eq!(sense(&r), LBA_OOR);
    assert_eq!(ram.allocated(), 1 << 20);
}

#[tokio::test]
async fn unmap_parameter_list_errors() {
    use opcode::UNMAP;
    let t = ram_target();
    good(&run(&t, &cdb10(UNMAP, 0, 0)).await);
    let list = unmap_list(&[(0, 1)]);
    let r = run_data(&t, &cdb10(UNMAP, 0, 7), &list).await;
    assert_eq!(sense(&r), (ILLEGAL, 0x1A, 0x00));
    let r = run_data(&t, &cdb10(UNMAP, 0, 24), &list[..20]).await;
    assert_eq!(sense(&r), (ILLEGAL, 0x1A, 0x00));
    let many = unmap_list(&vec![(0, 1); 257]);
    let r = run_data(&t, &cdb10(UNMAP, 0, many.len() as u16), &many).await;
    invalid_param_field(&r, 2, None);
    let mut c = cdb10(UNMAP, 0, 24);
    c[1] = 0x01;
    invalid_cdb_field(&run_data(&t, &c, &list).await, 1, Some(0));
}

#[tokio::test]
async fn unmap_total_above_maximum_is_invalid_field_in_parameter_list() {
    let t = target_over(Arc::new(NullBackend::new(16 << 40)), cfg(512));
    let list = unmap_list(&[(0, 1 << 20), (1 << 20, 1)]);
    let r = run_data(&t, &cdb10(opcode::UNMAP, 0, list.len() as u16), &list).await;
    invalid_param_field(&r, 24 + 8, None);
}

#[tokio::test]
async fn unmap_without_backend_support_is_invalid_opcode() {
    let mut b = TestBackend::new(1 << 20);
    b.unmap = false;
    let (t, _) = test_target(b, cfg(512));
    let list = unmap_list(&[(0, 1)]);
    let r = run_data(&t, &cdb10(opcode::UNMAP, 0, 24), &list).await;
    assert_eq!(sense(&r), (ILLEGAL, 0x20, 0x00));
}

#[tokio::test]
async fn unmap_on_read_only_lu_is_write_protected() {
    let mut c = cfg(512);
    c.read_only = true;
    let t = target_over(Arc::new(RamBackend::new(1 << 20)), c);
    let list = unmap_list(&[(0, 1)]);
    let r = run_data(&t, &cdb10(opcode::UNMAP, 0, 24), &list).await;
    assert_eq!(sense(&r), (0x7, 0x27, 0x00));
}

#[tokio::test]
async fn get_lba_status_reports_rest_of_medium_by_allocation() {
    let t = ram_target();
    let mut c = cdb16(0x9E, 100, 1024);
    c[1] = 0x12;
    let mut want = vec![0, 0, 0, 20, 0, 0, 0, 0];
    want.extend_from_slice(&100u64.to_be_bytes());
    want.extend_from_slice(&1948u32.to_be_bytes());
    want.extend_from_slice(&[1, 0, 0, 0]); // never written: deallocated
    assert_eq!(good(&run(&t, &c).await), &want[..]);
    good(&run_data(&t, &cdb10(opcode::WRITE_10, 0, 1), &[1u8; 512]).await);
    // The 512 KiB RAM chunk holding it (blocks 0..1024) is now allocated, the rest is not.
    let mut want = vec![0, 0, 0, 36, 0, 0, 0, 0];
    want.extend_from_slice(&100u64.to_be_bytes());
    want.extend_from_slice(&924u32.to_be_bytes());
    want.extend_from_slice(&[0, 0, 0, 0]);
    want.extend_from_slice(&1024u64.to_be_bytes());
    want.extend_from_slice(&1024u32.to_be_bytes());
    want.extend_from_slice(&[1, 0, 0, 0]);
    assert_eq!(good(&run(&t, &c).await), &want[..]);
    let mut c = cdb16(0x9E, 2048, 1024);
    c[1] = 0x12;
    assert_eq!(sense(&run(&t, &c).await), LBA_OOR);
}

#[tokio::test]
async fn sanitize_block_erase_deallocates_everything_and_get_lba_status_says_so() {
    let t = ram_target();
    good(&run_data(&t, &cdb10(opcode::WRITE_10, 0, 4), &[1u8; 2048]).await);
    let mut gls = cdb16(opcode::SERVICE_ACTION_IN_16, 0, 0);
    gls[1] = opcode::SAI_GET_LBA_STATUS;
    gls[13] = 64;
    let r = run(&t, &gls).await;
    assert_eq!(good(&r)[20], 0, "mapped before SANITIZE");
    let mut c = vec![0u8; 10];
    c[0] = opcode::SANITIZE;
    c[1] = opcode::SA_SANITIZE_BLOCK_ERASE;
    good(&run(&t, &c).await);
    let r = run(&t, &cdb10(opcode::READ_10, 0, 4)).await;
    assert!(good(&r).iter().all(|&b| b == 0));
    let r = run(&t, &gls).await;
    let d = good(&r);
    assert_eq!(&d[8..16], &0u64.to_be_bytes());
    assert_eq!(&d[16..20], &2048u32.to_be_bytes());
    assert_eq!(d[20], 1, "deallocated after SANITIZE");
    c[1] = opcode::SA_SANITIZE_OVERWRITE;
    invalid_cdb_field(&run(&t, &c).await, 1, Some(4));
}

// ---------------------------------------------------------------------------------------------
// COMPARE AND WRITE, ORWRITE
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn compare_and_write_writes_when_data_matches() {
    let t = ram_target();
    let old = pattern(1024, 1);
    let new = pattern(1024, 2);
    good(&run_data(&t, &cdb10(opcode::WRITE_10, 8, 2), &old).await);
    good(&run_data(&t, &caw(8, 2), &[old.clone(), new.clone()].concat()).await);
    assert_eq!(
        good(&run(&t, &cdb10(opcode::READ_10, 8, 2)).await),
        &new[..]
    );
}

#[tokio::test]
async fn compare_and_write_miscompare_reports_offset_and_writes_nothing() {
    let t = ram_target();
    let old = pattern(1024, 1);
    good(&run_data(&t, &cdb10(opcode::WRITE_10, 8, 2), &old).await);
    let mut verify = old.clone();
    verify[700] ^= 0x80;
    let r = run_data(&t, &caw(8, 2), &[verify, vec![0xAA; 1024]].concat()).await;
    assert_eq!(sense(&r), (0xE, 0x1D, 0x00));
    assert_eq!(&r.sense.unwrap()[3..7], &700u32.to_be_bytes());
    assert_eq!(
        good(&run(&t, &cdb10(opcode::READ_10, 8, 2)).await),
        &old[..]
    );
}

#[tokio::test]
async fn compare_and_write_field_errors() {
    let t = ram_target();
    invalid_cdb_field(
        &run_data(&t, &caw(0, 65), &vec![0; 65 * 1024]).await,
        13,
        None,
    );
    invalid_cdb_field(&run_data(&t, &caw(0, 2), &[0; 1024]).await, 13, None);
    assert_eq!(
        sense(&run_data(&t, &caw(2047, 2), &[0; 2048]).await),
        LBA_OOR
    );
    good(&run(&t, &caw(0, 0)).await);
}

#[tokio::test]
async fn compare_and_write_is_atomic_against_a_concurrent_write() {
    let mut b = TestBackend::new(1 << 20);
    b.yield_reads = true;
    let (t, _) = test_target(b, cfg(512));
    let a = vec![0xA; 512];
    let bb = vec![0xB; 512];
    let c = vec![0xC; 512];
    good(&run_data(&t, &cdb10(opcode::WRITE_10, 0, 1), &a).await);
    // CAW reads (and yields) first; the WRITE must wait for it rather than land in between.
    let caw_data = [a.clone(), bb.clone()].concat();
    let (caw_cdb, write_cdb) = (caw(0, 1), cdb10(opcode::WRITE_10, 0, 1));
    let (r1, r2) = tokio::join!(
        run_data(&t, &caw_cdb, &caw_data),
        run_data(&t, &write_cdb, &c),
    );
    good(&r1);
    good(&r2);
    assert_eq!(good(&run(&t, &cdb10(opcode::READ_10, 0, 1)).await), &c[..]);
}

#[tokio::test]
async fn compare_and_write_zero_blocks_with_data_is_invalid_field() {
    let t = ram_target();
    let mut c = cdb16(opcode::COMPARE_AND_WRITE, 0, 0);
    c[13] = 0;
    let r = run_data(&t, &c, &[0u8; 1024]).await;
    invalid_cdb_field(&r, 13, None);
    good(&run_data(&t, &c, &[]).await);
}

#[tokio::test]
async fn compare_and_write_with_data_other_than_twice_the_count_is_invalid_field() {
    let t = ram_target();
    let mut c = cdb16(opcode::COMPARE_AND_WRITE, 0, 0);
    c[13] = 1;
    // Four blocks for a one-block COMPARE AND WRITE: which half is which would be a guess.
    invalid_cdb_field(&run_data(&t, &c, &[0; 2048]).await, 13, None);
    c[13] = 3;
    invalid_cdb_field(&run_data(&t, &c, &[0; 2048]).await, 13, None);
    c[13] = 1;
    good(&run_data(&t, &c, &[0; 1024]).await);
}

#[tokio::test]
async fn orwrite_ors_data_into_the_medium() {
    let t = ram_target();
    good(&run_data(&t, &cdb10(opcode::WRITE_10, 3, 1), &[0x0Fu8; 512]).await);
    good(&run_data(&t, &cdb16(opcode::ORWRITE_16, 3, 1), &[0xF0u8; 512]).await);
    let r = run(&t, &cdb10(opcode::READ_10, 3, 1)).await;
    assert!(good(&r).iter().all(|&b| b == 0xFF));
    let r = run_data(&t, &cdb16(opcode::ORWRITE_16, 2048, 1), &[0u8; 512]).await;
    assert_eq!(sense(&r), (0x05, 0x21, 0x00));
}

// ---------------------------------------------------------------------------------------------
// PRE-FETCH, READ DEFECT DATA
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn pre_fetch_is_condition_met_and_range_checked() {
    let t = ram_target();
    let r = run(&t, &cdb10(opcode::PRE_FETCH_10, 0, 16)).await;
    assert_eq!(r.status, Status::CONDITION_MET);
    let r = run(&t, &cdb16(opcode::PRE_FETCH_16, 2040, 16)).await;
    assert_eq!(sense(&r), (0x05, 0x21, 0x00));
}

#[tokio::test]
async fn read_defect_data_is_an_empty_list() {
    let t = ram_target();
    let mut c = vec![0u8; 10];
    c[0] = opcode::READ_DEFECT_DATA_10;
    c[2] = 0x0C | 0x04;
    c[8] = 4;
    assert_eq!(good(&run(&t, &c).await), &[0, 0x0C | 0x04, 0, 0]);
}

// ---------------------------------------------------------------------------------------------
// Writes received in place (Target::place_write)
// ---------------------------------------------------------------------------------------------

/// `place_write` makes the WRITE's checks before its data and locks its range; anything that
/// would make the command fail, wait, or write other than exactly its transfer is left to
/// `execute` (`None`). A real 1 MiB file on tmpfs, the one kind of backend that takes bytes in
/// place.
#[tokio::test]
async fn place_write_checks_first_and_leaves_every_doubtful_write_to_execute() {
    let path = std::path::PathBuf::from(format!(
        "/dev/shm/ironsan-scsi-place-{}.img",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&path);
    let file = ironsan_backend::FileBackend::open(
        &path,
        &ironsan_backend::FileOptions {
            size: Some(1 << 20),
            ..Default::default()
        },
    )
    .unwrap();
    let t = target_over(Arc::new(file), cfg(512));
    let (a, b) = (nexus(1), nexus(2));
    let w = cdb16(WRITE_16, 16, 128);
    // A nexus not seen yet may have a unit attention to report: left to execute.
    assert!(t.place_write(0, &a, &w, 64 << 10).is_none());
    for n in [&a, &b] {
        while run_on(&t, 0, n, &[0u8; 6], &[]).await.status != Status::GOOD {}
    }
    let p = t
        .place_write(0, &a, &w, 64 << 10)
        .expect("a plain WRITE is placed");
    // Its blocks are locked: an overlapping write is left to execute (which waits), a
    // disjoint one is placed.
    assert!(t
        .place_write(0, &a, &cdb16(WRITE_16, 100, 8), 4096)
        .is_none());
    assert!(t
        .place_write(0, &b, &cdb16(WRITE_16, 200, 8), 4096)
        .is_some());
    // Data-Out not exactly the transfer, a range past the end, a zero-length write,
    // protection information, a READ, a LUN that does not exist: left to execute.
    assert!(t
        .place_write(0, &a, &cdb16(WRITE_16, 300, 8), 2048)
        .is_none());
    assert!(t
        .place_write(0, &a, &cdb16(WRITE_16, 2044, 8), 4096)
        .is_none());
    assert!(t.place_write(0, &a, &cdb16(WRITE_16, 300, 0), 0).is_none());
    let mut protected = cdb16(WRITE_16, 300, 8);
    protected[1] = 0x20;
    assert!(t.place_write(0, &a, &protected, 4096).is_none());
    assert!(t
        .place_write(0, &a, &cdb16(READ_16, 300, 8), 4096)
        .is_none());
    assert!(t
        .place_write(7, &a, &cdb16(WRITE_16, 300, 8), 4096)
        .is_none());
    // Bytes given to the placed write are in the medium when it finishes; then its range is
    // free again.
    let data = pattern(64 << 10, 3);
    p.target().write_at(0, &data[..4096]).unwrap();
    p.target().write_at(4096, &data[4096..]).unwrap();
    p.finish().unwrap();
    let r = run_on(&t, 0, &a, &cdb16(READ_16, 16, 128), &[]).await;
    assert_eq!(r.status, Status::GOOD);
    assert!(r.data_in == DataIn::Memory(Bytes::from(data)));
    assert!(t
        .place_write(0, &a, &cdb16(WRITE_16, 100, 8), 4096)
        .is_some());
    // A write the target cannot take whole is not placed past its end.
    let p = t.place_write(0, &a, &cdb16(WRITE_16, 0, 8), 4096).unwrap();
    assert!(p.target().write_at(4090, &[0u8; 8]).is_err());
    drop(p);
    // An SPC-2 reservation held by another nexus: left to execute, which reports the conflict.
    let mut reserve = vec![0u8; 6];
    reserve[0] = opcode::RESERVE_6;
    good(&run_on(&t, 0, &b, &reserve, &[]).await);
    assert!(t.place_write(0, &a, &w, 64 << 10).is_none());
    let r = run_on(&t, 0, &a, &w, &vec![0u8; 64 << 10]).await;
    assert_eq!(r, Response::status_only(Status::RESERVATION_CONFLICT));
    let _ = std::fs::remove_file(&path);
}
