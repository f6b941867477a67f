//! What each ZeRO stage does in one optimizer step, in one place: how a bucket's gradient is
//! reduced, which range of it this rank updates, how the update reaches the other ranks, and
//! how this rank holds the parameters. `ShardedOptimizer::step` runs the same sequence for every
//! stage and asks the plan at each of these points, so a new stage feature touches this file.
//!
//! How the parameters are held (whole, or sharded at stage 3) is the plan's
//! [`ParamHolding`](crate::fsdp::holding::ParamHolding) (`plan.params()`): stage 3's gathers,
//! reductions in backward and shard homes sit behind that one trait, in `fsdp/`. Code outside
//! this file never asks which stage runs (the suite's `architecture` test checks that no other
//! file names a stage where the step runs).

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::Tensor;
use burn_shard_comm::{Collective, Work};

use crate::bucket::reducer::BucketReduction;
use crate::error::ShardError;
use crate::fsdp::context::FsdpContext;
use crate::fsdp::holding::{ParamHolding, Sharded, Whole};
use crate::model::layout::{Bucket, FlatLayout};
use crate::overlap::call_tag::CallTag;
use crate::stage::Stage;

/// The stage, with how this rank holds the parameters; the only record of which stage runs.
#[derive(Clone, Debug)]
pub(crate) struct StagePlan {
    stage: Stage,
    params: Arc<dyn ParamHolding>,
}

impl StagePlan {
    /// Stages 0-2: every rank holds the parameters whole. Stage 0 all-reduces and every rank
    /// updates every element; stage 1 all-reduces, each rank updates its range, all-gather;
    /// stage 2 reduce-scatters, each rank updates its range, all-gather.
    ///
    /// # Panics
    /// At stage 3, whose parameters are sharded ([`StagePlan::sharded`]).
    pub(crate) fn whole(stage: Stage) -> Self {
        assert!(stage != Stage::Three, "stage 3 holds shards: StagePlan::sharded");
        Self {
            stage,
            params: Arc::new(Whole),
        }
    }

    /// Stage 3: gradients arrive reduce-scattered on the local shards (the layout covers only
    /// them); each rank updates its shards, which stay local; `ctx` is what the gather and
    /// reduce ops of this rank share.
    pub(crate) fn sharded(ctx: FsdpContext) -> Self {
        Self {
            stage: Stage::Three,
            params: Arc::new(Sharded(ctx)),
        }
    }

    pub(crate) fn stage(&self) -> Stage {
        self.stage
    }

    /// Whether each rank holds slot `index` of `layout` whole or not at all, over `world_size`
    /// ranks: at stage 0 (every rank steps every parameter), at stages 1-2 when the layout put
    /// it in one rank's range ([`FlatLayout::owned_whole`]); never at stage 3, whose step sees
    /// each parameter as a flat shard (`[chunk]`, even alone), and gathers a parameter read
    /// whole to its owner ([`StagePlan::gathers_whole_to_owner`]).
    pub(crate) fn holds_whole(&self, layout: &FlatLayout, index: usize) -> bool {
        match self.stage {
            Stage::Zero => true,
            Stage::One | Stage::Two => layout.owned_whole(index),
            Stage::Three => false,
        }
    }

    /// Whether parameters an optimizer reads whole get a layout that owns them whole
    /// ([`FlatLayout::from_module_owning`]): at stages 1-2 over several ranks.
    pub(crate) fn owns_whole_params(stage: Stage, world_size: usize) -> bool {
        matches!(stage, Stage::One | Stage::Two) && world_size > 1
    }

    /// Whether a parameter an optimizer reads whole is gathered to an owner, which steps it
    /// whole and sends the new values back ([`crate::step::whole_owner`]): at stage 3, whose
    /// ranks hold `[chunk]` shards (stages 0-2 hold it whole where they step it: `holds_whole`).
    pub(crate) fn gathers_whole_to_owner(&self) -> bool {
        self.stage == Stage::Three
    }

    /// How this rank holds the parameters: whole (stages 0-2) or sharded (stage 3).
    pub(crate) fn params(&self) -> &dyn ParamHolding {
        self.params.as_ref()
    }

    /// How a bucket's gradient is reduced at stages 0-2; `None` at stage 3, where backward
    /// reduced it already, per unit.
    pub(crate) fn bucket_reduction(&self) -> Option<BucketReduction> {
        match self.stage {
            Stage::Zero | Stage::One => Some(BucketReduction::AllReduce),
            Stage::Two => Some(BucketReduction::ReduceScatter),
            Stage::Three => None,
        }
    }

    /// The `[padded_numel]` gradient of a bucket, averaged over ranks, as far as this rank
    /// keeps it: whole (stages 0-1), this rank's shard (stage 2), or as it is (stage 3, where
    /// backward already reduced it).
    pub(crate) fn reduce(&self, comm: &dyn Collective, flat: Tensor<1>) -> Result<Tensor<1>, ShardError> {
        match self.bucket_reduction() {
            Some(reduction) => Ok(reduction.reduce(comm, flat)?),
            None => Ok(flat),
        }
    }

    /// Elements of what [`StagePlan::reduce`] returns for `bucket`: the padded bucket, or this
    /// rank's shard of it at stage 2.
    pub(crate) fn reduced_numel(&self, bucket: &Bucket) -> usize {
        self.bucket_reduction()
            .map_or(bucket.padded_numel, |r| r.reduced_numel(bucket))
    }

    /// The elements of `bucket` this rank updates: its shard at stages 1-2, the whole bucket at
    /// stage 0 (replicated) and stage 3 (whose layout covers the local shards).
    pub(crate) fn owned_range(&self, bucket: &Bucket, rank: usize) -> Range<usize> {
        match self.stage {
            Stage::One | Stage::Two => bucket.shard_range(rank),
            Stage::Zero | Stage::Three => 0..bucket.padded_numel,
        }
    }

    /// Whether the ranks' owned ranges partition the gradient (stages 1-3: a sum over all
    /// elements, such as a norm, needs the ranks' partial sums added up) or every rank owns it
    /// all (stage 0: its sums are already global).
    pub(crate) fn owned_ranges_partition(&self) -> bool {
        self.stage != Stage::Zero
    }

    /// The reduced gradient of `range` (what `reduce` kept, cut to the owned range).
    pub(crate) fn gradient_of_range(&self, reduced: Tensor<1>, range: Range<usize>) -> Tensor<1> {
        match self.stage {
            Stage::One => reduced.narrow(0, range.start, range.len()),
            Stage::Zero | Stage::Two | Stage::Three => reduced,
        }
    }

    /// This rank's updated range of bucket `index` -> what the model is rebuilt from: the whole
    /// bucket, all-gathered at stages 1-2, or the range itself (stages 0 and 3, nothing to
    /// send). With `overlap`, the all-gather is started and left running (the step starts each
    /// bucket's as soon as the bucket is stepped, so it runs while the next one is); without,
    /// it completes before this returns.
    pub(crate) fn publish(
        &self,
        comm: &dyn Collective,
        updated: Tensor<1>,
        index: usize,
        overlap: bool,
    ) -> Work<Tensor<1>> {
        match self.stage {
            Stage::One | Stage::Two if overlap => comm.all_gather_async(updated, CallTag::BucketPublish(index).value()),
            Stage::One | Stage::Two => Work::done(comm.all_gather(updated)),
            Stage::Zero | Stage::Three => Work::done(Ok(updated)),
        }
    }

    /// Whether "which parameters got a gradient" must be agreed on by the ranks: at stages 0-2
    /// a rank cannot know alone; at stage 3 a gradient exists on every rank or on none.
    pub(crate) fn gradient_presence_is_local(&self) -> bool {
        self.params.shards_parameters()
    }
}
