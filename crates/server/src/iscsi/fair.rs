//! The connection fairness control: the connections of one session (MC/S) move data in equal
//! shares when they compete for a line.
//!
//! TCP flows that share a bottleneck do not share it evenly: the one that got the larger
//! congestion window keeps it, and the others' commands take longer (the classic study of
//! several connections per session saw shares from 0.4 to 1 of the fastest). The target
//! decides when it reads a connection's Data-Out and when it sends its Data-In (and so when
//! the next R2T and the next command come), so it can hold back the connection that is ahead:
//!
//! * every connection of the session counts the bytes it moved (received + sent);
//! * before it reads more data (the reader, after a PDU that carried data) or sends more (the
//!   writer, before a batch with data), a connection that is more than [`QUANTUM`] bytes ahead
//!   of the slowest *busy* connection of its session (one with commands in flight) waits, in
//!   1 ms steps, at most [`MAX_WAIT`] per turn;
//! * a connection that falls more than [`CAP`] behind (it was idle, or joined late) is lifted
//!   to that distance, so idle time earns no credit and a late joiner is no burden.
//!
//! Connections of one session that do not compete for one line (separate lines, or loopback
//! where the CPU is the limit) lose little: the slowest busy one keeps pace with the others,
//! and nobody waits more than [`MAX_WAIT`]. A session of one connection never looks at it.

use crate::counters::ConnStats;
use crate::counters::TxStats;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// How far (bytes) a connection may get ahead of the slowest busy one of its session.
pub const QUANTUM: u64 = 1 << 20;
/// How far one may fall behind before it is lifted.
pub const CAP: u64 = 4 * QUANTUM;
/// The longest a connection waits for the others per turn (so a stuck one holds nobody).
pub const MAX_WAIT: Duration = Duration::from_millis(50);
const STEP: Duration = Duration::from_millis(1);

/// One connection's account.
#[derive(Debug)]
pub struct Member {
    stats: Arc<ConnStats>,
    tx: Arc<TxStats>,
    /// Added to the bytes moved: a lifted or late connection's head start.
    base: AtomicU64,
}

impl Member {
    fn level(&self) -> u64 {
        self.stats.rx_bytes.load(Relaxed) + self.tx.bytes.load(Relaxed) + self.base.load(Relaxed)
    }
    fn busy(&self) -> bool {
        self.stats.in_flight.load(Relaxed) > 0
    }
}

/// The accounts of one session's connections.
#[derive(Debug)]
pub struct Shares {
    on: bool,
    count: AtomicUsize,
    members: RwLock<Vec<Arc<Member>>>,
}

impl Shares {
    pub fn new(on: bool) -> Self {
        Shares {
            on,
            count: AtomicUsize::new(0),
            members: RwLock::new(Vec::new()),
        }
    }

    /// A connection joins: its account starts level with the busiest one.
    pub fn join(self: &Arc<Self>, stats: Arc<ConnStats>, tx: Arc<TxStats>) -> Pacer {
        let member = Arc::new(Member {
            stats,
            tx,
            base: AtomicU64::new(0),
        });
        let mut m = self.members.write().unwrap_or_else(|p| p.into_inner());
        let top = m.iter().map(|x| x.level()).max().unwrap_or(0);
        member
            .base
            .store(top.saturating_sub(member.level()), Relaxed);
        m.push(Arc::clone(&member));
        self.count.store(m.len(), Relaxed);
        Pacer {
            shares: Arc::clone(self),
            me: member,
        }
    }

    fn leave(&self, me: &Arc<Member>) {
        let mut m = self.members.write().unwrap_or_else(|p| p.into_inner());
        m.retain(|x| !Arc::ptr_eq(x, me));
        self.count.store(m.len(), Relaxed);
    }
}

/// A connection's handle on its session's shares; leaving the session drops it.
#[derive(Debug)]
pub struct Pacer {
    shares: Arc<Shares>,
    me: Arc<Member>,
}

impl Drop for Pacer {
    fn drop(&mut self) {
        self.shares.leave(&self.me);
    }
}

impl Pacer {
    /// The connection has stopped for good though something still holds this handle (its
    /// writer, kept for a TASK REASSIGN at ErrorRecoveryLevel 2): it leaves the shares now,
    /// so the others do not wait for it. Leaving again (on drop) is harmless.
    pub fn retire(&self) {
        self.shares.leave(&self.me);
    }

    /// Whether the control may act at all (it is on, and the session has several
    /// connections): a relaxed load or two.
    pub fn active(&self) -> bool {
        self.shares.on && self.shares.count.load(Relaxed) > 1
    }

    /// This connection is more than [`QUANTUM`] ahead of the slowest busy connection of its
    /// session. Lifts the ones more than [`CAP`] behind it on the way.
    pub fn ahead(&self) -> bool {
        if !self.active() {
            return false;
        }
        let mine = self.me.level();
        let m = self
            .shares
            .members
            .read()
            .unwrap_or_else(|p| p.into_inner());
        let mut slowest = None::<u64>;
        for other in m.iter().filter(|x| !Arc::ptr_eq(x, &self.me) && x.busy()) {
            let mut level = other.level();
            if level + CAP < mine {
                other.base.fetch_add(mine - CAP - level, Relaxed);
                level = mine - CAP;
            }
            slowest = Some(slowest.map_or(level, |s| s.min(level)));
        }
        slowest.is_some_and(|s| mine > s + QUANTUM)
    }

    /// Wait while [`Pacer::ahead`], at most [`MAX_WAIT`].
    pub async fn wait_turn(&self) {
        let mut waited = Duration::ZERO;
        while waited < MAX_WAIT && self.ahead() {
            tokio::time::sleep(STEP).await;
            waited += STEP;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(shares: &Arc<Shares>) -> (Pacer, Arc<ConnStats>, Arc<TxStats>) {
        let (s, t) = (Arc::new(ConnStats::default()), Arc::new(TxStats::default()));
        (shares.join(Arc::clone(&s), Arc::clone(&t)), s, t)
    }

    #[test]
    fn the_connection_ahead_of_a_busy_one_waits_and_idle_time_earns_no_credit() {
        let shares = Arc::new(Shares::new(true));
        let (a, sa, _) = member(&shares);
        assert!(!a.active(), "alone: the control does nothing");
        let (b, sb, tb) = member(&shares);
        assert!(a.active());
        sa.rx_bytes.store(QUANTUM + 1, Relaxed);
        // B is idle: A waits for nobody.
        assert!(!a.ahead());
        sb.in_flight.store(1, Relaxed);
        assert!(a.ahead(), "B is busy and A is a quantum ahead");
        tb.bytes.store(2, Relaxed);
        assert!(!a.ahead(), "B caught up to within a quantum");
        // A races on while B is slow: B is lifted to CAP behind, no further.
        sa.rx_bytes.store(100 * QUANTUM, Relaxed);
        assert!(a.ahead());
        assert_eq!(b.me.level(), 100 * QUANTUM - CAP);
        drop(b);
        assert!(!a.active(), "B left");
    }

    #[test]
    fn off_means_never_ahead() {
        let shares = Arc::new(Shares::new(false));
        let (a, sa, _) = member(&shares);
        let (_b, sb, _) = member(&shares);
        sa.rx_bytes.store(10 * QUANTUM, Relaxed);
        sb.in_flight.store(1, Relaxed);
        assert!(!a.ahead());
    }

    #[test]
    fn a_late_joiner_starts_level() {
        let shares = Arc::new(Shares::new(true));
        let (a, sa, _) = member(&shares);
        sa.rx_bytes.store(50 * QUANTUM, Relaxed);
        let (b, sb, _) = member(&shares);
        sb.in_flight.store(1, Relaxed);
        assert!(!a.ahead(), "B joined level with A");
        assert!(!b.ahead());
    }
}
