//! `ShardedStrategy`: burn-shard as a burn-train training strategy.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, mpsc};
use std::thread;

use burn::tensor::Device;
use burn::train::checkpoint::CheckpointingStrategy;
use burn::train::{
    LearnerModel, SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader, TrainStep,
    TrainingComponents, TrainingStrategy, ValidLoader,
};
use burn_shard::comm::{Collective, InProcessGroup};
use burn_shard::{IntoOptimizer, ShardConfig};

use crate::coordinator::Coordinator;
use crate::data::{equal_share, whole_share};
use crate::error::RankFailures;
use crate::item_count::{EqualShares, ItemCount};
use crate::rank::RankJob;

/// Sharded data-parallel training (ZeRO stages 0-3) inside burn-train's `SupervisedTraining`:
/// the ranks as threads of this process, one per device ([`ShardedStrategy::threads`],
/// burn-shard's in-process collectives), or this process as one rank of a group of processes
/// ([`ShardedStrategy::process`], NCCL or MPI).
///
/// ```ignore
/// let result = SupervisedTraining::new(dir, train, valid)
///     .metrics((LossMetric::new(), AccuracyMetric::new()))
///     .num_epochs(3)
///     .with_training_strategy(
///         ShardedStrategy::threads(ShardConfig::new(Stage::Three), AdamWConfig::new(), devices).into(),
///     )
///     .launch(Learner::new(model, AdamWConfig::new().init(), 1e-3));
/// ```
///
/// What changes against burn-train's own strategies, and why:
/// - **The optimizer** is burn-shard's [`burn_shard::ShardedOptimizer`] built from `optim`
///   (Burn's `AdamConfig`/`AdamWConfig` become the fused Adam step); the `ModuleOptimizer`
///   given to `Learner::new` is not used (the Learner keeps it private). The Learner's
///   learning-rate scheduler is used, stepped once per optimizer step on every rank.
/// - **Data**: each rank trains on an equal, contiguous share of the training loader (rank `r`
///   of `n` reads items `[r·k, (r+1)·k)`, `k = num_items / n`; the last `num_items % n` items
///   are dropped, with a warning, as `DistributedSampler(drop_last=True)` does): every step is
///   a collective. Validation counts every item exactly once: rank `r` reads items
///   `[⌊r·N/n⌋, ⌊(r+1)·N/n⌋)` of the `N`, so the validation metrics equal one device's at every
///   world size; a rank whose share ends a batch early waits for the others (at stage 3 it runs
///   the forward of a one-item batch whose outputs it drops, since every forward all-gathers).
///   A step trains on the union of one batch per rank, so the global batch is
///   `world_size` times the loader's batch size; gradients are averaged over the ranks. A
///   loader's `shuffle` permutes within each share, so a data set stored in order (sorted by
///   label, say) should be shuffled as a whole first (Burn's `ShuffledDataset`).
/// - **Metrics** are processed by the calling thread for the items of every rank of this
///   process: with threads, the logged loss and accuracy are the global ones. The renderer
///   hears of every rank's batch (burn-train's metrics take one item at a time), with the
///   progress counting each item once (every rank's items so far, summed: an epoch ends at the
///   data set's size) and the iteration being the step; with one process per rank, each
///   process logs its own rank's (see [`ShardedStrategy::process`]). Without a terminal,
///   [`crate::LineRenderer`] prints a short line every so many items instead of burn-train's
///   line per batch.
/// - **Stopping**: an interrupt (the `Interrupter`, a data error, a failed event processor) on
///   any rank is agreed by every rank at the next batch (one all-gather of one element per
///   batch, which also waits for the batch before), and early stopping and the checkpointing
///   strategy are decided at the epoch's end by rank 0 for every rank (one broadcast per
///   epoch).
/// - **Failures**: a rank that fails aborts its collective, so every other rank fails at its
///   next collective instead of waiting; `LearningResult::error` then holds
///   [`crate::RankFailures`] (see there why as `TrainingError::Dataset`), naming the ranks and
///   their messages. Refused before training: `with_file_checkpointer` (below), fewer items than
///   ranks, processes whose loaders differ in size.
/// - **Checkpoints** are burn-shard's sharded checkpoints
///   ([`ShardedStrategy::with_checkpoints`]), kept or deleted by a burn-train
///   `CheckpointingStrategy`; `SupervisedTraining::with_file_checkpointer` is refused (it
///   would save stage 3's placeholders). `SupervisedTraining::checkpoint(epoch)` resumes from
///   the sharded checkpoint of that epoch, at any world size and stage (at another world size
///   the global batch, and so what a step-based scheduler's step means, changes with it).
/// - **Devices**: each is made an autodiff device if it is not one.
///   `SupervisedTraining::gradient_checkpointing` applies to burn-train's own strategies only:
///   pass devices built with `device.autodiff().gradient_checkpointing()` for it.
/// - **The returned model** has full parameters (at stage 3 they are all-gathered at the end),
///   on the device of this process's first rank, as a model trained by burn-train's
///   single-device strategy. The model given to `Learner::new` is moved to host memory
///   (Burn's Flex device) for the run, so a stage-3 run does not keep it on the GPU.
///
/// `C` is how a step weighs the ranks' gradients: [`EqualShares`] (the default) or the item
/// count given to [`ShardedStrategy::with_item_count`].
pub struct ShardedStrategy<O, C = EqualShares> {
    config: ShardConfig,
    optim: O,
    ranks: Ranks,
    checkpoints: Option<(PathBuf, Mutex<Box<dyn CheckpointingStrategy>>)>,
    item_count: C,
}

/// One rank of this process: its number, its collective, its device.
type LocalRank = (usize, Arc<dyn Collective>, Device);

/// Where the ranks are.
enum Ranks {
    /// Every rank, as a thread of this process, one per device.
    Threads(Vec<Device>),
    /// This process is one rank of a group that `comm` reaches (NCCL, MPI).
    Process { comm: Arc<dyn Collective>, device: Device },
}

impl<O> ShardedStrategy<O> {
    /// One rank per device of `devices`, as threads of this process: `world_size =
    /// devices.len()`. A device may appear more than once (several ranks on one GPU, or the
    /// CPU). The devices get autodiff (and Burn's gradient checkpointing, when the device given
    /// has it) as burn-train's single-device strategy gives them.
    pub fn threads(config: ShardConfig, optim: O, devices: Vec<Device>) -> Self {
        Self {
            config,
            optim,
            ranks: Ranks::Threads(devices),
            checkpoints: None,
            item_count: EqualShares,
        }
    }

    /// This process is rank `comm.rank()` of `comm.world_size()`, on `device`: one process per
    /// rank, started by `burn-shard-run` (NCCL: `burn_shard::comm::NcclComm`) or `mpirun`
    /// (`burn_shard::comm::MpiComm`), each building the same `SupervisedTraining` and calling
    /// `launch`. Each process trains on its rank's share of the loaders, so every process must
    /// build the same loaders (same data, same shuffle seed).
    ///
    /// Metrics: each process's event processor sees its own rank's items only (burn-train's
    /// items are the user's types, which cannot cross processes): rank 0 logs and renders the
    /// metrics of its share of each batch; give the other ranks another directory, or a
    /// `.renderer(..)` and metric loggers that drop what they get. Decisions do agree: an
    /// interrupt on any rank stops every rank at the next batch, and rank 0's early stopping
    /// and checkpointing strategy decide for every rank at each epoch's end.
    pub fn process(config: ShardConfig, optim: O, comm: impl Collective + 'static, device: Device) -> Self {
        Self {
            config,
            optim,
            ranks: Ranks::Process {
                comm: Arc::new(comm),
                device,
            },
            checkpoints: None,
            item_count: EqualShares,
        }
    }
}

impl<O, C> ShardedStrategy<O, C> {
    /// Weighs each rank's gradient by its item count, for ranks whose batches hold different
    /// numbers of items: a token-mean loss over padded sequences, a loss that skips masked or
    /// ignored targets. burn-train's data shares give every rank as many *samples*, so the
    /// default (equal weights: the mean of the ranks' mean losses) is exact only when every
    /// rank's loss is a mean over as many items; with other counts it is another gradient than
    /// one device's on the global batch.
    ///
    /// With `count`, each step is `ShardedOptimizer::step_with_items`: the `TrainStep`'s
    /// gradients must be those of the **sum** of its per-item losses (`backward` on the sum; the
    /// output item may keep the mean for the metrics), and `count(&item)` the number of items
    /// (samples, or tokens) that sum covers, read from the `TrainStep`'s output item. The
    /// counts of a step's micro-batches (with `grads_accumulation`) are added, every rank's
    /// counts are added (one all-reduce of 8 bytes per step), and the summed gradients divided
    /// by the total: the gradient of the mean loss over every item of the global batch, as one
    /// device computes it. A step whose items total 0 on every rank fails the run (there is no
    /// mean to take).
    ///
    /// For a classifier whose padded targets hold `PAD`:
    /// `.with_item_count(|item: &ClassificationOutput| item.targets.clone().not_equal_elem(PAD).int().sum().into_scalar::<i64>() as u64)`
    /// (one read of a scalar per micro-batch; a count the batch already holds on the host is cheaper).
    pub fn with_item_count<T, F: Fn(&T) -> u64 + Send + Sync + 'static>(self, count: F) -> ShardedStrategy<O, F> {
        ShardedStrategy {
            config: self.config,
            optim: self.optim,
            ranks: self.ranks,
            checkpoints: self.checkpoints,
            item_count: count,
        }
    }

    /// Saves burn-shard's sharded checkpoints into `dir/epoch-N/` at the epochs `strategy`
    /// (burn-train's, e.g. `KeepLastNCheckpoints` or a `ComposedCheckpointingStrategy`) says,
    /// and deletes those it says. Every rank writes its own shard, so with one process per rank
    /// `dir` must be on a file system every rank sees (rank 0 deletes). `burn-shard ckpt
    /// consolidate` turns one into one ordinary Burn record. A save never overwrites: a fresh
    /// run into a `dir` that already holds `epoch-N/` fails at that epoch's end with
    /// burn-shard's `CheckpointError::Exists`, on every rank (use a new directory, or resume
    /// with `SupervisedTraining::checkpoint`); a failed save or delete ends the run with
    /// [`crate::RankFailures`]. Saves are written in the background
    /// (`save_checkpoint` with `SaveOptions::in_background`): the next epoch trains meanwhile; the next save and the end of
    /// the run wait for the previous one, and a failed background write ends the run there.
    pub fn with_checkpoints(mut self, dir: impl Into<PathBuf>, strategy: impl CheckpointingStrategy + 'static) -> Self {
        self.checkpoints = Some((dir.into(), Mutex::new(Box::new(strategy))));
        self
    }

    /// The world size: one rank per device (threads), or the group's size (processes).
    pub fn world_size(&self) -> usize {
        match &self.ranks {
            Ranks::Threads(devices) => devices.len(),
            Ranks::Process { comm, .. } => comm.world_size(),
        }
    }

    /// This process's ranks: `(rank, collective, device)` each, the collectives built for
    /// threads, the one given for a process.
    fn local_ranks(&self) -> Result<Vec<LocalRank>, String> {
        match &self.ranks {
            Ranks::Threads(devices) => {
                let group =
                    InProcessGroup::new(devices.len()).map_err(|e| format!("building the in-process group: {e}"))?;
                Ok(group
                    .into_comms()
                    .into_iter()
                    .zip(devices)
                    .enumerate()
                    .map(|(rank, (comm, device))| (rank, Arc::new(comm) as Arc<dyn Collective>, device.clone()))
                    .collect())
            }
            Ranks::Process { comm, device } => Ok(vec![(comm.rank(), comm.clone(), device.clone())]),
        }
    }
}

impl<M, O, C> From<ShardedStrategy<O, C>> for TrainingStrategy<M>
where
    M: LearnerModel,
    O: IntoOptimizer + Clone + Send + Sync + 'static,
    C: ItemCount<<M as TrainStep>::Output>,
{
    fn from(strategy: ShardedStrategy<O, C>) -> Self {
        TrainingStrategy::Custom(Arc::new(strategy))
    }
}

impl<O, C> ShardedStrategy<O, C> {
    /// Refuses the run before training: `interrupter` reports `message`, and with one process
    /// per rank the group is aborted, so the other processes do not wait for this one.
    fn refuse(&self, interrupter: &burn::train::Interrupter, message: String) {
        let rank = match &self.ranks {
            Ranks::Process { comm, .. } => {
                comm.abort(&format!("rank {} refused the run: {message}", comm.rank()));
                comm.rank()
            }
            // No rank has started: nothing waits.
            Ranks::Threads(_) => 0,
        };
        interrupter.fail(RankFailures(vec![(rank, message)]));
    }
}

impl<M, O, C> SupervisedLearningStrategy<M> for ShardedStrategy<O, C>
where
    M: LearnerModel,
    O: IntoOptimizer + Clone + Send + Sync + 'static,
    C: ItemCount<<M as TrainStep>::Output>,
{
    fn fit(
        &self,
        components: TrainingComponents<M>,
        learner: burn::train::Learner<M>,
        train: TrainLoader<M>,
        valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let interrupter = components.interrupter.clone();
        let processor = components.event_processor;
        // Every rank forks its own copy; the one kept here (for the error paths and the ranks'
        // clones of the Learner) stays off the accelerator.
        let mut learner = learner;
        learner.fork(&Device::flex().autodiff());
        if components.checkpointer.is_some() {
            self.refuse(
                &interrupter,
                "a file checkpointer would save the Learner's model and optimizer, which at stage 3 hold \
                 placeholders: remove `with_file_checkpointer` and use `ShardedStrategy::with_checkpoints(dir, \
                 strategy)`, which saves burn-shard's sharded checkpoints"
                    .into(),
            );
            return (learner.model(), processor);
        }
        let world_size = self.world_size();
        let valid_total = valid.num_items();
        if world_size == 0 || train.num_items() < world_size || valid.num_items() < world_size {
            self.refuse(
                &interrupter,
                format!(
                    "ShardedStrategy needs at least one rank, and at least one item per rank in the training ({}) and \
                 validation ({}) data; it has {world_size} ranks",
                    train.num_items(),
                    valid.num_items()
                ),
            );
            return (learner.model(), processor);
        }
        let local = match self.local_ranks() {
            Ok(local) => local,
            Err(message) => {
                self.refuse(&interrupter, message);
                return (learner.model(), processor);
            }
        };
        let local: Vec<_> = local
            .into_iter()
            .map(|(rank, comm, device)| {
                let train_device = if device.is_autodiff() {
                    device
                } else {
                    device.autodiff()
                };
                let train_share = equal_share(&train, rank, world_size, &train_device, "training");
                let valid_device = train_device.clone().without_autodiff();
                let valid_share = whole_share(&valid, rank, world_size, &valid_device);
                (rank, comm, train_device, train_share, valid_share)
            })
            .collect();
        let local_ranks = local.len();
        let (events_tx, events_rx) = mpsc::channel();
        let mut coordinator = Coordinator::<M> {
            ranks: local_ranks,
            processor,
            interrupter: interrupter.clone(),
            event_store: &components.event_store,
            early_stopping: components.early_stopping,
            checkpointing: self.checkpoints.as_ref().map(|(_, s)| s),
            train_items: local[0].3.num_items() * local_ranks,
            valid_items: local.iter().map(|l| l.4.num_items()).sum(),
            failures: Vec::new(),
        };
        let last_epoch = components.num_epochs;
        let results = thread::scope(|scope| {
            let mut decisions = Vec::with_capacity(local_ranks);
            let mut handles = Vec::with_capacity(local_ranks);
            for (rank, comm, device, train, valid) in local {
                let (decision_tx, decision_rx) = mpsc::channel();
                decisions.push(decision_tx);
                let job = RankJob {
                    rank,
                    config: &self.config,
                    optim: self.optim.clone(),
                    learner: learner.clone(),
                    device,
                    train,
                    valid,
                    valid_total,
                    first_epoch: starting_epoch,
                    last_epoch,
                    grad_accumulation: components.grad_accumulation,
                    interrupter: interrupter.clone(),
                    checkpoints: self.checkpoints.as_ref().map(|(dir, _)| dir.as_path()),
                    item_count: self.item_count.counter(),
                    resume_from: components.checkpoint,
                    events: events_tx.clone(),
                    decisions: decision_rx,
                };
                let handle = thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || job.run(comm))
                    .expect("spawning a rank thread");
                handles.push((rank, handle));
            }
            drop(events_tx);
            coordinator.run(starting_epoch, last_epoch, &events_rx, decisions);
            handles
                .into_iter()
                .map(|(rank, handle)| {
                    let result = handle.join().unwrap_or_else(|payload| {
                        Err(payload
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| payload.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "panicked".to_string()))
                    });
                    (rank, result)
                })
                .collect::<Vec<_>>()
        });
        let mut failures = coordinator.failures;
        let mut models = Vec::with_capacity(local_ranks);
        for (rank, result) in results {
            match result {
                Ok(model) => models.push(model),
                Err(message) if !failures.iter().any(|(r, _)| *r == rank) => failures.push((rank, message)),
                Err(_) => {}
            }
        }
        let processor = coordinator.processor;
        if !failures.is_empty() {
            failures.sort_by_key(|(rank, _)| *rank);
            interrupter.fail(RankFailures(failures));
            return (learner.model(), processor);
        }
        (models.swap_remove(0), processor)
    }
}
