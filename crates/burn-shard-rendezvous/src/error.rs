//! [`RendezvousError`]: why the rendezvous, its store or the launcher's variables failed. The
//! collectives' crate converts it into its own error (`burn_shard_comm::CommError`, variants of
//! the same names and messages), so `?` works in code that returns either.

/// Why joining the rendezvous, a store operation or reading the launcher's variables failed.
/// Every variant says what to change.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum RendezvousError {
    /// The world size is not usable.
    #[error("world_size must be at least 1, got {0}")]
    InvalidWorldSize(usize),
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
