//! Communication that overlaps compute: the per-rank state and the two reducers that start
//! collectives while backward runs, and stage 3's gather schedule. The autodiff ops in `hooks`
//! call into this layer; nothing here calls the hooks or the step.
//! - `bucket_reducer`: stages 0-2, one all-reduce or reduce-scatter per complete bucket (see
//!   [`crate::bucket`]);
//! - `comm_context`: what every stage-3 collective of a rank shares (the collective, the first
//!   error, transient memory), a leaf;
//! - `context`: what stage 3's ops share per rank: the `comm_context` and the shards' home
//!   (`crate::placement`) with the `gather_schedule` and the `unit_reducer` that take them;
//! - `backward_log`: the gradients since the optimizer's last call, in arrival order, from
//!   which both reducers learn one backward;
//! - `call_tag`: how every collective call is named for the collectives' cross-rank check;
//! - `spec`: what one stage-3 gather is of (`ParamSpec`; the hooks' `GatherSpec` adds the context);
//! - `collectives`: the buffer layouts of stage 3's collectives;
//! - `gather_schedule`: per-unit grouped all-gathers with prefetch;
//! - `unit_reducer`: per-unit grouped reduce-scatters.
//!
//! Imports `placement`, `model` and `error` of this crate.

pub(crate) mod backward_log;
pub(crate) mod bucket_reducer;
pub(crate) mod call_tag;
pub(crate) mod collectives;
pub(crate) mod comm_context;
pub(crate) mod context;
pub(crate) mod gather_schedule;
pub(crate) mod spec;
pub(crate) mod unit_reducer;
