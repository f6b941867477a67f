//! Aborting the group ([`MpiComm::abort_group`], behind `Collective::abort`): the notices a
//! failing rank sends to every other rank on the control communicator, how a rank picks one up,
//! and [`MpiComm::reject`] for a precondition every rank checks.

use ::mpi::request::StaticScope;
use ::mpi::traits::*;

use super::comm::{MpiComm, State};
use super::pinned::Pinned;
use super::process::mpi_calls;
use crate::CommError;

/// Tag of the abort notices on the control communicator.
const ABORT_TAG: i32 = 1;

impl MpiComm {
    /// Reads one pending abort notice from another rank, if any, and aborts this rank with it.
    pub(super) fn receive_notice(&self, state: &State) {
        if let Some(probed) = state.control.any_process().immediate_matched_probe_with_tag(ABORT_TAG) {
            let (bytes, status) = probed.matched_receive_vec::<u8>();
            let reason = String::from_utf8_lossy(&bytes).into_owned();
            self.mark_aborted(notice_text(status.source_rank(), &reason));
        }
    }

    /// Sends `reason` to every other process of the job on the control communicator (the
    /// job's, also for a sub-group: see [`State::control`]). Never blocks: the sends are not
    /// waited for (a peer may have failed too), and their buffers are never freed.
    pub(super) fn send_notices(&self, state: &State, reason: &str) {
        let (me, processes) = (state.control.rank(), state.control.size());
        for peer in (0..processes).filter(|&p| p != me) {
            let notice = Pinned::new(reason.as_bytes().to_vec());
            // SAFETY: the notice is never taken back, so it stays allocated for as long as
            // MPI may send it; the forgotten request only leaks MPI's bookkeeping of it.
            let request = unsafe {
                state
                    .control
                    .process_at_rank(peer)
                    .immediate_send_with_tag(StaticScope, notice.as_static(), ABORT_TAG)
            };
            std::mem::forget(request);
        }
    }

    /// Fails (and aborts the group, so the peers fail too) on a precondition every rank checks.
    pub(super) fn reject(&self, err: CommError) -> CommError {
        self.abort_group(&format!("rank {}: {err}", self.rank));
        err
    }

    /// `Collective::abort`: marks this rank aborted and sends `reason` to every other rank.
    pub(super) fn abort_group(&self, reason: &str) {
        if !self.mark_aborted(reason.to_string()) {
            return; // already aborted: the notices went out then, or the peers know
        }
        // A call of another thread polling with the lock held sees the flag and returns.
        let _calls = mpi_calls();
        if ::mpi::environment::is_finalized() {
            return;
        }
        let state = self.state();
        self.send_notices(&state, reason);
    }
}

/// The abort reason a rank reads from `source`'s notice: the reason as sent when it starts by
/// naming its rank (`rank 1 failed: ...`, most do), else `rank S aborted: REASON` (never `rank
/// 1 aborted: rank 1 failed: ...`).
fn notice_text(source: i32, reason: &str) -> String {
    let names_itself = reason
        .strip_prefix(&format!("rank {source}"))
        .is_some_and(|rest| rest.starts_with([' ', ':']));
    match names_itself {
        true => reason.to_string(),
        false => format!("rank {source} aborted: {reason}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_notice_names_its_rank_once() {
        assert_eq!(
            notice_text(1, "rank 1 failed: out of memory"),
            "rank 1 failed: out of memory"
        );
        assert_eq!(notice_text(1, "rank 1: invalid mesh"), "rank 1: invalid mesh");
        assert_eq!(notice_text(1, "rank 10 failed: x"), "rank 1 aborted: rank 10 failed: x");
        assert_eq!(notice_text(2, "the loss is NaN"), "rank 2 aborted: the loss is NaN");
    }
}
