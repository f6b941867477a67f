//! The NCCL backend (feature `cuda`): one rank per GPU, one process (or thread) per rank, any
//! number of nodes. Collectives run on Burn's CUDA tensors through cudarc's NCCL bindings, which
//! load `libnccl` and `libcuda` at run time (nothing is needed to build).
//!
//! Ordering: CubeCL does not expose its CUDA stream, so each collective first pins its buffers
//! and waits for the device's queued work (`client.sync()`), then runs NCCL on this
//! communicator's own stream in the same primary context and waits for it, with a timeout: a
//! peer that never joins makes the call abort the communicator (`ncclCommAbort`) and return
//! [`CommError::NcclTimeout`].
//!
//! Thread safety: NCCL forbids issuing operations on one communicator from several threads at
//! once, and a group (`ncclGroupStart`/`ncclGroupEnd`) must be issued by one thread ("Thread
//! Safety" in NCCL's user guide). [`NcclComm`] keeps the raw communicator and its stream behind
//! one `Mutex`, held for a whole collective (enqueue, group, wait), for `ncclCommAbort` and for
//! `ncclCommDestroy`, so the sharding core may share it (`Arc<dyn Collective>`) and call it from
//! any thread; calls from several threads run one after the other, in lock order, which must
//! still be the same order on every rank.
//!
//! Initialisation: with NCCL ≥ 2.14 the communicator is created non-blocking
//! (`ncclCommInitRankConfig` with `blocking = 0`), so joining it is bounded by a timeout and
//! `ncclCommAbort` can stop it at any point (NCCL's user guide, "Fault Tolerance"). Every later
//! NCCL call may then return `ncclInProgress`; each collective polls `ncclCommGetAsyncError`
//! until NCCL has issued its kernels, before touching the stream, and keeps polling it while
//! waiting for the stream (network errors surface there only). Older NCCL falls back to the
//! blocking `ncclCommInitRank`, which has no timeout.
//!
//! Files: `comm.rs` ([`NcclComm`], its lock and abort state, `Drop`), `join.rs` (constructors:
//! by id, or through the launcher's rendezvous), `id.rs` ([`NcclId`]), `init.rs` and
//! `config.rs` (creating the communicator, non-blocking where NCCL allows), `library.rs`
//! (loading libcuda/libnccl), `bandwidth.rs` (the device's copy bandwidth, for benchmarks), `state.rs` (`ncclCommGetAsyncError`), `buffers.rs` (tensors as
//! NCCL gets them), `run.rs`, `issue.rs` and `wait.rs` (one collective, start to end),
//! `group.rs` (the `*_many` calls), `split.rs` (sub-groups, `ncclCommSplit`); this file wires them
//! into [`Collective`].

mod bandwidth;
mod buffers;
mod comm;
mod config;
mod group;
mod id;
mod init;
mod issue;
mod join;
mod library;
mod run;
mod split;
mod state;
mod wait;

use std::ffi::c_int;
use std::sync::PoisonError;
use std::sync::atomic::Ordering;

use burn::tensor::Tensor;
use cudarc::nccl::result as nccl;

pub use self::bandwidth::cuda_copy_bandwidth;
use self::buffers::nccl_op;
pub use self::comm::{NCCL_DEFAULT_TIMEOUT, NcclComm};
pub use self::id::NcclId;
pub use self::library::{cuda_device_count, nccl_available};
use crate::stats::CollectiveKind;
use crate::{Collective, CommError, CommStats, ReduceOp};

impl Collective for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, tensor: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        let n = tensor.dims()[0];
        let sent = 2 * (self.world_size - 1) * n / self.world_size;
        self.run(CollectiveKind::AllReduce, tensor, n, sent, |l| {
            // SAFETY: `Launch`'s invariants, with input length = out_len = `n`: ncclAllReduce
            // reads `n` elements of `l.dtype` from `l.src` and writes `n` to `l.dst`.
            unsafe { nccl::all_reduce(l.src, l.dst, n, l.dtype, nccl_op(op), l.comm, l.stream) }
        })
    }

    fn reduce_scatter(&self, tensor: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        let n = tensor.dims()[0];
        if !n.is_multiple_of(self.world_size) {
            return Err(CommError::NotDivisible {
                op: "reduce_scatter",
                len: n,
                world_size: self.world_size,
            });
        }
        let chunk = n / self.world_size;
        let sent = (self.world_size - 1) * chunk;
        self.run(CollectiveKind::ReduceScatter, tensor, chunk, sent, |l| {
            // SAFETY: `Launch`'s invariants, with input length `n` = `chunk · world_size` and
            // out_len `chunk`: ncclReduceScatter reads `recvcount · nranks` = `n` elements from
            // `l.src` and writes `recvcount` = `chunk` to `l.dst`.
            unsafe { nccl::reduce_scatter(l.src, l.dst, chunk, l.dtype, nccl_op(op), l.comm, l.stream) }
        })
    }

    fn all_gather(&self, tensor: Tensor<1>) -> Result<Tensor<1>, CommError> {
        let chunk = tensor.dims()[0];
        let sent = (self.world_size - 1) * chunk;
        self.run(CollectiveKind::AllGather, tensor, chunk * self.world_size, sent, |l| {
            // SAFETY: `Launch`'s invariants, with input length `chunk` and out_len
            // `chunk · world_size`: ncclAllGather reads `sendcount` = `chunk` elements from
            // `l.src` and writes `sendcount · nranks` to `l.dst`.
            unsafe { nccl::all_gather(l.src, l.dst, chunk, l.dtype, l.comm, l.stream) }
        })
    }

    fn broadcast(&self, tensor: Tensor<1>, root: usize) -> Result<Tensor<1>, CommError> {
        if root >= self.world_size {
            return Err(CommError::InvalidRoot {
                root,
                world_size: self.world_size,
            });
        }
        // Fits: root < world_size, which `new_with_init_timeout` checked against `c_int`.
        let root_rank = root as c_int;
        let n = tensor.dims()[0];
        let sent = if self.rank == root { n } else { 0 };
        self.run(CollectiveKind::Broadcast, tensor, n, sent, |l| {
            // SAFETY: `Launch`'s invariants, with input length = out_len = `n`: ncclBroadcast
            // reads `n` elements from `l.src` (on the root) and writes `n` to `l.dst`; `root_rank`
            // is a rank of the communicator.
            unsafe { nccl::broadcast(l.src, l.dst, n, l.dtype, root_rank, l.comm, l.stream) }
        })
    }

    fn all_gather_many(&self, tensors: Vec<Tensor<1>>) -> Result<Vec<Tensor<1>>, CommError> {
        self.all_gather_group(tensors)
    }

    fn reduce_scatter_many(&self, tensors: Vec<Tensor<1>>, op: ReduceOp) -> Result<Vec<Tensor<1>>, CommError> {
        self.reduce_scatter_group(tensors, op)
    }

    fn barrier(&self) -> Result<(), CommError> {
        let one = Tensor::<1>::zeros([1], &self.device);
        self.all_reduce(one, ReduceOp::Sum).map(drop)
    }

    fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }

    /// `ncclCommSplit`, or new communicators before NCCL 2.18 (see `split.rs`).
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Collective>, CommError> {
        self.split_group(color, key)
            .map(|comm| Box::new(comm) as Box<dyn Collective>)
    }

    fn required_device(&self) -> Option<burn::tensor::Device> {
        Some(self.device.clone())
    }

    /// Aborts the communicator (`ncclCommAbort`) and returns once it is aborted. A collective in
    /// progress on another thread notices within a poll interval, aborts it itself and returns
    /// [`CommError::Aborted`]; with a blocking communicator (NCCL < 2.14) a call stuck inside NCCL
    /// is not interrupted, and this waits for it. Every later call returns
    /// [`CommError::Aborted`] carrying the first reason given.
    fn abort(&self, reason: &str) {
        let _ = self.abort_reason.set(reason.to_string());
        self.abort_requested.store(true, Ordering::SeqCst);
        let mut raw = self.raw.lock().unwrap_or_else(PoisonError::into_inner);
        self.abort_locked(&mut raw, reason);
    }
}
