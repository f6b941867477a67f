//! The MPI backend (feature `mpi`): one rank per process, started by `mpirun`, over the
//! system's MPI library (OpenMPI or MPICH) through rsmpi. For CPU machines and clusters.
//!
//! Collectives map to MPI's own: reduce-scatter to `MPI_Ireduce_scatter_block`, all-gather to
//! `MPI_Iallgather`, broadcast to `MPI_Ibcast`, barrier to `MPI_Ibarrier`. All-reduce is a
//! reduce-scatter followed by an all-gather of the (padded) buffer, so that, as the trait
//! promises, every rank gets bitwise-identical values (each element is reduced once, by its
//! owner; `MPI_Allreduce` does not promise that for every algorithm). Grouped calls
//! (`*_many`) move the whole bucket in one MPI call.
//!
//! Misuse is an error, as on the in-process backend:
//! - before each collective, the ranks all-gather its signature (call number, kind, length,
//!   dtype, root, tag: 48 bytes), so ranks that call different things get
//!   [`CommError::Mismatch`], all of them, instead of MPI's undefined behaviour;
//! - every call is non-blocking and polled: a rank that fails alone calls
//!   [`Collective::abort`], which sends its reason to every other rank on a second communicator,
//!   and the others return [`CommError::Aborted`] within a poll; silence longer than the timeout
//!   is [`CommError::MpiTimeout`], naming the processes that sent no heartbeat (dead, stuck or
//!   cut off);
//! - a rank that dies is `mpirun`'s business: it ends the whole job and names the rank.
//!
//! MPI is finalised when the process exits (an `atexit` handler, as mpi4py does), not when the
//! communicator drops: at stage 3, Burn's autodiff graph releases the last handle only at its
//! next clean-up, which may never come. MPI cannot cancel a collective: after a timeout or an
//! abort notice the pending call's buffers are left to MPI (leaked) and the exit handler skips
//! `MPI_Finalize` (it would wait for that call); `mpirun` then ends the job.
//!
//! Files: `comm.rs` ([`MpiComm`], its lock and abort state, `Drop`), `init.rs` (starting MPI),
//! `process.rs` (the process-wide lock, finalisation at exit, `mpirun` detection), `calls.rs`
//! (one collective, and the MPI calls it is made of), `signature.rs` (the check that all ranks
//! call the same thing), `wait.rs` (polling a pending call), `heartbeat.rs` (who is heard from during a long wait), `abort.rs` (abort notices),
//! `pinned.rs` (buffers MPI holds), `group.rs` (the `*_many` calls), `split.rs` (sub-groups); this file wires them into
//! [`Collective`].

mod abort;
mod calls;
mod comm;
mod group;
mod heartbeat;
mod init;
mod pinned;
mod process;
mod signature;
mod split;
mod wait;

use ::mpi::request::StaticScope;
use ::mpi::traits::*;
use burn::tensor::{DType, Tensor};

pub use self::comm::{MPI_DEFAULT_TIMEOUT, MpiComm};
use self::pinned::Pinned;
pub use self::process::launched_by_mpirun;
use crate::call_sig::CallSig;
use crate::host::HostBuffer;
use crate::stats::CollectiveKind;
use crate::{Collective, CommError, CommStats, ReduceOp};

impl Collective for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, tensor: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        let HostBuffer {
            mut values,
            dtype,
            device,
        } = self.read(tensor)?;
        let (n, len) = (self.world_size, values.len());
        let chunk = len.div_ceil(n);
        values.resize(chunk * n, 0.0);
        let sig = CallSig {
            kind: CollectiveKind::AllReduce,
            len,
            dtype,
            root: 0,
            tag: 0,
        };
        let mut out = self.call(sig.clone(), Some(2 * self.ring_bytes(chunk, dtype)), |comm, state| {
            let mut own = comm.reduce_scatter_sum(state, values, &sig)?;
            if op == ReduceOp::Avg {
                own.iter_mut().for_each(|v| *v /= n as f32);
            }
            comm.all_gather_f32(state, own, &sig)
        })?;
        out.truncate(len);
        Ok(HostBuffer::into_tensor(out, dtype, &device))
    }

    fn reduce_scatter(&self, tensor: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        self.reduce_scatter_tagged(tensor, op, 0)
    }

    fn reduce_scatter_tagged(&self, tensor: Tensor<1>, op: ReduceOp, tag: u64) -> Result<Tensor<1>, CommError> {
        let HostBuffer { values, dtype, device } = self.read(tensor)?;
        let n = self.world_size;
        if values.len() % n != 0 {
            return Err(self.reject(CommError::NotDivisible {
                op: "reduce_scatter",
                len: values.len(),
                world_size: n,
            }));
        }
        let sig = CallSig {
            kind: CollectiveKind::ReduceScatter,
            len: values.len(),
            dtype,
            root: 0,
            tag,
        };
        let bytes = self.ring_bytes(values.len() / n, dtype);
        let mut out = self.call(sig.clone(), Some(bytes), |comm, state| {
            comm.reduce_scatter_sum(state, values, &sig)
        })?;
        if op == ReduceOp::Avg {
            out.iter_mut().for_each(|v| *v /= n as f32);
        }
        Ok(HostBuffer::into_tensor(out, dtype, &device))
    }

    fn all_gather(&self, tensor: Tensor<1>) -> Result<Tensor<1>, CommError> {
        self.all_gather_tagged(tensor, 0)
    }

    fn all_gather_tagged(&self, tensor: Tensor<1>, tag: u64) -> Result<Tensor<1>, CommError> {
        let HostBuffer { values, dtype, device } = self.read(tensor)?;
        let sig = CallSig {
            kind: CollectiveKind::AllGather,
            len: values.len(),
            dtype,
            root: 0,
            tag,
        };
        let bytes = self.ring_bytes(values.len(), dtype);
        let out = self.call(sig.clone(), Some(bytes), |comm, state| {
            comm.all_gather_f32(state, values, &sig)
        })?;
        Ok(HostBuffer::into_tensor(out, dtype, &device))
    }

    fn broadcast(&self, tensor: Tensor<1>, root: usize) -> Result<Tensor<1>, CommError> {
        if root >= self.world_size {
            return Err(self.reject(CommError::InvalidRoot {
                root,
                world_size: self.world_size,
            }));
        }
        let HostBuffer { values, dtype, device } = self.read(tensor)?;
        let sig = CallSig {
            kind: CollectiveKind::Broadcast,
            len: values.len(),
            dtype,
            root,
            tag: 0,
        };
        // Counted as the ring broadcast of the in-process backend: every rank but the one
        // before the root forwards the buffer.
        let forwards = (self.rank + 1) % self.world_size != root;
        let bytes = if forwards {
            (values.len() * dtype.size()) as u64
        } else {
            0
        };
        let out = self.call(sig.clone(), Some(bytes), |comm, state| {
            let mut buf = Pinned::new(values);
            // SAFETY: as in `compare_signatures` (signature.rs): the buffer outlives the request or is leaked.
            let request = unsafe {
                state
                    .data
                    .process_at_rank(root as i32)
                    .immediate_broadcast_into(StaticScope, buf.as_static_mut())
            };
            comm.wait(state, request, &sig)?;
            // SAFETY: the broadcast completed.
            Ok(unsafe { buf.into_vec() })
        })?;
        Ok(HostBuffer::into_tensor(out, dtype, &device))
    }

    fn all_gather_many(&self, tensors: Vec<Tensor<1>>) -> Result<Vec<Tensor<1>>, CommError> {
        self.all_gather_group(tensors)
    }

    fn reduce_scatter_many(&self, tensors: Vec<Tensor<1>>, op: ReduceOp) -> Result<Vec<Tensor<1>>, CommError> {
        self.reduce_scatter_group(tensors, op)
    }

    fn barrier(&self) -> Result<(), CommError> {
        let sig = CallSig {
            kind: CollectiveKind::Barrier,
            len: 0,
            dtype: DType::F32,
            root: 0,
            tag: 0,
        };
        self.call(sig.clone(), Some(0), |comm, state| {
            let request = state.data.immediate_barrier();
            comm.wait(state, request, &sig)
        })
    }

    fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }

    /// Marks this rank aborted and sends `reason` to every other rank, whose pending and later
    /// calls then return [`CommError::Aborted`] (within one poll of a pending call).
    fn abort(&self, reason: &str) {
        self.abort_group(reason);
    }

    /// `MPI_Comm_split` of the collectives' communicator (see `split.rs`).
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Collective>, CommError> {
        self.split_group(color, key)
            .map(|comm| Box::new(comm) as Box<dyn Collective>)
    }
}
