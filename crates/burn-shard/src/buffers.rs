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

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{DType, Tensor};
use burn_shard_comm::{Collective, ReduceOp};

use crate::ShardError;
use crate::census::Census;

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
        let mut read = Read {
            wanted: self.order.iter().map(|(id, _)| *id).collect(),
            values: HashMap::new(),
        };
        model.visit(&mut read);
        let mut pieces = Vec::with_capacity(self.order.len());
        for (id, numel) in &self.order {
            let value = read.values.remove(id).ok_or_else(|| {
                ShardError::InvalidConfig(format!(
                    "running-state buffer {id} is missing from the module passed to step; pass the model that init returned"
                ))
            })?;
            pieces.push(value.reshape([*numel]).cast(DType::F32));
        }
        let mean = comm.all_reduce(Tensor::cat(pieces, 0), ReduceOp::Avg)?;
        let mut offsets = HashMap::with_capacity(self.order.len());
        let mut offset = 0;
        for (id, numel) in &self.order {
            offsets.insert(*id, (offset, *numel));
            offset += numel;
        }
        Ok(model.map(&mut Write { mean, offsets }))
    }
}

/// Reads the current (settled) value of each wanted buffer.
struct Read {
    wanted: std::collections::HashSet<ParamId>,
    values: HashMap<ParamId, Tensor<1>>,
}

impl ModuleVisitor for Read {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.wanted.contains(&param.id) {
            let value = param.val().inner();
            let numel = value.shape().num_elements();
            self.values.insert(param.id, value.reshape([numel]));
        }
    }
}

/// Writes each buffer's slice of the mean back, in the buffer's shape, dtype and autodiff mode.
struct Write {
    mean: Tensor<1>,
    offsets: HashMap<ParamId, (usize, usize)>,
}

impl ModuleMapper for Write {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(&(offset, numel)) = self.offsets.get(&param.id) else {
            return param;
        };
        let (id, old, mapper) = param.consume();
        let mut value: Tensor<D> = self
            .mean
            .clone()
            .narrow(0, offset, numel)
            .cast(old.dtype())
            .reshape(old.shape());
        if old.is_autodiff() {
            value = value.autodiff();
        }
        Param::from_mapped_value(id, value, mapper)
    }
}
