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

use crate::bucket::reducer::Early;
use crate::error::ShardError;
use crate::fsdp::read_ahead::ReadAhead;
use crate::fsdp::shard::PassShards;
use crate::model::flat::{SlotValues, tensor_bytes};
use crate::model::layout::ParamSlot;
use crate::optim::master::widen_half;

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

#[cfg(test)]
mod tests {
    use burn::module::ParamId;
    use burn::tensor::TensorData;

    use super::*;
    use crate::fsdp::shard::Shard;

    /// `values` as a `bf16` tensor on Burn's CPU device (each value exact in `bf16`).
    fn bf16(values: &[f32]) -> Tensor<1> {
        let data = TensorData::new(values.to_vec(), [values.len()]);
        Tensor::<1>::from_data(data, &Device::flex()).cast(DType::BF16)
    }

    fn read(t: Tensor<1>) -> Vec<f32> {
        t.cast(DType::F32).into_data().iter::<f32>().collect()
    }

    /// `bf16` has 8 significant bits: between 256 and 512 its values are 2 apart, so 256 + 1
    /// rounds back to 256 (a tie, to even). The rules below are told apart by that.
    #[test]
    fn bf16_spacing_at_256_is_two() {
        assert_eq!(read(bf16(&[256.0]) + bf16(&[1.0])), [256.0]);
        assert_eq!(read(bf16(&[258.0])), [258.0]);
    }

    /// A slot's gradient shards on disk: the shards of one backward pass are summed in their
    /// dtype (as Burn's `Gradients::register` sums two gradients of one parameter), the passes
    /// widened to `f32` and summed there (as `accumulate` keeps micro-batch sums), rounded once.
    /// Passes [256, 1], [1], [1]: 256 + 1 rounds to 256 in pass 0, the passes add up to 258
    /// exactly; summing everything in `bf16` would give 256, everything in `f32` 259 -> 260.
    #[test]
    fn stored_shards_sum_within_a_pass_in_their_dtype_and_across_passes_in_f32() {
        let shards: PassShards = [(0, 256.0), (0, 1.0), (1, 1.0), (2, 1.0)]
            .into_iter()
            .map(|(pass, v)| (pass, Shard::Held(bf16(&[v]))))
            .collect();
        let mut ahead = ReadAhead::default();
        let sum = sum_passes(&shards, DType::BF16, &Device::flex(), &mut ahead)
            .unwrap()
            .unwrap();
        assert_eq!(sum.dtype(), DType::BF16);
        assert_eq!(read(sum), [258.0]);
        // One pass only: no widening, the pass's own sum.
        let one: PassShards = vec![(5, Shard::Held(bf16(&[256.0]))), (5, Shard::Held(bf16(&[1.0])))];
        let sum = sum_passes(&one, DType::BF16, &Device::flex(), &mut ahead)
            .unwrap()
            .unwrap();
        assert_eq!(read(sum), [256.0]);
        assert!(
            sum_passes(&Vec::new(), DType::BF16, &Device::flex(), &mut ahead)
                .unwrap()
                .is_none()
        );
    }

    fn slot(dtype: DType) -> ParamSlot {
        ParamSlot {
            path: "w".into(),
            id: ParamId::new(),
            shape: vec![1],
            numel: 1,
            dtype,
            bucket: 0,
            offset: 0,
        }
    }

    /// Unreduced micro-batch gradients of a `bf16` slot are kept in `f32` and rounded once, by
    /// the step, after its own backward's gradient is added: 256 + 1 + 1 + 1 = 259 -> 260
    /// (rounding per micro-batch would stay at 256); the step ends the memory cycle.
    #[test]
    fn micro_batch_sums_are_kept_in_f32_and_rounded_once_by_the_step() {
        let mut pending = PendingGradients::new(1, 1);
        for v in [256.0, 1.0, 1.0] {
            pending.keep(None, vec![Some(bf16(&[v]))]);
        }
        assert_eq!(pending.count(), 1);
        let kept = pending.unreduced_mut()[0].clone().unwrap();
        assert_eq!((kept.dtype(), read(kept)), (DType::F32, vec![258.0]));
        let mut grads: SlotValues = vec![Some(bf16(&[1.0]))];
        pending.add_to_step(&mut grads, [slot(DType::BF16)].iter());
        let grad = grads.pop().unwrap().unwrap();
        assert_eq!((grad.dtype(), read(grad)), (DType::BF16, vec![260.0]));
        assert_eq!(pending.count(), 0);
        assert_eq!(pending.last_cycle_bytes(), 4, "one f32 sum of one element was held");
        // A slot without a backward gradient of its own in the step gets the sum alone.
        pending.keep(None, vec![Some(bf16(&[2.0]))]);
        let mut grads: SlotValues = vec![None];
        pending.add_to_step(&mut grads, [slot(DType::BF16)].iter());
        assert_eq!(read(grads[0].clone().unwrap()), [2.0]);
    }

    /// Buckets reduced inside earlier micro-batch backwards are merged with those the last
    /// backward reduced: the sums add in `f32` (256 + 1 = 257, not `bf16`'s 256), a bucket
    /// reduced only once is kept as it was, the slots present are the union, and the pending
    /// sums are moved out (none is counted twice).
    #[test]
    fn kept_reductions_merge_into_the_last_backwards_in_f32() {
        let early = |reduced: Vec<Option<Tensor<1>>>, present: Vec<bool>| Early {
            reduced,
            present,
            started_in_backward: 0,
            differs: false,
        };
        let mut pending = PendingGradients::new(2, 2);
        let mut first = early(vec![Some(bf16(&[256.0])), None], vec![true, false]);
        pending.merge_reduced_into(&mut first);
        pending.keep(Some(first), vec![None, None]);
        assert_eq!(pending.count(), 1);
        let mut last = early(vec![Some(bf16(&[1.0])), Some(bf16(&[3.0]))], vec![false, true]);
        pending.merge_reduced_into(&mut last);
        let [both, second] = [last.reduced[0].clone().unwrap(), last.reduced[1].clone().unwrap()];
        assert_eq!((both.dtype(), read(both)), (DType::F32, vec![257.0]));
        assert_eq!(read(second), [3.0]);
        assert_eq!(last.present, [true, true]);
        assert_eq!(pending.count(), 0);
    }
}
