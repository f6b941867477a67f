//! [`ShardedOptimizer`]: one ZeRO step around one of Burn's optimizers.

use std::sync::Arc;

use burn::module::Module;
use burn::optim::{GradientsParams, LearningRate, Optimizer, RecordState, StateSink};
use burn_shard_comm::{Collective, ReduceOp};

use crate::flat::{self, tensor_bytes};
use crate::layout::FlatLayout;
use crate::memory::{MemoryReport, PeakTracker, module_param_bytes};
use crate::{ShardError, Stage};

/// A Burn optimizer whose state (stages 1-2) and gradients (stage 2) are partitioned over the
/// ranks of a [`Collective`]. Built by [`ShardConfig::init`](crate::ShardConfig::init).
///
/// Each bucket of the [`FlatLayout`] is stepped as one flat `[shard_numel]` tensor (stages 1-2)
/// or `[padded_numel]` tensor (stage 0) by Burn's own `O::step`, so the update math is Burn's.
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
    gradients_bytes: usize,
    temporary_peak_bytes: usize,
}

impl<O: Optimizer> ShardedOptimizer<O> {
    pub(crate) fn new(optim: O, comm: Arc<dyn Collective>, layout: Arc<FlatLayout>, stage: Stage) -> Self {
        let states = vec![None; layout.buckets().len()];
        Self {
            optim,
            comm,
            layout,
            stage,
            states,
            gradients_bytes: 0,
            temporary_peak_bytes: 0,
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
    pub fn step<M: Module>(&mut self, lr: LearningRate, model: M, mut grads: GradientsParams) -> Result<M, ShardError> {
        let layout = self.layout.clone();
        let rank = self.comm.rank();
        let mut temp = PeakTracker::default();

        // 1. Reduce the gradients bucket by bucket; keep what this stage holds.
        let (mut grad_parts, device) = flat::take_grads(&model, &layout, &mut grads)?;
        drop(grads);
        let mut reduced = Vec::with_capacity(layout.buckets().len());
        for bucket in layout.buckets() {
            let flat = flat::assemble(&layout, bucket, &grad_parts, 0..bucket.padded_numel, &device);
            grad_parts[bucket.slots.clone()].iter_mut().for_each(|g| *g = None);
            let flat_bytes = tensor_bytes(&flat);
            temp.alloc(flat_bytes);
            let grad = if self.stage.shards_gradients() {
                self.comm.reduce_scatter(flat, ReduceOp::Avg)?
            } else {
                self.comm.all_reduce(flat, ReduceOp::Avg)?
            };
            temp.free(flat_bytes);
            reduced.push(grad);
        }
        self.gradients_bytes = reduced.iter().map(tensor_bytes).sum();

        // 2. Burn's optimizer on the owned range, then all-gather the updated shards.
        let (param_parts, _) = flat::param_values(&model, &layout)?;
        let mut full = Vec::with_capacity(layout.buckets().len());
        for ((bucket, grad), state) in layout.buckets().iter().zip(reduced).zip(self.states.iter_mut()) {
            let range = if self.stage.shards_optimizer_state() {
                bucket.shard_range(rank)
            } else {
                0..bucket.padded_numel
            };
            let grad = match self.stage {
                Stage::One => grad.narrow(0, range.start, range.len()),
                Stage::Zero | Stage::Two => grad,
            };
            let param = flat::assemble(&layout, bucket, &param_parts, range, &device);
            let param_bytes = tensor_bytes(&param);
            temp.alloc(param_bytes);
            let (param, new_state) = self.optim.step(lr, param, grad, state.take());
            *state = new_state;
            let updated = if self.stage.shards_optimizer_state() {
                self.comm.all_gather(param)?
            } else {
                param
            };
            temp.free(param_bytes);
            temp.alloc(tensor_bytes(&updated));
            full.push(updated);
        }
        drop(param_parts);
        self.temporary_peak_bytes = temp.peak();
        Ok(flat::scatter_into(model, &layout, &full))
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
        let optimizer_state_bytes = sink
            .tensors
            .iter()
            .map(|(_, d)| d.num_elements() * d.dtype().size())
            .sum();
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

    /// The ZeRO stage.
    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// Burn's optimizer state for each bucket's flat range owned by this rank (`None` before the
    /// first step). Tensors are `[shard_numel]` (stages 1-2) or `[padded_numel]` (stage 0).
    pub fn bucket_states(&self) -> &[Option<O::State<1>>] {
        &self.states
    }
}
