//! [`StepContext`]: what every phase of one optimizer step reads and nothing changes during it
//! (the layout, the stage's plan, the collective, the device, the loss scale), handed to the
//! phases as one value instead of one argument each.

use std::ops::Range;

use burn::tensor::{DType, Device, Tensor};
use burn_shard_comm::{Collective, ReduceOp};

use crate::error::ShardError;

use crate::model::layout::{Bucket, FlatLayout};
use crate::step::stage_plan::StagePlan;

/// One step's fixed facts, borrowed from the [`ShardedOptimizer`](crate::ShardedOptimizer) for
/// the length of the step.
pub(crate) struct StepContext<'a> {
    /// The flat layout of the trainable parameters (buckets and slots).
    pub(crate) layout: &'a FlatLayout,
    /// What the stage does at each point of the step.
    pub(crate) plan: &'a StagePlan,
    /// Where the state is sharded: every rank, or this rank's shard group.
    pub(crate) comm: &'a dyn Collective,
    /// Every rank of the job (`comm` when flat): decisions every rank makes alike.
    pub(crate) world: &'a dyn Collective,
    /// Hybrid sharding: the ranks holding the same shard in the other shard groups.
    pub(crate) replicate: Option<&'a dyn Collective>,
    /// Where the step's gradients and updates are computed: the parameters' plain device.
    pub(crate) device: Device,
    /// The loss scale the averaged gradients are divided by, read once before the loss scaler
    /// measures this step (which may grow or back off the scale for the next one); `None`
    /// without a loss scaler.
    pub(crate) loss_scale: Option<f32>,
    /// `world_size / total items` for a step given each rank's item count
    /// (`ShardedOptimizer::step_with_items`): turns the mean over the ranks of their summed
    /// gradients into the gradient of the mean over every item; `None` for `step`.
    pub(crate) item_scale: Option<f32>,
}

impl StepContext<'_> {
    /// The elements of `bucket` this rank updates (see [`StagePlan::owned_range`]).
    pub(crate) fn owned_range(&self, bucket: &Bucket) -> Range<usize> {
        self.plan.owned_range(bucket, self.comm.rank())
    }

    /// With hybrid sharding, `grad` (this rank's gradient shard, already averaged over its
    /// shard group) averaged over the replicas too: the mean over every rank, as a flat run
    /// takes it. `grad` itself when flat.
    ///
    /// # Errors
    /// [`ShardError::Comm`] when the all-reduce fails.
    pub(crate) fn replica_mean(&self, grad: Tensor<1>) -> Result<Tensor<1>, ShardError> {
        match self.replicate {
            Some(replicate) => {
                let dtype = grad.dtype();
                Ok(replicate.all_reduce(grad, ReduceOp::Avg)?.cast(dtype))
            }
            None => Ok(grad),
        }
    }

    /// The averaged gradient divided by the loss scale and multiplied by the item scale, in
    /// `f32` for `bf16`/`f16` gradients (so they lose nothing to it; `f32` and `f64` keep their
    /// dtype); the gradient itself without either.
    pub(crate) fn unscale(&self, grad: Tensor<1>) -> Tensor<1> {
        match self.unscale_factor() {
            Some(factor) => crate::optim::master::widen_half(grad).mul_scalar(factor),
            None => grad,
        }
    }

    /// The dtype [`StepContext::unscale`] gives a gradient of `dtype`.
    pub(crate) fn unscaled_dtype(&self, dtype: DType) -> DType {
        match self.unscale_factor().is_some() && crate::optim::master::needs_master(dtype) {
            true => DType::F32,
            false => dtype,
        }
    }

    /// What [`StepContext::unscale`] multiplies by, `None` without a loss or item scale.
    fn unscale_factor(&self) -> Option<f32> {
        match (self.loss_scale, self.item_scale) {
            (None, None) => None,
            (Some(scale), None) => Some(1.0 / scale),
            (None, Some(items)) => Some(items),
            (Some(scale), Some(items)) => Some(((items as f64) / (scale as f64)) as f32),
        }
    }
}
