//! [`ShardedOptimizer`]: one ZeRO step around one of Burn's optimizers.

use std::sync::Arc;

use burn::module::Module;
use burn::optim::{GradientsParams, LearningRate, Optimizer, RecordState, StateSink};
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_shard_comm::{Collective, ReduceOp};

use crate::flat::{self, tensor_bytes};
use crate::fsdp::context::FsdpContext;
use crate::layout::FlatLayout;
use crate::memory::{MemoryReport, PeakTracker, module_param_bytes};
use crate::{ShardError, Stage};

/// A Burn optimizer whose state (stages 1-3), gradients (stages 2-3) and parameters (stage 3)
/// are partitioned over the ranks of a [`Collective`]. Built by
/// [`ShardConfig::init`](crate::ShardConfig::init).
///
/// Each bucket of the [`FlatLayout`] is stepped as one flat `[shard_numel]` tensor (stages 1-2),
/// `[padded_numel]` tensor (stage 0) or tensor of this rank's parameter shards (stage 3, where
/// the layout covers the local shards) by `O::step`: Burn's own optimizer, so the update math is
/// Burn's, or [`FusedAdam`](burn_shard_kernels::FusedAdam) when Burn's Adam/AdamW config was
/// passed (see [`IntoOptimizer`](crate::IntoOptimizer)).
///
/// A parameter that received a gradient on no rank keeps its value, as with Burn's
/// `ModuleOptimizer`; its slice of the bucket's optimizer state still advances with the bucket
/// (moments decay, the step count grows), as in DeepSpeed's flat buffers. Gradient clipping
/// configured on a Burn optimizer config is not applied: Burn's `build()` leaves it out and its
/// per-parameter norms would be wrong on shards.
/// Adam, AdamW and SGD (with or without momentum) are element-wise, so the flat step equals
/// Burn's per-parameter step element for element. Optimizers that mix elements of a tensor
/// (per-tensor norms: LAMB, Muon, Adafactor, or Burn's per-parameter norm clipping) would see
/// buckets instead of parameters and must not be used here.
pub struct ShardedOptimizer<O: Optimizer> {
    optim: O,
    comm: Arc<dyn Collective>,
    layout: Arc<FlatLayout>,
    stage: Stage,
    states: Vec<Option<O::State<1>>>,
    /// `f32` master copy of this rank's range of each `bf16`/`f16` bucket (`None` for `f32`
    /// buckets and before the first step).
    masters: Vec<Option<Tensor<1>>>,
    gradients_bytes: usize,
    temporary_peak_bytes: usize,
    /// Stage 3: what the model's gather ops share (their first error, transient probes).
    fsdp: Option<FsdpContext>,
}

impl<O: Optimizer> ShardedOptimizer<O> {
    pub(crate) fn new(
        optim: O,
        comm: Arc<dyn Collective>,
        layout: Arc<FlatLayout>,
        stage: Stage,
        fsdp: Option<FsdpContext>,
    ) -> Self {
        let states = vec![None; layout.buckets().len()];
        let masters = vec![None; layout.buckets().len()];
        Self {
            optim,
            comm,
            layout,
            stage,
            states,
            masters,
            gradients_bytes: 0,
            temporary_peak_bytes: 0,
            fsdp,
        }
    }

    /// Averages `grads` over the ranks, updates this rank's shard with Burn's optimizer and
    /// all-gathers the result, returning `model` with every rank holding identical parameters.
    ///
    /// `grads` are this rank's gradients (`GradientsParams::from_grads(loss.backward(), &model)`)
    /// for its part of the global batch; with equal local batch sizes and a mean loss, their
    /// average is the gradient of the global batch. A trainable parameter that received no
    /// gradient on a rank counts as a zero gradient there.
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
        match self.fsdp.as_ref().and_then(FsdpContext::take_error) {
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
        let rank = self.comm.rank();
        let mut temp = PeakTracker::default();
        // Stage 3: the gradients were reduce-scattered inside backward; a collective that failed
        // there left its error behind.
        self.check_collectives()?;

        // 1. Reduce the gradients bucket by bucket; keep what this stage holds.
        let (mut grad_parts, device) = flat::take_grads(&model, &layout, &mut grads)?;
        drop(grads);
        let keep = self.without_gradient(&grad_parts, &device)?;
        let mut reduced = Vec::with_capacity(layout.buckets().len());
        for bucket in layout.buckets() {
            let flat = flat::assemble(&layout, bucket, &grad_parts, 0..bucket.padded_numel, &device);
            grad_parts[bucket.slots.clone()].iter_mut().for_each(|g| *g = None);
            let flat_bytes = tensor_bytes(&flat);
            temp.alloc(flat_bytes);
            let grad = match self.stage {
                Stage::Zero | Stage::One => self.comm.all_reduce(flat, ReduceOp::Avg)?,
                Stage::Two => self.comm.reduce_scatter(flat, ReduceOp::Avg)?,
                // The layout covers this rank's parameter shards, whose gradients are reduced.
                Stage::Three => flat,
            };
            temp.free(flat_bytes);
            reduced.push(grad);
        }
        self.gradients_bytes = reduced.iter().map(tensor_bytes).sum();

        // 2. Burn's optimizer on the owned range, then all-gather the updated shards.
        let (param_parts, _) = flat::param_values(&model, &layout)?;
        let mut full = Vec::with_capacity(layout.buckets().len());
        let shards = layout.buckets().iter().zip(reduced).zip(self.states.iter_mut());
        for (((bucket, grad), state), master) in shards.zip(self.masters.iter_mut()) {
            let range = match self.stage {
                Stage::One | Stage::Two => bucket.shard_range(rank),
                Stage::Zero | Stage::Three => 0..bucket.padded_numel,
            };
            let grad = match self.stage {
                Stage::One => grad.narrow(0, range.start, range.len()),
                Stage::Zero | Stage::Two | Stage::Three => grad,
            };
            let param = flat::assemble(&layout, bucket, &param_parts, range.clone(), &device);
            let param_bytes = tensor_bytes(&param);
            temp.alloc(param_bytes);
            let (param, new_state) = if !crate::master::needs_master(bucket.dtype) {
                self.optim.step(lr, param, grad, state.take())
            } else {
                // bf16/f16: the optimizer updates the f32 master; the model gets it rounded.
                let weights = master.take().unwrap_or_else(|| param.clone().cast(DType::F32));
                // Parameters without a gradient keep their value (`keep`): their master must too,
                // or it would drift (weight decay) and the model would jump to it later.
                let kept = crate::master::kept_mask(&layout, bucket, &keep, range.clone(), &device);
                let before = kept.as_ref().map(|_| weights.clone());
                let (weights, param, new_state) =
                    crate::master::step_with_master(&self.optim, lr, weights, param, grad, state.take());
                *master = Some(match (kept, before) {
                    (Some(mask), Some(before)) => weights.mask_where(mask, before),
                    _ => weights,
                });
                (param, new_state)
            };
            *state = new_state;
            let updated = match self.stage {
                Stage::One | Stage::Two => self.comm.all_gather(param)?,
                Stage::Zero | Stage::Three => param,
            };
            temp.free(param_bytes);
            temp.alloc(tensor_bytes(&updated));
            full.push(updated);
        }
        drop(param_parts);
        self.temporary_peak_bytes = match &self.fsdp {
            // Stage 3: the gathered parameters and full gradients of the forward and backward
            // that produced `grads` dominate; the step itself holds only shards.
            Some(fsdp) => {
                let peak = fsdp.transient_peak().max(temp.peak());
                fsdp.reset_transient_peak();
                peak
            }
            None => temp.peak(),
        };
        Ok(flat::scatter_into(model, &layout, &full, &keep))
    }

    /// Which slots received a gradient on no rank this step: like Burn's `ModuleOptimizer`,
    /// the step leaves those parameters unchanged (weight decay included). At stages 0-2 a
    /// rank cannot know alone, so the per-slot flags are all-reduced (one small collective of
    /// `slots` elements); at stage 3 a gradient exists on every rank or on none.
    fn without_gradient(&self, grads: &flat::SlotValues, device: &Device) -> Result<Vec<bool>, ShardError> {
        let local: Vec<bool> = grads.iter().map(Option::is_none).collect();
        if self.stage == Stage::Three || self.comm.world_size() == 1 {
            return Ok(local);
        }
        let flags: Vec<f32> = grads.iter().map(|g| if g.is_some() { 1.0 } else { 0.0 }).collect();
        let n = flags.len();
        let summed = self
            .comm
            .all_reduce(Tensor::from_data(TensorData::new(flags, [n]), device), ReduceOp::Sum)?;
        let summed: Vec<f32> = summed.into_data().convert::<f32>().iter::<f32>().collect();
        Ok(summed.iter().map(|&c| c == 0.0).collect())
    }

    /// This rank's memory, measured from the tensors held now (`model`'s parameters and the
    /// optimizer state) and during the last step (gradients, transient buffers).
    pub fn memory_report<M: Module>(&self, model: &M) -> MemoryReport {
        let mut sink = StateSink::default();
        for (b, state) in self.states.iter().enumerate() {
            if let Some(state) = state {
                state.state_flatten(&format!("bucket{b}"), &mut sink);
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
            stage: self.stage.number(),
            parameters_bytes: module_param_bytes(model),
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

    /// The ZeRO stage.
    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// The `f32` master weights of this rank's range of each `bf16`/`f16` bucket (same shapes
    /// as [`ShardedOptimizer::bucket_states`]' tensors); `None` for `f32` buckets and before
    /// the first step. They are initialised from the parameters at the first step; after
    /// loading new parameter values later, call [`ShardedOptimizer::reset_master_weights`].
    pub fn master_weights(&self) -> &[Option<Tensor<1>>] {
        &self.masters
    }

    /// Drops the `f32` master weights, so the next step takes them from the model's parameters
    /// again. Call it after loading new values into a `bf16`/`f16` model (a checkpoint, an
    /// edit); the step otherwise keeps updating the old masters and overwrites the new values.
    pub fn reset_master_weights(&mut self) {
        self.masters.iter_mut().for_each(|m| *m = None);
    }

    /// Burn's optimizer state for each bucket's flat range owned by this rank (`None` before the
    /// first step). Tensors are `[shard_numel]` (stages 1-2), `[padded_numel]` (stage 0) or the
    /// bucket of local shards (stage 3).
    pub fn bucket_states(&self) -> &[Option<O::State<1>>] {
        &self.states
    }
}
