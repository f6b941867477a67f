//! One optimizer step: [`ShardedOptimizer`](crate::ShardedOptimizer) (`optimizer`), what each
//! stage does at each point of it (`stage_plan`), the gradients it updates with, in memory or
//! on disk (`bucket_grads`), the gradient norm and clipping
//! (`grad_norm`), the micro-batch sums kept between optimizer calls (`pending`), the
//! per-slot optimizer state and masters that checkpoints save (`slot_state`), what the last call
//! measured for the reports (`last_step`), and reading or editing the parameters with a user's visitor or mapper (`params`). Imports `hooks`, `overlap`, `optim`, `model`, `error` and `stage`.

pub(crate) mod bucket_grads;
pub(crate) mod grad_norm;
pub(crate) mod last_step;
pub(crate) mod optimizer;
pub(crate) mod params;
pub(crate) mod pending;
pub(crate) mod slot_state;
pub(crate) mod stage_plan;
