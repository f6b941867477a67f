//! Phase 1 of a step: which slots have a gradient on some rank and which buckets the step still
//! reduces (agreed by the ranks), then each bucket's gradient reduced and cut to the range this
//! rank updates (what the stage's [`StagePlan`](crate::step::stage_plan::StagePlan) keeps).

use burn::tensor::Tensor;

use crate::bucket::reducer::{BucketReducer, Early};
use crate::error::ShardError;
use crate::model::flat::{self, tensor_bytes};
use crate::model::memory::PeakTracker;
use crate::step::agreement::any_rank;
use crate::step::context::StepContext;

/// Which slots received a gradient on some rank this step (`[slots]`), and which buckets the
/// step reduces (`[buckets]`). Like Burn's `ModuleOptimizer`, the step leaves slots without a
/// gradient unchanged (value, state, master). At stages 0-2 a rank cannot know alone, so the
/// per-slot flags (`grads` present, or reduced in `early`) are agreed by one all-reduce, with
/// one flag per bucket when buckets were reduced inside backward (whether some rank has
/// unreduced gradients of it): one small collective of `slots` (+ `buckets`) elements. At
/// stage 3 backward registers a gradient on every rank or on none; a `GradientsParams` edited
/// on some ranks only would break that, so with `exchanges_whole` (owners of whole parameters,
/// whose exchanges every rank must enter alike, or wait) the flags are agreed at stage 3 too.
/// Without `early` every bucket is reduced. The same all-reduce carries whether some rank's backwards differed from the ones
/// the bucket reducer learned ([`Early::differs`]); if so, every rank's `reducer` forgets them
/// here, and the next step learns again.
///
/// # Errors
/// [`ShardError::Comm`] when the all-reduce fails.
pub(crate) fn presence(
    cx: &StepContext,
    grads: &flat::SlotValues,
    early: Option<&Early>,
    reducer: Option<&BucketReducer>,
    exchanges_whole: bool,
) -> Result<(Vec<bool>, Vec<bool>), ShardError> {
    let buckets = cx.layout.buckets();
    let mut local: Vec<bool> = grads.iter().map(Option::is_some).collect();
    let Some(early) = early else {
        let every_bucket = vec![true; buckets.len()];
        // With replicas, a slot may have a gradient in one shard group and not in another.
        let local_is_global = cx.plan.gradient_presence_is_local() && cx.replicate.is_none() && !exchanges_whole;
        if local_is_global || cx.world.world_size() == 1 {
            return Ok((local, every_bucket));
        }
        return Ok((any_rank(cx.world, &local, &cx.device)?, every_bucket));
    };
    let unreduced = buckets.iter().map(|b| local[b.slots.clone()].iter().any(|&g| g));
    let unreduced: Vec<bool> = unreduced.collect();
    local.iter_mut().zip(&early.present).for_each(|(g, e)| *g |= e);
    let mut flags = any_rank(cx.world, &[local, unreduced, vec![early.differs]].concat(), &cx.device)?;
    if flags.pop() == Some(true)
        && let Some(reducer) = reducer
    {
        reducer.forget();
    }
    let in_step = flags.split_off(grads.len());
    Ok((flags, in_step))
}

/// Reduces the gradients bucket by bucket and keeps what this stage holds: one
/// `[reduced_numel]` tensor per bucket, in the bucket's dtype. A bucket reduced inside backward
/// (`early`, per bucket) is reduced here only where `reduce_in_step` says some rank's gradients
/// reached the step unreduced (see `crate::bucket`); the two parts are then added in `f32`.
/// Each flat bucket assembled for a reduction counts in `temp` while it is alive.
///
/// # Errors
/// [`ShardError::Comm`] when a reduction fails.
pub(crate) fn reduce_buckets(
    cx: &StepContext,
    mut grad_parts: flat::SlotValues,
    mut early: Vec<Option<Tensor<1>>>,
    reduce_in_step: &[bool],
    temp: &mut PeakTracker,
) -> Result<Vec<Tensor<1>>, ShardError> {
    let layout = cx.layout;
    let mut reduced = Vec::with_capacity(layout.buckets().len());
    for (index, bucket) in layout.buckets().iter().enumerate() {
        let in_step = match reduce_in_step[index] {
            true => {
                let flat = flat::assemble(layout, bucket, &grad_parts, 0..bucket.padded_numel, &cx.device);
                let flat_bytes = tensor_bytes(&flat);
                temp.alloc(flat_bytes);
                let grad = cx.plan.reduce(cx.comm, flat)?;
                temp.free(flat_bytes);
                Some(grad)
            }
            false => None,
        };
        grad_parts[bucket.slots.clone()].iter_mut().for_each(|g| *g = None);
        let early = early.get_mut(index).and_then(Option::take);
        reduced.push(match (early, in_step) {
            (Some(early), Some(in_step)) => (early + crate::optim::master::widen_half(in_step)).cast(bucket.dtype),
            (Some(grad), None) => grad.cast(bucket.dtype),
            (None, Some(grad)) => grad,
            (None, None) => Tensor::zeros([cx.plan.reduced_numel(bucket)], (&cx.device, bucket.dtype)),
        });
    }
    Ok(reduced)
}

/// The owned range of each bucket's reduced gradient (`reduced`, one per bucket), averaged
/// over the replicas with hybrid sharding, unscaled: `[owned range]` per bucket.
///
/// # Errors
/// [`ShardError::Comm`] when the replicas' all-reduce fails.
pub(crate) fn owned_gradients(cx: &StepContext, reduced: Vec<Tensor<1>>) -> Result<Vec<Tensor<1>>, ShardError> {
    cx.layout
        .buckets()
        .iter()
        .zip(reduced)
        .map(|(bucket, grad)| {
            let owned = cx.replica_mean(cx.plan.gradient_of_range(grad, cx.owned_range(bucket)))?;
            Ok(cx.unscale(owned))
        })
        .collect()
}
