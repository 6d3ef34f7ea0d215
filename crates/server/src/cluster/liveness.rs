//! The liveness rules of a cluster node, with no I/O: whose lease holds, who is to be
//! fenced, and whether this node may start a write (docs/ARCHITECTURE.md, "Several gateways
//! on one image", "Leases and fencing"). The cluster agent (`cluster/mod.rs`) feeds it what
//! RADOS told it (the members and fenced addresses it read, the answers to its pings) with
//! the time, and carries out what it decides (fencing, publishing the write gate).
//!
//! * **A peer's lease.** A ping sent at `s` that a peer answered makes the peer *alive*
//!   until `s + lease` (the answer is proof it was alive at some time after `s`, with no
//!   write older than `lease` in hand: it does not answer otherwise). Once a peer's lease has
//!   run out it is *suspect* for good: a later answer does not bring it back; it is fenced,
//!   and only a new instance (a new address) is a member again.
//! * **Pending.** A peer this node has not heard from since it joined, since the peer
//!   registered anew, or since this node's own lease came back after lapsing, is *pending*:
//!   not alive until it answers a ping sent after that moment, suspect if it has not within
//!   one lease.
//! * **The write gate** is open while every member that is not fenced is alive; it closes
//!   at the first moment a peer's lease runs out (no event needed: the data path compares
//!   the end with its clock) and while any peer is pending.
//! * **This node's lease** runs until `lease` after the earlier of the last ping it saw its
//!   own answer to and the last read of the cluster object that showed it unfenced. When it
//!   has lapsed the node starts no write and fences nobody; when it comes back every peer
//!   becomes pending (this node may have missed everything in between).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// What this node knows of another member.
#[derive(Clone, Debug)]
pub(crate) struct Peer {
    /// Its RADOS client's address (what fencing blocklists).
    pub address: String,
    pub name: String,
    /// Alive until then (`None`: pending).
    fresh_until: Option<Instant>,
    /// Suspect from then on unless it answers first.
    fence_after: Instant,
    pub fenced: bool,
    pub last_ack: Option<Instant>,
}

/// A peer's state, as `ctl cluster` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PeerState {
    /// Not heard from since this node joined or came back; writes wait for it.
    Pending,
    /// Its lease holds.
    Alive,
    /// Its lease ran out and it is not fenced yet: writes wait until it is.
    Suspect,
    /// Blocklisted in the cluster: the OSDs refuse whatever it still sends.
    Fenced,
}

impl PeerState {
    pub(crate) fn name(self) -> &'static str {
        match self {
            PeerState::Pending => "pending",
            PeerState::Alive => "alive",
            PeerState::Suspect => "suspect",
            PeerState::Fenced => "fenced",
        }
    }
}

/// Whether commands that change a shared medium may start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Gate {
    /// Until then (`None`: no other member, or every other is fenced: until something
    /// changes).
    Open(Option<Instant>),
    /// A peer is pending or suspect.
    Closed,
}

/// The liveness state of one node.
#[derive(Debug)]
pub(crate) struct Liveness {
    me: u16,
    lease: Duration,
    /// Answers to pings sent before this do not count for a peer.
    epoch: Instant,
    peers: BTreeMap<u16, Peer>,
    /// This node's own lease: until then (`None`: lapsed).
    self_until: Option<Instant>,
    /// When the last read of the cluster object that showed this node unfenced started.
    read_ok: Option<Instant>,
}

impl Liveness {
    /// Node `me`, joining at `now` with leases of `lease`.
    pub(crate) fn new(me: u16, lease: Duration, now: Instant) -> Liveness {
        Liveness {
            me,
            lease,
            epoch: now,
            peers: BTreeMap::new(),
            self_until: None,
            read_ok: None,
        }
    }

    /// The cluster object as a read that started at `t` found it (`now`: when it returned):
    /// its members (node, address, name) and the fenced addresses. Returns `false` if this
    /// node's address `mine` is fenced (its lease is then gone for good).
    pub(crate) fn members<'a>(
        &mut self,
        t: Instant,
        now: Instant,
        mine: &str,
        members: impl IntoIterator<Item = (u16, &'a str, &'a str)>,
        fenced: &BTreeSet<String>,
    ) -> bool {
        if fenced.contains(mine) {
            self.self_until = None;
            self.read_ok = None;
            return false;
        }
        self.read_ok = Some(self.read_ok.map_or(t, |r| r.max(t)));
        let mut seen = BTreeSet::new();
        for (n, address, name) in members {
            if n == self.me {
                continue;
            }
            seen.insert(n);
            let lease = self.lease;
            let p = self.peers.entry(n).or_insert_with(|| Peer {
                address: address.to_string(),
                name: name.to_string(),
                fresh_until: None,
                fence_after: now + lease,
                fenced: false,
                last_ack: None,
            });
            if p.address != address {
                // A new instance of that node: pending from now on.
                *p = Peer {
                    address: address.to_string(),
                    name: name.to_string(),
                    fresh_until: None,
                    fence_after: now + lease,
                    fenced: false,
                    last_ack: None,
                };
            }
            p.name = name.to_string();
            if fenced.contains(address) {
                p.fenced = true;
            }
        }
        self.peers.retain(|n, _| seen.contains(n));
        true
    }

    /// A ping sent at `s` was answered, as far as `now`, by the nodes in `acks`.
    pub(crate) fn pinged(&mut self, s: Instant, now: Instant, acks: &BTreeSet<u16>) {
        if acks.contains(&self.me) {
            if let Some(read) = self.read_ok {
                let until = s.min(read) + self.lease;
                if until > now {
                    if !self.self_valid(now) {
                        // Back after a lapse: whatever happened meanwhile, every peer must
                        // answer again before a write starts here.
                        self.epoch = self.epoch.max(s);
                        for p in self.peers.values_mut().filter(|p| !p.fenced) {
                            p.fresh_until = None;
                            p.fence_after = now + self.lease;
                        }
                    }
                    self.self_until = Some(self.self_until.map_or(until, |u| u.max(until)));
                }
            }
        }
        if s < self.epoch {
            return;
        }
        let lease = self.lease;
        for (n, p) in self.peers.iter_mut() {
            if !acks.contains(n) || p.fenced || now >= p.fence_after {
                continue;
            }
            let until = p.fresh_until.map_or(s + lease, |u| u.max(s + lease));
            p.fresh_until = Some(until);
            p.fence_after = until;
            p.last_ack = Some(now);
        }
    }

    /// Whether this node's own lease holds at `now`.
    pub(crate) fn self_valid(&self, now: Instant) -> bool {
        self.self_until.is_some_and(|u| now < u)
    }

    /// This node's lease end (`None`: lapsed or never had).
    pub(crate) fn self_until(&self) -> Option<Instant> {
        self.self_until
    }

    /// This node's lease is gone (it was fenced, or stopped).
    pub(crate) fn lapse(&mut self) {
        self.self_until = None;
    }

    /// The peers this node is to fence at `now`: suspect ones, and only while its own lease
    /// holds (a node that may have been away itself fences nobody).
    pub(crate) fn to_fence(&self, now: Instant) -> Vec<(u16, String)> {
        if !self.self_valid(now) {
            return Vec::new();
        }
        self.peers
            .iter()
            .filter(|(_, p)| !p.fenced && now >= p.fence_after)
            .map(|(n, p)| (*n, p.address.clone()))
            .collect()
    }

    /// Node `n` at `address` is fenced (blocklisted); an older address of it is ignored.
    pub(crate) fn fenced(&mut self, n: u16, address: &str) {
        if let Some(p) = self.peers.get_mut(&n).filter(|p| p.address == address) {
            p.fenced = true;
        }
    }

    /// The write gate.
    pub(crate) fn gate(&self) -> Gate {
        let mut until: Option<Instant> = None;
        for p in self.peers.values().filter(|p| !p.fenced) {
            let Some(f) = p.fresh_until else {
                return Gate::Closed;
            };
            until = Some(until.map_or(f, |u| u.min(f)));
        }
        Gate::Open(until)
    }

    /// The earliest moment a peer becomes suspect (for the agent's next look).
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.peers
            .values()
            .filter(|p| !p.fenced)
            .map(|p| p.fence_after)
            .min()
    }

    /// Peer `n`'s state at `now` (`None`: not a member).
    pub(crate) fn state(&self, n: u16, now: Instant) -> Option<PeerState> {
        let p = self.peers.get(&n)?;
        Some(if p.fenced {
            PeerState::Fenced
        } else if now >= p.fence_after {
            PeerState::Suspect
        } else if p.fresh_until.is_none() {
            PeerState::Pending
        } else {
            PeerState::Alive
        })
    }

    /// The peer `n` (`None`: not a member).
    pub(crate) fn peer(&self, n: u16) -> Option<&Peer> {
        self.peers.get(&n)
    }

    /// How long peer `n`'s lease still holds at `now`.
    pub(crate) fn peer_lease(&self, n: u16, now: Instant) -> Option<Duration> {
        let p = self.peers.get(&n)?;
        p.fresh_until
            .filter(|u| *u > now && !p.fenced)
            .map(|u| u - now)
    }

    /// Every peer's number.
    pub(crate) fn peer_numbers(&self) -> Vec<u16> {
        self.peers.keys().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const L: Duration = Duration::from_secs(3);

    fn ms(t0: Instant, n: u64) -> Instant {
        t0 + Duration::from_millis(n)
    }

    fn acks(n: &[u16]) -> BTreeSet<u16> {
        n.iter().copied().collect()
    }

    /// Node 1 with peers 2 and 3, read at `t0`.
    fn three(t0: Instant) -> Liveness {
        let mut l = Liveness::new(1, L, t0);
        let members = [(1, "a1", "n1"), (2, "a2", "n2"), (3, "a3", "n3")];
        assert!(l.members(t0, t0, "a1", members, &BTreeSet::new()));
        l
    }

    #[test]
    fn the_gate_opens_when_every_peer_answered_and_closes_when_a_lease_runs_out() {
        let t0 = Instant::now();
        let mut l = three(t0);
        assert_eq!(l.gate(), Gate::Closed, "peers pending after joining");
        assert!(!l.self_valid(t0));
        l.pinged(ms(t0, 10), ms(t0, 20), &acks(&[1, 2, 3]));
        assert!(l.self_valid(ms(t0, 20)));
        assert_eq!(l.gate(), Gate::Open(Some(ms(t0, 10) + L)));
        // Peer 3 stops answering; peer 2 goes on (and the cluster object is read as usual).
        let members = [(2, "a2", "n2"), (3, "a3", "n3")];
        assert!(l.members(ms(t0, 990), ms(t0, 995), "a1", members, &BTreeSet::new()));
        l.pinged(ms(t0, 1000), ms(t0, 1010), &acks(&[1, 2]));
        assert_eq!(
            l.gate(),
            Gate::Open(Some(ms(t0, 10) + L)),
            "3's lease bounds it"
        );
        assert!(l.to_fence(ms(t0, 3000)).is_empty());
        assert_eq!(l.state(3, ms(t0, 3010)), Some(PeerState::Suspect));
        assert_eq!(l.to_fence(ms(t0, 3010)), vec![(3, "a3".to_string())]);
        // A late answer does not bring a suspect back.
        l.pinged(ms(t0, 2900), ms(t0, 3100), &acks(&[1, 2, 3]));
        assert_eq!(l.state(3, ms(t0, 3100)), Some(PeerState::Suspect));
        l.fenced(3, "a3");
        assert_eq!(l.state(3, ms(t0, 3100)), Some(PeerState::Fenced));
        assert_eq!(l.gate(), Gate::Open(Some(ms(t0, 2900) + L)));
        assert_eq!(l.next_deadline(), Some(ms(t0, 2900) + L));
    }

    #[test]
    fn a_node_whose_own_lease_lapsed_fences_nobody_and_waits_for_every_peer_again() {
        let t0 = Instant::now();
        let mut l = three(t0);
        l.pinged(ms(t0, 10), ms(t0, 20), &acks(&[1, 2, 3]));
        // Paused for 10 s: its own lease and its peers' have run out.
        let back = ms(t0, 10_000);
        assert!(!l.self_valid(back));
        assert!(l.to_fence(back).is_empty(), "no fencing while away");
        assert!(l.members(
            back,
            back,
            "a1",
            [(2, "a2", "n2"), (3, "a3", "n3")],
            &BTreeSet::new()
        ));
        // Its own answer comes back first: every peer pending, the gate closed.
        l.pinged(ms(t0, 10_010), ms(t0, 10_020), &acks(&[1]));
        assert!(l.self_valid(ms(t0, 10_020)));
        assert_eq!(l.state(2, ms(t0, 10_020)), Some(PeerState::Pending));
        assert_eq!(l.gate(), Gate::Closed);
        // A ping from before the return does not count; one after it does.
        l.pinged(ms(t0, 9_000), ms(t0, 10_030), &acks(&[2, 3]));
        assert_eq!(l.gate(), Gate::Closed);
        l.pinged(ms(t0, 10_100), ms(t0, 10_110), &acks(&[1, 2, 3]));
        assert_eq!(l.gate(), Gate::Open(Some(ms(t0, 10_100) + L)));
    }

    #[test]
    fn a_fenced_address_ends_this_nodes_lease_and_a_new_instance_is_pending() {
        let t0 = Instant::now();
        let mut l = three(t0);
        l.pinged(ms(t0, 10), ms(t0, 20), &acks(&[1, 2, 3]));
        let fenced: BTreeSet<String> = ["a3".to_string()].into();
        assert!(l.members(
            ms(t0, 30),
            ms(t0, 40),
            "a1",
            [(2, "a2", "n2"), (3, "a3", "n3")],
            &fenced
        ));
        assert_eq!(l.state(3, ms(t0, 40)), Some(PeerState::Fenced));
        // Node 3 restarted with a new address: pending, not fenced.
        assert!(l.members(
            ms(t0, 50),
            ms(t0, 60),
            "a1",
            [(2, "a2", "n2"), (3, "a3b", "n3")],
            &fenced
        ));
        assert_eq!(l.state(3, ms(t0, 60)), Some(PeerState::Pending));
        assert_eq!(l.gate(), Gate::Closed);
        // Node 2 forgotten: gone from the view.
        assert!(l.members(ms(t0, 70), ms(t0, 80), "a1", [(3, "a3b", "n3")], &fenced));
        assert_eq!(l.state(2, ms(t0, 80)), None);
        // This node's own address fenced: its lease is gone.
        let me: BTreeSet<String> = ["a1".to_string()].into();
        assert!(!l.members(ms(t0, 90), ms(t0, 95), "a1", [(3, "a3b", "n3")], &me));
        assert!(!l.self_valid(ms(t0, 95)));
    }

    #[test]
    fn a_lone_node_is_open_for_good_once_its_lease_holds() {
        let t0 = Instant::now();
        let mut l = Liveness::new(1, L, t0);
        assert!(l.members(t0, t0, "a1", [(1, "a1", "n1")], &BTreeSet::new()));
        assert_eq!(l.gate(), Gate::Open(None));
        assert!(!l.self_valid(t0), "no own answer yet");
        l.pinged(ms(t0, 5), ms(t0, 6), &acks(&[1]));
        assert!(l.self_valid(ms(t0, 6)));
        assert!(!l.self_valid(ms(t0, 5) + L));
    }

    #[derive(Clone, Debug)]
    enum Ev {
        /// A ping sent `ms` after the last event, answered by these nodes after `rtt` ms.
        Ping(u64, Vec<u16>, u64),
        /// A read of the cluster object `ms` after the last event.
        Read(u64),
        /// Fence whoever is to be fenced, `ms` after the last event.
        Fence(u64),
    }

    fn ev() -> impl Strategy<Value = Ev> {
        prop_oneof![
            (
                0..2000u64,
                proptest::collection::vec(1..4u16, 0..4),
                0..1500u64
            )
                .prop_map(|(d, a, r)| Ev::Ping(d, a, r)),
            (0..2000u64).prop_map(Ev::Read),
            (0..2000u64).prop_map(Ev::Fence),
        ]
    }

    proptest! {
        /// Whatever the pings, answers, reads and fences: the gate is open at a moment only
        /// if every unfenced peer answered a ping sent no longer than a lease before it (so
        /// a peer that stopped answering is either fenced or holds every write back), and a
        /// node fences only while its own lease holds.
        #[test]
        fn the_gate_never_opens_over_a_silent_peer(evs in proptest::collection::vec(ev(), 1..60)) {
            let t0 = Instant::now();
            let mut l = three(t0);
            let mut now = t0;
            // Per peer: the send time of the latest ping it answered.
            let mut answered: BTreeMap<u16, Instant> = BTreeMap::new();
            for e in evs {
                match e {
                    Ev::Ping(d, a, rtt) => {
                        let s = now + Duration::from_millis(d);
                        now = s + Duration::from_millis(rtt);
                        let a: BTreeSet<u16> = a.into_iter().collect();
                        for n in &a {
                            let e = answered.entry(*n).or_insert(s);
                            *e = (*e).max(s);
                        }
                        l.pinged(s, now, &a);
                    }
                    Ev::Read(d) => {
                        let t = now + Duration::from_millis(d);
                        now = t;
                        l.members(t, now, "a1", [(2, "a2", "n2"), (3, "a3", "n3")], &BTreeSet::new());
                    }
                    Ev::Fence(d) => {
                        now += Duration::from_millis(d);
                        let f = l.to_fence(now);
                        prop_assert!(f.is_empty() || l.self_valid(now));
                        for (n, a) in f {
                            l.fenced(n, &a);
                        }
                    }
                }
                if let Gate::Open(until) = l.gate() {
                    if until.is_none_or(|u| now < u) {
                        for n in [2u16, 3] {
                            if l.state(n, now) == Some(PeerState::Fenced) {
                                continue;
                            }
                            let last = answered.get(&n).copied();
                            prop_assert!(
                                last.is_some_and(|s| now < s + L),
                                "gate open at {:?} over peer {n} last answering a ping of {:?}",
                                now - t0,
                                last.map(|s| s - t0)
                            );
                        }
                    }
                }
            }
        }
    }
}
