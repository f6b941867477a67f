//! Errors of the collectives.

use std::time::Duration;

/// Why a collective failed. Every variant says what to change.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum CommError {
    /// Ranks issued different collectives at the same point of their program.
    #[error(
        "collective mismatch at call #{seq}: rank {rank} called {ours} but rank {peer} called {theirs}; \
         every rank must issue the same collectives in the same order with the same lengths and dtypes"
    )]
    Mismatch {
        /// Index of the collective call (0-based, per group).
        seq: u64,
        /// The rank that detected the mismatch.
        rank: usize,
        /// What that rank called.
        ours: String,
        /// The neighbouring rank whose call differed.
        peer: usize,
        /// What the neighbour called.
        theirs: String,
    },
    /// A length that must be a multiple of `world_size` is not.
    #[error(
        "{op} needs a length divisible by world_size {world_size}, got {len}; pad the buffer to a multiple of world_size"
    )]
    NotDivisible {
        /// The collective.
        op: &'static str,
        /// The offending length (elements).
        len: usize,
        /// The group size.
        world_size: usize,
    },
    /// The dtype is not a float type the backend can move.
    #[error("collectives take f32, bf16 or f16 tensors, got {0}; cast the tensor first")]
    UnsupportedDtype(String),
    /// `root` is not a rank of the group.
    #[error("broadcast root {root} is out of range for world_size {world_size}")]
    InvalidRoot {
        /// The requested root.
        root: usize,
        /// The group size.
        world_size: usize,
    },
    /// A peer dropped its handle or its thread panicked while this rank waited for it.
    #[error("rank {peer} left the group (its thread ended or panicked) during {op}; see that rank's error")]
    PeerGone {
        /// The rank that disappeared.
        peer: usize,
        /// The collective in progress.
        op: String,
    },
    /// In-process backend: no message arrived from the neighbouring rank within the group's
    /// timeout.
    #[error(
        "rank {rank} waited {waited:?} in {op} without hearing from rank {peer}; a rank is stuck or \
         skipped this collective (raise the timeout with InProcessGroup::with_timeout if the work is legitimately slow)"
    )]
    Timeout {
        /// The waiting rank.
        rank: usize,
        /// The rank it waited for.
        peer: usize,
        /// The collective in progress.
        op: String,
        /// How long it waited.
        waited: Duration,
    },
    /// NCCL backend: a collective did not complete within the communicator's timeout (NCCL does
    /// not say which peer is missing); the communicator was aborted.
    #[error(
        "rank {rank}: NCCL {op} did not complete within {waited:?}, so the communicator was aborted; a rank is stuck, \
         died or skipped this collective (raise the timeout with NcclComm::with_timeout if the work is legitimately slow)"
    )]
    NcclTimeout {
        /// The waiting rank.
        rank: usize,
        /// The collective in progress.
        op: String,
        /// How long it waited.
        waited: Duration,
    },
    /// MPI backend: a collective did not complete within the communicator's timeout; the
    /// group was aborted and the call abandoned. MPI does not say which peer is missing, so
    /// the ranks waiting in a collective send each other heartbeats: `silent` names those not
    /// heard from.
    #[error(
        "rank {rank}: MPI {op} did not complete within {waited:?}, so the group was aborted; {}",
        silent_text(.silent)
    )]
    MpiTimeout {
        /// The waiting rank.
        rank: usize,
        /// The collective in progress.
        op: String,
        /// How long it waited.
        waited: Duration,
        /// The other members of the waiting group (as ranks of the job's world, `mpirun`'s
        /// ranks) that sent no heartbeat in the last 2 beat periods of the wait (a period is a
        /// quarter of the timeout, at most 1 s): dead, stuck before this call, or unreachable.
        silent: Vec<usize>,
    },
    /// An earlier error on some rank aborted the group.
    #[error("the group was aborted by an earlier error: {0}")]
    Aborted(String),
    /// The backend cannot run on this machine (no GPU, no libnccl, too few GPUs).
    #[error("collective backend unavailable: {0}")]
    Unavailable(String),
    /// The backend library failed (an NCCL or CUDA error, with its message).
    #[error("collective backend error: {0}")]
    Backend(String),
    /// The world size is not usable.
    #[error("world_size must be at least 1, got {0}")]
    InvalidWorldSize(usize),
    /// A 2-D mesh (replica groups of shard groups) that does not fit the world, or that the
    /// ranks do not agree on; the message names the fix.
    #[error("invalid mesh: {0}")]
    InvalidMesh(String),
    /// The backend cannot do what was asked (split its group into sub-groups); the message names
    /// the backends that can.
    #[error("not supported by this collective backend: {0}")]
    Unsupported(String),
    /// A launcher environment variable (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
    /// `MASTER_ADDR`, `MASTER_PORT`, `BURN_SHARD_JOB_TOKEN`, `BURN_SHARD_JOB_TOKEN_FILE`) is
    /// missing or malformed.
    #[error(
        "environment variable {var}: {problem}; start every process with burn-shard-run, which sets \
         RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and BURN_SHARD_JOB_TOKEN \
         (torchrun sets all but the token)"
    )]
    Env {
        /// The variable's name.
        var: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// The rendezvous store could not be hosted, reached or answered in time; the message names
    /// the address and what to check.
    #[error("rendezvous: {0}")]
    Rendezvous(String),
}

/// The rendezvous crate's errors are the variants of the same names here, with the same messages:
/// `?` turns one into the other.
impl From<burn_shard_rendezvous::RendezvousError> for CommError {
    fn from(e: burn_shard_rendezvous::RendezvousError) -> Self {
        use burn_shard_rendezvous::RendezvousError;
        match e {
            RendezvousError::InvalidWorldSize(world_size) => Self::InvalidWorldSize(world_size),
            RendezvousError::Env { var, problem } => Self::Env { var, problem },
            RendezvousError::Rendezvous(message) => Self::Rendezvous(message),
        }
    }
}

/// What [`CommError::MpiTimeout`] says about the processes not heard from.
fn silent_text(silent: &[usize]) -> String {
    if silent.is_empty() {
        return "every other member of the group was heard from while it waited, so they wait in different \
                calls or a link between two of them is down; raise the timeout with MpiComm::with_timeout if \
                the work is legitimately slow"
            .into();
    }
    let list: Vec<String> = silent.iter().map(usize::to_string).collect();
    format!(
        "no word from mpirun rank(s) {} during the wait: dead, stuck before this call, or unreachable (a network \
         link down); raise the timeout with MpiComm::with_timeout if their work is legitimately slow",
        list.join(", ")
    )
}
