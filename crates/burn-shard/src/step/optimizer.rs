//! [`ShardedOptimizer`]: one ZeRO step around one of Burn's optimizers.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::AtomicU32;

use burn::module::{Module, ParamGroup};
use burn::optim::GradientsParams;
use burn::optim::grad_clipping::GradientClipping;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::tensor::{Device, Tensor, TensorData};
use burn_shard_comm::{Collective, ReduceOp, Work};

use crate::error::ShardError;
use crate::hooks::exchange;
use crate::model::buffers::Buffers;
use crate::model::census::Census;
use crate::model::flat::{self, tensor_bytes};
use crate::model::layout::{Bucket, FlatLayout};
use crate::model::memory::{MemoryReport, PeakTracker, module_param_bytes};
use crate::optim::groups::Groups;
use crate::optim::into_optimizer::IntoOptimizer;
use crate::optim::loss_scale::{self, LossScaler, LossScaling};
use crate::optim::master::MasterWeightStep;
use crate::overlap::bucket_reducer::{BucketReducer, Early};
use crate::stage::Stage;
use crate::step::bucket_grads::{BucketGrads, StoredGrads};
use crate::step::grad_norm::{self, GradNorms};
use crate::step::last_step::LastStep;
use crate::step::pending::{self, PendingGradients};
use crate::step::slot_state::SlotStates;
use crate::step::stage_plan::{StagePlan, Updated};
use crate::swap::read_ahead::ReadAhead;
use crate::swap::shard_store::Shard;
use crate::swap::swapper::Swapper;

/// A Burn optimizer whose state (stages 1-3), gradients (stages 2-3) and parameters (stage 3)
/// are partitioned over the ranks of a [`Collective`]. Built by
/// [`ShardConfig::init`](crate::ShardConfig::init).
///
/// Each bucket of the [`FlatLayout`] is reduced as one flat buffer; then the piece of each
/// parameter in this rank's range of the bucket (its whole bucket at stage 0, its shard at
/// stages 1-2, its local shards at stage 3) is stepped by `O::step` with that parameter's own
/// state: Burn's own optimizer, so the update math is Burn's, or
/// [`FusedAdam`](burn_shard_kernels::FusedAdam) when Burn's Adam/AdamW config was passed (see
/// [`IntoOptimizer`](crate::IntoOptimizer)).
///
/// A parameter that received a gradient on no rank keeps its value and its state (step count,
/// moments, master), as with Burn's `ModuleOptimizer`.
/// Adam, AdamW and SGD (with or without momentum) are element-wise, so the flat step equals
/// Burn's per-parameter step element for element. Optimizers that mix elements of a tensor
/// (per-tensor norms: LAMB, Muon, Adafactor) would see buckets instead of parameters and must
/// not be used here.
///
/// What a step does with the averaged gradient before the optimizer sees it, in this order
/// (each on the owned range only, with norms summed over the ranks, so it equals single-device
/// training):
/// 1. divide by the loss scale ([`LossScaler`], `f16`); a non-finite global norm skips the step
///    on every rank;
/// 2. clip by global norm ([`ShardConfig::with_max_grad_norm`](crate::ShardConfig::with_max_grad_norm),
///    PyTorch's `clip_grad_norm_`);
/// 3. Burn's per-parameter clipping of the parameter's group (`grad_clipping` of a Burn config,
///    or of [`ShardedOptimizer::with_group`]): `Norm(t)` with the norm of the whole parameter,
///    `Value(t)` element-wise, both exactly as Burn's `ModuleOptimizer` clips.
///
/// Parameter groups ([`ShardedOptimizer::with_group`], Burn's `ParamGroup`) choose each
/// parameter's hyper-parameters (no weight decay on biases and norms), and a
/// `ModuleLearningRate` passed to `step` its learning rate, as in Burn.
pub struct ShardedOptimizer<O: MasterWeightStep> {
    /// The optimizer (and per-parameter clipping) of each parameter.
    groups: Groups<O>,
    /// The parameters' (plain) device, where small agreement collectives place their tensors.
    pub(crate) device: Device,
    pub(crate) comm: Arc<dyn Collective>,
    pub(crate) layout: Arc<FlatLayout>,
    pub(crate) plan: StagePlan,
    /// The model's float entries as `init` found them (paths, full shapes, kinds).
    pub(crate) census: Census,
    /// Per layout slot: the optimizer state and `f32` master of this rank's piece.
    pub(crate) slots: SlotStates<O>,
    /// Running-state buffers, averaged over the ranks at every step.
    buffers: Buffers,
    /// Clip by global norm to this (`ShardConfig::with_max_grad_norm`).
    max_grad_norm: Option<f32>,
    /// `f16` loss scaling (`ShardConfig::with_loss_scaler`).
    pub(crate) loss_scaler: Option<LossScaler>,
    /// The bits of the scale a loss was last multiplied by ([`ShardedOptimizer::scale_loss`],
    /// [`LossScaling`]) since the last optimizer call, 0 for none: checked and cleared by each
    /// `step` and `accumulate`.
    loss_scaled: Arc<AtomicU32>,
    /// Set while a step updates the parameters and the optimizer state, bucket by bucket: an
    /// error then leaves them half updated.
    updating: bool,
    /// The error of a step that failed while `updating`: every later step, `accumulate`,
    /// `map_params` and save is refused ([`ShardError::HalfAppliedStep`]).
    half_applied: Option<String>,
    /// What the last optimizer call measured (norm, applied, overlap, bytes), for the reports.
    last: LastStep,
    /// The micro-batch sums the next step adds (`accumulate`, and buckets reduced inside
    /// micro-batch backwards).
    pub(crate) pending: PendingGradients,
    /// Stages 0-2 reducing inside backward (see [`crate::bucket`]); `None` where they reduce in
    /// the step alone.
    pub(crate) bucket_reducer: Option<BucketReducer>,
    /// This run's history, saved with its checkpoints: a new run id at `init` and at every
    /// load, and the checkpoint loaded (see [`crate::run::Lineage`]).
    pub(crate) lineage: crate::run::Lineage,
}

/// What `ShardConfig` asks of the step beyond the stage (global-norm clipping, loss scaling,
/// NVMe offload), and where the parameters live.
pub(crate) struct StepOptions {
    pub(crate) max_grad_norm: Option<f32>,
    pub(crate) loss_scaler: Option<LossScaler>,
    /// The base group's per-parameter clipping (from the optimizer's Burn config).
    pub(crate) clipping: Option<GradientClipping>,
    /// The parameters' plain device.
    pub(crate) device: Device,
    /// NVMe offload: the swap file the optimizer state lives in between steps (the step then
    /// ends with one more all-reduce, of the ranks whose swap failed).
    pub(crate) swap: Option<Swapper>,
    /// NVMe parameter offload (stage 3): the step starts and ends with one more all-reduce
    /// each, of the ranks whose shard file failed.
    pub(crate) stores_shards: bool,
}

impl StepOptions {
    /// A hash of what changes the step's collectives and decisions, equal on ranks configured
    /// alike.
    pub(crate) fn fingerprint(&self) -> u64 {
        let mut h = DefaultHasher::new();
        self.max_grad_norm.map(f32::to_bits).hash(&mut h);
        self.loss_scaler.as_ref().map(LossScaler::fingerprint).hash(&mut h);
        crate::optim::groups::clipping_key(self.clipping.as_ref()).hash(&mut h);
        self.swap.is_some().hash(&mut h);
        self.stores_shards.hash(&mut h);
        h.finish()
    }
}

impl<O: MasterWeightStep> ShardedOptimizer<O> {
    pub(crate) fn new(
        optim: O,
        comm: Arc<dyn Collective>,
        layout: Arc<FlatLayout>,
        plan: StagePlan,
        census: Census,
        buffers: Buffers,
        options: StepOptions,
    ) -> Self {
        let (slots, buckets) = (layout.slots().len(), layout.buckets().len());
        Self {
            groups: Groups::new(optim, options.clipping, &layout),
            device: options.device,
            comm,
            layout,
            plan,
            census,
            slots: SlotStates::new(slots, options.swap),
            buffers,
            max_grad_norm: options.max_grad_norm,
            loss_scaler: options.loss_scaler,
            loss_scaled: Arc::default(),
            updating: false,
            half_applied: None,
            last: LastStep::default(),
            pending: PendingGradients::new(slots, buckets),
            bucket_reducer: None,
            lineage: crate::run::Lineage::fresh(),
        }
    }

    /// Stages 0-2: the reducer the model's hooks hand their gradients to.
    pub(crate) fn with_bucket_reducer(mut self, reducer: Option<BucketReducer>) -> Self {
        self.bucket_reducer = reducer;
        self
    }

    /// Stages 0-2: ends the reducer's backwards (see [`crate::bucket`]) and returns the buckets
    /// it reduced, with those kept from `accumulate`, and which slots they hold; `None` without
    /// a reducer. Every rank calls this first, at the same point.
    fn take_early(&mut self, is_step: bool) -> Result<Option<Early>, ShardError> {
        let Some(reducer) = &self.bucket_reducer else {
            return Ok(None);
        };
        let mut early = reducer.finish(is_step)?;
        self.last.overlapped_buckets = early.started_in_backward;
        self.pending.merge_reduced_into(&mut early);
        Ok(Some(early))
    }

    /// Steps the parameters `group` matches with `optim` and `grad_clipping` instead, as Burn's
    /// `ModuleOptimizer::with_group`: a parameter takes the last group that matches it (by
    /// `ParamId` or module path, e.g. `ParamGroup::from_regex(r"(bias|gamma|beta)$")` for the
    /// recipe "no weight decay on biases and norm weights"), and `grad_clipping` `None` means no
    /// per-parameter clipping for the group. The parameters it matches keep their optimizer state
    /// (step count, moments, `f32` masters), as with Burn: a run resumed with
    /// [`ShardedOptimizer::load_checkpoint`] continues the same whether its groups are added
    /// before or after the load. A collective: every rank calls it with the same groups (checked).
    ///
    /// # Errors
    /// [`ShardError::InvalidConfig`] when `optim` is a Burn config that carries its own
    /// `grad_clipping` (pass it as `grad_clipping` instead, as Burn's `with_group` takes it),
    /// when the group clips by norm and the configuration clips by global norm too, or when
    /// `optim` cannot step flat shards; [`ShardError::LayoutMismatch`] when ranks added
    /// different groups; [`ShardError::Comm`].
    pub fn with_group<C: IntoOptimizer<Optimizer = O>>(
        mut self,
        group: ParamGroup,
        optim: C,
        grad_clipping: Option<GradientClipping>,
    ) -> Result<Self, ShardError> {
        if optim.grad_clipping()?.is_some() {
            return Err(ShardError::InvalidConfig(
                "the optimizer config given to with_group carries its own grad_clipping; pass the clipping as \
                 with_group's grad_clipping argument (as ModuleOptimizer::with_group takes it) and remove it from \
                 the config"
                    .to_string(),
            ));
        }
        check_one_norm_clipping(self.max_grad_norm, grad_clipping.as_ref())?;
        let optim = optim.into_optimizer()?;
        // The matched slots keep their optimizer state (step count, moments, masters), as with
        // Burn's `ModuleOptimizer::with_group`: a group added after `load_checkpoint` resumes.
        self.groups.add(group, optim, grad_clipping, &self.layout);
        crate::model::layout::check_same_layout(self.comm.as_ref(), self.groups.fingerprint(), &self.device)?;
        Ok(self)
    }

    /// Averages `grads` over the ranks, updates this rank's shard with Burn's optimizer and
    /// all-gathers the result, returning `model` with every rank holding identical parameters
    /// (stages 0-2) or its updated shards (stage 3), and identical running-state buffers (their
    /// mean over ranks, see the crate docs).
    ///
    /// `grads` are this rank's gradients (`GradientsParams::from_grads(loss.backward(), &model)`)
    /// for its part of the global batch; with equal local batch sizes and a mean loss, their
    /// average is the gradient of the global batch. A trainable parameter that received no
    /// gradient on a rank counts as a zero gradient there; one that received a gradient on no
    /// rank is left as it is, optimizer state included, exactly as Burn's `ModuleOptimizer`
    /// leaves it: its step count, moments and master do not move, so a parameter first used at
    /// a later step (a conditional branch, an expert) takes the first Adam step of its own when
    /// it is. Only parameters trainable at `init` are in the layout: one frozen then and made
    /// trainable later needs a new `init`.
    ///
    /// At stages 0-2 with [`ShardConfig::overlap_comm`](crate::ShardConfig::overlap_comm) (the
    /// default, where the collective overlaps), buckets are reduced inside backward from the
    /// second step on, and their gradients are not in `grads`: this call takes them from the
    /// rank's reducer (see [`crate::bucket`]). Edits to `grads` then reach only the gradients
    /// that are there; to edit every gradient before the step, turn `overlap_comm` off.
    ///
    /// At stage 3 `grads` already hold this rank's shards of the mean gradients (reduce-scattered
    /// inside backward), and a parameter left out of `grads` is not stepped, as in Burn. This
    /// holds while the backwards between two optimizer calls have the structure learned before
    /// the first call; when it changes, the last reduce-scatters are still in flight when
    /// `backward()` returns, this call adds their shards to `grads` (whatever was left out),
    /// and the structure is learned again.
    ///
    /// `lr` is one learning rate (`f64`, e.g. from a Burn `LrScheduler`) or Burn's
    /// `ModuleLearningRate` (per-group rates from a `ModuleLrScheduler`); every rank must pass
    /// the same. Gradients given to [`ShardedOptimizer::accumulate`] since the last step are
    /// added to `grads`. With a [`LossScaler`], a step whose gradient overflowed on any rank
    /// leaves the parameters and the optimizer state unchanged on every rank (running-state
    /// buffers are still averaged; see [`ShardedOptimizer::loss_scaler`]).
    ///
    /// # Errors
    /// [`ShardError::Comm`] when a collective fails (the group is then aborted: stop training);
    /// [`ShardError::UnknownParam`] / [`ShardError::ShapeChanged`] when `model` is not the
    /// module returned by `init`; [`ShardError::LossNotScaled`] when a loss scaler is
    /// configured and no loss since the last optimizer call went through
    /// [`ShardedOptimizer::scale_loss`]; [`ShardError::HalfAppliedStep`] once a step failed
    /// while it was updating (a disk that filled, a collective lost mid-update): this and every
    /// later step, `accumulate`, `map_params` and save are refused, since some buckets hold the
    /// new values and some the old; resume from the last checkpoint.
    pub fn step<M: Module>(
        &mut self,
        lr: impl Into<ModuleLearningRate>,
        model: M,
        grads: GradientsParams,
    ) -> Result<M, ShardError> {
        if let Some(fsdp) = self.plan.fsdp() {
            // The shards are about to change: no gather of this pass is used again.
            fsdp.end_pass();
        }
        let result = self
            .check_call("step")
            .and_then(|()| self.step_with(&lr.into(), model, grads));
        if let Err(e) = &result {
            if std::mem::take(&mut self.updating) && self.half_applied.is_none() {
                self.half_applied = Some(e.to_string());
            }
            // A rank that fails alone (a wrong model, say) must not leave the others waiting.
            self.comm.abort(&format!(
                "rank {} failed in ShardedOptimizer::step: {e}",
                self.comm.rank()
            ));
        }
        result
    }

    /// Refuses `op` (what the caller is about to do, "save a checkpoint") once a step failed
    /// half-way.
    ///
    /// # Errors
    /// [`ShardError::HalfAppliedStep`] after a step failed while it was updating: `op` would see
    /// parameters and optimizer state of two different steps.
    pub(crate) fn refuse_half_applied(&self, op: &str) -> Result<(), ShardError> {
        match &self.half_applied {
            Some(cause) => Err(ShardError::HalfAppliedStep {
                op: op.to_string(),
                cause: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    /// What `step` and `accumulate` (`op`) check before they take a gradient: no step failed
    /// half-way, and the backwards since the last call scaled their loss by the current scale
    /// when a loss scaler is configured and the model has a parameter to step (a frozen teacher
    /// has none). Local: every rank finds the same.
    ///
    /// # Errors
    /// [`ShardError::HalfAppliedStep`], [`ShardError::LossNotScaled`].
    fn check_call(&self, op: &str) -> Result<(), ShardError> {
        self.refuse_half_applied(op)?;
        let trains = !self.layout.slots().is_empty();
        loss_scale::check_scaled(self.loss_scaler.as_ref().filter(|_| trains), &self.loss_scaled)
    }

    /// Stage 3: ends the reducer's pass (once per optimizer call) and adds to `grads` the
    /// gradient shards backward left in flight (none when the backward matched the learned
    /// structure, see [`crate::fsdp`]'s reducer). Every rank calls this at the same point.
    fn take_reduced<M: Module>(&self, model: &M, grads: &mut GradientsParams) {
        if let Some(fsdp) = self.plan.fsdp() {
            let reduced = fsdp.finish_reduce().into_iter().filter_map(|r| fsdp.keep_reduced(r));
            crate::overlap::unit_reducer::add_to_grads(model, reduced.collect(), grads);
            fsdp.end_grad_pass();
        }
    }

    /// Drops every gradient handed to the optimizer since the last `step` or `accumulate`
    /// without applying it: the micro-batch sums `accumulate` kept, at stages 0-2 the
    /// gradients of backwards whose buckets were reduced inside backward, and at stage 3 the
    /// last units' reductions still in flight and, with
    /// [`ShardConfig::nvme_offload_params`](crate::ShardConfig::nvme_offload_params), every
    /// gradient shard on disk (there the step applies every gradient shard reduced since the
    /// last `step`, `accumulate` or `discard_gradients`, whatever `grads` holds). Call it after a
    /// backward whose gradients you do not step with (a NaN loss you skip, an auxiliary
    /// backward): reduced inside backward, they would otherwise add to the next step, as
    /// PyTorch's `.grad` does until `zero_grad()`. A collective: every rank calls it at the same
    /// point.
    ///
    /// # Errors
    /// [`ShardError::Comm`] when a reduction in flight failed.
    pub fn discard_gradients(&mut self) -> Result<(), ShardError> {
        // The discarded backward's scaled loss does not cover the next one.
        self.loss_scaled.store(0, std::sync::atomic::Ordering::SeqCst);
        // Stage 3: the last units' reductions still in flight belong to the discarded backward.
        if let Some(fsdp) = self.plan.fsdp() {
            drop(fsdp.finish_reduce());
        }
        self.drop_kept_sums();
        match &self.bucket_reducer {
            Some(reducer) => reducer.discard(),
            None => Ok(()),
        }
    }

    /// Drops the micro-batch sums kept until the next step: unreduced (`accumulate`) and
    /// reduced inside backward.
    pub(crate) fn drop_kept_sums(&mut self) {
        self.pending.clear();
        if let Some(fsdp) = self.plan.fsdp() {
            fsdp.take_stored_grads();
        }
    }

    /// Stage 3: returns the first error a collective met inside forward or backward (gathers
    /// and reduce-scatters cannot return errors through Burn's autodiff; they record them and
    /// use zeros). `step` checks this itself; call it after an evaluation pass run outside it.
    pub fn check_collectives(&self) -> Result<(), ShardError> {
        match self.plan.fsdp().and_then(|ctx| ctx.take_error()) {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    /// Adds `grads` (one micro-batch's gradients, `GradientsParams::from_grads(loss.backward(),
    /// &model)`) to those the next [`ShardedOptimizer::step`] applies, without communicating at
    /// stages 0-2 (PyTorch DDP's `no_sync`, FSDP2's `set_requires_gradient_sync(False)`): `k`
    /// micro-batches then one step send the bytes of one step. The sum is kept per parameter,
    /// unreduced and whole (stages 0-2: one full gradient per rank, as DDP's `no_sync`).
    /// Stage 3 reduce-scatters each micro-batch's gradients inside its backward, as it must to
    /// free the gathered parameters, so every micro-batch sends its reduce-scatter (and its
    /// all-gathers) and only the sharded sums are kept; the step then adds nothing on the wire.
    ///
    /// The step adds the sums, so to train on the mean over `k` equal micro-batches divide each
    /// micro-batch's loss by `k` (as with PyTorch and Burn's `GradientsAccumulator`).
    ///
    /// # Errors
    /// As [`ShardedOptimizer::step`].
    pub fn accumulate<M: Module>(&mut self, model: &M, mut grads: GradientsParams) -> Result<(), ShardError> {
        self.take_reduced(model, &mut grads);
        let result = self
            .check_call("accumulate gradients")
            .and_then(|()| self.take_early(false))
            .and_then(|early| {
                self.check_collectives()?;
                let (parts, _) = flat::take_grads(model, &self.layout, &mut grads)?;
                // Reduced already: kept reduced, added by the step.
                self.pending.keep(early, parts);
                if let Some(reducer) = self.bucket_reducer.as_ref().filter(|r| r.armed()) {
                    // The next backward is expected to end in a step: its buckets carry these
                    // sums, so the step has nothing left to reduce.
                    reducer.seed(self.pending.unreduced_mut());
                }
                Ok(())
            });
        if let Err(e) = &result {
            self.comm.abort(&format!(
                "rank {} failed in ShardedOptimizer::accumulate: {e}",
                self.comm.rank()
            ));
        }
        result
    }

    /// The step, one phase after the other: collect the gradients, (1) reduce them, (2) cut
    /// the owned ranges and measure norms (a skipped step ends there), (3) update and publish
    /// the parameters, then rebuild the model and average the buffers.
    fn step_with<M: Module>(
        &mut self,
        lr: &ModuleLearningRate,
        model: M,
        mut grads: GradientsParams,
    ) -> Result<M, ShardError> {
        let layout = self.layout.clone();
        let mut temp = PeakTracker::default();
        self.last.applied = false;
        // Stage 3: the gradients were reduce-scattered inside backward (the last units' may
        // still be in flight); a collective that failed there left its error behind.
        self.take_reduced(&model, &mut grads);
        self.check_gathers()?;
        // Stages 0-2: the buckets reduced inside backward (none without a reducer).
        let early = self.take_early(true)?;

        let (mut grad_parts, device) = flat::take_grads(&model, &layout, &mut grads)?;
        drop(grads);
        self.pending.add_to_step(&mut grad_parts, layout.slots().iter());
        // Stage 3 with NVMe parameter offload: the gradient shards backward wrote to disk.
        let stored = self.stored_gradients(&mut grad_parts);
        let any_stored = stored.as_ref().is_some_and(|s| s.iter().any(|g| !g.is_empty()));
        let device = device.or_else(|| any_stored.then(|| self.device.clone()));
        let Some(device) = device else {
            // No trainable parameter (a frozen teacher): only the buffers move.
            self.last.applied = true;
            return self.buffers.sync(self.comm.as_ref(), model);
        };
        let (has_grad, reduce_in_step) = self.with_gradient(&grad_parts, early.as_ref(), &device)?;
        let early_reduced = early.map(|e| e.reduced).unwrap_or_default();

        let grads = match stored {
            Some(shards) => {
                self.last.gradients_bytes = 0;
                BucketGrads::Stored(StoredGrads {
                    shards,
                    ahead: ReadAhead::default(),
                })
            }
            None => {
                let reduced = self.reduce_buckets(grad_parts, early_reduced, &reduce_in_step, &device, &mut temp)?;
                BucketGrads::Held(self.owned_gradients(reduced).into_iter().map(Some).collect())
            }
        };
        let Measured::Apply(norms) = self.measure(&grads, &device)? else {
            return self.buffers.sync(self.comm.as_ref(), model);
        };
        let clip = Clip {
            global: match (self.max_grad_norm, &norms) {
                (Some(max), Some(norms)) => grad_norm::global_clip_coef(max, norms.total),
                _ => 1.0,
            },
            norms: norms.as_ref(),
        };
        // `update_and_publish` sets `updating` once it starts changing state (see `half_applied`).
        let updated = self.update_and_publish(lr, &clip, &model, grads, &has_grad, &device, &mut temp)?;
        self.updating = false;
        self.record_temporary_peak(&temp);
        let keep: Vec<bool> = has_grad.iter().map(|g| !g).collect();
        let model = self.plan.write_values(model, &layout, updated, &keep);
        if let Some(store) = self.plan.fsdp().and_then(|ctx| ctx.shard_store()) {
            self.last.param_io = store.take_io();
        }
        self.last.applied = true;
        self.buffers.sync(self.comm.as_ref(), model)
    }

    /// Phase 1: reduces the gradients bucket by bucket and keeps what this stage holds (one
    /// `[reduced_numel]` tensor per bucket, in the bucket's dtype). A bucket reduced inside
    /// backward (`early`) is reduced here only for gradients that reached the step unreduced
    /// on some rank (see `crate::bucket`).
    fn reduce_buckets(
        &mut self,
        mut grad_parts: flat::SlotValues,
        mut early: Vec<Option<Tensor<1>>>,
        reduce_in_step: &[bool],
        device: &Device,
        temp: &mut PeakTracker,
    ) -> Result<Vec<Tensor<1>>, ShardError> {
        let layout = self.layout.clone();
        let mut reduced = Vec::with_capacity(layout.buckets().len());
        for (index, bucket) in layout.buckets().iter().enumerate() {
            let in_step = match reduce_in_step[index] {
                true => {
                    let flat = flat::assemble(&layout, bucket, &grad_parts, 0..bucket.padded_numel, device);
                    let flat_bytes = tensor_bytes(&flat);
                    temp.alloc(flat_bytes);
                    let grad = self.plan.reduce(self.comm.as_ref(), flat)?;
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
                (None, None) => Tensor::zeros([self.plan.reduced_numel(bucket)], (device, bucket.dtype)),
            });
        }
        self.last.gradients_bytes = reduced.iter().map(tensor_bytes).sum();
        Ok(reduced)
    }

    /// Stage 3 with NVMe parameter offload: each layout slot's gradient shards that backward
    /// wrote to the shard file, in the order they were reduced; the slot's entry of `grad_parts` becomes a
    /// stride-0 zero view of its length (no memory), so the phases that ask which slots have a
    /// gradient see it. `None` without NVMe parameter offload.
    fn stored_gradients(&self, grad_parts: &mut flat::SlotValues) -> Option<Vec<pending::PassShards>> {
        let ctx = self.plan.fsdp()?;
        ctx.shard_store()?;
        let mut kept = ctx.take_stored_grads();
        let mut stored = vec![Vec::new(); self.layout.slots().len()];
        for (index, slot) in self.layout.slots().iter().enumerate() {
            let Some(shards) = kept.remove(&slot.id) else {
                continue;
            };
            // Every reduced shard went to disk (a failed write fails the step before here), and
            // `accumulate` keeps none in memory: nothing of the slot is in `grad_parts`.
            debug_assert!(grad_parts[index].is_none(), "a gradient both in memory and on disk");
            grad_parts[index] = Some(Tensor::<1>::zeros([1], (&self.device, slot.dtype)).expand([slot.numel]));
            stored[index] = shards;
        }
        Some(stored)
    }

    /// Bucket `index`'s owned-range gradient, unscaled: taken from memory, or read from the
    /// shard file (each slot's shards summed as Burn's gradients
    /// and `accumulate` sum them in memory, see [`pending::sum_passes`], then assembled and unscaled as
    /// [`Self::reduce_buckets`] and [`Self::owned_gradients`] do, so the values are the same).
    /// The next bucket's shards are read while this one is used (buckets are taken in order).
    fn bucket_grad(&self, grads: &mut BucketGrads, index: usize, device: &Device) -> Result<Tensor<1>, ShardError> {
        let stored = match grads {
            BucketGrads::Held(held) => return Ok(held[index].take().expect("each bucket is taken once")),
            BucketGrads::Stored(stored) => stored,
        };
        let buckets = self.layout.buckets();
        let bucket = &buckets[index];
        // This bucket's reads first (started with the previous bucket, but for the first).
        let this: Vec<_> = stored.shards_of(bucket).cloned().collect();
        stored.ahead.start(&this, false);
        if let Some(next) = buckets.get(index + 1) {
            let next: Vec<_> = stored.shards_of(next).cloned().collect();
            stored.ahead.start(&next, true);
        }
        let mut values: flat::SlotValues = vec![None; self.layout.slots().len()];
        for index in bucket.slots.clone() {
            let dtype = self.layout.slots()[index].dtype;
            values[index] = pending::sum_passes(&stored.shards[index], dtype, device, &mut stored.ahead)?;
        }
        let flat = flat::assemble(&self.layout, bucket, &values, 0..bucket.padded_numel, device);
        let range = self.plan.owned_range(bucket, self.comm.rank());
        Ok(self.unscale(self.plan.gradient_of_range(flat, range)))
    }

    /// Phase 2a: the owned range of each bucket's reduced gradient, unscaled.
    fn owned_gradients(&self, reduced: Vec<Tensor<1>>) -> Vec<Tensor<1>> {
        self.layout
            .buckets()
            .iter()
            .zip(reduced)
            .map(|(bucket, grad)| {
                let range = self.plan.owned_range(bucket, self.comm.rank());
                self.unscale(self.plan.gradient_of_range(grad, range))
            })
            .collect()
    }

    /// Phase 2b: the gradients' norms where clipping or loss scaling needs them (one small
    /// all-reduce at stages 1-3), and the loss scaler's verdict.
    fn measure(&mut self, grads: &BucketGrads, device: &Device) -> Result<Measured, ShardError> {
        let norms = match self.needs_norms() {
            true => {
                // Taken from a clone (handles): stored gradients are read once more for their
                // norms.
                let mut grads = grads.clone();
                let mut grad = |index| self.bucket_grad(&mut grads, index, device);
                Some(grad_norm::measure(
                    &self.layout,
                    &self.plan,
                    self.comm.as_ref(),
                    &mut grad,
                    device,
                )?)
            }
            false => None,
        };
        self.last.grad_norm = norms.as_ref().map(|n| n.total);
        if let (Some(scaler), Some(norms)) = (&mut self.loss_scaler, &norms)
            && !scaler.update(norms.total)
        {
            tracing::warn!(
                rank = self.comm.rank(),
                scale = scaler.scale(),
                "gradient overflow: step skipped, loss scale backed off"
            );
            if let Some(fsdp) = self.plan.fsdp() {
                fsdp.reset_transient_peak();
            }
            return Ok(Measured::Skipped);
        }
        if let Some(norms) = norms.as_ref().filter(|n| !n.total.is_finite()) {
            // Without a loss scaler nothing skips: say so, as PyTorch's clip_grad_norm_ would
            // with error_if_nonfinite.
            tracing::warn!(
                rank = self.comm.rank(),
                norm = norms.total,
                "non-finite gradient norm: the step applies it (configure a LossScaler to skip such steps)"
            );
        }
        Ok(Measured::Apply(norms))
    }

    /// Phase 3: Burn's optimizer on each parameter's piece of the owned range, then the
    /// all-gather of the updated shards; returns each bucket's updated values as this stage
    /// holds them (at stage 3 the new shards, each put where shards live as soon as its bucket
    /// is stepped). Where backward reduces buckets (the collectives overlap compute), each
    /// bucket's all-gather is started as soon as the bucket is stepped and runs while the next
    /// one is; all are waited for before returning.
    #[allow(clippy::too_many_arguments)]
    fn update_and_publish<M: Module>(
        &mut self,
        lr: &ModuleLearningRate,
        clip: &Clip,
        model: &M,
        mut grads: BucketGrads,
        has_grad: &[bool],
        device: &Device,
        temp: &mut PeakTracker,
    ) -> Result<Updated, ShardError> {
        let layout = self.layout.clone();
        let overlap = self.bucket_reducer.is_some();
        let keep: Vec<bool> = has_grad.iter().map(|g| !g).collect();
        let values = self.plan.read_values(model, &layout)?;
        // From here an error leaves some buckets stepped and others not (see `half_applied`).
        self.updating = true;
        self.slots.begin_step(self.stepped_slots(has_grad));
        let mut publishing = Vec::with_capacity(layout.buckets().len());
        let mut shards = HashMap::new();
        let mut failed = None;
        // With NVMe parameter offload: the next bucket's parameter shards are read while this
        // one is stepped (this bucket's first, for the first bucket).
        let mut param_reads = ReadAhead::default();
        for (index, bucket) in layout.buckets().iter().enumerate() {
            // Queued in the order they are waited for: this bucket's parameters and gradients,
            // then the next bucket's gradients and parameters.
            param_reads.start(&self.piece_shards(&values, bucket), false);
            let range = self.plan.owned_range(bucket, self.comm.rank());
            let grad = self.bucket_grad(&mut grads, index, device);
            if let Some(next) = layout.buckets().get(index + 1) {
                param_reads.start(&self.piece_shards(&values, next), true);
            }
            let param = match grad.and_then(|grad| {
                let reads = &mut param_reads;
                self.update_range(lr, clip, bucket, range, &values, reads, grad, has_grad, device)
            }) {
                Ok(param) => param,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            };
            let param_bytes = bytes_on(&param, device);
            temp.alloc(param_bytes);
            // Stage 3: the new shards go where shards live now (written behind the step with
            // NVMe parameter offload), so the step holds one bucket of them at a time.
            match self.plan.home_shards(&layout, bucket, &param, &keep) {
                Some(homed) => {
                    temp.free(param_bytes);
                    let held = homed.iter().filter_map(|(_, s)| s.held()).map(|t| bytes_on(t, device));
                    temp.alloc(held.sum());
                    shards.extend(homed);
                }
                None => publishing.push((
                    param_bytes,
                    self.plan.publish(self.comm.as_ref(), param, index, overlap),
                )),
            }
        }
        drop((values, param_reads));
        let (param_bytes, works): (Vec<usize>, Vec<_>) = publishing.into_iter().unzip();
        let waited = Work::wait_all(works.into_iter().map(Some));
        // Ended whatever the collectives did, so that no write of this step is left in flight.
        let swapped = self.slots.end_step();
        let homed = self.plan.fsdp().map_or(Ok(()), |ctx| ctx.flush_home());
        // A failed read or write of the shard file comes first, then the swap file's.
        let own = match failed {
            Some(e) => Err(e),
            None => homed.and(swapped),
        };
        let stores_shards = self.plan.fsdp().is_some_and(|ctx| ctx.shard_store().is_some());
        match self.slots.swaps() || stores_shards {
            true => self.agree_on_disk(own, device, "in this step")?,
            false => own?,
        }
        let full: Vec<Tensor<1>> = waited?.into_iter().flatten().collect();
        if self.plan.fsdp().is_some() {
            return Ok(Updated::Shards(shards));
        }
        for (param_bytes, updated) in param_bytes.into_iter().zip(&full) {
            temp.free(param_bytes);
            temp.alloc(bytes_on(updated, device));
        }
        Ok(Updated::Buckets(full))
    }

    /// The values of the pieces of `bucket` this rank steps (stage 3: their shards).
    fn piece_shards(&self, values: &[Option<Shard>], bucket: &Bucket) -> Vec<Shard> {
        let range = self.plan.owned_range(bucket, self.comm.rank());
        let pieces = self.layout.pieces(bucket, &range);
        pieces.filter_map(|(index, _)| values[index].clone()).collect()
    }

    /// The slots this step updates on this rank, in the order `update_range` takes them: those
    /// with a gradient and a piece in this rank's range, bucket by bucket.
    fn stepped_slots(&self, has_grad: &[bool]) -> Vec<usize> {
        let mut order = Vec::new();
        for bucket in self.layout.buckets() {
            let range = self.plan.owned_range(bucket, self.comm.rank());
            order.extend(
                self.layout
                    .pieces(bucket, &range)
                    .map(|(i, _)| i)
                    .filter(|&i| has_grad[i]),
            );
        }
        order
    }

    /// NVMe offload (of the optimizer state or the stage-3 shards): gives a phase (`when`) the
    /// same outcome on every rank (one all-reduce of which ranks' disk reads or writes failed):
    /// a rank whose own failed (`own`) returns its error, the others one naming it.
    pub(crate) fn agree_on_disk(
        &self,
        own: Result<(), ShardError>,
        device: &Device,
        when: &str,
    ) -> Result<(), ShardError> {
        let failed = self.failed_ranks(own.is_err(), device);
        // This rank's own error first: it names the cause, a failed all-reduce does not.
        own?;
        let failed = failed?;
        match failed.is_empty() {
            true => Ok(()),
            false => Err(ShardError::Nvme {
                path: self.slots.swap_dir().unwrap_or_else(|| self.shard_dir()),
                reason: format!(
                    "rank(s) {failed:?} could not read or write their swap files {when} (this rank's files are fine)"
                ),
                fix: "see those ranks' errors; then resume from the last checkpoint".into(),
            }),
        }
    }

    /// The directory of this rank's parameter shard file (NVMe parameter offload; empty
    /// without it), which the errors naming another rank give.
    fn shard_dir(&self) -> std::path::PathBuf {
        let store = self.plan.fsdp().and_then(|ctx| ctx.shard_store().cloned());
        store
            .and_then(|store| store.path().parent().map(|dir| dir.to_path_buf()))
            .unwrap_or_default()
    }

    /// The step's peak of temporary bytes, for `memory_report`.
    fn record_temporary_peak(&mut self, temp: &PeakTracker) {
        self.last.temporary_peak_bytes = match self.plan.fsdp() {
            // Stage 3: the gathered parameters and full gradients of the forward and backward
            // that produced the gradients dominate; the step itself holds only shards.
            Some(fsdp) => {
                let peak = fsdp.transient_peak().max(temp.peak());
                fsdp.reset_transient_peak();
                peak
            }
            None => temp.peak(),
        };
    }

    /// Steps each parameter's piece of `range` of `bucket` with its own optimizer state (so
    /// per-parameter state, such as Adam's step count, follows Burn's per-parameter semantics)
    /// and returns the updated `[range.len()]` range. `grad` covers `range`. Pieces of
    /// parameters without a gradient on any rank are returned as they are, their state and
    /// master untouched; padding stays zero. Each value is taken as its piece is reached (from
    /// the shard file with NVMe parameter offload, its read started in `reads`: an error when it
    /// cannot be read).
    #[allow(clippy::too_many_arguments)]
    fn update_range(
        &mut self,
        lr: &ModuleLearningRate,
        clip: &Clip,
        bucket: &Bucket,
        range: Range<usize>,
        values: &[Option<Shard>],
        reads: &mut ReadAhead,
        grad: Tensor<1>,
        has_grad: &[bool],
        device: &Device,
    ) -> Result<Tensor<1>, ShardError> {
        let layout = self.layout.clone();
        let mut pieces = Vec::new();
        for (index, part) in layout.pieces(bucket, &range) {
            let slot = &layout.slots()[index];
            let len = part.len();
            let value = values[index].as_ref().map(|v| reads.take(v).wait()).transpose()?;
            let param = flat::slot_piece(&value, slot, part.clone(), bucket.dtype, device);
            if !has_grad[index] {
                pieces.push(param);
                continue;
            }
            let grad = grad.clone().narrow(0, slot.offset + part.start - range.start, len);
            let grad = self.clip(index, grad, clip);
            let lr = lr.lr_from_param(slot.id, Some(&slot.path));
            let param = self.slots.step(index, self.groups.optim(index), lr, param, grad);
            pieces.push(param);
        }
        Ok(flat::join_range(pieces, bucket, range, device))
    }

    /// Whether this step measures gradient norms: to clip by them, or to detect an overflow.
    fn needs_norms(&self) -> bool {
        self.max_grad_norm.is_some() || self.loss_scaler.is_some() || self.groups.clips_by_norm()
    }

    /// The averaged gradient divided by the loss scale, in `f32` for `bf16`/`f16` gradients (so
    /// they lose nothing to the division; `f32` and `f64` keep their dtype); the gradient itself
    /// without a loss scaler.
    fn unscale(&self, grad: Tensor<1>) -> Tensor<1> {
        match &self.loss_scaler {
            Some(scaler) => {
                let grad = crate::optim::master::widen_half(grad);
                grad.mul_scalar(1.0 / scaler.scale())
            }
            None => grad,
        }
    }

    /// Layout slot `slot`'s piece `grad` clipped: by global norm, then by its group's clipping.
    fn clip(&self, slot: usize, grad: Tensor<1>, clip: &Clip) -> Tensor<1> {
        let grad = grad_norm::scale(grad, clip.global);
        match self.groups.clipping(slot) {
            Some(clipping) => {
                let norm = clip.norms.map_or(0.0, |n| n.per_slot[slot]);
                grad_norm::clip_piece(clipping, grad, norm)
            }
            None => grad,
        }
    }

    /// Which slots received a gradient on some rank this step, and which buckets the step
    /// reduces. Like Burn's `ModuleOptimizer`, the step leaves slots without a gradient
    /// unchanged (value, state, master). At stages 0-2 a rank cannot know alone, so the
    /// per-slot flags (`grads` present, or reduced in `early`) are all-reduced, with one flag per
    /// bucket when buckets were reduced inside backward (whether some rank has unreduced
    /// gradients of it): one small collective of `slots` (+ `buckets`) elements. At stage 3 a
    /// gradient exists on every rank or on none. Without `early` every bucket is reduced.
    /// The same all-reduce carries whether some rank's backwards differed from the ones the
    /// bucket reducer learned ([`Early::differs`]); if so, every rank's reducer forgets them
    /// here, and the next step learns again.
    fn with_gradient(
        &self,
        grads: &flat::SlotValues,
        early: Option<&Early>,
        device: &Device,
    ) -> Result<(Vec<bool>, Vec<bool>), ShardError> {
        let buckets = self.layout.buckets();
        let mut local: Vec<bool> = grads.iter().map(Option::is_some).collect();
        let Some(early) = early else {
            let every_bucket = vec![true; buckets.len()];
            if self.plan.gradient_presence_is_local() || self.comm.world_size() == 1 {
                return Ok((local, every_bucket));
            }
            return Ok((self.any_rank(&local, device)?, every_bucket));
        };
        let unreduced = buckets.iter().map(|b| local[b.slots.clone()].iter().any(|&g| g));
        let unreduced: Vec<bool> = unreduced.collect();
        local.iter_mut().zip(&early.present).for_each(|(g, e)| *g |= e);
        let mut flags = self.any_rank(&[local, unreduced, vec![early.differs]].concat(), device)?;
        if flags.pop() == Some(true)
            && let Some(reducer) = &self.bucket_reducer
        {
            reducer.forget();
        }
        let in_step = flags.split_off(grads.len());
        Ok((flags, in_step))
    }

    /// Stage 3: as [`ShardedOptimizer::check_collectives`], and with NVMe parameter offload the
    /// ranks agree (one all-reduce of a flag per rank): a shard file that could not be read in
    /// forward or backward fails this step on every rank, the others naming the rank.
    fn check_gathers(&self) -> Result<(), ShardError> {
        let Some(ctx) = self.plan.fsdp().filter(|ctx| ctx.shard_store().is_some()) else {
            return self.check_collectives();
        };
        // The gradient shards backward queued for writing are on disk, or their failure known.
        let own = self.check_collectives().and(ctx.flush_home());
        self.agree_on_disk(own, &self.device, "in forward or backward")
    }

    /// The ranks that passed `failed = true`, in order (one all-reduce of a flag per rank, on
    /// `device`): how ranks that each did their part of an operation agree on its outcome.
    pub(crate) fn failed_ranks(&self, failed: bool, device: &Device) -> Result<Vec<usize>, ShardError> {
        let mut flags = vec![false; self.comm.world_size()];
        flags[self.comm.rank()] = failed;
        Ok((self.any_rank(&flags, device)?.into_iter().enumerate())
            .filter_map(|(rank, failed)| failed.then_some(rank))
            .collect())
    }

    /// `flags` OR-ed over the ranks (one all-reduce).
    fn any_rank(&self, flags: &[bool], device: &Device) -> Result<Vec<bool>, ShardError> {
        let values: Vec<f32> = flags.iter().map(|&g| if g { 1.0 } else { 0.0 }).collect();
        let n = values.len();
        let summed = self
            .comm
            .all_reduce(Tensor::from_data(TensorData::new(values, [n]), device), ReduceOp::Sum)?;
        let summed: Vec<f32> = summed.into_data().convert::<f32>().iter::<f32>().collect();
        Ok(summed.iter().map(|&c| c > 0.0).collect())
    }

    /// This rank's memory, measured from the tensors held now (`model`'s parameters and the
    /// optimizer state) and during the last step (gradients, transient buffers).
    ///
    /// Optimizer state (moments, `f32` masters) counts as `optimizer_state_bytes` when its
    /// tensors are on the parameters' device and as `host_bytes` when they are elsewhere (in
    /// host memory, with [`Offload`](crate::Offload)), tensor by tensor; stage-3 shards count
    /// as `parameters_bytes` on the device, as `host_bytes` in host memory (with
    /// [`ShardConfig::offload_params`](crate::ShardConfig::offload_params)) and as `disk_bytes`
    /// in the shard file (with [`ShardConfig::nvme_offload_params`](crate::ShardConfig::nvme_offload_params)).
    pub fn memory_report<M: Module>(&self, model: &M) -> MemoryReport {
        let device = flat::plain_device(model).ok();
        let state = self.slots.bytes(device.as_ref());
        // Stage 3: shards by where they live (host memory with parameter offload, disk with
        // NVMe parameter offload).
        let (mut shards_on_device, mut shards_elsewhere, mut shards_on_disk) = (0, 0, 0);
        let parameters_bytes = match self.plan.fsdp() {
            Some(_) => {
                let shards = exchange::collect_shards(model);
                for shard in shards.values() {
                    match shard.held() {
                        None => shards_on_disk += shard.numel() * shard.dtype().size(),
                        Some(held) if device.as_ref().is_none_or(|d| held.device() == *d) => {
                            shards_on_device += tensor_bytes(held)
                        }
                        Some(held) => shards_elsewhere += tensor_bytes(held),
                    }
                }
                shards_on_device + module_param_bytes(model, |id| shards.contains_key(id))
            }
            None => module_param_bytes(model, |_| false),
        };
        MemoryReport {
            rank: self.comm.rank(),
            world_size: self.comm.world_size(),
            stage: self.stage().number(),
            parameters_bytes,
            gradients_bytes: self.last.gradients_bytes + self.pending.last_cycle_bytes(),
            optimizer_state_bytes: state.on_device,
            host_bytes: state.elsewhere + shards_elsewhere,
            disk_bytes: state.on_disk + shards_on_disk,
            temporary_peak_bytes: self.last.temporary_peak_bytes,
        }
    }

    /// Buckets whose reduction started inside backward, before the last `step` or `accumulate`
    /// was called (stages 0-2 with [`ShardConfig::overlap_comm`](crate::ShardConfig::overlap_comm),
    /// see [`crate::bucket`]): every bucket of [`ShardedOptimizer::layout`] when the backward
    /// matched the learned one; 0 at the first step (which learns), for micro-batches given to
    /// `accumulate` as learned (not when a step was expected instead), at stage 3 and where
    /// buckets are reduced in the step.
    pub fn overlapped_buckets(&self) -> usize {
        self.last.overlapped_buckets
    }

    /// The collective this optimizer reduces over (e.g. to average a loss for logging).
    pub fn comm(&self) -> &dyn Collective {
        self.comm.as_ref()
    }

    /// The flat layout of the trainable parameters.
    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    /// The optimizer each flat shard is stepped with (e.g. to ask a
    /// [`FusedAdam`](burn_shard_kernels::FusedAdam) which path it takes): the one `init` was
    /// given (groups added with [`ShardedOptimizer::with_group`] have their own).
    pub fn optimizer(&self) -> &O {
        self.groups.base()
    }

    /// The global L2 norm of the gradient the last step applied: averaged over the ranks,
    /// divided by the loss scale, before any clipping (every trainable element of every rank
    /// counted once; the value PyTorch's `clip_grad_norm_` returns). Measured only when the step
    /// needs it: with [`ShardConfig::with_max_grad_norm`](crate::ShardConfig::with_max_grad_norm)
    /// (`f32::INFINITY` measures without clipping), a [`LossScaler`], or clipping by norm in a
    /// group; `None` otherwise and before the first step. Non-finite after an overflow.
    pub fn last_grad_norm(&self) -> Option<f64> {
        self.last.grad_norm
    }

    /// Whether the last [`ShardedOptimizer::step`] updated the parameters: `false` when the
    /// [`LossScaler`] skipped it because the gradient overflowed on some rank (the same answer
    /// on every rank), and before the first step. PyTorch's `GradScaler` users compare the scale
    /// before and after `update()` for the same purpose.
    ///
    /// A learning-rate schedule that should advance on applied steps only (warm-up counted in
    /// updates, not in batches) advances when this is `true`:
    ///
    /// ```ignore
    /// let lr = lr_at(applied, steps);            // the schedule's index: applied steps
    /// model = optim.step(lr, model, grads)?;
    /// if optim.last_step_applied() { applied += 1; }
    /// ```
    ///
    /// With a Burn `LrScheduler`, keep a clone from before `scheduler.step()` and put it back
    /// when the step was skipped.
    pub fn last_step_applied(&self) -> bool {
        self.last.applied
    }

    /// The loss scaler (current scale, steps skipped), when one was configured.
    pub fn loss_scaler(&self) -> Option<&LossScaler> {
        self.loss_scaler.as_ref()
    }

    /// `loss` in `f32` multiplied by the loss scale (unchanged without a [`LossScaler`]): call
    /// `backward` on this. The product is taken in `f32` so that an `f16` loss times the scale
    /// (`2^16` by default) does not overflow; backward casts the scaled gradient back to the
    /// loss's dtype.
    ///
    /// Without this call (or [`LossScaling::scale_loss`]) for any backward since the last
    /// optimizer call, the next `step` or `accumulate` fails with
    /// [`ShardError::LossNotScaled`] when a loss scaler other than `LossScaler::fixed(1.0)` is
    /// configured: it would divide unscaled gradients by the scale.
    pub fn scale_loss<const D: usize>(&self, loss: Tensor<D>) -> Tensor<D> {
        self.loss_scaling().scale_loss(loss)
    }

    /// A handle that scales losses for this optimizer's next `step` or `accumulate`, for code
    /// that cannot reach the optimizer (burn-train's `TrainStep`, which burn-shard-train's
    /// `ShardedStrategy` serves through `burn_shard_train::scale_loss`). Take a new one after
    /// each optimizer call: the scale changes.
    pub fn loss_scaling(&self) -> LossScaling {
        LossScaling::new(
            self.loss_scaler.as_ref().map(LossScaler::scale),
            self.loss_scaled.clone(),
        )
    }

    /// Elements of the parameters this rank steps (and keeps optimizer state for): every
    /// trainable element at stage 0, this rank's range of each bucket without its padding at
    /// stages 1-2, its shards at stage 3.
    pub fn stepped_numel(&self) -> usize {
        self.layout
            .buckets()
            .iter()
            .map(|bucket| {
                let range = self.plan.owned_range(bucket, self.comm.rank());
                range.end.min(bucket.numel).saturating_sub(range.start)
            })
            .sum()
    }

    /// With [`NvmeOffload`](crate::NvmeOffload): the bytes the last step read from and wrote to
    /// this rank's swap file, as `(read, written)` (each the whole state and masters of the
    /// pieces it stepped, once); with [`ShardConfig::nvme_offload_params`](crate::ShardConfig::nvme_offload_params)
    /// also those of its parameter shard file since the step before (the shards read by the
    /// gathers of forward and backward and by the update, and the updated shards written);
    /// `(0, 0)` without either and before the first step.
    pub fn nvme_io_bytes(&self) -> (u64, u64) {
        let io = self.slots.last_step_io();
        (
            io.read + self.last.param_io.read,
            io.written + self.last.param_io.written,
        )
    }

    /// With [`ShardConfig::nvme_offload_params`](crate::ShardConfig::nvme_offload_params): of
    /// the bytes read from this rank's parameter shard file since the step before (counted in
    /// [`ShardedOptimizer::nvme_io_bytes`]), those whose read was not started ahead of its use,
    /// so that the thread that needed them waited for the disk. In a pass of `U` units learned
    /// by the gather schedule these are the shards of its first two units (the one gathered and
    /// the one prefetched on entering it) and of parameters gathered outside units; the other
    /// units' shards are read while the unit two before computes. The step reads each bucket's
    /// gradient and parameter shards while the previous bucket is stepped, so there these are
    /// the first bucket's (its gradient shards once more when clipping or loss scaling
    /// measures their norm first). Shards whose write is still queued are taken from memory
    /// and count as neither. 0 without NVMe
    /// parameter offload and before the first step.
    pub fn nvme_read_on_demand_bytes(&self) -> u64 {
        self.last.param_io.read_on_demand
    }

    /// The ZeRO stage.
    pub fn stage(&self) -> Stage {
        self.plan.stage()
    }

    /// Whether a forward pass of the model is a collective (stage 3: every sharded parameter is
    /// all-gathered when read), so that every rank must run the same forwards in the same
    /// order, in evaluation too; `false` at stages 0-2, where a forward is local.
    pub fn forward_is_collective(&self) -> bool {
        self.plan.fsdp().is_some()
    }

    /// The `f32` master weights of this rank's piece of each `bf16`/`f16` parameter of the
    /// layout (same shapes as [`ShardedOptimizer::slot_states`]' tensors); `None` for `f32`
    /// parameters and before a parameter's first gradient. They are initialised from the
    /// parameters then; after loading new parameter values later, call
    /// [`ShardedOptimizer::reset_master_weights`]. Empty (every entry `None`) with
    /// [`NvmeOffload`](crate::NvmeOffload), which keeps them on disk between steps.
    pub fn master_weights(&self) -> &[Option<Tensor<1>>] {
        &self.slots.masters
    }

    /// Makes the `f32` masters follow values changed outside the optimizer: when a
    /// `bf16`/`f16` parameter is next stepped, each element whose value no longer equals its
    /// master rounded to the parameter's dtype (an edit, new values loaded) takes the
    /// parameter's value; every other element keeps its master and the sub-ulp progress in it.
    /// Call it after changing such a model's values yourself ([`ShardedOptimizer::map_params`]
    /// calls it); without it the step keeps updating the old masters and overwrites the edit.
    /// Costs one comparison of each stepped piece with its master at that step.
    pub fn reset_master_weights(&mut self) {
        self.slots.mark_edited();
    }

    /// Burn's optimizer state of each parameter of the layout ([`FlatLayout::slots`] order), for
    /// the piece of it this rank steps: the whole parameter (stage 0), its part of this rank's
    /// range of the bucket (stages 1-2; `None` when the range holds none of it) or this rank's
    /// shard (stage 3). `None` before the parameter's first gradient, and for every parameter
    /// with [`NvmeOffload`](crate::NvmeOffload), which keeps the states on disk between steps.
    /// Tensors are 1-D.
    pub fn slot_states(&self) -> &[Option<O::State<1>>] {
        &self.slots.states
    }
}

/// What the step's measuring phase decided.
enum Measured {
    /// An overflow: every rank saw the same non-finite norm and skips the step.
    Skipped,
    /// Apply the step, with the norms where clipping or loss scaling measured them.
    Apply(Option<GradNorms>),
}

/// How this step clips: the global-norm factor and the norms per-parameter clipping reads.
struct Clip<'a> {
    global: f32,
    norms: Option<&'a GradNorms>,
}

/// One norm-based clipping at a time: by global norm (`ShardConfig::with_max_grad_norm`) or by
/// each parameter's norm (Burn's `GradientClipping::Norm`), not both.
pub(crate) fn check_one_norm_clipping(
    max_grad_norm: Option<f32>,
    clipping: Option<&GradientClipping>,
) -> Result<(), ShardError> {
    if let (Some(max), Some(GradientClipping::Norm(t))) = (max_grad_norm, clipping) {
        return Err(ShardError::InvalidConfig(format!(
            "gradients would be clipped twice by norm: by global norm (with_max_grad_norm({max})) and by each \
             parameter's norm (GradientClippingConfig::Norm({t}) in the optimizer config); keep one"
        )));
    }
    Ok(())
}

/// Bytes of `tensor` when it is on `device`, 0 elsewhere: the step's temporary peak counts the
/// parameters' device, not the host memory that parameter offload updates its shards in.
fn bytes_on(tensor: &Tensor<1>, device: &Device) -> usize {
    match tensor.device() == *device {
        true => tensor_bytes(tensor),
        false => 0,
    }
}
