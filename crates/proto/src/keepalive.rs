//! Target-initiated NOP-In pings (RFC 7143 §11.19, §7.1.2): after `interval` without anything
//! received from the initiator, the target pings (ITT 0xffffffff, a TTT of its own, which the
//! initiator must answer with a NOP-Out echoing it); if still nothing has arrived `timeout`
//! after the ping, the connection is dead.
//!
//! No clock here: the caller passes its monotonic time in milliseconds, records when it last
//! received anything, and calls [`Keepalive::on_timer`] at the time the previous call asked.

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
        // Our own TTTs for pings stay above the range of R2Ts and Text continuations.
        self.ttt = self.ttt.wrapping_add(1) | TTT_LIMIT;
        if self.ttt == u32::MAX {
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

#[cfg(test)]
mod tests {
    use super::*;

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
