//! Target-initiated NOP-In pings (RFC 7143 §11.19, §7.1.2): after `interval` without anything
//! received from the initiator, the target pings (ITT 0xffffffff, a TTT of its own, which the
//! initiator must answer with a NOP-Out echoing it); if still nothing has arrived `timeout`
//! after the ping, the connection is dead.
//!
//! No clock here: the caller passes its monotonic time in milliseconds, records when it last
//! received anything, and calls [`Keepalive::on_timer`] at the time the previous call asked.
//!
//! [`Probe`] is the other use of a ping: proof that the initiator is there *now*, asked for
//! before a command read after a silence may run (a node of a cluster of gateways: the
//! bytes may have waited in a socket through a pause or a partition, sent by an initiator
//! that has since given up on them and resent them through another node).

use crate::connection::TTT_LIMIT;
use crate::pdu::{Header, Itt, NopIn, Ttt};

/// What to do when the timer fires ([`Keepalive::on_timer`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeepaliveAction {
    /// Send this NOP-In.
    pub ping: Option<Header>,
    /// The initiator did not answer: close the connection.
    pub close: bool,
    /// Call again at this time (ms); `None` when pings are off or the connection is closing.
    pub next: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Idle,
    /// A ping left at this time.
    Pinged(u64),
}

/// The keepalive of one connection.
#[derive(Clone, Debug)]
pub struct Keepalive {
    interval: u64,
    timeout: u64,
    ttt: u32,
    state: State,
}

impl Keepalive {
    /// Ping after `interval_ms` of silence (0: never), close `timeout_ms` after an unanswered
    /// ping.
    pub fn new(interval_ms: u64, timeout_ms: u64) -> Self {
        Keepalive {
            interval: interval_ms,
            timeout: timeout_ms,
            ttt: TTT_LIMIT,
            state: State::Idle,
        }
    }

    /// When to call [`Keepalive::on_timer`] first, given the time now.
    pub fn first_deadline(&self, now: u64) -> Option<u64> {
        (self.interval > 0).then(|| now + self.interval)
    }

    /// The timer fired at `now`; the initiator was last heard from at `last_rx`.
    pub fn on_timer(&mut self, now: u64, last_rx: u64) -> KeepaliveAction {
        let wait = |until: u64| KeepaliveAction {
            ping: None,
            close: false,
            next: Some(until),
        };
        if self.interval == 0 {
            return KeepaliveAction {
                ping: None,
                close: false,
                next: None,
            };
        }
        if let State::Pinged(sent) = self.state {
            if last_rx < sent {
                if now < sent + self.timeout {
                    return wait(sent + self.timeout);
                }
                return KeepaliveAction {
                    ping: None,
                    close: true,
                    next: None,
                };
            }
            self.state = State::Idle;
        }
        let quiet_since = last_rx;
        if now.saturating_sub(quiet_since) < self.interval {
            return wait(quiet_since + self.interval);
        }
        // Our own TTTs for pings stay above the range of R2Ts and Text continuations, and
        // below the probes'.
        self.ttt = self.ttt.wrapping_add(1) | TTT_LIMIT;
        if self.ttt >= PROBE_TTT_BASE {
            self.ttt = TTT_LIMIT;
        }
        self.state = State::Pinged(now);
        KeepaliveAction {
            ping: Some(Header::NopIn(NopIn {
                itt: Itt::RESERVED,
                ttt: Ttt(self.ttt),
                ..Default::default()
            })),
            close: false,
            next: Some(now + self.timeout),
        }
    }
}

/// The first Target Transfer Tag of [`Probe`] pings (the keepalive's stay below it, R2Ts and
/// Text continuations below [`TTT_LIMIT`]; RFC 7143 §11.19.1: a NOP-In the initiator must
/// answer carries a TTT other than 0xffffffff).
pub const PROBE_TTT_BASE: u32 = 0xF000_0000;

/// Proof that the initiator is live after a silence on its connection.
///
/// A receive that comes more than `gap` after the previous one (a header that arrives after
/// a silence, or a PDU whose bytes took that long) leaves the connection *unproven*: what
/// was read may have waited in the network or in a socket while the initiator gave up on
/// it. It is proven again when the initiator answers a NOP-In sent after that gap (a live
/// connection delivers in order, so whatever the initiator did about the earlier bytes, an
/// abort or a logout, arrives before its answer; a connection the initiator has closed
/// answers with a reset). The caller holds the commands it must not run on an unproven
/// connection until then.
#[derive(Clone, Debug)]
pub struct Probe {
    gap: u64,
    last_rx: Option<u64>,
    unproven: bool,
    /// The TTT of the ping sent since the connection became unproven.
    pinged: Option<u32>,
    next: u32,
    proofs: u64,
}

impl Probe {
    /// Unproven after a silence longer than `gap_ms`.
    pub fn new(gap_ms: u64) -> Self {
        Probe {
            gap: gap_ms,
            last_rx: None,
            unproven: false,
            pinged: None,
            next: PROBE_TTT_BASE,
            proofs: 0,
        }
    }

    /// Bytes were received at `now_ms` (a header read, or the end of a PDU's data).
    pub fn received(&mut self, now_ms: u64) {
        if self
            .last_rx
            .is_some_and(|last| now_ms.saturating_sub(last) > self.gap)
        {
            self.unproven = true;
            // A ping sent before the gap proves nothing about what came after it.
            self.pinged = None;
        }
        self.last_rx = Some(now_ms);
    }

    /// Whether commands must wait for a proof.
    pub fn unproven(&self) -> bool {
        self.unproven
    }

    /// The NOP-In to send now: one per unproven stretch.
    pub fn ping(&mut self) -> Option<Header> {
        if !self.unproven || self.pinged.is_some() {
            return None;
        }
        let ttt = self.next;
        self.next = if self.next == u32::MAX - 1 {
            PROBE_TTT_BASE
        } else {
            self.next + 1
        };
        self.pinged = Some(ttt);
        Some(Header::NopIn(NopIn {
            itt: Itt::RESERVED,
            ttt: Ttt(ttt),
            ..Default::default()
        }))
    }

    /// A NOP-Out answering a ping with `ttt` arrived: `true` if it is the proof awaited (the
    /// connection is proven).
    pub fn answered(&mut self, ttt: Ttt) -> bool {
        if self.unproven && self.pinged == Some(ttt.0) {
            self.unproven = false;
            self.pinged = None;
            self.proofs += 1;
            return true;
        }
        false
    }

    /// How many proofs there have been (a held command waits for this to grow).
    pub fn proofs(&self) -> u64 {
        self.proofs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_silence_asks_for_a_fresh_proof_and_only_a_ping_after_it_gives_one() {
        let mut p = Probe::new(1_000);
        p.received(0);
        p.received(900);
        assert!(!p.unproven() && p.ping().is_none(), "no gap, no probe");
        p.received(2_000);
        assert!(p.unproven());
        let Some(Header::NopIn(n)) = p.ping() else {
            panic!("a probe")
        };
        assert!(n.itt == Itt::RESERVED && n.ttt.0 >= PROBE_TTT_BASE && n.ttt != Ttt::RESERVED);
        assert!(p.ping().is_none(), "one ping per unproven stretch");
        assert!(!p.answered(Ttt(n.ttt.0 + 1)), "another tag proves nothing");
        // Another silence before the answer: that ping no longer counts.
        p.received(4_000);
        assert!(!p.answered(n.ttt) && p.unproven());
        let Some(Header::NopIn(m)) = p.ping() else {
            panic!("a new probe")
        };
        assert!(p.answered(m.ttt));
        assert!(!p.unproven() && p.proofs() == 1);
        assert!(!p.answered(m.ttt), "answered once");
    }

    #[test]
    fn keepalive_and_probe_tags_never_meet() {
        let mut k = Keepalive::new(1, 1);
        k.ttt = PROBE_TTT_BASE - 2;
        let mut now = 0;
        for _ in 0..8 {
            now += 10;
            if let Some(Header::NopIn(n)) = k.on_timer(now, 0).ping {
                assert!(n.ttt.0 >= TTT_LIMIT && n.ttt.0 < PROBE_TTT_BASE);
            }
        }
    }

    #[test]
    fn pings_after_silence_and_closes_when_unanswered() {
        let mut k = Keepalive::new(15_000, 30_000);
        assert_eq!(k.first_deadline(0), Some(15_000));
        // Traffic at 10 s: look again at 25 s.
        assert_eq!(k.on_timer(15_000, 10_000).next, Some(25_000));
        let a = k.on_timer(25_000, 10_000);
        assert!(
            matches!(a.ping, Some(Header::NopIn(ref n)) if n.itt == Itt::RESERVED && n.ttt.0 >= TTT_LIMIT)
        );
        assert_eq!(a.next, Some(55_000));
        let a = k.on_timer(55_000, 10_000);
        assert!(a.close && a.next.is_none());
    }

    #[test]
    fn an_answer_to_the_ping_keeps_the_connection() {
        let mut k = Keepalive::new(1_000, 2_000);
        assert!(k.on_timer(1_000, 0).ping.is_some());
        let a = k.on_timer(2_000, 1_500);
        assert!(!a.close);
        assert_eq!(a.next, Some(2_500));
        assert!(a.ping.is_none());
    }

    #[test]
    fn off_when_the_interval_is_zero() {
        let mut k = Keepalive::new(0, 30_000);
        assert_eq!(k.first_deadline(5), None);
        assert_eq!(k.on_timer(1 << 40, 0).next, None);
    }

    #[test]
    fn ping_ttts_never_collide_with_r2t_ttts_or_the_reserved_tag() {
        let mut k = Keepalive::new(1, 1);
        k.ttt = u32::MAX - 2;
        let mut now = 0;
        for _ in 0..8 {
            now += 10;
            if let Some(Header::NopIn(n)) = k.on_timer(now, 0).ping {
                assert!(n.ttt.0 >= TTT_LIMIT && n.ttt != Ttt::RESERVED);
            }
            k.state = State::Idle;
        }
    }
}
