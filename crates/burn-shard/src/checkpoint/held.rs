//! This rank's values of the entries a checkpoint covers, as the writer and the fingerprints
//! read them: whole entries from the model, stage-3 parameters from this rank's shards.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use burn::module::{Module, ParamId};
use burn::tensor::{Tensor, TensorData};

use super::pieces::Holding;
use crate::error::ShardError;
use crate::fsdp::exchange;
use crate::fsdp::shard::Shard;
use crate::model::census::Entry;
use crate::model::flat;

/// The values of some entries on this rank, each taken once.
pub(crate) struct HeldValues {
    /// Entries held whole (`[numel]`, plain).
    values: HashMap<ParamId, Tensor<1>>,
    /// Stage 3: this rank's shard of each sharded parameter (`[ceil(numel / world_size)]`).
    shards: HashMap<ParamId, Shard>,
}

impl HeldValues {
    /// The values of `entries` in `model`: those held whole, and this rank's shards when
    /// `shards_parameters` (stage 3).
    pub(crate) fn of<M: Module>(model: &M, entries: &[(ParamId, &Entry, Holding)], shards_parameters: bool) -> Self {
        let whole: HashSet<ParamId> = entries
            .iter()
            .filter(|(_, _, h)| !h.is_sharded())
            .map(|(id, _, _)| *id)
            .collect();
        Self {
            values: flat::values_by_id(model, &whole),
            shards: match shards_parameters {
                true => exchange::collect_shards(model),
                false => HashMap::new(),
            },
        }
    }

    /// Elements `range` of the entry (`range` is this rank's piece of it, see
    /// [`super::pieces::piece`]): the value holding them and a reader of `[range.len()]`
    /// elements, run when the caller needs the bytes (from the shard file with NVMe parameter
    /// offload), so one tensor is in memory at a time.
    ///
    /// # Errors
    /// [`ShardError::UnknownParam`] when the model has no such entry (not the model `init`
    /// returned).
    pub(crate) fn take(
        &mut self,
        id: &ParamId,
        entry: &Entry,
        holding: Holding,
        range: Range<usize>,
    ) -> Result<PieceReader, ShardError> {
        let value = match holding.is_sharded() {
            true => self.shards.remove(id),
            false => self.values.remove(id).map(Shard::Held),
        }
        .ok_or_else(|| ShardError::UnknownParam {
            path: entry.path.clone(),
            id: id.to_string(),
        })?;
        // A shard starts at its own range; a whole value at element 0.
        let start = match holding.is_sharded() {
            true => 0,
            false => range.start,
        };
        Ok(PieceReader {
            value,
            start,
            len: range.len(),
        })
    }
}

/// One piece of an entry, read on demand.
pub(crate) struct PieceReader {
    value: Shard,
    start: usize,
    len: usize,
}

impl PieceReader {
    /// The whole shard this piece reads from, as it is held (stage 3: `[chunk]`, padded).
    ///
    /// # Errors
    /// [`ShardError::Nvme`] when the shard file cannot be read.
    pub(crate) fn shard(&self) -> Result<Tensor<1>, ShardError> {
        self.value.read_for_checkpoint()
    }

    /// The piece's dtype.
    pub(crate) fn dtype(&self) -> burn::tensor::DType {
        self.value.dtype()
    }

    /// Whether the piece is a shard on disk (NVMe parameter offload), which no step writes in
    /// place: reading it later reads the values of now.
    pub(crate) fn is_on_disk(&self) -> bool {
        matches!(self.value, Shard::Stored(_))
    }

    /// Its elements: `[len]`, the entry's dtype.
    ///
    /// # Errors
    /// [`ShardError::Nvme`] when the shard file cannot be read.
    pub(crate) fn read(&self) -> Result<TensorData, ShardError> {
        Ok(self
            .value
            .read_for_checkpoint()?
            .narrow(0, self.start, self.len)
            .into_data())
    }
}
