//! Running a delivered command on the SCSI layer and turning its outcome into PDUs.
//!
//! A command's future (`scsi::Target::execute` plus building the response) is polled once
//! inline: most commands (RAM, page-cache hits of file LUNs, tmpfs files, errors) finish right
//! there, with no task and no wake-up, and their response joins the reader's batch. A command
//! that must wait (backend I/O in flight, the transmit budget, a range lock) becomes a task of
//! its own.

use super::write::WriteData;
use super::{Connection, PollingFlag};
use crate::iscsi::task::Slot;
use crate::iscsi::writer::{Out, OutPdu};
use crate::metrics::{Class, Stamp, Timing};
use crate::LiveTarget;
use bytes::Bytes;
use ironsan_proto::negotiate::ConnParams;
use ironsan_proto::pdu::*;
use ironsan_proto::task::{response_pdus, Outcome};
use ironsan_proto::DataSn;
use ironsan_scsi::{Command, Response};
use std::future::Future;
use std::sync::Arc;

/// The smallest read sent straight from a file LUN's page cache or mapping (below it the
/// `cachestat` a mapped read asks costs about what the copy saves), and the smallest
/// MaxRecvDataSegmentLength for which `sendfile` is used: each Data-In segment then costs a
/// `sendfile` (and a `sendmsg` for its header) instead of two copies; below this, copying
/// into one batched vectored write is cheaper (docs/PERFORMANCE.md).
const IN_PLACE_MIN: u32 = 64 * 1024;

/// Whether and how a connection sends large file-LUN reads without copying them
/// ([`crate::ZeroCopyReads`]): never with a data digest (it needs the bytes); `sendfile` only
/// with segments of at least [`IN_PLACE_MIN`] and, in `auto`, on a connection whose congestion
/// control does not pace inside TCP (BBR), where a mapping of a tmpfs file is sent from
/// instead (docs/PERFORMANCE.md). Reads of nothing stored may go as the zero page with
/// `sendfile` in `on` and `auto` alike, given segments of at least [`IN_PLACE_MIN`].
pub(super) fn in_place_reads(
    mode: crate::ZeroCopyReads,
    params: &ConnParams,
    fd: std::os::fd::RawFd,
) -> Option<ironsan_backend::InPlaceRead> {
    use crate::ZeroCopyReads as Z;
    use ironsan_backend::SendFrom;
    if params.data_digest {
        return None;
    }
    let big_segments = params.max_xmit_data_segment_length >= IN_PLACE_MIN;
    let from = match mode {
        Z::Off => return None,
        Z::On if big_segments => SendFrom::PageCache,
        Z::On => return None,
        Z::Mapped => SendFrom::Mapping,
        Z::Auto => {
            let paced = crate::sys::tcp_congestion(fd).is_ok_and(|cc| cc.starts_with("bbr"));
            if big_segments && !paced {
                SendFrom::PageCache
            } else {
                SendFrom::Mapping
            }
        }
    };
    Some(ironsan_backend::InPlaceRead {
        min: IN_PLACE_MIN,
        from,
        zero_page: big_segments && mode != Z::Mapped,
    })
}

/// Turn a SCSI response into iSCSI PDUs ([`response_pdus`]: Data-In with the status collapsed
/// into the last one when there is no sense data, and/or a SCSI Response with the sense),
/// slicing the read data (never copying it) into the Data-In segments.
fn response(
    cmd: &ScsiCommand,
    resp: Response,
    write_needed: Option<u32>,
    exp_data_sn: DataSn,
    max_xmit: u32,
    max_burst: u32,
) -> Vec<OutPdu> {
    let produced = resp.data_in.len() as u32;
    let status = resp.status.0;
    let outcome = Outcome {
        status,
        sense: resp.sense.is_some(),
        produced,
        write_needed,
        exp_data_sn,
    };
    let (send, pdus) = response_pdus(cmd, outcome, max_xmit, max_burst);
    // Moved, not cloned: a clone of a freshly frozen buffer allocates its shared header.
    let mut data = resp.data_in;
    data.truncate(send as usize);
    let sense = resp.sense;
    pdus.map(|p| {
        let segment = if p.data_len > 0 {
            // Each segment is split off the front; the last (usually the only) one takes what
            // is left without a clone.
            data.split_to(p.data_len as usize)
        } else if matches!(p.header, Header::ScsiResponse(_)) {
            sense
                .as_deref()
                .map(sense_segment)
                .unwrap_or_default()
                .into()
        } else {
            ironsan_scsi::DataIn::default()
        };
        OutPdu {
            header: p.header,
            data: segment,
            mode: if p.status {
                SnMode::Status
            } else {
                SnMode::Current
            },
        }
    })
    .collect()
}

impl Connection {
    /// Run a delivered command whose data is complete (normal sessions only). It must still
    /// have its entry in the session's task table (a task management function or the end of
    /// the session may have removed it, which aborted it: then it does not run).
    pub(super) fn spawn_exec(
        &mut self,
        cmd: ScsiCommand,
        cdb: Bytes,
        data_out: WriteData,
        exp_data_sn: DataSn,
        slot: Slot,
        t_header: Stamp,
    ) {
        // A command without Data-Out comes here straight from its header: no second clock
        // read for a stage that is empty.
        let t_data = if cmd.write { Stamp::now() } else { t_header };
        let Some(target) = self.session.target.clone() else {
            return;
        };
        let hold = self.probe_hold(&target, &cmd, &cdb, t_data);
        let session = Arc::clone(&self.session);
        let shared = Arc::clone(&self.shared);
        let scmd_op = cdb.first().copied().unwrap_or(0);
        let max_xmit = self.params.max_xmit_data_segment_length;
        let max_burst = session.params.max_burst_length;
        let in_place = self.in_place;
        let lun = cmd.lun.number().unwrap_or(u64::MAX);
        let itt = cmd.itt;
        // The LUN map as of this command: a LUN removed meanwhile still finishes this command.
        let scsi = target.scsi();
        let metrics = self.metrics_of(&target, &scsi, lun);
        let class = Class::of(cmd.read, cmd.write);
        let (data_out, placed) = match data_out {
            WriteData::Buffer(b) => (b, None),
            WriteData::Placed(p) => (Bytes::new(), Some(p)),
        };
        let write_bytes = match &placed {
            Some(p) => p.target().len(),
            None => data_out.len(),
        };
        let write_needed = if cmd.write {
            let bs = scsi.lun(lun).map(|l| l.block_size()).unwrap_or(512);
            Some(ironsan_scsi::data_out_len(&cdb, bs).unwrap_or(write_bytes as u32))
        } else {
            None
        };
        let write_bytes = write_bytes as u64;
        // A read first takes its size from the connection's transmit budget (returned when the
        // writer has sent its Data-In), holding its CmdSN slot while it waits.
        let budget = (cmd.read && cmd.expected_data_transfer_length > 0).then(|| {
            let n =
                (cmd.expected_data_transfer_length as usize).min(super::tx_budget_bytes(&shared));
            (Arc::clone(&self.tx_budget), n as u32)
        });
        // The flag is set before the task's entry is claimed: an abort that removes the entry
        // after the claim sees it set and makes the LU's reads wait until the reader is out
        // of the inline poll. Cleared however this function ends (a panic in the inline poll
        // included): a flag left set would make the LU's reads and writes wait for an aborted
        // task forever.
        let _polling = PollingFlag::set(&self.polling);
        if !self.claim(itt) {
            // The session has ended (reinstated or reset away), or a task management function
            // aborted the command before it ran: it never runs.
            return;
        }
        let probe_wait = shared.cfg.limits.nop_timeout;
        let body = {
            let session = Arc::clone(&session);
            async move {
                // Read after a silence on a cluster node: run only once the initiator has
                // answered a ping sent after it (the connection is then proven live).
                let proven = match hold {
                    Some((mut proofs, seen)) => {
                        tokio::time::timeout(probe_wait, proofs.wait_for(|n| *n > seen))
                            .await
                            .is_ok_and(|r| r.is_ok())
                    }
                    None => true,
                };
                // Execution starts when the budget is had: no second clock read when it was
                // there at once (the usual case).
                let (permit, t_exec) = match budget {
                    Some((b, n)) => match Arc::clone(&b).try_acquire_many_owned(n) {
                        Ok(p) => (Some(p), t_data),
                        Err(_) => {
                            let p = b.acquire_many_owned(n).await.ok()?;
                            (Some(p), Stamp::now())
                        }
                    },
                    None => (None, t_data),
                };
                let resp = match placed {
                    _ if !proven => {
                        tracing::warn!(
                            initiator = %session.initiator_name,
                            "no answer to a NOP-In after a silence: a write to a shared LUN is refused"
                        );
                        Response::check_condition(ironsan_scsi::SenseReason::NotAccessible(
                            ironsan_scsi::AccessState::Unavailable,
                        ))
                    }
                    // The data is in place; the command's checks were made before it came.
                    Some(p) => match p.finish() {
                        Ok(()) => Response::good(Bytes::new()),
                        Err(reason) => Response::check_condition(reason),
                    },
                    None => {
                        let scmd = Command {
                            cdb,
                            data_out,
                            expected_in_len: cmd.expected_data_transfer_length,
                            in_place,
                        };
                        scsi.execute(lun, &session.nexus, scmd).await
                    }
                };
                let t_done = Stamp::now();
                // Whoever removes the entry owns the completion: TMF or us, never both.
                session.with_core(|c| c.remove(itt))?;
                if scmd_op == ironsan_scsi::opcode::PERSISTENT_RESERVE_OUT {
                    crate::iscsi::session::abort_preempted(&shared.sessions, &target, lun);
                }
                let bytes = match class {
                    Class::Read => (resp.data_in.len() as u64)
                        .min(u64::from(cmd.expected_data_transfer_length)),
                    Class::Write => write_bytes,
                    Class::Other => 0,
                };
                let pdus = response(&cmd, resp, write_needed, exp_data_sn, max_xmit, max_burst);
                drop(slot);
                let timing = metrics.map(|lun| Timing {
                    lun,
                    class,
                    bytes,
                    header: t_header,
                    data: t_data,
                    exec: t_exec,
                    done: t_done,
                    queued: Stamp::now(),
                });
                Some(Out::Command {
                    pdus,
                    permit,
                    timing,
                })
            }
        };
        self.run_inline(body, itt, lun);
        // Out of the inline poll (completed, or a task that an abort now knows about): the
        // flag clears as `_polling` drops.
    }

    /// The latency counters of `lun`, only for LUNs that exist (an initiator cannot make
    /// entries); cached per connection.
    fn metrics_of(
        &mut self,
        target: &crate::LiveTarget,
        scsi: &ironsan_scsi::Target,
        lun: u64,
    ) -> Option<Arc<crate::metrics::LunMetrics>> {
        match self.lun_metrics.get(&lun) {
            Some(m) => Some(Arc::clone(m)),
            None if scsi.lun(lun).is_some() => {
                let m = target.lun_metrics(lun);
                self.lun_metrics.insert(lun, Arc::clone(&m));
                Some(m)
            }
            None => None,
        }
    }

    /// Claim the delivered task `itt` to run it, telling an abort from another thread that
    /// this reader polls it inline; `false`: it was aborted or the session ended.
    fn claim(&mut self, itt: Itt) -> bool {
        let polling = Arc::clone(&self.polling);
        self.sess(|c| match c.claim(itt) {
            Some(r) => {
                r.polling = polling;
                true
            }
            None => false,
        })
    }

    /// Most commands (RAM, the page-cache fast path of file LUNs, errors) complete the first
    /// time they are polled: run them here, with no task, no wake-up and no queue hop, and
    /// keep the response for the writer's next batch. The rest become tasks, whose abort
    /// handle goes into the task's entry.
    fn run_inline(
        &mut self,
        body: impl Future<Output = Option<Out>> + Send + 'static,
        itt: Itt,
        lun: u64,
    ) {
        let mut body = Box::pin(body);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match body.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(Some(out)) => self.keep(out),
            std::task::Poll::Ready(None) => {}
            std::task::Poll::Pending => {
                let tx = self.tx.clone();
                let (session, id) = (Arc::clone(&self.session), self.id);
                // Polled again by the task, every future in `body` registers the task's
                // waker in place of the no-op one.
                let handle = self.tasks.spawn(async move {
                    if let Some(out) = body.await {
                        if let Err(e) = tx.send(out).await {
                            // Its connection has gone: kept for a TASK REASSIGN at
                            // ErrorRecoveryLevel 2 (`conn::reassign`).
                            session.park(id, e.0);
                        }
                    }
                });
                let mut handle = Some(handle);
                self.sess(|c| {
                    if let Some(t) = c.task_mut(itt) {
                        t.payload.abort = handle.take();
                    }
                });
                if let Some(handle) = handle {
                    // A task management function took the entry while the command was
                    // polled here: it is aborted, like every other task it found.
                    handle.abort();
                    if let Some(lu) = scsi_lu(&self.session, lun) {
                        lu.task_aborted(move || handle.is_finished());
                    }
                }
            }
        }
    }

    /// On a cluster node, a command that changes a shared medium read while the connection
    /// is unproven (after a silence: [`super::Probing`]) waits for the initiator's answer to
    /// a ping, which is sent now if it has not been: the proofs to wait on and how many there
    /// were. `None`: it runs at once.
    fn probe_hold(
        &mut self,
        target: &LiveTarget,
        cmd: &ScsiCommand,
        cdb: &Bytes,
        t_data: Stamp,
    ) -> Option<(tokio::sync::watch::Receiver<u64>, u64)> {
        let epoch = self.epoch;
        let p = self.probe.as_mut()?;
        // The end of the command's data is a receive too: a PDU whose bytes took longer than
        // the gap to come leaves the connection unproven.
        p.core.received(t_data.since(epoch) / 1_000_000);
        if !p.core.unproven() || !ironsan_scsi::changes_medium(cdb) {
            return None;
        }
        let lun = cmd.lun.number()?;
        target.scsi().lun(lun)?.config().cluster.as_ref()?;
        let ping = p.core.ping();
        let hold = (p.proofs.subscribe(), p.core.proofs());
        if let Some(ping) = ping {
            tracing::debug!(
                initiator = %self.session.initiator_name,
                cid = self.cid,
                "a write to a shared LUN read after a silence waits for the initiator's answer to a NOP-In"
            );
            self.shared
                .stats
                .probes
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.keep(Out::Pdus(vec![OutPdu::current(ping, Bytes::new())]));
        }
        Some(hold)
    }

    /// Complete a command that failed before it ran, if its entry in the task table is still
    /// there to take (else a task management function aborted it: no response).
    pub(super) fn finish_waiting(
        &mut self,
        cmd: ScsiCommand,
        resp: Response,
        exp_data_sn: DataSn,
        slot: Slot,
    ) {
        let itt = cmd.itt;
        if self.sess(|c| c.remove(itt)).is_none() {
            return;
        }
        let pdus = response(
            &cmd,
            resp,
            None,
            exp_data_sn,
            self.params.max_xmit_data_segment_length,
            self.session.params.max_burst_length,
        );
        drop(slot);
        self.keep(Out::Pdus(pdus));
    }
}

fn scsi_lu(
    session: &crate::iscsi::session::Session,
    lun: u64,
) -> Option<Arc<ironsan_scsi::LogicalUnit>> {
    session
        .target
        .as_ref()
        .and_then(|t| t.scsi().lun(lun).cloned())
}
