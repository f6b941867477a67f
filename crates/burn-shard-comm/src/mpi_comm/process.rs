//! What is MPI's per process rather than per communicator: the lock every MPI call of the
//! process holds, the flag that a call was abandoned, `MPI_Finalize` at process exit (skipped
//! after an abandoned call or a panic), and whether `mpirun` started this process.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Set once a call was abandoned in flight, or a thread panicked: `MPI_Finalize` would wait
/// for a call (or for ranks) that will never come, so the exit skips it and `mpirun` ends the
/// job within seconds.
pub(super) static ABANDONED: AtomicBool = AtomicBool::new(false);

/// Held by every MPI call of this process (one `MpiComm` per process), by `Drop` and by the
/// exit handler, so `MPI_Finalize` never runs alongside another thread's call.
static MPI_CALLS: Mutex<()> = Mutex::new(());

pub(super) fn mpi_calls() -> MutexGuard<'static, ()> {
    MPI_CALLS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Finalises MPI at process exit (`exit`, or a return from `main`), unless a call was abandoned,
/// a thread panicked, or another thread is inside an MPI call right now.
pub(super) extern "C" fn finalize_at_exit() {
    let Ok(_calls) = MPI_CALLS.try_lock() else {
        return; // a thread is inside MPI: finalising now would break MPI_THREAD_SERIALIZED
    };
    if !ABANDONED.load(Ordering::SeqCst) && !::mpi::environment::is_finalized() {
        // SAFETY: MPI was initialised (this handler is registered by `MpiComm::init` after
        // that) and not finalised; holding `MPI_CALLS` means no other thread is in an MPI call,
        // and none can start one (each checks `is_finalized` under the same lock).
        unsafe {
            ::mpi::ffi::MPI_Finalize();
        }
    }
}

/// Whether this process was started by an MPI launcher (`mpirun`/`mpiexec` of OpenMPI, MPICH
/// or any PMIx launcher), judged from the variables they set (`OMPI_COMM_WORLD_SIZE`,
/// `PMI_SIZE`, `PMIX_RANK`). Never initialises MPI.
pub fn launched_by_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|var| std::env::var_os(var).is_some())
}
