//! Marking a unit of a stage-3 model.

use std::any::Any;
use std::cell::{Cell, RefCell};

use burn::backend::{Dispatch, DispatchTensor};
use burn::tensor::Tensor;

use crate::fsdp::gather_op::FsdpOps;

thread_local! {
    /// The unit whose forward is running on this thread, if any: its input and its scope number.
    static UNIT_INPUT: RefCell<Option<(DispatchTensor, u64)>> = const { RefCell::new(None) };
    /// Numbers the unit scopes entered on this thread, so gathers know which scope they ran in.
    static NEXT_SCOPE: Cell<u64> = const { Cell::new(0) };
    /// Whether a stage-3 parameter was gathered in the innermost unit scope running.
    static GATHERED: Cell<bool> = const { Cell::new(false) };
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
/// full gradient until then. At stage 3, when `forward` returns a `Tensor<D>` (the rank of
/// `input`) of `input`'s shape, that output is also where Burn's balanced checkpointing stops
/// recomputing: it is
/// kept for backward (one activation per unit), so backward recomputes one unit at a time and
/// re-gathers each unit's parameters in that unit's group. With no sharding active it only
/// calls `forward`, so model code can use it unconditionally.
///
/// ```ignore
/// for block in &self.blocks {
///     x = burn_shard::fsdp::unit(&x, || block.forward(x.clone()));
/// }
/// ```
pub fn unit<const D: usize, R: 'static>(input: &Tensor<D>, forward: impl FnOnce() -> R) -> R {
    let scope = NEXT_SCOPE.with(|n| {
        let scope = n.get();
        n.set(scope.wrapping_add(1));
        scope
    });
    let previous = UNIT_INPUT.with(|u| u.replace(Some((input.clone().into_dispatch(), scope))));
    let restore = Restore {
        unit: previous,
        gathered: GATHERED.with(|g| g.replace(false)),
    };
    let output = forward();
    let gathered = GATHERED.with(Cell::get);
    drop(restore);
    match gathered {
        true => checkpoint_boundary(input.dims(), output),
        false => output,
    }
}

/// A stage-3 unit's output through [`FsdpOps::fsdp_unit_boundary`], when it is a `Tensor<D>`
/// of the input's shape `dims` (a block on the residual stream; a head's logits, which nothing
/// after it recomputes from, would only be kept longer).
///
/// Why: under Burn's balanced checkpointing a residual stream is a chain of memory-bound adds,
/// so recomputing one unit's input in backward would recompute every unit before it, and
/// re-gather their biases and norms out of order (which also leaves their backward groups
/// ungrouped and unprefetched, see [`crate::fsdp::gather_schedule`]). A compute-bound identity at each
/// unit's output makes Burn save it instead, so backward recomputes within one unit at a time:
/// the checkpoint per block of activation checkpointing as FSDP users know it.
fn checkpoint_boundary<const D: usize, R: 'static>(dims: [usize; D], output: R) -> R {
    let mut output = Some(output);
    if let Some(slot) = (&mut output as &mut dyn Any).downcast_mut::<Option<Tensor<D>>>()
        && slot.as_ref().is_some_and(|t| t.dims() == dims)
        && let Some(tensor) = slot.take()
    {
        *slot = Some(Tensor::from_dispatch(<Dispatch as FsdpOps>::fsdp_unit_boundary(
            tensor.into_dispatch(),
        )));
    }
    output.expect("put back above")
}

/// Records that a stage-3 parameter was gathered inside the current unit scope.
pub(crate) fn note_gather() {
    GATHERED.with(|g| g.set(true));
}

/// Puts back the enclosing unit, also when `forward` panics; the enclosing scope has gathered
/// whatever this one did (outside every scope the flag is cleared).
struct Restore {
    unit: Option<(DispatchTensor, u64)>,
    gathered: bool,
}

impl Drop for Restore {
    fn drop(&mut self) {
        let previous = self.unit.take();
        let outermost = previous.is_none();
        UNIT_INPUT.with(|u| *u.borrow_mut() = previous);
        let outer = self.gathered;
        GATHERED.with(|g| g.set(!outermost && (g.get() || outer)));
    }
}

/// The current unit's input and scope number, if a [`unit`] scope is active on this thread.
pub(crate) fn current_unit() -> Option<(DispatchTensor, u64)> {
    UNIT_INPUT.with(|u| u.borrow().clone())
}
