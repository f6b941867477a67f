//! Starting MPI ([`MpiComm::init`]): `MPI_Init_thread` with `MPI_THREAD_SERIALIZED`, the checks
//! that this process can take part (started by `mpirun`, a thread-capable MPI), finalisation
//! registered at exit, and the two communicators (collectives, abort notices).

use std::mem::ManuallyDrop;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::Duration;

use ::mpi::traits::*;

use super::comm::{MPI_DEFAULT_TIMEOUT, MpiComm, State};
use super::process::{ABANDONED, finalize_at_exit, launched_by_mpirun};
use crate::CommError;
use crate::stats::StatsCounter;

impl MpiComm {
    /// Initialises MPI (`MPI_Init_thread` with `MPI_THREAD_SERIALIZED`), registers its
    /// finalisation at process exit, and joins its world: the rank and world size are
    /// `mpirun`'s. Without `mpirun` it is a world of one process.
    ///
    /// # Errors
    /// [`CommError::Unavailable`] when MPI was already initialised in this process (one
    /// `MpiComm` per process), or when the MPI library cannot serve calls from several threads
    /// one at a time (it provides less than `MPI_THREAD_SERIALIZED`).
    pub fn init() -> Result<Self, CommError> {
        let (universe, threading) =
            ::mpi::initialize_with_threading(::mpi::Threading::Serialized).ok_or_else(|| {
                CommError::Unavailable(
                    "MPI is already initialised in this process: create one MpiComm per process and share it (Arc)"
                        .into(),
                )
            })?;
        if !launched_by_mpirun() && std::env::var_os("WORLD_SIZE").is_some_and(|w| w != "1") {
            return Err(CommError::Unavailable(
                "WORLD_SIZE is set but this process was not started by mpirun: a launcher such as burn-shard-run \
                 or torchrun starts processes that MPI cannot join (each would train alone); start them with \
                 `mpirun -np N`, or use NcclComm::from_env under burn-shard-run"
                    .into(),
            ));
        }
        if matches!(threading, ::mpi::Threading::Single | ::mpi::Threading::Funneled) {
            return Err(CommError::Unavailable(format!(
                "the MPI library provides only {threading:?} threading, burn-shard needs Serialized: \
                 use an MPI built with thread support (Debian's OpenMPI has it)"
            )));
        }
        let world = universe.world();
        let (rank, world_size) = (world.rank() as usize, world.size() as usize);
        // Finalised by `finalize_at_exit`, not by rsmpi's `Universe` drop (see the module doc).
        std::mem::forget(universe);
        // SAFETY: registers a plain `extern "C" fn` without arguments, as `atexit` requires.
        if unsafe { libc::atexit(finalize_at_exit) } != 0 {
            tracing::warn!("cannot register MPI_Finalize at exit: mpirun may report an abnormal exit");
        }
        // A panic anywhere means this rank will not reach its next collective: skip the
        // finalisation (which would wait for the others until their timeout) so that mpirun
        // ends the job as soon as this process exits.
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            ABANDONED.store(true, Ordering::SeqCst);
            previous(info);
        }));
        Ok(Self {
            rank,
            world_size,
            timeout: MPI_DEFAULT_TIMEOUT,
            state: Mutex::new(ManuallyDrop::new(State {
                data: world.duplicate(),
                // Shared with the sub-groups split from this world; used, cloned and dropped
                // only under the process-wide MPI lock (see `State`).
                #[allow(clippy::arc_with_non_send_sync)]
                control: std::sync::Arc::new(world.duplicate()),
                seq: 0,
                abandoned: false,
            })),
            abort: std::sync::Arc::default(),
            stats: StatsCounter::default(),
        })
    }

    /// Sets how long one collective may wait for the other ranks (default 5 minutes).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}
