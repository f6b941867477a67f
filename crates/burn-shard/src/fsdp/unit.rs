//! Marking a unit of a stage-3 model.

use std::cell::RefCell;

use burn::backend::DispatchTensor;
use burn::tensor::Tensor;

thread_local! {
    /// The input of the unit whose forward is running on this thread, if any.
    static UNIT_INPUT: RefCell<Option<DispatchTensor>> = const { RefCell::new(None) };
}

/// Runs `forward` (one unit, e.g. a transformer block) with `input` as the unit's input.
///
/// Every parameter all-gathered inside then depends on `input` in the autodiff graph, so its
/// backward (the reduce-scatter of its gradient) runs as soon as the unit's backward is done,
/// and the unit's full gradients are freed one unit at a time (FSDP's per-unit
/// reduce-scatter). Without a unit scope, results are identical but every reduce-scatter waits
/// for the end of the backward pass. With no sharding active it only calls `forward`, so model
/// code can use it unconditionally.
///
/// ```ignore
/// for block in &self.blocks {
///     x = burn_shard::fsdp::unit(&x, || block.forward(x.clone()));
/// }
/// ```
pub fn unit<const D: usize, R>(input: &Tensor<D>, forward: impl FnOnce() -> R) -> R {
    let previous = UNIT_INPUT.with(|u| u.replace(Some(input.clone().into_dispatch())));
    let _restore = Restore(previous);
    forward()
}

/// Puts back the enclosing unit's input, also when `forward` panics.
struct Restore(Option<DispatchTensor>);

impl Drop for Restore {
    fn drop(&mut self) {
        let previous = self.0.take();
        UNIT_INPUT.with(|u| *u.borrow_mut() = previous);
    }
}

/// The current unit's input, if a [`unit`] scope is active on this thread.
pub(crate) fn current_unit_input() -> Option<DispatchTensor> {
    UNIT_INPUT.with(|u| u.borrow().clone())
}
