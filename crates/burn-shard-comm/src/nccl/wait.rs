//! Waiting for a collective: until NCCL has issued it (`ncclInProgress` settled), then until its
//! stream is done, polling `ncclCommGetAsyncError` and an abort request all along and failing at
//! the communicator's timeout.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::comm::{NcclComm, Raw};
use super::state::{CommState, async_state};
use crate::CommError;

/// How often a collective polls its stream and `ncclCommGetAsyncError` while it waits.
const POLL: Duration = Duration::from_micros(50);

impl NcclComm {
    /// `ncclCommGetAsyncError`: `Ok(true)` while NCCL is still issuing (non-blocking
    /// communicators), `Ok(false)` when all is issued and no error happened; an error for an
    /// asynchronous NCCL error or a pending abort request (the caller then aborts).
    fn in_progress(&self, raw: &Raw, op: &str) -> Result<bool, CommError> {
        if self.abort_requested.load(Ordering::SeqCst) {
            return Err(self.aborted_error());
        }
        match async_state(raw.comm) {
            CommState::Ready => Ok(false),
            CommState::InProgress => Ok(true),
            CommState::Failed(what) => Err(CommError::Backend(format!(
                "rank {}: NCCL reported {what} during {op}, so the communicator was aborted; a peer may have died \
                 or the network failed (set NCCL_DEBUG=WARN for NCCL's reason)",
                self.rank
            ))),
        }
    }

    fn check_deadline(&self, op: &str, start: Instant) -> Result<(), CommError> {
        let waited = start.elapsed();
        if waited > self.timeout {
            return Err(CommError::NcclTimeout {
                rank: self.rank,
                op: op.to_string(),
                waited,
            });
        }
        Ok(())
    }

    /// Waits until NCCL has issued everything to the stream: a non-blocking communicator may
    /// return `ncclInProgress` from any call and then "users must query the communicator state
    /// until it becomes ncclSuccess before calling another NCCL function", and before CUDA calls
    /// on the stream (NCCL user guide, "Nonblocking Group Operation"). Blocking communicators
    /// return at once.
    pub(super) fn wait_ready(&self, raw: &Raw, op: &str, start: Instant) -> Result<(), CommError> {
        while self.in_progress(raw, op)? {
            self.check_deadline(op, start)?;
            std::thread::sleep(POLL);
        }
        Ok(())
    }

    /// Waits for the stream, polling `ncclCommGetAsyncError` too: an operation hit by a network
    /// error never completes and reports only there (NCCL user guide, "Asynchronous errors").
    pub(super) fn wait_stream(&self, raw: &Raw, op: &str, start: Instant) -> Result<(), CommError> {
        let event = raw
            .stream
            .record_event(None)
            .map_err(|e| CommError::Backend(format!("rank {}: {op}: cannot record a CUDA event: {e:?}", self.rank)))?;
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    return Err(CommError::Backend(format!(
                        "rank {}: {op} failed on the GPU: {e:?}",
                        self.rank
                    )));
                }
            }
            self.in_progress(raw, op)?;
            self.check_deadline(op, start)?;
            std::thread::sleep(POLL);
        }
    }
}
