//! The listening portals: binding, adding, removing and retagging them at run time, the
//! published portal list (SendTargets, `ctl portals`), and the accept loop that hands each
//! connection to the iSCSI driver (`conn::run`).

use super::*;
use crate::control::ControlError;

/// Connections beyond `max_connections` accepted only to answer their login with 0302.
const OVERFLOW_CONNECTIONS: usize = 16;

/// Counts a connection in `Shared::connections` while it lives.
struct ConnGuard(Arc<Shared>);

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A listening portal. The socket is owned here (through the one long-lived strong `Arc`);
/// its accept loop holds only a `Weak` and upgrades it while it polls, so dropping this
/// entry closes the socket at once (see [`Listening::close`]) without waiting for the loop.
pub(crate) struct Listening {
    /// The address as asked for (port 0: any free port).
    requested: SocketAddr,
    /// The address actually bound.
    addr: SocketAddr,
    /// The portal group tag; read by the accept loop for each connection it accepts.
    tag: Arc<AtomicU16>,
    /// Whose connections these are.
    transport: Transport,
    listener: Arc<TcpListener>,
    /// Wakes the accept loop to end.
    stop: Arc<Notify>,
    /// Whether its accept loop runs (false between `Server::bind` and `Server::run`).
    started: bool,
}

/// The listening portals, in the order they were bound or added.
pub(crate) struct Listeners {
    list: Vec<Listening>,
    /// Where accept loops run: set by `Server::run`.
    handle: Option<tokio::runtime::Handle>,
    /// Shutdown has begun: every socket is closed and no portal may be added.
    closed: bool,
}

impl Listeners {
    /// The portals bound at start, not yet accepting.
    pub(crate) fn new(list: Vec<Listening>) -> Self {
        Listeners {
            list,
            handle: None,
            closed: false,
        }
    }

    /// Refuse `addr` if a portal (other than the `except`-th) is bound to it or was asked
    /// for it. Port 0 asks for a new free port: never a duplicate.
    fn refuse_duplicate(
        &self,
        addr: SocketAddr,
        except: Option<usize>,
    ) -> Result<(), ControlError> {
        if addr.port() == 0 {
            return Ok(());
        }
        match self
            .list
            .iter()
            .enumerate()
            .find(|(j, p)| Some(*j) != except && (p.addr == addr || p.requested == addr))
        {
            Some((_, p)) => Err(ControlError::exists(format!(
                "portal {addr} already exists (group {})",
                p.tag.load(Ordering::Relaxed)
            ))),
            None => Ok(()),
        }
    }

    /// The runtime a socket for `addr` is registered with: the server's (or the caller's
    /// before `run`).
    fn runtime_handle(&self, addr: SocketAddr) -> Result<tokio::runtime::Handle, ControlError> {
        match self.handle.clone() {
            Some(h) => Ok(h),
            None => tokio::runtime::Handle::try_current().map_err(|_| {
                ControlError::unsupported(format!("cannot listen on {addr}: no tokio runtime"))
            }),
        }
    }
}

impl Listening {
    /// Bind `addr` as tokio's `TcpListener::bind` does (SO_REUSEADDR, backlog 1024), but
    /// synchronously, so the control socket's (blocking) commands can add portals. Needs a
    /// tokio runtime context (the socket is registered with its reactor).
    pub(crate) fn bind(
        addr: SocketAddr,
        tag: u16,
        transport: Transport,
    ) -> std::io::Result<Listening> {
        let err = |e: std::io::Error| {
            std::io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}"))
        };
        let sock = match addr {
            SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
            SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
        }
        .map_err(err)?;
        sock.set_reuseaddr(true).map_err(err)?;
        sock.bind(addr).map_err(err)?;
        let listener = sock.listen(1024).map_err(err)?;
        let bound = listener.local_addr().map_err(err)?;
        Ok(Listening {
            requested: addr,
            addr: bound,
            tag: Arc::new(AtomicU16::new(tag)),
            transport,
            listener: Arc::new(listener),
            stop: Arc::new(Notify::new()),
            started: false,
        })
    }

    pub(crate) fn portal(&self) -> Portal {
        Portal {
            addr: self.addr,
            tag: self.tag.load(Ordering::Relaxed),
        }
    }

    fn start(&mut self, handle: &tokio::runtime::Handle, shared: &Arc<Shared>) {
        if !self.started {
            self.started = true;
            handle.spawn(accept_loop(
                Arc::downgrade(&self.listener),
                Arc::clone(&self.tag),
                self.transport,
                Arc::clone(&self.stop),
                Arc::clone(shared),
            ));
        }
    }

    /// Stop accepting and close the socket now: when this returns, connection attempts are
    /// refused. Connections already accepted are not touched.
    fn close(self) {
        self.stop.notify_one();
        // The accept loop holds a strong reference only inside one (non-blocking) poll; wait
        // those microseconds out so the socket is closed here, not a moment later.
        let deadline = std::time::Instant::now() + Duration::from_secs(1);
        let mut arc = self.listener;
        loop {
            match Arc::try_unwrap(arc) {
                Ok(listener) => {
                    drop(listener);
                    return;
                }
                Err(a) if std::time::Instant::now() < deadline => {
                    arc = a;
                    std::thread::yield_now();
                }
                // Never expected: the loop closes it when its poll returns.
                Err(_) => return,
            }
        }
    }
}

/// Closes every portal when dropped (`Server::run` ending or being dropped).
pub(crate) struct StopAccepting(pub(crate) Arc<Shared>);

impl Drop for StopAccepting {
    fn drop(&mut self) {
        self.0.stop_accepting();
    }
}

/// A portal as `control::Control::portal_list` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortalInfo {
    /// The address actually bound.
    pub addr: SocketAddr,
    pub tag: u16,
    /// The address as configured or added (differs from `addr` for port 0).
    pub requested: SocketAddr,
    /// The protocol it speaks.
    pub transport: Transport,
}

impl Shared {
    /// Publish the portal list (SendTargets, `ctl portals`) after a change of `l`.
    fn sync_portals(&self, l: &Listeners) {
        // What SendTargets announces: the iSCSI portals.
        *lock(&self.portals) = l
            .list
            .iter()
            .filter(|p| p.transport == Transport::Iscsi)
            .map(Listening::portal)
            .collect();
        self.refresh_alua();
    }

    /// `Server::run`: start every accept loop on this runtime; portals added from now on
    /// start at once.
    pub(crate) fn start_accepting(self: &Arc<Self>, handle: tokio::runtime::Handle) {
        let mut l = lock(&self.listeners);
        for p in &mut l.list {
            p.start(&handle, self);
        }
        l.handle = Some(handle);
    }

    /// Shutdown: close every listening socket. The published portal list is left as it was
    /// (SendTargets during the grace time answers as before).
    pub(crate) fn stop_accepting(&self) {
        let list = {
            let mut l = lock(&self.listeners);
            l.closed = true;
            l.handle = None;
            std::mem::take(&mut l.list)
        };
        for p in list {
            p.close();
        }
    }

    pub(crate) fn portal_list(&self) -> Vec<PortalInfo> {
        lock(&self.listeners)
            .list
            .iter()
            .map(|p| PortalInfo {
                addr: p.addr,
                tag: p.tag.load(Ordering::Relaxed),
                requested: p.requested,
                transport: p.transport,
            })
            .collect()
    }

    /// The listeners, locked to bind a portal of group `tag`: refused for tag 0 (reserved)
    /// and once shutdown has begun.
    fn listeners_to_bind(
        &self,
        tag: u16,
    ) -> Result<std::sync::MutexGuard<'_, Listeners>, ControlError> {
        if tag == 0 {
            return Err(ControlError::invalid("portal group tag 0 is reserved"));
        }
        let l = lock(&self.listeners);
        if l.closed {
            return Err(ControlError::busy("the server is shutting down"));
        }
        Ok(l)
    }

    /// Bind `addr` as a portal of group `tag` and start accepting on it (if the server runs).
    pub(crate) fn add_portal(
        self: &Arc<Self>,
        addr: SocketAddr,
        tag: u16,
    ) -> Result<Portal, ControlError> {
        let mut l = self.listeners_to_bind(tag)?;
        l.refuse_duplicate(addr, None)?;
        let handle = l.runtime_handle(addr)?;
        let mut p = {
            let _in_runtime = handle.enter();
            Listening::bind(addr, tag, Transport::Iscsi).map_err(|e| e.to_string())?
        };
        if l.handle.is_some() {
            p.start(&handle, self);
        }
        let portal = p.portal();
        l.list.push(p);
        self.sync_portals(&l);
        drop(l);
        tracing::info!(portal = %portal.addr, tag, "portal added");
        Ok(portal)
    }

    /// Stop accepting on the portal bound to `addr` and close its socket. Sessions that came
    /// in through it keep running. Refused for the last portal, and for the last portal of a
    /// group that a target is restricted to (its `portal_groups`).
    pub(crate) fn remove_portal(&self, addr: SocketAddr) -> Result<Portal, ControlError> {
        let mut l = lock(&self.listeners);
        let i = l.list.iter().position(|p| p.addr == addr).ok_or_else(|| {
            ControlError::not_found(format!("no portal {addr} (ironsan ctl portals lists them)"))
        })?;
        if l.list.len() == 1 {
            return Err(ControlError::busy(format!(
                "{addr} is the last portal; add another one first"
            )));
        }
        self.check_group_keeps_a_portal(&l, i)?;
        let p = l.list.remove(i);
        self.sync_portals(&l);
        drop(l);
        let portal = p.portal();
        p.close();
        tracing::info!(portal = %portal.addr, tag = portal.tag, "portal removed");
        Ok(portal)
    }

    /// Refuse to take portal `i` out of its group if it is the group's last portal and a
    /// target is restricted to groups that include it (it would become unreachable there,
    /// and a saved configuration would name a group that does not exist).
    fn check_group_keeps_a_portal(&self, l: &Listeners, i: usize) -> Result<(), ControlError> {
        let (addr, tag) = (l.list[i].addr, l.list[i].tag.load(Ordering::Relaxed));
        let last_of_group = !l
            .list
            .iter()
            .enumerate()
            .any(|(j, p)| j != i && p.tag.load(Ordering::Relaxed) == tag);
        if !last_of_group {
            return Ok(());
        }
        let rt = self.runtime();
        let mut named: Vec<&str> = rt
            .portal_groups
            .iter()
            .filter(|(t, tags)| tags.contains(&tag) && rt.targets.contains_key(*t))
            .map(|(t, _)| t.as_str())
            .collect();
        if named.is_empty() {
            return Ok(());
        }
        named.sort_unstable();
        Err(ControlError::busy(format!(
            "{addr} is the last portal of group {tag}, which {} name(s) in portal_groups; change that first (ironsan ctl apply)",
            named.join(", ")
        )))
    }

    /// Close the portal bound to `old` and listen on `new` (group `tag`) in its place, for an
    /// address that cannot be bound while `old` listens (127.0.0.1:3260 → 0.0.0.0:3260). If
    /// `new` cannot be bound, `old` is bound again and the error returned.
    pub(crate) fn replace_portal(
        self: &Arc<Self>,
        old: SocketAddr,
        new: SocketAddr,
        tag: u16,
    ) -> Result<Portal, ControlError> {
        let mut l = self.listeners_to_bind(tag)?;
        let i = l
            .list
            .iter()
            .position(|p| p.addr == old)
            .ok_or_else(|| ControlError::not_found(format!("no portal {old}")))?;
        l.refuse_duplicate(new, Some(i))?;
        let old_tag = l.list[i].tag.load(Ordering::Relaxed);
        if old_tag != tag {
            self.check_group_keeps_a_portal(&l, i)?;
        }
        let handle = l.runtime_handle(new)?;
        let _in_runtime = handle.enter();
        let started = l.handle.is_some();
        let gone = l.list.remove(i);
        let old_requested = gone.requested;
        let transport = gone.transport;
        gone.close();
        let (mut p, result) = match Listening::bind(new, tag, transport) {
            Ok(p) => (p, Ok(())),
            Err(e) => match Listening::bind(old, old_tag, transport) {
                Ok(mut back) => {
                    back.requested = old_requested;
                    (back, Err(e.to_string()))
                }
                Err(e2) => {
                    self.sync_portals(&l);
                    return Err(ControlError::failed(format!(
                        "{e}; and {old} could not be bound again: {e2}"
                    )));
                }
            },
        };
        if started {
            p.start(&handle, self);
        }
        let portal = p.portal();
        l.list.insert(i, p);
        self.sync_portals(&l);
        drop(l);
        result?;
        tracing::info!(old = %old, portal = %portal.addr, tag, "portal replaced");
        Ok(portal)
    }

    /// Move the portal bound to `addr` to group `tag`: connections accepted from now on get
    /// the new tag, those already accepted keep theirs.
    pub(crate) fn set_portal_tag(&self, addr: SocketAddr, tag: u16) -> Result<(), ControlError> {
        if tag == 0 {
            return Err(ControlError::invalid("portal group tag 0 is reserved"));
        }
        let l = lock(&self.listeners);
        let p = l
            .list
            .iter()
            .find(|p| p.addr == addr)
            .ok_or_else(|| ControlError::not_found(format!("no portal {addr}")))?;
        let old = p.tag.swap(tag, Ordering::Relaxed);
        self.sync_portals(&l);
        drop(l);
        tracing::info!(portal = %addr, old, tag, "portal moved to another group");
        Ok(())
    }
}

/// Accept on one portal until it is removed (its socket dropped or `stop` notified) or the
/// task is dropped.
async fn accept_loop(
    listener: Weak<TcpListener>,
    tag: Arc<AtomicU16>,
    transport: Transport,
    stop: Arc<Notify>,
    shared: Arc<Shared>,
) {
    loop {
        // The strong reference lives only inside the poll (see `Listening::close`).
        let accept = std::future::poll_fn(|cx| match listener.upgrade() {
            Some(l) => l.poll_accept(cx).map(Some),
            None => std::task::Poll::Ready(None),
        });
        let accepted = tokio::select! {
            biased;
            _ = stop.notified() => return,
            r = accept => r,
        };
        match accepted {
            None => return,
            Some(Ok((stream, peer))) => {
                // Beyond max_connections a few more are served only to fail their login with
                // 0302; past that, close at once so descriptors stay bounded.
                let open = shared.connections.fetch_add(1, Ordering::Relaxed);
                let guard = ConnGuard(Arc::clone(&shared));
                if open
                    >= shared
                        .cfg
                        .limits
                        .max_connections
                        .saturating_add(OVERFLOW_CONNECTIONS)
                {
                    tracing::warn!(%peer, "connection limit reached; closing");
                    drop(stream);
                    drop(guard);
                    continue;
                }
                let _ = stream.set_nodelay(true);
                let over = open >= shared.cfg.limits.max_connections;
                let tag = tag.load(Ordering::Relaxed);
                tokio::spawn(async move {
                    match transport {
                        Transport::Iscsi => {
                            conn::run(stream, peer, tag, Arc::clone(&guard.0), over).await
                        }
                    }
                    drop(guard);
                });
            }
            Some(Err(e)) => {
                // EMFILE and friends: back off rather than spin.
                tracing::warn!("accept failed: {e}");
                tokio::select! {
                    _ = stop.notified() => return,
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
            }
        }
    }
}
