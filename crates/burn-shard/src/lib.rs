//! ZeRO sharded data-parallel training for Burn.
//!
//! One call turns it on: [`ShardConfig::init`] takes a Burn model, an optimizer (Burn's
//! `AdamWConfig`/`AdamConfig` for the fused Adam step, or a built element-wise Burn optimizer
//! such as `Sgd`; see [`IntoOptimizer`]) and this rank's
//! [`Collective`](burn_shard_comm::Collective), and returns the model (parameters synchronised
//! from rank 0) and a [`ShardedOptimizer`] whose `step` replaces `ModuleOptimizer::step`.
//!
//! | stage | gradients | optimizer state | parameters | collectives per step |
//! |---|---|---|---|---|
//! | 0 (DDP) | all-reduced, full | full | full | all-reduce |
//! | 1 | all-reduced, full | sharded | full | all-reduce + all-gather |
//! | 2 | reduce-scattered, sharded | sharded | full | reduce-scatter + all-gather |
//! | 3 (FSDP) | reduce-scattered in backward | sharded | sharded, gathered per use | all-gather (forward, backward) + reduce-scatter |
//!
//! Stages 0-2: the parameters that require grad are packed, in module traversal order, into flat
//! buckets ([`FlatLayout`]); rank `r` owns elements `[r·L/N, (r+1)·L/N)` of each padded bucket
//! of length `L`. Burn's own optimizer steps each parameter's piece of this rank's range with
//! that parameter's state, so its update math is reused.
//! From the second step on, each bucket's reduction starts inside backward as soon as its
//! gradients are complete, where the collective overlaps with compute: see [`bucket`].
//! Stage 3: see [`fsdp`].
//! Where the optimizer state and stage-3 shards live: one [`Placement`] policy, [`Home::Device`]
//! (the default), [`Home::Host`] (ZeRO-Offload; parameter offload to CPU) or [`Home::Disk`]
//! (ZeRO-Infinity's NVMe offload, settings in [`NvmeOffload`]), set with
//! [`ShardConfig::with_optimizer_state_on`] and [`ShardConfig::with_params_on`].
//! Which stage fits: [`estimate`] (the ZeRO paper's per-rank formulas, and the same figures
//! measured on a built model).
//!
//! What each kind of float entry gets, at every stage:
//! - a parameter has its own optimizer state (Adam's step count and moments, the `f32` master
//!   of a `bf16`/`f16` parameter), so a parameter that receives no gradient in a step keeps its
//!   value and its state, exactly as with Burn's `ModuleOptimizer`;
//! - running-state buffers (BatchNorm's running mean and variance) are never sharded and, at
//!   the end of every step, become their mean over the ranks (see `model/buffers.rs`);
//! - a parameter that already carries a reparameterization (LoRA's frozen base) is trained at
//!   stages 0-2 and kept whole at stage 3, where its adapters are sharded;
//! - empty parameters are left as they are.

// Layers, bottom to top; each imports only the ones above it in this list (checked by the test
// suite's `architecture` module): error, run, stage, backend < model < optim < swap < overlap <
// fsdp < bucket < checkpoint < step < sharded_optimizer < config < init < estimate. `fsdp` (stage 3)
// and `bucket` (stages 0-2's reductions inside backward) are each one subsystem in one folder,
// their module docs the public pages that say how they work.
mod backend;
mod error;
mod run;
mod stage;

mod model;
mod optim;

mod swap;

mod overlap;

pub mod fsdp;

pub mod bucket;

pub mod checkpoint;
mod step;

mod sharded_optimizer;

mod config;
pub mod estimate;
mod init;

pub use config::{CheckpointConfig, Home, MeshConfig, Placement, ShardConfig, Stage3Config};
pub use error::ShardError;
pub use model::layout::{Bucket, FlatLayout, ParamSlot};
pub use model::memory::MemoryReport;
pub use model::pretrained::Pretrained;
pub use optim::any::{AnyOptimizer, AnyState};
pub use optim::into_optimizer::{ElementWise, IntoOptimizer, OptimizerGroup};
pub use optim::loss_scale::{LossScaler, LossScaling};
pub use optim::master::MasterWeightStep;
pub use optim::optimizer_groups::OptimizerGroups;
pub use run::FrozenEntries;
pub use sharded_optimizer::optimizer::ShardedOptimizer;
pub use sharded_optimizer::reports::RankReport;
pub use stage::Stage;
pub use swap::config::NvmeOffload;

pub use burn_shard_comm as comm;
pub use burn_shard_comm::{Mesh, MeshLayout};
pub use burn_shard_kernels as kernels;
