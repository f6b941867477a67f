//! One optimizer step's phases. [`ShardedOptimizer`](crate::ShardedOptimizer)'s `step`
//! (`sharded_optimizer/`, the public face) builds the step's `context` and runs them in order: `reduce`
//! (which slots have a gradient, the buckets reduced), `measure` (norms, the loss scaler's
//! verdict, clipping; `grad_norm`), `update` (Burn's optimizer on each piece, then publishing).
//! Beside them: what each stage does at each point (`stage_plan`, the one place that asks the
//! stage), how ranks agree on an outcome (`agreement`), the gradients per bucket, in memory or on
//! disk (`bucket_grads`), the micro-batch sums kept between optimizer calls (`pending`), the
//! per-slot optimizer state and masters that checkpoints save (`slot_state`), the owners that step
//! whole parameters at stage 3 (`whole_owner`), what `init` asks of
//! the step (`options`), what the last call measured and the reports (`last_step`, `reports`),
//! and reading or editing the parameters with a user's visitor or mapper (`params`). Imports
//! `bucket`, `fsdp`, `overlap`, `swap`, `optim`, `model`, `error` and `stage`.

pub(crate) mod agreement;
pub(crate) mod bucket_grads;
pub(crate) mod context;
pub(crate) mod grad_norm;
pub(crate) mod last_step;
pub(crate) mod measure;
pub(crate) mod options;
pub(crate) mod pending;
pub(crate) mod reduce;
pub(crate) mod slot_state;
pub(crate) mod stage_plan;
pub(crate) mod update;
pub(crate) mod whole_owner;
