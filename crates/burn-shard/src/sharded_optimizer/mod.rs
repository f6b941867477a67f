//! [`ShardedOptimizer`](crate::ShardedOptimizer), the optimizer's public face: every `impl
//! ShardedOptimizer` is in this folder. The type and its step entry points (`optimizer`: `step`,
//! `accumulate`, the phases of `step/` run in order), steps weighted by item counts (`items`),
//! reading and editing the parameters with a user's visitor or mapper (`params`), the reports
//! (`reports`), saving and loading this run's state as a sharded checkpoint (`save`, `load`,
//! the frozen entries it names by fingerprint: `frozen`), and the saves written in the
//! background (`background_save`, each one a `save_in_flight`). Imports `step`, `checkpoint`
//! and every layer below them.

pub(crate) mod background_save;
pub(crate) mod frozen;
pub(crate) mod items;
pub(crate) mod load;
pub(crate) mod optimizer;
pub(crate) mod params;
pub(crate) mod reports;
pub(crate) mod save;
pub(crate) mod save_in_flight;
