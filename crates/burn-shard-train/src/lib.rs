//! burn-shard in burn-train's `Learner`: [`ShardedStrategy`] trains a model with ZeRO stages
//! 0-3 inside `SupervisedTraining`, with the user's metrics, renderer, learning-rate
//! scheduler, gradient accumulation, early stopping and checkpointing strategy; ranks as
//! threads of one process, or one process per rank (`burn-shard-run`, `mpirun`).
//!
//! burn-train's API changes at every minor release; this crate is the one place that follows
//! it (burn-train 0.22.1). The sharding itself is [`burn_shard`]'s.
//!
//! Files: `strategy.rs` (the public type and `fit`), `coordinator.rs` (the calling thread:
//! events, metrics, the decisions of an epoch's end), `rank.rs` (one rank's epoch loop),
//! `events.rs` (their messages), `item_count.rs` (how a step weighs the ranks' gradients), `error.rs` (failed ranks), `data.rs` (each rank's share of a data loader),
//! `loss_scale.rs` ([`scale_loss`] for a `TrainStep`), `renderer.rs` ([`LineRenderer`]: metrics as plain
//! lines when the output is not a terminal).

mod coordinator;
mod data;
mod error;
mod events;
mod item_count;
mod loss_scale;
mod rank;
mod renderer;
mod strategy;

pub use error::RankFailures;
pub use item_count::{EqualShares, ItemCount};
pub use loss_scale::scale_loss;
pub use renderer::LineRenderer;
pub use strategy::ShardedStrategy;
