//! Running-state buffers (BatchNorm's running mean and variance, any `RunningState`): the one
//! rule that keeps them identical on every rank.
//!
//! **Rule: at the end of every `ShardedOptimizer::step`, each buffer becomes the mean over the
//! ranks of its value on each rank** (one all-reduce of all buffers, in `f32`). Buffers are never
//! sharded, at any stage, and are exported at full shape.
//!
//! Why the mean: each rank's forward updates a running mean as `(1-m)·old + m·mean(local
//! batch)`; averaging those over ranks gives `(1-m)·old + m·mean(global batch)` when the local
//! batches are equal in size, which is exactly what one device sees for the global batch. A
//! running variance averages the local batch variances (it lacks the spread between the local
//! means, as with Burn's own multi-device training, which averages per-thread values the same
//! way). PyTorch DDP instead broadcasts rank 0's buffers before each forward, which keeps only
//! rank 0's batches.
//!
//! Burn's `RunningState` keeps pending per-thread values that it settles when the module is
//! validated; ranks that are threads of one process and were cloned from one model share them.
//! The sync settles them first (`Module::valid`), reads every rank's value, and writes the mean
//! back after an all-reduce that no rank leaves before every rank has read: so shared or not,
//! every rank ends the step with the same buffers.
//!
//! With several forward passes per step (gradient accumulation) on ranks that share one
//! clone's `RunningState`s, Burn's own `update` averages whatever the ranks have pending at that
//! moment, which depends on thread timing: ranks still end every step identical, but the value
//! is no longer exactly the rule. Give each rank its own states (`model.valid().train()` before
//! `fork`, as separate processes have anyway) when that matters.

use std::collections::HashMap;

use burn::module::{Module, ParamId};
use burn::tensor::{DType, Tensor};
use burn_shard_comm::{Collective, ReduceOp};

use crate::error::ShardError;
use crate::model::census::Census;
use crate::model::flat;

/// The buffers of one model: ids in traversal order with their element counts.
#[derive(Clone, Debug, Default)]
pub(crate) struct Buffers {
    order: Vec<(ParamId, usize)>,
}

impl Buffers {
    /// The running-state buffers the census found (empty ones left out).
    pub(crate) fn of(census: &Census) -> Self {
        let order = census
            .buffers()
            .map(|(id, e)| (id, e.shape.iter().product::<usize>()))
            .filter(|(_, n)| *n > 0)
            .collect();
        Self { order }
    }

    /// Applies the rule of this module's docs to `model`. Every rank must call it.
    ///
    /// # Errors
    /// [`ShardError::Comm`] when the all-reduce fails.
    pub(crate) fn sync<M: Module>(&self, comm: &dyn Collective, model: M) -> Result<M, ShardError> {
        if self.order.is_empty() {
            return Ok(model);
        }
        // Every rank's forward has updated its buffers before any rank settles them.
        comm.barrier()?;
        drop(model.valid());
        let wanted = self.order.iter().map(|(id, _)| *id).collect();
        let mut values = flat::values_by_id(&model, &wanted);
        let mut pieces = Vec::with_capacity(self.order.len());
        for (id, _) in &self.order {
            let value = values.remove(id).ok_or_else(|| {
                ShardError::InvalidConfig(format!(
                    "running-state buffer {id} is missing from the module passed to step; pass the model that init returned"
                ))
            })?;
            pieces.push(value.cast(DType::F32));
        }
        let mean = comm.all_reduce(Tensor::cat(pieces, 0), ReduceOp::Avg)?;
        let mut values = HashMap::with_capacity(self.order.len());
        let mut offset = 0;
        for (id, numel) in &self.order {
            values.insert(*id, mean.clone().narrow(0, offset, *numel));
            offset += numel;
        }
        Ok(flat::replace_values(model, values))
    }
}
