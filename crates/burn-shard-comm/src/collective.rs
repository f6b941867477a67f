//! The [`Collective`] trait: the one interface between the sharding core and a transport.

use burn::tensor::Tensor;

use crate::{CommError, CommStats, Work};

/// How values from all ranks are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum over ranks.
    Sum,
    /// Element-wise sum over ranks divided by `world_size` (the data-parallel gradient mean).
    Avg,
}

/// A group of `world_size` ranks that exchange flat 1-D float tensors.
///
/// Every rank of the group must issue the same collectives, in the same order, with the same
/// lengths and dtypes. Breaking that contract is reported as [`CommError::Mismatch`] on every
/// rank, never as a hang. A rank that dies or drops its handle makes the others fail with
/// [`CommError::PeerGone`]; a peer that is silent for longer than the group's timeout gives
/// [`CommError::Timeout`]. After any error the group is aborted and every later call returns
/// [`CommError::Aborted`].
///
/// Tensors: shape `[len]`, float dtype. `f32` is the native dtype; `bf16` and `f16` are accepted,
/// reduced in `f32` and returned in the input dtype. Inputs must not be tracked by autodiff (call
/// `.inner()` first); outputs live on the input's device and do not require grad.
pub trait Collective: Send + Sync {
    /// This rank's index in `0..world_size`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn world_size(&self) -> usize;

    /// Reduces `tensor` (shape `[len]`) over all ranks; every rank receives the same `[len]`
    /// result, bitwise identical on every rank.
    fn all_reduce(&self, tensor: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError>;

    /// Reduces `tensor` (shape `[len]`, `len` divisible by `world_size`) over all ranks and
    /// returns this rank's chunk: elements `[rank·len/N, (rank+1)·len/N)` of the reduced buffer,
    /// shape `[len/N]`.
    ///
    /// # Errors
    /// [`CommError::NotDivisible`] when `len % world_size != 0`.
    fn reduce_scatter(&self, tensor: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError>;

    /// Concatenates every rank's `tensor` (shape `[chunk]`, equal on all ranks) in rank order;
    /// returns shape `[world_size·chunk]`.
    fn all_gather(&self, tensor: Tensor<1>) -> Result<Tensor<1>, CommError>;

    /// Returns `root`'s `tensor` on every rank (shape `[len]`, equal on all ranks).
    ///
    /// # Errors
    /// [`CommError::InvalidRoot`] when `root >= world_size`.
    fn broadcast(&self, tensor: Tensor<1>, root: usize) -> Result<Tensor<1>, CommError>;

    /// [`Collective::reduce_scatter`] with a `tag` naming what is reduced (e.g. a hash of the
    /// parameter's path), identical on every rank. Backends that can check it report ranks that
    /// reduce different things with equal lengths as [`CommError::Mismatch`] instead of mixing
    /// them; the default ignores the tag.
    fn reduce_scatter_tagged(&self, tensor: Tensor<1>, op: ReduceOp, tag: u64) -> Result<Tensor<1>, CommError> {
        let _ = tag;
        self.reduce_scatter(tensor, op)
    }

    /// [`Collective::all_gather`] with a `tag`, checked like
    /// [`Collective::reduce_scatter_tagged`]'s.
    fn all_gather_tagged(&self, tensor: Tensor<1>, tag: u64) -> Result<Tensor<1>, CommError> {
        let _ = tag;
        self.all_gather(tensor)
    }

    /// [`Collective::all_gather`] of each tensor of a bucket, in order: `out[i]` is the
    /// all-gather of `tensors[i]` (shape `[world_size·chunk_i]`). Every rank passes the same
    /// number of tensors with the same lengths.
    ///
    /// The default loops over [`Collective::all_gather`]; backends may fuse the calls (NCCL runs
    /// them as one group, one launch and one wait) with the same results and the same
    /// [`Collective::stats`] (one call per tensor). An empty `tensors` returns an empty `Vec`.
    ///
    /// # Errors
    /// As [`Collective::all_gather`]; after an error no output is returned.
    fn all_gather_many(&self, tensors: Vec<Tensor<1>>) -> Result<Vec<Tensor<1>>, CommError> {
        tensors.into_iter().map(|t| self.all_gather(t)).collect()
    }

    /// [`Collective::reduce_scatter`] of each tensor of a bucket, in order: `out[i]` is this
    /// rank's chunk of the reduction of `tensors[i]` (shape `[len_i/world_size]`). Every rank
    /// passes the same number of tensors with the same lengths.
    ///
    /// The default loops over [`Collective::reduce_scatter`]; backends may fuse the calls, as for
    /// [`Collective::all_gather_many`].
    ///
    /// # Errors
    /// As [`Collective::reduce_scatter`]: [`CommError::NotDivisible`] when a length is not a
    /// multiple of `world_size` (a fusing backend checks every tensor before moving any).
    fn reduce_scatter_many(&self, tensors: Vec<Tensor<1>>, op: ReduceOp) -> Result<Vec<Tensor<1>>, CommError> {
        tensors.into_iter().map(|t| self.reduce_scatter(t, op)).collect()
    }

    /// Starts [`Collective::all_gather_tagged`] and returns at once with a handle to wait on
    /// (PyTorch's `async_op=True`), so the caller can compute while the gather runs: FSDP's
    /// prefetch of the next unit's parameters.
    ///
    /// The call takes its place in this rank's order of collectives when it is made: every
    /// rank must start it at the same point of its sequence of calls, as for a synchronous
    /// call. Backends with a communication thread (the in-process one) run it there and every
    /// later call of the rank queues behind it; the default runs it here, to completion, and
    /// returns a finished [`Work`] (correct, nothing overlapped).
    ///
    /// # Errors
    /// Through [`Work::wait`], as [`Collective::all_gather`].
    fn all_gather_async(&self, tensor: Tensor<1>, tag: u64) -> Work<Tensor<1>> {
        Work::done(self.all_gather_tagged(tensor, tag))
    }

    /// Starts [`Collective::reduce_scatter_tagged`] and returns at once with a handle to wait
    /// on: FSDP reduce-scatters one unit's gradients while backward computes the unit before
    /// it. Ordering, threads and the default as for [`Collective::all_gather_async`].
    ///
    /// # Errors
    /// Through [`Work::wait`], as [`Collective::reduce_scatter`].
    fn reduce_scatter_async(&self, tensor: Tensor<1>, op: ReduceOp, tag: u64) -> Work<Tensor<1>> {
        Work::done(self.reduce_scatter_tagged(tensor, op, tag))
    }

    /// Starts [`Collective::all_reduce`] and returns at once with a handle to wait on: DDP and
    /// ZeRO-1 all-reduce one bucket of gradients while backward computes the next.
    /// `tag` names the call as in [`Collective::all_gather_tagged`] (0: untagged; the default
    /// ignores it). Ordering, threads and the default as for [`Collective::all_gather_async`].
    ///
    /// # Errors
    /// Through [`Work::wait`], as [`Collective::all_reduce`].
    fn all_reduce_async(&self, tensor: Tensor<1>, op: ReduceOp, tag: u64) -> Work<Tensor<1>> {
        let _ = tag;
        Work::done(self.all_reduce(tensor, op))
    }

    /// Whether the `*_async` calls run while the caller goes on (a communication thread or
    /// stream), so starting them inside backward hides their time; `false` (the default) when
    /// they complete before returning, where starting them early only moves the wait.
    fn overlaps_compute(&self) -> bool {
        false
    }

    /// Returns once every rank has entered the barrier.
    fn barrier(&self) -> Result<(), CommError>;

    /// Bytes sent and calls made by this rank so far, per collective.
    fn stats(&self) -> CommStats;

    /// Aborts the group: every rank blocked in a collective, and every later call, returns
    /// [`CommError::Aborted`] carrying `reason`. Called when a rank fails on its own, so the
    /// others do not wait for it until the timeout.
    fn abort(&self, reason: &str);

    /// The device every tensor passed to this group must live on (NCCL: its GPU), for callers
    /// that build small tensors of their own (the ranks' colors in [`Collective::split`]);
    /// `None` (the default) when any device works.
    fn required_device(&self) -> Option<burn::tensor::Device> {
        None
    }

    /// Splits the group into disjoint sub-groups, as `MPI_Comm_split` and `ncclCommSplit` do:
    /// the ranks that pass the same `color` form one group, numbered by `key` (ties broken by
    /// rank in this group). A collective over this group: every rank calls it once, at the
    /// same point of its sequence of calls. The sub-group has its own call sequence, statistics
    /// and abort state; it keeps this group's timeout and error behaviour. To abort the
    /// sub-groups of a rank together, see [`crate::Mesh`].
    ///
    /// # Errors
    /// [`CommError::Unsupported`] (the default) where the backend cannot split; the backend's
    /// errors of a collective.
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Collective>, CommError> {
        let _ = (color, key);
        Err(CommError::Unsupported(
            "splitting a group into sub-groups (hybrid sharding needs it); the in-process, MPI and NCCL backends can"
                .into(),
        ))
    }
}

/// A shared handle is the same rank of the same group: one rank can hand its collective to
/// several sharded models (a trained student and a frozen teacher), which then issue their
/// collectives one after the other on every rank.
impl<C: Collective + ?Sized> Collective for std::sync::Arc<C> {
    fn rank(&self) -> usize {
        (**self).rank()
    }

    fn world_size(&self) -> usize {
        (**self).world_size()
    }

    fn all_reduce(&self, tensor: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        (**self).all_reduce(tensor, op)
    }

    fn reduce_scatter(&self, tensor: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        (**self).reduce_scatter(tensor, op)
    }

    fn all_gather(&self, tensor: Tensor<1>) -> Result<Tensor<1>, CommError> {
        (**self).all_gather(tensor)
    }

    fn broadcast(&self, tensor: Tensor<1>, root: usize) -> Result<Tensor<1>, CommError> {
        (**self).broadcast(tensor, root)
    }

    fn reduce_scatter_tagged(&self, tensor: Tensor<1>, op: ReduceOp, tag: u64) -> Result<Tensor<1>, CommError> {
        (**self).reduce_scatter_tagged(tensor, op, tag)
    }

    fn all_gather_tagged(&self, tensor: Tensor<1>, tag: u64) -> Result<Tensor<1>, CommError> {
        (**self).all_gather_tagged(tensor, tag)
    }

    fn all_gather_many(&self, tensors: Vec<Tensor<1>>) -> Result<Vec<Tensor<1>>, CommError> {
        (**self).all_gather_many(tensors)
    }

    fn reduce_scatter_many(&self, tensors: Vec<Tensor<1>>, op: ReduceOp) -> Result<Vec<Tensor<1>>, CommError> {
        (**self).reduce_scatter_many(tensors, op)
    }

    fn all_gather_async(&self, tensor: Tensor<1>, tag: u64) -> Work<Tensor<1>> {
        (**self).all_gather_async(tensor, tag)
    }

    fn reduce_scatter_async(&self, tensor: Tensor<1>, op: ReduceOp, tag: u64) -> Work<Tensor<1>> {
        (**self).reduce_scatter_async(tensor, op, tag)
    }

    fn all_reduce_async(&self, tensor: Tensor<1>, op: ReduceOp, tag: u64) -> Work<Tensor<1>> {
        (**self).all_reduce_async(tensor, op, tag)
    }

    fn overlaps_compute(&self) -> bool {
        (**self).overlaps_compute()
    }

    fn barrier(&self) -> Result<(), CommError> {
        (**self).barrier()
    }

    fn stats(&self) -> CommStats {
        (**self).stats()
    }

    fn abort(&self, reason: &str) {
        (**self).abort(reason)
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Collective>, CommError> {
        (**self).split(color, key)
    }

    fn required_device(&self) -> Option<burn::tensor::Device> {
        (**self).required_device()
    }
}
