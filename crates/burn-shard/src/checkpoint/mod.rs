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
//!   full shape, dtype and which rank holds which element range, the files' digests, the
//!   caller's payload (step, data position, seed, scheduler state) and the lineage;
//! - `scheduler.bpk` (rank 0, when saved with a scheduler): Burn's `LrSchedulerRecord`;
//! - `COMPLETE`: written last. A directory without it is not a checkpoint.
//!
//! Every piece is a range of the flattened entry, so a reader at another world size or stage
//! takes the ranges it needs from whichever files hold them: no conversion step. Saving writes
//! into `DIR.partial` and renames it to `DIR` once every rank is done, so a failed save leaves
//! no half checkpoint and never touches an earlier one: a failed save removes its
//! `DIR.partial` (rank 0, once every rank is done with it), and a save that finds a `*.partial`
//! next to its target (left by a crashed process) removes it and says so with
//! `tracing::warn!`. Files are verified against their digests before they are read. Ranks
//! must see one filesystem (the usual shared checkpoint directory), and one run saves into a
//! directory at a time.
//!
//! # Lineage
//!
//! A run starts at `init` or at a load, with a new id; each checkpoint records its run's id, the
//! checkpoint that run resumed from, and the history before it ([`Lineage`]). A run resumed from
//! a checkpoint that is not the newest in a directory it saves into (a rollback: resume from
//! `step-4` of a directory holding `step-8` and `step-12`) starts a new branch there: before its
//! first save into the directory it moves the checkpoints that sort after the one it resumed
//! from and are not of its history into `DIR/abandoned-<run id>/` (never deleting them; rank 0
//! moves, every rank agrees; a `tracing::warn!` names them). [`list`], [`keep_last`] and the
//! examples' `--resume DIR` see only the lineage of the newest checkpoint of a directory, so
//! `keep_last` never removes an abandoned checkpoint nor one of another lineage. A fresh run
//! moves nothing (saving over an existing checkpoint is refused). Checkpoints written before
//! lineages existed load as before, and count as one unnamed run.
//!
//! # Frozen entries
//!
//! With [`FrozenEntries::Fingerprinted`](crate::FrozenEntries::Fingerprinted) a checkpoint holds
//! no values of the parameters the optimizer does not train (a LoRA fine-tune's base): each
//! such entry has a `fingerprint` and no pieces in `meta.json`, and `base` names the weights the
//! run loaded. The fingerprint (see [`EntryMeta::fingerprint`]) is a sum over elements, so the
//! ranks of any world size and stage compute it from their own pieces with one all-reduce; a
//! load compares it with the model's values before anything is read or changed, and refuses
//! another base naming the checkpoint's. [`reshard`] keeps the fingerprints, [`inspect`] lists
//! them, and a whole-model [`consolidate`] refuses and names the fix
//! ([`Selection::Trainable`] works). Such a checkpoint is format 2 ([`FORMAT_VERSION`]).

// The format, the files, the pieces and the offline operations (reshard, consolidate,
// inspect), usable without an optimizer; saving and loading a run's state are the optimizer's
// (`sharded_optimizer/save.rs`, `load.rs`), built on these.
mod consolidate;
pub(crate) mod files;
pub(crate) mod format;
pub(crate) mod frozen;
pub(crate) mod held;
pub(crate) mod lineage;
pub(crate) mod meta;
pub(crate) mod options;
pub(crate) mod pieces;
mod reshard;

pub use crate::error::CheckpointError;
pub use consolidate::{ConsolidateOptions, ConsolidateReport, RecordFormat, Selection, consolidate};
pub use format::{FORMAT_VERSION, is_checkpoint, remove};
pub use lineage::ABANDONED_PREFIX;
pub use meta::{BaseMeta, Branch, CheckpointMeta, EntryMeta, FileMeta, Lineage, Piece};
pub use options::{Restored, SaveOptions};
pub use reshard::{FileStatus, Inspection, inspect, keep_last, list, newest, reshard};
