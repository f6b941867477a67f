//! One optimizer step: [`ShardedOptimizer`](crate::ShardedOptimizer) (`optimizer`), what each
//! stage does at each point of it (`stage_plan`), and the gradient norm and clipping
//! (`grad_norm`). Imports `hooks`, `overlap`, `optim`, `model`, `error` and `stage`.

pub(crate) mod grad_norm;
pub(crate) mod optimizer;
pub(crate) mod stage_plan;
