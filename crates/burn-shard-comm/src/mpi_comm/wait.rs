//! Waiting for a non-blocking MPI call ([`MpiComm::wait`]): polled, spinning first, for
//! completion, abort notices, this rank's own abort and the timeout, with heartbeats once the
//! wait is long (`heartbeat.rs`: a timeout names the processes not heard from); on a failure
//! the call is abandoned and the other ranks are told.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ::mpi::request::{Request, StaticScope};

use super::comm::{MpiComm, State};
use super::heartbeat::Heartbeats;
use super::process::ABANDONED;
use crate::CommError;
use crate::call_sig::CallSig;

/// Polls of a pending call before the poll loop starts sleeping between tests (MPI progresses
/// a non-blocking collective only inside MPI calls, so the first polls spin).
const SPIN_POLLS: u32 = 1000;
/// Pause between polls after [`SPIN_POLLS`]: bounds the added latency of a slow collective.
const POLL_PAUSE: Duration = Duration::from_micros(100);

impl MpiComm {
    /// Waits for `request`, polling for abort notices, this rank's own abort and the timeout.
    /// On an error the request is abandoned: the caller must leave its buffers to MPI
    /// ([`Pinned`](super::pinned::Pinned) without `into_vec`).
    pub(super) fn wait<D: ?Sized>(
        &self,
        state: &mut State,
        mut request: Request<'static, D, StaticScope>,
        sig: &CallSig,
    ) -> Result<(), CommError> {
        let start = Instant::now();
        let mut polls = 0u32;
        // Dropped at return, with the lock still held (it may free a pending beat).
        let mut beats = Heartbeats::new(self.timeout);
        loop {
            match request.test() {
                Ok(_) => {
                    beats.discard_pending(state);
                    return Ok(());
                }
                Err(pending) => request = pending,
            }
            self.receive_notice(state);
            beats.poll(state);
            let failure = match self.check() {
                Err(aborted) => Some(aborted),
                Ok(()) if start.elapsed() >= self.timeout => Some(CommError::MpiTimeout {
                    rank: self.rank,
                    op: sig.to_string(),
                    waited: start.elapsed(),
                    silent: beats.silent(state),
                }),
                Ok(()) => None,
            };
            if let Some(err) = failure {
                // MPI cannot cancel a collective: forget the request (its Drop would panic) and
                // leave MPI the buffers; the group is dead, so this happens at most once.
                std::mem::forget(request);
                state.abandoned = true;
                ABANDONED.store(true, Ordering::SeqCst);
                // A timeout's message starts with its rank already.
                if !matches!(err, CommError::Aborted(_)) && self.mark_aborted(err.to_string()) {
                    self.send_notices(state, &err.to_string());
                }
                return Err(err);
            }
            polls = polls.saturating_add(1);
            if polls < SPIN_POLLS {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(POLL_PAUSE);
            }
        }
    }
}
