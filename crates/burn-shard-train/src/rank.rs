//! One rank's training: burn-train's epoch loop with burn-shard's optimizer in place of the
//! Learner's, its items sent to the coordinator.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender};

use burn::data::dataloader::DataLoader;
use burn::data::dataset::DatasetError;
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn::train::{InferenceStep, Interrupter, Learner, LearnerModel, TrainStep};
use burn_shard::checkpoint::SaveOptions;
use burn_shard::comm::Collective;
use burn_shard::{IntoOptimizer, ShardConfig, ShardError, ShardedOptimizer};

use crate::error::RankFailures;
use crate::events::{EpochDecision, RankEvent, Split};
use crate::loss_scale::with_scaling;

/// What a rank sends the coordinator.
pub(crate) type Event<M> = RankEvent<<M as TrainStep>::Output, <M as InferenceStep>::Output>;

/// A `TrainStep` output item's count of items.
pub(crate) type ItemCounter<M> = dyn Fn(&<M as TrainStep>::Output) -> u64 + Send + Sync;

/// The directory of the sharded checkpoint of `epoch` under `root`.
pub(crate) fn epoch_dir(root: &Path, epoch: usize) -> PathBuf {
    root.join(format!("epoch-{epoch}"))
}

/// Everything one rank needs: its device, its share of the data, its copy of the Learner (whose
/// learning-rate scheduler it steps, identically on every rank), and its two channels.
pub(crate) struct RankJob<'a, M: LearnerModel, O> {
    pub rank: usize,
    pub config: &'a ShardConfig,
    pub optim: O,
    pub learner: Learner<M>,
    pub device: Device,
    pub train: std::sync::Arc<dyn DataLoader<<M as TrainStep>::Input>>,
    /// This rank's share of the validation loader (shares may differ by one item).
    pub valid: std::sync::Arc<dyn DataLoader<<M as InferenceStep>::Input>>,
    /// Items of the whole validation loader.
    pub valid_total: usize,
    pub first_epoch: usize,
    pub last_epoch: usize,
    pub grad_accumulation: Option<usize>,
    pub interrupter: Interrupter,
    pub checkpoints: Option<&'a Path>,
    /// Each micro-batch's item count, when the ranks' gradients are weighed by it
    /// (`ShardedStrategy::with_item_count`); `None`: equal weights.
    pub item_count: Option<&'a ItemCounter<M>>,
    pub resume_from: Option<usize>,
    pub events: Sender<Event<M>>,
    pub decisions: Receiver<EpochDecision>,
}

/// A rank's failure, as the coordinator reports it.
pub(crate) type RankError = String;

impl<M: LearnerModel, O: IntoOptimizer + Clone> RankJob<'_, M, O> {
    /// Trains, then returns the model with full parameters (at stage 3 every rank all-gathers
    /// them: a collective). On an error the rank aborts its collective, so no other rank waits
    /// for it, and tells the coordinator.
    pub(crate) fn run(self, comm: Arc<dyn Collective>) -> Result<M, RankError> {
        let (rank, events) = (self.rank, self.events.clone());
        let result = self.train(comm.clone());
        if let Err(message) = &result {
            // Processes of other ranks would otherwise wait in their next collective until its
            // timeout (threads see a dropped peer; NCCL and MPI do not).
            comm.abort(&format!("rank {rank} failed: {message}"));
            let _ = events.send(RankEvent::Failed {
                rank,
                message: message.clone(),
            });
        }
        result
    }

    fn train(self, comm: Arc<dyn Collective>) -> Result<M, RankError> {
        let mut learner = self.learner.clone();
        let model = learner.model().fork(&self.device);
        let (mut model, mut optim) = self
            .config
            .init(model, self.optim.clone(), comm)
            .map_err(|e| format!("ShardConfig::init: {e}"))?;
        let optim = &mut optim;
        self.check_same_data(optim.comm())?;
        let mut global_step = 0;
        if let Some(epoch) = self.resume_from {
            let root = self.checkpoints.ok_or_else(|| {
                format!(
                    "resuming from epoch {epoch} needs the directory of burn-shard's checkpoints: \
                     ShardedStrategy::with_checkpoints(dir, strategy)"
                )
            })?;
            let dir = epoch_dir(root, epoch);
            let (loaded, restored) = optim
                .load_checkpoint(model, &dir)
                .map_err(|e| format!("resuming from {}: {e}", dir.display()))?;
            model = loaded;
            global_step = restored.payload["global_step"].as_u64().ok_or_else(|| {
                format!(
                    "{} was not saved by ShardedStrategy (its payload has no global_step, which the learning-rate \
                     schedule resumes from): resume it with burn-shard's own loop, or start afresh",
                    dir.display()
                )
            })? as usize;
            // The Learner's scheduler can be loaded but not saved (its record is private): a
            // scheduler is a function of its step count, so stepping it as often restores it.
            for _ in 0..global_step {
                learner.lr_step();
            }
        }
        for epoch in self.first_epoch..=self.last_epoch {
            let stopped = self.train_epoch(&mut model, optim, &mut learner, &mut global_step)?;
            self.end(Split::Train, stopped)?;
            if stopped {
                break;
            }
            let stopped = self.valid_epoch(&model, optim)?;
            self.end(Split::Valid, stopped)?;
            let decision = self
                .decisions
                .recv()
                .map_err(|_| "the coordinating thread stopped".to_string())?;
            // Rank 0's decision for every rank: with one process per rank, each process's
            // coordinator read only its own rank's metrics.
            let decision = agree_decision(optim.comm(), decision, &self.device)?;
            self.events
                .send(RankEvent::Decided { stop: decision.stop })
                .map_err(|_| "the coordinating thread stopped".to_string())?;
            for action in decision.checkpoints {
                self.checkpoint(action, &model, optim, epoch, global_step)?;
            }
            if decision.stop {
                break;
            }
        }
        optim
            .wait_for_checkpoint()
            .map_err(|e| format!("the last checkpoint: {e}"))?;
        Ok(model.materialize())
    }

    /// Every rank must run the same number of training batches, see the same validation set
    /// and weigh its gradients alike (a step with item counts adds a collective); with one
    /// process per rank each built its own loaders and strategy, so these are compared first
    /// (one all-gather of three numbers: the training share, the whole validation set, whether
    /// steps count items).
    fn check_same_data(&self, comm: &dyn Collective) -> Result<(), RankError> {
        let (train, valid) = (self.train.num_items(), self.valid_total);
        let counted = self.item_count.is_some();
        let mine = [train as f32, valid as f32, f32::from(u8::from(counted))];
        let all = small_collective(mine.to_vec(), &self.device, "comparing the ranks' data", |t| {
            comm.all_gather(t)
        })?;
        if let Some(other) = all.chunks(3).position(|other| other[2] != mine[2]) {
            let (with, without) = match counted {
                true => (self.rank, other),
                false => (other, self.rank),
            };
            return Err(format!(
                "rank {with} weighs its gradients by item counts (ShardedStrategy::with_item_count) and rank \
                 {without} does not: every process must build the same ShardedStrategy"
            ));
        }
        match all.chunks(3).position(|other| other[..2] != mine[..2]) {
            Some(other) => Err(format!(
                "rank {other}'s data differs from rank {}'s ({train} training items in its share, {valid} validation \
                 items in all): every process must build the same loaders (same data, batch size and shuffle seed)",
                self.rank
            )),
            None => Ok(()),
        }
    }

    fn end(&self, split: Split, stopped: bool) -> Result<(), RankError> {
        self.events
            .send(RankEvent::SplitEnd { split, stopped })
            .map_err(|_| "the coordinating thread stopped".to_string())
    }

    /// One training pass over this rank's share. Returns whether the ranks agreed to stop.
    fn train_epoch(
        &self,
        model: &mut M,
        optim: &mut ShardedOptimizer<O::Optimizer>,
        learner: &mut Learner<M>,
        global_step: &mut usize,
    ) -> Result<bool, RankError> {
        let accumulation = self.grad_accumulation.unwrap_or(1).max(1);
        let mut micro_batches = 0;
        // Items of this step's micro-batches so far (with an item count).
        let mut items = 0u64;
        let mut iterator = self.train.iter();
        loop {
            let (item, failed) = next_item(iterator.next(), &self.interrupter);
            let agreed = agree_stop(optim.comm(), &self.interrupter, failed, item.is_some(), &self.device)?;
            if agreed.stop {
                return Ok(true);
            }
            // Equal shares run out at the same batch; loaders built differently (another batch
            // size in one process) would leave ranks in different collectives: refused.
            if agreed.any_item != agreed.every_item {
                return Err(
                    "the ranks' training shares ran out at different batches: every process must build the same \
                     loaders (same data, batch size and shuffle seed)"
                        .to_string(),
                );
            }
            let Some(item) = item else { return Ok(false) };
            let output = with_scaling(optim.loss_scaling(), || TrainStep::step(model, item));
            let progress = iterator.progress();
            micro_batches += 1;
            if let Some(count) = self.item_count {
                items += count(&output.item);
            }
            // Burn's rule: step after `accumulation` micro-batches, or at the last one.
            if micro_batches == accumulation || progress.is_completed() {
                learner.lr_step();
                let (lr, stepped) = (learner.lr_current(), model.clone());
                *model = match self.item_count {
                    Some(_) => optim.step_with_items(lr, stepped, output.grads, items),
                    None => optim.step(lr, stepped, output.grads),
                }
                .map_err(step_error)?;
                (micro_batches, items) = (0, 0);
                *global_step += 1;
            } else {
                optim.accumulate(model, output.grads).map_err(step_error)?;
            }
            let event = RankEvent::Trained {
                rank: self.rank,
                item: output.item,
                progress,
                lr: learner.lr_current(),
            };
            self.events
                .send(event)
                .map_err(|_| "the coordinating thread stopped".to_string())?;
        }
    }

    /// One validation pass over this rank's share, on every rank, until every rank's share is
    /// done: shares may differ by one item, so one rank may have a batch more. A rank out of
    /// items still agrees at each batch, and where a forward is a collective (stage 3: each
    /// parameter is all-gathered) it runs one on a one-item batch of its share and reports
    /// nothing, so every item counts once. Returns whether the ranks agreed to stop.
    fn valid_epoch(&self, model: &M, optim: &ShardedOptimizer<O::Optimizer>) -> Result<bool, RankError> {
        let model = model.valid();
        let mut iterator = self.valid.iter();
        let mut done = false;
        loop {
            let (item, failed) = match done {
                true => (None, false),
                false => next_item(iterator.next(), &self.interrupter),
            };
            done = item.is_none();
            let agreed = agree_stop(optim.comm(), &self.interrupter, failed, item.is_some(), &self.device)?;
            if agreed.stop {
                return Ok(true);
            }
            if !agreed.any_item {
                break;
            }
            let Some(item) = item else {
                if optim.forward_is_collective() {
                    let pad = match self.valid.slice(0, 1).iter().next() {
                        Some(Ok(pad)) => pad,
                        Some(Err(e)) => {
                            return Err(format!("loading a batch to keep in step with the other ranks: {e}"));
                        }
                        None => return Err("this rank's validation share is empty".to_string()),
                    };
                    drop(InferenceStep::step(&model, pad));
                }
                continue;
            };
            let item = InferenceStep::step(&model, item);
            let event = RankEvent::Validated {
                rank: self.rank,
                item,
                progress: iterator.progress(),
            };
            self.events
                .send(event)
                .map_err(|_| "the coordinating thread stopped".to_string())?;
        }
        // A stage-3 gather outside `step` records its error instead of returning it.
        optim.check_collectives().map_err(step_error)?;
        Ok(false)
    }

    fn checkpoint(
        &self,
        action: burn::train::checkpoint::CheckpointingAction,
        model: &M,
        optim: &ShardedOptimizer<O::Optimizer>,
        epoch: usize,
        global_step: usize,
    ) -> Result<(), RankError> {
        use burn::train::checkpoint::CheckpointingAction;
        let Some(root) = self.checkpoints else { return Ok(()) };
        match action {
            CheckpointingAction::Save => {
                let dir = epoch_dir(root, epoch);
                let payload = serde_json::json!({ "epoch": epoch, "global_step": global_step });
                // In the background: the next epoch trains while the files are written (the
                // next save, a load and the end of the run wait for it).
                optim
                    .save_checkpoint(model, &dir, SaveOptions::new(payload).in_background())
                    .map_err(|e| format!("saving the checkpoint of epoch {epoch} into {}: {e}", dir.display()))
            }
            // A checkpoint still being written completes first (every rank: settling is a
            // collective, and every rank holds the same saves), or it would be renamed into
            // place after the delete. Then one rank removes; one already gone is what was asked.
            CheckpointingAction::Delete(old)
                if optim.report().checkpoints_in_flight().contains(&epoch_dir(root, old)) =>
            {
                optim
                    .wait_for_checkpoint()
                    .map_err(|e| format!("the checkpoint of epoch {old}, before deleting it: {e}"))?;
                self.checkpoint(CheckpointingAction::Delete(old), model, optim, epoch, global_step)
            }
            // One already gone is what was asked; the marker goes first (`checkpoint::remove`), so
            // a delete cut short leaves no half checkpoint that counts as one.
            CheckpointingAction::Delete(old) if self.rank == 0 => {
                let dir = epoch_dir(root, old);
                match dir.exists() {
                    false => Ok(()),
                    true => burn_shard::checkpoint::remove(&dir)
                        .map_err(|e| format!("removing the checkpoint of epoch {old} from {}: {e}", root.display())),
                }
            }
            CheckpointingAction::Delete(_) => Ok(()),
        }
    }
}

/// The next batch, or `None` at the end of the share; a data error goes to the interrupter (so
/// the run reports it) and comes back as `true`, for every rank to stop at this step.
fn next_item<I>(next: Option<Result<I, DatasetError>>, interrupter: &Interrupter) -> (Option<I>, bool) {
    match next {
        Some(Ok(item)) => (Some(item), false),
        Some(Err(e)) => {
            interrupter.fail(e);
            (None, true)
        }
        None => (None, false),
    }
}

fn step_error(e: ShardError) -> RankError {
    e.to_string()
}

/// Rank 0's `decision`, broadcast to every rank: `[stop, actions, (kind, epoch) per action]`
/// (kind 1: save, 2: delete), at most [`MAX_ACTIONS`] actions.
fn agree_decision(comm: &dyn Collective, decision: EpochDecision, device: &Device) -> Result<EpochDecision, RankError> {
    use burn::train::checkpoint::CheckpointingAction;
    if decision.checkpoints.len() > MAX_ACTIONS {
        return Err(format!(
            "the checkpointing strategy asked for {} actions at one epoch; ShardedStrategy takes at most {MAX_ACTIONS}",
            decision.checkpoints.len()
        ));
    }
    let mut encoded = vec![0.0f32; 2 + 2 * MAX_ACTIONS];
    encoded[0] = if decision.stop { 1.0 } else { 0.0 };
    encoded[1] = decision.checkpoints.len() as f32;
    for (i, action) in decision.checkpoints.iter().enumerate() {
        let (kind, epoch) = match action {
            CheckpointingAction::Save => (1.0, 0),
            CheckpointingAction::Delete(epoch) => (2.0, *epoch),
        };
        encoded[2 + 2 * i] = kind;
        // Epochs are exact in f32 up to 2^24.
        encoded[3 + 2 * i] = epoch as f32;
    }
    let agreed = small_collective(encoded, device, "agreeing on the decisions of the epoch's end", |t| {
        comm.broadcast(t, 0)
    })?;
    let actions = agreed[1] as usize;
    Ok(EpochDecision {
        stop: agreed[0] > 0.0,
        checkpoints: (0..actions)
            .map(|i| match agreed[2 + 2 * i] < 1.5 {
                true => CheckpointingAction::Save,
                false => CheckpointingAction::Delete(agreed[3 + 2 * i] as usize),
            })
            .collect(),
    })
}

/// The most checkpoint actions one epoch's end may take (burn-train's strategies take at most
/// two: a save and a delete, or one per composed strategy).
const MAX_ACTIONS: usize = 8;

/// What the ranks agreed at one batch.
struct Agreed {
    /// Some rank wants to stop: an interrupt, or a failure.
    stop: bool,
    /// Some rank has an item for this batch.
    any_item: bool,
    /// Every rank has an item for this batch.
    every_item: bool,
}

/// Whether any rank wants to stop (an interrupt, or a failure such as a data error) and
/// whether any rank has an item (`has_item` here). One all-gather of two elements per rank, so
/// every rank leaves the pass at the same batch and no collective is left waiting. A rank whose
/// own `interrupter` has not seen the cause (one process per rank) records it there, so its
/// `LearningResult` reports the stop or the failure.
fn agree_stop(
    comm: &dyn Collective,
    interrupter: &Interrupter,
    failed: bool,
    has_item: bool,
    device: &Device,
) -> Result<Agreed, RankError> {
    const NONE: f32 = 0.0;
    const STOP: f32 = 1.0;
    const FAILURE: f32 = 2.0;
    let local = match (failed || interrupter.error().is_some(), interrupter.should_stop()) {
        (true, _) => FAILURE,
        (false, true) => STOP,
        (false, false) => NONE,
    };
    let has = if has_item { 1.0 } else { 0.0 };
    let agreed = small_collective(vec![local, has], device, "agreeing whether to stop", |t| {
        comm.all_gather(t)
    })?;
    let kinds: Vec<f32> = agreed.iter().step_by(2).copied().collect();
    let any_item = agreed.iter().skip(1).step_by(2).any(|h| *h > 0.0);
    let every_item = agreed.iter().skip(1).step_by(2).all(|h| *h > 0.0);
    if let Some(rank) = kinds.iter().position(|k| *k == FAILURE)
        && interrupter.error().is_none()
    {
        interrupter.fail(RankFailures(vec![(
            rank,
            "failed (its own result names the error); this rank stopped with it".to_string(),
        )]));
    } else if let Some(rank) = kinds.iter().position(|k| *k == STOP)
        && !interrupter.should_stop()
    {
        interrupter.stop(Some(&format!("stopped by rank {rank}")));
    }
    Ok(Agreed {
        stop: kinds.iter().any(|k| *k != NONE),
        any_item,
        every_item,
    })
}

/// Runs `collective` on `values` (`f32`, on `device` without autodiff: the device's default
/// float type may be `f16`, which would round epochs and counts) and reads the result back to
/// the host. `what` names the step in the error.
fn small_collective(
    values: Vec<f32>,
    device: &Device,
    what: &str,
    collective: impl FnOnce(Tensor<1>) -> Result<Tensor<1>, burn_shard::comm::CommError>,
) -> Result<Vec<f32>, RankError> {
    let device = device.clone().without_autodiff();
    let len = values.len();
    let tensor = Tensor::<1>::from_data(TensorData::new(values, [len]), (&device, DType::F32));
    collective(tensor)
        .map_err(|e| format!("{what}: {e}"))?
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| format!("{what}: reading the result: {e:?}"))
}
