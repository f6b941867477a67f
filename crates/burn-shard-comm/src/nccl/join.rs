//! Joining a communicator ([`NcclComm::new`] and the other constructors): by an [`NcclId`] given
//! to every rank, or through the launcher's rendezvous ([`NcclComm::from_env`]), where rank 0
//! creates the id and publishes it (or why it could not) to the others.

use std::ffi::c_int;
use std::sync::atomic::AtomicBool;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use burn::tensor::Device;
use cudarc::driver::CudaContext;

use super::comm::{NCCL_DEFAULT_TIMEOUT, NcclComm, Raw};
use super::id::NcclId;
use super::init::init_comm;
use super::library::cuda_device_count;
use crate::stats::StatsCounter;
use crate::{CommError, RENDEZVOUS_DEFAULT_TIMEOUT, Rendezvous, RendezvousEnv};

/// The rendezvous key under which rank 0 publishes the NCCL id (256 hex digits).
const NCCL_ID_KEY: &str = "burn-shard/nccl-id";
/// Prefix of the value rank 0 publishes instead when it cannot create the id.
const NCCL_ID_FAILED: &str = "error: ";

impl NcclComm {
    /// Joins the communicator `id` as `rank` of `world_size`, on CUDA device `device_index`.
    /// Waits until every rank has joined, at most [`RENDEZVOUS_DEFAULT_TIMEOUT`] (60 s; as
    /// [`NcclComm::new_with_init_timeout`]). Collectives then time out after
    /// [`NCCL_DEFAULT_TIMEOUT`] (see [`NcclComm::with_timeout`]).
    ///
    /// # Errors
    /// As [`NcclComm::new_with_init_timeout`].
    pub fn new(device_index: usize, rank: usize, world_size: usize, id: &NcclId) -> Result<Self, CommError> {
        Self::new_with_init_timeout(device_index, rank, world_size, id, RENDEZVOUS_DEFAULT_TIMEOUT)
    }

    /// [`NcclComm::new`], waiting at most `init_timeout` for every rank to join.
    ///
    /// With NCCL ≥ 2.14 the communicator is created non-blocking (`ncclCommInitRankConfig`,
    /// `blocking = 0`) and its state polled; when `init_timeout` passes first, it is aborted
    /// (`ncclCommAbort`) and the call fails. With older NCCL, `ncclCommInitRank` blocks until all
    /// ranks have joined, without a timeout (a warning is logged); so does the initialisation when
    /// `NCCL_COMM_BLOCKING=1` is set, which overrides `blocking = 0`.
    ///
    /// # Errors
    /// - [`CommError::InvalidWorldSize`] when `world_size` is 0, `rank >= world_size`, or
    ///   `world_size` does not fit NCCL's `int`.
    /// - [`CommError::Unavailable`] without libcuda/libnccl, when `device_index` is not a GPU of
    ///   this machine (fewer GPUs than ranks per node), or with an NCCL older than 2.4.
    /// - [`CommError::NcclTimeout`] when not every rank joined within `init_timeout` (a rank did
    ///   not start, used another id, or cannot reach the others over the network); the partly
    ///   built communicator was aborted.
    /// - [`CommError::Backend`] for other CUDA and NCCL failures.
    pub fn new_with_init_timeout(
        device_index: usize,
        rank: usize,
        world_size: usize,
        id: &NcclId,
        init_timeout: Duration,
    ) -> Result<Self, CommError> {
        if world_size == 0 || rank >= world_size || c_int::try_from(world_size).is_err() {
            return Err(CommError::InvalidWorldSize(world_size));
        }
        let gpus = cuda_device_count()?;
        if device_index >= gpus {
            return Err(CommError::Unavailable(format!(
                "rank {rank} asked for CUDA device {device_index} but this machine has {gpus} GPU(s): \
                 run at most {gpus} ranks per node (one GPU each)"
            )));
        }
        // The primary context, the one CubeCL retains: device pointers of Burn tensors are valid here.
        let ctx = CudaContext::new(device_index).map_err(|e| CommError::Backend(format!("CUDA context: {e:?}")))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| CommError::Backend(format!("CUDA stream: {e:?}")))?;
        // NCCL creates the communicator on the calling thread's current device (`cudaGetDevice`).
        ctx.bind_to_thread()
            .map_err(|e| CommError::Backend(format!("CUDA context: {e:?}")))?;
        let (comm, nonblocking) = init_comm(id, rank, world_size, device_index, init_timeout)?;
        Ok(Self {
            raw: Mutex::new(Raw { comm, stream }),
            abort_requested: AtomicBool::new(false),
            abort_reason: OnceLock::new(),
            nonblocking,
            rank,
            world_size,
            device_index,
            device: Device::cuda(device_index),
            timeout: NCCL_DEFAULT_TIMEOUT,
            stats: StatsCounter::default(),
        })
    }

    /// Joins the job this process was started in by `burn-shard-run` (or `torchrun`, with
    /// `BURN_SHARD_JOB_TOKEN` exported on every node): reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    /// `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` and the job token,
    /// exchanges the NCCL id through the [`Rendezvous`] (rank 0 creates it) and builds the
    /// communicator on CUDA device `LOCAL_RANK`. Every process of the job must call it once.
    /// Waits up to [`RENDEZVOUS_DEFAULT_TIMEOUT`] (60 s) for the other ranks, in the rendezvous
    /// and again in NCCL's initialisation.
    ///
    /// # Errors
    /// [`CommError::Env`] for missing or malformed variables; otherwise as
    /// [`NcclComm::from_rendezvous_env`].
    pub fn from_env() -> Result<Self, CommError> {
        Self::from_rendezvous_env(&RendezvousEnv::from_env()?, RENDEZVOUS_DEFAULT_TIMEOUT)
    }

    /// [`NcclComm::from_env`] with the job's place given by `env` and every wait (connecting,
    /// the NCCL id, all ranks present, NCCL's own initialisation) bounded by `timeout`.
    ///
    /// All ranks meet in a barrier before joining the communicator, so a rank that never started
    /// is reported within `timeout` by every other rank. A rank that passes the barrier and then
    /// fails (e.g. its GPU is missing) makes the others fail with [`CommError::NcclTimeout`]
    /// within `timeout` too (NCCL ≥ 2.14; older NCCL waits until the launcher stops them, which
    /// `burn-shard-run` does at once on its node).
    ///
    /// # Errors
    /// [`CommError::Rendezvous`] when the store cannot be hosted or reached, the id does not
    /// arrive, or not every rank arrives within `timeout`; on ranks other than 0, also when rank 0
    /// could not create the id (carrying its reason); else as
    /// [`NcclComm::new_with_init_timeout`].
    pub fn from_rendezvous_env(env: &RendezvousEnv, timeout: Duration) -> Result<Self, CommError> {
        let rendezvous = Rendezvous::new(env.clone(), timeout)?;
        let store = rendezvous.store();
        let id = if env.rank == 0 {
            match NcclId::new() {
                Ok(id) => {
                    store.set(NCCL_ID_KEY, id.to_hex().as_bytes())?;
                    id
                }
                Err(e) => {
                    // Tell the other ranks why, instead of letting them time out.
                    let _ = store.set(NCCL_ID_KEY, format!("{NCCL_ID_FAILED}{e}").as_bytes());
                    return Err(e);
                }
            }
        } else {
            let value = store.get(NCCL_ID_KEY, timeout)?;
            let text = String::from_utf8_lossy(&value);
            if let Some(reason) = text.strip_prefix(NCCL_ID_FAILED) {
                return Err(CommError::Rendezvous(format!(
                    "rank 0 could not create the NCCL id: {reason}"
                )));
            }
            NcclId::from_hex(&text)?
        };
        rendezvous.barrier(timeout)?;
        // Past the barrier every rank has the id: leave the store (rank 0 closes it once the
        // others have left) before the communicator, which may live for the whole job, exists.
        drop(rendezvous);
        Self::new_with_init_timeout(env.local_rank, env.rank, env.world_size, &id, timeout)
    }

    /// Sets how long one collective may take before the communicator is aborted (default
    /// [`NCCL_DEFAULT_TIMEOUT`], 5 minutes). It counts from the moment the call holds the
    /// communicator (not while it waits for another thread's call) to the end of its GPU work.
    /// The initialisation timeout is set at construction
    /// ([`NcclComm::new_with_init_timeout`]).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The Burn device of this rank.
    pub fn device(&self) -> &Device {
        &self.device
    }
}
