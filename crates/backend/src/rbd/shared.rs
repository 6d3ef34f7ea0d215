//! Objects several gateways share in a RADOS pool: data replaced atomically with
//! compare-and-set on a version, watch/notify between the gateways, and fencing
//! (blocklisting) of a gateway that does not answer. These are the primitives a cluster of
//! ironsan nodes serving one image builds on (docs/ARCHITECTURE.md, "Several gateways").
//!
//! Every call blocks on the cluster (a round trip to an OSD or a monitor): call them from a
//! blocking thread (`tokio::task::spawn_blocking`), never on a connection's task.

use super::ffi::{self, Cluster, IoCtx, WatchHandlers};
pub use super::ffi::{Notification, NotifyReply};
use super::RadosClient;
use std::sync::Arc;
use std::time::Duration;

/// A pool of shared objects on a connected cluster.
pub struct SharedPool {
    cluster: Arc<Cluster>,
    io: Arc<IoCtx>,
    pool: String,
}

impl std::fmt::Debug for SharedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedPool")
            .field("pool", &self.pool)
            .field("instance_id", &self.cluster.instance_id())
            .finish_non_exhaustive()
    }
}

/// An object's data and the version it had.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned {
    pub data: Vec<u8>,
    pub version: u64,
}

/// A registered watch; dropping it unregisters it (and waits until no callback runs).
#[derive(Debug)]
pub struct Watcher {
    watch: ffi::ObjectWatch,
}

impl std::fmt::Debug for ffi::ObjectWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectWatch")
            .field("cookie", &self.cookie())
            .finish()
    }
}

impl Watcher {
    /// The watch's cookie, as notifications and acknowledgements name it.
    pub fn cookie(&self) -> u64 {
        self.watch.cookie()
    }

    /// Whether the OSD still has the watch: the time since it last confirmed it, or why it
    /// broke (notifies may have been missed since).
    pub fn check(&self) -> Result<Duration, SharedError> {
        self.watch
            .check()
            .map(Duration::from_millis)
            .map_err(|e| err("rados_watch_check", e))
    }
}

/// A failed call on shared objects: what was being done and the cluster's error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedError {
    pub context: String,
    /// The errno librados returned (`None`: not an errno, e.g. a refused connection).
    pub errno: Option<i32>,
}

impl SharedError {
    /// The cluster blocklisted this client (`ESHUTDOWN`): it can do nothing more with it.
    pub fn fenced(&self) -> bool {
        self.errno == Some(libc::ESHUTDOWN)
    }
}

impl std::fmt::Display for SharedError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.errno {
            Some(e) => write!(f, "{}: {}", self.context, ffi::Errno(e)),
            None => f.write_str(&self.context),
        }
    }
}

impl std::error::Error for SharedError {}

impl From<String> for SharedError {
    fn from(context: String) -> Self {
        SharedError {
            context,
            errno: None,
        }
    }
}

fn err(what: &str, e: ffi::Errno) -> SharedError {
    SharedError {
        context: what.to_string(),
        errno: Some(e.0),
    }
}

impl SharedPool {
    /// Connect as `client.ID` with `conf` (`None`: librados' own search) and open `pool`.
    pub fn connect(conf: Option<&str>, id: &str, pool: &str) -> Result<SharedPool, SharedError> {
        let cluster = Arc::new(super::connect_client(
            &format!("pool {pool}"),
            conf.map(std::path::Path::new),
            id,
            false,
        )?);
        let io = cluster
            .pool(pool, None)
            .map(Arc::new)
            .map_err(|e| err(&format!("pool {pool}"), e))?;
        Ok(SharedPool {
            cluster,
            io,
            pool: pool.to_string(),
        })
    }

    /// The connection, for the RBD LUNs this node serves through the same client (so that
    /// fencing this node's address fences its writes to the images too).
    pub fn client(&self) -> RadosClient {
        RadosClient(Arc::clone(&self.cluster))
    }

    /// This client's address (`IP:PORT/NONCE`): what another node blocklists to fence it.
    pub fn address(&self) -> Result<String, SharedError> {
        self.cluster.addr().map_err(|e| err("rados_getaddrs", e))
    }

    /// This client's instance id (the notifier id others see).
    pub fn instance_id(&self) -> u64 {
        self.cluster.instance_id()
    }

    /// The object `oid` (`None`: it does not exist).
    pub fn read(&self, oid: &str) -> Result<Option<Versioned>, SharedError> {
        self.io
            .read_versioned(oid)
            .map(|o| o.map(|(data, version)| Versioned { data, version }))
            .map_err(|e| err(&format!("reading {}/{oid}", self.pool), e))
    }

    /// Replace `oid` with `data` if it is still at version `expect` (`None`: create it, it
    /// must not exist). `Ok(None)`: another writer came first.
    pub fn replace(
        &self,
        oid: &str,
        expect: Option<u64>,
        data: &[u8],
    ) -> Result<Option<u64>, SharedError> {
        self.io
            .replace_versioned(oid, expect, data)
            .map_err(|e| err(&format!("writing {}/{oid}", self.pool), e))
    }

    /// Read-modify-write `oid` until the compare-and-set succeeds (at most `attempts`
    /// times): `change` gets the current data (`None`: no object yet) and returns the new
    /// data, or `None` to leave the object as it is. Returns what was written (`None`:
    /// `change` left the object as it was).
    pub fn update(
        &self,
        oid: &str,
        attempts: usize,
        mut change: impl FnMut(Option<&[u8]>) -> Option<Vec<u8>>,
    ) -> Result<Option<Versioned>, SharedError> {
        for _ in 0..attempts.max(1) {
            let cur = self.read(oid)?;
            let Some(new) = change(cur.as_ref().map(|c| c.data.as_slice())) else {
                return Ok(None);
            };
            if let Some(version) = self.replace(oid, cur.as_ref().map(|c| c.version), &new)? {
                return Ok(Some(Versioned { data: new, version }));
            }
        }
        Err(format!(
            "{}/{oid}: {attempts} concurrent updates in a row, giving up",
            self.pool
        )
        .into())
    }

    /// Watch `oid` (it must exist). `on_notify` runs on librados' threads for each
    /// notification and must answer it with [`SharedPool::ack`] (the notifier waits for
    /// that); `on_error` runs when the watch breaks (the node may have missed notifies and
    /// must not trust its copy of the shared state until it has watched and read again).
    pub fn watch(
        &self,
        oid: &str,
        on_notify: impl Fn(Notification) + Send + Sync + 'static,
        on_error: impl Fn(i32) + Send + Sync + 'static,
    ) -> Result<Watcher, SharedError> {
        let handlers = WatchHandlers {
            on_notify: Box::new(on_notify),
            on_error: Box::new(on_error),
        };
        self.io
            .watch(oid, handlers)
            .map(|watch| Watcher { watch })
            .map_err(|e| err(&format!("watching {}/{oid}", self.pool), e))
    }

    /// Answer notification `n` on `oid` with `payload`.
    pub fn ack(&self, oid: &str, n: &Notification, payload: &[u8]) -> Result<(), SharedError> {
        self.io
            .notify_ack(oid, n.notify_id, n.cookie, payload)
            .map_err(|e| err(&format!("acknowledging a notify on {}/{oid}", self.pool), e))
    }

    /// Notify every watcher of `oid` and wait up to `timeout` for their answers.
    pub fn notify(
        &self,
        oid: &str,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<NotifyReply, SharedError> {
        self.io
            .notify(oid, payload, timeout)
            .map_err(|e| err(&format!("notifying {}/{oid}", self.pool), e))
    }

    /// Fence the client at `address` ([`SharedPool::address`] of another node): once this
    /// returns, the OSDs refuse its operations for `expire` (0: the cluster's default).
    pub fn blocklist(&self, address: &str, expire: Duration) -> Result<(), SharedError> {
        let secs = u32::try_from(expire.as_secs()).unwrap_or(u32::MAX);
        self.cluster
            .blocklist_add(address, secs)
            .map_err(|e| err(&format!("blocklisting {address}"), e))
    }
}
