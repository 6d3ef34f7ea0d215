//! What a session's kept connections left behind for TASK REASSIGN at ErrorRecoveryLevel 2
//! (RFC 7143 §7.2.2, §11.5.1): a kept connection outlives its reader, so the session holds
//! it, for whichever of its connections asks.
//!
//! Per kept connection: what its writer stamped and the initiator has not acknowledged
//! ([`crate::iscsi::writer::Retained`]); responses it never stamped (still queued when its writer
//! stopped, or produced afterwards by its commands, which keep running), parked by task; its
//! delivered writes that were waiting for Data-Out; and, for tasks reassigned while still
//! running, where their response goes once it is here (`forward_when_done`, `resolve`: no
//! poll). The connection that reassigns a task reads what it needs through
//! [`Orphans::take_write`] and [`Orphans::take_output`] (`conn/reassign.rs`).

use crate::iscsi::task::PendingWrite;
use crate::iscsi::writer::{Out, OutPdu, Queue, Retained, SnMode};
use ironsan_proto::connection::Write;
use ironsan_proto::pdu::*;
use ironsan_proto::session::ConnId;
use ironsan_proto::DataSn;
use ironsan_scsi::DataIn as Segment;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// What one kept connection left behind.
#[derive(Default)]
struct Kept {
    cid: Option<Cid>,
    /// What its writer stamped and the initiator has not acknowledged (the writer itself,
    /// and its socket, go with the connection).
    retained: Option<Arc<Mutex<Retained>>>,
    /// Responses never stamped, by task.
    parked: HashMap<Itt, Vec<OutPdu>>,
    /// Delivered writes that were waiting for Data-Out.
    writes: Vec<Write<PendingWrite>>,
    /// Tasks reassigned while still running, by task: where their response goes once it is
    /// here (parked, or kept by the writer when it stops).
    waiting: HashMap<Itt, Forward>,
}

/// The connection a reassigned, still running task now belongs to.
struct Forward {
    tx: Queue,
    exp_data_sn: DataSn,
    max_xmit: u32,
}

/// Responses of reassigned tasks to send on their new connections (outside the lock).
pub(crate) type Forwards = Vec<(Queue, Vec<OutPdu>)>;

/// Send what [`Orphans`] found for reassigned tasks on their new connections.
pub(crate) fn send_forwards(forwards: Forwards) {
    for (tx, pdus) in forwards {
        // Called under no lock but from synchronous code: the queue may be full. If that
        // connection has gone too, its initiator reassigns again.
        tokio::spawn(async move {
            let _ = tx.send(Out::Pdus(pdus)).await;
        });
    }
}

/// What the session's kept connections left behind, by connection.
#[derive(Default)]
pub(crate) struct Orphans {
    conns: HashMap<ConnId, Kept>,
}

impl std::fmt::Debug for Orphans {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Orphans")
            .field("conns", &self.conns.len())
            .finish_non_exhaustive()
    }
}

/// Whether a response PDU took a StatSN when first built (a SCSI Response, a Data-In with
/// the status).
fn carries_status(h: &Header) -> bool {
    match h {
        Header::ScsiResponse(_) => true,
        Header::DataIn(d) => d.status.is_some(),
        _ => false,
    }
}

fn task_of(h: &Header) -> Option<Itt> {
    match h {
        Header::ScsiResponse(r) => Some(r.itt),
        Header::DataIn(d) => Some(d.itt),
        _ => None,
    }
}

impl Orphans {
    /// Keep responses of the connection `id` that were never stamped (Data-In and statuses
    /// by task; anything else is dropped: the initiator gave up on that connection).
    /// Returns the responses of reassigned tasks that are complete now.
    pub(crate) fn park(&mut self, id: ConnId, out: Out) -> Forwards {
        let kept = self.conns.entry(id).or_default();
        let mut stack = vec![out];
        while let Some(o) = stack.pop() {
            match o {
                Out::Pdus(pdus) | Out::Command { pdus, .. } => {
                    for p in pdus {
                        if let Some(itt) = task_of(&p.header) {
                            kept.parked.entry(itt).or_default().push(p);
                        }
                    }
                }
                // In order: the batch's first message is handled first.
                Out::Batch(v) => stack.extend(v.into_iter().rev()),
                _ => {}
            }
        }
        self.resolve(id)
    }

    /// The responses of tasks reassigned away from the kept connection `id` that are
    /// complete: after something was parked, or when its writer stopped (a response its
    /// writer stamped is in what the writer kept).
    pub(crate) fn resolve(&mut self, id: ConnId) -> Forwards {
        let waiting: Vec<(Itt, DataSn, u32)> = match self.conns.get(&id) {
            Some(k) => k
                .waiting
                .iter()
                .map(|(itt, f)| (*itt, f.exp_data_sn, f.max_xmit))
                .collect(),
            None => return Vec::new(),
        };
        let mut out = Vec::new();
        // `take_output` answers `None`, changing nothing, while the status is not here.
        for (itt, exp_data_sn, max_xmit) in waiting {
            if let Some(p) = self.take_output(Some(id), itt, exp_data_sn, max_xmit) {
                if let Some(f) = self.conns.get_mut(&id).and_then(|k| k.waiting.remove(&itt)) {
                    out.push((f.tx, p));
                }
            }
        }
        out
    }

    /// Send the response of task `itt`, reassigned from the kept connection `from` while
    /// still running, to `tx` once it is complete; returned at once if it is already.
    pub(crate) fn forward_when_done(
        &mut self,
        from: ConnId,
        itt: Itt,
        tx: Queue,
        exp_data_sn: DataSn,
        max_xmit: u32,
    ) -> Forwards {
        if let Some(p) = self.take_output(Some(from), itt, exp_data_sn, max_xmit) {
            return vec![(tx, p)];
        }
        if let Some(kept) = self.conns.get_mut(&from) {
            kept.waiting.insert(
                itt,
                Forward {
                    tx,
                    exp_data_sn,
                    max_xmit,
                },
            );
        }
        Vec::new()
    }

    /// The connection `id` is kept: its writer and its writes waiting for data.
    pub(crate) fn keep(
        &mut self,
        id: ConnId,
        cid: Cid,
        retained: Option<Arc<Mutex<Retained>>>,
        writes: Vec<Write<PendingWrite>>,
    ) {
        let kept = self.conns.entry(id).or_default();
        kept.cid = Some(cid);
        kept.retained = retained;
        kept.writes.extend(writes);
    }

    /// The initiator's last ExpStatSN for the kept connection `cid` (a Logout for its
    /// recovery, RFC 7143 §11.14, or a login restarting it, §11.12.8): the statuses below it
    /// were received; they and their tasks' Data-In are let go, so a TASK REASSIGN of a tag
    /// used again since cannot find them.
    pub(crate) fn acknowledge(&mut self, cid: Cid, exp_stat_sn: ironsan_proto::StatSn) {
        // The latest connection with the CID: StatSNs are numbered per connection.
        let latest = self
            .conns
            .iter_mut()
            .filter(|(_, k)| k.cid == Some(cid))
            .max_by_key(|(id, _)| **id);
        if let Some(r) = latest.and_then(|(_, k)| k.retained.as_ref()) {
            crate::lock(r).ack(exp_stat_sn);
        }
    }

    /// A new command with the tag `itt` arrived: the initiator has every earlier task with
    /// that tag (RFC 7143 §11.2.1.8), so nothing kept for one may answer a TASK REASSIGN.
    pub(crate) fn tag_reused(&mut self, itt: Itt) {
        for kept in self.conns.values_mut() {
            kept.parked.remove(&itt);
            kept.waiting.remove(&itt);
            if let Some(r) = &kept.retained {
                crate::lock(r).forget_task(itt);
            }
        }
    }

    /// Whether anything is kept (a cheap test before [`Orphans::tag_reused`]).
    pub(crate) fn is_empty(&self) -> bool {
        self.conns.is_empty()
    }

    /// Let go of what the connections `ids` left.
    pub(crate) fn forget(&mut self, ids: &[ConnId]) {
        for id in ids {
            self.conns.remove(id);
        }
    }

    pub(crate) fn clear(&mut self) {
        self.conns.clear();
    }

    pub(crate) fn take_write(&mut self, from: ConnId, itt: Itt) -> Option<Write<PendingWrite>> {
        let kept = self.conns.get_mut(&from)?;
        let i = kept.writes.iter().position(|w| w.itt == itt)?;
        Some(kept.writes.swap_remove(i))
    }

    /// The response of task `itt` to send on the connection it was reassigned to, from the
    /// kept connection `from` (any, when `None`): Data-In from `exp_data_sn` (0: all held)
    /// and the status, stamped anew there, its Data-In fitted to that connection's
    /// MaxRecvDataSegmentLength `max_xmit`. `None` until its status is held.
    pub(crate) fn take_output(
        &mut self,
        from: Option<ConnId>,
        itt: Itt,
        exp_data_sn: DataSn,
        max_xmit: u32,
    ) -> Option<Vec<OutPdu>> {
        let pdus = self.take_response(from, itt, exp_data_sn)?;
        let fitted = ironsan_proto::recovery::refit_data_in(
            pdus,
            max_xmit as usize,
            Segment::len,
            Segment::split_to,
        );
        Some(
            fitted
                .into_iter()
                .map(|(header, data)| OutPdu {
                    mode: mode_of(&header),
                    header,
                    data,
                })
                .collect(),
        )
    }

    fn take_response(
        &mut self,
        from: Option<ConnId>,
        itt: Itt,
        exp_data_sn: DataSn,
    ) -> Option<Vec<(Header, Segment)>> {
        // Newest connection first: a tag the initiator reused after an earlier reassignment
        // finds its latest task, not one an older connection left behind.
        let mut ids: Vec<ConnId> = self
            .conns
            .keys()
            .copied()
            .filter(|id| from.is_none_or(|f| f == *id))
            .collect();
        ids.sort_unstable_by(|a, b| b.cmp(a));
        for id in ids {
            let Some(kept) = self.conns.get_mut(&id) else {
                continue;
            };
            let done = kept
                .parked
                .get(&itt)
                .is_some_and(|v| v.iter().any(|p| carries_status(&p.header)));
            if done {
                let pdus = kept.parked.remove(&itt).unwrap_or_default();
                return Some(
                    pdus.into_iter()
                        .filter(|p| match &p.header {
                            Header::DataIn(d) => ironsan_proto::recovery::resent_on_reassign(
                                d,
                                exp_data_sn,
                                d.status.is_some(),
                            ),
                            _ => true,
                        })
                        .map(|p| (p.header, p.data))
                        .collect(),
                );
            }
            let retained = kept
                .retained
                .as_ref()
                .and_then(|r| crate::lock(r).reassign(itt, exp_data_sn));
            if let Some(v) = retained {
                return Some(
                    v.into_iter()
                        .map(|(header, data)| (header, Segment::Memory(data)))
                        .collect(),
                );
            }
        }
        None
    }
}

/// How a resumed response PDU is stamped on its new connection: the status takes that
/// connection's next StatSN (RFC 7143 §7.2.2).
fn mode_of(h: &Header) -> SnMode {
    if carries_status(h) {
        SnMode::Status
    } else {
        SnMode::Current
    }
}
