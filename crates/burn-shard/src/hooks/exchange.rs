//! Reading and replacing the shards a stage-3 model holds.
//!
//! A shard lives inside its parameter's [`ShardedParam`](crate::hooks::sharded_param::ShardedParam),
//! which module traversal does not show as a parameter. The sharded optimizer reaches the shards
//! through Burn's own traversal instead: it visits (or maps) the model with an exchange active
//! on its thread, and each `ShardedParam`'s hand-written `visit` (or `map`) reports (or replaces)
//! its shard. Replacing returns a new module, as Burn's optimizers do, so clones of the model
//! taken earlier keep their values.

use std::cell::RefCell;
use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, ParamId};
use burn::tensor::Tensor;

use crate::overlap::spec::GatherSpec;

enum Exchange {
    /// Shards reported by `visit`.
    Collect(HashMap<ParamId, Tensor<1>>),
    /// Shards `map` puts in place of the current ones.
    Replace(HashMap<ParamId, Tensor<1>>),
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

/// Every shard `model` holds, by parameter id (`[chunk]`, plain tensors; cheap clones).
pub(crate) fn collect_shards<M: Module>(model: &M) -> HashMap<ParamId, Tensor<1>> {
    struct Nothing;
    impl ModuleVisitor for Nothing {}
    let active = Active::start(Exchange::Collect(HashMap::new()));
    model.visit(&mut Nothing);
    match active.finish() {
        Some(Exchange::Collect(shards)) => shards,
        _ => HashMap::new(),
    }
}

/// `model` with the shards of the parameters in `shards` replaced (each `[chunk]`, the
/// parameter's dtype, plain); the other parameters and buffers are unchanged.
pub(crate) fn replace_shards<M: Module>(model: M, shards: HashMap<ParamId, Tensor<1>>) -> M {
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
        if let Some(Exchange::Collect(shards)) = e.borrow_mut().as_mut() {
            shards.insert(spec.id, spec.shard.clone());
        }
    });
}

/// Called by `ShardedParam::map`.
pub(crate) fn on_map(spec: &mut GatherSpec) {
    EXCHANGE.with(|e| {
        if let Some(Exchange::Replace(shards)) = e.borrow_mut().as_mut()
            && let Some(shard) = shards.remove(&spec.id)
        {
            crate::hooks::sharded_param::set_shard(spec, shard);
        }
    });
}
