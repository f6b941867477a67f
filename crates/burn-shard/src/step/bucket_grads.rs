//! The gradient each bucket's update takes.

use burn::tensor::Tensor;

use crate::swap::shard_store::Shard;

/// The step's gradients, bucket by bucket: in memory, or at stage 3 with NVMe parameter
/// offload in the shard file, read one bucket at a time (`ShardedOptimizer::bucket_grad`), so
/// the step never holds the gradients of the whole model.
#[derive(Clone)]
pub(crate) enum BucketGrads {
    /// Each bucket's owned-range gradient, unscaled; taken by the update.
    Held(Vec<Option<Tensor<1>>>),
    /// Each layout slot's gradient shards, in the order they were reduced, each with its
    /// backward pass (summed when read).
    Stored(Vec<Vec<(u64, Shard)>>),
}
