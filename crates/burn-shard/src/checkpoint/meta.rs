//! `meta.json`: what a sharded checkpoint holds and where (serde JSON, written by rank 0).

use std::path::Path;

use burn::tensor::DType;
use serde::{Deserialize, Serialize};

use super::format::{FORMAT_VERSION, META, is_checkpoint};
use crate::error::CheckpointError;
pub(crate) use crate::run::order;
pub use crate::run::{Branch, Lineage};

/// The metadata file of a checkpoint directory.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// Ranks that wrote the checkpoint.
    pub world_size: usize,
    /// ZeRO stage of the run that wrote it (0-3).
    pub stage: u8,
    /// Every float entry of the model (parameters and buffers), in traversal order.
    pub entries: Vec<EntryMeta>,
    /// The rank files, with their sizes and SHA-256 digests.
    pub files: Vec<FileMeta>,
    /// The caller's payload (step, data position, seed, scheduler state, ...).
    pub payload: serde_json::Value,
    /// The loss scaler's state (scale, finite steps since growth, skipped steps) when the run
    /// used one; absent otherwise (and in checkpoints written before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scaler: Option<crate::optim::loss_scale::LossScaler>,
    /// Where the checkpoint comes from: the run that saved it, the checkpoint that run resumed
    /// from and the history before it (see [`Lineage`]); absent in checkpoints written before
    /// it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lineage: Option<Lineage>,
    /// The frozen base the checkpoint refers to instead of holding it (saved with
    /// [`FrozenEntries::Fingerprinted`](crate::FrozenEntries::Fingerprinted)); absent when it
    /// holds every entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<BaseMeta>,
}

/// The frozen base of a checkpoint that holds fingerprints of its frozen entries instead of
/// their values.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct BaseMeta {
    /// Where the run's pretrained weights came from (the file given to `init_pretrained`, as
    /// it was named then); `None` for a run started with `init`.
    pub origin: Option<String>,
    /// SHA-256 of the frozen entries' paths and fingerprints, lowercase hex: one name for the
    /// base, equal for every checkpoint trained on it.
    pub fingerprint: String,
}

/// One float entry of the model.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct EntryMeta {
    /// Module path, e.g. `blocks.0.attn.query.weight` (the name in a Burn record).
    pub path: String,
    /// The `ParamId` of the writer's model (kept in a consolidated record).
    pub id: u64,
    /// Full (logical) shape.
    pub shape: Vec<usize>,
    /// Element type, as Burn names it (`F32`, `BF16`, `F16`, `F64`).
    pub dtype: String,
    /// `param`, `reparameterized` (a parameter with its own reparameterization) or `buffer`.
    pub kind: String,
    /// Whether the optimizer trained it (its pieces then carry optimizer state).
    pub trainable: bool,
    /// Where its elements are: disjoint element ranges of the flattened entry, in order,
    /// covering `[0, numel)`; none when the checkpoint holds its `fingerprint` instead.
    pub pieces: Vec<Piece>,
    /// A frozen entry the checkpoint does not hold: the wrapping sum over its elements `i` of
    /// SplitMix64's finalizer of `i * 0x9E3779B97F4A7C15 XOR bits(i)` (the element's bytes,
    /// little-endian), 16 hex digits. It sums over any split of the elements, so ranks of any
    /// world size and stage compute it from their own pieces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
}

impl EntryMeta {
    /// Elements of the full entry.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the checkpoint holds the entry's values (not only its fingerprint).
    pub fn is_held(&self) -> bool {
        self.fingerprint.is_none()
    }
}

/// Elements `[start, end)` of an entry, stored in rank `rank`'s file.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Piece {
    /// The rank whose file holds it.
    pub rank: usize,
    /// First element (inclusive).
    pub start: usize,
    /// Last element (exclusive).
    pub end: usize,
}

/// One rank file.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileMeta {
    /// File name inside the checkpoint directory (`rank-3.bpk`).
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
    /// SHA-256 of the file's bytes, lowercase hex.
    pub sha256: String,
}

impl CheckpointMeta {
    /// Reads and checks `dir/meta.json`.
    ///
    /// # Errors
    /// [`CheckpointError::NotFound`], [`CheckpointError::Incomplete`] without the completion
    /// marker or for a save's working directory `DIR.partial`,
    /// [`CheckpointError::Io`], [`CheckpointError::Corrupt`] for unparsable JSON,
    /// [`CheckpointError::Version`].
    pub fn read(dir: &Path) -> Result<Self, CheckpointError> {
        if !dir.is_dir() {
            return Err(CheckpointError::NotFound { dir: dir.to_path_buf() });
        }
        if !is_checkpoint(dir) {
            return Err(CheckpointError::Incomplete { dir: dir.to_path_buf() });
        }
        let path = dir.join(META);
        let text = std::fs::read_to_string(&path).map_err(|e| CheckpointError::io(&path, e))?;
        let meta: Self = serde_json::from_str(&text).map_err(|e| CheckpointError::Corrupt {
            file: path.clone(),
            reason: format!("not a checkpoint's metadata: {e}"),
        })?;
        if !(1..=FORMAT_VERSION).contains(&meta.format_version) {
            return Err(CheckpointError::Version {
                file: path,
                found: meta.format_version,
                supported: FORMAT_VERSION,
            });
        }
        Ok(meta)
    }
}

/// Burn's name of a float dtype the checkpoint stores.
pub(crate) fn dtype_name(dtype: DType) -> String {
    format!("{dtype:?}")
}

/// The dtype named by [`dtype_name`].
pub(crate) fn parse_dtype(name: &str) -> Option<DType> {
    [DType::F32, DType::F64, DType::BF16, DType::F16, DType::Flex32]
        .into_iter()
        .find(|d| dtype_name(*d) == name)
}
