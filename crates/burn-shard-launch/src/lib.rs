//! `burn-shard-run`: a launcher for multi-process (multi-GPU, multi-node) jobs, like PyTorch's
//! `torchrun`.
//!
//! On each node, [`launch`] starts `nproc_per_node` copies of a program with `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` set — what
//! `burn_shard_comm::NcclComm::from_env` and [`RendezvousEnv::from_env`] read; the names are the
//! rendezvous crate's constants — prefixes their output with `[rank R]`, and stops every rank of
//! the node as soon as one fails, so a crash is an error with the rank's name instead of a job
//! that hangs in its next collective.
//!
//! Every rank also gets the job's token in `BURN_SHARD_JOB_TOKEN`, which rank 0's rendezvous
//! store asks each connection to prove: on one node a fresh random one per job; with several
//! nodes the one given to every node (`--job-token-file`, `BURN_SHARD_JOB_TOKEN_FILE` or
//! `BURN_SHARD_JOB_TOKEN`), since node 0's store must hold the same token as the other nodes'
//! ranks. Several nodes without a token are refused before anything starts.
//!
//! With `--max-restarts N`, [`run`] starts every rank again after a failure (torchrun's
//! elastic agent), on one node or, agreeing through node 0's launcher, on several; with
//! `--nnodes MIN:MAX` a start goes ahead without lost nodes at a smaller world size; with
//! `--supervise` it restarts a command that starts the ranks itself (`mpirun`).
//!
//! This crate does not depend on Burn (only on `burn-shard-rendezvous`, std only): the launcher
//! builds in seconds and starts any program. Linux only (process groups, `waitid`).
//!
//! [`RendezvousEnv::from_env`]: burn_shard_rendezvous::RendezvousEnv::from_env

mod agent;
mod attempts;
mod cli;
mod config;
mod error;
mod launch;
mod output;
mod process_group;
mod restart;
mod signals;

pub use cli::{Cli, parse_args};
pub use config::{
    DEFAULT_MASTER_PORT, DEFAULT_NODE_TIMEOUT, DEFAULT_NODE_WAIT, DEFAULT_STOP_GRACE, LaunchConfig, MAX_RESTARTS,
    OutputMode, RESTART_COUNT,
};
pub use error::LaunchError;
pub use launch::{LaunchOutcome, RankExit, launch};
pub use output::{OutputLine, OutputStream};
pub use restart::run;
pub use signals::forward_termination_signals;
