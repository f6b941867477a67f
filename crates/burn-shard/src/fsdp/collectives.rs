//! Buffer layouts of the stage-3 collectives: a parameter of `numel` elements is split into
//! `world_size` chunks of `chunk = ceil(numel / N)` elements, the last one zero-padded.

use burn::tensor::{DType, Tensor};

use crate::fsdp::comm_context::CommContext;

/// This rank's `[chunk]` shard, on the device it is gathered on (see
/// [`ShardHome::to_compute`](crate::fsdp::home::ShardHome::to_compute)) -> the full
/// `[numel]` parameter (padding dropped) there.
/// On a collective error the error is recorded and zeros are returned (the step then fails).
pub(crate) fn all_gather_full(ctx: &CommContext, shard: Tensor<1>, numel: usize, tag: u64) -> Tensor<1> {
    let (device, dtype) = (shard.device(), shard.dtype());
    match ctx.comm().all_gather_tagged(shard, tag) {
        Ok(full) if full.dims()[0] == numel => full,
        Ok(full) => full.narrow(0, 0, numel),
        Err(e) => {
            ctx.record_error(e);
            Tensor::zeros([numel], (&device, dtype))
        }
    }
}

/// The full `[numel]` gradient -> this rank's `[chunk]` shard of its mean over ranks.
pub(crate) fn reduce_scatter_grad(ctx: &CommContext, full: Tensor<1>, chunk: usize, tag: u64) -> Tensor<1> {
    let (device, dtype) = (full.device(), full.dtype());
    let padded = pad_to(full, chunk * ctx.comm().world_size());
    match ctx
        .comm()
        .reduce_scatter_tagged(padded, burn_shard_comm::ReduceOp::Avg, tag)
    {
        Ok(shard) => shard,
        Err(e) => {
            ctx.record_error(e);
            Tensor::zeros([chunk], (&device, dtype))
        }
    }
}

/// `full` (`[numel]`) zero-padded to `[padded]` elements, `padded >= numel` (as is when equal).
pub(crate) fn pad_to(full: Tensor<1>, padded: usize) -> Tensor<1> {
    let numel = full.dims()[0];
    if numel == padded {
        return full;
    }
    let (device, dtype) = (full.device(), full.dtype());
    Tensor::cat(vec![full, Tensor::zeros([padded - numel], (&device, dtype))], 0)
}

/// The group of `dtype` among `groups` (one per dtype, in first-seen order: a grouped collective
/// moves one dtype), appended by `new` when there is none yet.
pub(crate) fn dtype_group<G>(
    groups: &mut Vec<G>,
    dtype: DType,
    dtype_of: impl Fn(&G) -> DType,
    new: impl FnOnce() -> G,
) -> &mut G {
    let index = match groups.iter().position(|g| dtype_of(g) == dtype) {
        Some(i) => i,
        None => {
            groups.push(new());
            groups.len() - 1
        }
    };
    &mut groups[index]
}
