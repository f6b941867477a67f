//! Stage 3 (FSDP): parameters sharded too, all-gathered per use and freed after it.
//!
//! The decomposition follows PyTorch FSDP2's (paths under `crates/burn-shard/src/`):
//! - `hooks/sharded_param.rs`: one parameter's sharded state (its shard, full shape, how to unshard
//!   it), attached to Burn's `Param` as a `Reparameterization` over a full-shape placeholder,
//!   so `param.val()` all-gathers just in time, `param.shape()` is the full shape, and model
//!   code stays unchanged;
//! - `hooks/exchange.rs`: how the sharded optimizer reads and replaces the shards a model holds;
//! - `hooks/gather_op.rs`: the autodiff op that hooks the collectives into forward and backward
//!   (all-gather forward, re-gather in backward instead of keeping the full weight,
//!   the full gradient handed to `reduce` as soon as it is complete);
//! - `overlap/collectives.rs`: the buffer layouts of those collectives (padding, flattening), nothing else;
//! - `overlap/unit_reducer.rs`: the per-unit grouped reduce-scatters, started while backward computes the unit
//!   before and waited for by backward's last gradient (learned at the first optimizer call);
//! - `overlap/gather_schedule.rs`: the per-unit grouped all-gathers, learned from the previous pass, and the
//!   prefetch of the next unit's while this one computes;
//! - [`unit()`] (`hooks/unit.rs`): marking a unit (e.g. a transformer block) so its reduce-scatter runs right after
//!   its backward instead of at the end of the whole backward pass;
//! - `model/units.rs`: units named by module path from outside the model
//!   ([`crate::ShardConfig::with_units`], FSDP2's `fully_shard(submodule)`), for models whose
//!   `forward` cannot carry [`unit()`] calls: the same grouped all-gathers and reduce-scatters, the
//!   reduce-scatters at the end of backward;
//! - `overlap/comm_context.rs`: what every collective of a rank shares: the collective, the first
//!   error, and the transient-memory probes; `overlap/context.rs` owns it with the shards' home
//!   (`placement/home.rs`: the compute device, host memory or disk), the schedule and the unit
//!   reducer;
//! - `placement/shard.rs`: what a sharded parameter holds (`Shard`: in memory or on disk);
//! - `overlap/backward_log.rs`: the gradients' arrival order, from which the reducer learns one
//!   backward;
//! - `overlap/spec.rs`: what one gather is of (`ParamSpec`), shared by the ops (whose
//!   `GatherSpec` in `hooks/gather_op.rs` adds the context) and the schedule and reducer that
//!   group them.

pub use crate::hooks::sharded_param::ShardedParam;
pub use crate::hooks::unit;
pub use crate::hooks::unit::unit;
