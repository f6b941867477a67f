//! The gradient each bucket's update takes: held in memory (reduced by phase 1), or at stage 3
//! with NVMe parameter offload read from the shard file one bucket at a time.

use burn::tensor::{Device, Tensor};

use crate::error::ShardError;
use crate::fsdp::read_ahead::ReadAhead;
use crate::fsdp::shard::{PassShards, Shard};
use crate::model::flat;
use crate::model::layout::{Bucket, FlatLayout};
use crate::step::context::StepContext;
use crate::step::pending;
use crate::step::stage_plan::StagePlan;

/// The step's gradients, bucket by bucket: in memory, or at stage 3 with NVMe parameter
/// offload in the shard file, read one bucket at a time ([`BucketGrads::take`]), so the step
/// never holds the gradients of the whole model.
pub(crate) enum BucketGrads {
    /// Each bucket's owned-range gradient, unscaled; taken by the update.
    Held(Vec<Option<Tensor<1>>>),
    /// Each layout slot's gradient shards on disk.
    Stored(StoredGrads),
}

/// Each layout slot's gradient shards, in the order they were reduced, each with its backward
/// pass (summed when read), and the reads of the next bucket's shards, started while the
/// current one is used.
pub(crate) struct StoredGrads {
    pub(crate) shards: Vec<PassShards>,
    pub(crate) ahead: ReadAhead,
}

impl BucketGrads {
    /// Bucket `index`'s owned-range gradient, unscaled (`[owned range]`, in `f32` for a
    /// `bf16`/`f16` bucket with a loss scaler): taken from memory, or read from the shard file
    /// (each slot's shards summed as Burn's gradients and `accumulate` sum them in memory, see
    /// [`pending::sum_passes`], then assembled and unscaled as phase 1 does, so the values are
    /// the same). The next bucket's shards are read while this one is used (buckets are taken
    /// in order, each once).
    ///
    /// # Errors
    /// [`ShardError::Nvme`] when a gradient shard cannot be read; [`ShardError::Comm`] when the
    /// replicas' all-reduce fails.
    pub(crate) fn take(&mut self, cx: &StepContext, index: usize) -> Result<Tensor<1>, ShardError> {
        let stored = match self {
            BucketGrads::Held(held) => return Ok(held[index].take().expect("each bucket is taken once")),
            BucketGrads::Stored(stored) => stored,
        };
        let buckets = cx.layout.buckets();
        let bucket = &buckets[index];
        // This bucket's reads first (started with the previous bucket, but for the first).
        let this: Vec<_> = stored.shards_of(bucket).cloned().collect();
        stored.ahead.start(&this, false);
        if let Some(next) = buckets.get(index + 1) {
            let next: Vec<_> = stored.shards_of(next).cloned().collect();
            stored.ahead.start(&next, true);
        }
        let mut values: flat::SlotValues = vec![None; cx.layout.slots().len()];
        for index in bucket.slots.clone() {
            let dtype = cx.layout.slots()[index].dtype;
            values[index] = pending::sum_passes(&stored.shards[index], dtype, &cx.device, &mut stored.ahead)?;
        }
        let flat = flat::assemble(cx.layout, bucket, &values, 0..bucket.padded_numel, &cx.device);
        // With hybrid sharding each read is averaged over the replicas (a step that measures
        // norms reads a bucket twice, and all-reduces it twice, to the same values).
        Ok(cx.unscale(cx.replica_mean(cx.plan.gradient_of_range(flat, cx.owned_range(bucket)))?))
    }
}

impl StoredGrads {
    /// Stage 3 with NVMe parameter offload: each layout slot's gradient shards that backward
    /// wrote to the shard file, in the order they were reduced (taken from the stage's context);
    /// the slot's entry of `grad_parts` becomes a stride-0 zero view of its length (no memory),
    /// so the phases that ask which slots have a gradient see it (on `device`, the parameters'
    /// device: the step may have no gradient in memory to take one from). `None` without NVMe
    /// parameter offload.
    pub(crate) fn from_plan(
        plan: &StagePlan,
        layout: &FlatLayout,
        device: &Device,
        grad_parts: &mut flat::SlotValues,
    ) -> Option<Self> {
        let mut kept = plan.params().take_stored_grads()?;
        let mut shards = vec![Vec::new(); layout.slots().len()];
        for (index, slot) in layout.slots().iter().enumerate() {
            let Some(slot_shards) = kept.remove(&slot.id) else {
                continue;
            };
            // Every reduced shard went to disk (a failed write fails the step before here), and
            // `accumulate` keeps none in memory: nothing of the slot is in `grad_parts`.
            debug_assert!(grad_parts[index].is_none(), "a gradient both in memory and on disk");
            grad_parts[index] = Some(Tensor::<1>::zeros([1], (device, slot.dtype)).expand([slot.numel]));
            shards[index] = slot_shards;
        }
        Some(StoredGrads {
            shards,
            ahead: ReadAhead::default(),
        })
    }

    /// Whether any slot has a gradient shard on disk.
    pub(crate) fn any(&self) -> bool {
        self.shards.iter().any(|s| !s.is_empty())
    }

    /// The gradient shards of `bucket`'s slots.
    pub(crate) fn shards_of(&self, bucket: &Bucket) -> impl Iterator<Item = &Shard> {
        self.shards[bucket.slots.clone()]
            .iter()
            .flatten()
            .map(|(_, shard)| shard)
    }
}

/// The same gradients (handles); reads started ahead are not cloned.
impl Clone for BucketGrads {
    fn clone(&self) -> Self {
        match self {
            BucketGrads::Held(held) => BucketGrads::Held(held.clone()),
            BucketGrads::Stored(stored) => BucketGrads::Stored(StoredGrads {
                shards: stored.shards.clone(),
                ahead: ReadAhead::default(),
            }),
        }
    }
}
