//! What one stage-3 gather or re-gather is of, shared by the ops that issue it (`gather_op.rs`, whose
//! `GatherSpec` adds the rank's context) and the schedule and reducer that group it.

use std::sync::atomic::{AtomicU64, Ordering};

use burn::module::ParamId;
use burn::tensor::Shape;

use crate::fsdp::shard::Shard;

/// Where a gather runs: in forward (`param.val()`), or re-gathered in backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Phase {
    Forward,
    Backward,
}

/// What one gather is of: this rank's shard, the parameter's shapes and names, the phase.
#[derive(Clone, Debug)]
pub struct ParamSpec {
    /// The parameter's id.
    pub(crate) id: ParamId,
    /// This rank's shard: `[chunk]`, the parameter's dtype, plain (not tracked by autodiff), on
    /// the compute device, in host memory with parameter offload (`ShardHome::to_compute`
    /// copies it for each gather), or in the rank's shard file with NVMe parameter offload
    /// (`FsdpContext::read` reads it for each gather).
    /// Ops keep the clone they were given, so a re-gather in backward uses the values of the
    /// forward even if the optimizer has replaced the shard since.
    pub(crate) shard: Shard,
    /// Shape of the full parameter.
    pub(crate) full_shape: Shape,
    /// Shape of the shard's gradient, registered on the placeholder: `[1, .., 1, chunk]`
    /// (same rank as the parameter).
    pub(crate) shard_shape: Shape,
    /// Elements of the full parameter.
    pub(crate) numel: usize,
    /// Elements of each rank's shard, `ceil(numel / world_size)`.
    pub(crate) chunk: usize,
    /// Names the parameter in its collectives (a hash of its module path, equal on every rank),
    /// so ranks that reach different parameters of equal size fail instead of mixing them.
    pub(crate) tag: u64,
    /// Identifies the value of `shard` (a new number each time a shard is created or
    /// replaced), so a gather uses a grouped result only if it gathered this very shard.
    pub(crate) version: u64,
    /// Forward gather or backward re-gather: the schedule keeps their groups apart.
    pub(crate) phase: Phase,
    /// The [`unit`](crate::fsdp::unit) scope the forward gather runs in, if any.
    pub(crate) unit_scope: Option<u64>,
    /// The unit [`crate::Stage3Config::units`] puts the parameter in, if any: outside an
    /// `fsdp::unit` scope, its forward gather runs in that unit's scope.
    pub(crate) policy_unit: Option<u32>,
}

/// Scope numbers of the units that `Stage3Config::units` names have this bit set, so they never
/// equal the scope numbers of `fsdp::unit` calls (counted from 0 per thread).
pub(crate) const POLICY_SCOPE: u64 = 1 << 63;

/// A number no shard value had before (process-wide, so clones of a model never collide): the
/// [`ParamSpec::version`] of a new or replaced shard.
pub(crate) fn next_version() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
