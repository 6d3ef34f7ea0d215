//! MODE SENSE / MODE SELECT and the mode pages (`mode.rs`).

use super::*;

fn mode_sense6(page: u8, alloc: u8) -> Vec<u8> {
    vec![0x1A, 0, page, 0, alloc, 0]
}

fn mode_sense10(b1: u8, page: u8, alloc: u16) -> Vec<u8> {
    let a = alloc.to_be_bytes();
    vec![0x5A, b1, page, 0, 0, 0, 0, a[0], a[1], 0]
}

fn caching(wce: bool) -> Vec<u8> {
    let mut p = vec![0u8; 20];
    p[0] = 0x08;
    p[1] = 0x12;
    p[2] = if wce { 0x04 } else { 0 };
    p
}

fn mode_select6(data: &[u8]) -> Vec<u8> {
    vec![0x15, 0x10, 0, 0, data.len() as u8, 0]
}

fn caching_param_list(wce: bool) -> Vec<u8> {
    let mut d = vec![0, 0, 0, 0];
    d.extend(caching(wce));
    d
}

#[tokio::test]
async fn mode_sense6_caching_page_is_byte_exact() {
    let t = ram_target();
    let r = run(&t, &mode_sense6(0x08, 255)).await;
    let mut want = vec![31, 0x00, 0x10, 8, 0, 0, 0x08, 0x00, 0, 0, 0x02, 0x00];
    want.extend(caching(false));
    assert_eq!(good(&r), &want[..]);
    let r = run(&t, &mode_sense6(0x08, 4)).await;
    assert_eq!(good(&r), &want[..4]);
}

#[tokio::test]
async fn mode_sense10_all_pages_with_long_lba_descriptor_is_byte_exact() {
    let t = null_16t();
    let r = run(&t, &mode_sense10(0x10, 0x3F, 1000)).await;
    let mut want = vec![0, 0, 0x00, 0x10, 0x01, 0, 0, 16];
    want.extend_from_slice(&(1u64 << 35).to_be_bytes());
    want.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0x02, 0x00]);
    want.extend(caching(false));
    want.extend_from_slice(&[0x0A, 0x0A, 0x02, 0x10, 0, 0, 0, 0, 0, 0, 0, 0]);
    want.extend_from_slice(&[0x1C, 0x0A, 0x08, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    let len = (want.len() - 2) as u16;
    want[..2].copy_from_slice(&len.to_be_bytes());
    assert_eq!(good(&r), &want[..]);
}

#[tokio::test]
async fn mode_sense_short_descriptor_saturates_block_count() {
    let t = null_16t();
    let r = run(&t, &mode_sense6(0x0A, 255)).await;
    assert_eq!(&good(&r)[4..12], &[0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0x02, 0]);
}

#[tokio::test]
async fn mode_sense_dbd_omits_block_descriptor() {
    let t = ram_target();
    let mut c = mode_sense6(0x08, 255);
    c[1] = 0x08;
    let r = run(&t, &c).await;
    let mut want = vec![23, 0, 0x10, 0];
    want.extend(caching(false));
    assert_eq!(good(&r), &want[..]);
}

#[tokio::test]
async fn mode_sense_changeable_and_default_values() {
    let mut c = cfg(512);
    c.write_cache = true;
    let t = target_over(Arc::new(RamBackend::new(1 << 20)), c);
    let mut cdb = mode_sense6(0x48, 255); // changeable, caching
    cdb[1] = 0x08;
    assert_eq!(&good(&run(&t, &cdb).await)[4..], &caching(true)[..]);
    cdb[2] = 0x4A; // changeable, control: only SWP
    assert_eq!(
        &good(&run(&t, &cdb).await)[6..],
        &[0, 0, 0x08, 0, 0, 0, 0, 0, 0, 0][..]
    );
    cdb[2] = 0x88; // default caching: WCE from config
    assert_eq!(&good(&run(&t, &cdb).await)[4..], &caching(true)[..]);
}

#[tokio::test]
async fn mode_sense_saved_values_is_saving_parameters_not_supported() {
    let t = ram_target();
    let r = run(&t, &mode_sense6(0xC8, 255)).await;
    assert_eq!(sense(&r), (ILLEGAL, 0x39, 0x00));
}

#[tokio::test]
async fn mode_sense_unknown_page_or_subpage_is_invalid_field() {
    let t = ram_target();
    invalid_cdb_field(&run(&t, &mode_sense6(0x19, 255)).await, 2, Some(5));
    let mut c = mode_sense6(0x08, 255);
    c[3] = 0x01;
    invalid_cdb_field(&run(&t, &c).await, 3, None);
    c[3] = 0xFF;
    good(&run(&t, &c).await);
}

#[tokio::test]
async fn mode_sense_reports_write_protect_for_read_only_lu() {
    let mut c = cfg(512);
    c.read_only = true;
    let t = target_over(Arc::new(RamBackend::new(1 << 20)), c);
    assert_eq!(good(&run(&t, &mode_sense6(0x3F, 255)).await)[2], 0x90);
    assert_eq!(good(&run(&t, &mode_sense10(0, 0x3F, 255)).await)[3], 0x90);
}

#[tokio::test]
async fn mode_select_wce_toggle_raises_mode_parameters_changed_for_other_nexus() {
    let (t, b) = test_target(TestBackend::new(1 << 20), cfg(512));
    let (n1, n2, n3) = (nexus(1), nexus(2), nexus(3));
    // Nexus 2 has seen the LU; nexus 3 only arrives later.
    good(&run_on(&t, 0, &n2, &[0; 6], &[]).await);
    let list = caching_param_list(true);
    good(&run_on(&t, 0, &n1, &mode_select6(&list), &list).await);
    assert!(t.lun(0).unwrap().wce());
    let r = run_on(&t, 0, &n1, &mode_sense6(0x08, 255), &[]).await;
    assert_eq!(good(&r)[14], 0x04);
    // The other nexus gets the UA once; INQUIRY does not consume it.
    good(&run_on(&t, 0, &n2, &inquiry(false, 0, 36), &[]).await);
    let r = run_on(&t, 0, &n2, &[0; 6], &[]).await;
    assert_eq!(sense(&r), (0x6, 0x2A, 0x01));
    good(&run_on(&t, 0, &n2, &[0; 6], &[]).await);
    // The nexus that changed it, and a later one, get none.
    good(&run_on(&t, 0, &n1, &[0; 6], &[]).await);
    good(&run_on(&t, 0, &n3, &[0; 6], &[]).await);
    // Writes are now cached; turning WCE off again flushes.
    good(&run_on(&t, 0, &n1, &cdb10(opcode::WRITE_10, 0, 1), &[1; 512]).await);
    assert_eq!(b.modes(), vec![WriteMode::Cached]);
    let list = caching_param_list(false);
    good(&run_on(&t, 0, &n1, &mode_select6(&list), &list).await);
    assert_eq!(b.flushes.load(Ordering::SeqCst), 1);
    assert!(!t.lun(0).unwrap().wce());
    assert_eq!(
        sense(&run_on(&t, 0, &n2, &[0; 6], &[]).await),
        (0x6, 0x2A, 0x01)
    );
}

#[tokio::test]
async fn mode_select_without_change_raises_no_unit_attention() {
    let t = ram_target();
    good(&run_on(&t, 0, &nexus(2), &[0; 6], &[]).await);
    let list = caching_param_list(false);
    good(&run_data(&t, &mode_select6(&list), &list).await);
    good(&run_on(&t, 0, &nexus(2), &[0; 6], &[]).await);
}

#[tokio::test]
async fn mode_select_of_unchangeable_field_is_invalid_field_in_parameter_list() {
    let t = ram_target();
    let mut list = caching_param_list(false);
    list[4 + 2] |= 0x01; // RCD is not changeable
    let r = run_data(&t, &mode_select6(&list), &list).await;
    invalid_param_field(&r, 6, Some(0));
    let mut list = caching_param_list(true);
    list[4 + 12] = 0x20; // FSW/... byte 12 bit 5
    let r = run_data(&t, &mode_select6(&list), &list).await;
    invalid_param_field(&r, 16, Some(5));
    assert!(!t.lun(0).unwrap().wce(), "nothing applied on error");
    // Control page: any change refused.
    let mut list = vec![0, 0, 0, 0, 0x0A, 0x0A, 0x06, 0x10, 0, 0, 0, 0, 0, 0, 0, 0];
    let r = run_data(&t, &mode_select6(&list), &list).await;
    invalid_param_field(&r, 6, Some(2)); // D_SENSE
    list[6] = 0x02;
    good(&run_data(&t, &mode_select6(&list), &list).await);
}

#[tokio::test]
async fn mode_select_bad_page_header_is_invalid_field_in_parameter_list() {
    let t = ram_target();
    let mut list = caching_param_list(true);
    list[5] = 0x10; // wrong page length
    invalid_param_field(&run_data(&t, &mode_select6(&list), &list).await, 5, None);
    let mut list = caching_param_list(true);
    list[4] = 0x19; // unknown page
    invalid_param_field(&run_data(&t, &mode_select6(&list), &list).await, 4, Some(5));
    let mut list = caching_param_list(true);
    list[4] = 0x48; // SPF
    invalid_param_field(&run_data(&t, &mode_select6(&list), &list).await, 4, Some(6));
    let mut list = caching_param_list(true);
    list[1] = 0x05; // medium type
    invalid_param_field(&run_data(&t, &mode_select6(&list), &list).await, 1, None);
}

#[tokio::test]
async fn mode_select_truncated_parameter_list_is_parameter_list_length_error() {
    let t = ram_target();
    let list = caching_param_list(true);
    // Parameter list length cuts the page short.
    let r = run_data(&t, &mode_select6(&list[..10]), &list).await;
    assert_eq!(sense(&r), (ILLEGAL, 0x1A, 0x00));
    // The initiator sent less than the parameter list length.
    let r = run_data(&t, &mode_select6(&list), &list[..10]).await;
    assert_eq!(sense(&r), (ILLEGAL, 0x1A, 0x00));
    // Shorter than the header.
    let r = run_data(&t, &mode_select6(&list[..3]), &list).await;
    assert_eq!(sense(&r), (ILLEGAL, 0x1A, 0x00));
    assert!(!t.lun(0).unwrap().wce());
}

#[tokio::test]
async fn mode_select_pf_zero_and_sp_one_are_invalid_fields() {
    let t = ram_target();
    let list = caching_param_list(true);
    let mut c = mode_select6(&list);
    c[1] = 0x00;
    invalid_cdb_field(&run_data(&t, &c, &list).await, 1, Some(4));
    c[1] = 0x11;
    invalid_cdb_field(&run_data(&t, &c, &list).await, 1, Some(0));
    good(&run(&t, &[0x15, 0x10, 0, 0, 0, 0]).await); // length 0: nothing to do
}

#[tokio::test]
async fn mode_select10_accepts_mode_sense10_output_with_block_descriptor() {
    let t = null_16t();
    let r = run(&t, &mode_sense10(0x10, 0x3F, 1000)).await;
    let mut list = good(&r).to_vec();
    list[0] = 0;
    list[1] = 0;
    list[8 + 16 + 2] |= 0x04; // WCE on
    let mut c = cdb10(opcode::MODE_SELECT_10, 0, list.len() as u16);
    c[1] = 0x10;
    good(&run_data(&t, &c, &list).await);
    assert!(t.lun(0).unwrap().wce());
    // A different block length is refused at the descriptor's block length field.
    list[8 + 15] = 0x00;
    list[8 + 14] = 0x10;
    invalid_param_field(&run_data(&t, &c, &list).await, 20, None);
}

#[tokio::test]
async fn software_write_protect_refuses_writes_until_cleared() {
    let t = ram_target();
    let (a, b) = (nexus(1), nexus(2));
    good(&run_on(&t, 0, &b, &[0; 6], &[]).await);
    // MODE SELECT(6) control page with SWP=1.
    let mut page = vec![0u8; 4 + 12];
    page[4] = 0x0A;
    page[5] = 0x0A;
    page[6] = 0x02;
    page[7] = 0x10;
    page[8] = 0x08;
    let sel = [opcode::MODE_SELECT_6, 0x10, 0, 0, 16, 0];
    good(&run_on(&t, 0, &a, &sel, &page).await);
    let w = cdb10(opcode::WRITE_10, 0, 1);
    assert_eq!(
        sense(&run_on(&t, 0, &a, &w, &[0u8; 512]).await),
        (0x07, 0x27, 0x00)
    );
    assert_eq!(
        sense(&run_on(&t, 0, &b, &[0; 6], &[]).await),
        (0x06, 0x2A, 0x01)
    );
    page[8] = 0;
    good(&run_on(&t, 0, &a, &sel, &page).await);
    good(&run_on(&t, 0, &a, &w, &[0u8; 512]).await);
}
