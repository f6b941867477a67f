//! [`PendingGradients`]: the gradients the next step adds to its backward's own, kept between
//! optimizer calls. One accumulated gradient has two possible holders, and this type is the one
//! place that merges them:
//! - the *unreduced* sums of the micro-batches given to `accumulate` (per layout slot, whole on
//!   each rank, as DDP's `no_sync`);
//! - the *reduced* sums of buckets that a micro-batch's backward already reduced (per bucket,
//!   from the bucket reducer, when it expected a step; with the slots they hold).
//!
//! `bf16`/`f16` sums are kept in `f32`, rounded once by the step (as one backward on the
//! concatenated batch would round, not once per micro-batch).

use burn::tensor::{DType, Device, Tensor};

use crate::error::ShardError;
use crate::model::flat::{SlotValues, tensor_bytes};
use crate::model::layout::ParamSlot;
use crate::optim::master::widen_half;
use crate::overlap::bucket_reducer::Early;
use crate::placement::read_ahead::ReadAhead;
use crate::placement::shard::Shard;

/// The micro-batch sums waiting for the next step, and their peak size.
pub(crate) struct PendingGradients {
    /// Per layout slot: the sum of the unreduced micro-batch gradients (flat).
    unreduced: SlotValues,
    /// Per bucket: the sum of the reductions made inside micro-batch backwards.
    reduced: Vec<Option<Tensor<1>>>,
    /// Per layout slot: whether `reduced` holds a gradient of it.
    reduced_present: Vec<bool>,
    /// Peak bytes held since the last step, and during the cycle that the last step ended.
    peak_bytes: usize,
    last_cycle_bytes: usize,
}

/// `a + b` where both are there, else whichever is.
fn add(a: Option<Tensor<1>>, b: Option<Tensor<1>>) -> Option<Tensor<1>> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a + b),
        (a, b) => a.or(b),
    }
}

impl PendingGradients {
    pub(crate) fn new(slots: usize, buckets: usize) -> Self {
        Self {
            unreduced: vec![None; slots],
            reduced: vec![None; buckets],
            reduced_present: vec![false; slots],
            peak_bytes: 0,
            last_cycle_bytes: 0,
        }
    }

    /// Drops every sum (`discard_gradients`, a checkpoint load).
    pub(crate) fn clear(&mut self) {
        self.unreduced.iter_mut().for_each(|g| *g = None);
        self.reduced.iter_mut().for_each(|g| *g = None);
        self.reduced_present.iter_mut().for_each(|p| *p = false);
    }

    /// Slots with a pending sum (a checkpoint cannot hold them).
    pub(crate) fn count(&self) -> usize {
        self.unreduced.iter().flatten().count() + self.reduced_present.iter().filter(|&&p| p).count()
    }

    /// Moves the kept reduced sums into `early` (what the reducer just reduced), so that
    /// `early` holds everything reduced since the last step.
    pub(crate) fn merge_reduced_into(&mut self, early: &mut Early) {
        for (mine, kept) in early.reduced.iter_mut().zip(&mut self.reduced) {
            *mine = add(mine.take().map(widen_half), kept.take());
        }
        for (present, kept) in early.present.iter_mut().zip(&mut self.reduced_present) {
            *present |= std::mem::take(kept);
        }
    }

    /// `accumulate`: keeps what `early` reduced (merged by [`Self::merge_reduced_into`]) and
    /// adds the micro-batch's unreduced gradients `parts`.
    pub(crate) fn keep(&mut self, early: Option<Early>, parts: SlotValues) {
        if let Some(early) = early {
            self.reduced = early.reduced;
            self.reduced_present = early.present;
        }
        for (sum, grad) in self.unreduced.iter_mut().zip(parts) {
            *sum = add(sum.take(), grad.map(widen_half));
        }
        let held: usize = self
            .unreduced
            .iter()
            .chain(&self.reduced)
            .flatten()
            .map(tensor_bytes)
            .sum();
        self.peak_bytes = self.peak_bytes.max(held);
    }

    /// The unreduced sums, for the bucket reducer to seed its next backward's buckets with.
    pub(crate) fn unreduced_mut(&mut self) -> &mut SlotValues {
        &mut self.unreduced
    }

    /// The step: adds the unreduced sums to the backward's gradients `grads` (per slot, cast
    /// back to each slot's dtype) and ends the cycle's memory count.
    pub(crate) fn add_to_step<'a>(&mut self, grads: &mut SlotValues, slots: impl Iterator<Item = &'a ParamSlot>) {
        for ((grad, sum), slot) in grads.iter_mut().zip(&mut self.unreduced).zip(slots) {
            if let Some(sum) = sum.take() {
                let dtype = sum.dtype();
                let total = match grad.take() {
                    Some(grad) => sum + grad.cast(dtype),
                    None => sum,
                };
                *grad = Some(total.cast(slot.dtype));
            }
        }
        self.last_cycle_bytes = std::mem::take(&mut self.peak_bytes);
    }

    /// Peak bytes of sums held during the cycle the last step ended.
    pub(crate) fn last_cycle_bytes(&self) -> usize {
        self.last_cycle_bytes
    }
}

/// A slot's gradient shards on disk, each with the backward pass it came from.
pub(crate) type PassShards = Vec<(u64, Shard)>;

/// The sum of a slot's gradient shards, read, as the in-memory path sums them: the shards of
/// one backward pass in their dtype, in order (Burn's `Gradients::register`); several passes
/// (`accumulate`'s micro-batches) each widened to `f32`, summed in order and cast back to
/// `dtype` ([`PendingGradients`], whose rules these are, for the gradient shards
/// that stage 3 keeps on disk with NVMe parameter offload); on `device`, where the in-memory path holds them; `None`
/// without shards.
/// Each shard is taken from `ahead` when its read was started there.
pub(crate) fn sum_passes(
    shards: &PassShards,
    dtype: DType,
    device: &Device,
    ahead: &mut ReadAhead,
) -> Result<Option<Tensor<1>>, ShardError> {
    let mut passes: Vec<Tensor<1>> = Vec::new();
    let mut last_pass = None;
    for (pass, shard) in shards {
        let grad = ahead.take(shard).wait()?.to_device(device);
        match passes.pop() {
            Some(sum) if last_pass == Some(*pass) => passes.push(sum + grad),
            Some(sum) => passes.extend([sum, grad]),
            None => passes.push(grad),
        }
        last_pass = Some(*pass);
    }
    if passes.len() < 2 {
        return Ok(passes.pop());
    }
    let widened = passes.into_iter().map(widen_half);
    Ok(widened.reduce(|sum, grad| sum + grad).map(|sum| sum.cast(dtype)))
}
