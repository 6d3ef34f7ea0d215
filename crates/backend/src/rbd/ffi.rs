//! librados and librbd, loaded when the first RBD LUN opens (`dlopen` of `librados.so.2` and
//! `librbd.so.1` through `libloading`): the only `unsafe` of the RBD backend.
//!
//! Building ironsan needs neither Ceph's headers nor its libraries; a machine without them
//! serves every other backend, and an `rbd:` LUN is refused at start with what to install.
//! The signatures are those of Ceph 16 (librbd 1.16, librados 3.0; `/usr/include/rbd/librbd.h`
//! and `/usr/include/rados/librados.h` of `librbd-dev` / `librados-dev`), all present in
//! later releases too.
//!
//! Rules this module keeps:
//! * The libraries are never unloaded (librados starts threads and registers exit handlers).
//! * Every asynchronous operation owns its buffers, iovec and result cell in one heap
//!   allocation ([`Op`]) that only the completion callback frees, so dropping the future that
//!   waits for it (an aborted task) cannot free memory librbd still writes to; librbd has no
//!   way to cancel an operation.
//! * The completion callback runs on a librbd thread: it reads the result, releases the
//!   completion and sends the [`Op`] back over a oneshot channel; it never blocks, never
//!   panics and never calls back into librbd beyond those two calls.
#![allow(unsafe_code)]

use bytes::{Bytes, BytesMut};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use tokio::sync::oneshot;

type RadosT = *mut c_void;
type IoCtxT = *mut c_void;
type ImageT = *mut c_void;
type CompletionT = *mut c_void;
type CompleteCb = extern "C" fn(CompletionT, *mut c_void);
type UpdateCb = extern "C" fn(*mut c_void);
type DiffCb = extern "C" fn(u64, usize, c_int, *mut c_void) -> c_int;
type WriteOpT = *mut c_void;
/// `rados_watchcb2_t`: (arg, notify_id, watch cookie, notifier's instance id, data, len).
type WatchCb = extern "C" fn(*mut c_void, u64, u64, u64, *mut c_void, usize);
/// `rados_watcherrcb_t`: (arg, watch cookie, negative errno).
type WatchErrCb = extern "C" fn(*mut c_void, u64, c_int);

/// `LIBRADOS_CMPXATTR_OP_EQ`.
const CMPXATTR_EQ: u8 = 1;

/// `struct notify_ack_t` (librados.h): a watcher that acknowledged a notify.
#[repr(C)]
struct NotifyAck {
    notifier_id: u64,
    cookie: u64,
    payload: *mut c_char,
    payload_len: u64,
}

/// `struct notify_timeout_t` (librados.h): a watcher that did not acknowledge in time.
#[repr(C)]
struct NotifyTimeout {
    notifier_id: u64,
    cookie: u64,
}

/// `rbd_lock_mode_t`, a C enum of non-negative values: an `unsigned int` to the compiler.
type LockMode = std::ffi::c_uint;
/// `rbd_lock_mode_t`: RBD_LOCK_MODE_EXCLUSIVE.
const LOCK_MODE_EXCLUSIVE: LockMode = 0;
/// `RBD_FEATURE_EXCLUSIVE_LOCK` (`rbd/features.h`).
pub(super) const FEATURE_EXCLUSIVE_LOCK: u64 = 1 << 2;
/// The exclusive lock and the features that need it (`rbd/features.h`), in the order
/// `rbd feature disable` wants them removed.
pub(super) const FEATURES_NEEDING_LOCK: [(u64, &str); 4] = [
    (1 << 6, "journaling"),
    (1 << 4, "fast-diff"),
    (1 << 3, "object-map"),
    (FEATURE_EXCLUSIVE_LOCK, "exclusive-lock"),
];
/// `RBD_WRITE_ZEROES_FLAG_THICK_PROVISION`: zeros written (allocated), not a deallocation.
pub(super) const ZEROES_THICK: c_int = 1;

/// `rbd_config_option_t`.
#[repr(C)]
struct ConfigOption {
    name: *mut c_char,
    value: *mut c_char,
    source: c_int,
}

/// The entry points used, resolved once.
struct Api {
    rados_create2: unsafe extern "C" fn(*mut RadosT, *const c_char, *const c_char, u64) -> c_int,
    rados_conf_read_file: unsafe extern "C" fn(RadosT, *const c_char) -> c_int,
    rados_conf_set: unsafe extern "C" fn(RadosT, *const c_char, *const c_char) -> c_int,
    rados_connect: unsafe extern "C" fn(RadosT) -> c_int,
    rados_shutdown: unsafe extern "C" fn(RadosT),
    rados_getaddrs: unsafe extern "C" fn(RadosT, *mut *mut c_char) -> c_int,
    rados_ioctx_create: unsafe extern "C" fn(RadosT, *const c_char, *mut IoCtxT) -> c_int,
    rados_ioctx_destroy: unsafe extern "C" fn(IoCtxT),
    rados_ioctx_set_namespace: unsafe extern "C" fn(IoCtxT, *const c_char),
    rados_get_instance_id: unsafe extern "C" fn(RadosT) -> u64,
    rados_blocklist_add: unsafe extern "C" fn(RadosT, *mut c_char, u32) -> c_int,
    rados_stat: unsafe extern "C" fn(IoCtxT, *const c_char, *mut u64, *mut libc::time_t) -> c_int,
    rados_read: unsafe extern "C" fn(IoCtxT, *const c_char, *mut c_char, usize, u64) -> c_int,
    rados_getxattr:
        unsafe extern "C" fn(IoCtxT, *const c_char, *const c_char, *mut c_char, usize) -> c_int,
    rados_create_write_op: unsafe extern "C" fn() -> WriteOpT,
    rados_release_write_op: unsafe extern "C" fn(WriteOpT),
    rados_write_op_create: unsafe extern "C" fn(WriteOpT, c_int, *const c_char),
    rados_write_op_cmpxattr:
        unsafe extern "C" fn(WriteOpT, *const c_char, u8, *const c_char, usize),
    rados_write_op_setxattr: unsafe extern "C" fn(WriteOpT, *const c_char, *const c_char, usize),
    rados_write_op_write_full: unsafe extern "C" fn(WriteOpT, *const c_char, usize),
    rados_write_op_operate:
        unsafe extern "C" fn(WriteOpT, IoCtxT, *const c_char, *mut libc::time_t, c_int) -> c_int,
    rados_watch2: unsafe extern "C" fn(
        IoCtxT,
        *const c_char,
        *mut u64,
        WatchCb,
        WatchErrCb,
        *mut c_void,
    ) -> c_int,
    rados_unwatch2: unsafe extern "C" fn(IoCtxT, u64) -> c_int,
    rados_watch_check: unsafe extern "C" fn(IoCtxT, u64) -> c_int,
    rados_watch_flush: unsafe extern "C" fn(RadosT) -> c_int,
    rados_notify2: unsafe extern "C" fn(
        IoCtxT,
        *const c_char,
        *const c_char,
        c_int,
        u64,
        *mut *mut c_char,
        *mut usize,
    ) -> c_int,
    rados_notify_ack:
        unsafe extern "C" fn(IoCtxT, *const c_char, u64, u64, *const c_char, c_int) -> c_int,
    rados_decode_notify_response: unsafe extern "C" fn(
        *mut c_char,
        usize,
        *mut *mut NotifyAck,
        *mut usize,
        *mut *mut NotifyTimeout,
        *mut usize,
    ) -> c_int,
    rados_free_notify_response: unsafe extern "C" fn(*mut NotifyAck, usize, *mut NotifyTimeout),
    rados_buffer_free: unsafe extern "C" fn(*mut c_char),
    rbd_open: unsafe extern "C" fn(IoCtxT, *const c_char, *mut ImageT, *const c_char) -> c_int,
    rbd_open_read_only:
        unsafe extern "C" fn(IoCtxT, *const c_char, *mut ImageT, *const c_char) -> c_int,
    rbd_close: unsafe extern "C" fn(ImageT) -> c_int,
    rbd_get_size: unsafe extern "C" fn(ImageT, *mut u64) -> c_int,
    rbd_get_features: unsafe extern "C" fn(ImageT, *mut u64) -> c_int,
    rbd_resize: unsafe extern "C" fn(ImageT, u64) -> c_int,
    rbd_config_image_list: unsafe extern "C" fn(ImageT, *mut ConfigOption, *mut c_int) -> c_int,
    rbd_config_image_list_cleanup: unsafe extern "C" fn(*mut ConfigOption, c_int),
    rbd_update_watch: unsafe extern "C" fn(ImageT, *mut u64, UpdateCb, *mut c_void) -> c_int,
    rbd_update_unwatch: unsafe extern "C" fn(ImageT, u64) -> c_int,
    rbd_diff_iterate2:
        unsafe extern "C" fn(ImageT, *const c_char, u64, u64, u8, u8, DiffCb, *mut c_void) -> c_int,
    rbd_lock_acquire: unsafe extern "C" fn(ImageT, LockMode) -> c_int,
    rbd_lock_get_owners:
        unsafe extern "C" fn(ImageT, *mut LockMode, *mut *mut c_char, *mut usize) -> c_int,
    rbd_lock_get_owners_cleanup: unsafe extern "C" fn(*mut *mut c_char, usize),
    rbd_lock_break: unsafe extern "C" fn(ImageT, LockMode, *const c_char) -> c_int,
    rbd_aio_create_completion:
        unsafe extern "C" fn(*mut c_void, CompleteCb, *mut CompletionT) -> c_int,
    rbd_aio_get_return_value: unsafe extern "C" fn(CompletionT) -> isize,
    rbd_aio_release: unsafe extern "C" fn(CompletionT),
    rbd_aio_readv:
        unsafe extern "C" fn(ImageT, *const libc::iovec, c_int, u64, CompletionT) -> c_int,
    rbd_aio_writev:
        unsafe extern "C" fn(ImageT, *const libc::iovec, c_int, u64, CompletionT) -> c_int,
    rbd_aio_flush: unsafe extern "C" fn(ImageT, CompletionT) -> c_int,
    rbd_aio_write_zeroes:
        unsafe extern "C" fn(ImageT, u64, usize, CompletionT, c_int, c_int) -> c_int,
    rbd_aio_compare_and_write: unsafe extern "C" fn(
        ImageT,
        u64,
        usize,
        *const c_char,
        *const c_char,
        CompletionT,
        *mut u64,
        c_int,
    ) -> isize,
}

static API: OnceLock<Result<Api, String>> = OnceLock::new();

/// The libraries' entry points, loaded on first use; `Err` says what is missing.
fn api() -> Result<&'static Api, String> {
    API.get_or_init(load).as_ref().map_err(Clone::clone)
}

/// Whether librados and librbd can be loaded here (`Err`: why not, and what to install).
pub fn available() -> Result<(), String> {
    api().map(|_| ())
}

fn open_lib(name: &str) -> Result<&'static libloading::Library, String> {
    // SAFETY: loading runs the library's initialisers; librados and librbd are ordinary
    // shared libraries whose initialisers only set up their own state. The handle is leaked,
    // so the library is never unloaded while its threads or our function pointers exist.
    let lib = unsafe { libloading::Library::new(name) }.map_err(|e| {
        format!("{name} could not be loaded ({e}); RBD LUNs need Ceph's client libraries (Debian: apt-get install librbd1)")
    })?;
    Ok(Box::leak(Box::new(lib)))
}

fn load() -> Result<Api, String> {
    let rados = open_lib("librados.so.2")?;
    let rbd = open_lib("librbd.so.1")?;
    macro_rules! sym {
        ($lib:expr, $name:ident) => {{
            // SAFETY: the symbol is looked up by its C name and given the type of its
            // declaration in Ceph 16's public headers (librados.h / librbd.h), which later
            // releases keep; the library stays loaded for the life of the process (leaked
            // above), so the function pointer never dangles.
            let s = unsafe { $lib.get(concat!(stringify!($name), "\0").as_bytes()) }
                .map_err(|e| format!("{}: {e} (Ceph older than 16?)", stringify!($name)))?;
            *s
        }};
    }
    Ok(Api {
        rados_create2: sym!(rados, rados_create2),
        rados_conf_read_file: sym!(rados, rados_conf_read_file),
        rados_conf_set: sym!(rados, rados_conf_set),
        rados_connect: sym!(rados, rados_connect),
        rados_shutdown: sym!(rados, rados_shutdown),
        rados_getaddrs: sym!(rados, rados_getaddrs),
        rados_ioctx_create: sym!(rados, rados_ioctx_create),
        rados_ioctx_destroy: sym!(rados, rados_ioctx_destroy),
        rados_ioctx_set_namespace: sym!(rados, rados_ioctx_set_namespace),
        rados_get_instance_id: sym!(rados, rados_get_instance_id),
        rados_blocklist_add: sym!(rados, rados_blocklist_add),
        rados_stat: sym!(rados, rados_stat),
        rados_read: sym!(rados, rados_read),
        rados_getxattr: sym!(rados, rados_getxattr),
        rados_create_write_op: sym!(rados, rados_create_write_op),
        rados_release_write_op: sym!(rados, rados_release_write_op),
        rados_write_op_create: sym!(rados, rados_write_op_create),
        rados_write_op_cmpxattr: sym!(rados, rados_write_op_cmpxattr),
        rados_write_op_setxattr: sym!(rados, rados_write_op_setxattr),
        rados_write_op_write_full: sym!(rados, rados_write_op_write_full),
        rados_write_op_operate: sym!(rados, rados_write_op_operate),
        rados_watch2: sym!(rados, rados_watch2),
        rados_unwatch2: sym!(rados, rados_unwatch2),
        rados_watch_check: sym!(rados, rados_watch_check),
        rados_watch_flush: sym!(rados, rados_watch_flush),
        rados_notify2: sym!(rados, rados_notify2),
        rados_notify_ack: sym!(rados, rados_notify_ack),
        rados_decode_notify_response: sym!(rados, rados_decode_notify_response),
        rados_free_notify_response: sym!(rados, rados_free_notify_response),
        rados_buffer_free: sym!(rados, rados_buffer_free),
        rbd_open: sym!(rbd, rbd_open),
        rbd_open_read_only: sym!(rbd, rbd_open_read_only),
        rbd_close: sym!(rbd, rbd_close),
        rbd_get_size: sym!(rbd, rbd_get_size),
        rbd_get_features: sym!(rbd, rbd_get_features),
        rbd_resize: sym!(rbd, rbd_resize),
        rbd_config_image_list: sym!(rbd, rbd_config_image_list),
        rbd_config_image_list_cleanup: sym!(rbd, rbd_config_image_list_cleanup),
        rbd_update_watch: sym!(rbd, rbd_update_watch),
        rbd_update_unwatch: sym!(rbd, rbd_update_unwatch),
        rbd_diff_iterate2: sym!(rbd, rbd_diff_iterate2),
        rbd_lock_acquire: sym!(rbd, rbd_lock_acquire),
        rbd_lock_get_owners: sym!(rbd, rbd_lock_get_owners),
        rbd_lock_get_owners_cleanup: sym!(rbd, rbd_lock_get_owners_cleanup),
        rbd_lock_break: sym!(rbd, rbd_lock_break),
        rbd_aio_create_completion: sym!(rbd, rbd_aio_create_completion),
        rbd_aio_get_return_value: sym!(rbd, rbd_aio_get_return_value),
        rbd_aio_release: sym!(rbd, rbd_aio_release),
        rbd_aio_readv: sym!(rbd, rbd_aio_readv),
        rbd_aio_writev: sym!(rbd, rbd_aio_writev),
        rbd_aio_flush: sym!(rbd, rbd_aio_flush),
        rbd_aio_write_zeroes: sym!(rbd, rbd_aio_write_zeroes),
        rbd_aio_compare_and_write: sym!(rbd, rbd_aio_compare_and_write),
    })
}

/// A negative errno from librados/librbd, as a positive errno.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Errno(pub i32);

impl Errno {
    fn check(ret: c_int) -> Result<c_int, Errno> {
        if ret < 0 {
            Err(Errno(-ret))
        } else {
            Ok(ret)
        }
    }
}

impl std::fmt::Display for Errno {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", std::io::Error::from_raw_os_error(self.0))
    }
}

fn cstr(s: &str) -> Result<CString, Errno> {
    CString::new(s).map_err(|_| Errno(libc::EINVAL))
}

/// A connected cluster handle (`rados_t`).
pub(super) struct Cluster {
    api: &'static Api,
    h: RadosT,
}

// SAFETY: librados handles are documented as thread-safe (every call takes its own locks);
// the handle is only freed in `Drop`, when no reference is left.
unsafe impl Send for Cluster {}
// SAFETY: as above: concurrent calls on one `rados_t` are allowed.
unsafe impl Sync for Cluster {}

/// Where a connection attempt failed (the caller words the message).
#[derive(Debug)]
pub(super) enum ConnectError {
    Library(String),
    Create(Errno),
    ReadConf(Errno),
    Set(String, Errno),
    Connect(Errno),
}

impl Cluster {
    /// `rados_create2` as `client.ID`, `rados_conf_read_file(conf)` (`None`: librados' own
    /// search: $CEPH_CONF, /etc/ceph/ceph.conf, ~/.ceph/config, ./ceph.conf), every
    /// `settings` pair, then `rados_connect` (blocking: bounded by `client_mount_timeout`).
    pub(super) fn connect(
        conf: Option<&str>,
        id: &str,
        settings: &[(&str, &str)],
    ) -> Result<Cluster, ConnectError> {
        let api = api().map_err(ConnectError::Library)?;
        let cluster = cstr("ceph").map_err(ConnectError::Create)?;
        let name = cstr(&format!("client.{id}")).map_err(ConnectError::Create)?;
        let mut h: RadosT = std::ptr::null_mut();
        // SAFETY: `h` is a valid out-pointer; both strings are NUL-terminated and outlive the
        // call (librados copies them).
        Errno::check(unsafe { (api.rados_create2)(&mut h, cluster.as_ptr(), name.as_ptr(), 0) })
            .map_err(ConnectError::Create)?;
        // From here `Drop` shuts the handle down on every error path.
        let c = Cluster { api, h };
        let path = conf.map(cstr).transpose().map_err(ConnectError::ReadConf)?;
        let path_ptr = path.as_ref().map_or(std::ptr::null(), |p| p.as_ptr());
        // SAFETY: `c.h` is a created, not yet connected handle; `path_ptr` is NULL (search
        // the default places) or a NUL-terminated path that outlives the call.
        Errno::check(unsafe { (api.rados_conf_read_file)(c.h, path_ptr) })
            .map_err(ConnectError::ReadConf)?;
        for (k, v) in settings {
            let (ck, cv) = (
                cstr(k).map_err(|e| ConnectError::Set(k.to_string(), e))?,
                cstr(v).map_err(|e| ConnectError::Set(k.to_string(), e))?,
            );
            // SAFETY: valid handle; both strings NUL-terminated, copied by librados.
            Errno::check(unsafe { (api.rados_conf_set)(c.h, ck.as_ptr(), cv.as_ptr()) })
                .map_err(|e| ConnectError::Set(k.to_string(), e))?;
        }
        // SAFETY: a configured handle; blocks until connected or `client_mount_timeout`.
        Errno::check(unsafe { (api.rados_connect)(c.h) }).map_err(ConnectError::Connect)?;
        Ok(c)
    }

    /// This client's address as the cluster sees it (`IP:PORT/NONCE`), the form lock
    /// owners and blocklist entries use.
    pub(super) fn addr(&self) -> Result<String, Errno> {
        let mut p: *mut c_char = std::ptr::null_mut();
        // SAFETY: connected handle; `p` is a valid out-pointer that librados sets to a
        // `strdup`ed string on success.
        Errno::check(unsafe { (self.api.rados_getaddrs)(self.h, &mut p) })?;
        if p.is_null() {
            return Err(Errno(libc::EIO));
        }
        // SAFETY: `p` is a NUL-terminated string allocated with malloc by librados; it is
        // copied, then freed once.
        let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
        // SAFETY: `p` came from librados' `strdup` (malloc) and is not used after this.
        unsafe { libc::free(p.cast()) };
        Ok(s)
    }

    /// An I/O context on `pool` (in `namespace`, if any).
    pub(super) fn pool(
        self: &std::sync::Arc<Self>,
        pool: &str,
        namespace: Option<&str>,
    ) -> Result<IoCtx, Errno> {
        let name = cstr(pool)?;
        let mut io: IoCtxT = std::ptr::null_mut();
        // SAFETY: connected handle; `name` NUL-terminated; `io` a valid out-pointer.
        Errno::check(unsafe { (self.api.rados_ioctx_create)(self.h, name.as_ptr(), &mut io) })?;
        let ctx = IoCtx {
            api: self.api,
            h: io,
            _cluster: std::sync::Arc::clone(self),
        };
        if let Some(ns) = namespace {
            let ns = cstr(ns)?;
            // SAFETY: a valid I/O context; the namespace string is copied by librados.
            unsafe { (self.api.rados_ioctx_set_namespace)(ctx.h, ns.as_ptr()) };
        }
        Ok(ctx)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `rados_create2` and nothing refers to it any more
        // (I/O contexts and images hold an `Arc` of the cluster).
        unsafe { (self.api.rados_shutdown)(self.h) };
    }
}

/// A pool's I/O context (`rados_ioctx_t`).
pub(super) struct IoCtx {
    api: &'static Api,
    h: IoCtxT,
    _cluster: std::sync::Arc<Cluster>,
}

// SAFETY: librados I/O contexts may be used from several threads; freed only in `Drop`.
unsafe impl Send for IoCtx {}
// SAFETY: as above.
unsafe impl Sync for IoCtx {}

impl Drop for IoCtx {
    fn drop(&mut self) {
        // SAFETY: created by `rados_ioctx_create`; images opened on it hold an `Arc` of it.
        unsafe { (self.api.rados_ioctx_destroy)(self.h) };
    }
}

// ----- shared objects: versioned data, watch/notify, fencing (several gateways) --------------

/// The xattr holding a shared object's version: 20 decimal digits, so that librados' string
/// comparison (`rados_write_op_cmpxattr`) compares versions exactly.
const VERSION_XATTR: &str = "ironsan.version";

fn version_text(v: u64) -> String {
    format!("{v:020}")
}

impl Cluster {
    /// This client's instance id: the `notifier_id` other watchers see in its notifies, and
    /// the id in its acknowledgements.
    pub(super) fn instance_id(&self) -> u64 {
        // SAFETY: connected handle; a plain getter.
        unsafe { (self.api.rados_get_instance_id)(self.h) }
    }

    /// Blocklist the client at `addr` (`IP:PORT/NONCE`, as [`Cluster::addr`] gives it) for
    /// `expire_secs` seconds (0: the cluster's default). Returns once the monitors have
    /// committed it; OSDs then refuse that client's operations.
    pub(super) fn blocklist_add(&self, addr: &str, expire_secs: u32) -> Result<(), Errno> {
        let a = cstr(addr)?;
        // SAFETY: connected handle; librados reads the NUL-terminated address (the pointer is
        // `char *` in the header but not written to) during the call only.
        Errno::check(unsafe {
            (self.api.rados_blocklist_add)(self.h, a.as_ptr().cast_mut(), expire_secs)
        })
        .map(|_| ())
    }
}

/// The reply to [`IoCtx::notify`]: who acknowledged (instance id, watch cookie, payload) and
/// who did not within the timeout (instance id, watch cookie).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct NotifyReply {
    pub acks: Vec<(u64, u64, Vec<u8>)>,
    pub timeouts: Vec<(u64, u64)>,
}

/// One notification a watch received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    pub notify_id: u64,
    pub cookie: u64,
    pub notifier: u64,
    pub data: Vec<u8>,
}

/// What a watch calls: on each notification, and when the watch breaks (a negative errno:
/// the connection to the OSD was lost long enough that notifies may have been missed).
pub(super) struct WatchHandlers {
    pub on_notify: Box<dyn Fn(Notification) + Send + Sync>,
    pub on_error: Box<dyn Fn(i32) + Send + Sync>,
}

/// A registered watch on an object; dropping it unregisters it and waits until no callback runs.
pub(super) struct ObjectWatch {
    io: std::sync::Arc<IoCtx>,
    cookie: u64,
    handlers: *mut WatchHandlers,
}

// SAFETY: the handlers are `Send + Sync`; the raw pointer is only freed in `Drop`, after
// librados has stopped calling back (unwatch, then flush).
unsafe impl Send for ObjectWatch {}
// SAFETY: as above; `&Watch` gives access to nothing but the cookie.
unsafe impl Sync for ObjectWatch {}

impl ObjectWatch {
    /// The watch's cookie (what notifications and acknowledgements name it by).
    pub(super) fn cookie(&self) -> u64 {
        self.cookie
    }

    /// Whether the watch is still registered with the OSD: the milliseconds since it was
    /// last confirmed, or the error that broke it (`ENOTCONN`: lost, notifies may have been
    /// missed).
    pub(super) fn check(&self) -> Result<u64, Errno> {
        // SAFETY: the cookie came from `rados_watch2` on this I/O context, which is alive.
        let r = unsafe { (self.io.api.rados_watch_check)(self.io.h, self.cookie) };
        Errno::check(r).map(|ms| u64::try_from(ms).unwrap_or(0))
    }
}

extern "C" fn watch_cb(
    arg: *mut c_void,
    notify_id: u64,
    cookie: u64,
    notifier: u64,
    data: *mut c_void,
    len: usize,
) {
    let data = if data.is_null() || len == 0 {
        Vec::new()
    } else {
        // SAFETY: librados passes `len` readable bytes at `data` for the duration of the call.
        unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }.to_vec()
    };
    // SAFETY: `arg` is the `WatchHandlers` registered with this watch; it is freed only after
    // the watch is unregistered and librados' callbacks are flushed.
    let h = unsafe { &*arg.cast::<WatchHandlers>() };
    let n = Notification {
        notify_id,
        cookie,
        notifier,
        data,
    };
    // A panic must not unwind into librados.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (h.on_notify)(n)));
}

extern "C" fn watch_err_cb(arg: *mut c_void, _cookie: u64, err: c_int) {
    // SAFETY: as in `watch_cb`.
    let h = unsafe { &*arg.cast::<WatchHandlers>() };
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (h.on_error)(err)));
}

/// Dropping the watch unregisters it and waits for its callbacks to finish: never drop it
/// from one of its own callbacks (that waits for itself).
impl Drop for ObjectWatch {
    fn drop(&mut self) {
        // SAFETY: the cookie came from `rados_watch2` on this I/O context. After unwatch,
        // `rados_watch_flush` waits for callbacks already queued, so none runs once it returns.
        unsafe {
            (self.io.api.rados_unwatch2)(self.io.h, self.cookie);
            (self.io.api.rados_watch_flush)(self.io._cluster.h);
        }
        // SAFETY: made by `Box::into_raw` in `IoCtx::watch`; no callback can use it any more.
        drop(unsafe { Box::from_raw(self.handlers) });
    }
}

impl IoCtx {
    /// The version of `oid` (`None`: no such object; 0: an object without a version).
    fn version_of(&self, o: &CStr) -> Result<Option<u64>, Errno> {
        let name = cstr(VERSION_XATTR)?;
        let mut v = [0u8; 32];
        // SAFETY: valid I/O context; `o` and `name` NUL-terminated; `v` has 32 writable bytes,
        // the length given.
        let n = match Errno::check(unsafe {
            (self.api.rados_getxattr)(
                self.h,
                o.as_ptr(),
                name.as_ptr(),
                v.as_mut_ptr().cast(),
                v.len(),
            )
        }) {
            Ok(n) => usize::try_from(n).unwrap_or(0),
            Err(Errno(libc::ENOENT)) => return Ok(None),
            Err(Errno(libc::ENODATA)) => return Ok(Some(0)),
            Err(e) => return Err(e),
        };
        Ok(Some(
            std::str::from_utf8(&v[..n.min(v.len())])
                .ok()
                .and_then(|t| t.trim().parse::<u64>().ok())
                .unwrap_or(0),
        ))
    }

    /// The data and version of the shared object `oid` (`None`: it does not exist). The
    /// version is read before and after the data, and the read repeated until they agree:
    /// RADOS applies each write operation whole, and versions only grow, so equal versions
    /// mean no write came in between and the data is that version's.
    pub(super) fn read_versioned(&self, oid: &str) -> Result<Option<(Vec<u8>, u64)>, Errno> {
        let o = cstr(oid)?;
        loop {
            let Some(before) = self.version_of(&o)? else {
                return Ok(None);
            };
            let mut size = 0u64;
            // SAFETY: valid I/O context; `o` NUL-terminated; `size` a valid out-pointer;
            // mtime not wanted (NULL is allowed).
            match Errno::check(unsafe {
                (self.api.rados_stat)(self.h, o.as_ptr(), &mut size, std::ptr::null_mut())
            }) {
                Err(Errno(libc::ENOENT)) => return Ok(None),
                Err(e) => return Err(e),
                Ok(_) => {}
            }
            let len = usize::try_from(size).map_err(|_| Errno(libc::EFBIG))?;
            // One byte more than the size: a longer object (rewritten meanwhile) shows as a
            // full buffer, and the versions below then differ anyway.
            let mut buf = vec![0u8; len + 1];
            // SAFETY: `buf` has `len + 1` writable bytes; librados writes at most that many.
            let n = Errno::check(unsafe {
                (self.api.rados_read)(self.h, o.as_ptr(), buf.as_mut_ptr().cast(), len + 1, 0)
            })?;
            buf.truncate(usize::try_from(n).unwrap_or(0));
            if self.version_of(&o)? == Some(before) {
                return Ok(Some((buf, before)));
            }
        }
    }

    /// Replace the data of `oid` atomically if its version is still `expect` (`None`: the
    /// object must not exist yet), making it version `expect + 1` (1 for a new object).
    /// `Ok(None)`: someone changed it first (re-read and retry); `Ok(Some(v))`: written as
    /// version `v`. The compare, the data and the version go in one RADOS write operation.
    pub(super) fn replace_versioned(
        &self,
        oid: &str,
        expect: Option<u64>,
        data: &[u8],
    ) -> Result<Option<u64>, Errno> {
        let o = cstr(oid)?;
        let name = cstr(VERSION_XATTR)?;
        let next = expect.map_or(1, |v| v + 1);
        let (old, new) = (version_text(expect.unwrap_or(0)), version_text(next));
        // SAFETY: creates an empty operation, released below on every path.
        let op = unsafe { (self.api.rados_create_write_op)() };
        if op.is_null() {
            return Err(Errno(libc::ENOMEM));
        }
        // SAFETY: `op` is a live operation; every buffer (`name`, `old`, `new`, `data`, `o`)
        // outlives `rados_write_op_operate`, which runs the operation synchronously; the
        // operation is released exactly once afterwards.
        let ret = unsafe {
            match expect {
                None => (self.api.rados_write_op_create)(op, 1, std::ptr::null()),
                Some(_) => (self.api.rados_write_op_cmpxattr)(
                    op,
                    name.as_ptr(),
                    CMPXATTR_EQ,
                    old.as_ptr().cast(),
                    old.len(),
                ),
            }
            (self.api.rados_write_op_setxattr)(op, name.as_ptr(), new.as_ptr().cast(), new.len());
            (self.api.rados_write_op_write_full)(op, data.as_ptr().cast(), data.len());
            let r =
                (self.api.rados_write_op_operate)(op, self.h, o.as_ptr(), std::ptr::null_mut(), 0);
            (self.api.rados_release_write_op)(op);
            r
        };
        match Errno::check(ret) {
            Ok(_) => Ok(Some(next)),
            // cmpxattr mismatch, or an exclusive create of an existing object.
            Err(Errno(libc::ECANCELED)) | Err(Errno(libc::EEXIST)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Watch `oid` (it must exist): `handlers` are called on librados' threads for every
    /// notification (answer with [`IoCtx::notify_ack`]) and when the watch breaks.
    pub(super) fn watch(
        self: &std::sync::Arc<Self>,
        oid: &str,
        handlers: WatchHandlers,
    ) -> Result<ObjectWatch, Errno> {
        let o = cstr(oid)?;
        let arg = Box::into_raw(Box::new(handlers));
        let mut cookie = 0u64;
        // SAFETY: valid I/O context; `o` NUL-terminated; `arg` stays valid until the `Watch`
        // is dropped (unwatch + flush first), or is freed below if the watch failed.
        let r = Errno::check(unsafe {
            (self.api.rados_watch2)(
                self.h,
                o.as_ptr(),
                &mut cookie,
                watch_cb,
                watch_err_cb,
                arg.cast(),
            )
        });
        if let Err(e) = r {
            // SAFETY: the watch was not registered; `arg` is ours alone.
            drop(unsafe { Box::from_raw(arg) });
            return Err(e);
        }
        Ok(ObjectWatch {
            io: std::sync::Arc::clone(self),
            cookie,
            handlers: arg,
        })
    }

    /// Acknowledge notification `notify_id` received by the watch `cookie` on `oid`, with a
    /// payload the notifier receives.
    pub(super) fn notify_ack(
        &self,
        oid: &str,
        notify_id: u64,
        cookie: u64,
        payload: &[u8],
    ) -> Result<(), Errno> {
        let o = cstr(oid)?;
        let len = c_int::try_from(payload.len()).map_err(|_| Errno(libc::E2BIG))?;
        // SAFETY: valid I/O context; buffers outlive the call (librados copies the payload).
        Errno::check(unsafe {
            (self.api.rados_notify_ack)(
                self.h,
                o.as_ptr(),
                notify_id,
                cookie,
                payload.as_ptr().cast(),
                len,
            )
        })
        .map(|_| ())
    }

    /// Notify every watcher of `oid` with `payload` and wait up to `timeout` (in whole
    /// seconds, rounded up) for their
    /// acknowledgements. Blocking. Watchers that did not answer are in `timeouts` (the call
    /// itself then reports ETIMEDOUT, which is not an error here).
    pub(super) fn notify(
        &self,
        oid: &str,
        payload: &[u8],
        timeout: std::time::Duration,
    ) -> Result<NotifyReply, Errno> {
        let o = cstr(oid)?;
        let len = c_int::try_from(payload.len()).map_err(|_| Errno(libc::E2BIG))?;
        // The OSD keeps the timeout in whole seconds (librados divides by 1000, and 0 means
        // its default of 30 s): round up, at least one second.
        let secs = timeout.as_millis().div_ceil(1000).max(1);
        let ms = u64::try_from(secs * 1000).unwrap_or(u64::MAX);
        let mut reply: *mut c_char = std::ptr::null_mut();
        let mut reply_len = 0usize;
        // SAFETY: valid I/O context; the payload outlives the call; `reply`/`reply_len` are
        // valid out-pointers (librados allocates the reply, freed below with
        // `rados_buffer_free`).
        let ret = unsafe {
            (self.api.rados_notify2)(
                self.h,
                o.as_ptr(),
                payload.as_ptr().cast(),
                len,
                ms,
                &mut reply,
                &mut reply_len,
            )
        };
        match Errno::check(ret) {
            Ok(_) | Err(Errno(libc::ETIMEDOUT)) => {}
            Err(e) => {
                if !reply.is_null() {
                    // SAFETY: allocated by librados for this call; freed once.
                    unsafe { (self.api.rados_buffer_free)(reply) };
                }
                return Err(e);
            }
        }
        if reply.is_null() {
            return Ok(NotifyReply::default());
        }
        let mut acks: *mut NotifyAck = std::ptr::null_mut();
        let mut nacks = 0usize;
        let mut tos: *mut NotifyTimeout = std::ptr::null_mut();
        let mut ntos = 0usize;
        // SAFETY: `reply`/`reply_len` are the buffer librados returned; the out-pointers are
        // valid; the decoded arrays are freed below with `rados_free_notify_response`.
        let dec = Errno::check(unsafe {
            (self.api.rados_decode_notify_response)(
                reply, reply_len, &mut acks, &mut nacks, &mut tos, &mut ntos,
            )
        });
        let mut out = NotifyReply::default();
        if dec.is_ok() {
            for i in 0..nacks {
                // SAFETY: `acks` points to `nacks` entries decoded by librados.
                let a = unsafe { &*acks.add(i) };
                let plen = usize::try_from(a.payload_len).unwrap_or(0);
                let payload = if a.payload.is_null() || plen == 0 {
                    Vec::new()
                } else {
                    // SAFETY: each ack's payload has `payload_len` bytes, owned by the
                    // decoded response until it is freed below.
                    unsafe { std::slice::from_raw_parts(a.payload.cast::<u8>(), plen) }.to_vec()
                };
                out.acks.push((a.notifier_id, a.cookie, payload));
            }
            for i in 0..ntos {
                // SAFETY: `tos` points to `ntos` entries decoded by librados.
                let t = unsafe { &*tos.add(i) };
                out.timeouts.push((t.notifier_id, t.cookie));
            }
            // SAFETY: the arrays came from `rados_decode_notify_response`; freed once.
            unsafe { (self.api.rados_free_notify_response)(acks, nacks, tos) };
        }
        // SAFETY: allocated by librados for this call; freed once, after decoding.
        unsafe { (self.api.rados_buffer_free)(reply) };
        dec.map(|_| out)
    }
}

/// An open image (`rbd_image_t`). Closing it (`Drop`) waits for its operations in flight.
pub(super) struct Image {
    api: &'static Api,
    h: ImageT,
    _io: std::sync::Arc<IoCtx>,
    /// Operations submitted and not yet completed.
    in_flight: std::sync::Arc<AtomicU64>,
}

// SAFETY: librbd allows concurrent calls on one image handle (QEMU submits from several
// threads); the handle is closed only in `Drop`.
unsafe impl Send for Image {}
// SAFETY: as above.
unsafe impl Sync for Image {}

impl Drop for Image {
    fn drop(&mut self) {
        // SAFETY: opened by `rbd_open*`; `rbd_close` waits for operations in flight, whose
        // callbacks do not touch the image handle.
        unsafe { (self.api.rbd_close)(self.h) };
    }
}

impl Image {
    /// `rbd_open` (or `rbd_open_read_only`) of `name`'s head. Blocking.
    pub(super) fn open(
        io: &std::sync::Arc<IoCtx>,
        name: &str,
        read_only: bool,
    ) -> Result<Image, Errno> {
        let api = io.api;
        let cname = cstr(name)?;
        let mut h: ImageT = std::ptr::null_mut();
        let f = if read_only {
            api.rbd_open_read_only
        } else {
            api.rbd_open
        };
        // SAFETY: valid I/O context; `cname` NUL-terminated; `h` a valid out-pointer; a NULL
        // snapshot name opens the head.
        Errno::check(unsafe { f(io.h, cname.as_ptr(), &mut h, std::ptr::null()) })?;
        Ok(Image {
            api,
            h,
            _io: std::sync::Arc::clone(io),
            in_flight: std::sync::Arc::new(AtomicU64::new(0)),
        })
    }

    /// Operations submitted to librbd and not yet completed.
    pub(super) fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// The image's size in bytes.
    pub(super) fn size(&self) -> Result<u64, Errno> {
        let mut n = 0u64;
        // SAFETY: open image; `n` a valid out-pointer.
        Errno::check(unsafe { (self.api.rbd_get_size)(self.h, &mut n) })?;
        Ok(n)
    }

    /// The image's feature bits (`RBD_FEATURE_*`).
    pub(super) fn features(&self) -> Result<u64, Errno> {
        let mut n = 0u64;
        // SAFETY: open image; `n` a valid out-pointer.
        Errno::check(unsafe { (self.api.rbd_get_features)(self.h, &mut n) })?;
        Ok(n)
    }

    /// `rbd_resize` (blocking: it updates the image header in the cluster).
    pub(super) fn resize(&self, size: u64) -> Result<(), Errno> {
        // SAFETY: open image.
        Errno::check(unsafe { (self.api.rbd_resize)(self.h, size) }).map(|_| ())
    }

    /// The effective value of the librbd option `key` for this image (after pool and image
    /// overrides).
    pub(super) fn config(&self, key: &str) -> Result<Option<String>, Errno> {
        let mut max: c_int = 0;
        // SAFETY: open image; with a NULL array and `max` 0 librbd only reports the number
        // of options needed (-ERANGE).
        let r = unsafe { (self.api.rbd_config_image_list)(self.h, std::ptr::null_mut(), &mut max) };
        if r < 0 && r != -libc::ERANGE {
            return Err(Errno(-r));
        }
        let n = usize::try_from(max).unwrap_or(0);
        let mut opts: Vec<ConfigOption> = (0..n)
            .map(|_| ConfigOption {
                name: std::ptr::null_mut(),
                value: std::ptr::null_mut(),
                source: 0,
            })
            .collect();
        // SAFETY: `opts` has room for `max` entries, which librbd fills with strings it
        // allocates; they are freed below with the matching cleanup call.
        Errno::check(unsafe {
            (self.api.rbd_config_image_list)(self.h, opts.as_mut_ptr(), &mut max)
        })?;
        let filled = usize::try_from(max).unwrap_or(0).min(opts.len());
        let mut found = None;
        for o in &opts[..filled] {
            if o.name.is_null() || o.value.is_null() {
                continue;
            }
            // SAFETY: non-NULL strings librbd just filled in, valid until the cleanup.
            let name = unsafe { CStr::from_ptr(o.name) };
            if name.to_bytes() == key.as_bytes() {
                // SAFETY: as above.
                found = Some(
                    unsafe { CStr::from_ptr(o.value) }
                        .to_string_lossy()
                        .into_owned(),
                );
            }
        }
        // SAFETY: frees exactly the `filled` entries librbd allocated.
        unsafe { (self.api.rbd_config_image_list_cleanup)(opts.as_mut_ptr(), max) };
        Ok(found)
    }

    /// The current owners of the image's exclusive lock (empty: none).
    pub(super) fn lock_owners(&self) -> Result<Vec<String>, Errno> {
        let mut mode: LockMode = 0;
        let mut owners: [*mut c_char; 16] = [std::ptr::null_mut(); 16];
        let mut n = owners.len();
        // SAFETY: open image; `owners` has room for `n` pointers, which librbd fills with
        // strings it allocates and the cleanup call below frees.
        let r = unsafe {
            (self.api.rbd_lock_get_owners)(self.h, &mut mode, owners.as_mut_ptr(), &mut n)
        };
        if r == -libc::ENOENT {
            return Ok(Vec::new());
        }
        Errno::check(r)?;
        let n = n.min(owners.len());
        let out = owners[..n]
            .iter()
            .filter(|p| !p.is_null())
            // SAFETY: non-NULL strings librbd just filled in, valid until the cleanup.
            .map(|&p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
            .collect();
        // SAFETY: frees the `n` strings librbd allocated.
        unsafe { (self.api.rbd_lock_get_owners_cleanup)(owners.as_mut_ptr(), n) };
        Ok(out)
    }

    /// Break `owner`'s exclusive lock; librbd blocklists the owner first
    /// (`rbd_blocklist_on_break_lock`, on by default), so it can write no more. Blocking.
    pub(super) fn lock_break(&self, owner: &str) -> Result<(), Errno> {
        let o = cstr(owner)?;
        // SAFETY: open image; `o` NUL-terminated and outlives the call.
        Errno::check(unsafe { (self.api.rbd_lock_break)(self.h, LOCK_MODE_EXCLUSIVE, o.as_ptr()) })
            .map(|_| ())
    }

    /// Take the exclusive lock and keep it (no transparent hand-over to other clients).
    /// Blocking.
    pub(super) fn lock_acquire(&self) -> Result<(), Errno> {
        // SAFETY: open image.
        Errno::check(unsafe { (self.api.rbd_lock_acquire)(self.h, LOCK_MODE_EXCLUSIVE) })
            .map(|_| ())
    }

    /// The allocated extents of `[off, off + len)` as `(offset, len, exists)` in order, from
    /// the image's own allocation data (its parent's included). Blocking.
    pub(super) fn allocation(&self, off: u64, len: u64) -> Result<Vec<(u64, u64, bool)>, Errno> {
        extern "C" fn cb(off: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int {
            // SAFETY: `arg` is the `&mut Vec` passed below, alive and not otherwise borrowed
            // while `rbd_diff_iterate2` runs (it calls back on the calling thread).
            let out = unsafe { &mut *arg.cast::<Vec<(u64, u64, bool)>>() };
            out.push((off, len as u64, exists != 0));
            0
        }
        let mut out: Vec<(u64, u64, bool)> = Vec::new();
        // SAFETY: open image; a NULL snapshot name diffs against nothing (everything that
        // exists is reported); `cb` matches the callback type and `out` outlives the call.
        Errno::check(unsafe {
            (self.api.rbd_diff_iterate2)(
                self.h,
                std::ptr::null(),
                off,
                len,
                1,
                0,
                cb,
                (&mut out as *mut Vec<(u64, u64, bool)>).cast(),
            )
        })?;
        Ok(out)
    }

    /// Call `notify` on a librbd thread whenever the image's header changes (a resize by
    /// another client, a lock hand-over, ...). It must not block or call into librbd.
    pub(super) fn watch(
        self: &std::sync::Arc<Self>,
        notify: Box<dyn Fn() + Send + Sync>,
    ) -> Result<Watch, Errno> {
        extern "C" fn cb(arg: *mut c_void) {
            // SAFETY: `arg` is the boxed closure below, freed only after `rbd_update_unwatch`
            // returned (which waits for callbacks in progress).
            let f = unsafe { &*arg.cast::<Box<dyn Fn() + Send + Sync>>() };
            f();
        }
        let ctx = Box::into_raw(Box::new(notify));
        let mut handle = 0u64;
        // SAFETY: open image; `cb` matches `rbd_update_callback_t`; `ctx` stays valid until
        // the watch is removed (`Watch::drop`).
        let r = unsafe { (self.api.rbd_update_watch)(self.h, &mut handle, cb, ctx.cast()) };
        if r < 0 {
            // SAFETY: the watch was not registered, so nothing else refers to `ctx`.
            drop(unsafe { Box::from_raw(ctx) });
            return Err(Errno(-r));
        }
        Ok(Watch {
            image: std::sync::Arc::clone(self),
            handle,
            ctx,
        })
    }

    fn completion(&self, op: Box<Op>) -> Result<(CompletionT, *mut Op), (Errno, Box<Op>)> {
        let raw = Box::into_raw(op);
        let mut c: CompletionT = std::ptr::null_mut();
        // SAFETY: `raw` is handed to librbd as the callback argument; `on_complete` takes it
        // back exactly once. `c` is a valid out-pointer.
        let r = unsafe { (self.api.rbd_aio_create_completion)(raw.cast(), on_complete, &mut c) };
        if r < 0 {
            // SAFETY: no completion exists, so the callback will never run: ours again.
            return Err((Errno(-r), unsafe { Box::from_raw(raw) }));
        }
        Ok((c, raw))
    }

    /// Submit `op` with `submit(completion, op)`; resolves to librbd's return value and the
    /// op (its buffers) once the callback ran.
    fn run(&self, mut op: Box<Op>, submit: impl FnOnce(CompletionT, &mut Op) -> isize) -> Pending {
        let (tx, rx) = oneshot::channel();
        op.done = Some(tx);
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        op.counted = Some(std::sync::Arc::clone(&self.in_flight));
        let (c, raw) = match self.completion(op) {
            Ok(x) => x,
            Err((e, op)) => return Pending::Failed(e, op),
        };
        // SAFETY: `raw` is the live op the completion owns; nothing else touches it until
        // the callback, which cannot run before the submission below returns or fails.
        let r = submit(c, unsafe { &mut *raw });
        if r < 0 {
            // SAFETY: a failed submission never calls back: release the completion and take
            // the op back.
            unsafe { (self.api.rbd_aio_release)(c) };
            // SAFETY: as above, the op is ours again.
            let op = unsafe { Box::from_raw(raw) };
            return Pending::Failed(Errno(-(r as i32)), op);
        }
        Pending::Waiting(rx)
    }

    /// Read `len` bytes at `off`.
    pub(super) fn read(&self, off: u64, len: usize) -> Pending {
        let mut op = Op::new();
        op.read = BytesMut::with_capacity(len);
        op.iov = libc::iovec {
            iov_base: op.read.as_mut_ptr().cast(),
            iov_len: len,
        };
        let (api, h) = (self.api, self.h);
        self.run(op, |c, op| {
            // SAFETY: `op.iov` points at `len` bytes of `op.read`'s allocation, which lives
            // (unmoved: it is heap memory owned by the op) until the callback.
            unsafe { (api.rbd_aio_readv)(h, &op.iov, 1, off, c) as isize }
        })
    }

    /// Write `data` at `off`; `keep` is dropped only when the write can no longer change
    /// the image.
    pub(super) fn write(&self, off: u64, data: Bytes, keep: Option<crate::Keep>) -> Pending {
        let mut op = Op::new();
        op.iov = libc::iovec {
            iov_base: data.as_ptr() as *mut c_void,
            iov_len: data.len(),
        };
        op.data = data;
        op.keep = keep;
        let (api, h) = (self.api, self.h);
        self.run(op, |c, op| {
            // SAFETY: `op.iov` points into `op.data`, kept alive by the op until the callback;
            // librbd only reads from it.
            unsafe { (api.rbd_aio_writev)(h, &op.iov, 1, off, c) as isize }
        })
    }

    /// Zero `len` bytes at `off`: `flags` 0 deallocates where it can (reads return zeros),
    /// [`ZEROES_THICK`] writes zeros.
    pub(super) fn write_zeroes(
        &self,
        off: u64,
        len: usize,
        flags: c_int,
        keep: Option<crate::Keep>,
    ) -> Pending {
        let mut op = Op::new();
        op.keep = keep;
        let (api, h) = (self.api, self.h);
        self.run(op, |c, _| {
            // SAFETY: open image, valid completion; no buffers involved.
            unsafe { (api.rbd_aio_write_zeroes)(h, off, len, c, flags, 0) as isize }
        })
    }

    /// Make every completed write durable (a no-op without the librbd cache).
    pub(super) fn flush(&self) -> Pending {
        let (api, h) = (self.api, self.h);
        self.run(Op::new(), |c, _| {
            // SAFETY: open image, valid completion.
            unsafe { (api.rbd_aio_flush)(h, c) as isize }
        })
    }

    /// Compare the image at `off` with `cmp` and write `data` (same length) only if they
    /// are equal, atomically in the cluster. A miscompare completes with `-EILSEQ`.
    pub(super) fn compare_and_write(
        &self,
        off: u64,
        cmp: Bytes,
        data: Bytes,
        keep: Option<crate::Keep>,
    ) -> Pending {
        let mut op = Op::new();
        op.cmp = cmp;
        op.data = data;
        op.keep = keep;
        let (api, h) = (self.api, self.h);
        self.run(op, |c, op| {
            let len = op.data.len().min(op.cmp.len());
            // SAFETY: both buffers are owned by the op until the callback and at least `len`
            // bytes long; `op.mismatch` is written by librbd before the callback.
            unsafe {
                (api.rbd_aio_compare_and_write)(
                    h,
                    off,
                    len,
                    op.cmp.as_ptr().cast(),
                    op.data.as_ptr().cast(),
                    c,
                    &mut op.mismatch,
                    0,
                )
            }
        })
    }
}

/// A registered header watch; removed on drop (blocking: waits for a callback in progress).
pub(super) struct Watch {
    image: std::sync::Arc<Image>,
    handle: u64,
    ctx: *mut Box<dyn Fn() + Send + Sync>,
}

// SAFETY: the closure is `Send + Sync` and only freed in `Drop`.
unsafe impl Send for Watch {}
// SAFETY: as above; `Watch` has no methods besides `Drop`.
unsafe impl Sync for Watch {}

impl Drop for Watch {
    fn drop(&mut self) {
        // SAFETY: the handle was returned by `rbd_update_watch` on this image; after
        // `rbd_update_unwatch` returns no callback runs, so the closure can be freed.
        unsafe {
            (self.image.api.rbd_update_unwatch)(self.image.h, self.handle);
            drop(Box::from_raw(self.ctx));
        }
    }
}

/// What one operation owns while librbd works on it.
pub(super) struct Op {
    done: Option<oneshot::Sender<(isize, Box<Op>)>>,
    iov: libc::iovec,
    /// A read's destination (capacity = length; the length set once filled).
    pub read: BytesMut,
    data: Bytes,
    cmp: Bytes,
    /// A compare-and-write's miscompare offset (as librbd reports it).
    pub mismatch: u64,
    keep: Option<crate::Keep>,
    /// The image's in-flight count, decremented when the op is done with.
    counted: Option<std::sync::Arc<AtomicU64>>,
}

impl Drop for Op {
    fn drop(&mut self) {
        if let Some(c) = self.counted.take() {
            c.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

// SAFETY: the raw iovec only points into buffers the op itself owns.
unsafe impl Send for Op {}

impl Op {
    fn new() -> Box<Op> {
        Box::new(Op {
            done: None,
            iov: libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            },
            read: BytesMut::new(),
            data: Bytes::new(),
            cmp: Bytes::new(),
            mismatch: 0,
            keep: None,
            counted: None,
        })
    }

    /// A finished read's data: the `ret` bytes librbd returned, zero-filled to the length
    /// asked for.
    pub(super) fn take_read(&mut self, ret: isize) -> Bytes {
        let want = self.iov.iov_len;
        let got = usize::try_from(ret)
            .unwrap_or(0)
            .min(want)
            .min(self.read.capacity());
        // SAFETY: librbd wrote `got` bytes (its return value, bounded by the buffer's
        // capacity) at the start of the buffer before completing.
        unsafe { self.read.set_len(got) };
        let mut b = std::mem::take(&mut self.read);
        b.resize(want, 0);
        b.freeze()
    }
}

extern "C" fn on_complete(c: CompletionT, arg: *mut c_void) {
    let Ok(api) = api() else { return };
    // SAFETY: `c` is the completion librbd calls back for; the return value is read before
    // the completion is released, and it is released exactly once.
    let ret = unsafe { (api.rbd_aio_get_return_value)(c) };
    // SAFETY: as above.
    unsafe { (api.rbd_aio_release)(c) };
    // SAFETY: `arg` is the op `Box::into_raw`ed at submission; the callback runs once, so
    // ownership comes back here exactly once.
    let mut op = unsafe { Box::from_raw(arg.cast::<Op>()) };
    // The range the operation held is free from now on, and the operation is no longer in
    // flight.
    op.keep = None;
    if let Some(c) = op.counted.take() {
        c.fetch_sub(1, Ordering::Relaxed);
    }
    if let Some(tx) = op.done.take() {
        // Nobody waiting (the task was aborted): the op is dropped here, buffers with it.
        let _ = tx.send((ret, op));
    }
}

/// An operation in flight, or one that could not be submitted.
pub(super) enum Pending {
    Waiting(oneshot::Receiver<(isize, Box<Op>)>),
    Failed(Errno, Box<Op>),
}

impl Pending {
    /// Wait for the result: librbd's return value (negative: an errno) and the op.
    pub(super) async fn wait(self) -> (isize, Box<Op>) {
        match self {
            Pending::Waiting(rx) => match rx.await {
                Ok(x) => x,
                // The sender is only dropped unsent if the library could not be loaded in
                // the callback, which cannot happen once an op was submitted.
                Err(_) => (-(libc::EIO as isize), Op::new()),
            },
            Pending::Failed(e, op) => (-(e.0 as isize), op),
        }
    }
}

#[cfg(test)]
mod headers;
