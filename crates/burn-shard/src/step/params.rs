//! Reading and editing a sharded model's parameters from outside the step, with the user's own
//! Burn `ModuleVisitor` or `ModuleMapper`: [`ShardedOptimizer::visit_params`] and
//! [`ShardedOptimizer::map_params`].
//!
//! At stages 0-2 every rank holds whole parameters, and `model.visit` / `model.map` see and
//! change the real values. At stage 3 a parameter's stored value is a placeholder (see
//! `hooks/sharded_param.rs`) that Burn hands to visitors and mappers in place of the value, so
//! they read zeros and their edits are lost. These two calls all-gather one sharded parameter at
//! a time (FSDP's `summon_full_params`, one parameter instead of the whole model in memory), hand
//! it to the visitor or mapper as a whole parameter, and put this rank's shard of the mapped value
//! back. At every stage `map_params` also tells the `f32` masters of `bf16`/`f16` parameters to
//! take the edited elements (see [`ShardedOptimizer::reset_master_weights`]).

use std::collections::HashMap;

use burn::module::{Flag, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{Bool, Int, Tensor};

use crate::error::ShardError;
use crate::hooks::exchange;
use crate::hooks::gather_op::GatherSpec;
use crate::optim::master::MasterWeightStep;
use crate::step::optimizer::ShardedOptimizer;

impl<O: MasterWeightStep> ShardedOptimizer<O> {
    /// Runs `visitor` over `model` (`model.visit(visitor)`) with every parameter's full value,
    /// at every stage: at stage 3 each sharded parameter is all-gathered when the traversal
    /// reaches it and handed to `visitor.visit_float` as a whole `Param` (same `ParamId`, full
    /// shape, plain tensor). A collective at stage 3: every rank calls it at the same point.
    /// Use it instead of `model.visit` for anything that reads values (norms, statistics,
    /// exports); `model.visit` at stage 3 sees full-shape placeholders.
    ///
    /// # Errors
    /// [`ShardError::Comm`] when an all-gather failed (stage 3).
    pub fn visit_params<M: Module, V: ModuleVisitor>(&self, model: &M, visitor: &mut V) -> Result<(), ShardError> {
        let Some(fsdp) = self.plan.fsdp() else {
            model.visit(visitor);
            return Ok(());
        };
        let specs = exchange::collect_specs(model);
        model.visit(&mut Gathering {
            inner: visitor,
            specs: &specs,
        });
        fsdp.take_error().map_or(Ok(()), Err)
    }

    /// `model.map(mapper)` with every parameter's full value, at every stage, for edits such as
    /// weight clipping (WGAN), pruning, re-initialisation or an EMA: at stage 3 each sharded
    /// parameter is all-gathered, given to `mapper.map_float` as a whole `Param`, and this
    /// rank's shard of the result becomes the parameter's shard (in its dtype; the mapper's
    /// changes to `require_grad` or the id of a sharded parameter are not kept). Afterwards the
    /// `f32` masters of `bf16`/`f16` parameters take the edited elements at the next step (as
    /// after [`ShardedOptimizer::reset_master_weights`]); optimizer state (Adam's moments) is
    /// kept. A collective at stage 3: every rank calls it at the same point with the same
    /// mapper. `model.map` at stage 3 would map placeholders, and the edits would be lost.
    ///
    /// # Errors
    /// [`ShardError::Comm`] when an all-gather failed (stage 3), [`ShardError::Nvme`] when a
    /// shard could not be read or written with NVMe parameter offload; the model is then
    /// unchanged.
    pub fn map_params<M: Module, Mp: ModuleMapper>(&mut self, model: M, mapper: &mut Mp) -> Result<M, ShardError> {
        let mapped = match self.plan.fsdp() {
            None => model.map(mapper),
            Some(fsdp) => {
                let specs = exchange::collect_specs(&model);
                let mut gathering = Gathering {
                    inner: mapper,
                    specs: &specs,
                };
                let mut shards = HashMap::new();
                let mapped = model.clone().map(&mut Scattering {
                    gathering: &mut gathering,
                    shards: &mut shards,
                });
                if let Some(e) = fsdp.take_error() {
                    return Err(e);
                }
                // Where shards live (the shard file with NVMe parameter offload), written before
                // any is replaced: a failed write leaves the model as it was.
                let shards = shards
                    .into_iter()
                    .map(|(id, shard)| (id, fsdp.to_home(shard)))
                    .collect();
                // Every rank replaces its shards, or none does.
                self.agree_on_disk(fsdp.flush_home(), &self.device, "in map_params")?;
                exchange::replace_shards(mapped, shards)
            }
        };
        self.reset_master_weights();
        Ok(mapped)
    }
}

/// Forwards a traversal to `inner`, with each sharded parameter's full value in place of its
/// placeholder.
struct Gathering<'a, T> {
    inner: &'a mut T,
    specs: &'a HashMap<ParamId, GatherSpec>,
}

impl<V: ModuleVisitor> ModuleVisitor for Gathering<'_, V> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        match self.specs.get(&param.id) {
            Some(spec) => self
                .inner
                .visit_float(&Param::initialized(param.id, exchange::full_value::<D>(spec))),
            None => self.inner.visit_float(param),
        }
    }

    fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
        self.inner.visit_int(param);
    }

    fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
        self.inner.visit_bool(param);
    }

    fn visit_flag(&mut self, flag: &Param<Flag>) {
        self.inner.visit_flag(flag);
    }

    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.inner.enter_module(name, container_type);
    }

    fn exit_module(&mut self, name: &str, container_type: &str) {
        self.inner.exit_module(name, container_type);
    }
}

/// Maps each sharded parameter's full value with the user's mapper and keeps this rank's shard
/// of the result in `shards` (put in place afterwards); the placeholder itself is unchanged.
struct Scattering<'a, 'b, Mp> {
    gathering: &'a mut Gathering<'b, Mp>,
    shards: &'a mut HashMap<ParamId, Tensor<1>>,
}

impl<Mp: ModuleMapper> ModuleMapper for Scattering<'_, '_, Mp> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(spec) = self.gathering.specs.get(&param.id) else {
            return self.gathering.inner.map_float(param);
        };
        let full = Param::initialized(param.id, exchange::full_value::<D>(spec));
        let mapped = self.gathering.inner.map_float(full).into_value();
        self.shards.insert(param.id, exchange::shard_of(spec, mapped));
        param
    }

    fn map_int<const D: usize>(&mut self, param: Param<Tensor<D, Int>>) -> Param<Tensor<D, Int>> {
        self.gathering.inner.map_int(param)
    }

    fn map_bool<const D: usize>(&mut self, param: Param<Tensor<D, Bool>>) -> Param<Tensor<D, Bool>> {
        self.gathering.inner.map_bool(param)
    }

    fn map_flag(&mut self, flag: Param<Flag>) -> Param<Flag> {
        self.gathering.inner.map_flag(flag)
    }

    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.gathering.inner.enter_module(name, container_type);
    }

    fn exit_module(&mut self, name: &str, container_type: &str) {
        self.gathering.inner.exit_module(name, container_type);
    }
}
