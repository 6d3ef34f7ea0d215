//! A node's lease on its right to write storage that other nodes write too (a cluster of
//! gateways serving one RBD image; docs/ARCHITECTURE.md, "Several gateways on one image").
//!
//! The cluster agent renews it while the other nodes can see this node alive and it has shown
//! that none of them fenced it; a backend with a lease hands no write to the storage once
//! the lease has lapsed (the operation fails with [`BackendError::Suspended`]), so commands
//! that waited inside this process through a pause, a stall or a partition are never
//! submitted late. The check is one atomic load and one clock read.
//!
//! [`BackendError::Suspended`]: crate::BackendError::Suspended

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The process-wide zero of the nanosecond clock leases are kept in.
fn base() -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(Instant::now)
}

fn nanos(t: Instant) -> u64 {
    u64::try_from(t.saturating_duration_since(base()).as_nanos()).unwrap_or(u64::MAX)
}

/// Valid until an instant (lapsed when made, until first renewed).
#[derive(Debug, Default)]
pub struct Lease {
    /// Nanoseconds since [`base`] until which the lease holds; 0: lapsed.
    until: AtomicU64,
}

/// Two leases are equal when they are the same lease (as two RBD LUNs of one node share it).
impl PartialEq for Lease {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}
impl Eq for Lease {}

impl Lease {
    /// A lapsed lease.
    pub fn new() -> Lease {
        let _ = base();
        Lease::default()
    }

    /// Valid until `t` (never shortened by a renewal that arrives late: `t` earlier than the
    /// current end leaves it).
    pub fn renew_until(&self, t: Instant) {
        self.until.fetch_max(nanos(t), Ordering::AcqRel);
    }

    /// Valid until `t` exactly (`None`: lapsed), whether that is later or earlier than the
    /// current end.
    pub fn set(&self, t: Option<Instant>) {
        self.until
            .store(t.map_or(0, |t| nanos(t).max(1)), Ordering::Release);
    }

    /// Valid until changed.
    pub fn set_forever(&self) {
        self.until.store(u64::MAX, Ordering::Release);
    }

    /// Lapsed now, whatever its end was.
    pub fn lapse(&self) {
        self.until.store(0, Ordering::Release);
    }

    /// Whether it holds now.
    pub fn valid(&self) -> bool {
        nanos(Instant::now()) < self.until.load(Ordering::Acquire)
    }

    /// How long it still holds (`None`: lapsed).
    pub fn remaining(&self) -> Option<Duration> {
        let (now, until) = (nanos(Instant::now()), self.until.load(Ordering::Acquire));
        (now < until).then(|| Duration::from_nanos(until - now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lapsed_until_renewed_and_never_shortened_by_a_late_renewal() {
        let l = Lease::new();
        assert!(!l.valid() && l.remaining().is_none());
        let now = Instant::now();
        l.renew_until(now + Duration::from_secs(60));
        assert!(l.valid());
        l.renew_until(now + Duration::from_secs(1));
        assert!(l.remaining().unwrap() > Duration::from_secs(30));
        l.lapse();
        assert!(!l.valid());
        l.renew_until(now);
        assert!(!l.valid(), "an end in the past is no renewal");
        l.set_forever();
        assert!(l.valid());
        l.set(Some(now));
        assert!(!l.valid(), "set may shorten");
        l.set(None);
        assert!(!l.valid());
    }
}
