//! Marking a unit of a stage-3 model.

use std::cell::{Cell, RefCell};

use burn::backend::DispatchTensor;
use burn::tensor::Tensor;

thread_local! {
    /// The unit whose forward is running on this thread, if any: its input and its scope number.
    static UNIT_INPUT: RefCell<Option<(DispatchTensor, u64)>> = const { RefCell::new(None) };
    /// Numbers the unit scopes entered on this thread, so gathers know which scope they ran in.
    static NEXT_SCOPE: Cell<u64> = const { Cell::new(0) };
}

/// Runs `forward` (one unit, e.g. a transformer block) with `input` as the unit's input.
///
/// Every parameter all-gathered inside then depends on `input` in the autodiff graph, so its
/// backward (handing its full gradient to the reducer) runs as soon as the unit's backward is
/// done, and the unit's full gradients are freed one unit at a time. From the second pass on,
/// the unit's parameters are all-gathered by one collective, the next unit's gather runs while
/// this one computes, and the unit's gradients are reduce-scattered by one collective while
/// backward computes the unit before (see [`crate::fsdp`]): FSDP2's per-group all-gather and
/// reduce-scatter. Without a unit
/// scope results are identical, but each parameter is gathered and reduce-scattered alone and
/// Burn may run the gathers' backwards only at the end of the backward pass, keeping every
/// full gradient until then. With no sharding active it only calls `forward`, so model code
/// can use it unconditionally.
///
/// ```ignore
/// for block in &self.blocks {
///     x = burn_shard::fsdp::unit(&x, || block.forward(x.clone()));
/// }
/// ```
pub fn unit<const D: usize, R>(input: &Tensor<D>, forward: impl FnOnce() -> R) -> R {
    let scope = NEXT_SCOPE.with(|n| {
        let scope = n.get();
        n.set(scope.wrapping_add(1));
        scope
    });
    let previous = UNIT_INPUT.with(|u| u.replace(Some((input.clone().into_dispatch(), scope))));
    let _restore = Restore(previous);
    forward()
}

/// Puts back the enclosing unit, also when `forward` panics.
struct Restore(Option<(DispatchTensor, u64)>);

impl Drop for Restore {
    fn drop(&mut self) {
        let previous = self.0.take();
        UNIT_INPUT.with(|u| *u.borrow_mut() = previous);
    }
}

/// The current unit's input and scope number, if a [`unit`] scope is active on this thread.
pub(crate) fn current_unit() -> Option<(DispatchTensor, u64)> {
    UNIT_INPUT.with(|u| u.borrow().clone())
}
