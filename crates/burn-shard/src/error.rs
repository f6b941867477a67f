//! Errors of the sharding core.

use burn_shard_comm::CommError;

/// Why sharded set-up or a sharded step failed. Every message names the fix.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ShardError {
    /// A collective failed (mismatch, dead peer, timeout): see the inner error.
    #[error(transparent)]
    Comm(#[from] CommError),
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
         configure the same step (max_grad_norm, loss scaler, gradient clipping, parameter groups)"
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
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    /// A configuration value is out of range.
    #[error("invalid sharding configuration: {0}")]
    InvalidConfig(String),
}
