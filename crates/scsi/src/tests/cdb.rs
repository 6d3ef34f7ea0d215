//! CDB decoding (`cdb.rs`): `data_out_len`, operation codes, CDB lengths and the CONTROL byte.

use super::*;

#[test]
fn data_out_len_covers_every_data_out_command() {
    use opcode::*;
    assert_eq!(data_out_len(&cdb10(WRITE_10, 0, 8), 512), Ok(4096));
    assert_eq!(data_out_len(&cdb6(WRITE_6, 0, 0), 512), Ok(256 * 512));
    assert_eq!(data_out_len(&cdb12(WRITE_12, 0, 2), 4096), Ok(8192));
    assert_eq!(data_out_len(&cdb16(WRITE_16, 0, 3), 512), Ok(1536));
    assert_eq!(
        data_out_len(&cdb16(WRITE_16, 0, u32::MAX), 4096),
        Err(SenseReason::cdb_byte(10))
    );
    let mut v = cdb10(VERIFY_10, 0, 4);
    assert_eq!(data_out_len(&v, 512), Ok(0));
    v[1] = 0x02;
    assert_eq!(data_out_len(&v, 512), Ok(2048));
    v[1] = 0x06;
    assert_eq!(data_out_len(&v, 512), Ok(512));
    assert_eq!(data_out_len(&cdb10(WRITE_SAME_10, 0, 9), 512), Ok(512));
    let mut ws = cdb16(WRITE_SAME_16, 0, 9);
    ws[1] = 0x01;
    assert_eq!(data_out_len(&ws, 512), Ok(0));
    let mut caw = cdb16(COMPARE_AND_WRITE, 0, 0);
    caw[13] = 2;
    assert_eq!(data_out_len(&caw, 512), Ok(2048));
    assert_eq!(
        data_out_len(&[MODE_SELECT_6, 0x10, 0, 0, 28, 0], 512),
        Ok(28)
    );
    assert_eq!(data_out_len(&cdb10(MODE_SELECT_10, 0, 300), 512), Ok(300));
    assert_eq!(data_out_len(&cdb10(UNMAP, 0, 24), 512), Ok(24));
    assert_eq!(data_out_len(&cdb10(READ_10, 0, 8), 512), Ok(0));
    assert_eq!(
        data_out_len(&[WRITE_10, 0, 0], 512),
        Err(SenseReason::CdbTooShort)
    );
    assert_eq!(data_out_len(&[], 512), Err(SenseReason::CdbTooShort));
    assert_eq!(data_out_len(&[0xFF; 16], 512), Ok(0));
}

#[tokio::test]
async fn unknown_opcode_is_invalid_command_operation_code() {
    let t = ram_target();
    for op in [0x02u8, 0x7F, 0xC0, 0xFF, 0x8D] {
        let mut c = vec![0u8; 16];
        c[0] = op;
        assert_eq!(
            sense(&run(&t, &c).await),
            (ILLEGAL, 0x20, 0x00),
            "op {op:02x}"
        );
    }
}

#[tokio::test]
async fn truncated_cdb_is_invalid_field_without_pointer() {
    let t = ram_target();
    for c in [
        &[][..],
        &[0x28, 0, 0, 0][..],
        &[0x88; 15][..],
        &[0x12, 0, 0][..],
    ] {
        let r = run(&t, c).await;
        assert_eq!(sense(&r), (ILLEGAL, 0x24, 0x00));
        assert_eq!(field_pointer(&r), None);
    }
}

#[tokio::test]
async fn naca_and_link_in_control_byte_are_invalid_fields() {
    let t = ram_target();
    let mut c = cdb10(opcode::READ_10, 0, 1);
    c[9] = 0x04;
    invalid_cdb_field(&run(&t, &c).await, 9, Some(2));
    let mut c = [0u8; 6];
    c[5] = 0x01;
    invalid_cdb_field(&run(&t, &c).await, 5, Some(0));
}
