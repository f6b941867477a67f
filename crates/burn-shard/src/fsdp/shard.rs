//! [`Shard`]: what a stage-3 parameter holds of its values, wherever they live: in memory (on
//! the compute device, or in host memory with parameter offload) or in the rank's shard file
//! (NVMe parameter offload, [`ShardStore`](crate::swap::shard_store::ShardStore)).

use std::sync::Arc;

use burn::tensor::{DType, Device, Tensor};

use crate::error::ShardError;
use crate::swap::shard_store::{ShardRead, StoredShard};

/// What a stage-3 parameter holds of its values: this rank's `[chunk]` shard, in memory (on the
/// compute device, or in host memory with parameter offload) or in the rank's
/// [`ShardStore`](crate::swap::shard_store::ShardStore).
/// Clones are cheap (a tensor handle or an `Arc`).
// `Held` (a tensor handle, the common case) is the large variant: boxing it would allocate
// each time a shard is replaced, for 64 bytes saved per parameter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub(crate) enum Shard {
    /// In memory, plain (not tracked by autodiff).
    Held(Tensor<1>),
    /// On disk, read on each use.
    Stored(Arc<StoredShard>),
}

impl Shard {
    /// The values, `[chunk]`, read from disk when stored.
    ///
    /// # Errors
    /// As [`StoredShard::read`].
    pub(crate) fn read(&self) -> Result<Tensor<1>, ShardError> {
        match self {
            Shard::Held(shard) => Ok(shard.clone()),
            Shard::Stored(stored) => stored.read(),
        }
    }

    /// [`Shard::read`] for a checkpoint: a read from disk is not counted in the step's I/O.
    ///
    /// # Errors
    /// As [`StoredShard::read`].
    pub(crate) fn read_for_checkpoint(&self) -> Result<Tensor<1>, ShardError> {
        match self {
            Shard::Held(shard) => Ok(shard.clone()),
            Shard::Stored(stored) => stored.read_for_checkpoint(),
        }
    }

    /// Starts reading the values, to be waited for now (on the store's I/O threads when
    /// stored; see [`StoredShard::start_read`]).
    pub(crate) fn start_read(&self) -> ShardRead {
        match self {
            Shard::Held(shard) => ShardRead::Ready(shard.clone()),
            Shard::Stored(stored) => stored.start_read(false),
        }
    }

    /// Elements (`chunk`).
    pub(crate) fn numel(&self) -> usize {
        match self {
            Shard::Held(shard) => shard.dims()[0],
            Shard::Stored(stored) => stored.numel(),
        }
    }

    /// The values' dtype.
    pub(crate) fn dtype(&self) -> DType {
        match self {
            Shard::Held(shard) => shard.dtype(),
            Shard::Stored(stored) => stored.dtype(),
        }
    }

    /// Where a read shard is: its device in memory, the host when stored.
    pub(crate) fn device(&self) -> Device {
        match self {
            Shard::Held(shard) => shard.device(),
            Shard::Stored(stored) => stored.host(),
        }
    }

    /// The tensor, when the shard is in memory.
    pub(crate) fn held(&self) -> Option<&Tensor<1>> {
        match self {
            Shard::Held(shard) => Some(shard),
            Shard::Stored(_) => None,
        }
    }
}

/// A slot's gradient shards on disk, each with the backward pass it came from.
pub(crate) type PassShards = Vec<(u64, Shard)>;
