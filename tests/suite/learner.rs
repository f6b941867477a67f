//! burn-shard-train's `ShardedStrategy` inside burn-train's `SupervisedTraining`, against
//! burn-train's own single-device strategy on the same global batches.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::AdamConfig;
use burn::optim::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::prelude::*;
use burn::tensor::DType;
use burn::train::checkpoint::KeepLastNCheckpoints;
use burn::train::metric::store::EventStoreClient;
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::{
    ClassificationOutput, EarlyStoppingStrategy, InferenceStep, Interrupter, Learner, LearningResult,
    SupervisedTraining, TrainOutput, TrainStep,
};
use burn_shard::comm::{Collective, InProcessGroup, run_ranks};
use burn_shard::{ShardConfig, Stage};
use burn_shard_train::{LineRenderer, RankFailures, ShardedStrategy};

use burn::module::{ModuleMapper, Param};

use crate::common::{Rng, cast, max_abs_diff, params_of, remap, scratch};

const FEATURES: usize = 6;
const CLASSES: usize = 3;
/// Items per epoch (training, validation) and the global batch: 4 steps per epoch at every
/// world size, which 1, 2 and 3 divide.
const TRAIN_ITEMS: usize = 48;
const VALID_ITEMS: usize = 12;
const GLOBAL_BATCH: usize = 12;

#[derive(Module, Debug)]
pub struct Classifier {
    l1: Linear,
    act: Relu,
    l2: Linear,
}

impl Classifier {
    fn new(device: &Device) -> Self {
        Self {
            l1: LinearConfig::new(FEATURES, 10).init(device),
            act: Relu::new(),
            l2: LinearConfig::new(10, CLASSES).init(device),
        }
    }

    fn classify(&self, batch: Batch) -> ClassificationOutput {
        let output = self.l2.forward(self.act.forward(self.l1.forward(batch.x)));
        let loss = CrossEntropyLossConfig::new()
            .init(&output.device())
            .forward(output.clone(), batch.y.clone());
        ClassificationOutput::new(loss, output, batch.y)
    }
}

impl TrainStep for Classifier {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> TrainOutput<ClassificationOutput> {
        let item = self.classify(batch);
        // Scaled when ShardedStrategy runs a loss scaler; the metrics get the unscaled loss.
        TrainOutput::new(self, burn_shard_train::scale_loss(item.loss.clone()).backward(), item)
    }
}

impl InferenceStep for Classifier {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> ClassificationOutput {
        self.classify(batch)
    }
}

#[derive(Clone, Debug)]
pub struct Item {
    x: [f32; FEATURES],
    y: i64,
}

#[derive(Clone, Debug)]
pub struct Batch {
    x: Tensor<2>,
    y: Tensor<1, Int>,
}

/// Batches items with features in `dtype` (the model's); `hook` sees each item's `x[0]`
/// (tests use it to act on one rank's batch).
#[derive(Clone)]
pub(crate) struct ItemBatcher {
    hook: Arc<dyn Fn(&Item) + Send + Sync>,
    dtype: DType,
}

impl ItemBatcher {
    fn plain() -> Self {
        Self {
            hook: Arc::new(|_| {}),
            dtype: DType::F32,
        }
    }

    fn of(&self, dtype: DType) -> Self {
        Self { dtype, ..self.clone() }
    }
}

impl Batcher<Item, Batch> for ItemBatcher {
    fn batch(&self, items: Vec<Item>, device: &Device) -> Batch {
        items.iter().for_each(|i| (self.hook)(i));
        make_batch(&items, device, self.dtype)
    }
}

/// `items` as one batch on `device`, features in `dtype`.
fn make_batch(items: &[Item], device: &Device, dtype: DType) -> Batch {
    let x: Vec<f32> = items.iter().flat_map(|i| i.x).collect();
    let y: Vec<i64> = items.iter().map(|i| i.y).collect();
    Batch {
        x: Tensor::<2>::from_data(TensorData::new(x, [items.len(), FEATURES]), device).cast(dtype),
        y: Tensor::from_data(TensorData::new(y, [items.len()]), device),
    }
}

/// `n` items labelled by a fixed random teacher, so the loss can fall; item `i` has
/// `x[0] = i` scaled small, so a batcher can tell which item it batches.
fn items(n: usize, seed: u64) -> Vec<Item> {
    let teacher = Rng::new(7).vec(FEATURES * CLASSES);
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|i| {
            let mut x = [0.0; FEATURES];
            x.iter_mut().for_each(|v| *v = rng.next_f32());
            x[0] = i as f32 / 64.0;
            let score = |c: usize| (0..FEATURES).map(|f| x[f] * teacher[f * CLASSES + c]).sum::<f32>();
            let y = (0..CLASSES).max_by(|a, b| score(*a).total_cmp(&score(*b))).unwrap() as i64;
            Item { x, y }
        })
        .collect()
}

/// The order in which `world_size` ranks see the same global batches of `global_batch` items
/// as one device: rank `r` reads the contiguous share `[r·n, (r+1)·n)`, so base item
/// `k·G + r·b + j` (global batch `k`, the `j`-th item of rank `r`'s part) goes to position
/// `r·n + k·b + j`. With gradient accumulation a rank's part spans its micro-batches of the step.
pub(crate) fn rank_order<T: Clone>(base: &[T], world_size: usize, global_batch: usize) -> Vec<T> {
    let (n, b) = (base.len() / world_size, global_batch / world_size);
    let mut out = base.to_vec();
    for (k, global) in base.chunks(global_batch).enumerate() {
        for (r, part) in global.chunks(b).enumerate() {
            out[r * n + k * b..r * n + (k + 1) * b].clone_from_slice(part);
        }
    }
    out
}

/// `module` with fixed pseudo-random values: the same model in every run, whatever Burn's RNG
/// did in the tests that ran before on the same device.
pub(crate) fn seeded<M: Module>(module: M) -> M {
    struct Seeded(Rng);
    impl ModuleMapper for Seeded {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            remap(param, |value| {
                let values: Vec<f32> = self
                    .0
                    .vec(value.shape().num_elements())
                    .iter()
                    .map(|v| v * 0.5)
                    .collect();
                Tensor::from_data(TensorData::new(values, value.shape()), &value.device())
            })
        }
    }
    module.map(&mut Seeded(Rng::new(3)))
}

fn loader(items: Vec<Item>, batch: usize, batcher: ItemBatcher) -> Arc<dyn DataLoader<Batch>> {
    DataLoaderBuilder::new(batcher)
        .batch_size(batch)
        .build(InMemDataset::new(items))
}

/// One training run's setup: epochs, gradient accumulation, and how to end early.
#[derive(Clone)]
pub(crate) struct Run {
    pub epochs: usize,
    pub accumulation: Option<usize>,
    pub batcher: ItemBatcher,
    pub stop_at_epoch: Option<usize>,
    pub resume_from: Option<usize>,
    /// Receives the run's interrupter before launch.
    pub interrupter: Option<Arc<OnceLock<Interrupter>>>,
    /// burn-shard's checkpoints (default: `checkpoints/` in the run's directory).
    pub checkpoints: Option<PathBuf>,
    /// Items of the validation set.
    pub valid_items: usize,
    /// The model's float dtype (`f16` needs a loss scaler in the sharded runs).
    pub dtype: DType,
    /// Receives what the run's [`LineRenderer`] prints (a line every global batch); `None`:
    /// dropped. Every run renders with it, never with burn-train's dashboard, which would take
    /// over a terminal that runs the tests.
    pub lines: Option<Lines>,
}

/// A buffer a [`LineRenderer`] writes into, readable after the run.
#[derive(Clone, Default)]
pub(crate) struct Lines(Arc<Mutex<Vec<u8>>>);

impl Lines {
    fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).expect("UTF-8 lines")
    }
}

impl std::io::Write for Lines {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Run {
    pub(crate) fn epochs(epochs: usize) -> Self {
        Self {
            epochs,
            accumulation: None,
            batcher: ItemBatcher::plain(),
            stop_at_epoch: None,
            resume_from: None,
            interrupter: None,
            checkpoints: None,
            valid_items: VALID_ITEMS,
            dtype: DType::F32,
            lines: None,
        }
    }
}

/// Early stopping at a fixed epoch, decided by the strategy's coordinator once for all ranks.
#[derive(Clone)]
struct StopAt(usize);

impl EarlyStoppingStrategy for StopAt {
    fn should_stop(&mut self, epoch: usize, _store: &EventStoreClient) -> bool {
        epoch >= self.0
    }
}

/// The Learner as the Burn book writes it; `sharding: None` is burn-train's single-device
/// strategy on the global batch, `Some((n, config))` burn-shard's strategy with `n` ranks as threads.
pub(crate) fn train(dir: &Path, sharding: Option<(usize, ShardConfig)>, run: &Run) -> LearningResult<Classifier> {
    let strategy =
        sharding.map(|(n, config)| ShardedStrategy::threads(config, AdamConfig::new(), vec![Device::flex(); n]));
    train_with(dir, strategy, run)
}

/// [`train`] with `strategy` (`None`: burn-train's single-device strategy).
pub(crate) fn train_with(
    dir: &Path,
    strategy: Option<ShardedStrategy<AdamConfig>>,
    run: &Run,
) -> LearningResult<Classifier> {
    train_with_optimizers(dir, strategy, run, AdamConfig::new().init())
}

/// [`train_with`] with any sharded optimizer, `burn` the single-device Learner's.
pub(crate) fn train_with_optimizers<O: burn_shard::IntoOptimizer + Clone + Send + Sync + 'static>(
    dir: &Path,
    strategy: Option<ShardedStrategy<O>>,
    run: &Run,
    burn: burn::optim::ModuleOptimizer,
) -> LearningResult<Classifier> {
    let device = Device::flex();
    let world_size = strategy.as_ref().map_or(1, |s| s.world_size());
    let base_train = items(TRAIN_ITEMS, 1);
    let train = loader(
        rank_order(&base_train, world_size, GLOBAL_BATCH),
        GLOBAL_BATCH / world_size,
        run.batcher.of(run.dtype),
    );
    // Validation in the items' order: every rank's share counts once, whatever its length.
    let valid = loader(
        items(run.valid_items, 2),
        GLOBAL_BATCH / world_size,
        ItemBatcher::plain().of(run.dtype),
    );
    let model = cast(seeded(Classifier::new(&device.clone().autodiff())), run.dtype);
    let renderer = match &run.lines {
        Some(lines) => LineRenderer::to(GLOBAL_BATCH, lines.clone()),
        None => LineRenderer::to(GLOBAL_BATCH, std::io::sink()),
    };
    let mut training = SupervisedTraining::new(dir, train, valid)
        .metrics((LossMetric::new(), AccuracyMetric::new()))
        .num_epochs(run.epochs)
        .renderer(Box::new(renderer));
    if let Some(n) = run.accumulation {
        training = training.grads_accumulation(n);
    }
    if let Some(epoch) = run.stop_at_epoch {
        training = training.early_stopping(StopAt(epoch));
    }
    if let Some(epoch) = run.resume_from {
        training = training.checkpoint(epoch);
    }
    if let Some(slot) = &run.interrupter {
        slot.set(training.interrupter()).ok().expect("one run per slot");
    }
    if let Some(strategy) = strategy {
        let checkpoints = run.checkpoints.clone().unwrap_or_else(|| dir.join("checkpoints"));
        let strategy = strategy.with_checkpoints(checkpoints, KeepLastNCheckpoints::new(2));
        training = training.with_training_strategy(strategy.into());
    }
    training.launch(Learner::new(model, burn, scheduler()))
}

/// A scheduler that changes every step: the strategy must step it once per global step.
fn scheduler() -> burn::optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler {
    LinearLrSchedulerConfig::new(2e-2, 2e-3, 40).init().expect("scheduler")
}

/// The epoch's loss the file logger wrote for `split` of `epoch` (burn-train's aggregate, over
/// every rank's batches).
fn logged_loss(dir: &Path, split: &str, epoch: usize) -> f64 {
    logged(dir, split, epoch, "Loss").0
}

/// What the file logger wrote for metric `metric` of `split` of `epoch`: the epoch's value
/// (its `value,final` line, burn-train's aggregate of the batches weighted by the count each
/// reported: items for accuracy, one per batch for the loss), and the counts summed (each other
/// line is a batch's `value,count`).
fn logged(dir: &Path, split: &str, epoch: usize, metric: &str) -> (f64, usize) {
    let file = dir
        .join(split)
        .join(format!("epoch-{epoch}"))
        .join(format!("{metric}.log"));
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
    let (mut last, mut counted) = (None, 0);
    for line in text.lines().filter(|l| !l.is_empty()) {
        let (value, count) = line.split_once(',').expect("value,count");
        let value: f64 = value.parse().expect("a number");
        match count.trim() {
            "final" => last = Some(value),
            count => counted += count.parse::<usize>().expect("a count"),
        }
    }
    (
        last.unwrap_or_else(|| panic!("{}: no final line", file.display())),
        counted,
    )
}

pub(crate) fn finished(result: &LearningResult<Classifier>, what: &str) -> Vec<f32> {
    if let Some(e) = &result.error {
        panic!("{what}: training failed: {e}");
    }
    params_of(&result.model)
}

#[test]
fn sharded_strategy_trains_as_burns_single_device_learner_at_every_stage_and_world_size() {
    let epochs = 2;
    for accumulation in [None, Some(2)] {
        let run = Run {
            accumulation,
            ..Run::epochs(epochs)
        };
        let ref_dir = scratch("learner", &format!("reference-{accumulation:?}"));
        let reference = finished(&train(&ref_dir, None, &run), "reference");
        for world_size in 1..=3 {
            for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
                // Accumulation is swept at two world sizes to keep the sweep short.
                if accumulation.is_some() && world_size == 1 {
                    continue;
                }
                let ctx = format!("stage {stage}, world size {world_size}, accumulation {accumulation:?}");
                let dir = scratch("learner", &format!("s{stage}-w{world_size}-{accumulation:?}"));
                let result = train(&dir, Some((world_size, ShardConfig::new(stage))), &run);
                let params = finished(&result, &ctx);
                let diff = max_abs_diff(&params, &reference);
                assert!(
                    diff < 1e-4,
                    "{ctx}: parameters differ from the single-device Learner by {diff}"
                );
                for epoch in 1..=epochs {
                    for split in ["train", "valid"] {
                        let (got, want) = (logged_loss(&dir, split, epoch), logged_loss(&ref_dir, split, epoch));
                        assert!(
                            (got - want).abs() < 1e-4,
                            "{ctx}: logged {split} loss of epoch {epoch} is {got}, single-device {want}"
                        );
                    }
                }
            }
        }
    }
}

/// burn-train's Learner with Muon for the two matrices and Adam for the biases, through
/// `OptimizerGroups` in the sharded strategy: Burn's single-device Learner with the same
/// groups, at stages 0-3 over 2 and 3 ranks (each matrix stepped whole by one rank).
#[test]
fn sharded_strategy_trains_muon_groups_as_burns_learner() {
    use burn::module::ParamGroup;
    use burn::optim::MuonConfig;
    let matrices = || ParamGroup::from_regex(r"^l[12]\.weight$").expect("a valid regex");
    let burn = || {
        AdamConfig::new()
            .init()
            .with_group(matrices(), MuonConfig::new().build(), None)
    };
    let run = Run::epochs(2);
    let ref_dir = scratch("learner", "muon-reference");
    let strategy: Option<ShardedStrategy<burn_shard::OptimizerGroups>> = None;
    let reference = finished(&train_with_optimizers(&ref_dir, strategy, &run, burn()), "reference");
    let adam = finished(&train(&scratch("learner", "adam-reference"), None, &run), "adam");
    assert!(
        max_abs_diff(&reference, &adam) > 1e-3,
        "Muon must train differently from Adam"
    );
    for world_size in [2, 3] {
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            let ctx = format!("Muon, stage {stage}, world size {world_size}");
            let dir = scratch("learner", &format!("muon-s{stage}-w{world_size}"));
            let groups =
                burn_shard::OptimizerGroups::new(AdamConfig::new()).with_group(matrices(), MuonConfig::new(), None);
            let strategy = ShardedStrategy::threads(ShardConfig::new(stage), groups, vec![Device::flex(); world_size]);
            let params = finished(&train_with_optimizers(&dir, Some(strategy), &run, burn()), &ctx);
            let diff = max_abs_diff(&params, &reference);
            assert!(diff < 1e-4, "{ctx}: parameters differ from Burn's Learner by {diff}");
            let (got, want) = (logged_loss(&dir, "train", 2), logged_loss(&ref_dir, "train", 2));
            assert!((got - want).abs() < 1e-4, "{ctx}: train loss {got}, Burn's {want}");
        }
    }
}

#[test]
fn sharded_strategy_early_stopping_and_interrupts_end_every_rank() {
    // Early stopping after epoch 2 of 4: the same parameters as 2 epochs.
    let two = finished(
        &train(&scratch("learner", "two-epochs"), None, &Run::epochs(2)),
        "2 epochs",
    );
    let run = Run {
        stop_at_epoch: Some(2),
        ..Run::epochs(4)
    };
    let stopped = train(
        &scratch("learner", "early"),
        Some((3, ShardConfig::new(Stage::Three))),
        &run,
    );
    let params = finished(&stopped, "early stopping");
    let diff = max_abs_diff(&params, &two);
    assert!(
        diff < 1e-4,
        "early stopping at epoch 2 of 4 differs from 2 epochs by {diff}"
    );

    // An interrupt raised while one rank (rank 1 of 2) batches an item: every rank stops at the
    // same step, and the run reports the interruption.
    let interrupts = Arc::new(AtomicUsize::new(0));
    let seen = interrupts.clone();
    let dir = scratch("learner", "interrupt");
    let interrupter: Arc<OnceLock<Interrupter>> = Arc::default();
    let slot = interrupter.clone();
    let batcher = ItemBatcher {
        hook: Arc::new(move |item: &Item| {
            // Base item 30 (global batch 2, 6 items per rank) opens rank 1's third batch.
            if (item.x[0] * 64.0).round() as usize == 30 && seen.fetch_add(1, Ordering::SeqCst) == 0 {
                slot.get()
                    .expect("set before launch")
                    .stop(Some("asked by a test on rank 1"));
            }
        }),
        ..ItemBatcher::plain()
    };
    let run = Run {
        batcher,
        interrupter: Some(interrupter),
        ..Run::epochs(3)
    };
    let result = train(&dir, Some((2, ShardConfig::new(Stage::Two))), &run);
    assert!(
        result.error.is_none(),
        "an interrupt is not an error: {:?}",
        result.error.map(|e| e.to_string())
    );
    let interruption = result.interrupted.expect("the run reports the interruption");
    assert_eq!(interruption.reason.as_deref(), Some("asked by a test on rank 1"));
    assert_eq!(
        interrupts.load(Ordering::SeqCst),
        1,
        "the batch that interrupts is batched once"
    );

    // A rank that panics: every rank ends, and the error names it.
    let batcher = ItemBatcher {
        hook: Arc::new(|item: &Item| {
            if (item.x[0] * 64.0).round() as usize == 40 {
                panic!("a data bug on one rank");
            }
        }),
        ..ItemBatcher::plain()
    };
    let run = Run {
        batcher,
        ..Run::epochs(2)
    };
    let result = train(
        &scratch("learner", "panic"),
        Some((3, ShardConfig::new(Stage::Three))),
        &run,
    );
    let error = result.error.expect("a rank panicked: the run fails");
    let failures = RankFailures::of(&error).unwrap_or_else(|| panic!("the error carries the failed ranks: {error}"));
    let ranks: Vec<usize> = failures.0.iter().map(|(rank, _)| *rank).collect();
    assert_eq!(ranks, [0, 1, 2], "every rank ends, in rank order: {failures}");
    // Base item 40 (global batch 3, 4 items per rank at 3 ranks) is rank 1's.
    assert!(
        failures.0[1].1.contains("a data bug on one rank"),
        "the panicking rank's own message: {failures}"
    );
}

#[test]
fn sharded_strategy_resumes_an_epoch_checkpoint_at_another_world_size_and_stage() {
    let uninterrupted = finished(&train(&scratch("learner", "four"), None, &Run::epochs(4)), "4 epochs");
    let dir = scratch("learner", "resume");
    finished(
        &train(&dir, Some((2, ShardConfig::new(Stage::One))), &Run::epochs(2)),
        "first 2 epochs",
    );
    assert!(
        dir.join("checkpoints/epoch-2/meta.json").exists(),
        "epoch 2's sharded checkpoint"
    );
    let run = Run {
        resume_from: Some(2),
        ..Run::epochs(4)
    };
    let resumed = finished(&train(&dir, Some((3, ShardConfig::new(Stage::Three))), &run), "resumed");
    let diff = max_abs_diff(&resumed, &uninterrupted);
    assert!(
        diff < 1e-4,
        "resumed at 3 ranks and stage 3, 4 epochs differ from uninterrupted by {diff}"
    );
    // KeepLastNCheckpoints(2): epochs 3 and 4 are kept, the older ones deleted.
    assert_kept_last_two(&dir);
}

/// After 4 epochs with `KeepLastNCheckpoints(2)`: epochs 3 and 4 are kept, the older ones
/// deleted.
fn assert_kept_last_two(dir: &Path) {
    let kept: Vec<bool> = (1..=4)
        .map(|e| dir.join(format!("checkpoints/epoch-{e}")).exists())
        .collect();
    assert_eq!(
        kept,
        [false, false, true, true],
        "checkpoints kept by burn-train's strategy"
    );
}

/// burn-train's Learner under hybrid sharding (4 ranks as 2 replicas of shard groups of 2, stage
/// 3): the single-device Learner's parameters and logged losses (within 1e-4), and its epoch
/// checkpoints, written by shard group 0 alone (rank files 0 and 1) in the background, kept and
/// deleted by burn-train's strategy as in a flat run.
#[test]
fn sharded_strategy_trains_under_hybrid_sharding_as_the_single_device_learner() {
    let epochs = 4;
    let run = Run::epochs(epochs);
    let ref_dir = scratch("learner", "hsdp-reference");
    let reference = finished(&train(&ref_dir, None, &run), "reference");
    let dir = scratch("learner", "hsdp");
    let config = ShardConfig::new(Stage::Three).with_replicas(2);
    let params = finished(&train(&dir, Some((4, config)), &run), "2 x 2 mesh");
    let diff = max_abs_diff(&params, &reference);
    assert!(
        diff < 1e-4,
        "parameters differ from the single-device Learner by {diff}"
    );
    for epoch in 1..=epochs {
        let (got, want) = (logged_loss(&dir, "train", epoch), logged_loss(&ref_dir, "train", epoch));
        assert!(
            (got - want).abs() < 1e-4,
            "train loss of epoch {epoch}: {got}, single-device {want}"
        );
    }
    assert_kept_last_two(&dir);
    let files = burn_shard::checkpoint::inspect(dir.join("checkpoints/epoch-4"))
        .expect("a complete checkpoint")
        .bytes_per_rank()
        .len();
    assert_eq!(files, 2, "shard group 0 writes the files of a world of 2");
}

/// One process per rank, as `burn-shard-run` or `mpirun` start them (here threads that each
/// build and launch their own `SupervisedTraining`, with a rank's collective each): the same
/// parameters as the single-device Learner, and early stopping configured on rank 0 alone
/// stops every rank at the same epoch (rank 0 decides the end of each epoch for all).
#[test]
fn sharded_strategy_with_one_process_per_rank_trains_as_the_single_device_learner() {
    let two = finished(
        &train(&scratch("learner", "process-ref"), None, &Run::epochs(2)),
        "2 epochs",
    );
    for stage in [Stage::One, Stage::Three] {
        // Metric logs per rank, checkpoints shared (a shared file system, as on a cluster).
        let checkpoints = scratch("learner", &format!("process-{stage}-checkpoints"));
        let group = InProcessGroup::new(2).unwrap();
        let results = run_ranks(group, |comm| {
            let rank = comm.rank();
            let strategy = ShardedStrategy::process(ShardConfig::new(stage), AdamConfig::new(), comm, Device::flex());
            let run = Run {
                stop_at_epoch: (rank == 0).then_some(2),
                checkpoints: Some(checkpoints.clone()),
                ..Run::epochs(4)
            };
            let result = train_with(
                &scratch("learner", &format!("process-{stage}-rank{rank}")),
                Some(strategy),
                &run,
            );
            finished(&result, &format!("stage {stage}, rank {rank}"))
        })
        .unwrap();
        for (rank, params) in results.iter().enumerate() {
            let diff = max_abs_diff(params, &two);
            assert!(
                diff < 1e-4,
                "stage {stage}, rank {rank}: 2 epochs (early stopping on rank 0) differ by {diff}"
            );
        }
        // Rank 0's checkpointing strategy (keep the last 2) acted for both ranks.
        let kept: Vec<bool> = (1..=3)
            .map(|e| checkpoints.join(format!("epoch-{e}")).exists())
            .collect();
        assert_eq!(kept, [true, true, false], "stage {stage}");
    }

    // An interrupt on rank 1's own interrupter (another process's is not shared): rank 0 stops
    // at the same batch and reports who stopped it.
    let results = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let rank = comm.rank();
        let interrupter: Arc<OnceLock<Interrupter>> = Arc::default();
        let slot = interrupter.clone();
        let batcher = ItemBatcher {
            hook: Arc::new(move |item: &Item| {
                // Base item 30 (global batch 2) is rank 1's only.
                if (item.x[0] * 64.0).round() as usize == 30 {
                    slot.get().expect("set before launch").stop(Some("asked on rank 1"));
                }
            }),
            ..ItemBatcher::plain()
        };
        let run = Run {
            batcher,
            interrupter: Some(interrupter),
            ..Run::epochs(3)
        };
        let strategy = ShardedStrategy::process(ShardConfig::new(Stage::Two), AdamConfig::new(), comm, Device::flex());
        let result = train_with(
            &scratch("learner", &format!("process-stop-rank{rank}")),
            Some(strategy),
            &run,
        );
        assert!(
            result.error.is_none(),
            "rank {rank}: {:?}",
            result.error.map(|e| e.to_string())
        );
        result.interrupted.and_then(|i| i.reason)
    })
    .unwrap();
    assert_eq!(
        results,
        [
            Some("stopped by rank 1".to_string()),
            Some("asked on rank 1".to_string())
        ]
    );
}

/// The reported case: 13 validation items at world size 2 gave 41.67 % accuracy where one
/// device gives 38.46 %, because the last `len % world_size` items were dropped. Validation
/// counts every item exactly once at every world size 1-4 and stage 0-3 (shares of 13 items
/// differ by one, and at stage 3 the rank with a batch less keeps the others' gathers
/// company): the logged validation accuracy equals the single-device Learner's, over all 13
/// items. (burn-train's `LossMetric` weights each batch once, whatever its size, so the epoch's
/// loss depends on how the items are batched, on one device too: it is not compared here.)
#[test]
fn validation_metrics_count_every_item_once_at_every_stage_and_world_size() {
    let run = Run {
        valid_items: 13,
        ..Run::epochs(1)
    };
    let ref_dir = scratch("learner", "valid-13-reference");
    finished(&train(&ref_dir, None, &run), "reference");
    let (ref_accuracy, ref_items) = logged(&ref_dir, "valid", 1, "Accuracy");
    assert_eq!(ref_items, 13, "the single-device Learner validates every item");
    for world_size in 1..=4 {
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            let ctx = format!("stage {stage}, world size {world_size}");
            let dir = scratch("learner", &format!("valid-13-s{stage}-w{world_size}"));
            finished(&train(&dir, Some((world_size, ShardConfig::new(stage))), &run), &ctx);
            let (accuracy, items) = logged(&dir, "valid", 1, "Accuracy");
            assert_eq!(items, 13, "{ctx}: validation items counted");
            assert!(
                (accuracy - ref_accuracy).abs() < 1e-9,
                "{ctx}: validation accuracy {accuracy} %, single-device {ref_accuracy} %"
            );
        }
    }
}

/// Without a terminal the progress is [`LineRenderer`]'s: a line every global batch of items,
/// counting each item once although every rank's batch reaches the renderer (an epoch ends at
/// the data set's size, also when the validation shares differ in length), a line at each
/// split's end and a summary; never burn-train's `Debug` dump of its progress.
#[test]
fn progress_lines_count_every_item_once_and_end_with_a_summary() {
    for world_size in [1, 2, 3] {
        let lines = Lines::default();
        let run = Run {
            // 13 validation items: shares of 6 and 7 on 2 ranks, 4, 4 and 5 on 3.
            valid_items: 13,
            lines: Some(lines.clone()),
            ..Run::epochs(2)
        };
        let dir = scratch("learner", &format!("lines-w{world_size}"));
        finished(
            &train(&dir, Some((world_size, ShardConfig::new(Stage::Two))), &run),
            "lines",
        );
        let text = lines.text();
        let ctx = format!("world size {world_size}, the lines:\n{text}");
        assert!(!text.contains("ProgressSnapshot"), "{ctx}");
        // `<split> epoch <e>/2  <items>/<total> items  Loss ..  Accuracy .. %  .. items/s`
        let counts = |split: &str, epoch: usize| -> Vec<(usize, usize)> {
            let head = format!("{split} epoch {epoch}/2  ");
            text.lines()
                .filter_map(|l| l.strip_prefix(&head))
                .map(|rest| {
                    let (items, total) = rest.split_once(" items").unwrap().0.split_once('/').unwrap();
                    (items.parse().unwrap(), total.parse().unwrap())
                })
                .collect()
        };
        for epoch in [1, 2] {
            // A line at 12, 24 and 36 items (each global batch), and the split's end at 48.
            let train: Vec<(usize, usize)> = [12, 24, 36, 48].map(|n| (n, TRAIN_ITEMS)).to_vec();
            assert_eq!(counts("train", epoch), train, "{ctx}");
            assert_eq!(counts("valid", epoch), vec![(12, 13), (13, 13)], "{ctx}");
        }
        let line = |prefix: &str| text.lines().find(|l| l.starts_with(prefix)).map(str::to_owned);
        let end = line("train epoch 2/2  48/48 items").unwrap();
        assert!(
            end.contains("  Loss ") && end.contains("  Accuracy ") && end.contains(" %"),
            "{ctx}"
        );
        let summary = line("summary: 96 training items in ").unwrap_or_else(|| panic!("no summary: {ctx}"));
        assert!(summary.contains("items/s"), "{ctx}");
        for (split, epoch, items) in [("train", 1, 48), ("valid", 1, 13), ("train", 2, 48), ("valid", 2, 13)] {
            assert!(
                line(&format!("  {split} epoch {epoch}: {items} items  Loss ")).is_some(),
                "{ctx}"
            );
        }
    }
}

/// `run` as a hand-written loop of burn-shard on `world_size` ranks (threads), with `config`:
/// the shares, batches, learning-rate schedule and step rule `ShardedStrategy` uses (step after
/// `accumulation` micro-batches or at the last one), `optim.scale_loss` before backward. Rank
/// 0's final parameters.
fn hand_loop(world_size: usize, config: &ShardConfig, run: &Run) -> Vec<f32> {
    use burn::optim::GradientsParams;
    let results = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
        let rank = comm.rank();
        let device = Device::flex().autodiff();
        let model = cast(seeded(Classifier::new(&device)), run.dtype);
        let (mut model, mut optim) = config.init(model, AdamConfig::new(), comm).expect("init");
        let mut scheduler = scheduler();
        let (share, batch) = (TRAIN_ITEMS / world_size, GLOBAL_BATCH / world_size);
        let ordered = rank_order(&items(TRAIN_ITEMS, 1), world_size, GLOBAL_BATCH);
        let batches: Vec<&[Item]> = ordered[rank * share..(rank + 1) * share].chunks(batch).collect();
        let accumulation = run.accumulation.unwrap_or(1).max(1);
        for _ in 0..run.epochs {
            let mut micro_batches = 0;
            for (i, items) in batches.iter().enumerate() {
                let loss = model.classify(make_batch(items, &device, run.dtype)).loss;
                let grads = GradientsParams::from_grads(optim.scale_loss(loss).backward(), &model);
                micro_batches += 1;
                if micro_batches == accumulation || i + 1 == batches.len() {
                    model = optim.step(scheduler.step(), model, grads).expect("step");
                    micro_batches = 0;
                } else {
                    optim.accumulate(&model, grads).expect("accumulate");
                }
            }
        }
        params_of(&model.materialize())
    })
    .expect("no rank panics");
    results.into_iter().next().expect("rank 0")
}

/// The reported case: an `f16` model with `LossScaler::dynamic()` trained through
/// `ShardedStrategy` moved its parameters 0.118x as far as in `f32` (the loop never scaled the
/// loss, the step still unscaled the gradients). Every option of `ShardConfig` means the same in
/// the Learner as in a hand-written loop: loss scaling (`f16`, dynamic), `bf16` with masters,
/// clipping by global norm, accumulation, NVMe offload of the optimizer state and of stage 3's
/// parameters give bitwise the hand-written loop's parameters; and `f16` moves about as far as
/// `f32`. (Parameter groups are set on the optimizer, `ShardedOptimizer::with_group`, which the
/// strategy does not take.)
#[test]
fn every_shard_config_option_means_the_same_in_the_learner_as_in_a_hand_written_loop() {
    let nvme = scratch("learner", "options-nvme");
    let world_size = 2;
    type Case = (
        &'static str,
        DType,
        Option<usize>,
        fn(ShardConfig, &Path) -> ShardConfig,
        bool,
    );
    let cases: [Case; 6] = [
        (
            "f16, dynamic loss scaler",
            DType::F16,
            None,
            |c, _| c.with_loss_scaler(burn_shard::LossScaler::dynamic()),
            false,
        ),
        ("bf16 with f32 masters", DType::BF16, None, |c, _| c, false),
        (
            "clipping by global norm",
            DType::F32,
            None,
            |c, _| c.with_max_grad_norm(0.05),
            false,
        ),
        ("accumulation of 2", DType::F32, Some(2), |c, _| c, false),
        (
            "NVMe offload of the state",
            DType::F32,
            None,
            |c, dir| c.with_optimizer_state_on(burn_shard::Home::Disk(burn_shard::NvmeOffload::new(dir))),
            false,
        ),
        (
            "stage 3's parameters on NVMe",
            DType::F32,
            None,
            |c, dir| c.with_params_on(burn_shard::Home::Disk(dir.into())),
            true,
        ),
    ];
    let initial = params_of(&seeded(Classifier::new(&Device::flex().autodiff())));
    let moved = |params: &[f32]| -> f64 {
        let squares: f64 = params.iter().zip(&initial).map(|(a, b)| f64::from(a - b).powi(2)).sum();
        squares.sqrt()
    };
    for (name, dtype, accumulation, option, stage3_only) in cases {
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            if stage3_only && stage != Stage::Three {
                continue;
            }
            let ctx = format!("{name}, stage {stage}");
            let config = option(ShardConfig::new(stage), &nvme);
            let run = Run {
                accumulation,
                dtype,
                ..Run::epochs(2)
            };
            let dir = scratch(
                "learner",
                &format!("options-{stage}-{}", name.replace([' ', ',', '\''], "-")),
            );
            let learner = finished(&train(&dir, Some((world_size, config.clone())), &run), &ctx);
            let hand = hand_loop(world_size, &config, &run);
            let diff = max_abs_diff(&learner, &hand);
            assert!(
                learner == hand,
                "{ctx}: the Learner's parameters differ from the hand-written loop's by up to {diff}"
            );
            if dtype == DType::F16 {
                let reference = hand_loop(world_size, &ShardConfig::new(stage), &Run::epochs(2));
                let ratio = moved(&learner) / moved(&reference);
                assert!(
                    (0.5..1.5).contains(&ratio),
                    "{ctx}: f16 moved the parameters {ratio:.3}x as far as f32"
                );
            }
        }
    }
}
