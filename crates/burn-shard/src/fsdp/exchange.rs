//! Reading and replacing the shards a stage-3 model holds.
//!
//! A shard lives inside its parameter's [`ShardedParam`](crate::fsdp::sharded_param::ShardedParam),
//! which module traversal does not show as a parameter. The sharded optimizer reaches the shards
//! through Burn's own traversal instead: it visits (or maps) the model with an exchange active
//! on its thread, and each `ShardedParam`'s hand-written `visit` (or `map`) reports (or replaces)
//! its shard. Replacing returns a new module, as Burn's optimizers do, so clones of the model
//! taken earlier keep their values.

use std::cell::RefCell;
use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, ParamId};
use burn::tensor::Tensor;

use crate::fsdp::collectives::pad_to;
use crate::fsdp::gather_op::GatherSpec;
use crate::fsdp::shard::Shard;

enum Exchange {
    /// Sharded states reported by `visit`.
    CollectSpecs(HashMap<ParamId, GatherSpec>),
    /// Shards `map` puts in place of the current ones.
    Replace(HashMap<ParamId, Shard>),
}

thread_local! {
    static EXCHANGE: RefCell<Option<Exchange>> = const { RefCell::new(None) };
}

/// Clears the exchange when the traversal ends, also by a panic.
struct Active;

impl Active {
    fn start(exchange: Exchange) -> Self {
        EXCHANGE.with(|e| *e.borrow_mut() = Some(exchange));
        Active
    }

    fn finish(self) -> Option<Exchange> {
        EXCHANGE.with(|e| e.borrow_mut().take())
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        EXCHANGE.with(|e| e.borrow_mut().take());
    }
}

/// The sharded state of every stage-3 parameter `model` holds, by parameter id.
pub(crate) fn collect_specs<M: Module>(model: &M) -> HashMap<ParamId, GatherSpec> {
    struct Nothing;
    impl ModuleVisitor for Nothing {}
    let active = Active::start(Exchange::CollectSpecs(HashMap::new()));
    model.visit(&mut Nothing);
    match active.finish() {
        Some(Exchange::CollectSpecs(specs)) => specs,
        _ => HashMap::new(),
    }
}

/// Every shard `model` holds, by parameter id (`[chunk]`, plain, in memory or on disk; cheap
/// clones).
pub(crate) fn collect_shards<M: Module>(model: &M) -> HashMap<ParamId, Shard> {
    collect_specs(model)
        .into_iter()
        .map(|(id, spec)| (id, spec.param.shard))
        .collect()
}

/// The full value of `spec`'s parameter, all-gathered (a collective: every rank calls it for
/// the same parameters in the same order), in its full shape, plain. A failed collective is
/// recorded in the context (`CommContext::take_error`) and gives zeros, as does a shard that
/// cannot be read from disk.
pub(crate) fn full_value<const D: usize>(spec: &GatherSpec) -> Tensor<D> {
    spec.ctx
        .gather_alone(&spec.shard, spec.numel, spec.tag)
        .reshape(spec.full_shape.clone())
}

/// This rank's `[chunk]` shard of `full` (the parameter's full value, any shape), in the shard's
/// dtype and on its device: the inverse of [`full_value`].
pub(crate) fn shard_of<const D: usize>(spec: &GatherSpec, full: Tensor<D>) -> Tensor<1> {
    let (n, r) = (spec.ctx.comm().world_size(), spec.ctx.comm().rank());
    let flat = pad_to(full.reshape([spec.numel]), spec.chunk * n).narrow(0, r * spec.chunk, spec.chunk);
    // A new buffer: a view would keep the whole full value alive.
    // In the value's own dtype, not the device's default float dtype.
    let data = flat.into_data();
    let dtype = data.dtype();
    let shard = Tensor::<1>::from_data(data, (&spec.shard.device(), dtype));
    shard.cast(spec.shard.dtype())
}

/// `model` with the shards of the parameters in `shards` replaced (each `[chunk]`, the
/// parameter's dtype, plain; one in memory is moved where shards live, see
/// `GatherSpec::set_shard`); the other parameters and buffers are unchanged.
pub(crate) fn replace_shards<M: Module>(model: M, shards: HashMap<ParamId, Shard>) -> M {
    struct Same;
    impl ModuleMapper for Same {}
    let active = Active::start(Exchange::Replace(shards));
    let model = model.map(&mut Same);
    drop(active);
    model
}

/// Called by `ShardedParam::visit`.
pub(crate) fn on_visit(spec: &GatherSpec) {
    EXCHANGE.with(|e| {
        if let Some(Exchange::CollectSpecs(specs)) = e.borrow_mut().as_mut() {
            specs.insert(spec.id, spec.clone());
        }
    });
}

/// Called by `ShardedParam::map`.
pub(crate) fn on_map(spec: &mut GatherSpec) {
    EXCHANGE.with(|e| {
        if let Some(Exchange::Replace(shards)) = e.borrow_mut().as_mut()
            && let Some(shard) = shards.remove(&spec.id)
        {
            spec.set_shard(shard);
        }
    });
}
