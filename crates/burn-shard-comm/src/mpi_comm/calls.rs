//! Issuing one collective ([`MpiComm::call`]: check the group, take the locks, compare
//! signatures, run, count) and the MPI calls collectives are made of: a summing reduce-scatter
//! and an all-gather of host `f32` buffers, plus reading tensors to the host.

use ::mpi::collective::SystemOperation;
use ::mpi::request::StaticScope;
use ::mpi::traits::*;
use burn::tensor::{DType, Tensor};

use super::comm::{MpiComm, State};
use super::pinned::Pinned;
use super::process::mpi_calls;
use crate::CommError;
use crate::call_sig::CallSig;
use crate::host::HostBuffer;

impl MpiComm {
    /// Runs one collective: checks the group, takes the lock, compares signatures with every
    /// rank, then runs `body` and counts one call of `bytes_sent` (`None`: the caller counts).
    pub(super) fn call<T>(
        &self,
        sig: CallSig,
        bytes_sent: Option<u64>,
        body: impl FnOnce(&Self, &mut State) -> Result<T, CommError>,
    ) -> Result<T, CommError> {
        self.check()?;
        let _calls = mpi_calls();
        if ::mpi::environment::is_finalized() {
            return Err(CommError::Unavailable(
                "MPI was finalised: the process is exiting".into(),
            ));
        }
        let mut guard = self.state();
        let state: &mut State = &mut guard;
        self.receive_notice(state);
        self.check()?;
        let seq = state.seq;
        state.seq += 1;
        self.compare_signatures(state, seq, &sig)?;
        let out = body(self, state)?;
        if let Some(bytes) = bytes_sent {
            self.stats.record(sig.kind, bytes);
        }
        Ok(out)
    }

    /// Copies every tensor of a bucket to the host, as [`MpiComm::read`].
    pub(super) fn read_bucket(&self, tensors: Vec<Tensor<1>>) -> Result<Vec<HostBuffer>, CommError> {
        tensors.into_iter().map(|t| self.read(t)).collect()
    }

    /// Copies `tensor` to the host; a dtype the backend cannot move fails the whole group.
    pub(super) fn read(&self, tensor: Tensor<1>) -> Result<HostBuffer, CommError> {
        HostBuffer::read(tensor).map_err(|e| self.reject(e))
    }

    /// This rank's reduced chunk of `values` (length divisible by `world_size`), summed.
    pub(super) fn reduce_scatter_sum(
        &self,
        state: &mut State,
        values: Vec<f32>,
        sig: &CallSig,
    ) -> Result<Vec<f32>, CommError> {
        let chunk = values.len() / self.world_size;
        let send = Pinned::new(values);
        let mut recv = Pinned::new(vec![0f32; chunk]);
        // SAFETY: as in `compare_signatures` (signature.rs): the buffers outlive the request or are leaked.
        let request = unsafe {
            state.data.immediate_reduce_scatter_block_into(
                StaticScope,
                send.as_static(),
                recv.as_static_mut(),
                SystemOperation::sum(),
            )
        };
        self.wait(state, request, sig)?;
        // SAFETY: the reduce-scatter completed.
        Ok(unsafe { (send.into_vec(), recv.into_vec()) }.1)
    }

    /// Every rank's `chunk`, concatenated in rank order.
    pub(super) fn all_gather_f32(
        &self,
        state: &mut State,
        chunk: Vec<f32>,
        sig: &CallSig,
    ) -> Result<Vec<f32>, CommError> {
        let len = chunk.len() * self.world_size;
        let send = Pinned::new(chunk);
        let mut recv = Pinned::new(vec![0f32; len]);
        // SAFETY: as in `compare_signatures` (signature.rs): the buffers outlive the request or are leaked.
        let request = unsafe {
            state
                .data
                .immediate_all_gather_into(StaticScope, send.as_static(), recv.as_static_mut())
        };
        self.wait(state, request, sig)?;
        // SAFETY: the all-gather completed.
        Ok(unsafe { (send.into_vec(), recv.into_vec()) }.1)
    }

    /// Bytes this rank sends in a ring reduce-scatter or all-gather of `chunk` elements per
    /// rank: the volume [`CommStats`](crate::CommStats) counts on every backend (MPI picks its own algorithm).
    pub(super) fn ring_bytes(&self, chunk: usize, dtype: DType) -> u64 {
        ((self.world_size - 1) * chunk * dtype.size()) as u64
    }
}
