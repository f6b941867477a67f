//! Stage 3 (FSDP): parameters sharded too, all-gathered per use and freed after it.
//!
//! The decomposition follows PyTorch FSDP2's:
//! - `sharded_param`: one parameter's sharded state (its shard, full shape, how to unshard
//!   it), attached to Burn's `Param` as a `Reparameterization` over a full-shape placeholder,
//!   so `param.val()` all-gathers just in time, `param.shape()` is the full shape, and model
//!   code stays unchanged;
//! - `exchange`: how the sharded optimizer reads and replaces the shards a model holds;
//! - `gather_op`: the autodiff op that hooks the collectives into forward and backward
//!   (all-gather forward, re-gather in backward instead of keeping the full weight,
//!   the full gradient handed to `reduce` as soon as it is complete);
//! - `collectives`: the buffer layouts of those collectives (padding, flattening), nothing else;
//! - `reduce`: the per-unit grouped reduce-scatters, started while backward computes the unit
//!   before and waited for by backward's last gradient (learned at the first optimizer call);
//! - `schedule`: the per-unit grouped all-gathers, learned from the previous pass, and the
//!   prefetch of the next unit's while this one computes;
//! - [`unit()`]: marking a unit (e.g. a transformer block) so its reduce-scatter runs right after
//!   its backward instead of at the end of the whole backward pass;
//! - `context`: what the ops share per rank: the collective, the first error, and the
//!   transient-memory probes.

pub(crate) mod collectives;
pub(crate) mod context;
pub(crate) mod exchange;
pub(crate) mod gather_op;
pub(crate) mod reduce;
pub(crate) mod schedule;
pub(crate) mod sharded_param;
pub mod unit;

pub use sharded_param::ShardedParam;
pub use unit::unit;
