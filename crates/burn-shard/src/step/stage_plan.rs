//! What each ZeRO stage does in one optimizer step, in one place: how a bucket's gradient is
//! reduced, which range of it this rank updates, how the update reaches the other ranks, and
//! where the parameters live. `ShardedOptimizer::step` runs the same sequence for every stage
//! and asks the plan at each of these points, so a new stage feature touches this file.
//!
//! Stage 3's per-rank context (the gather schedule, the unit reducer, where the shards live) is
//! reached through the plan's methods too, each a no-op or an empty answer at stages 0-2: code
//! outside this file never asks which stage runs (the suite's `architecture` test checks that
//! no other file matches on the plan's variants or takes its context).

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use burn::module::{Module, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn_shard_comm::{Collective, Work};

use crate::error::ShardError;
use crate::hooks::exchange;
use crate::model::flat;
use crate::model::layout::{Bucket, FlatLayout};
use crate::overlap::bucket_reducer::BucketReduction;
use crate::overlap::call_tag::CallTag;
use crate::overlap::context::FsdpContext;
use crate::placement::shard::Shard;
use crate::stage::Stage;
use crate::step::pending::PassShards;
use crate::swap::shard_store::ShardStore;

/// The stage, with what stage 3 needs (the context its gather ops share); the only record of
/// which stage runs.
#[derive(Clone, Debug)]
pub(crate) enum StagePlan {
    /// Stage 0: all-reduce, every rank updates every element.
    Zero,
    /// Stage 1: all-reduce, each rank updates its range, all-gather.
    One,
    /// Stage 2: reduce-scatter, each rank updates its range, all-gather.
    Two,
    /// Stage 3: gradients arrive reduce-scattered on the local shards (the layout covers only
    /// them); each rank updates its shards, which stay local.
    Three(FsdpContext),
}

impl StagePlan {
    pub(crate) fn stage(&self) -> Stage {
        match self {
            StagePlan::Zero => Stage::Zero,
            StagePlan::One => Stage::One,
            StagePlan::Two => Stage::Two,
            StagePlan::Three(_) => Stage::Three,
        }
    }

    /// Stage 3's shared context; private: the rest of the crate asks the plan's methods below.
    fn fsdp(&self) -> Option<&FsdpContext> {
        match self {
            StagePlan::Three(ctx) => Some(ctx),
            _ => None,
        }
    }

    /// Whether the parameters are sharded (stage 3): every forward is then a collective (each
    /// sharded parameter is all-gathered when read), and reading or editing a parameter's value
    /// from outside the model needs a gather.
    pub(crate) fn shards_parameters(&self) -> bool {
        self.fsdp().is_some()
    }

    /// Before the optimizer replaces the shards (stage 3): nothing gathered in this pass is used
    /// again, and nothing is prefetched across the step.
    pub(crate) fn end_gather_pass(&self) {
        if let Some(fsdp) = self.fsdp() {
            fsdp.end_pass();
        }
    }

    /// Stage 3: ends the unit reducer's pass (once per optimizer call) and adds to `grads` the
    /// gradient shards backward left in flight (none when the backward matched the learned
    /// structure, see [`crate::fsdp`]'s reducer); with NVMe parameter offload they go to the
    /// shard file instead. Every rank calls this at the same point. Nothing at stages 0-2.
    pub(crate) fn take_reduced<M: Module>(&self, model: &M, grads: &mut GradientsParams) {
        if let Some(fsdp) = self.fsdp() {
            let reduced = fsdp.finish_reduce().into_iter().filter_map(|r| fsdp.keep_reduced(r));
            crate::overlap::unit_reducer::add_to_grads(model, reduced.collect(), grads);
            fsdp.end_grad_pass();
        }
    }

    /// Stage 3: waits for the reductions still in flight and drops them (they belong to a
    /// discarded backward).
    pub(crate) fn discard_in_flight(&self) {
        if let Some(fsdp) = self.fsdp() {
            drop(fsdp.finish_reduce());
        }
    }

    /// Stage 3 with NVMe parameter offload: takes the gradient shards backward wrote to the
    /// shard file since the last step, per parameter in the order they were reduced; `None`
    /// without NVMe parameter offload (an empty map when there are none).
    pub(crate) fn take_stored_grads(&self) -> Option<HashMap<ParamId, PassShards>> {
        let fsdp = self.fsdp()?;
        fsdp.home().store()?;
        Some(fsdp.take_stored_grads())
    }

    /// Parameters with gradient shards kept on disk for the next step (0 without NVMe
    /// parameter offload).
    pub(crate) fn stored_grad_count(&self) -> usize {
        self.fsdp().map_or(0, |fsdp| fsdp.stored_grad_count())
    }

    /// Stage 3: the first error a gather or reduction recorded inside forward or backward
    /// (Burn's autodiff ops cannot return one), taken; `None` at stages 0-2.
    pub(crate) fn take_error(&self) -> Option<ShardError> {
        self.fsdp().and_then(|fsdp| fsdp.take_error())
    }

    /// The rank's file of parameter and gradient shards (stage 3 with NVMe parameter offload).
    pub(crate) fn shard_store(&self) -> Option<&Arc<ShardStore>> {
        self.fsdp().and_then(|fsdp| fsdp.home().store())
    }

    /// The directory of this rank's shard file, which the errors naming another rank give;
    /// empty without NVMe parameter offload.
    pub(crate) fn shard_dir(&self) -> PathBuf {
        let store = self.shard_store();
        store
            .and_then(|store| store.path().parent().map(|dir| dir.to_path_buf()))
            .unwrap_or_default()
    }

    /// `shard` (`[chunk]`) put where this rank's shards live: host memory with parameter
    /// offload, the shard file with NVMe parameter offload (the write queued, see
    /// [`StagePlan::flush_home`]), kept as it is otherwise and at stages 0-2.
    pub(crate) fn to_home(&self, shard: Tensor<1>) -> Shard {
        match self.fsdp() {
            Some(fsdp) => fsdp.home().to_home(shard),
            None => Shard::Held(shard),
        }
    }

    /// Waits for the shard writes queued by [`StagePlan::to_home`] and by backward (nothing
    /// without NVMe parameter offload).
    ///
    /// # Errors
    /// [`ShardError::Nvme`] naming the first write that failed.
    pub(crate) fn flush_home(&self) -> Result<(), ShardError> {
        self.fsdp().map_or(Ok(()), |fsdp| fsdp.home().flush())
    }

    /// A step that ends without updating (the loss scaler skipped it): stage 3 starts its next
    /// peak of transient bytes here.
    pub(crate) fn skip_step(&self) {
        if let Some(fsdp) = self.fsdp() {
            fsdp.reset_transient_peak();
        }
    }

    /// The step's peak of temporary bytes for `report().memory`, given the step's own
    /// (`step_peak`): at stage 3 the gathered parameters and full gradients of the forward and
    /// backward that produced the gradients dominate (the step itself holds only shards), and
    /// their peak starts anew.
    pub(crate) fn temporary_peak(&self, step_peak: usize) -> usize {
        match self.fsdp() {
            Some(fsdp) => {
                let peak = fsdp.transient_peak().max(step_peak);
                fsdp.reset_transient_peak();
                peak
            }
            None => step_peak,
        }
    }

    /// How a bucket's gradient is reduced at stages 0-2; `None` at stage 3, where backward
    /// reduced it already, per unit.
    pub(crate) fn bucket_reduction(&self) -> Option<BucketReduction> {
        match self {
            StagePlan::Zero | StagePlan::One => Some(BucketReduction::AllReduce),
            StagePlan::Two => Some(BucketReduction::ReduceScatter),
            StagePlan::Three(_) => None,
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
        match self {
            StagePlan::One | StagePlan::Two => bucket.shard_range(rank),
            StagePlan::Zero | StagePlan::Three(_) => 0..bucket.padded_numel,
        }
    }

    /// Whether the ranks' owned ranges partition the gradient (stages 1-3: a sum over all
    /// elements, such as a norm, needs the ranks' partial sums added up) or every rank owns it
    /// all (stage 0: its sums are already global).
    pub(crate) fn owned_ranges_partition(&self) -> bool {
        !matches!(self, StagePlan::Zero)
    }

    /// The reduced gradient of `range` (what `reduce` kept, cut to the owned range).
    pub(crate) fn gradient_of_range(&self, reduced: Tensor<1>, range: Range<usize>) -> Tensor<1> {
        match self {
            StagePlan::One => reduced.narrow(0, range.start, range.len()),
            StagePlan::Zero | StagePlan::Two | StagePlan::Three(_) => reduced,
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
        match self {
            StagePlan::One | StagePlan::Two if overlap => {
                comm.all_gather_async(updated, CallTag::BucketPublish(index).value())
            }
            StagePlan::One | StagePlan::Two => Work::done(comm.all_gather(updated)),
            StagePlan::Zero | StagePlan::Three(_) => Work::done(Ok(updated)),
        }
    }

    /// Whether "which parameters got a gradient" must be agreed on by the ranks: at stages 0-2
    /// a rank cannot know alone; at stage 3 a gradient exists on every rank or on none.
    pub(crate) fn gradient_presence_is_local(&self) -> bool {
        matches!(self, StagePlan::Three(_))
    }

    /// The current values of the layout's slots: the parameters (stages 0-2) or this rank's
    /// shards (stage 3; read one by one as the step reaches them, from disk with NVMe
    /// parameter offload).
    pub(crate) fn read_values<M: Module>(
        &self,
        model: &M,
        layout: &FlatLayout,
    ) -> Result<Vec<Option<Shard>>, ShardError> {
        Ok(match self {
            StagePlan::Three(_) => {
                let mut shards = exchange::collect_shards(model);
                let mut values = Vec::with_capacity(layout.slots().len());
                for slot in layout.slots() {
                    let shard = shards.remove(&slot.id).ok_or_else(|| ShardError::UnknownParam {
                        path: slot.path.clone(),
                        id: slot.id.to_string(),
                    })?;
                    values.push(Some(shard));
                }
                values
            }
            _ => flat::param_values(model, layout)?
                .0
                .into_iter()
                .map(|value| value.map(Shard::Held))
                .collect(),
        })
    }

    /// Stage 3: the updated shard of each slot of `bucket` that was stepped (`keep` unset), cut
    /// from the bucket's updated values and put where shards live (written to the shard file
    /// with NVMe parameter offload, behind the step: the step holds one bucket's shards at a
    /// time, plus the writes in flight, and calls [`StagePlan::flush_home`] at its end);
    /// `None` at stages 0-2, whose buckets are published whole.
    pub(crate) fn home_shards(
        &self,
        layout: &FlatLayout,
        bucket: &Bucket,
        updated: &Tensor<1>,
        keep: &[bool],
    ) -> Option<Vec<(ParamId, Shard)>> {
        let StagePlan::Three(ctx) = self else { return None };
        let slots = bucket.slots.clone().zip(&layout.slots()[bucket.slots.clone()]);
        let stepped = slots.filter(|(index, _)| !keep[*index]);
        Some(
            stepped
                .map(|(_, slot)| {
                    (
                        slot.id,
                        ctx.home().to_home(updated.clone().narrow(0, slot.offset, slot.numel)),
                    )
                })
                .collect(),
        )
    }

    /// What the update phase produced, as this stage holds it: the published buckets (`full`,
    /// stages 0-2), or the stepped slots' new shards (`shards`, stage 3).
    pub(crate) fn updated(&self, full: Vec<Tensor<1>>, shards: HashMap<ParamId, Shard>) -> Updated {
        match self {
            StagePlan::Three(_) => Updated::Shards(shards),
            _ => Updated::Buckets(full),
        }
    }

    /// `model` rebuilt from the step's update, slots with `keep` set left as they are.
    pub(crate) fn write_values<M: Module>(&self, model: M, layout: &FlatLayout, updated: Updated, keep: &[bool]) -> M {
        match updated {
            Updated::Shards(shards) => exchange::replace_shards(model, shards),
            Updated::Buckets(buckets) => flat::scatter_into(model, layout, &buckets, keep),
        }
    }
}

/// What a step updated: each bucket's published values (stages 0-2), or at stage 3 the
/// stepped slots' new shards, already where shards live.
pub(crate) enum Updated {
    Buckets(Vec<Tensor<1>>),
    Shards(HashMap<ParamId, Shard>),
}
