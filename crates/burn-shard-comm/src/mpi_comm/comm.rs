//! The [`MpiComm`] type: its MPI handles behind one lock ([`State`]), the abort flag and reason,
//! and `Drop`, which frees the handles only while that is still allowed (MPI not finalised, no
//! call abandoned).

use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use ::mpi::topology::SimpleCommunicator;

use super::process::mpi_calls;
use crate::CommError;
use crate::stats::StatsCounter;

/// Default time a collective may wait for the other ranks before [`CommError::MpiTimeout`]
/// (5 minutes, as the other backends).
pub const MPI_DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// One rank of the job's MPI world: a [`Collective`] for CPU processes started by `mpirun`.
///
/// ```no_run
/// use burn_shard_comm::{Collective, MpiComm};
/// let comm = MpiComm::init().unwrap(); // once per process
/// println!("rank {} of {}", comm.rank(), comm.world_size());
/// ```
///
/// Create one per process, preferably on the main thread. MPI is finalised when the process
/// exits normally (from `main` or `std::process::exit`), whatever still holds a handle. It may
/// be used from any thread: calls are serialised by a mutex, as `MPI_THREAD_SERIALIZED`
/// requires.
/// Tensors are copied to host `f32` and back, so any Burn device works (the CPU is the point).
///
/// [`Collective`]: crate::Collective
pub struct MpiComm {
    pub(super) rank: usize,
    pub(super) world_size: usize,
    pub(super) timeout: Duration,
    /// Every MPI call happens with this lock held. Dropped by hand: the handles are freed only
    /// while MPI is still initialised and no call was abandoned (see `Drop`).
    pub(super) state: Mutex<ManuallyDrop<State>>,
    /// Shared with every sub-group split from this communicator (and its world's): one abort
    /// notice, received by whichever group polls first, aborts them all.
    pub(super) abort: Arc<AbortState>,
    pub(super) stats: StatsCounter,
}

/// A process's abort flag and first reason, shared by its `MpiComm` and the sub-groups split
/// from it, which also share the job's control communicator.
#[derive(Default)]
pub(super) struct AbortState {
    aborted: AtomicBool,
    reason: Mutex<Option<String>>,
}

/// The MPI handles, used only with [`MpiComm::state`] locked.
pub(super) struct State {
    /// Collectives and their signatures.
    pub(super) data: SimpleCommunicator,
    /// Abort notices, so they never match a collective's messages. The job's: shared by every
    /// sub-group split from it, so a notice reaches every process whichever group it waits in.
    pub(super) control: Arc<SimpleCommunicator>,
    /// Calls made so far (the signature's call number).
    pub(super) seq: u64,
    /// A call was abandoned in flight: MPI may still use leaked buffers.
    pub(super) abandoned: bool,
}

// SAFETY: the MPI handles in `State` are only used with the `state` mutex held, so no two
// threads call MPI at the same time, which is what MPI_THREAD_SERIALIZED (checked in `init`)
// allows from any thread. The remaining fields are atomics, mutexes and plain values.
unsafe impl Send for MpiComm {}
// SAFETY: as for `Send`: every `&self` method that reaches MPI takes the `state` mutex first.
unsafe impl Sync for MpiComm {}

impl fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish()
    }
}

impl MpiComm {
    pub(super) fn state(&self) -> MutexGuard<'_, ManuallyDrop<State>> {
        // A panic while the lock was held cannot leave a call in flight (rsmpi aborts the
        // process when a pending request unwinds), so the handles stay usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The reason of an abort of this rank, or of one another rank told this one about.
    pub(super) fn check(&self) -> Result<(), CommError> {
        if self.abort.aborted.load(Ordering::SeqCst) {
            let reason = self.abort.reason.lock().unwrap_or_else(PoisonError::into_inner).clone();
            return Err(CommError::Aborted(reason.unwrap_or_default()));
        }
        Ok(())
    }

    /// Marks the group aborted with `reason` (the first reason wins); whether this call did it.
    pub(super) fn mark_aborted(&self, reason: String) -> bool {
        let mut slot = self.abort.reason.lock().unwrap_or_else(PoisonError::into_inner);
        let first = slot.is_none();
        if first {
            *slot = Some(reason);
        }
        self.abort.aborted.store(true, Ordering::SeqCst);
        first
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        let _calls = mpi_calls();
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        if state.abandoned || ::mpi::environment::is_finalized() {
            // Freeing a communicator with a call in flight, or after MPI_Finalize, is an MPI
            // error: leave the handles to the process's end.
            return;
        }
        // SAFETY: `state` is not used again (this is drop); it frees the collectives' communicator
        // and this handle of the shared control communicator (freed with its last handle).
        unsafe { ManuallyDrop::drop(state) };
    }
}
