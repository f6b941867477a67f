//! Sharded checkpoints: every rank saves its own shard; a checkpoint loads at any world size
//! and stage, and consolidates into one ordinary Burn record.
//!
//! A checkpoint is a directory:
//! - `rank-R.bpk` (one per rank, Burn's burnpack format): this rank's pieces of the entries,
//!   named `param/PATH` (values), `state/PATH/FIELD` (the optimizer state of that piece, in
//!   Burn's `RecordState` flattening: `momentum.moment_1`, ...; scalars such as
//!   `momentum.time` as burnpack scalars) and `master/PATH` (the `f32` master of a `bf16`/`f16`
//!   parameter);
//! - `rank-R.sha256`: that file's SHA-256 and size, written by its rank after the file;
//! - `meta.json` (rank 0): format version, world size, stage, for every entry its module path,
//!   full shape, dtype and which rank holds which element range, the files' digests, and the
//!   caller's payload (step, data position, seed, scheduler state);
//! - `scheduler.bpk` (rank 0, when saved with a scheduler): Burn's `LrSchedulerRecord`;
//! - `COMPLETE`: written last. A directory without it is not a checkpoint.
//!
//! Every piece is a range of the flattened entry, so a reader at another world size or stage
//! takes the ranges it needs from whichever files hold them: no conversion step. Saving writes
//! into `DIR.partial` and renames it to `DIR` once every rank is done, so a failed save leaves
//! no half checkpoint and never touches an earlier one. Files are verified against their
//! digests before they are read. Ranks must see one filesystem (the usual shared checkpoint
//! directory).

mod consolidate;
mod files;
mod load;
mod meta;
mod pieces;
mod reshard;
mod save;

use std::path::{Path, PathBuf};

pub use crate::error::CheckpointError;
pub use consolidate::{ConsolidateReport, consolidate, consolidate_optimizer, consolidate_safetensors};
pub use meta::{CheckpointMeta, EntryMeta, FORMAT_VERSION, FileMeta, Piece};
pub use reshard::{FileStatus, Inspection, inspect, keep_last, list, reshard};

/// The metadata file.
pub(crate) const META: &str = "meta.json";
/// The learning-rate scheduler's record (optional), written by rank 0.
pub(crate) const SCHEDULER: &str = "scheduler.bpk";
/// The completion marker, written last.
pub(crate) const COMPLETE: &str = "COMPLETE";

/// `dir` with `.partial` appended: where a save writes before it is complete.
pub(crate) fn partial_dir(dir: &Path) -> PathBuf {
    let mut name = dir.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".partial");
    dir.with_file_name(name)
}
