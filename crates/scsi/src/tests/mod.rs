//! Unit tests of the device server against RamBackend, NullBackend and an instrumented backend,
//! one module per module of the crate they mainly exercise (`target` for the crate root). This
//! module holds the fixtures and helpers they share.

use super::*;
use ironsan_backend::{
    BackendError, BlockDevice, Capabilities, IoFuture, NullBackend, RamBackend, WriteMode,
};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::task::{Context, Poll};

mod alua;
mod cdb;
mod lu;
mod mode;
mod pr;
mod sbc;
mod sense;
mod spc;
mod target;
mod xcopy;

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
        shared: false,
        cluster: None,
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
// Helpers shared by several test modules
// ---------------------------------------------------------------------------------------------

fn rsoc(options: u8, op: u8, sa: u16, alloc: u32) -> Vec<u8> {
    let mut c = vec![0xA3, 0x0C, options, op];
    c.extend_from_slice(&sa.to_be_bytes());
    c.extend_from_slice(&alloc.to_be_bytes());
    c.extend_from_slice(&[0, 0]);
    c
}

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

async fn register(t: &Target, n: &Nexus, key: u64) {
    let r = run_on(t, 0, n, &prout(0x06, 0), &prout_params(0, key, false)).await;
    good(&r);
}

async fn clear_uas(t: &Target, n: &Nexus) {
    while run_on(t, 0, n, &[0; 6], &[]).await.status != Status::GOOD {}
}

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

/// The nexus of initiator `id` through port `port` (one initiator port, several target ports).
fn path(id: u64, port: u16) -> Nexus {
    nexus_at(id, port)
}
