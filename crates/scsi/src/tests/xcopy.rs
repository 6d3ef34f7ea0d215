//! EXTENDED COPY (LID1), RECEIVE COPY RESULTS and the Third-party Copy VPD page (`xcopy.rs`).

use super::*;
use crate::xcopy;

const NAA2: u64 = 0x3000_0000_0000_0002;

/// Identification CSCD descriptor (E4h) naming the LU with NAA `naa`.
fn cscd(naa: u64) -> Vec<u8> {
    let mut d = vec![0u8; 32];
    d[0] = 0xE4;
    d[4] = 0x01; // binary
    d[5] = 0x03; // association LU, type NAA
    d[7] = 8;
    d[8..16].copy_from_slice(&naa.to_be_bytes());
    d[29..32].copy_from_slice(&512u32.to_be_bytes()[1..]);
    d
}

/// Block → block segment descriptor (02h).
fn b2b(src: u16, dst: u16, blocks: u16, src_lba: u64, dst_lba: u64) -> Vec<u8> {
    let mut d = vec![0u8; 28];
    d[0] = 0x02;
    d[2..4].copy_from_slice(&24u16.to_be_bytes());
    d[4..6].copy_from_slice(&src.to_be_bytes());
    d[6..8].copy_from_slice(&dst.to_be_bytes());
    d[10..12].copy_from_slice(&blocks.to_be_bytes());
    d[12..20].copy_from_slice(&src_lba.to_be_bytes());
    d[20..28].copy_from_slice(&dst_lba.to_be_bytes());
    d
}

/// EXTENDED COPY (LID1) parameter list.
fn xcopy_list(list_id: u8, usage: u8, cscds: &[Vec<u8>], segs: &[Vec<u8>]) -> Vec<u8> {
    let c: Vec<u8> = cscds.concat();
    let s: Vec<u8> = segs.concat();
    let mut p = vec![0u8; 16];
    p[0] = list_id;
    p[1] = usage << 3;
    p[2..4].copy_from_slice(&(c.len() as u16).to_be_bytes());
    p[8..12].copy_from_slice(&(s.len() as u32).to_be_bytes());
    p.extend_from_slice(&c);
    p.extend_from_slice(&s);
    p
}

fn xcopy_cdb(len: usize) -> Vec<u8> {
    let mut c = vec![0u8; 16];
    c[0] = opcode::EXTENDED_COPY;
    c[10..14].copy_from_slice(&(len as u32).to_be_bytes());
    c
}

fn rcr_cdb(sa: u8, list_id: u8) -> Vec<u8> {
    let mut c = vec![0u8; 16];
    c[0] = opcode::RECEIVE_COPY_RESULTS;
    c[1] = sa;
    c[2] = list_id;
    c[10..14].copy_from_slice(&1024u32.to_be_bytes());
    c
}

async fn xcopy(t: &Target, list: &[u8]) -> Response {
    run_data(t, &xcopy_cdb(list.len()), list).await
}

/// Two 2048-block RAM LUs: LUN 0 (NAA) and LUN 1 (NAA2).
fn two_lu_target(cfg1: LuConfig) -> Target {
    let mut t = ram_target();
    t.add_lun(
        1,
        Arc::new(LogicalUnit::new(Arc::new(RamBackend::new(1 << 20)), cfg1)),
    );
    t
}

fn cfg_naa2() -> LuConfig {
    LuConfig {
        naa: NAA2,
        ..cfg(512)
    }
}

const COPY_ABORTED: u8 = 0xA;

#[tokio::test]
async fn extended_copy_copies_blocks_within_one_lu() {
    let t = ram_target();
    let data = pattern(16 * 512, 3);
    good(&run_data(&t, &cdb10(opcode::WRITE_10, 0, 16), &data).await);
    let list = xcopy_list(1, 0b10, &[cscd(NAA)], &[b2b(0, 0, 16, 0, 2032)]);
    good(&xcopy(&t, &list).await);
    assert_eq!(
        good(&run(&t, &cdb10(opcode::READ_10, 2032, 16)).await),
        &data[..]
    );
}

#[tokio::test]
async fn extended_copy_copies_between_lus_of_the_target() {
    let t = two_lu_target(cfg_naa2());
    let data = pattern(8 * 512, 9);
    good(&run_data(&t, &cdb10(opcode::WRITE_10, 100, 8), &data).await);
    let list = xcopy_list(
        0,
        0b11,
        &[cscd(NAA), cscd(NAA2)],
        &[b2b(0, 1, 4, 100, 0), b2b(0, 1, 4, 104, 10)],
    );
    good(&xcopy(&t, &list).await);
    let n = nexus(1);
    let a = good(&run_on(&t, 1, &n, &cdb10(opcode::READ_10, 0, 4), &[]).await).to_vec();
    let b = good(&run_on(&t, 1, &n, &cdb10(opcode::READ_10, 10, 4), &[]).await).to_vec();
    assert_eq!(a, &data[..2048]);
    assert_eq!(b, &data[2048..]);
}

#[tokio::test]
async fn extended_copy_of_overlapping_ranges_behaves_like_memmove() {
    // 3 MiB LU; copy 2 MiB (more than one chunk) forward by 1 block, then backward.
    let t = target_over(Arc::new(RamBackend::new(3 << 20)), cfg(512));
    let data = pattern(4096 * 512, 5);
    good(&run_data(&t, &cdb10(opcode::WRITE_10, 0, 4096), &data).await);
    let list = xcopy_list(0, 0b11, &[cscd(NAA)], &[b2b(0, 0, 4096, 0, 1)]);
    good(&xcopy(&t, &list).await);
    let d = good(&run(&t, &cdb10(opcode::READ_10, 1, 4096)).await).to_vec();
    assert_eq!(d, data);
    let list = xcopy_list(0, 0b11, &[cscd(NAA)], &[b2b(0, 0, 4096, 1, 0)]);
    good(&xcopy(&t, &list).await);
    let d = good(&run(&t, &cdb10(opcode::READ_10, 0, 4096)).await).to_vec();
    assert_eq!(d, data);
}

#[tokio::test]
async fn extended_copy_writes_are_durable_with_wce_off_and_cached_with_wce_on() {
    let (t, b) = test_target(TestBackend::new(1 << 20), cfg(512));
    let list = xcopy_list(0, 0b11, &[cscd(NAA)], &[b2b(0, 0, 8, 0, 8)]);
    good(&xcopy(&t, &list).await);
    assert_eq!(b.modes(), vec![WriteMode::Durable]);
    let mut wce = cfg(512);
    wce.write_cache = true;
    let (t, b) = test_target(TestBackend::new(1 << 20), wce);
    good(&xcopy(&t, &list).await);
    assert_eq!(b.modes(), vec![WriteMode::Cached]);
}

#[tokio::test]
async fn extended_copy_with_parameter_list_length_0_is_good_and_does_nothing() {
    let t = ram_target();
    good(&run(&t, &xcopy_cdb(0)).await);
}

#[tokio::test]
async fn extended_copy_truncated_lists_are_parameter_list_length_errors() {
    let t = ram_target();
    let list = xcopy_list(1, 0, &[cscd(NAA)], &[b2b(0, 0, 8, 0, 8)]);
    for len in [10, 16 + 31, 16 + 32 + 27] {
        let r = run_data(&t, &xcopy_cdb(len), &list[..len]).await;
        assert_eq!(sense(&r), (ILLEGAL, 0x1A, 0x00), "len {len}");
    }
    // Less Data-Out than the CDB's PARAMETER LIST LENGTH.
    let r = run_data(&t, &xcopy_cdb(list.len()), &list[..40]).await;
    assert_eq!(sense(&r), (ILLEGAL, 0x1A, 0x00));
}

#[tokio::test]
async fn extended_copy_descriptor_limits_give_too_many_descriptors() {
    let t = ram_target();
    let cscds = vec![cscd(NAA); 9];
    let list = xcopy_list(1, 0, &cscds, &[b2b(0, 0, 8, 0, 8)]);
    assert_eq!(sense(&xcopy(&t, &list).await), (ILLEGAL, 0x26, 0x06));
    let segs = vec![b2b(0, 0, 1, 0, 8); 33];
    let list = xcopy_list(1, 0, &[cscd(NAA)], &segs);
    assert_eq!(sense(&xcopy(&t, &list).await), (ILLEGAL, 0x26, 0x08));
    // Both over the limit: longer than MAXIMUM DESCRIPTOR LIST LENGTH.
    let list = xcopy_list(1, 0, &cscds, &segs);
    assert_eq!(sense(&xcopy(&t, &list).await), (ILLEGAL, 0x1A, 0x00));
}

#[tokio::test]
async fn extended_copy_unsupported_descriptor_types() {
    let t = ram_target();
    let mut fc = cscd(NAA);
    fc[0] = 0xE0; // Fibre Channel N_Port_Name
    let list = xcopy_list(1, 0, &[fc], &[b2b(0, 0, 8, 0, 8)]);
    assert_eq!(sense(&xcopy(&t, &list).await), (ILLEGAL, 0x26, 0x07));
    let mut s2s = b2b(0, 0, 8, 0, 8);
    s2s[0] = 0x03; // stream → stream
    let list = xcopy_list(1, 0, &[cscd(NAA)], &[s2s]);
    assert_eq!(sense(&xcopy(&t, &list).await), (ILLEGAL, 0x26, 0x09));
}

#[tokio::test]
async fn extended_copy_ignores_lu_id_type_and_refuses_a_non_block_peripheral_type() {
    let t = ram_target();
    let mut d = cscd(NAA);
    d[1] = 0x80; // LU ID TYPE 10b
    good(&xcopy(&t, &xcopy_list(1, 0b10, &[d], &[b2b(0, 0, 8, 0, 8)])).await);
    let mut d = cscd(NAA);
    d[1] = 0x01; // sequential access
    let r = xcopy(&t, &xcopy_list(1, 0, &[d], &[b2b(0, 0, 8, 0, 8)])).await;
    invalid_param_field(&r, 17, Some(4));
}

#[tokio::test]
async fn extended_copy_bad_descriptor_index_or_nul_target_is_copy_aborted_unreachable() {
    let t = ram_target();
    let list = xcopy_list(1, 0, &[cscd(NAA)], &[b2b(0, 1, 8, 0, 8)]);
    let r = xcopy(&t, &list).await;
    assert_eq!(sense(&r), (COPY_ABORTED, 0x08, 0x04));
    let mut nul = cscd(NAA);
    nul[1] = 0x20;
    let list = xcopy_list(1, 0, &[nul], &[b2b(0, 0, 8, 0, 8)]);
    assert_eq!(sense(&xcopy(&t, &list).await), (COPY_ABORTED, 0x08, 0x04));
}

#[tokio::test]
async fn extended_copy_of_an_lu_outside_the_target_is_copy_target_not_reachable() {
    let t = ram_target();
    let list = xcopy_list(1, 0, &[cscd(NAA), cscd(NAA2)], &[b2b(0, 1, 8, 0, 8)]);
    let r = xcopy(&t, &list).await;
    assert_eq!(sense(&r), (COPY_ABORTED, 0x0D, 0x02));
}

#[tokio::test]
async fn extended_copy_beyond_capacity_is_copy_aborted_before_any_data_moves() {
    let t = ram_target();
    good(&run_data(&t, &cdb10(opcode::WRITE_10, 0, 8), &[1; 4096]).await);
    // Segment 0 is fine, segment 1 runs past the end: nothing is copied at all.
    let list = xcopy_list(
        1,
        0,
        &[cscd(NAA)],
        &[b2b(0, 0, 8, 0, 100), b2b(0, 0, 8, 0, 2047)],
    );
    let r = xcopy(&t, &list).await;
    assert_eq!(sense(&r), (COPY_ABORTED, 0x00, 0x00));
    let s = r.sense.as_ref().unwrap();
    assert_eq!(&s[8..12], &1u32.to_be_bytes()); // COMMAND-SPECIFIC INFORMATION: segment 1
    let d = good(&run(&t, &cdb10(opcode::READ_10, 100, 8)).await).to_vec();
    assert!(d.iter().all(|&b| b == 0));
}

#[tokio::test]
async fn extended_copy_block_length_mismatch_is_invalid_field_in_parameter_list() {
    let t = ram_target();
    let mut d = cscd(NAA);
    d[29..32].copy_from_slice(&4096u32.to_be_bytes()[1..]);
    let r = xcopy(&t, &xcopy_list(1, 0, &[d], &[b2b(0, 0, 8, 0, 8)])).await;
    invalid_param_field(&r, 16 + 29, None);
}

#[tokio::test]
async fn extended_copy_to_a_write_protected_lu_is_data_protect() {
    let mut ro = cfg_naa2();
    ro.read_only = true;
    let t = two_lu_target(ro);
    let list = xcopy_list(1, 0, &[cscd(NAA), cscd(NAA2)], &[b2b(0, 1, 8, 0, 8)]);
    assert_eq!(sense(&xcopy(&t, &list).await), (0x7, 0x27, 0x00));
    // Reading from it is fine.
    let list = xcopy_list(1, 0b10, &[cscd(NAA), cscd(NAA2)], &[b2b(1, 0, 8, 0, 8)]);
    good(&xcopy(&t, &list).await);
}

#[tokio::test]
async fn extended_copy_honours_reservations_on_source_and_destination() {
    let t = two_lu_target(cfg_naa2());
    let (a, b) = (nexus(1), nexus(2));
    // Nexus 2 holds an SPC-2 reservation of LUN 1: nexus 1 may not copy into or out of it.
    let mut reserve = vec![0u8; 6];
    reserve[0] = opcode::RESERVE_6;
    good(&run_on(&t, 1, &b, &reserve, &[]).await);
    for seg in [b2b(0, 1, 8, 0, 8), b2b(1, 0, 8, 0, 8)] {
        let list = xcopy_list(0, 0b11, &[cscd(NAA), cscd(NAA2)], &[seg]);
        let r = run_on(&t, 0, &a, &xcopy_cdb(list.len()), &list).await;
        assert_eq!(r, Response::status_only(Status::RESERVATION_CONFLICT));
    }
    // The holder may.
    let list = xcopy_list(0, 0b11, &[cscd(NAA), cscd(NAA2)], &[b2b(0, 1, 8, 0, 8)]);
    good(&run_on(&t, 0, &b, &xcopy_cdb(list.len()), &list).await);
}

#[tokio::test]
async fn extended_copy_honours_write_exclusive_persistent_reservation_of_destination() {
    let t = two_lu_target(cfg_naa2());
    let (a, b) = (nexus(1), nexus(2));
    good(&run_on(&t, 1, &b, &prout(0x06, 0), &prout_params(0, 0xBB, false)).await);
    good(&run_on(&t, 1, &b, &prout(0x01, 0x01), &prout_params(0xBB, 0, false)).await);
    let list = xcopy_list(0, 0b11, &[cscd(NAA), cscd(NAA2)], &[b2b(0, 1, 8, 0, 8)]);
    let r = run_on(&t, 0, &a, &xcopy_cdb(list.len()), &list).await;
    assert_eq!(r.status, Status::RESERVATION_CONFLICT);
    // Write Exclusive lets others read: copying out of LUN 1 works.
    let list = xcopy_list(0, 0b11, &[cscd(NAA), cscd(NAA2)], &[b2b(1, 0, 8, 0, 8)]);
    good(&run_on(&t, 0, &a, &xcopy_cdb(list.len()), &list).await);
}

#[tokio::test]
async fn extended_copy_medium_error_is_copy_aborted_with_the_medium_asc() {
    let (t, b) = test_target(TestBackend::new(1 << 20), cfg(512));
    b.fail_with(BackendError::ReadError { offset: 0 });
    let list = xcopy_list(0, 0b11, &[cscd(NAA)], &[b2b(0, 0, 8, 0, 8)]);
    assert_eq!(sense(&xcopy(&t, &list).await), (COPY_ABORTED, 0x11, 0x00));
}

#[tokio::test]
async fn extended_copy_lid4_service_action_is_invalid_field() {
    let t = ram_target();
    let mut c = xcopy_cdb(0);
    c[1] = 0x01;
    invalid_cdb_field(&run(&t, &c).await, 1, Some(4));
}

#[tokio::test]
async fn extended_copy_list_id_usage_11b_needs_list_identifier_0() {
    let t = ram_target();
    let list = xcopy_list(5, 0b11, &[cscd(NAA)], &[b2b(0, 0, 8, 0, 8)]);
    invalid_param_field(&xcopy(&t, &list).await, 0, None);
}

#[tokio::test]
async fn receive_copy_status_reports_a_held_copy_once() {
    let t = ram_target();
    let r = run(&t, &rcr_cdb(0x00, 1)).await;
    invalid_cdb_field(&r, 2, None); // no such copy
    good(
        &xcopy(
            &t,
            &xcopy_list(1, 0b00, &[cscd(NAA)], &[b2b(0, 0, 8, 0, 8)]),
        )
        .await,
    );
    let r = run(&t, &rcr_cdb(0x00, 1)).await;
    let d = good(&r);
    assert_eq!(&d[..4], &8u32.to_be_bytes());
    assert_eq!(d[4], 0x01); // completed without errors
    assert_eq!(&d[5..7], &1u16.to_be_bytes()); // segments processed
    assert_eq!(d[7], 0x00); // bytes
    assert_eq!(&d[8..12], &4096u32.to_be_bytes());
    invalid_cdb_field(&run(&t, &rcr_cdb(0x00, 1)).await, 2, None);
}

#[tokio::test]
async fn receive_copy_status_of_a_failed_copy_reports_completed_with_errors() {
    let (t, b) = test_target(TestBackend::new(1 << 20), cfg(512));
    good(
        &xcopy(
            &t,
            &xcopy_list(7, 0b00, &[cscd(NAA)], &[b2b(0, 0, 8, 0, 8)]),
        )
        .await,
    );
    good(&run(&t, &rcr_cdb(0x00, 7)).await);
    b.fail_with(BackendError::WriteError { offset: 0 });
    let list = xcopy_list(7, 0b00, &[cscd(NAA)], &[b2b(0, 0, 8, 0, 8)]);
    assert_eq!(sense(&xcopy(&t, &list).await), (COPY_ABORTED, 0x0C, 0x00));
    *b.fail.lock().unwrap() = None;
    let r = run(&t, &rcr_cdb(0x00, 7)).await;
    assert_eq!(good(&r)[4], 0x02);
    assert_eq!(&good(&r)[5..7], &0u16.to_be_bytes());
}

#[tokio::test]
async fn receive_copy_status_is_per_nexus_not_kept_for_discard_usage_and_dropped_on_nexus_loss() {
    let t = ram_target();
    good(
        &xcopy(
            &t,
            &xcopy_list(2, 0b10, &[cscd(NAA)], &[b2b(0, 0, 8, 0, 8)]),
        )
        .await,
    );
    invalid_cdb_field(&run(&t, &rcr_cdb(0x00, 2)).await, 2, None);
    good(
        &xcopy(
            &t,
            &xcopy_list(3, 0b00, &[cscd(NAA)], &[b2b(0, 0, 8, 0, 8)]),
        )
        .await,
    );
    let other = run_on(&t, 0, &nexus(2), &rcr_cdb(0x00, 3), &[]).await;
    invalid_cdb_field(&other, 2, None);
    t.nexus_lost(1);
    invalid_cdb_field(&run(&t, &rcr_cdb(0x00, 3)).await, 2, None);
}

#[tokio::test]
async fn receive_copy_results_operating_parameters_reports_the_enforced_limits() {
    let t = ram_target();
    let r = run(&t, &rcr_cdb(0x03, 0)).await;
    let d = good(&r);
    assert_eq!(d.len(), 46);
    assert_eq!(&d[..4], &42u32.to_be_bytes());
    assert_eq!(d[4], 0x01); // SNLID
    assert_eq!(&d[8..10], &8u16.to_be_bytes());
    assert_eq!(&d[10..12], &32u16.to_be_bytes());
    assert_eq!(&d[12..16], &(8 * 32 + 32 * 28u32).to_be_bytes());
    assert_eq!(&d[16..20], &(64u32 << 20).to_be_bytes());
    assert_eq!(&d[20..24], &[0; 4]); // no inline data
    assert_eq!(&d[34..36], &16u16.to_be_bytes());
    assert_eq!(d[37], 9); // 512-byte granularity
    assert_eq!(d[43], 2);
    assert_eq!(&d[44..46], &[0x02, 0xE4]);
    // Other service actions are not offered.
    invalid_cdb_field(&run(&t, &rcr_cdb(0x01, 0)).await, 1, Some(4));
    invalid_cdb_field(&run(&t, &rcr_cdb(0x04, 0)).await, 1, Some(4));
}

#[test]
fn copy_results_refuse_a_list_id_in_use_and_bound_what_they_keep() {
    let mut c = xcopy::CopyResults::default();
    assert!(c.begin_for_test(1, 5));
    assert!(!c.begin_for_test(1, 5)); // still running: OPERATION IN PROGRESS
    assert!(c.begin_for_test(2, 5)); // another nexus
    c.finish_for_test(1, 5);
    assert!(c.begin_for_test(1, 5)); // done: the id may be reused
    for id in 10..40 {
        assert!(c.begin_for_test(1, id));
        c.finish_for_test(1, id);
    }
    assert!(c.len_for_test(1) <= 17);
}

#[tokio::test]
async fn third_party_copy_vpd_page_describes_lid1_support() {
    let t = ram_target();
    let r = run(&t, &inquiry(true, 0x8F, 1024)).await;
    let p = good(&r);
    assert_eq!(&p[..2], &[0x00, 0x8F]);
    assert_eq!(usize::from(u16::from_be_bytes([p[2], p[3]])), p.len() - 4);
    // Walk the descriptors: (type, length), lengths multiples of 4.
    let mut at = 4;
    let mut kinds = Vec::new();
    while at < p.len() {
        let kind = u16::from_be_bytes([p[at], p[at + 1]]);
        let len = usize::from(u16::from_be_bytes([p[at + 2], p[at + 3]]));
        assert_eq!(len % 4, 0);
        if kind == 0x0001 {
            assert_eq!(
                &p[at + 4..at + 12],
                &[7, 0x83, 1, 0x00, 0x84, 2, 0x00, 0x03]
            );
        }
        if kind == 0x0004 {
            assert_eq!(len, 0x1C);
            assert_eq!(&p[at + 8..at + 12], &[0, 8, 0, 32]);
        }
        if kind == 0x8001 {
            assert_eq!(len, 0x20);
        }
        kinds.push(kind);
        at += 4 + len;
    }
    assert_eq!(at, p.len());
    assert_eq!(kinds, vec![0x0001, 0x0004, 0x0008, 0x000C, 0x8001]);
}

#[tokio::test]
async fn rsoc_reports_extended_copy_and_receive_copy_results() {
    let t = ram_target();
    for (op, sa) in [(0x83u8, 0x00u16), (0x84, 0x00), (0x84, 0x03)] {
        let mut c = vec![opcode::MAINTENANCE_IN, 0x0C, 0x02, op];
        c.extend_from_slice(&sa.to_be_bytes());
        c.extend_from_slice(&512u32.to_be_bytes());
        c.extend_from_slice(&[0, 0]);
        let r = run(&t, &c).await;
        assert_eq!(good(&r)[1] & 0x07, 0b011, "op {op:02x}/{sa:02x}");
    }
}
