//! The grouped calls (`all_gather_many`, `reduce_scatter_many`): one NCCL call per tensor of the
//! bucket, issued as one NCCL group, so a bucket costs one launch and one wait.

use burn::tensor::Tensor;
use cudarc::nccl::result as nccl;

use super::buffers::{Item, nccl_op};
use super::comm::NcclComm;
use crate::stats::CollectiveKind;
use crate::{CommError, ReduceOp};

impl NcclComm {
    /// [`Collective::all_gather_many`](crate::Collective::all_gather_many): one all-gather per
    /// tensor, issued as one NCCL group.
    pub(super) fn all_gather_group(&self, tensors: Vec<Tensor<1>>) -> Result<Vec<Tensor<1>>, CommError> {
        if tensors.is_empty() {
            return Ok(Vec::new());
        }
        let chunks: Vec<usize> = tensors.iter().map(|t| t.dims()[0]).collect();
        let items = tensors
            .into_iter()
            .zip(&chunks)
            .map(|(input, &chunk)| Item {
                input,
                out_len: chunk * self.world_size,
                sent_elems: (self.world_size - 1) * chunk,
            })
            .collect();
        self.run_group(CollectiveKind::AllGather, items, |l| {
            // SAFETY: as in `all_gather` (mod.rs), for item `l.index`: input length
            // `chunks[l.index]`, out_len `chunks[l.index] · world_size`.
            unsafe { nccl::all_gather(l.src, l.dst, chunks[l.index], l.dtype, l.comm, l.stream) }
        })
    }

    /// [`Collective::reduce_scatter_many`](crate::Collective::reduce_scatter_many): one
    /// reduce-scatter per tensor, issued as one NCCL group.
    pub(super) fn reduce_scatter_group(
        &self,
        tensors: Vec<Tensor<1>>,
        op: ReduceOp,
    ) -> Result<Vec<Tensor<1>>, CommError> {
        if tensors.is_empty() {
            return Ok(Vec::new());
        }
        let mut chunks = Vec::with_capacity(tensors.len());
        for t in &tensors {
            let n = t.dims()[0];
            if !n.is_multiple_of(self.world_size) {
                return Err(CommError::NotDivisible {
                    op: "reduce_scatter",
                    len: n,
                    world_size: self.world_size,
                });
            }
            chunks.push(n / self.world_size);
        }
        let items = tensors
            .into_iter()
            .zip(&chunks)
            .map(|(input, &chunk)| Item {
                input,
                out_len: chunk,
                sent_elems: (self.world_size - 1) * chunk,
            })
            .collect();
        self.run_group(CollectiveKind::ReduceScatter, items, |l| {
            // SAFETY: as in `reduce_scatter` (mod.rs), for item `l.index`: input length
            // `chunks[l.index] · world_size`, out_len `chunks[l.index]`.
            unsafe { nccl::reduce_scatter(l.src, l.dst, chunks[l.index], l.dtype, nccl_op(op), l.comm, l.stream) }
        })
    }
}
