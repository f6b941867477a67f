//! The thread that called `fit`: it owns burn-train's event processor, processes every rank's
//! items, and takes the decisions of an epoch's end (checkpoints, early stopping, interrupts)
//! once for every rank.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::mpsc::{Receiver, Sender};

use burn::data::dataloader::Progress;
use burn::train::checkpoint::CheckpointingStrategy;
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    CloneEarlyStoppingStrategy, EventProcessorTraining, Interrupter, LearnerEvent, LearnerModel,
    SupervisedTrainingEventProcessor, TrainingItem,
};

use crate::events::{EpochDecision, RankEvent, Split};
use crate::rank::Event;

/// What the coordinator holds for the run.
pub(crate) struct Coordinator<'a, M: LearnerModel> {
    /// The ranks of this process (all of them for threads, one for a process).
    pub ranks: usize,
    pub processor: SupervisedTrainingEventProcessor<M>,
    pub interrupter: Interrupter,
    pub event_store: &'a EventStoreClient,
    pub early_stopping: Option<Box<dyn CloneEarlyStoppingStrategy>>,
    pub checkpointing: Option<&'a Mutex<Box<dyn CheckpointingStrategy>>>,
    /// Items per epoch over this process's ranks (what is trained on: the remainder dropped).
    pub train_items: usize,
    pub valid_items: usize,
    /// Ranks that failed, with their messages.
    pub failures: Vec<(usize, String)>,
}

impl<M: LearnerModel> Coordinator<'_, M> {
    /// Runs epochs `first..=last` as burn-train's single-device strategy does, with items from
    /// every rank. Returns when training ends or a rank fails; dropping `decisions` then tells
    /// ranks waiting for a decision that there is none.
    pub(crate) fn run(
        &mut self,
        first: usize,
        last: usize,
        events: &Receiver<Event<M>>,
        decisions: Vec<Sender<EpochDecision>>,
    ) {
        for epoch in first..=last {
            let interrupter = self.interrupter.clone();
            interrupter.fail_on_error(self.processor.process_train(LearnerEvent::StartSplit {
                epoch_number: epoch,
                total_items: self.train_items,
            }));
            let Some(stopped) = self.pass(Split::Train, events) else {
                return;
            };
            interrupter.fail_on_error(self.processor.process_train(LearnerEvent::EndSplit(epoch)));
            if stopped {
                if let Some(interruption) = interrupter.interruption() {
                    let reason = interruption.reason.as_deref().unwrap_or("reason unknown");
                    tracing::info!("training interrupted: {reason}");
                }
                return;
            }
            interrupter.fail_on_error(self.processor.process_valid(LearnerEvent::StartSplit {
                epoch_number: epoch,
                total_items: self.valid_items,
            }));
            let Some(stopped) = self.pass(Split::Valid, events) else {
                return;
            };
            interrupter.fail_on_error(self.processor.process_valid(LearnerEvent::EndSplit(epoch)));
            interrupter.fail_on_error(self.processor.process_train(LearnerEvent::EndEpoch(epoch)));
            if self.checkpointing.is_some() || self.early_stopping.is_some() {
                // Both read the event store: it must hold this epoch's metrics.
                interrupter.fail_on_error(self.processor.flush());
            }
            let decision = self.decide(epoch, stopped || interrupter.should_stop());
            for sender in &decisions {
                // A rank that is gone has failed; its failure arrives as an event.
                let _ = sender.send(decision.clone());
            }
            // The ranks take rank 0's decision (another process's, with one process per rank).
            match self.agreed(events) {
                Some(false) => {}
                Some(true) | None => return,
            }
        }
    }

    /// The end of an epoch, in burn-train's order: an interrupt stops before checkpointing; else
    /// the checkpointing strategy acts, then early stopping may stop.
    fn decide(&mut self, epoch: usize, interrupted: bool) -> EpochDecision {
        if interrupted {
            return EpochDecision {
                checkpoints: Vec::new(),
                stop: true,
            };
        }
        let checkpoints = match self.checkpointing {
            Some(strategy) => strategy
                .lock()
                .expect("a checkpointing strategy panicked")
                .checkpointing(epoch, self.event_store),
            None => Vec::new(),
        };
        let stop = self
            .early_stopping
            .as_mut()
            .is_some_and(|early| early.should_stop(epoch, self.event_store));
        EpochDecision { checkpoints, stop }
    }

    /// Whether the ranks agreed to stop after the epoch's decision, or `None` when a rank failed.
    fn agreed(&mut self, events: &Receiver<Event<M>>) -> Option<bool> {
        let mut stop = None;
        for _ in 0..self.ranks {
            match events.recv() {
                Ok(RankEvent::Decided { stop: rank_stop }) => stop = Some(rank_stop),
                Ok(RankEvent::Failed { rank, message }) => {
                    self.failures.push((rank, message));
                    return None;
                }
                Ok(_) => unreachable!("a rank sends nothing between its pass's end and its decision"),
                Err(_) => {
                    self.failures
                        .push((0, "every rank stopped before agreeing on the epoch's end".into()));
                    return None;
                }
            }
        }
        stop
    }

    /// Processes one pass's items until every rank has ended it. Returns whether the ranks
    /// stopped inside it, or `None` when a rank failed (the failure is recorded).
    ///
    /// Each rank's item goes through the metrics (the loss and accuracy are over every rank's
    /// batches), so the renderer hears of each of a step's batches; the progress each carries
    /// counts every item once: the items the ranks have reported so far in this pass, summed,
    /// out of the pass's items (not a rank's progress times the ranks, which rendered each
    /// step's count once per rank). The iteration is the step: the rank's batches so far in
    /// the pass, the same on every rank at a step.
    fn pass(&mut self, split: Split, events: &Receiver<Event<M>>) -> Option<bool> {
        let total = match split {
            Split::Train => self.train_items,
            Split::Valid => self.valid_items,
        };
        let mut counted = PassCount::default();
        let mut ended = 0;
        let mut stopped = false;
        while ended < self.ranks {
            let Ok(event) = events.recv() else {
                self.failures
                    .push((0, "every rank stopped without ending the pass".into()));
                return None;
            };
            match event {
                RankEvent::Trained {
                    rank,
                    item,
                    progress,
                    lr,
                } => {
                    let (progress, iteration) = counted.add(rank, &progress, total);
                    let item = TrainingItem::new(item, progress, Some(iteration), Some(lr));
                    self.interrupter
                        .fail_on_error(self.processor.process_train(LearnerEvent::ProcessedItem(item)));
                }
                RankEvent::Validated { rank, item, progress } => {
                    let (progress, iteration) = counted.add(rank, &progress, total);
                    let item = TrainingItem::new(item, progress, Some(iteration), None);
                    self.interrupter
                        .fail_on_error(self.processor.process_valid(LearnerEvent::ProcessedItem(item)));
                }
                RankEvent::SplitEnd {
                    split: ended_split,
                    stopped: rank_stopped,
                    ..
                } => {
                    debug_assert_eq!(ended_split, split, "ranks end passes in order");
                    ended += 1;
                    stopped |= rank_stopped;
                }
                RankEvent::Failed { rank, message } => {
                    self.failures.push((rank, message));
                    return None;
                }
                RankEvent::Decided { .. } => unreachable!("decisions come after both passes"),
            }
        }
        Some(stopped)
    }
}

/// What the ranks of this process have reported in one pass: per rank, its items and batches.
#[derive(Default)]
struct PassCount {
    ranks: HashMap<usize, (usize, usize)>,
}

impl PassCount {
    /// Records `rank`'s batch with the rank's `progress` through its share; returns the
    /// progress through the pass (every rank's items so far, summed, out of `total`) and the
    /// rank's batches so far in the pass.
    fn add(&mut self, rank: usize, progress: &Progress, total: usize) -> (Progress, usize) {
        let slot = self.ranks.entry(rank).or_default();
        slot.0 = progress.items_processed;
        slot.1 += 1;
        let batches = slot.1;
        let items = self.ranks.values().map(|(items, _)| items).sum();
        (
            Progress {
                items_processed: items,
                items_total: total,
                unit: progress.unit.clone(),
            },
            batches,
        )
    }
}
