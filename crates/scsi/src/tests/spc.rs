//! SPC-4 primary commands (`spc.rs`): INQUIRY and VPD, REPORT LUNS, TEST UNIT READY, REQUEST
//! SENSE, REPORT SUPPORTED OPERATION CODES, RESERVE / RELEASE, PREVENT ALLOW MEDIUM REMOVAL.

use super::*;
use crate::{cdb, spc};

// ---------------------------------------------------------------------------------------------
// INQUIRY and VPD
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn inquiry_standard_data_is_byte_exact() {
    let t = ram_target();
    let r = run(&t, &inquiry(false, 0, 255)).await;
    let mut want = [0u8; 96];
    want[..8].copy_from_slice(&[0x00, 0x00, 0x06, 0x12, 91, 0x38, 0x00, 0x02]); // TPGS=11b, 3PC
    want[8..16].copy_from_slice(b"IRONSAN ");
    want[16..32].copy_from_slice(b"RAMDISK         ");
    want[32..36].copy_from_slice(b"0.1 ");
    want[58..66].copy_from_slice(&[0x00, 0xA0, 0x04, 0x60, 0x04, 0xC0, 0x09, 0x60]);
    assert_eq!(good(&r), &want[..]);
}

#[tokio::test]
async fn inquiry_is_truncated_to_allocation_length() {
    let t = ram_target();
    assert_eq!(good(&run(&t, &inquiry(false, 0, 5)).await).len(), 5);
    assert_eq!(good(&run(&t, &inquiry(false, 0, 0)).await).len(), 0);
    assert_eq!(good(&run(&t, &inquiry(true, 0x83, 6)).await).len(), 6);
}

#[tokio::test]
async fn inquiry_cmddt_is_invalid_field_with_bit_pointer() {
    let t = ram_target();
    let mut c = inquiry(false, 0, 96);
    c[1] = 0x02;
    invalid_cdb_field(&run(&t, &c).await, 1, Some(1));
}

#[tokio::test]
async fn inquiry_page_code_without_evpd_is_invalid_field() {
    let t = ram_target();
    invalid_cdb_field(&run(&t, &inquiry(false, 0x80, 96)).await, 2, None);
}

#[tokio::test]
async fn inquiry_unknown_vpd_page_is_invalid_field() {
    let t = ram_target();
    invalid_cdb_field(&run(&t, &inquiry(true, 0x86, 96)).await, 2, None);
}

#[tokio::test]
async fn vpd_supported_pages_lists_every_page() {
    let t = ram_target();
    let r = run(&t, &inquiry(true, 0x00, 255)).await;
    assert_eq!(
        good(&r),
        &[0, 0, 0, 7, 0x00, 0x80, 0x83, 0x8F, 0xB0, 0xB1, 0xB2][..]
    );
}

#[tokio::test]
async fn vpd_unit_serial_number_reports_configured_serial() {
    let t = ram_target();
    let r = run(&t, &inquiry(true, 0x80, 255)).await;
    assert_eq!(good(&r), b"\x00\x80\x00\x06SN0001");
}

#[tokio::test]
async fn vpd_unit_serial_number_defaults_to_naa_hex() {
    let mut c = cfg(512);
    c.serial = "\u{7}".into();
    let t = target_over(Arc::new(RamBackend::new(1 << 20)), c);
    let r = run(&t, &inquiry(true, 0x80, 255)).await;
    assert_eq!(&good(&r)[4..], b"5001405abcdef012");
}

#[tokio::test]
async fn vpd_device_identification_is_byte_exact() {
    let t = ram_target();
    let r = run(&t, &inquiry(true, 0x83, 1024)).await;
    let mut body = vec![0x01, 0x03, 0x00, 0x08];
    body.extend_from_slice(&NAA.to_be_bytes());
    body.extend_from_slice(&[0x02, 0x01, 0x00, 14]);
    body.extend_from_slice(b"IRONSAN SN0001");
    body.extend_from_slice(&[0x51, 0x94, 0x00, 0x04, 0, 0, 0, 1]);
    body.extend_from_slice(&[0x53, 0x98, 0x00, 40]);
    body.extend_from_slice(TARGET_PORT.as_bytes());
    body.extend_from_slice(&[0, 0]);
    body.extend_from_slice(&[0x53, 0xA8, 0x00, 32]);
    body.extend_from_slice(b"iqn.2024-01.org.ironsan:disk1");
    body.extend_from_slice(&[0, 0, 0]);
    let mut want = vec![0x00, 0x83];
    want.extend_from_slice(&(body.len() as u16).to_be_bytes());
    want.extend_from_slice(&body);
    assert_eq!(good(&r), &want[..]);
}

#[tokio::test]
async fn vpd_naa_with_invalid_format_nibble_is_forced_locally_assigned() {
    let mut c = cfg(512);
    c.naa = 0x1234_5678_9abc_def0;
    let t = target_over(Arc::new(RamBackend::new(1 << 20)), c);
    let r = run(&t, &inquiry(true, 0x83, 1024)).await;
    assert_eq!(&good(&r)[8..16], &0x3234_5678_9abc_def0u64.to_be_bytes());
}

#[tokio::test]
async fn inquiry_to_missing_lun_reports_qualifier_3_type_1f() {
    let t = ram_target();
    let r = run_on(&t, 7, &nexus(1), &inquiry(false, 0, 96), &[]).await;
    let d = good(&r);
    assert_eq!(d.len(), 96);
    assert_eq!(d[0], 0x7F);
    assert_eq!(d[2], 0x06);
    let r = run_on(&t, 7, &nexus(1), &inquiry(true, 0x80, 96), &[]).await;
    assert_eq!(sense(&r), (ILLEGAL, 0x25, 0x00));
}

// ---------------------------------------------------------------------------------------------
// REPORT LUNS
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn report_luns_uses_peripheral_and_flat_space_addressing() {
    let mut t = ram_target();
    let lu = t.lun(0).unwrap().clone();
    t.add_lun(300, lu.clone());
    t.add_lun(5, lu);
    let c = [0xA0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0];
    for lun in [0, 42] {
        // REPORT LUNS works at any LUN, mapped or not.
        let r = run_on(&t, lun, &nexus(1), &c, &[]).await;
        assert_eq!(
            good(&r),
            &[
                0, 0, 0, 24, 0, 0, 0, 0, //
                0, 0, 0, 0, 0, 0, 0, 0, //
                0, 5, 0, 0, 0, 0, 0, 0, //
                0x41, 0x2C, 0, 0, 0, 0, 0, 0,
            ][..]
        );
    }
    // Truncated to 16 bytes; the list length still counts all LUNs.
    let mut c16 = c;
    c16[9] = 16;
    c16[8] = 0;
    let r = run(&t, &c16).await;
    assert_eq!(good(&r).len(), 16);
    assert_eq!(&good(&r)[..4], &[0, 0, 0, 24]);
}

#[tokio::test]
async fn report_luns_select_report_well_known_only_is_empty() {
    let t = ram_target();
    let r = run(&t, &[0xA0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0]).await;
    assert_eq!(good(&r), &[0u8; 8][..]);
    let r = run(&t, &[0xA0, 0, 2, 0, 0, 0, 0, 0, 1, 0, 0, 0]).await;
    assert_eq!(good(&r).len(), 16);
}

#[tokio::test]
async fn report_luns_unknown_select_report_is_invalid_field() {
    let t = ram_target();
    let r = run(&t, &[0xA0, 0, 3, 0, 0, 0, 0, 0, 1, 0, 0, 0]).await;
    invalid_cdb_field(&r, 2, None);
}

#[tokio::test]
async fn report_luns_allocation_below_16_is_invalid_field() {
    let t = ram_target();
    let r = run(&t, &[0xA0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 0, 0]).await;
    invalid_cdb_field(&r, 6, None);
}

// ---------------------------------------------------------------------------------------------
// TEST UNIT READY, REQUEST SENSE
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn test_unit_ready_is_good() {
    let t = ram_target();
    assert!(good(&run(&t, &[0; 6]).await).is_empty());
}

#[tokio::test]
async fn request_sense_without_pending_condition_is_no_sense() {
    let t = ram_target();
    let r = run(&t, &[0x03, 0, 0, 0, 252, 0]).await;
    let mut want = [0u8; 18];
    want[0] = 0x70;
    want[7] = 10;
    assert_eq!(good(&r), &want[..]);
    assert_eq!(good(&run(&t, &[0x03, 0, 0, 0, 8, 0]).await).len(), 8);
}

#[tokio::test]
async fn request_sense_descriptor_format_is_invalid_field() {
    let t = ram_target();
    invalid_cdb_field(&run(&t, &[0x03, 1, 0, 0, 252, 0]).await, 1, Some(0));
}

#[tokio::test]
async fn request_sense_on_missing_lun_returns_lun_not_supported_data() {
    let t = ram_target();
    let r = run_on(&t, 3, &nexus(1), &[0x03, 0, 0, 0, 18, 0], &[]).await;
    let d = good(&r);
    assert_eq!((d[2], d[12], d[13]), (ILLEGAL, 0x25, 0x00));
}

// ---------------------------------------------------------------------------------------------
// REPORT SUPPORTED OPERATION CODES
// ---------------------------------------------------------------------------------------------

#[test]
fn supported_table_usage_data_matches_cdb_lengths() {
    for e in spc::SUPPORTED {
        assert_eq!(e.usage[0], e.op);
        assert_eq!(Some(e.usage.len()), cdb::cdb_length(e.op), "{:02x}", e.op);
        assert_eq!(*e.usage.last().unwrap(), 0x07);
    }
}

#[tokio::test]
async fn rsoc_all_commands_lists_every_supported_command() {
    let t = ram_target();
    let r = run(&t, &rsoc(0, 0, 0, 4096)).await;
    let d = good(&r);
    let n = spc::SUPPORTED.len();
    assert_eq!(&d[..4], &((n * 8) as u32).to_be_bytes());
    let descs: Vec<&[u8]> = d[4..].chunks(8).collect();
    assert_eq!(descs.len(), n);
    assert!(descs.contains(&&[0x88, 0, 0, 0, 0, 0, 0, 16][..]));
    assert!(descs.contains(&&[0x9E, 0, 0, 0x10, 0, 1, 0, 16][..]));
    assert!(descs.contains(&&[0x12, 0, 0, 0, 0, 0, 0, 6][..]));
    // RCTD: each descriptor carries a 12-byte timeouts descriptor.
    let r = run(&t, &rsoc(0x80, 0, 0, 4096)).await;
    assert_eq!(good(&r).len(), 4 + n * 20);
    assert_eq!(good(&r)[9], 0x02); // CTDP
}

#[tokio::test]
async fn rsoc_one_command_reports_usage_data() {
    let t = ram_target();
    let r = run(&t, &rsoc(1, 0x28, 0, 64)).await;
    assert_eq!(
        good(&r),
        &[0, 3, 0, 10, 0x28, 0xF8, 0xFF, 0xFF, 0xFF, 0xFF, 0, 0xFF, 0xFF, 0x07][..]
    );
    let r = run(&t, &rsoc(1, 0x02, 0, 64)).await;
    assert_eq!(good(&r), &[0, 1, 0, 0][..]);
    let r = run(&t, &rsoc(2, 0x9E, 0x10, 64)).await;
    assert_eq!(&good(&r)[..6], &[0, 3, 0, 16, 0x9E, 0x1F]);
    let r = run(&t, &rsoc(2, 0x9E, 0x11, 64)).await;
    assert_eq!(good(&r), &[0, 1, 0, 0][..]);
    let r = run(&t, &rsoc(3, 0x12, 0, 64)).await;
    assert_eq!(&good(&r)[..4], &[0, 3, 0, 6]);
}

#[tokio::test]
async fn rsoc_bad_request_is_invalid_field() {
    let t = ram_target();
    invalid_cdb_field(&run(&t, &rsoc(1, 0x9E, 0, 64)).await, 3, None);
    invalid_cdb_field(&run(&t, &rsoc(2, 0x28, 0, 64)).await, 3, None);
    invalid_cdb_field(&run(&t, &rsoc(4, 0x28, 0, 64)).await, 2, Some(2));
    let mut c = rsoc(0, 0, 0, 64);
    c[1] = 0x0D;
    invalid_cdb_field(&run(&t, &c).await, 1, Some(4));
}

// ---------------------------------------------------------------------------------------------
// RESERVE / RELEASE, PREVENT ALLOW MEDIUM REMOVAL
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn reservation_conflicts_for_other_nexus_until_released() {
    let t = ram_target();
    let (n1, n2) = (nexus(1), nexus(2));
    good(&run_on(&t, 0, &n1, &[0x16, 0, 0, 0, 0, 0], &[]).await);
    good(&run_on(&t, 0, &n1, &[0x16, 0, 0, 0, 0, 0], &[]).await); // again: fine
    let r = run_on(&t, 0, &n2, &cdb10(opcode::READ_10, 0, 1), &[]).await;
    assert_eq!(r, Response::status_only(Status::RESERVATION_CONFLICT));
    let r = run_on(&t, 0, &n2, &[0x56, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]).await;
    assert_eq!(r.status, Status::RESERVATION_CONFLICT);
    good(&run_on(&t, 0, &n2, &inquiry(false, 0, 36), &[]).await);
    // RELEASE by a non-holder is GOOD and changes nothing.
    good(&run_on(&t, 0, &n2, &[0x17, 0, 0, 0, 0, 0], &[]).await);
    assert_eq!(
        run_on(&t, 0, &n2, &[0; 6], &[]).await.status,
        Status::RESERVATION_CONFLICT
    );
    good(&run_on(&t, 0, &n1, &cdb10(opcode::READ_10, 0, 1), &[]).await);
    good(&run_on(&t, 0, &n1, &[0x57, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]).await);
    good(&run_on(&t, 0, &n2, &cdb10(opcode::READ_10, 0, 1), &[]).await);
}

#[tokio::test]
async fn reservation_is_released_by_lun_reset_and_nexus_loss() {
    let t = ram_target();
    let (n1, n2) = (nexus(1), nexus(2));
    good(&run_on(&t, 0, &n1, &[0x16, 0, 0, 0, 0, 0], &[]).await);
    t.lun(0).unwrap().reset();
    clear_uas(&t, &n1).await;
    clear_uas(&t, &n2).await;
    good(&run_on(&t, 0, &n2, &[0; 6], &[]).await);
    good(&run_on(&t, 0, &n1, &[0x16, 0, 0, 0, 0, 0], &[]).await);
    t.nexus_lost(1);
    good(&run_on(&t, 0, &n2, &[0; 6], &[]).await);
}

#[tokio::test]
async fn third_party_reservation_is_invalid_field() {
    let t = ram_target();
    let r = run(&t, &[0x56, 0x10, 0, 0, 0, 0, 0, 0, 0, 0]).await;
    invalid_cdb_field(&r, 1, Some(4));
    let r = run(&t, &[0x56, 0x02, 0, 0, 0, 0, 0, 0, 0, 0]).await;
    invalid_cdb_field(&r, 1, Some(1));
    let r = run(&t, &[0x16, 0x02, 0, 0, 0, 0]).await;
    invalid_cdb_field(&r, 1, Some(4));
}

#[tokio::test]
async fn prevent_medium_removal_blocks_eject() {
    let t = ram_target();
    good(&run(&t, &[0x1E, 0, 0, 0, 0x01, 0]).await);
    let r = run(&t, &[0x1B, 0, 0, 0, 0x02, 0]).await;
    assert_eq!(sense(&r), (ILLEGAL, 0x53, 0x02));
    good(&run(&t, &[0x1E, 0, 0, 0, 0x00, 0]).await);
    good(&run(&t, &[0x1B, 0, 0, 0, 0x02, 0]).await);
    invalid_cdb_field(&run(&t, &[0x1E, 0, 0, 0, 0x02, 0]).await, 4, Some(1));
}

/// An LU whose store other nodes write too (`LuConfig::shared`) offers nothing that is only
/// atomic or enforced inside this process: no persistent reservations, no ORWRITE, and
/// COMPARE AND WRITE only as long as the backing store does it atomically (RamBackend: not
/// at all, so Block Limits reports 0 and every length is refused).
#[tokio::test]
async fn a_shared_lu_offers_no_process_local_reservations_or_read_modify_writes() {
    let t = target_over(
        Arc::new(RamBackend::new(1 << 20)),
        LuConfig {
            shared: true,
            ..cfg(512)
        },
    );
    let r = run_data(&t, &prout(0, 0), &prout_params(0, 0x1234, false)).await;
    assert_eq!(sense(&r), (0x5, 0x20, 0x00));
    let r = run(&t, &[0x5E, 0, 0, 0, 0, 0, 0, 0, 64, 0]).await;
    assert_eq!(sense(&r), (0x5, 0x20, 0x00));
    let r = run_data(&t, &cdb16(0x8B, 0, 1), &[0u8; 512]).await;
    assert_eq!(sense(&r), (0x5, 0x20, 0x00), "ORWRITE");
    for cdb in [[0x16u8, 0, 0, 0, 0, 0], [0x17, 0, 0, 0, 0, 0]] {
        let r = run(&t, &cdb).await;
        assert_eq!(sense(&r), (0x5, 0x20, 0x00), "SPC-2 {:#x}", cdb[0]);
    }
    let caw = {
        let mut c = cdb16(0x89, 0, 0);
        c[13] = 1;
        c
    };
    let r = run_data(&t, &caw, &[0u8; 1024]).await;
    assert_eq!(
        sense(&r),
        (0x5, 0x24, 0x00),
        "COMPARE AND WRITE, not atomic here"
    );
    let vpd = run(&t, &inquiry(true, 0xB0, 255)).await;
    assert_eq!(good(&vpd)[5], 0, "MAXIMUM COMPARE AND WRITE LENGTH");
    // REPORT SUPPORTED OPERATION CODES leaves them out, and says so when asked for one.
    let all = run(&t, &rsoc(0, 0, 0, 65535)).await;
    let list = good(&all)[4..].to_vec();
    let ops: Vec<u8> = list.chunks(8).map(|d| d[0]).collect();
    for op in [0x5E, 0x5F, 0x8B, 0x16, 0x17, 0x56, 0x57] {
        assert!(!ops.contains(&op), "{op:#x} listed: {ops:02x?}");
    }
    assert!(ops.contains(&0x89) && ops.contains(&0x8A), "{ops:02x?}");
    let one = run(&t, &rsoc(2, 0x5F, 0, 64)).await;
    assert_eq!(good(&one)[1] & 0x07, 0b001, "PR OUT: not supported");
    // The same LU not shared: all of them.
    let t = ram_target();
    let all = run(&t, &rsoc(0, 0, 0, 65535)).await;
    let ops: Vec<u8> = good(&all)[4..].chunks(8).map(|d| d[0]).collect();
    assert!(ops.contains(&0x5F) && ops.contains(&0x8B));
}
