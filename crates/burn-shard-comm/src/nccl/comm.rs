//! The [`NcclComm`] type: the raw communicator and its stream behind one lock ([`Raw`]), the abort
//! state, and what every collective does with them first (fail fast once aborted, take the lock,
//! abort under it), plus `Drop`, which destroys a healthy communicator and aborts any other.

use std::fmt;
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use burn::tensor::Device;
use cudarc::driver::CudaStream;
use cudarc::nccl::{result as nccl, sys as ncclsys};

use super::state::{CommState, async_state};
use crate::CommError;
use crate::stats::StatsCounter;

/// Default time a collective may take before the communicator is aborted (5 minutes).
pub const NCCL_DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The raw NCCL communicator and the stream its collectives run on. Only reachable through
/// the lock `NcclComm::raw` (or `&mut NcclComm` in `Drop`), so one thread at a time uses it.
pub(super) struct Raw {
    /// A communicator created by `ncclCommInitRank(Config)`; null once aborted or destroyed, so a
    /// freed handle is never passed to NCCL again.
    pub(super) comm: ncclsys::ncclComm_t,
    pub(super) stream: Arc<CudaStream>,
}

// SAFETY: `ncclComm_t` is a plain pointer that NCCL lets any thread use, provided "only one
// thread operates the communicator at a time" and one thread issues all the operations of a
// group (NCCL user guide, "Thread Safety"). A `Raw` is only reached through `NcclComm::raw`, a
// `Mutex` held for every NCCL call on it, from the group's start to its end (and for the wait
// that follows), or through `&mut NcclComm` in `Drop`: moving it to another thread never lets
// two threads call NCCL on it at once. `Arc<CudaStream>` is already `Send + Sync` (cudarc binds
// the stream's context to the calling thread itself). `Raw` is not `Sync`: sharing goes through
// the `Mutex`, which makes `NcclComm` `Send + Sync` with no further `unsafe impl`.
unsafe impl Send for Raw {}

/// One rank of an NCCL communicator, bound to one CUDA device.
///
/// `Send + Sync`: share it between threads (`Arc<dyn Collective>`); every call locks the
/// communicator for its whole duration (enqueue and wait), so concurrent calls are serialised,
/// as NCCL requires. [`Collective::abort`] from another thread stops a collective in progress
/// within a poll interval (non-blocking communicators, NCCL ≥ 2.14). Two `NcclComm`s on the same
/// GPU must not run collectives concurrently from different threads (NCCL's thread-safety rules
/// cover communicators of one device too): share one handle instead.
///
/// [`Collective::abort`]: crate::Collective::abort
pub struct NcclComm {
    /// The communicator and its stream: every NCCL call and every use of the stream holds it.
    pub(super) raw: Mutex<Raw>,
    /// Set (before the lock is taken) by [`Collective::abort`](crate::Collective::abort) and by
    /// every internal abort; the thread holding `raw` checks it between polls and aborts the
    /// communicator itself.
    pub(super) abort_requested: AtomicBool,
    /// Why the communicator was aborted (the first reason given).
    pub(super) abort_reason: OnceLock<String>,
    /// Created with `blocking = 0` (NCCL ≥ 2.14); informational (NCCL_COMM_BLOCKING=1 in the
    /// environment makes NCCL create it blocking anyway, which the code handles the same way).
    pub(super) nonblocking: bool,
    pub(super) rank: usize,
    pub(super) world_size: usize,
    pub(super) device_index: usize,
    pub(super) device: Device,
    pub(super) timeout: Duration,
    pub(super) stats: StatsCounter,
}

const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<NcclComm>();
};

impl fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device_index", &self.device_index)
            .field("nonblocking", &self.nonblocking)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl NcclComm {
    fn abort_reason(&self) -> &str {
        self.abort_reason.get().map_or("no reason given", String::as_str)
    }

    pub(super) fn aborted_error(&self) -> CommError {
        CommError::Aborted(format!(
            "rank {}: the NCCL communicator was aborted: {}",
            self.rank,
            self.abort_reason()
        ))
    }

    /// Fails fast, without the lock, once an abort was requested or done.
    pub(super) fn check(&self) -> Result<(), CommError> {
        if self.abort_requested.load(Ordering::SeqCst) {
            return Err(self.aborted_error());
        }
        Ok(())
    }

    /// Locks the communicator for one collective. A lock poisoned by a thread that panicked in
    /// the middle of a collective (leaving it half issued) aborts the communicator, as does a
    /// pending abort request; both then return [`CommError::Aborted`].
    pub(super) fn acquire(&self) -> Result<MutexGuard<'_, Raw>, CommError> {
        let mut raw = match self.raw.lock() {
            Ok(raw) => raw,
            Err(poisoned) => {
                let mut raw = poisoned.into_inner();
                self.abort_locked(&mut raw, "a thread panicked while it was using this NCCL communicator");
                raw
            }
        };
        if !raw.comm.is_null() && self.abort_requested.load(Ordering::SeqCst) {
            self.abort_locked(&mut raw, "abort requested");
        }
        if raw.comm.is_null() {
            return Err(self.aborted_error());
        }
        Ok(raw)
    }

    /// Aborts the communicator unless it already is, and records `reason` if it is the first
    /// one. The caller holds the lock: `raw` is its guard's content.
    pub(super) fn abort_locked(&self, raw: &mut Raw, reason: &str) {
        let _ = self.abort_reason.set(reason.to_string());
        self.abort_requested.store(true, Ordering::SeqCst);
        if raw.comm.is_null() {
            return;
        }
        tracing::error!(
            rank = self.rank,
            "aborting the NCCL communicator: {}",
            self.abort_reason()
        );
        // SAFETY: `raw.comm` is non-null, so it is the communicator `ncclCommInitRank(Config)`
        // returned and neither `ncclCommAbort` nor `ncclCommDestroy` has run on it (both null
        // it). The caller holds the lock, so no other thread is inside an NCCL call on this
        // communicator, which `ncclCommAbort` requires ("Fault Tolerance"); this thread is not
        // inside one either (collectives call this only after their NCCL calls returned).
        // `ncclCommAbort` may run during initialisation, communication or with work in flight:
        // it stops that work and frees the communicator.
        if let Err(e) = unsafe { nccl::comm_abort(raw.comm) } {
            tracing::warn!(rank = self.rank, "ncclCommAbort returned {:?}", e.0);
        }
        raw.comm = ptr::null_mut();
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let poisoned = self.raw.is_poisoned();
        let raw = self.raw.get_mut().unwrap_or_else(PoisonError::into_inner);
        if raw.comm.is_null() {
            return;
        }
        // Every collective returned after its GPU work completed or after aborting, so nothing
        // is in flight. A healthy communicator is destroyed; one with an asynchronous error, or
        // left by a panicking thread, is aborted (NCCL user guide, "Error handling").
        let healthy = !poisoned && matches!(async_state(raw.comm), CommState::Ready);
        if healthy {
            // SAFETY: `raw.comm` is live (non-null) and `&mut self` excludes every other user;
            // it is nulled right after, so it is never used again.
            if let Err(e) = unsafe { nccl::comm_destroy(raw.comm) } {
                tracing::warn!(rank = self.rank, "ncclCommDestroy returned {:?}", e.0);
            }
        } else {
            // SAFETY: as for `comm_destroy` above.
            let _ = unsafe { nccl::comm_abort(raw.comm) };
        }
        raw.comm = ptr::null_mut();
    }
}
