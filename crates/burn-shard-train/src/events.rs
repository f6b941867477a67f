//! What ranks tell the coordinating thread, and what it answers.
//!
//! burn-train's event processor (metrics, the renderer, the event store that early stopping and
//! checkpointing read) is one object that cannot be shared between threads that train, so one
//! thread, the caller of `fit`, owns it and every rank sends it its items. The logged metrics
//! are then over the items of every rank: the global loss and accuracy of each step.

use burn::data::dataloader::Progress;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::train::checkpoint::CheckpointingAction;

/// Which of an epoch's two passes an event belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Split {
    Train,
    Valid,
}

/// A message from a rank to the coordinator.
pub(crate) enum RankEvent<T, V> {
    /// One training batch done: the rank, its output item, the rank's progress through its
    /// share, and the learning rate of the step it belongs to.
    Trained {
        rank: usize,
        item: T,
        progress: Progress,
        lr: ModuleLearningRate,
    },
    /// One validation batch done by `rank`.
    Validated { rank: usize, item: V, progress: Progress },
    /// The rank finished a pass; `stopped`: the ranks agreed to stop inside it (the same on
    /// every rank, see `agree_stop`).
    SplitEnd { split: Split, stopped: bool },
    /// The rank took the epoch's decision agreed with rank 0 (`stop`: training ends here).
    Decided { stop: bool },
    /// The rank failed; it has aborted its collective, so the others fail too, within their
    /// timeout, instead of waiting for it.
    Failed { rank: usize, message: String },
}

/// The coordinator's answer at the end of an epoch, the same to every rank: what to do with
/// checkpoints (burn-train's `CheckpointingStrategy` decided it from the event store) and
/// whether to stop (an interrupt, or early stopping).
#[derive(Clone, Debug)]
pub(crate) struct EpochDecision {
    pub checkpoints: Vec<CheckpointingAction>,
    pub stop: bool,
}
