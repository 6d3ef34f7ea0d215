//! Unit tests of the device server against RamBackend, NullBackend and an instrumented backend.

use super::*;
use ironsan_backend::{
    BackendError, BlockDevice, Capabilities, IoFuture, NullBackend, RamBackend, WriteMode,
};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::task::{Context, Poll};

// ---------------------------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------------------------

const TARGET_PORT: &str = "iqn.2024-01.org.ironsan:disk1,t,0x0001";
const NAA: u64 = 0x5001_405a_bcde_f012;

fn nexus(id: u64) -> Nexus {
    Nexus {
        id,
        initiator_port: format!("iqn.1994-05.com.example:h{id},i,0x23d00000000{id}").into(),
        target_port: TARGET_PORT.into(),
        relative_port: 1,
    }
}

fn cfg(bs: u32) -> LuConfig {
    LuConfig {
        block_size: bs,
        physical_block_size: 0,
        read_only: false,
        write_cache: false,
        serial: "SN0001".into(),
        naa: NAA,
        vendor: "IRONSAN".into(),
        product: "RAMDISK".into(),
        revision: "0.1".into(),
        state_dir: None,
    }
}

fn target_over(backend: Arc<dyn BlockDevice>, cfg: LuConfig) -> Target {
    let mut t = Target::new();
    t.add_lun(0, Arc::new(LogicalUnit::new(backend, cfg)));
    t
}

/// A 2048-block (1 MiB) RAM LU with 512-byte blocks at LUN 0.
fn ram_target() -> Target {
    target_over(Arc::new(RamBackend::new(1 << 20)), cfg(512))
}

fn null_16t() -> Target {
    target_over(Arc::new(NullBackend::new(16 << 40)), cfg(512))
}

async fn run_on(t: &Target, lun: u64, n: &Nexus, cdb: &[u8], data: &[u8]) -> Response {
    t.execute(
        lun,
        n,
        Command {
            cdb: Bytes::copy_from_slice(cdb),
            data_out: Bytes::copy_from_slice(data),
            expected_in_len: 0,
            in_place: None,
        },
    )
    .await
}

async fn run(t: &Target, cdb: &[u8]) -> Response {
    run_on(t, 0, &nexus(1), cdb, &[]).await
}

async fn run_data(t: &Target, cdb: &[u8], data: &[u8]) -> Response {
    run_on(t, 0, &nexus(1), cdb, data).await
}

#[track_caller]
fn good(r: &Response) -> &[u8] {
    assert_eq!(r.status, Status::GOOD, "sense: {:02x?}", r.sense);
    assert!(r.sense.is_none());
    match &r.data_in {
        DataIn::Memory(b) => b,
        DataIn::File(f) => panic!("data in a file: {f:?}"),
    }
}

/// (key, asc, ascq) of a CHECK CONDITION.
#[track_caller]
fn sense(r: &Response) -> (u8, u8, u8) {
    assert_eq!(r.status, Status::CHECK_CONDITION);
    let s = r.sense.as_ref().expect("sense data");
    assert_eq!(s.len(), 18);
    assert_eq!(s[0] & 0x7F, 0x70);
    assert_eq!(s[7], 10);
    assert!(r.data_in.is_empty());
    (s[2] & 0x0F, s[12], s[13])
}

/// (C/D, byte, bit) of the sense-key specific field pointer, if SKSV.
fn field_pointer(r: &Response) -> Option<(bool, u16, Option<u8>)> {
    let s = r.sense.as_ref()?;
    if s[15] & 0x80 == 0 {
        return None;
    }
    let bit = (s[15] & 0x08 != 0).then_some(s[15] & 0x07);
    Some((s[15] & 0x40 != 0, u16::from_be_bytes([s[16], s[17]]), bit))
}

#[track_caller]
fn invalid_cdb_field(r: &Response, byte: u16, bit: Option<u8>) {
    assert_eq!(sense(r), (0x5, 0x24, 0x00));
    assert_eq!(field_pointer(r), Some((true, byte, bit)));
}

#[track_caller]
fn invalid_param_field(r: &Response, byte: u16, bit: Option<u8>) {
    assert_eq!(sense(r), (0x5, 0x26, 0x00));
    assert_eq!(field_pointer(r), Some((false, byte, bit)));
}

const ILLEGAL: u8 = 0x5;
const LBA_OOR: (u8, u8, u8) = (ILLEGAL, 0x21, 0x00);

fn cdb6(op: u8, lba: u32, len: u8) -> Vec<u8> {
    vec![
        op,
        (lba >> 16) as u8 & 0x1F,
        (lba >> 8) as u8,
        lba as u8,
        len,
        0,
    ]
}
fn cdb10(op: u8, lba: u32, len: u16) -> Vec<u8> {
    let mut c = vec![op, 0];
    c.extend_from_slice(&lba.to_be_bytes());
    c.push(0);
    c.extend_from_slice(&len.to_be_bytes());
    c.push(0);
    c
}
fn cdb12(op: u8, lba: u32, len: u32) -> Vec<u8> {
    let mut c = vec![op, 0];
    c.extend_from_slice(&lba.to_be_bytes());
    c.extend_from_slice(&len.to_be_bytes());
    c.extend_from_slice(&[0, 0]);
    c
}
fn cdb16(op: u8, lba: u64, len: u32) -> Vec<u8> {
    let mut c = vec![op, 0];
    c.extend_from_slice(&lba.to_be_bytes());
    c.extend_from_slice(&len.to_be_bytes());
    c.extend_from_slice(&[0, 0]);
    c
}
fn inquiry(evpd: bool, page: u8, alloc: u16) -> Vec<u8> {
    let a = alloc.to_be_bytes();
    vec![opcode::INQUIRY, u8::from(evpd), page, a[0], a[1], 0]
}
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A backend for instrumentation: RAM underneath, records write modes and flushes, can be told
/// to fail, to refuse unmap, or to yield once inside reads (to interleave commands).
struct TestBackend {
    ram: RamBackend,
    unmap: bool,
    alignment: u32,
    yield_reads: bool,
    modes: Mutex<Vec<WriteMode>>,
    flushes: AtomicUsize,
    fail: Mutex<Option<BackendError>>,
}

impl TestBackend {
    fn new(size: u64) -> Self {
        TestBackend {
            ram: RamBackend::new(size),
            unmap: true,
            alignment: 1,
            yield_reads: false,
            modes: Mutex::new(Vec::new()),
            flushes: AtomicUsize::new(0),
            fail: Mutex::new(None),
        }
    }
    fn fail_with(&self, e: BackendError) {
        *self.fail.lock().unwrap() = Some(e);
    }
    fn failure(&self) -> Result<(), BackendError> {
        match self.fail.lock().unwrap().clone() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
    fn modes(&self) -> Vec<WriteMode> {
        self.modes.lock().unwrap().clone()
    }
}

struct YieldOnce(bool);
impl Future for YieldOnce {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            Poll::Ready(())
        } else {
            self.0 = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }
}

impl BlockDevice for TestBackend {
    fn kind(&self) -> &'static str {
        "test"
    }
    fn size(&self) -> u64 {
        self.ram.size()
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            volatile: true,
            unmap: self.unmap,
            alignment: self.alignment,
            discards_writes: false,
            write_zeroes: false,
        }
    }
    fn read(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
        Box::pin(async move {
            self.failure()?;
            if self.yield_reads {
                YieldOnce(false).await;
            }
            self.ram.read(offset, len).await
        })
    }
    fn write(&self, offset: u64, data: Bytes, mode: WriteMode) -> IoFuture<'_, ()> {
        Box::pin(async move {
            self.failure()?;
            self.modes.lock().unwrap().push(mode);
            self.ram.write(offset, data, mode).await
        })
    }
    fn flush(&self) -> IoFuture<'_, ()> {
        Box::pin(async move {
            self.failure()?;
            self.flushes.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
    }
    fn unmap(&self, offset: u64, len: u64) -> IoFuture<'_, ()> {
        Box::pin(async move {
            if !self.unmap {
                return Err(BackendError::Unsupported);
            }
            self.ram.unmap(offset, len).await
        })
    }
}

fn test_target(b: TestBackend, c: LuConfig) -> (Target, Arc<TestBackend>) {
    let b = Arc::new(b);
    (target_over(b.clone(), c), b)
}

// ---------------------------------------------------------------------------------------------
// Sense encoding, LUN encoding, data_out_len
// ---------------------------------------------------------------------------------------------

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

#[test]
fn local_naa_is_locally_assigned_and_stable() {
    let a = local_naa("iqn.x/0");
    assert_eq!(a >> 60, 3);
    assert_eq!(a, local_naa("iqn.x/0"));
    assert_ne!(a, local_naa("iqn.x/1"));
}

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

// ---------------------------------------------------------------------------------------------
// LUN addressing and REPORT LUNS
// ---------------------------------------------------------------------------------------------

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

#[tokio::test]
async fn commands_to_missing_lun_are_logical_unit_not_supported() {
    let t = ram_target();
    for c in [vec![0u8; 6], cdb10(opcode::READ_10, 0, 1), vec![0xFF; 16]] {
        let r = run_on(&t, 3, &nexus(1), &c, &[]).await;
        assert_eq!(sense(&r), (ILLEGAL, 0x25, 0x00));
    }
}

#[tokio::test]
async fn request_sense_on_missing_lun_returns_lun_not_supported_data() {
    let t = ram_target();
    let r = run_on(&t, 3, &nexus(1), &[0x03, 0, 0, 0, 18, 0], &[]).await;
    let d = good(&r);
    assert_eq!((d[2], d[12], d[13]), (ILLEGAL, 0x25, 0x00));
}

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
// TEST UNIT READY, REQUEST SENSE, generic CDB checks
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

// ---------------------------------------------------------------------------------------------
// READ CAPACITY
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

use crate::cdb::block_range;

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

// ---------------------------------------------------------------------------------------------
// VERIFY, SYNCHRONIZE CACHE, START STOP UNIT
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

// ---------------------------------------------------------------------------------------------
// MODE SENSE / MODE SELECT
// ---------------------------------------------------------------------------------------------

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

fn mode_select6(data: &[u8]) -> Vec<u8> {
    vec![0x15, 0x10, 0, 0, data.len() as u8, 0]
}
fn caching_param_list(wce: bool) -> Vec<u8> {
    let mut d = vec![0, 0, 0, 0];
    d.extend(caching(wce));
    d
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

// ---------------------------------------------------------------------------------------------
// Unit attentions and LU reset
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn no_unit_attention_at_first_contact() {
    let t = ram_target();
    good(&run_on(&t, 0, &nexus(9), &cdb10(opcode::READ_10, 0, 1), &[]).await);
}

#[tokio::test]
async fn lun_reset_raises_power_on_reset_once_per_nexus() {
    let t = ram_target();
    let (n1, n2) = (nexus(1), nexus(2));
    good(&run_on(&t, 0, &n1, &[0; 6], &[]).await);
    good(&run_on(&t, 0, &n2, &[0; 6], &[]).await);
    t.lun(0).unwrap().reset(&n1);
    assert_eq!(
        sense(&run_on(&t, 0, &n1, &[0; 6], &[]).await),
        (0x6, 0x29, 0x00)
    );
    good(&run_on(&t, 0, &n1, &[0; 6], &[]).await);
    // REPORT LUNS does not consume it either.
    good(&run_on(&t, 0, &n2, &[0xA0, 0, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0], &[]).await);
    let r = run_on(&t, 0, &n2, &cdb10(opcode::READ_10, 0, 1), &[]).await;
    assert_eq!(sense(&r), (0x6, 0x29, 0x00));
    good(&run_on(&t, 0, &n2, &cdb10(opcode::READ_10, 0, 1), &[]).await);
}

#[tokio::test]
async fn request_sense_returns_and_clears_unit_attention() {
    let t = ram_target();
    let (n1, n2) = (nexus(1), nexus(2));
    good(&run_on(&t, 0, &n2, &[0; 6], &[]).await);
    t.lun(0).unwrap().reset(&n1);
    let r = run_on(&t, 0, &n2, &[0x03, 0, 0, 0, 18, 0], &[]).await;
    let d = good(&r);
    assert_eq!((d[2], d[12], d[13]), (0x6, 0x29, 0x00));
    let r = run_on(&t, 0, &n2, &[0x03, 0, 0, 0, 18, 0], &[]).await;
    assert_eq!(good(&r)[2], 0);
    good(&run_on(&t, 0, &n2, &[0; 6], &[]).await);
}

#[tokio::test]
async fn unit_attentions_queue_in_order_without_duplicates() {
    let t = ram_target();
    let lu = t.lun(0).unwrap();
    good(&run_on(&t, 0, &nexus(2), &[0; 6], &[]).await);
    lu.establish_unit_attention(UnitAttention::PowerOnReset, None);
    lu.establish_unit_attention(UnitAttention::ModeParametersChanged, None);
    lu.establish_unit_attention(UnitAttention::PowerOnReset, None);
    let n2 = nexus(2);
    assert_eq!(sense(&run_on(&t, 0, &n2, &[0; 6], &[]).await), (6, 0x29, 0));
    assert_eq!(sense(&run_on(&t, 0, &n2, &[0; 6], &[]).await), (6, 0x2A, 1));
    good(&run_on(&t, 0, &n2, &[0; 6], &[]).await);
}

#[tokio::test]
async fn report_luns_clears_reported_luns_data_changed() {
    let t = ram_target();
    let n2 = nexus(2);
    good(&run_on(&t, 0, &n2, &[0; 6], &[]).await);
    let lu = t.lun(0).unwrap();
    lu.establish_unit_attention(UnitAttention::ReportedLunsDataChanged, None);
    lu.establish_unit_attention(UnitAttention::CapacityDataChanged, None);
    good(&run_on(&t, 0, &n2, &[0xA0, 0, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0], &[]).await);
    assert_eq!(
        sense(&run_on(&t, 0, &n2, &[0; 6], &[]).await),
        (6, 0x2A, 0x09)
    );
    good(&run_on(&t, 0, &n2, &[0; 6], &[]).await);
}

#[tokio::test]
async fn nexus_loss_drops_pending_unit_attentions() {
    let t = ram_target();
    good(&run_on(&t, 0, &nexus(2), &[0; 6], &[]).await);
    t.lun(0).unwrap().reset(&nexus(1));
    t.nexus_lost(2);
    good(&run_on(&t, 0, &nexus(2), &[0; 6], &[]).await);
}

// ---------------------------------------------------------------------------------------------
// Hostile input
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// WRITE SAME, UNMAP, GET LBA STATUS
// ---------------------------------------------------------------------------------------------

fn ram_target_with_handle() -> (Target, Arc<RamBackend>) {
    let ram = Arc::new(RamBackend::new(1 << 20));
    (target_over(ram.clone(), cfg(512)), ram)
}

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

// ---------------------------------------------------------------------------------------------
// REPORT SUPPORTED OPERATION CODES
// ---------------------------------------------------------------------------------------------

fn rsoc(options: u8, op: u8, sa: u16, alloc: u32) -> Vec<u8> {
    let mut c = vec![0xA3, 0x0C, options, op];
    c.extend_from_slice(&sa.to_be_bytes());
    c.extend_from_slice(&alloc.to_be_bytes());
    c.extend_from_slice(&[0, 0]);
    c
}

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
// COMPARE AND WRITE
// ---------------------------------------------------------------------------------------------

fn caw(lba: u64, blocks: u8) -> Vec<u8> {
    let mut c = cdb16(opcode::COMPARE_AND_WRITE, lba, 0);
    c[13] = blocks;
    c
}

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
async fn range_lock_excludes_only_overlapping_ranges() {
    let l = lu::RangeLock::default();
    let g1 = l.lock(0, 10).await;
    let _g2 = l.lock(10, 20).await; // adjacent: no overlap
    let mut waiting = Box::pin(l.lock(5, 6));
    let waker = std::task::Waker::noop();
    let mut cx = Context::from_waker(waker);
    assert!(waiting.as_mut().poll(&mut cx).is_pending());
    drop(g1);
    assert!(waiting.as_mut().poll(&mut cx).is_ready());
}

// ---------------------------------------------------------------------------------------------
// RESERVE / RELEASE
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
    t.lun(0).unwrap().reset(&n1);
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

// ---------------------------------------------------------------------------------------------
// Persistent reservations, SANITIZE, ORWRITE, WRITE ATOMIC, PRE-FETCH, READ DEFECT DATA
// ---------------------------------------------------------------------------------------------

fn prout(sa: u8, ptype: u8) -> Vec<u8> {
    let mut c = vec![0u8; 10];
    c[0] = opcode::PERSISTENT_RESERVE_OUT;
    c[1] = sa;
    c[2] = ptype;
    c[8] = 24;
    c
}

fn prout_params(rk: u64, sark: u64, aptpl: bool) -> Vec<u8> {
    let mut p = vec![0u8; 24];
    p[0..8].copy_from_slice(&rk.to_be_bytes());
    p[8..16].copy_from_slice(&sark.to_be_bytes());
    p[20] = u8::from(aptpl);
    p
}

fn prin(sa: u8) -> Vec<u8> {
    let mut c = vec![0u8; 10];
    c[0] = opcode::PERSISTENT_RESERVE_IN;
    c[1] = sa;
    c[7] = 0x10;
    c
}

async fn register(t: &Target, n: &Nexus, key: u64) {
    let r = run_on(t, 0, n, &prout(0x06, 0), &prout_params(0, key, false)).await;
    good(&r);
}

async fn clear_uas(t: &Target, n: &Nexus) {
    while run_on(t, 0, n, &[0; 6], &[]).await.status != Status::GOOD {}
}

#[tokio::test]
async fn pr_register_read_keys_and_generation() {
    let t = ram_target();
    let (a, b) = (nexus(1), nexus(2));
    register(&t, &a, 0xAA).await;
    register(&t, &b, 0xBB).await;
    let r = run_on(&t, 0, &a, &prin(0x00), &[]).await;
    let d = good(&r);
    assert_eq!(&d[0..4], &2u32.to_be_bytes()); // PRGENERATION
    assert_eq!(&d[4..8], &16u32.to_be_bytes());
    assert_eq!(&d[8..16], &0xAAu64.to_be_bytes());
    assert_eq!(&d[16..24], &0xBBu64.to_be_bytes());
    // REGISTER with a wrong key conflicts.
    let r = run_on(&t, 0, &a, &prout(0x00, 0), &prout_params(0x1, 0xCC, false)).await;
    assert_eq!(r.status, Status::RESERVATION_CONFLICT);
}

#[tokio::test]
async fn pr_exclusive_access_blocks_reads_and_writes_of_others() {
    let t = ram_target();
    let (a, b) = (nexus(1), nexus(2));
    register(&t, &a, 0xAA).await;
    good(&run_on(&t, 0, &a, &prout(0x01, 0x03), &prout_params(0xAA, 0, false)).await);
    let read = cdb10(opcode::READ_10, 0, 1);
    good(&run_on(&t, 0, &a, &read, &[]).await);
    assert_eq!(
        run_on(&t, 0, &b, &read, &[]).await.status,
        Status::RESERVATION_CONFLICT
    );
    // INQUIRY and PRIN stay allowed.
    good(&run_on(&t, 0, &b, &inquiry(false, 0, 96), &[]).await);
    good(&run_on(&t, 0, &b, &prin(0x01), &[]).await);
    let rr = run_on(&t, 0, &b, &prin(0x01), &[]).await;
    assert_eq!(&good(&rr)[8..16], &0xAAu64.to_be_bytes());
    assert_eq!(good(&rr)[21], 0x03);
}

#[tokio::test]
async fn pr_write_exclusive_registrants_only_lets_registered_nexus_write() {
    let t = ram_target();
    let (a, b, c) = (nexus(1), nexus(2), nexus(3));
    register(&t, &a, 0xAA).await;
    register(&t, &b, 0xBB).await;
    good(&run_on(&t, 0, &a, &prout(0x01, 0x05), &prout_params(0xAA, 0, false)).await);
    let w = cdb10(opcode::WRITE_10, 0, 1);
    good(&run_on(&t, 0, &b, &w, &[0u8; 512]).await);
    assert_eq!(
        run_on(&t, 0, &c, &w, &[0u8; 512]).await.status,
        Status::RESERVATION_CONFLICT
    );
    good(&run_on(&t, 0, &c, &cdb10(opcode::READ_10, 0, 1), &[]).await);
}

#[tokio::test]
async fn pr_release_with_wrong_type_is_invalid_release() {
    let t = ram_target();
    let a = nexus(1);
    register(&t, &a, 0xAA).await;
    good(&run_on(&t, 0, &a, &prout(0x01, 0x01), &prout_params(0xAA, 0, false)).await);
    let r = run_on(&t, 0, &a, &prout(0x02, 0x03), &prout_params(0xAA, 0, false)).await;
    assert_eq!(sense(&r), (0x05, 0x26, 0x04));
}

#[tokio::test]
async fn pr_preempt_and_abort_removes_registration_queues_abort_and_ua() {
    let t = ram_target();
    let (a, b) = (nexus(1), nexus(2));
    register(&t, &a, 0xAA).await;
    register(&t, &b, 0xBB).await;
    good(&run_on(&t, 0, &a, &prout(0x01, 0x03), &prout_params(0xAA, 0, false)).await);
    good(
        &run_on(
            &t,
            0,
            &b,
            &prout(0x05, 0x03),
            &prout_params(0xBB, 0xAA, false),
        )
        .await,
    );
    let lu = t.lun(0).unwrap();
    let aborts = lu.take_pr_aborts();
    assert_eq!(aborts.len(), 1);
    assert_eq!(aborts[0].0, a.initiator_port);
    assert!(lu.take_pr_aborts().is_empty());
    let r = run_on(&t, 0, &a, &[0; 6], &[]).await;
    assert_eq!(sense(&r), (0x06, 0x2A, 0x05)); // REGISTRATIONS PREEMPTED
    let rr = run_on(&t, 0, &b, &prin(0x01), &[]).await;
    assert_eq!(&good(&rr)[8..16], &0xBBu64.to_be_bytes());
}

#[tokio::test]
async fn pr_clear_removes_everything_and_reports_reservations_preempted() {
    let t = ram_target();
    let (a, b) = (nexus(1), nexus(2));
    register(&t, &a, 0xAA).await;
    register(&t, &b, 0xBB).await;
    clear_uas(&t, &b).await;
    good(&run_on(&t, 0, &a, &prout(0x03, 0), &prout_params(0xAA, 0, false)).await);
    let r = run_on(&t, 0, &b, &[0; 6], &[]).await;
    assert_eq!(sense(&r), (0x06, 0x2A, 0x03));
    let r = run_on(&t, 0, &a, &prin(0x00), &[]).await;
    assert_eq!(&good(&r)[4..8], &0u32.to_be_bytes());
}

#[tokio::test]
async fn pr_aptpl_without_state_dir_is_refused_and_with_one_survives_restart() {
    let t = ram_target();
    let r = run_on(
        &t,
        0,
        &nexus(1),
        &prout(0x06, 0),
        &prout_params(0, 0xAA, true),
    )
    .await;
    invalid_param_field(&r, 20, Some(0));

    let dir = std::env::temp_dir().join(format!("ironsan-pr-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let c = LuConfig {
        state_dir: Some(dir.clone()),
        ..cfg(512)
    };
    let backend: Arc<dyn BlockDevice> = Arc::new(RamBackend::new(1 << 20));
    let t = target_over(Arc::clone(&backend), c.clone());
    let a = nexus(1);
    good(&run_on(&t, 0, &a, &prout(0x06, 0), &prout_params(0, 0xAA, true)).await);
    good(&run_on(&t, 0, &a, &prout(0x01, 0x01), &prout_params(0xAA, 0, false)).await);
    assert!(dir.join(PR_STATE_FILE).exists());
    drop(t);
    let t = target_over(backend, c);
    let rr = run_on(&t, 0, &nexus(2), &prin(0x01), &[]).await;
    let d = good(&rr);
    assert_eq!(&d[8..16], &0xAAu64.to_be_bytes());
    assert_eq!(d[21], 0x01);
    let caps = run_on(&t, 0, &a, &prin(0x02), &[]).await;
    assert_eq!(good(&caps)[2] & 0x01, 0x01); // PTPL_C
    assert_eq!(good(&caps)[3] & 0x01, 0x01); // PTPL_A
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn lun_reset_reports_unit_attention_to_every_nexus_including_the_requester() {
    let t = ram_target();
    let (a, b) = (nexus(1), nexus(2));
    good(&run_on(&t, 0, &a, &[0; 6], &[]).await);
    good(&run_on(&t, 0, &b, &[0; 6], &[]).await);
    t.lun(0).unwrap().reset(&a);
    assert_eq!(
        sense(&run_on(&t, 0, &a, &[0; 6], &[]).await),
        (0x06, 0x29, 0x00)
    );
    assert_eq!(
        sense(&run_on(&t, 0, &b, &[0; 6], &[]).await),
        (0x06, 0x29, 0x00)
    );
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
async fn orwrite_ors_data_into_the_medium() {
    let t = ram_target();
    good(&run_data(&t, &cdb10(opcode::WRITE_10, 3, 1), &[0x0Fu8; 512]).await);
    good(&run_data(&t, &cdb16(opcode::ORWRITE_16, 3, 1), &[0xF0u8; 512]).await);
    let r = run(&t, &cdb10(opcode::READ_10, 3, 1)).await;
    assert!(good(&r).iter().all(|&b| b == 0xFF));
    let r = run_data(&t, &cdb16(opcode::ORWRITE_16, 2048, 1), &[0u8; 512]).await;
    assert_eq!(sense(&r), (0x05, 0x21, 0x00));
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

// ---------------------------------------------------------------------------------------------
// Physical block size, WRITE SAME with a count of 0, exact Data-Out sizes
// ---------------------------------------------------------------------------------------------

fn read_capacity_16_cdb() -> Vec<u8> {
    let mut c = vec![0x9E, 0x10];
    c.extend_from_slice(&[0; 8]);
    c.extend_from_slice(&32u32.to_be_bytes());
    c.extend_from_slice(&[0, 0]);
    c
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

// ---------------------------------------------------------------------------------------------
// EXTENDED COPY (LID1), RECEIVE COPY RESULTS, Third-party Copy VPD page
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Run-time changes (ironsan ctl): resize, LUN add/remove
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn resize_raises_capacity_data_has_changed_and_reports_the_new_size() {
    let mut t = ram_target();
    good(&run(&t, &[0x00, 0, 0, 0, 0, 0]).await); // nexus 1 known
    let lu = Arc::clone(t.lun(0).unwrap());
    // Write the last block, shrink, grow back: it reads zeros.
    let last = 2047u32;
    let w = cdb10(0x2A, last, 1);
    good(&run_data(&t, &w, &[0xAB; 512]).await);
    assert_eq!(lu.resize(4 << 20).unwrap(), 8192);
    assert_eq!(
        sense(&run(&t, &[0x00, 0, 0, 0, 0, 0]).await),
        (0x6, 0x2A, 0x09)
    );
    let cap = run(&t, &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0]).await;
    assert_eq!(&good(&cap)[..4], &8191u32.to_be_bytes());
    good(&run(&t, &cdb10(0x28, 8191, 1)).await);
    lu.resize(512 * 1024).unwrap();
    assert_eq!(
        sense(&run(&t, &cdb10(0x28, 1500, 1)).await),
        (0x6, 0x2A, 0x09)
    );
    assert_eq!(sense(&run(&t, &cdb10(0x28, 1500, 1)).await), LBA_OOR);
    lu.resize(1 << 20).unwrap();
    let _ = run(&t, &[0x00, 0, 0, 0, 0, 0]).await; // the UA
    assert_eq!(good(&run(&t, &cdb10(0x28, last, 1)).await), &[0u8; 512][..]);
    assert!(lu.resize(100).is_err(), "less than one block");
    // Adding a LUN raises REPORTED LUNS DATA HAS CHANGED on the others.
    let mut t2 = t.clone();
    t2.add_lun(
        1,
        Arc::new(LogicalUnit::new(
            Arc::new(RamBackend::new(1 << 20)),
            cfg(512),
        )),
    );
    t2.luns_changed();
    t = t2;
    assert_eq!(
        sense(&run(&t, &[0x00, 0, 0, 0, 0, 0]).await),
        (0x6, 0x3F, 0x0E)
    );
    assert!(t.clone().remove_lun(1).is_some());
}

// ---------------------------------------------------------------------------------------------
// Aborted writes and the write range lock
// ---------------------------------------------------------------------------------------------

/// A FaultBackend over RAM whose first write to LBAs 0..=7 does `effect`; the target over it.
fn fault_target(effect: &str) -> (Arc<Target>, Arc<ironsan_backend::FaultControl>) {
    let rule = ironsan_backend::FaultRule::parse(&format!("write@0-7/count=1:{effect}")).unwrap();
    let be =
        ironsan_backend::FaultBackend::new(Arc::new(RamBackend::new(1 << 20)), vec![rule], 512, 1);
    let ctl = be.control();
    (Arc::new(target_over(Arc::new(be), cfg(512))), ctl)
}

async fn yield_until(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = std::time::Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(10),
            "timed out: {what}"
        );
        tokio::task::yield_now().await;
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
}

/// An aborted write whose I/O is already in the device (cannot be called back) keeps the range
/// locked until that I/O is done, so a newer write of the same blocks lands after it and wins.
/// Before the fix the lock went with the dropped task: the newer write was acknowledged at
/// once and then overwritten by the aborted one.
#[tokio::test(flavor = "current_thread")]
async fn aborted_write_in_flight_keeps_the_range_until_its_io_is_done() {
    let (t, ctl) = fault_target("hang");
    let old = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 1)).await }
    });
    yield_until("old write in the device", || ctl.stuck_now() == 1).await;
    // ABORT TASK: the task future is dropped; the transport answers the TMF at once.
    old.abort();
    assert!(old.await.unwrap_err().is_cancelled());
    assert_eq!(
        t.lun(0).unwrap().writes.held(),
        1,
        "range released with the task"
    );
    // A newer write of the same blocks waits for the aborted I/O ...
    let new = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 2)).await }
    });
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    assert!(!new.is_finished(), "newer write overtook the aborted one");
    // ... a write elsewhere does not.
    good(&run_data(&t, &cdb16(WRITE_16, 8, 8), &pattern(4096, 3)).await);
    // The device lets the old I/O finish; then the newer write runs and is acknowledged.
    ctl.release();
    good(&new.await.unwrap());
    let r = run(&t, &cdb16(READ_16, 0, 16)).await;
    assert_eq!(
        &good(&r)[..4096],
        &pattern(4096, 2)[..],
        "aborted write landed last"
    );
    assert_eq!(&good(&r)[4096..], &pattern(4096, 3)[..]);
    assert_eq!(t.lun(0).unwrap().writes.held(), 0);
}

/// An aborted write that never reached the device (stuck before it) gives its range back at
/// once: a newer write neither waits for the hung device nor is overwritten.
#[tokio::test(flavor = "current_thread")]
async fn aborted_write_that_never_reached_the_device_releases_the_range_at_once() {
    let (t, ctl) = fault_target("stuck");
    let old = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 1)).await }
    });
    yield_until("old write stuck", || ctl.stuck_now() == 1).await;
    old.abort();
    assert!(old.await.unwrap_err().is_cancelled());
    assert_eq!(t.lun(0).unwrap().writes.held(), 0);
    good(&run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 2)).await);
    ctl.release();
    let r = run(&t, &cdb16(READ_16, 0, 8)).await;
    assert_eq!(good(&r), &pattern(4096, 2)[..]);
}

/// The same for UNMAP and WRITE SAME: an aborted deallocation in the device is ordered before
/// a newer write of the blocks.
#[tokio::test(flavor = "current_thread")]
async fn aborted_unmap_in_flight_keeps_the_range_until_its_io_is_done() {
    let rule = ironsan_backend::FaultRule::parse("unmap@0-7/count=1:hang").unwrap();
    let inner = Arc::new(TestBackend::new(1 << 20));
    let be = ironsan_backend::FaultBackend::new(inner, vec![rule], 512, 1);
    let ctl = be.control();
    let t = Arc::new(target_over(Arc::new(be), cfg(512)));
    good(&run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 1)).await);
    let mut unmap = vec![0u8; 24];
    unmap[1] = 22;
    unmap[3] = 16;
    unmap[8..16].copy_from_slice(&0u64.to_be_bytes());
    unmap[16..20].copy_from_slice(&8u32.to_be_bytes());
    let old = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run_data(&t, &cdb10(UNMAP, 0, 24), &unmap).await }
    });
    yield_until("unmap in the device", || ctl.stuck_now() == 1).await;
    old.abort();
    assert!(old.await.unwrap_err().is_cancelled());
    let new = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 2)).await }
    });
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    assert!(!new.is_finished(), "newer write overtook the aborted unmap");
    ctl.release();
    good(&new.await.unwrap());
    let r = run(&t, &cdb16(READ_16, 0, 8)).await;
    assert_eq!(good(&r), &pattern(4096, 2)[..]);
}

// ---------------------------------------------------------------------------------------------
// Reads and orphaned writes (docs/INTEGRITY.md, "Reads and orphaned writes")
// ---------------------------------------------------------------------------------------------

/// A write aborted while the device holds its I/O leaves an orphaned range: a read of it issued
/// after the abort waits until the device finishes and then sees the aborted data, so two
/// successive reads agree. Without the fix the first read returned the old data and a later
/// one the aborted write's.
#[tokio::test(flavor = "current_thread")]
async fn read_after_abort_waits_for_the_orphaned_write_in_the_device() {
    let (t, ctl) = fault_target("hang");
    good(&run_data(&t, &cdb16(WRITE_16, 8, 8), &pattern(4096, 7)).await);
    let old = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 1)).await }
    });
    yield_until("write in the device", || ctl.stuck_now() == 1).await;
    old.abort();
    assert!(old.await.unwrap_err().is_cancelled());
    let lu = Arc::clone(t.lun(0).unwrap());
    assert_eq!(lu.writes.orphaned(), 1);
    // A read of the orphaned blocks (here overlapping them by one block) waits ...
    let read = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run(&t, &cdb16(READ_16, 7, 2)).await }
    });
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    assert!(!read.is_finished(), "read overtook the orphaned write");
    // ... reads elsewhere do not.
    let r = run(&t, &cdb16(READ_16, 8, 8)).await;
    assert_eq!(good(&r), &pattern(4096, 7)[..]);
    // The device finishes the aborted write: the waiting read sees it, and so does every
    // later read.
    ctl.release();
    let r = read.await.unwrap();
    assert_eq!(&good(&r)[..512], &pattern(4096, 1)[3584..]);
    assert_eq!(&good(&r)[512..], &pattern(4096, 7)[..512]);
    let r = run(&t, &cdb16(READ_16, 0, 8)).await;
    assert_eq!(good(&r), &pattern(4096, 1)[..]);
    assert_eq!(lu.writes.orphaned(), 0);
    assert_eq!(lu.writes.held(), 0);
}

/// Reads do not wait for ordinary in-flight writes (SCSI does not order concurrent commands;
/// waiting would cost every read that meets a write): a read of blocks a running write holds
/// completes at once with the old data.
#[tokio::test(flavor = "current_thread")]
async fn read_does_not_wait_for_a_write_that_was_not_aborted() {
    let (t, ctl) = fault_target("hang");
    let w = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 1)).await }
    });
    yield_until("write in the device", || ctl.stuck_now() == 1).await;
    let lu = Arc::clone(t.lun(0).unwrap());
    assert_eq!((lu.writes.held(), lu.writes.orphaned()), (1, 0));
    let r = run(&t, &cdb16(READ_16, 0, 8)).await;
    assert!(good(&r).iter().all(|&b| b == 0));
    ctl.release();
    good(&w.await.unwrap());
    assert_eq!(
        good(&run(&t, &cdb16(READ_16, 0, 8)).await),
        &pattern(4096, 1)[..]
    );
}

/// A write aborted before it reached the device (stuck in front of it) orphans nothing: reads
/// go on at once and see the old data for good.
#[tokio::test(flavor = "current_thread")]
async fn read_after_abort_of_a_write_that_never_reached_the_device_does_not_wait() {
    let (t, ctl) = fault_target("stuck");
    let old = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 1)).await }
    });
    yield_until("write stuck", || ctl.stuck_now() == 1).await;
    old.abort();
    assert!(old.await.unwrap_err().is_cancelled());
    let lu = Arc::clone(t.lun(0).unwrap());
    assert_eq!((lu.writes.held(), lu.writes.orphaned()), (0, 0));
    let r = run(&t, &cdb16(READ_16, 0, 8)).await;
    assert!(good(&r).iter().all(|&b| b == 0));
    ctl.release();
    let r = run(&t, &cdb16(READ_16, 0, 8)).await;
    assert!(good(&r).iter().all(|&b| b == 0), "the dropped write landed");
}

/// Report an aborted task to `lu` as the transport does (`task_aborted`); it is gone once the
/// returned flag is set.
fn report_aborted(lu: &LogicalUnit) -> Arc<std::sync::atomic::AtomicBool> {
    let gone = Arc::new(std::sync::atomic::AtomicBool::new(false));
    lu.task_aborted({
        let gone = Arc::clone(&gone);
        move || gone.load(Ordering::SeqCst)
    });
    gone
}

/// The transport answers ABORT TASK before the aborted task's future is dropped; reads wait
/// for every task reported with `task_aborted` to be gone, then for what it orphaned. Here
/// the aborted task is a future held by the test: reads of any block wait while it is
/// alive; once it is dropped, reads of its blocks wait for the device.
#[tokio::test(flavor = "current_thread")]
async fn reads_wait_for_an_aborted_task_that_is_not_yet_dropped() {
    let (t, ctl) = fault_target("hang");
    let lu = Arc::clone(t.lun(0).unwrap());
    let cdb = cdb16(WRITE_16, 0, 8);
    let data = Bytes::from(pattern(4096, 1));
    let nexus = nexus(1);
    let mut aborted = Box::pin(t.execute(
        0,
        &nexus,
        Command {
            cdb: Bytes::copy_from_slice(&cdb),
            data_out: data,
            expected_in_len: 0,
            in_place: None,
        },
    ));
    let noop = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(noop);
    assert!(aborted.as_mut().poll(&mut cx).is_pending());
    yield_until("write in the device", || ctl.stuck_now() == 1).await;
    // ABORT TASK: reported to the LU; the future is not dropped yet.
    let gone = report_aborted(&lu);
    let far = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run(&t, &cdb16(READ_16, 64, 8)).await }
    });
    let near = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run(&t, &cdb16(READ_16, 0, 8)).await }
    });
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    assert!(!far.is_finished() && !near.is_finished());
    // The future is dropped: its range is orphaned; the far read goes on, the near one waits
    // for the device.
    drop(aborted);
    gone.store(true, Ordering::SeqCst);
    good(&far.await.unwrap());
    assert_eq!(lu.writes.orphaned(), 1);
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    assert!(!near.is_finished());
    ctl.release();
    assert_eq!(good(&near.await.unwrap()), &pattern(4096, 1)[..]);
    assert_eq!(lu.writes.orphaned(), 0);
}

/// A task aborted after its command was admitted but before it took its blocks' range (its
/// thread preempted in between, say) must not land after the TMF response: a write issued
/// after that response waits until the aborted task is gone, and the aborted task, polled
/// meanwhile, takes no range (it yields to be dropped). Without that the later write took the
/// free range and was acknowledged, and the aborted one then wrote over it (INTEGRITY.md
/// promise 17).
#[tokio::test(flavor = "current_thread")]
async fn writes_wait_for_an_aborted_task_that_has_not_taken_its_range_yet() {
    let t = Arc::new(ram_target());
    let lu = Arc::clone(t.lun(0).unwrap());
    let nexus = nexus(1);
    // Admitted, not yet polled: it holds no range.
    let mut aborted = Box::pin(t.execute(
        0,
        &nexus,
        Command {
            cdb: Bytes::copy_from_slice(&cdb16(WRITE_16, 0, 8)),
            data_out: Bytes::from(pattern(4096, 1)),
            expected_in_len: 0,
            in_place: None,
        },
    ));
    let gone = report_aborted(&lu);
    // After the TMF response: a write of the same blocks from another initiator.
    let newer = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 2)).await }
    });
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    assert!(
        !newer.is_finished(),
        "a write went ahead of an aborted task still alive"
    );
    // The aborted task runs on: it must not take the range and write.
    let noop = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(noop);
    assert!(
        aborted.as_mut().poll(&mut cx).is_pending(),
        "the aborted write ran"
    );
    assert_eq!(lu.writes.held(), 0);
    drop(aborted);
    gone.store(true, Ordering::SeqCst);
    good(&newer.await.unwrap());
    let r = run(&t, &cdb16(READ_16, 0, 8)).await;
    assert!(
        good(&r) == &pattern(4096, 2)[..],
        "the newer write was overwritten"
    );
}

/// An aborted WRITE SAME (UNMAP) in the device orphans its range like a WRITE; reads and GET
/// LBA STATUS (which reads the allocation map) wait for it.
#[tokio::test(flavor = "current_thread")]
async fn get_lba_status_and_reads_wait_for_an_orphaned_unmap() {
    // Two whole RAM chunks (1 MiB = 2048 blocks), so the unmap really deallocates.
    let rule = ironsan_backend::FaultRule::parse("unmap@0-2047/count=1:hang").unwrap();
    let inner = Arc::new(RamBackend::new(2 << 20));
    let be = ironsan_backend::FaultBackend::new(inner, vec![rule], 512, 1);
    let ctl = be.control();
    let t = Arc::new(target_over(Arc::new(be), cfg(512)));
    good(&run_data(&t, &cdb16(WRITE_16, 0, 8), &pattern(4096, 1)).await);
    let mut ws = cdb16(opcode::WRITE_SAME_16, 0, 2048);
    ws[1] = 0x08; // UNMAP
    let old = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run_data(&t, &ws, &[0u8; 512]).await }
    });
    yield_until("unmap in the device", || ctl.stuck_now() == 1).await;
    old.abort();
    assert!(old.await.unwrap_err().is_cancelled());
    assert_eq!(t.lun(0).unwrap().writes.orphaned(), 1);
    let mut gls = vec![0u8; 16];
    gls[0] = 0x9E;
    gls[1] = 0x12;
    gls[13] = 64;
    let status = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run(&t, &gls).await }
    });
    let read = tokio::spawn({
        let t = Arc::clone(&t);
        async move { run(&t, &cdb16(READ_16, 0, 8)).await }
    });
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    assert!(!status.is_finished() && !read.is_finished());
    ctl.release();
    let st = status.await.unwrap();
    assert_eq!(good(&st)[8..16], 0u64.to_be_bytes());
    assert_eq!(
        good(&st)[20] & 0x0F,
        0x01,
        "LBA 0 deallocated by the aborted unmap"
    );
    assert!(good(&read.await.unwrap()).iter().all(|&b| b == 0));
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

// ---------------------------------------------------------------------------------------------
// ALUA: target port groups, access states, RTPG / STPG
// ---------------------------------------------------------------------------------------------

/// A nexus through relative target port `port`.
fn nexus_at(id: u64, port: u16) -> Nexus {
    Nexus {
        target_port: format!("iqn.2024-01.org.ironsan:disk1,t,0x{port:04x}").into(),
        relative_port: port,
        ..nexus(id)
    }
}

/// A RAM target with two groups: 1 = port 1, 2 = ports 2 and 3.
fn alua_target() -> Target {
    let mut t = ram_target();
    t.set_alua(Arc::new(Alua::new(vec![
        PortGroup::new(1, vec![1]),
        PortGroup::new(2, vec![2, 3]),
    ])));
    t
}

const RTPG: [u8; 12] = [0xA3, 0x0A, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0];
const RTPG_EXT: [u8; 12] = [0xA3, 0x2A, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0];

fn stpg_cdb(len: u32) -> [u8; 12] {
    let l = len.to_be_bytes();
    [0xA4, 0x0A, 0, 0, 0, 0, l[0], l[1], l[2], l[3], 0, 0]
}

/// A SET TARGET PORT GROUPS parameter list of (state code, group) descriptors.
fn stpg_list(d: &[(u8, u16)]) -> Vec<u8> {
    let mut v = vec![0u8; 4];
    for (s, g) in d {
        v.extend_from_slice(&[*s, 0]);
        v.extend_from_slice(&g.to_be_bytes());
    }
    v
}

/// (group id, state code, pref, status code, ports) of each RTPG descriptor after `hdr` bytes.
fn rtpg_groups(d: &[u8], hdr: usize) -> Vec<(u16, u8, bool, u8, Vec<u16>)> {
    let len = u32::from_be_bytes([d[0], d[1], d[2], d[3]]) as usize;
    assert_eq!(len + 4, d.len(), "RETURN DATA LENGTH");
    let mut out = Vec::new();
    let mut o = hdr;
    while o < d.len() {
        assert_eq!(d[o + 1], 0xCF, "supported states T/O/U/S/AN/AO");
        let n = usize::from(d[o + 7]);
        let ports = (0..n)
            .map(|i| u16::from_be_bytes([d[o + 10 + 4 * i], d[o + 11 + 4 * i]]))
            .collect();
        out.push((
            u16::from_be_bytes([d[o + 2], d[o + 3]]),
            d[o] & 0x0F,
            d[o] & 0x80 != 0,
            d[o + 5],
            ports,
        ));
        o += 8 + 4 * n;
    }
    out
}

#[tokio::test]
async fn alua_inquiry_reports_tpgs_and_the_port_and_group_designators() {
    let t = alua_target();
    let d = good(&run_on(&t, 0, &nexus_at(1, 3), &[0x12, 0, 0, 0, 96, 0], &[]).await).to_vec();
    assert_eq!(d[5] & 0x30, 0x30, "TPGS = implicit and explicit");
    let d = good(&run_on(&t, 0, &nexus_at(1, 3), &[0x12, 1, 0x83, 1, 0, 0], &[]).await).to_vec();
    let mut o = 4;
    let (mut rel, mut tpg) = (None, None);
    while o + 4 <= d.len() {
        let (kind, len) = (d[o + 1] & 0x3F, usize::from(d[o + 3]));
        let v = &d[o + 4..o + 4 + len];
        match kind {
            0x14 => rel = Some(u16::from_be_bytes([v[2], v[3]])),
            0x15 => tpg = Some(u16::from_be_bytes([v[2], v[3]])),
            _ => {}
        }
        o += 4 + len;
    }
    assert_eq!(rel, Some(3), "relative target port designator");
    assert_eq!(tpg, Some(2), "target port group designator");
}

#[tokio::test]
async fn alua_report_target_port_groups_in_both_formats_and_truncated() {
    let t = alua_target();
    t.alua().set_preferred(1, true).unwrap();
    t.alua().set_transition_time(7);
    for port in [1, 2] {
        let d = good(&run_on(&t, 0, &nexus_at(1, port), &RTPG, &[]).await).to_vec();
        assert_eq!(
            rtpg_groups(&d, 4),
            vec![(1, 0, true, 0, vec![1]), (2, 0, false, 0, vec![2, 3])],
            "the same view from port {port}"
        );
    }
    let d = good(&run_on(&t, 0, &nexus_at(1, 1), &RTPG_EXT, &[]).await).to_vec();
    assert_eq!(
        (d[4], d[5]),
        (0x10, 7),
        "format type 001b, implicit transition time"
    );
    assert_eq!(rtpg_groups(&d, 8).len(), 2);
    // A tiny allocation length truncates; RETURN DATA LENGTH still counts everything.
    let mut cdb = RTPG;
    cdb[9] = 6;
    cdb[8] = 0;
    let d = good(&run_on(&t, 0, &nexus_at(1, 1), &cdb, &[]).await).to_vec();
    assert_eq!(d.len(), 6);
    assert_eq!(u32::from_be_bytes([d[0], d[1], d[2], d[3]]), 8 + 4 + 8 + 8);
    // Parameter data formats other than 000b / 001b are refused.
    let mut cdb = RTPG;
    cdb[1] = 0x4A;
    invalid_cdb_field(&run_on(&t, 0, &nexus_at(1, 1), &cdb, &[]).await, 1, Some(7));
}

/// One command of each class, and whether each state processes it.
#[tokio::test]
async fn alua_each_state_refuses_what_spc4_says_with_its_ascq() {
    let classes: [(&str, Vec<u8>, Vec<u8>); 10] = [
        ("INQUIRY", vec![0x12, 0, 0, 0, 96, 0], vec![]),
        (
            "REPORT LUNS",
            vec![0xA0, 0, 0, 0, 0, 0, 0, 0, 0, 64, 0, 0],
            vec![],
        ),
        ("REQUEST SENSE", vec![0x03, 0, 0, 0, 18, 0], vec![]),
        ("RTPG", RTPG.to_vec(), vec![]),
        ("MODE SENSE", vec![0x1A, 0, 0x3F, 0, 255, 0], vec![]),
        (
            "READ CAPACITY",
            vec![0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            vec![],
        ),
        ("PR IN", vec![0x5E, 0, 0, 0, 0, 0, 0, 0, 64, 0], vec![]),
        ("TEST UNIT READY", vec![0, 0, 0, 0, 0, 0], vec![]),
        ("READ", vec![0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0], vec![]),
        (
            "WRITE",
            vec![0x2A, 0, 0, 0, 0, 0, 0, 0, 1, 0],
            vec![0xAB; 512],
        ),
    ];
    // Which of the classes above each state processes (SPC-4 §5.15.2.4).
    let allowed = |s: AccessState, i: usize| match s {
        AccessState::ActiveOptimized | AccessState::ActiveNonOptimized => true,
        AccessState::Standby => i <= 6,
        _ => i <= 3,
    };
    for state in AccessState::ALL {
        let t = alua_target();
        t.set_access_state(2, state, None).unwrap();
        let n = nexus_at(5, 2);
        let _ = run_on(&t, 0, &n, &[0, 0, 0, 0, 0, 0], &[]).await; // the state-change UA
        for (i, (name, cdb, data)) in classes.iter().enumerate() {
            let r = run_on(&t, 0, &n, cdb, data).await;
            if allowed(state, i) {
                good(&r);
            } else {
                assert_eq!(
                    sense(&r),
                    (0x2, 0x04, state.refusal_ascq()),
                    "{name} in {state}"
                );
            }
        }
        // The other group's port is unaffected.
        good(
            &run_on(
                &t,
                0,
                &nexus_at(6, 1),
                &[0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0],
                &[],
            )
            .await,
        );
    }
    assert_eq!(
        [
            AccessState::Transitioning,
            AccessState::Standby,
            AccessState::Unavailable,
            AccessState::Offline
        ]
        .map(AccessState::refusal_ascq),
        [0x0A, 0x0B, 0x0C, 0x12]
    );
}

#[tokio::test]
async fn alua_set_target_port_groups_changes_states_and_tells_the_other_nexuses() {
    let t = alua_target();
    let (me, other) = (nexus_at(1, 1), nexus_at(2, 2));
    good(&run_on(&t, 0, &me, &[0, 0, 0, 0, 0, 0], &[]).await);
    good(&run_on(&t, 0, &other, &[0, 0, 0, 0, 0, 0], &[]).await);
    let list = stpg_list(&[(0x1, 1), (0x2, 2)]);
    good(&run_on(&t, 0, &me, &stpg_cdb(list.len() as u32), &list).await);
    let d = good(&run_on(&t, 0, &me, &RTPG, &[]).await).to_vec();
    assert_eq!(
        rtpg_groups(&d, 4),
        vec![(1, 1, false, 1, vec![1]), (2, 2, false, 1, vec![2, 3])],
        "states set, status code 01h (altered by SET TARGET PORT GROUPS)"
    );
    // The requester gets no unit attention; the other nexus gets 2Ah/06h once.
    good(&run_on(&t, 0, &me, &[0, 0, 0, 0, 0, 0], &[]).await);
    assert_eq!(
        sense(&run_on(&t, 0, &other, &[0, 0, 0, 0, 0, 0], &[]).await),
        (0x6, 0x2A, 0x06)
    );
    // Now in standby, port 2 refuses media access but still takes STPG back to active.
    assert_eq!(
        sense(&run_on(&t, 0, &other, &[0, 0, 0, 0, 0, 0], &[]).await),
        (0x2, 0x04, 0x0B)
    );
    let list = stpg_list(&[(0x0, 2)]);
    good(&run_on(&t, 0, &other, &stpg_cdb(list.len() as u32), &list).await);
    good(&run_on(&t, 0, &other, &[0, 0, 0, 0, 0, 0], &[]).await);
    assert_eq!(
        sense(&run_on(&t, 0, &me, &[0, 0, 0, 0, 0, 0], &[]).await),
        (0x6, 0x2A, 0x06)
    );
    // An implicit change: status code 02h and a unit attention for everyone.
    t.set_access_state(1, AccessState::Unavailable, None)
        .unwrap();
    assert_eq!(
        sense(&run_on(&t, 0, &other, &RTPG, &[]).await),
        (0x6, 0x2A, 0x06)
    );
    let d = good(&run_on(&t, 0, &other, &RTPG, &[]).await).to_vec();
    assert_eq!(rtpg_groups(&d, 4)[0], (1, 3, false, 2, vec![1]));
}

#[tokio::test]
async fn alua_bad_set_target_port_groups_lists_change_nothing() {
    let t = alua_target();
    let n = nexus_at(1, 1);
    let before = t.alua().groups();
    // Unknown group (second descriptor): field pointer at its TARGET PORT GROUP.
    let list = stpg_list(&[(0x2, 1), (0x2, 9)]);
    invalid_param_field(&run_on(&t, 0, &n, &stpg_cdb(12), &list).await, 10, None);
    // States that cannot be asked for: LBA dependent, offline, transitioning, reserved.
    for code in [0x4u8, 0xE, 0xF, 0x7] {
        let list = stpg_list(&[(0x2, 1), (code, 2)]);
        invalid_param_field(&run_on(&t, 0, &n, &stpg_cdb(12), &list).await, 8, Some(3));
    }
    // A list length that is not a header plus whole descriptors, or more than was sent.
    let list = stpg_list(&[(0x2, 1)]);
    for (len, data) in [(6u32, &list[..]), (12, &list[..]), (3, &list[..3])] {
        assert_eq!(
            sense(&run_on(&t, 0, &n, &stpg_cdb(len), data).await),
            (0x5, 0x1A, 0x00),
            "length {len}"
        );
    }
    // A wrong service action.
    let mut cdb = stpg_cdb(8);
    cdb[1] = 0x0B;
    invalid_cdb_field(&run_on(&t, 0, &n, &cdb, &list).await, 1, Some(4));
    assert_eq!(t.alua().groups(), before, "nothing changed");
    good(&run_on(&t, 0, &nexus_at(2, 2), &[0, 0, 0, 0, 0, 0], &[]).await);
}

#[tokio::test]
async fn alua_timed_transition_ends_only_if_not_overtaken() {
    let t = alua_target();
    good(&run_on(&t, 0, &nexus_at(1, 3), &[0, 0, 0, 0, 0, 0], &[]).await);
    let gen = t
        .set_access_state(2, AccessState::Transitioning, None)
        .unwrap();
    assert_eq!(
        sense(
            &run_on(
                &t,
                0,
                &nexus_at(1, 3),
                &[0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0],
                &[]
            )
            .await
        ),
        (0x6, 0x2A, 0x06)
    );
    assert_eq!(
        sense(
            &run_on(
                &t,
                0,
                &nexus_at(1, 3),
                &[0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0],
                &[]
            )
            .await
        ),
        (0x2, 0x04, 0x0A)
    );
    t.set_access_state(2, AccessState::ActiveNonOptimized, Some(gen))
        .unwrap();
    // A transition overtaken by another change does not apply its end.
    let gen = t
        .set_access_state(2, AccessState::Transitioning, None)
        .unwrap();
    t.set_access_state(2, AccessState::Standby, None).unwrap();
    assert_eq!(
        t.set_access_state(2, AccessState::ActiveOptimized, Some(gen)),
        Err(AluaError::Overtaken)
    );
    assert_eq!(t.alua().group_of(2).unwrap().state, AccessState::Standby);
}

#[tokio::test]
async fn alua_writes_are_not_placed_through_an_inaccessible_port() {
    let t = alua_target();
    let cdb = [0x2A, 0, 0, 0, 0, 0, 0, 0, 1, 0];
    let n = nexus_at(1, 2);
    // RAM cannot place writes either way; the check must not open a path around the state.
    t.set_access_state(2, AccessState::Standby, None).unwrap();
    assert!(t.place_write(0, &n, &cdb, 512).is_none());
}

#[tokio::test]
async fn alua_commands_are_listed_by_report_supported_operation_codes() {
    let t = alua_target();
    for (op, sa) in [(0xA3u8, 0x0Au16), (0xA4, 0x0A)] {
        let s = sa.to_be_bytes();
        let cdb = [0xA3, 0x0C, 0x02, op, s[0], s[1], 0, 0, 1, 0, 0, 0];
        let d = good(&run(&t, &cdb).await).to_vec();
        assert_eq!(d[1] & 0x07, 0b011, "{op:02x}/{sa:02x} supported");
        assert_eq!(d[4], op);
    }
}

/// The nexus of initiator `id` through port `port` (one initiator port, several target ports).
fn path(id: u64, port: u16) -> Nexus {
    nexus_at(id, port)
}

#[tokio::test]
async fn pr_across_target_ports_all_tg_pt_spec_i_pt_and_register_and_move() {
    let t = alua_target();
    let w = cdb10(opcode::WRITE_10, 0, 1);
    // Initiator 1 registers through port 1 with ALL_TG_PT=1: its path through port 2 is
    // registered too, and READ FULL STATUS says ALL_TG_PT.
    let mut p = prout_params(0, 0xA1, false);
    p[20] |= 0x04;
    good(&run_on(&t, 0, &path(1, 1), &prout(0x00, 0), &p).await);
    // Write Exclusive, Registrants Only, reserved through port 1.
    good(
        &run_on(
            &t,
            0,
            &path(1, 1),
            &prout(0x01, 0x05),
            &prout_params(0xA1, 0, false),
        )
        .await,
    );
    good(&run_on(&t, 0, &path(1, 2), &w, &[1u8; 512]).await);
    let mut full = prin(0x03);
    full[8] = 0xFF;
    let d = good(&run_on(&t, 0, &path(1, 2), &full, &[]).await).to_vec();
    assert_eq!(d[8 + 12] & 0x02, 0x02, "ALL_TG_PT reported");
    // Initiator 2 registered through port 1 only: its path through port 2 is not.
    register(&t, &path(2, 1), 0xB2).await;
    good(&run_on(&t, 0, &path(2, 1), &w, &[2u8; 512]).await);
    assert_eq!(
        run_on(&t, 0, &path(2, 2), &w, &[2u8; 512]).await.status,
        Status::RESERVATION_CONFLICT
    );
    good(&run_on(&t, 0, &path(2, 2), &cdb10(opcode::READ_10, 0, 1), &[]).await);
    // SPEC_I_PT is not supported (SIP_C=0): refused with the bit pointed at.
    let mut p = prout_params(0, 0xC3, false);
    p[20] |= 0x08;
    invalid_param_field(
        &run_on(&t, 0, &path(3, 1), &prout(0x00, 0), &p).await,
        20,
        Some(3),
    );

    // REGISTER AND MOVE: initiator 2's holder moves a Write Exclusive reservation to
    // initiator 4 through another relative port (3).
    let t = alua_target();
    register(&t, &path(2, 1), 0xB2).await;
    good(
        &run_on(
            &t,
            0,
            &path(2, 1),
            &prout(0x01, 0x01),
            &prout_params(0xB2, 0, false),
        )
        .await,
    );
    let tid = {
        let name = path(4, 3).initiator_port.to_string();
        let mut n = name.into_bytes();
        n.push(0);
        while !n.len().is_multiple_of(4) {
            n.push(0);
        }
        let mut d = vec![0x45, 0];
        d.extend_from_slice(&(n.len() as u16).to_be_bytes());
        d.extend_from_slice(&n);
        d
    };
    let move_params = |rel: u16| {
        let mut m = vec![0u8; 24];
        m[0..8].copy_from_slice(&0xB2u64.to_be_bytes());
        m[8..16].copy_from_slice(&0xD4u64.to_be_bytes());
        m[18..20].copy_from_slice(&rel.to_be_bytes());
        m[20..24].copy_from_slice(&(tid.len() as u32).to_be_bytes());
        m.extend_from_slice(&tid);
        m
    };
    let mut cdb = prout(0x07, 0x01);
    // A relative port that does not exist: INVALID FIELD IN PARAMETER LIST at byte 18.
    let m = move_params(9);
    cdb[8] = m.len() as u8;
    invalid_param_field(&run_on(&t, 0, &path(2, 1), &cdb, &m).await, 18, None);
    let m = move_params(3);
    good(&run_on(&t, 0, &path(2, 1), &cdb, &m).await);
    // Initiator 4 now holds it through port 3 (and only there); initiator 2 is unregistered
    // as a holder and writes conflict.
    good(&run_on(&t, 0, &path(4, 3), &w, &[4u8; 512]).await);
    assert_eq!(
        run_on(&t, 0, &path(4, 2), &w, &[4u8; 512]).await.status,
        Status::RESERVATION_CONFLICT
    );
    assert_eq!(
        run_on(&t, 0, &path(2, 1), &w, &[2u8; 512]).await.status,
        Status::RESERVATION_CONFLICT
    );
    let rr = run_on(&t, 0, &path(2, 1), &prin(0x01), &[]).await;
    assert_eq!(&good(&rr)[8..16], &0xD4u64.to_be_bytes());
}

#[tokio::test]
async fn alua_and_pr_edge_cases_found_in_review() {
    // An ALL_TG_PT registration may not hide a per-port one of the same initiator port.
    let t = alua_target();
    register(&t, &path(1, 1), 0xA1).await;
    let mut p = prout_params(0, 0xA2, false);
    p[20] |= 0x04;
    assert_eq!(
        run_on(&t, 0, &path(1, 2), &prout(0x00, 0), &p).await.status,
        Status::RESERVATION_CONFLICT
    );
    // A timed transition taken before the layout was replaced never ends a later state.
    let t = alua_target();
    let gen = t
        .set_access_state(2, AccessState::Transitioning, None)
        .unwrap();
    t.set_port_groups(Some(vec![
        PortGroup::new(1, vec![1]),
        PortGroup::new(2, vec![2, 3]),
    ]));
    t.set_access_state(2, AccessState::Unavailable, None)
        .unwrap();
    assert_eq!(
        t.set_access_state(2, AccessState::Standby, Some(gen)),
        Err(AluaError::Overtaken)
    );
    // Configured groups: a new port outside them gets a group of its own.
    t.follow_ports(&[1, 2, 3, 7]);
    let g = t.alua().groups();
    assert_eq!(g.len(), 3);
    assert_eq!((g[2].id, g[2].ports.clone()), (7, vec![7]));
    assert_eq!(
        g[1].state,
        AccessState::Unavailable,
        "configured states stay"
    );
}
