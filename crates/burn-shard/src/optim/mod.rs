//! What steps a flat shard: the optimizer argument of `ShardConfig::init` (`into_optimizer`),
//! any optimizer type-erased and stepped flat or on whole parameters (`any`), a base optimizer
//! with groups of others (`optimizer_groups`),
//! `f32` masters of `bf16`/`f16` buckets (`master`), where the state lives and the update runs
//! (`state_home`: with the parameters, or in host memory as in ZeRO-Offload), parameter groups
//! (`groups`) and loss scaling (`loss_scale`). Knows buckets, not collectives: imports only
//! `model`, `error` and `stage` of this crate.

pub(crate) mod any;
pub(crate) mod groups;
pub(crate) mod into_optimizer;
pub(crate) mod loss_scale;
pub(crate) mod master;
pub(crate) mod optimizer_groups;
pub(crate) mod state_home;
