//! Communication that overlaps compute: the per-rank state and the two reducers that start
//! collectives while backward runs, and stage 3's gather schedule. The autodiff ops in `hooks`
//! call into this layer; nothing here calls the hooks or the step.
//! - `bucket_reducer`: stages 0-2, one all-reduce or reduce-scatter per complete bucket (see
//!   [`crate::bucket`]);
//! - `context`: what stage 3's ops share per rank (collective, first error, transient memory),
//!   owning its `gather_schedule` and `unit_reducer`;
//! - `call_tag`: how every collective call is named for the collectives' cross-rank check;
//! - `spec`: what one stage-3 gather needs (`GatherSpec`);
//! - `collectives`: the buffer layouts of stage 3's collectives;
//! - `gather_schedule`: per-unit grouped all-gathers with prefetch;
//! - `unit_reducer`: per-unit grouped reduce-scatters.
//!
//! Imports `model`, `error` and `stage` of this crate.

pub(crate) mod bucket_reducer;
pub(crate) mod call_tag;
pub(crate) mod collectives;
pub(crate) mod context;
pub(crate) mod gather_schedule;
pub(crate) mod spec;
pub(crate) mod unit_reducer;
