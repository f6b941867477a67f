//! The gradient each bucket's update takes.

use burn::tensor::Tensor;

use crate::model::layout::Bucket;
use crate::step::pending::PassShards;
use crate::swap::read_ahead::ReadAhead;
use crate::swap::shard_store::Shard;

/// The step's gradients, bucket by bucket: in memory, or at stage 3 with NVMe parameter
/// offload in the shard file, read one bucket at a time (`ShardedOptimizer::bucket_grad`), so
/// the step never holds the gradients of the whole model.
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

impl StoredGrads {
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
