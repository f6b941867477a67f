//! Collectives for sharded data-parallel training with Burn.
//!
//! One trait, [`Collective`], carries the five operations that ZeRO and FSDP need
//! (all-reduce, reduce-scatter, all-gather, broadcast, barrier) on flat 1-D float tensors.
//! Backends implement it; the sharding core (`burn-shard`) only ever talks to the trait.
//!
//! Backends in this crate:
//! - [`InProcessGroup`]: `world_size` ranks as threads of one process, connected in a ring
//!   by channels. It is the CPU default and the test bed: reductions are deterministic and
//!   every misuse (mismatched calls, a rank that dies) is an error within a bounded time.
//! - `NcclComm` (feature `cuda`): NCCL through cudarc, one rank per GPU, in place on Burn's
//!   CUDA tensors. `NcclComm::from_env` joins a job started by `burn-shard-run` (or `torchrun`)
//!   through the [`Rendezvous`], a TCP key-value store hosted by rank 0 (crate
//!   `burn-shard-rendezvous`, re-exported here).
//! - `MpiComm` (feature `mpi`): MPI through rsmpi, one rank per CPU process started by
//!   `mpirun`, on any number of machines.
//!
//! Every backend counts the bytes each rank sends ([`CommStats`]), so traffic can be checked
//! against the ring-algorithm volumes (all-reduce `2(N-1)/N·S`, reduce-scatter and all-gather
//! `(N-1)/N·S` bytes per rank for a buffer of `S` bytes).

mod call_sig;
mod collective;
mod error;
mod host;
mod in_process;
mod launch;
mod mesh;
#[cfg(feature = "mpi")]
mod mpi_comm;
#[cfg(feature = "cuda")]
mod nccl;
mod ring;
mod split;
mod stats;
mod work;

pub use burn_shard_rendezvous::{
    JOB_TOKEN, JOB_TOKEN_FILE, JobToken, MAX_KEY_BYTES, MAX_VALUE_BYTES, RENDEZVOUS_DEFAULT_TIMEOUT, Rendezvous,
    RendezvousEnv, StoreClient, StoreLimits, StoreServer,
};
pub use collective::{Collective, ReduceOp};
pub use error::CommError;
pub use in_process::{InProcessComm, InProcessGroup};
pub use launch::{RankFailure, run_ranks};
pub use mesh::{Mesh, MeshLayout};
pub use stats::{CollectiveKind, CommStats, OpStats};
pub use work::Work;

#[cfg(feature = "mpi")]
pub use mpi_comm::{MPI_DEFAULT_TIMEOUT, MpiComm, launched_by_mpirun};
#[cfg(feature = "cuda")]
pub use nccl::{NCCL_DEFAULT_TIMEOUT, NcclComm, NcclId, cuda_copy_bandwidth, cuda_device_count, nccl_available};
