//! Sense data encoding and the mapping of backend errors to sense (`sense.rs`).

use super::*;

#[test]
fn fixed_sense_with_field_pointer_is_byte_exact() {
    let s = SenseReason::InvalidFieldInCdb {
        byte: 0x0102,
        bit: Some(4),
    }
    .to_fixed_sense();
    let mut want = [0u8; 18];
    want[0] = 0x70;
    want[2] = 0x05;
    want[7] = 10;
    want[12] = 0x24;
    want[15] = 0x80 | 0x40 | 0x08 | 4;
    want[16] = 0x01;
    want[17] = 0x02;
    assert_eq!(&s[..], &want);
}

#[test]
fn fixed_sense_information_sets_valid_only_when_it_fits() {
    let s = SenseReason::Miscompare { offset: 0x1234 }.to_fixed_sense();
    assert_eq!(s[0], 0xF0);
    assert_eq!(&s[3..7], &[0, 0, 0x12, 0x34]);
    assert_eq!((s[2], s[12], s[13]), (0x0E, 0x1D, 0x00));
    let s = SenseReason::UnrecoveredReadError { lba: 1 << 40 }.to_fixed_sense();
    assert_eq!(s[0], 0x70);
    assert_eq!(&s[3..7], &[0; 4]);
}

#[test]
fn parameter_list_field_pointer_has_cd_clear() {
    let s = SenseReason::InvalidFieldInParameterList {
        byte: 14,
        bit: None,
    }
    .to_fixed_sense();
    assert_eq!(s[15], 0x80);
    assert_eq!(&s[16..18], &[0, 14]);
    assert_eq!(s[12], 0x26);
}

#[tokio::test]
async fn backend_errors_map_to_medium_hardware_and_space_errors() {
    let (t, b) = test_target(TestBackend::new(1 << 20), cfg(512));
    b.fail_with(BackendError::ReadError { offset: 5 * 512 });
    let r = run(&t, &cdb10(opcode::READ_10, 5, 1)).await;
    assert_eq!(sense(&r), (0x3, 0x11, 0x00));
    assert_eq!(&r.sense.as_ref().unwrap()[..7], &[0xF0, 0, 3, 0, 0, 0, 5]);
    b.fail_with(BackendError::WriteError { offset: 512 });
    let r = run_data(&t, &cdb10(opcode::WRITE_10, 1, 1), &[0; 512]).await;
    assert_eq!(sense(&r), (0x3, 0x0C, 0x00));
    b.fail_with(BackendError::NoSpace);
    let r = run_data(&t, &cdb10(opcode::WRITE_10, 1, 1), &[0; 512]).await;
    assert_eq!(sense(&r), (0x7, 0x27, 0x07));
    b.fail_with(BackendError::Io("boom".into()));
    let r = run(&t, &cdb10(opcode::SYNCHRONIZE_CACHE_10, 0, 0)).await;
    assert_eq!(sense(&r), (0x4, 0x44, 0x00));
}
