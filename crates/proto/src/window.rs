//! The session's command window: the CmdSN sequencer (RFC 7143 §3.2.2.1, §4.2.2.1).
//!
//! Non-immediate commands are delivered in CmdSN order across every connection of the
//! session. A command outside [ExpCmdSN, MaxCmdSN] is silently ignored (§4.2.2.1: "MUST
//! silently ignore"); one that arrives ahead of a gap (the connections of a session race each
//! other) is held until the gap fills, then released with everything after it that is already
//! here. Immediate commands bypass ordering and do not advance ExpCmdSN.
//!
//! A CmdSN can also be *consumed* without delivering anything: the referenced command of an
//! ABORT TASK that never arrived (§11.5.1, §7.11: the target considers it received), and the
//! commands of a connection that is gone. (A rejected command's CmdSN is not consumed, §7.3:
//! the initiator plugs that gap; nor are those of commands held for a connection that failed
//! at ErrorRecoveryLevel 2, §6.2.1: the initiator retries them.) A consumed CmdSN ahead of a gap is a placeholder that the gap-filling command
//! releases like any other; a later command with that CmdSN is a duplicate and is ignored.
//!
//! MaxCmdSN is `ExpCmdSN + depth - 1 - in_flight`, so an initiator can never have more than
//! `depth` commands in the target at once, however fast it sees responses; held commands sit
//! inside the advertised range already and do not shrink it.
//!
//! Cost: an in-order command is one comparison pair and a counter; nothing is hashed while
//! nothing is held (always, on a session of one connection).

use crate::serial::CmdSn;
use std::collections::{HashMap, VecDeque};

/// Why a command was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ignored {
    /// CmdSN below ExpCmdSN: a duplicate or a stale retransmission.
    BelowWindow,
    /// CmdSN above MaxCmdSN: the initiator ignored flow control.
    AboveWindow,
    /// A command with this CmdSN is already held (or the CmdSN was consumed).
    Duplicate,
}

/// What the window holds at a CmdSN ahead of ExpCmdSN.
#[derive(Debug)]
enum Slot<T> {
    Item(T),
    /// Consumed without a command to deliver.
    Consumed,
}

/// The CmdSN window of one session. `T` is what the caller wants handed back, in order, when a
/// held command is released.
#[derive(Debug)]
pub struct CmdWindow<T> {
    exp_cmd_sn: CmdSn,
    depth: u32,
    in_flight: u32,
    held: HashMap<u32, Slot<T>>,
    /// Held items released by the last admission, in CmdSN order ([`CmdWindow::pop_released`]).
    released: VecDeque<T>,
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
            released: VecDeque::new(),
        }
    }

    /// The next CmdSN expected.
    pub fn exp_cmd_sn(&self) -> CmdSn {
        self.exp_cmd_sn
    }

    /// The highest CmdSN the initiator may send now. When the target is full this is
    /// ExpCmdSN - 1, which closes the window (RFC 7143 §4.2.2.1).
    pub fn max_cmd_sn(&self) -> CmdSn {
        let room = self.depth.saturating_sub(self.in_flight);
        CmdSn(self.exp_cmd_sn.0.wrapping_add(room).wrapping_sub(1))
    }

    /// Commands delivered and not yet completed.
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// CmdSNs held (commands and placeholders) ahead of a gap.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Whether `cmd_sn` is inside [ExpCmdSN, MaxCmdSN].
    pub fn contains(&self, cmd_sn: CmdSn) -> bool {
        // Not >= ExpCmdSN includes the undefined case of RFC 1982 (exactly 2^31 apart).
        cmd_sn.ge(self.exp_cmd_sn) && cmd_sn.le(self.max_cmd_sn())
    }

    /// Whether a non-immediate command with `cmd_sn` would be admitted (held or delivered).
    pub fn check(&self, cmd_sn: CmdSn) -> Result<(), Ignored> {
        if !cmd_sn.ge(self.exp_cmd_sn) {
            return Err(Ignored::BelowWindow);
        }
        if cmd_sn.gt(self.max_cmd_sn()) {
            return Err(Ignored::AboveWindow);
        }
        if cmd_sn != self.exp_cmd_sn && self.held.contains_key(&cmd_sn.0) {
            return Err(Ignored::Duplicate);
        }
        Ok(())
    }

    /// Offer a command. `Ok(Some(item))`: deliver it now (and afterwards everything
    /// [`CmdWindow::pop_released`] gives, which follows it in CmdSN order); `Ok(None)`: it is
    /// held behind a gap; `Err`: ignore it. Immediate commands are delivered at once.
    pub fn admit(&mut self, cmd_sn: CmdSn, immediate: bool, item: T) -> Result<Option<T>, Ignored> {
        if immediate {
            self.in_flight += 1;
            return Ok(Some(item));
        }
        self.check(cmd_sn)?;
        if cmd_sn != self.exp_cmd_sn {
            self.held.insert(cmd_sn.0, Slot::Item(item));
            return Ok(None);
        }
        self.in_flight += 1;
        self.advance();
        Ok(Some(item))
    }

    /// Consume `cmd_sn` without delivering a command (see the module docs). `Err` when it is
    /// outside the window or already taken; immediate commands consume nothing.
    pub fn consume(&mut self, cmd_sn: CmdSn, immediate: bool) -> Result<(), Ignored> {
        if immediate {
            return Ok(());
        }
        self.check(cmd_sn)?;
        if cmd_sn != self.exp_cmd_sn {
            self.held.insert(cmd_sn.0, Slot::Consumed);
            return Ok(());
        }
        self.advance();
        Ok(())
    }

    /// ExpCmdSN passed one CmdSN: release what follows it.
    fn advance(&mut self) {
        self.exp_cmd_sn = self.exp_cmd_sn.next();
        // Nothing held (always, on one connection): no lookup.
        while !self.held.is_empty() {
            match self.held.remove(&self.exp_cmd_sn.0) {
                None => break,
                Some(Slot::Item(t)) => {
                    self.in_flight += 1;
                    self.released.push_back(t);
                }
                Some(Slot::Consumed) => {}
            }
            self.exp_cmd_sn = self.exp_cmd_sn.next();
        }
    }

    /// The next held item released by the last admission or consumption, in CmdSN order.
    pub fn pop_released(&mut self) -> Option<T> {
        self.released.pop_front()
    }

    /// Turn held items that match `pred` into consumed CmdSNs (their commands will not be
    /// delivered: aborted, or their connection is gone); returns them.
    pub fn drop_held_where(&mut self, mut pred: impl FnMut(&T) -> bool) -> Vec<T> {
        let mut out = Vec::new();
        for slot in self.held.values_mut() {
            if matches!(slot, Slot::Item(t) if pred(t)) {
                if let Slot::Item(t) = std::mem::replace(slot, Slot::Consumed) {
                    out.push(t);
                }
            }
        }
        out
    }

    /// Forget held items that match `pred` as if their commands never arrived: their CmdSNs
    /// are not received, and the initiator sends them again (RFC 7143 §6.2.1, a retry with
    /// the same CmdSN after its connection failed at ErrorRecoveryLevel 2); returns them.
    pub fn unreceive_held_where(&mut self, mut pred: impl FnMut(&T) -> bool) -> Vec<T> {
        let gone: Vec<u32> = self
            .held
            .iter()
            .filter(|(_, s)| matches!(s, Slot::Item(t) if pred(t)))
            .map(|(sn, _)| *sn)
            .collect();
        gone.into_iter()
            .filter_map(|sn| match self.held.remove(&sn) {
                Some(Slot::Item(t)) => Some(t),
                _ => None,
            })
            .collect()
    }

    /// Forget everything held (the session has ended).
    pub fn clear_held(&mut self) -> Vec<T> {
        let mut out: Vec<T> = self.released.drain(..).collect();
        out.extend(self.held.drain().filter_map(|(_, s)| match s {
            Slot::Item(t) => Some(t),
            Slot::Consumed => None,
        }));
        out
    }

    /// A delivered command finished (its response is queued): its slot opens again.
    pub fn complete(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn released<T>(w: &mut CmdWindow<T>) -> Vec<T> {
        std::iter::from_fn(|| w.pop_released()).collect()
    }

    #[test]
    fn delivers_in_order_and_advances() {
        let mut w = CmdWindow::new(CmdSn(10), 4);
        assert_eq!(w.max_cmd_sn(), CmdSn(13));
        assert_eq!(w.admit(CmdSn(10), false, 'a'), Ok(Some('a')));
        assert_eq!(w.exp_cmd_sn(), CmdSn(11));
        // One in flight: the window does not move forward until it completes.
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
        assert_eq!(w.admit(CmdSn(2), false, 2), Ok(None));
        assert_eq!(w.admit(CmdSn(1), false, 1), Ok(None));
        assert_eq!(w.admit(CmdSn(1), false, 1), Err(Ignored::Duplicate));
        assert_eq!(w.in_flight(), 0, "held commands are not in flight");
        assert_eq!(w.admit(CmdSn(0), false, 0), Ok(Some(0)));
        assert_eq!(released(&mut w), vec![1, 2]);
        assert_eq!(w.exp_cmd_sn(), CmdSn(3));
        assert_eq!(w.in_flight(), 3);
    }

    #[test]
    fn a_consumed_cmdsn_fills_its_gap_and_blocks_its_duplicate() {
        let mut w = CmdWindow::new(CmdSn(0), 8);
        assert_eq!(w.admit(CmdSn(2), false, 2), Ok(None));
        assert_eq!(w.consume(CmdSn(1), false), Ok(()));
        assert_eq!(w.admit(CmdSn(1), false, 1), Err(Ignored::Duplicate));
        assert_eq!(w.consume(CmdSn(0), false), Ok(()));
        assert_eq!(released(&mut w), vec![2]);
        assert_eq!(w.exp_cmd_sn(), CmdSn(3));
        assert_eq!(w.in_flight(), 1, "only the delivered command is in flight");
        assert_eq!(w.admit(CmdSn(0), false, 0), Err(Ignored::BelowWindow));
    }

    #[test]
    fn dropped_held_commands_leave_their_cmdsn_consumed() {
        let mut w = CmdWindow::new(CmdSn(0), 8);
        w.admit(CmdSn(1), false, 'x').unwrap();
        w.admit(CmdSn(2), false, 'y').unwrap();
        assert_eq!(w.drop_held_where(|c| *c == 'x'), vec!['x']);
        assert_eq!(w.admit(CmdSn(0), false, 'a'), Ok(Some('a')));
        assert_eq!(released(&mut w), vec!['y']);
        assert_eq!(w.exp_cmd_sn(), CmdSn(3));
    }

    #[test]
    fn wraps_at_two_to_the_32() {
        let mut w = CmdWindow::new(CmdSn(u32::MAX), 4);
        assert_eq!(w.admit(CmdSn(u32::MAX), false, ()), Ok(Some(())));
        assert_eq!(w.exp_cmd_sn(), CmdSn(0));
        assert_eq!(w.admit(CmdSn(0), false, ()), Ok(Some(())));
        w.complete();
        w.complete();
        assert_eq!(w.max_cmd_sn(), CmdSn(4));
    }

    #[test]
    fn immediate_commands_do_not_advance_exp_cmd_sn() {
        let mut w = CmdWindow::new(CmdSn(5), 4);
        assert_eq!(w.admit(CmdSn(5), true, 'i'), Ok(Some('i')));
        assert_eq!(w.exp_cmd_sn(), CmdSn(5));
        assert_eq!(w.consume(CmdSn(77), true), Ok(()));
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

    #[test]
    fn held_entries_are_bounded_by_the_window() {
        // However an initiator floods, only CmdSNs inside the advertised window are held.
        let mut w = CmdWindow::new(CmdSn(0), 16);
        for sn in 1..10_000u32 {
            let _ = w.admit(CmdSn(sn), false, sn);
        }
        assert_eq!(w.held(), 15);
    }
}
