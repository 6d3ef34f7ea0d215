//! The session's command window (RFC 7143 §4.2.2.1, §3.2.2.1).
//!
//! Non-immediate commands must be delivered to the SCSI layer in CmdSN order, across every
//! connection of the session; a command outside [ExpCmdSN, MaxCmdSN] is silently ignored
//! (with ErrorRecoveryLevel 0 there is nothing else to do with it). A command that arrives
//! ahead of a gap (possible with several connections) is held until the gap fills. Immediate
//! commands bypass ordering and do not advance ExpCmdSN.
//!
//! MaxCmdSN is `ExpCmdSN + depth - 1 - in_flight`, so an initiator can never have more than
//! `depth` commands in the target at once, however fast it sees responses.

use crate::serial::CmdSn;
use std::collections::HashMap;

/// Why a command was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ignored {
    /// CmdSN below ExpCmdSN: a duplicate or a stale retransmission.
    BelowWindow,
    /// CmdSN above MaxCmdSN: the initiator ignored flow control.
    AboveWindow,
    /// A command with this CmdSN is already held.
    Duplicate,
}

/// The CmdSN window of one session. `T` is whatever the caller wants handed back in order.
#[derive(Debug)]
pub struct CmdWindow<T> {
    exp_cmd_sn: CmdSn,
    depth: u32,
    in_flight: u32,
    held: HashMap<u32, T>,
}

impl<T> CmdWindow<T> {
    /// A window starting at `exp_cmd_sn` (the CmdSN of the leading login request) allowing
    /// `depth` (≥ 1) commands in the target at once.
    pub fn new(exp_cmd_sn: CmdSn, depth: u32) -> Self {
        CmdWindow {
            exp_cmd_sn,
            depth: depth.max(1),
            in_flight: 0,
            held: HashMap::new(),
        }
    }

    /// The next CmdSN expected.
    pub fn exp_cmd_sn(&self) -> CmdSn {
        self.exp_cmd_sn
    }

    /// The highest CmdSN the initiator may send now. When the target is full this is
    /// ExpCmdSN - 1, which closes the window (RFC 7143 §4.2.2.1).
    pub fn max_cmd_sn(&self) -> CmdSn {
        // Held commands already sit inside [ExpCmdSN, MaxCmdSN]; they must not shrink it.
        let room = self.depth.saturating_sub(self.in_flight);
        CmdSn(self.exp_cmd_sn.0.wrapping_add(room).wrapping_sub(1))
    }

    /// Commands admitted and not yet completed.
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// Offer a command. Returns the commands now deliverable, in CmdSN order (possibly empty
    /// if this one was held behind a gap), or why it was ignored. Immediate commands are
    /// delivered at once and counted in flight.
    pub fn admit(&mut self, cmd_sn: CmdSn, immediate: bool, item: T) -> Result<Vec<T>, Ignored> {
        if immediate {
            self.in_flight += 1;
            return Ok(vec![item]);
        }
        // Not >= ExpCmdSN includes the undefined case of RFC 1982 (exactly 2^31 apart).
        if !cmd_sn.ge(self.exp_cmd_sn) {
            return Err(Ignored::BelowWindow);
        }
        // The window as it was advertised: any CmdSN up to ExpCmdSN + depth - 1 minus what is
        // already in the target.
        if cmd_sn.gt(self.max_cmd_sn()) {
            return Err(Ignored::AboveWindow);
        }
        if cmd_sn != self.exp_cmd_sn {
            if self.held.contains_key(&cmd_sn.0) {
                return Err(Ignored::Duplicate);
            }
            self.held.insert(cmd_sn.0, item);
            return Ok(Vec::new());
        }
        let mut out = vec![item];
        self.exp_cmd_sn = self.exp_cmd_sn.next();
        self.in_flight += 1;
        // Nothing held (always, on one connection): no lookup, whose hashing was a third of
        // the cost of admitting an in-order command.
        while !self.held.is_empty() {
            let Some(next) = self.held.remove(&self.exp_cmd_sn.0) else {
                break;
            };
            out.push(next);
            self.exp_cmd_sn = self.exp_cmd_sn.next();
            self.in_flight += 1;
        }
        Ok(out)
    }

    /// A delivered command finished (its response is queued): its slot opens again.
    pub fn complete(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delivers_in_order_and_advances() {
        let mut w = CmdWindow::new(CmdSn(10), 4);
        assert_eq!(w.max_cmd_sn(), CmdSn(13));
        assert_eq!(w.admit(CmdSn(10), false, 'a'), Ok(vec!['a']));
        assert_eq!(w.exp_cmd_sn(), CmdSn(11));
        // One in flight: the window shrinks by one.
        assert_eq!(w.max_cmd_sn(), CmdSn(13));
        w.complete();
        assert_eq!(w.max_cmd_sn(), CmdSn(14));
    }

    #[test]
    fn rejects_cmdsn_outside_window() {
        let mut w = CmdWindow::new(CmdSn(10), 4);
        assert_eq!(w.admit(CmdSn(9), false, ()), Err(Ignored::BelowWindow));
        assert_eq!(w.admit(CmdSn(14), false, ()), Err(Ignored::AboveWindow));
        assert_eq!(
            w.admit(CmdSn(10 + (1 << 31)), false, ()),
            Err(Ignored::BelowWindow)
        );
        assert_eq!(w.exp_cmd_sn(), CmdSn(10));
    }

    #[test]
    fn holds_commands_behind_a_gap_then_releases_them_in_order() {
        let mut w = CmdWindow::new(CmdSn(0), 8);
        assert_eq!(w.admit(CmdSn(2), false, 2), Ok(vec![]));
        assert_eq!(w.admit(CmdSn(1), false, 1), Ok(vec![]));
        assert_eq!(w.admit(CmdSn(1), false, 1), Err(Ignored::Duplicate));
        assert_eq!(w.admit(CmdSn(0), false, 0), Ok(vec![0, 1, 2]));
        assert_eq!(w.exp_cmd_sn(), CmdSn(3));
        assert_eq!(w.in_flight(), 3);
    }

    #[test]
    fn wraps_at_two_to_the_32() {
        let mut w = CmdWindow::new(CmdSn(u32::MAX), 4);
        assert_eq!(w.admit(CmdSn(u32::MAX), false, ()), Ok(vec![()]));
        assert_eq!(w.exp_cmd_sn(), CmdSn(0));
        assert_eq!(w.admit(CmdSn(0), false, ()), Ok(vec![()]));
        w.complete();
        w.complete();
        assert_eq!(w.max_cmd_sn(), CmdSn(4));
    }

    #[test]
    fn immediate_commands_do_not_advance_exp_cmd_sn() {
        let mut w = CmdWindow::new(CmdSn(5), 4);
        assert_eq!(w.admit(CmdSn(5), true, 'i'), Ok(vec!['i']));
        assert_eq!(w.exp_cmd_sn(), CmdSn(5));
    }

    #[test]
    fn full_target_closes_the_window() {
        let mut w = CmdWindow::new(CmdSn(0), 2);
        w.admit(CmdSn(0), false, ()).unwrap();
        w.admit(CmdSn(1), false, ()).unwrap();
        // MaxCmdSN = ExpCmdSN - 1: nothing may be sent.
        assert_eq!(w.max_cmd_sn(), CmdSn(1));
        assert_eq!(w.admit(CmdSn(2), false, ()), Err(Ignored::AboveWindow));
    }
}
