//! The grouped calls (`all_gather_many`, `reduce_scatter_many`): a whole bucket in one MPI call,
//! its tensors concatenated (rank-major for the reduce-scatter) and split again afterwards.

use burn::tensor::Tensor;

use super::comm::MpiComm;
use super::signature::bucket_sig;
use crate::host::HostBuffer;
use crate::stats::CollectiveKind;
use crate::{CommError, ReduceOp};

impl MpiComm {
    /// [`Collective::all_gather_many`](crate::Collective::all_gather_many): the bucket in one
    /// MPI all-gather.
    pub(super) fn all_gather_group(&self, tensors: Vec<Tensor<1>>) -> Result<Vec<Tensor<1>>, CommError> {
        let buffers = self.read_bucket(tensors)?;
        if buffers.is_empty() {
            return Ok(Vec::new());
        }
        let n = self.world_size;
        let sig = bucket_sig(CollectiveKind::AllGather, &buffers);
        // One all-gather of the concatenated chunks: rank r's block holds its chunk of every
        // tensor, in order.
        let send: Vec<f32> = buffers.iter().flat_map(|b| b.values.iter().copied()).collect();
        let block = send.len();
        let gathered = self.call(sig.clone(), None, |comm, state| comm.all_gather_f32(state, send, &sig))?;
        let mut offset = 0;
        let out = buffers
            .iter()
            .map(|b| {
                let c = b.values.len();
                let mut full = Vec::with_capacity(n * c);
                for r in 0..n {
                    full.extend_from_slice(&gathered[r * block + offset..r * block + offset + c]);
                }
                offset += c;
                self.stats
                    .record(CollectiveKind::AllGather, self.ring_bytes(c, b.dtype));
                HostBuffer::into_tensor(full, b.dtype, &b.device)
            })
            .collect();
        Ok(out)
    }

    /// [`Collective::reduce_scatter_many`](crate::Collective::reduce_scatter_many): the bucket
    /// in one MPI reduce-scatter.
    pub(super) fn reduce_scatter_group(
        &self,
        tensors: Vec<Tensor<1>>,
        op: ReduceOp,
    ) -> Result<Vec<Tensor<1>>, CommError> {
        let buffers = self.read_bucket(tensors)?;
        if buffers.is_empty() {
            return Ok(Vec::new());
        }
        let n = self.world_size;
        if let Some(b) = buffers.iter().find(|b| b.values.len() % n != 0) {
            return Err(self.reject(CommError::NotDivisible {
                op: "reduce_scatter",
                len: b.values.len(),
                world_size: n,
            }));
        }
        let sig = bucket_sig(CollectiveKind::ReduceScatter, &buffers);
        // One reduce-scatter of a rank-major buffer: block r holds chunk r of every tensor, so
        // rank r receives its chunk of each, in order.
        let mut send = Vec::with_capacity(buffers.iter().map(|b| b.values.len()).sum());
        for r in 0..n {
            for b in &buffers {
                let c = b.values.len() / n;
                send.extend_from_slice(&b.values[r * c..(r + 1) * c]);
            }
        }
        let own = self.call(sig.clone(), None, |comm, state| {
            comm.reduce_scatter_sum(state, send, &sig)
        })?;
        let mut offset = 0;
        let out = buffers
            .iter()
            .map(|b| {
                let c = b.values.len() / n;
                let mut chunk = own[offset..offset + c].to_vec();
                offset += c;
                if op == ReduceOp::Avg {
                    chunk.iter_mut().for_each(|v| *v /= n as f32);
                }
                self.stats
                    .record(CollectiveKind::ReduceScatter, self.ring_bytes(c, b.dtype));
                HostBuffer::into_tensor(chunk, b.dtype, &b.device)
            })
            .collect();
        Ok(out)
    }
}
