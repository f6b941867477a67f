//! [`ShardedOptimizer`]: one ZeRO step around one of Burn's optimizers.

use std::ops::Range;
use std::sync::Arc;

use burn::module::Module;
use burn::optim::{GradientsParams, LearningRate, RecordState, StateSink};
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_shard_comm::{Collective, ReduceOp};

use crate::buffers::Buffers;
use crate::census::Census;
use crate::flat::{self, tensor_bytes};
use crate::fsdp::context::FsdpContext;
use crate::fsdp::exchange;
use crate::layout::{Bucket, FlatLayout};
use crate::master::MasterWeightStep;
use crate::memory::{MemoryReport, PeakTracker, module_param_bytes};
use crate::stage_plan::StagePlan;
use crate::{ShardError, Stage};

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
/// moments, master), as with Burn's `ModuleOptimizer`. Gradient clipping configured on a Burn
/// optimizer config is refused: Burn's per-parameter norms would be wrong on shards.
/// Adam, AdamW and SGD (with or without momentum) are element-wise, so the flat step equals
/// Burn's per-parameter step element for element. Optimizers that mix elements of a tensor
/// (per-tensor norms: LAMB, Muon, Adafactor, or Burn's per-parameter norm clipping) would see
/// buckets instead of parameters and must not be used here.
pub struct ShardedOptimizer<O: MasterWeightStep> {
    pub(crate) optim: O,
    pub(crate) comm: Arc<dyn Collective>,
    pub(crate) layout: Arc<FlatLayout>,
    pub(crate) plan: StagePlan,
    /// The model's float entries as `init` found them (paths, full shapes, kinds).
    pub(crate) census: Census,
    /// Burn's optimizer state of each layout slot's piece owned by this rank (`None` before
    /// the slot's first gradient, and for slots outside this rank's range).
    pub(crate) states: Vec<Option<O::State<1>>>,
    /// `f32` master copy of each `bf16`/`f16` slot's piece owned by this rank (`None` for
    /// `f32` slots and before the slot's first gradient).
    pub(crate) masters: Vec<Option<Tensor<1>>>,
    /// Running-state buffers, averaged over the ranks at every step.
    buffers: Buffers,
    gradients_bytes: usize,
    temporary_peak_bytes: usize,
}

impl<O: MasterWeightStep> ShardedOptimizer<O> {
    pub(crate) fn new(
        optim: O,
        comm: Arc<dyn Collective>,
        layout: Arc<FlatLayout>,
        plan: StagePlan,
        census: Census,
        buffers: Buffers,
    ) -> Self {
        let states = vec![None; layout.slots().len()];
        let masters = vec![None; layout.slots().len()];
        Self {
            optim,
            comm,
            layout,
            plan,
            census,
            states,
            masters,
            buffers,
            gradients_bytes: 0,
            temporary_peak_bytes: 0,
        }
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
    /// a later step (a conditional branch, an expert, a parameter unfrozen mid-run) takes the
    /// first Adam step of its own when it is.
    ///
    /// # Errors
    /// [`ShardError::Comm`] when a collective fails (the group is then aborted: stop training);
    /// [`ShardError::UnknownParam`] / [`ShardError::ShapeChanged`] when `model` is not the
    /// module returned by `init`.
    pub fn step<M: Module>(&mut self, lr: LearningRate, model: M, grads: GradientsParams) -> Result<M, ShardError> {
        let result = self.step_with(lr, model, grads);
        if let Err(e) = &result {
            // A rank that fails alone (a wrong model, say) must not leave the others waiting.
            self.comm.abort(&format!(
                "rank {} failed in ShardedOptimizer::step: {e}",
                self.comm.rank()
            ));
        }
        result
    }

    /// Stage 3: returns the first error a collective met inside forward or backward (gathers
    /// and reduce-scatters cannot return errors through Burn's autodiff; they record them and
    /// use zeros). `step` checks this itself; call it after an evaluation pass run outside it.
    pub fn check_collectives(&self) -> Result<(), ShardError> {
        match self.plan.fsdp().and_then(FsdpContext::take_error) {
            Some(err) => Err(err.into()),
            None => Ok(()),
        }
    }

    fn step_with<M: Module>(
        &mut self,
        lr: LearningRate,
        model: M,
        mut grads: GradientsParams,
    ) -> Result<M, ShardError> {
        let layout = self.layout.clone();
        let mut temp = PeakTracker::default();
        // Stage 3: the gradients were reduce-scattered inside backward; a collective that failed
        // there left its error behind.
        self.check_collectives()?;

        let (mut grad_parts, device) = flat::take_grads(&model, &layout, &mut grads)?;
        drop(grads);
        let Some(device) = device else {
            // No trainable parameter (a frozen teacher): only the buffers move.
            return self.buffers.sync(self.comm.as_ref(), model);
        };
        let has_grad = self.with_gradient(&grad_parts, &device)?;

        // 1. Reduce the gradients bucket by bucket; keep what this stage holds.
        let mut reduced = Vec::with_capacity(layout.buckets().len());
        for bucket in layout.buckets() {
            let flat = flat::assemble(&layout, bucket, &grad_parts, 0..bucket.padded_numel, &device);
            grad_parts[bucket.slots.clone()].iter_mut().for_each(|g| *g = None);
            let flat_bytes = tensor_bytes(&flat);
            temp.alloc(flat_bytes);
            let grad = self.plan.reduce(self.comm.as_ref(), flat)?;
            temp.free(flat_bytes);
            reduced.push(grad);
        }
        self.gradients_bytes = reduced.iter().map(tensor_bytes).sum();

        // 2. Burn's optimizer on each parameter's piece of the owned range, then all-gather.
        let values = self.plan.read_values(&model, &layout)?;
        let mut full = Vec::with_capacity(layout.buckets().len());
        for (bucket, grad) in layout.buckets().iter().zip(reduced) {
            let range = self.plan.owned_range(bucket, self.comm.rank());
            let grad = self.plan.gradient_of_range(grad, range.clone());
            let param = self.update_range(lr, &layout, bucket, range, &values, grad, &has_grad, &device);
            let param_bytes = tensor_bytes(&param);
            temp.alloc(param_bytes);
            let updated = self.plan.publish(self.comm.as_ref(), param)?;
            temp.free(param_bytes);
            temp.alloc(tensor_bytes(&updated));
            full.push(updated);
        }
        drop(values);
        self.temporary_peak_bytes = match self.plan.fsdp() {
            // Stage 3: the gathered parameters and full gradients of the forward and backward
            // that produced `grads` dominate; the step itself holds only shards.
            Some(fsdp) => {
                let peak = fsdp.transient_peak().max(temp.peak());
                fsdp.reset_transient_peak();
                peak
            }
            None => temp.peak(),
        };
        let keep: Vec<bool> = has_grad.iter().map(|g| !g).collect();
        let model = self.plan.write_values(model, &layout, &full, &keep);
        self.buffers.sync(self.comm.as_ref(), model)
    }

    /// Steps each parameter's piece of `range` of `bucket` with its own optimizer state (so
    /// per-parameter state, such as Adam's step count, follows Burn's per-parameter semantics)
    /// and returns the updated `[range.len()]` range. `grad` covers `range`. Pieces of
    /// parameters without a gradient on any rank are returned as they are, their state and
    /// master untouched; padding stays zero.
    #[allow(clippy::too_many_arguments)]
    fn update_range(
        &mut self,
        lr: LearningRate,
        layout: &FlatLayout,
        bucket: &Bucket,
        range: Range<usize>,
        values: &flat::SlotValues,
        grad: Tensor<1>,
        has_grad: &[bool],
        device: &Device,
    ) -> Tensor<1> {
        let mut pieces = Vec::new();
        for index in bucket.slots.clone() {
            let slot = &layout.slots()[index];
            let Some(part) = slot.within(&range) else {
                continue;
            };
            let len = part.len();
            let param = flat::slot_piece(&values[index], slot, part.clone(), bucket.dtype, device);
            if !has_grad[index] {
                pieces.push(param);
                continue;
            }
            let grad = grad.clone().narrow(0, slot.offset + part.start - range.start, len);
            let state = self.states[index].take();
            let (param, state) = if crate::master::needs_master(bucket.dtype) {
                // bf16/f16: the optimizer updates the f32 master; the model gets it rounded.
                let master = self.masters[index]
                    .take()
                    .unwrap_or_else(|| param.clone().cast(DType::F32));
                let (master, param, state) = self.optim.step_with_master(lr, master, param, grad, state);
                self.masters[index] = Some(master);
                (param, state)
            } else {
                self.optim.step(lr, param, grad, state)
            };
            self.states[index] = state;
            pieces.push(param);
        }
        flat::join_range(pieces, bucket, range, device)
    }

    /// Which slots received a gradient on some rank this step. Like Burn's `ModuleOptimizer`,
    /// the step leaves the others unchanged (value, state, master). At stages 0-2 a rank cannot
    /// know alone, so the per-slot flags are all-reduced (one small collective of `slots`
    /// elements); at stage 3 a gradient exists on every rank or on none.
    fn with_gradient(&self, grads: &flat::SlotValues, device: &Device) -> Result<Vec<bool>, ShardError> {
        let local: Vec<bool> = grads.iter().map(Option::is_some).collect();
        if self.plan.gradient_presence_is_local() || self.comm.world_size() == 1 {
            return Ok(local);
        }
        let flags: Vec<f32> = local.iter().map(|&g| if g { 1.0 } else { 0.0 }).collect();
        let n = flags.len();
        let summed = self
            .comm
            .all_reduce(Tensor::from_data(TensorData::new(flags, [n]), device), ReduceOp::Sum)?;
        let summed: Vec<f32> = summed.into_data().convert::<f32>().iter::<f32>().collect();
        Ok(summed.iter().map(|&c| c > 0.0).collect())
    }

    /// This rank's memory, measured from the tensors held now (`model`'s parameters and the
    /// optimizer state) and during the last step (gradients, transient buffers).
    pub fn memory_report<M: Module>(&self, model: &M) -> MemoryReport {
        let mut sink = StateSink::default();
        for (i, state) in self.states.iter().enumerate() {
            if let Some(state) = state {
                state.state_flatten(&format!("slot{i}"), &mut sink);
            }
        }
        let master_bytes: usize = self.masters.iter().flatten().map(tensor_bytes).sum();
        let optimizer_state_bytes = master_bytes
            + sink
                .tensors
                .iter()
                .map(|(_, d)| d.num_elements() * d.dtype().size())
                .sum::<usize>();
        MemoryReport {
            rank: self.comm.rank(),
            world_size: self.comm.world_size(),
            stage: self.stage().number(),
            parameters_bytes: match self.plan.fsdp() {
                Some(_) => {
                    let shards = exchange::collect_shards(model);
                    let sharded: usize = shards.values().map(tensor_bytes).sum();
                    sharded + module_param_bytes(model, |id| shards.contains_key(id))
                }
                None => module_param_bytes(model, |_| false),
            },
            gradients_bytes: self.gradients_bytes,
            optimizer_state_bytes,
            temporary_peak_bytes: self.temporary_peak_bytes,
        }
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
    /// [`FusedAdam`](burn_shard_kernels::FusedAdam) which path it takes).
    pub fn optimizer(&self) -> &O {
        &self.optim
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

    /// The ZeRO stage.
    pub fn stage(&self) -> Stage {
        self.plan.stage()
    }

    /// The `f32` master weights of this rank's piece of each `bf16`/`f16` parameter of the
    /// layout (same shapes as [`ShardedOptimizer::slot_states`]' tensors); `None` for `f32`
    /// parameters and before a parameter's first gradient. They are initialised from the
    /// parameters then; after loading new parameter values later, call
    /// [`ShardedOptimizer::reset_master_weights`].
    pub fn master_weights(&self) -> &[Option<Tensor<1>>] {
        &self.masters
    }

    /// Drops the `f32` master weights, so the next step takes them from the model's parameters
    /// again. Call it after loading new values into a `bf16`/`f16` model (a checkpoint, an
    /// edit); the step otherwise keeps updating the old masters and overwrites the new values.
    pub fn reset_master_weights(&mut self) {
        self.masters.iter_mut().for_each(|m| *m = None);
    }

    /// Burn's optimizer state of each parameter of the layout ([`FlatLayout::slots`] order), for
    /// the piece of it this rank steps: the whole parameter (stage 0), its part of this rank's
    /// range of the bucket (stages 1-2; `None` when the range holds none of it) or this rank's
    /// shard (stage 3). `None` before the parameter's first gradient. Tensors are 1-D.
    pub fn slot_states(&self) -> &[Option<O::State<1>>] {
        &self.states
    }
}
