//! Reading and editing a sharded model's parameters from outside the step, with the user's own
//! Burn `ModuleVisitor` or `ModuleMapper`: [`ShardedOptimizer::visit_params`] and
//! [`ShardedOptimizer::map_params`].
//!
//! At stages 0-2 every rank holds whole parameters, and `model.visit` / `model.map` see and
//! change the real values. At stage 3 a parameter's stored value is a placeholder (see
//! `fsdp/sharded_param.rs`) that Burn hands to visitors and mappers in place of the value, so
//! they read zeros and their edits are lost. These two calls all-gather one sharded parameter at
//! a time (FSDP's `summon_full_params`, one parameter instead of the whole model in memory), hand
//! it to the visitor or mapper as a whole parameter, and put this rank's shard of the mapped value
//! back. At every stage `map_params` also tells the `f32` masters of `bf16`/`f16` parameters to
//! take the edited elements (see [`ShardedOptimizer::reset_master_weights`]).
//!
//! The rule for what a mapper may change, the same at every stage: values, and `require_grad`
//! from `true` to `false` (freezing, as `model.no_grad()` does) or back for a parameter that was
//! trainable at `init`. Shape and dtype are what the flat buckets, the shards and the optimizer
//! state are laid out for, so a mapper that changes them (a vocabulary resize, a transpose, a
//! quantisation) is refused with [`ShardError::MappedParamChanged`] naming the parameter, both
//! values and the way that works (edit the whole model, then `ShardConfig::init` again); so is
//! unfreezing a parameter that was frozen at `init` (it has no optimizer state). Refused means
//! every rank returns the error and no shard is replaced.

use std::collections::HashMap;

use burn::module::{Flag, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{Bool, DType, Int, Tensor};

use crate::error::ShardError;
use crate::fsdp::exchange;
use crate::fsdp::gather_op::GatherSpec;
use crate::model::census::{Census, EntryKind};
use crate::optim::master::MasterWeightStep;
use crate::sharded_optimizer::optimizer::ShardedOptimizer;

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
        if !self.plan.params().shards_parameters() {
            model.visit(visitor);
            return Ok(());
        }
        let specs = exchange::collect_specs(model);
        model.visit(&mut Gathering {
            inner: visitor,
            specs: &specs,
        });
        self.plan.params().take_error().map_or(Ok(()), Err)
    }

    /// `model.map(mapper)` with every parameter's full value, at every stage, for edits such as
    /// weight clipping (WGAN), pruning, re-initialisation or an EMA: at stage 3 each sharded
    /// parameter is all-gathered, given to `mapper.map_float` as a whole `Param`, and this
    /// rank's shard of the result becomes the parameter's shard (in its dtype; the mapper's
    /// change of `require_grad` is kept, its change of the id is not). Afterwards the
    /// `f32` masters of `bf16`/`f16` parameters take the edited elements at the next step (as
    /// after [`ShardedOptimizer::reset_master_weights`]); optimizer state (Adam's moments) is
    /// kept. A collective at stage 3: every rank calls it at the same point with the same
    /// mapper. `model.map` at stage 3 would map placeholders, and the edits would be lost.
    ///
    /// A mapper may change values and `require_grad`, not shapes or dtypes (see the
    /// [module docs](self) for the rule and what to do instead).
    ///
    /// # Errors
    /// [`ShardError::MappedParamChanged`] when the mapper changed a parameter's shape or dtype,
    /// or made a parameter frozen at `init` trainable; [`ShardError::Comm`] when an all-gather
    /// failed (stage 3), [`ShardError::Nvme`] when a shard could not be read or written with
    /// NVMe parameter offload; [`ShardError::HalfAppliedStep`] after a step failed half-way.
    /// Every rank returns the error and no shard is replaced.
    pub fn map_params<M: Module, Mp: ModuleMapper>(&mut self, model: M, mapper: &mut Mp) -> Result<M, ShardError> {
        self.refuse_half_applied("map parameters")?;
        let mapped = match self.plan.params().shards_parameters() {
            false => {
                let mapped = model.map(mapper);
                // Whole parameters on every rank, mapped alike: every rank finds the same change.
                let mut check = CheckMapped {
                    census: &self.census,
                    changed: None,
                };
                mapped.visit(&mut check);
                if let Some(e) = check.changed {
                    return Err(e);
                }
                mapped
            }
            true => {
                let specs = exchange::collect_specs(&model);
                let mut gathering = Gathering {
                    inner: mapper,
                    specs: &specs,
                };
                let mut shards = HashMap::new();
                let mut scattering = Scattering {
                    gathering: &mut gathering,
                    shards: &mut shards,
                    census: &self.census,
                    changed: None,
                };
                let mapped = model.clone().map(&mut scattering);
                // Both taken: an all-gather's error must not surface at the next call instead.
                let gather_error = self.plan.params().take_error();
                if let Some(e) = scattering.changed.take().or(gather_error) {
                    return Err(e);
                }
                // Where shards live (the shard file with NVMe parameter offload), written before
                // any is replaced: a failed write leaves the model as it was.
                let shards = shards
                    .into_iter()
                    .map(|(id, shard)| (id, self.plan.params().to_home(shard)))
                    .collect();
                // Every rank replaces its shards, or none does.
                self.agree_on_disk(self.plan.params().flush_home(), "in map_params")?;
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
/// of the result in `shards` (put in place afterwards); the placeholder keeps its value and
/// takes the mapper's `require_grad`. The first change the rule refuses is kept in `changed`
/// (the traversal goes on, so every rank runs the same all-gathers).
struct Scattering<'a, 'b, Mp> {
    gathering: &'a mut Gathering<'b, Mp>,
    shards: &'a mut HashMap<ParamId, Tensor<1>>,
    census: &'a Census,
    changed: Option<ShardError>,
}

impl<Mp: ModuleMapper> ModuleMapper for Scattering<'_, '_, Mp> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(spec) = self.gathering.specs.get(&param.id) else {
            return self.gathering.inner.map_float(param);
        };
        // During `map` the parameter comes without its reparameterization: this is the
        // placeholder, whose autodiff state is the parameter's.
        let placeholder = param.base();
        let require_grad = placeholder.is_require_grad();
        let mut full = exchange::full_value::<D>(spec);
        if placeholder.is_autodiff() {
            // The mapper sees the parameter as Burn would hand it: tracked, and requiring grad
            // when the parameter does, so `set_require_grad` (and `no_grad`) mean what they say.
            full = full.autodiff();
            if require_grad {
                full = full.require_grad();
            }
        }
        let mapped = self
            .gathering
            .inner
            .map_float(Param::initialized(param.id, full))
            .into_value();
        let found = (mapped.shape().to_vec(), mapped.dtype());
        let now_require_grad = placeholder.is_autodiff() && mapped.is_require_grad();
        if let Some(e) = refused_change(self.census, param.id, found, now_require_grad) {
            self.changed.get_or_insert(e);
            return param;
        }
        self.shards.insert(param.id, exchange::shard_of(spec, mapped));
        if now_require_grad == require_grad || !placeholder.is_autodiff() {
            param
        } else {
            param.set_require_grad(now_require_grad)
        }
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

/// Finds, at stages 0-2, the first parameter the mapper changed against the rule (see the
/// [module docs](self)).
struct CheckMapped<'a> {
    census: &'a Census,
    changed: Option<ShardError>,
}

impl ModuleVisitor for CheckMapped<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let Some(entry) = self.census.get(&param.id) else {
            return;
        };
        if self.changed.is_some() || entry.kind == EntryKind::Buffer {
            return;
        }
        // The stored value: the gradient hook of stages 0-2 is not run for a look.
        let value = param.base();
        let found = (value.shape().to_vec(), value.dtype());
        self.changed = refused_change(self.census, param.id, found, value.is_require_grad());
    }
}

/// The error for a mapped parameter whose `(shape, dtype)` is now `found` where `init` saw
/// another, or that requires grad now (`require_grad`) though it was frozen at `init`; `None`
/// when the rule allows the change (the census holds what `init` saw).
fn refused_change(census: &Census, id: ParamId, found: (Vec<usize>, DType), require_grad: bool) -> Option<ShardError> {
    let entry = census.get(&id)?;
    let (what, fix) = if entry.shape != found.0 {
        (format!("shape from {:?} to {:?}", entry.shape, found.0), RELAYOUT)
    } else if entry.dtype != found.1 {
        (format!("dtype from {:?} to {:?}", entry.dtype, found.1), RELAYOUT)
    } else if require_grad && !entry.require_grad {
        ("require_grad from false to true".to_string(), UNFROZEN)
    } else {
        return None;
    };
    Some(ShardError::MappedParamChanged {
        path: entry.path.clone(),
        what,
        fix: fix.to_string(),
    })
}

/// What to do instead of changing a parameter's shape or dtype with `map_params`.
const RELAYOUT: &str = "the flat buckets, the shards and the optimizer state are laid out for the old one: to \
    resize, transpose or re-type a parameter, edit the whole model (`model.materialize()` gives it with plain \
    parameters on every rank, or load a consolidated checkpoint into the plain model) and call ShardConfig::init \
    on it again (its optimizer state starts afresh)";

/// What to do instead of unfreezing with `map_params` a parameter frozen at `init`.
const UNFROZEN: &str = "it was frozen at ShardConfig::init, so it has no optimizer state and no place in the \
    buckets: make it trainable before ShardConfig::init (freezing with map_params or no_grad, and unfreezing what \
    was trainable at init, both work)";
