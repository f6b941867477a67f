//! What the last optimizer call measured, for the reports: the gradient norm, whether the
//! update was applied, how many buckets overlapped backward, and the gradient and transient
//! bytes behind [`MemoryReport`](crate::MemoryReport).

use crate::swap::shard_store::ShardIo;

/// Measurements of the last `step` (or `accumulate`, for `overlapped_buckets`).
#[derive(Clone, Debug, Default)]
pub(crate) struct LastStep {
    /// Global norm of the averaged, unscaled gradient before clipping, from the last step that
    /// measured it.
    pub(crate) grad_norm: Option<f64>,
    /// Whether the last `step` updated the parameters (`false` when the loss scaler skipped
    /// it, and before the first step).
    pub(crate) applied: bool,
    /// Buckets whose reduction started inside backward before the last optimizer call.
    pub(crate) overlapped_buckets: usize,
    /// Bytes of the reduced gradients the last step held.
    pub(crate) gradients_bytes: usize,
    /// Peak bytes of transient buffers during the last step.
    pub(crate) temporary_peak_bytes: usize,
    /// Wall time of the optimizer's own steps in the last `step` (see
    /// [`Update::optimizer_time`](crate::step::update::Update)).
    pub(crate) optimizer_time: std::time::Duration,
    /// Bytes (read, written) of the rank's parameter shard file from the end of the step
    /// before to the end of the last one (its forward, backward and update), with NVMe
    /// parameter offload.
    pub(crate) param_io: ShardIo,
}
