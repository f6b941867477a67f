//! Errors of the sharding core: [`ShardError`] for set-up and steps, and [`CheckpointError`]
//! (re-exported as `checkpoint::CheckpointError`), which it wraps. Both live at the bottom of
//! the crate so that every layer can return them.

use std::path::{Path, PathBuf};

use burn_shard_comm::CommError;

/// Why sharded set-up or a sharded step failed. Every message names the fix.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ShardError {
    /// A collective failed (mismatch, dead peer, timeout): see the inner error.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The model's device is on a backend that lacks an op the configuration needs.
    #[error("the model's device ({device}) has no {missing} in this build: {fix}")]
    UnsupportedBackend {
        /// The model's device (without autodiff), as Burn prints it.
        device: String,
        /// The op that is missing.
        missing: String,
        /// What to do instead.
        fix: String,
    },
    /// A parameter the stage cannot train, named with the reason and the fix.
    #[error("parameter `{path}` cannot be trained at stage {stage}: {reason}")]
    UnsupportedParam {
        /// The parameter's module path.
        path: String,
        /// The stage asked for.
        stage: u8,
        /// Why, and what to do instead.
        reason: String,
    },
    /// Ranks hold modules with different parameter layouts.
    #[error(
        "rank {rank} has a different parameter layout than rank {peer} (fingerprints {ours:#018x} vs {theirs:#018x}); \
         every rank must build the same model (same architecture, same frozen parameters, same bucket size) and \
         configure the same step (max_grad_norm, loss scaler, gradient clipping, parameter groups, NVMe offload)"
    )]
    LayoutMismatch {
        /// This rank.
        rank: usize,
        /// The rank whose layout differs.
        peer: usize,
        /// This rank's fingerprint.
        ours: u64,
        /// The peer's fingerprint.
        theirs: u64,
    },
    /// Ranks passed different [`ShardConfig`](crate::ShardConfig)s to `init`.
    #[error(
        "rank {rank}'s ShardConfig differs from rank {peer}'s in {fields:?}: every rank must pass the same \
         ShardConfig to init (every field but the NVMe offload directories and their I/O settings, which may \
         differ per node)"
    )]
    ConfigMismatch {
        /// This rank.
        rank: usize,
        /// The rank whose config differs.
        peer: usize,
        /// The fields that differ, as paths in the config's tree (`stage`, `stage3.units`,
        /// `placement.params`).
        fields: Vec<String>,
    },
    /// The module given to `step`, `save_checkpoint` or `load_checkpoint` is not the one the
    /// optimizer was built for.
    #[error(
        "parameter `{path}` ({id}) is in only one of the module passed and the layout built by ShardConfig::init; pass the model that init (or the last step) returned"
    )]
    UnknownParam {
        /// The parameter's module path.
        path: String,
        /// Its id.
        id: String,
    },
    /// A parameter changed shape since the layout was built.
    #[error(
        "parameter `{path}` has shape {found:?}, the layout expects {expected:?}; rebuild the sharded optimizer after changing the model"
    )]
    ShapeChanged {
        /// The parameter's module path.
        path: String,
        /// Shape recorded in the layout.
        expected: Vec<usize>,
        /// Shape found now.
        found: Vec<usize>,
    },
    /// Two module fields hold the same parameter (same `ParamId`), e.g. a weight tied by
    /// `clone()`. Use one field and read it twice instead (`param.val()` in both places).
    #[error(
        "parameters `{first}` and `{second}` share one ParamId; tie weights by using one Param in two places, not by cloning it into two fields"
    )]
    DuplicateParam {
        /// Path of the first field.
        first: String,
        /// Path of the second field.
        second: String,
    },
    /// A parameter has a dtype the sharded optimizer cannot train.
    #[error(
        "parameter `{path}` has dtype {dtype}; sharded training supports f32, f64 (stepped directly) and bf16, f16 (with f32 master weights): cast the model first"
    )]
    UnsupportedDtype {
        /// The parameter's module path.
        path: String,
        /// Its dtype, as Burn prints it.
        dtype: String,
    },
    /// A parameter changed dtype since the layout was built.
    #[error(
        "parameter `{path}` has dtype {found}, the layout expects {expected}; cast the model before ShardConfig::init, not after"
    )]
    DTypeChanged {
        /// The parameter's module path.
        path: String,
        /// Dtype recorded in the layout.
        expected: String,
        /// Dtype found now.
        found: String,
    },
    /// A checkpoint could not be saved, read or applied: see the inner error.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A configuration value is out of range.
    #[error("invalid sharding configuration: {0}")]
    InvalidConfig(String),
    /// NVMe offload ([`NvmeOffload`](crate::NvmeOffload)): this rank's swap file or its
    /// directory could not be used, or a peer's could not (then `reason` names the ranks). The
    /// optimizer state on disk is then lost for this run: resume from the last checkpoint.
    #[error("NVMe offload, {path}: {reason}; {fix}")]
    Nvme {
        /// The swap file, or the directory when no file could be made.
        path: PathBuf,
        /// What failed (the operating system's message where it gave one).
        reason: String,
        /// What to do about it.
        fix: String,
    },
    /// An earlier `ShardedOptimizer::step` failed after it had started updating (a disk that
    /// filled with NVMe offload, a collective lost mid-update): some buckets hold the new
    /// values and some the old, on this rank or across ranks. Every later `step`, `accumulate`,
    /// `map_params` and save returns this, so a half-applied step is never trained on or saved.
    #[error(
        "an earlier ShardedOptimizer::step failed half-way ({cause}): the parameters and the optimizer state are \
         partly updated, so this optimizer refuses to {op}; restart the job and resume from the last checkpoint \
         (ShardedOptimizer::load_checkpoint)"
    )]
    HalfAppliedStep {
        /// What the refused call was (`step`, `save a checkpoint`, ...).
        op: String,
        /// The error of the step that failed half-way.
        cause: String,
    },
    /// A mapper given to `ShardedOptimizer::map_params` changed what the sharded layout is
    /// built on (a parameter's shape or dtype, or made a parameter frozen at `init` trainable);
    /// nothing was replaced.
    #[error("map_params: the mapper changed parameter `{path}`'s {what}, which is refused; {fix}; nothing was changed")]
    MappedParamChanged {
        /// The parameter's module path.
        path: String,
        /// What changed, from what to what.
        what: String,
        /// Why it cannot be kept, and what to call instead.
        fix: String,
    },
    /// A [`LossScaler`](crate::LossScaler) is configured but the loss of a backward that
    /// reached the optimizer was not multiplied by its scale: the step would divide unscaled
    /// gradients by the scale (`2^16` by default) and barely train.
    #[error(
        "ShardConfig has a LossScaler (scale {scale}) but no loss since the last optimizer call was scaled by it{}: \
         call backward on optim.scale_loss(loss) (in a burn-train TrainStep run by ShardedStrategy, on \
         burn_shard_train::scale_loss(loss)), taking a new LossScaling after each optimizer call, or configure \
         LossScaler::fixed(1.0) to keep only the overflow check",
        scaled_by.map(|s| format!(" (the last was scaled by {s}, an older scale)")).unwrap_or_default()
    )]
    LossNotScaled {
        /// The loss scale the step would have divided by.
        scale: f32,
        /// The scale the last loss was multiplied by, when it was an older one.
        scaled_by: Option<f32>,
    },
    /// Pretrained weights ([`Pretrained`](crate::Pretrained)) that do not fit the model,
    /// found by [`ShardConfig::init_pretrained`](crate::ShardConfig::init_pretrained) on every
    /// rank from the file's header before any entry was read or changed.
    #[error("the pretrained weights {origin} do not fit the model (nothing was loaded):\n  - {problems}")]
    PretrainedMismatch {
        /// The file.
        origin: String,
        /// Every problem, one per line: tensor and entry named, both shapes or dtypes.
        problems: String,
    },
    /// A pretrained file could not be opened or read.
    #[error("cannot read the pretrained weights {origin}: {reason}")]
    PretrainedRead {
        /// The file.
        origin: String,
        /// What failed.
        reason: String,
    },
}

/// Why a checkpoint could not be saved, read or applied. Every message names the file or the
/// parameter, and what to do.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CheckpointError {
    /// A file could not be read or written.
    #[error("{path}: {message}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The operating system's message.
        message: String,
    },
    /// The checkpoint directory does not exist.
    #[error("{dir} does not exist; pass a checkpoint directory (one that has meta.json and COMPLETE)")]
    NotFound {
        /// The directory.
        dir: PathBuf,
    },
    /// The directory has no completion marker, or is a save's working directory (`DIR.partial`,
    /// even one holding the marker: its save was killed before the rename that completes it):
    /// a save that did not finish, or not a checkpoint.
    #[error(
        "{dir} is not a complete checkpoint (no COMPLETE marker, or a save's DIR.partial working directory): its save did not finish; use an earlier checkpoint"
    )]
    Incomplete {
        /// The directory.
        dir: PathBuf,
    },
    /// The target directory of a save exists already.
    #[error("{dir} exists already; save each checkpoint into a new directory (e.g. one per step)")]
    Exists {
        /// The directory.
        dir: PathBuf,
    },
    /// A file's contents do not match what the metadata says (truncated, altered, unreadable).
    #[error("{file} is corrupt: {reason}; restore it or use an earlier checkpoint")]
    Corrupt {
        /// The file.
        file: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A file the metadata lists is not there.
    #[error("{file} is missing from the checkpoint; copy every rank's file into the directory")]
    Missing {
        /// The file.
        file: PathBuf,
    },
    /// Written by another format version.
    #[error(
        "{file} has checkpoint format {found}, this build reads formats 1 to {supported} (a later format needs a later burn-shard)"
    )]
    Version {
        /// The metadata file.
        file: PathBuf,
        /// Its version.
        found: u32,
        /// The newest version this build reads.
        supported: u32,
    },
    /// Another rank failed in the same collective checkpoint operation (its own error says why).
    #[error("rank(s) {ranks:?} failed in {op}: see that rank's error; nothing was changed here")]
    PeerFailed {
        /// The operation.
        op: String,
        /// The ranks that failed.
        ranks: Vec<usize>,
    },
    /// An argument is out of range.
    #[error("{0}")]
    InvalidArgument(String),
    /// The checkpoint is of another model.
    #[error("the checkpoint does not fit the model: {0}; load it into the model it was saved from")]
    ModelMismatch(String),
    /// The checkpoint holds fingerprints of its frozen entries instead of their values
    /// ([`FrozenEntries::Fingerprinted`](crate::FrozenEntries::Fingerprinted)), and the model's
    /// frozen entries are not the base it was trained on.
    #[error(
        "{dir} was trained on the frozen base {base} and does not hold it; the model's {differ} differ from it. \
         Load that base into the model first, as the run that saved the checkpoint did (the same file and options \
         with ShardConfig::init_pretrained, or the same model given to init), then load_checkpoint"
    )]
    BaseMismatch {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The base: its origin and fingerprint.
        base: String,
        /// The entries that differ (the first few by module path, and how many more).
        differ: String,
    },
    /// An operation needs values the checkpoint does not hold: it was saved with
    /// [`FrozenEntries::Fingerprinted`](crate::FrozenEntries::Fingerprinted).
    #[error("{dir} does not hold its frozen base ({base}), only fingerprints of it ({entries}); {fix}")]
    BaseNotSaved {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The base: its origin and fingerprint.
        base: String,
        /// The entries it does not hold (the first few, and how many more).
        entries: String,
        /// What to do instead.
        fix: String,
    },
}

/// The first `shown` of `names`, joined with ", ", and how many more: how errors list what
/// they are about.
pub(crate) fn listed<S: AsRef<str>>(names: &[S], shown: usize) -> String {
    let mut text = names
        .iter()
        .take(shown)
        .map(AsRef::as_ref)
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > shown {
        text.push_str(&format!(" and {} more", names.len() - shown));
    }
    text
}

impl CheckpointError {
    pub(crate) fn io(path: &Path, err: impl std::fmt::Display) -> Self {
        CheckpointError::Io {
            path: path.to_path_buf(),
            message: err.to_string(),
        }
    }
}
