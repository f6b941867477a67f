//! [`ParamHolding`]: how this rank holds the model's parameters between steps, whole
//! ([`Whole`], stages 0-2) or as its shards ([`Sharded`], stage 3). The one seam between the
//! optimizer step and stage 3: the step and the optimizer's face ask the plan's holding
//! (`StagePlan::params`) and never reach stage 3's context themselves.
//!
//! Every method has the answer of whole parameters as its default, so [`Whole`] is empty and
//! [`Sharded`] overrides what sharding changes: which shards backward reduced and where they
//! live, the errors its collectives recorded inside autodiff, and the transient bytes of its
//! gathers.

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use burn::module::ParamId;
use burn::tensor::Tensor;

use crate::error::ShardError;
use crate::fsdp::context::FsdpContext;
use crate::fsdp::shard::{PassShards, Shard};
use crate::fsdp::unit_reducer::Reduced;
use crate::model::layout::{Bucket, FlatLayout};
use crate::swap::shard_store::ShardStore;

/// How this rank holds the model's parameters between steps: whole on every rank, or as this
/// rank's shards gathered per use (FSDP). Each rank calls a method at the same point of a step
/// as every other rank: some end collectives that every rank started.
pub(crate) trait ParamHolding: fmt::Debug + Send + Sync {
    /// Whether the parameters are sharded: every forward is then a collective (each sharded
    /// parameter is all-gathered when read), and reading or editing a parameter's value from
    /// outside the model needs a gather.
    fn shards_parameters(&self) -> bool {
        false
    }

    /// Before the optimizer replaces the shards: nothing gathered in this pass is used again,
    /// and nothing is prefetched across the step. Nothing for whole parameters.
    fn end_gather_pass(&self) {}

    /// Ends backward's reductions (once per optimizer call, every rank at the same point) and
    /// returns the gradient shards left in flight, to be added to the step's gradients (none
    /// when the backward matched the learned structure, see the unit reducer); with NVMe
    /// parameter offload they go to the shard file instead. Empty for whole parameters.
    fn take_reduced(&self) -> Vec<Reduced> {
        Vec::new()
    }

    /// Waits for the reductions still in flight and drops them (they belong to a discarded
    /// backward). Nothing for whole parameters.
    fn discard_in_flight(&self) {}

    /// With NVMe parameter offload, takes the gradient shards backward wrote to the shard file
    /// since the last step, per parameter in the order they were reduced (an empty map when
    /// there are none); `None` without.
    fn take_stored_grads(&self) -> Option<HashMap<ParamId, PassShards>> {
        None
    }

    /// Parameters with gradient shards kept on disk for the next step (0 without NVMe
    /// parameter offload).
    fn stored_grad_count(&self) -> usize {
        0
    }

    /// The first error a gather or reduction recorded inside forward or backward (Burn's
    /// autodiff ops cannot return one), taken; `None` for whole parameters.
    fn take_error(&self) -> Option<ShardError> {
        None
    }

    /// The rank's file of parameter and gradient shards (NVMe parameter offload).
    fn shard_store(&self) -> Option<&Arc<ShardStore>> {
        None
    }

    /// The directory of this rank's shard file, which the errors naming another rank give;
    /// empty without NVMe parameter offload.
    fn shard_dir(&self) -> PathBuf {
        let store = self.shard_store();
        store
            .and_then(|store| store.path().parent().map(|dir| dir.to_path_buf()))
            .unwrap_or_default()
    }

    /// `shard` (`[chunk]`) put where this rank's shards live: host memory with parameter
    /// offload, the shard file with NVMe parameter offload (the write queued, see
    /// [`ParamHolding::flush_home`]), kept as it is otherwise and for whole parameters.
    fn to_home(&self, shard: Tensor<1>) -> Shard {
        Shard::Held(shard)
    }

    /// Waits for the shard writes queued by [`ParamHolding::to_home`] and by backward (nothing
    /// without NVMe parameter offload).
    ///
    /// # Errors
    /// [`ShardError::Nvme`] naming the first write that failed.
    fn flush_home(&self) -> Result<(), ShardError> {
        Ok(())
    }

    /// A step that ends without updating (the loss scaler skipped it): the next peak of
    /// transient bytes starts here. Nothing for whole parameters.
    fn skip_step(&self) {}

    /// The step's peak of temporary bytes for `report().memory`, given the step's own
    /// (`step_peak`): with sharded parameters the gathered parameters and full gradients of the
    /// forward and backward that produced the gradients dominate (the step itself holds only
    /// shards), and their peak starts anew.
    fn temporary_peak(&self, step_peak: usize) -> usize {
        step_peak
    }

    /// The updated shard of each slot of `bucket` that was stepped (`keep` unset), cut from
    /// the bucket's updated values (`[padded_numel]`) and put where shards live (written to the
    /// shard file with NVMe parameter offload, behind the step: the step holds one bucket's
    /// shards at a time, plus the writes in flight, and calls [`ParamHolding::flush_home`] at
    /// its end); `None` for whole parameters, whose buckets are published whole.
    fn home_shards(
        &self,
        _layout: &FlatLayout,
        _bucket: &Bucket,
        _updated: &Tensor<1>,
        _keep: &[bool],
    ) -> Option<Vec<(ParamId, Shard)>> {
        None
    }
}

/// Whole parameters on every rank (stages 0-2): every answer is the default.
#[derive(Debug)]
pub(crate) struct Whole;

impl ParamHolding for Whole {}

/// This rank's shards of the parameters, gathered per use (stage 3), through the context its
/// gather and reduce ops share.
#[derive(Debug)]
pub(crate) struct Sharded(pub(crate) FsdpContext);

impl ParamHolding for Sharded {
    fn shards_parameters(&self) -> bool {
        true
    }

    fn end_gather_pass(&self) {
        self.0.end_pass();
    }

    fn take_reduced(&self) -> Vec<Reduced> {
        let reduced = self
            .0
            .finish_reduce()
            .into_iter()
            .filter_map(|r| self.0.keep_reduced(r));
        let reduced = reduced.collect();
        self.0.end_grad_pass();
        reduced
    }

    fn discard_in_flight(&self) {
        drop(self.0.finish_reduce());
    }

    fn take_stored_grads(&self) -> Option<HashMap<ParamId, PassShards>> {
        self.0.home().store()?;
        Some(self.0.take_stored_grads())
    }

    fn stored_grad_count(&self) -> usize {
        self.0.stored_grad_count()
    }

    fn take_error(&self) -> Option<ShardError> {
        self.0.take_error()
    }

    fn shard_store(&self) -> Option<&Arc<ShardStore>> {
        self.0.home().store()
    }

    fn to_home(&self, shard: Tensor<1>) -> Shard {
        self.0.home().to_home(shard)
    }

    fn flush_home(&self) -> Result<(), ShardError> {
        self.0.home().flush()
    }

    fn skip_step(&self) {
        self.0.reset_transient_peak();
    }

    fn temporary_peak(&self, step_peak: usize) -> usize {
        let peak = self.0.transient_peak().max(step_peak);
        self.0.reset_transient_peak();
        peak
    }

    fn home_shards(
        &self,
        layout: &FlatLayout,
        bucket: &Bucket,
        updated: &Tensor<1>,
        keep: &[bool],
    ) -> Option<Vec<(ParamId, Shard)>> {
        let slots = bucket.slots.clone().zip(&layout.slots()[bucket.slots.clone()]);
        let stepped = slots.filter(|(index, _)| !keep[*index]);
        let home = self.0.home();
        Some(
            stepped
                .map(|(_, slot)| {
                    (
                        slot.id,
                        home.to_home(updated.clone().narrow(0, slot.offset, slot.numel)),
                    )
                })
                .collect(),
        )
    }
}
