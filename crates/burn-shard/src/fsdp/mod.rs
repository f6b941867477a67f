//! Stage 3 (FSDP): parameters sharded too, all-gathered per use and freed after it.
//!
//! Everything stage 3 adds lives in this folder. The step asks it through one trait,
//! `ParamHolding` (`holding.rs`: how this rank holds the parameters, whole at stages 0-2 or
//! sharded here), held by `StagePlan`; the optimizer's face and checkpoints read and replace
//! shards through `exchange.rs`; `init/stage3.rs` shards a model. The decomposition follows
//! PyTorch FSDP2's (paths under `crates/burn-shard/src/fsdp/`):
//! - `sharded_param.rs`: one parameter's sharded state (its shard, full shape, how to unshard
//!   it), attached to Burn's `Param` as a `Reparameterization` over a full-shape placeholder,
//!   so `param.val()` all-gathers just in time, `param.shape()` is the full shape, and model
//!   code stays unchanged;
//! - `exchange.rs`: how the sharded optimizer reads and replaces the shards a model holds;
//! - `gather_op.rs`: the autodiff op that hooks the collectives into forward and backward
//!   (all-gather forward, re-gather in backward instead of keeping the full weight, the full
//!   gradient handed to `reduce` as soon as it is complete);
//! - `collectives.rs`: the buffer layouts of those collectives (padding, flattening), nothing else;
//! - `unit_reducer.rs`: the per-unit grouped reduce-scatters, started while backward computes
//!   the unit before and waited for by backward's last gradient (learned at the first optimizer
//!   call);
//! - `gather_schedule.rs`: the per-unit grouped all-gathers, learned from the previous pass, and
//!   the prefetch of the next unit's while this one computes;
//! - [`unit()`] (`unit.rs`): marking a unit (e.g. a transformer block) so its reduce-scatter
//!   runs right after its backward instead of at the end of the whole backward pass; units
//!   named by module path from outside the model ([`crate::ShardConfig::with_units`], FSDP2's
//!   `fully_shard(submodule)`) are resolved in `model/units.rs`, for models whose `forward`
//!   cannot carry [`unit()`] calls: the same grouped all-gathers and reduce-scatters, the
//!   reduce-scatters at the end of backward;
//! - `comm_context.rs`: what every collective of a rank shares: the collective, the first
//!   error, and the transient-memory probes; `context.rs` owns it with the shards' home
//!   (`home.rs`: the compute device, host memory or disk), the schedule and the unit reducer;
//! - `shard.rs`: what a sharded parameter holds (`Shard`: in memory or on disk);
//!   `read_ahead.rs`: shard reads from disk started before their use;
//! - `spec.rs`: what one gather is of (`ParamSpec`), shared by the ops (whose `GatherSpec` in
//!   `gather_op.rs` adds the context) and the schedule and reducer that group them;
//! - `holding.rs`: the trait above, with the whole and the sharded answers side by side.
//!
//! Below this folder: `overlap/` (the backward log the unit reducer learns from, which stages
//! 0-2's bucket reducer shares, and the collectives' call tags), `swap/` (the shard file), `model/`.

pub(crate) mod collectives;
pub(crate) mod comm_context;
pub(crate) mod context;
pub(crate) mod exchange;
pub(crate) mod gather_op;
pub(crate) mod gather_schedule;
pub(crate) mod holding;
pub(crate) mod home;
pub(crate) mod read_ahead;
pub(crate) mod shard;
pub(crate) mod sharded_param;
pub(crate) mod spec;
pub mod unit;
pub(crate) mod unit_reducer;

pub use sharded_param::ShardedParam;
pub use unit::unit;
