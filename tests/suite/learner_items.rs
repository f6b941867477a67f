//! `ShardedStrategy::with_item_count` in burn-train's Learner: ranks whose batches hold
//! different numbers of items (targets masked by a pad label, as padded tokens are) train as
//! burn-train's single-device Learner on the global batch with the mean loss over the unmasked
//! items, at stages 0-3, world sizes 2-4, with gradient accumulation; without the count (equal
//! weights) they do not.

use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::AdamConfig;
use burn::prelude::*;
use burn::tensor::activation::log_softmax;
use burn::train::metric::LossMetric;
use burn::train::{
    ClassificationOutput, InferenceStep, Learner, LearningResult, SupervisedTraining, TrainOutput, TrainStep,
};
use burn_shard::{ShardConfig, Stage};
use burn_shard_train::{LineRenderer, ShardedStrategy};

use crate::common::{Rng, max_abs_diff, params_of, scratch};
use crate::learner::{rank_order, seeded};

const FEATURES: usize = 5;
const CLASSES: usize = 3;
/// The label of a masked item: it adds nothing to the loss and is not counted.
const PAD: i64 = CLASSES as i64;
const TRAIN_ITEMS: usize = 48;
/// Items of one optimizer step over every rank (and every micro-batch of the step).
const GLOBAL_BATCH: usize = 24;

#[derive(Module, Debug)]
pub struct Masked {
    l1: Linear,
    act: Relu,
    l2: Linear,
}

#[derive(Clone, Debug)]
pub struct Item {
    x: [f32; FEATURES],
    y: i64,
}

/// A batch; `sum`: the training loss is the sum over the unmasked items (for the item count),
/// else their mean.
#[derive(Clone, Debug)]
pub struct Batch {
    x: Tensor<2>,
    y: Tensor<1, Int>,
    sum: bool,
}

impl Masked {
    fn new(device: &Device) -> Self {
        Self {
            l1: LinearConfig::new(FEATURES, 8).init(device),
            act: Relu::new(),
            l2: LinearConfig::new(8, CLASSES).init(device),
        }
    }

    /// The loss over the unmasked items (summed), their count, and the logits.
    fn losses(&self, batch: &Batch) -> (Tensor<1>, Tensor<1>, Tensor<2>) {
        let logits = self.l2.forward(self.act.forward(self.l1.forward(batch.x.clone())));
        let kept = batch.y.clone().not_equal_elem(PAD);
        let labels = batch.y.clone().mask_fill(kept.clone().bool_not(), 0);
        let per_item = log_softmax(logits.clone(), 1)
            .gather(1, labels.unsqueeze_dim(1))
            .squeeze_dim::<1>(1)
            .neg()
            .mask_fill(kept.clone().bool_not(), 0.0);
        (per_item.sum(), kept.float().sum(), logits)
    }
}

impl TrainStep for Masked {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> TrainOutput<ClassificationOutput> {
        let (sum, count, logits) = self.losses(&batch);
        let mean = sum.clone() / count;
        let trained = if batch.sum { sum } else { mean.clone() };
        // The metrics get this rank's mean either way.
        TrainOutput::new(
            self,
            trained.backward(),
            ClassificationOutput::new(mean, logits, batch.y),
        )
    }
}

impl InferenceStep for Masked {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> ClassificationOutput {
        let (sum, count, logits) = self.losses(&batch);
        ClassificationOutput::new(sum / count, logits, batch.y)
    }
}

#[derive(Clone)]
struct ItemBatcher {
    sum: bool,
}

impl Batcher<Item, Batch> for ItemBatcher {
    fn batch(&self, items: Vec<Item>, device: &Device) -> Batch {
        let x: Vec<f32> = items.iter().flat_map(|i| i.x).collect();
        let y: Vec<i64> = items.iter().map(|i| i.y).collect();
        Batch {
            x: Tensor::from_data(TensorData::new(x, [items.len(), FEATURES]), device),
            y: Tensor::from_data(TensorData::new(y, [items.len()]), device),
            sum: self.sum,
        }
    }
}

/// `n` items labelled by a fixed random teacher; 40 % of those after the first of every 3 are
/// masked, so each micro-batch of every rank keeps between 1 and all of its items.
fn items(n: usize, seed: u64) -> Vec<Item> {
    let teacher = Rng::new(11).vec(FEATURES * CLASSES);
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|i| {
            let mut x = [0.0; FEATURES];
            x.iter_mut().for_each(|v| *v = rng.next_f32());
            let score = |c: usize| (0..FEATURES).map(|f| x[f] * teacher[f * CLASSES + c]).sum::<f32>();
            let label = (0..CLASSES).max_by(|a, b| score(*a).total_cmp(&score(*b))).unwrap() as i64;
            let masked = i % 3 != 0 && rng.next_f32() < 0.4;
            Item {
                x,
                y: if masked { PAD } else { label },
            }
        })
        .collect()
}

/// The unmasked items of each rank's micro-batches, over the first epoch.
fn counts_per_rank(world_size: usize, accumulation: usize) -> Vec<Vec<usize>> {
    let ordered = rank_order(&items(TRAIN_ITEMS, 1), world_size, GLOBAL_BATCH);
    let micro = GLOBAL_BATCH / world_size / accumulation;
    ordered
        .chunks(TRAIN_ITEMS / world_size)
        .map(|share| {
            share
                .chunks(micro)
                .map(|b| b.iter().filter(|i| i.y != PAD).count())
                .collect()
        })
        .collect()
}

/// burn-train's Learner over 2 epochs: `None`, its single-device strategy on the global batch
/// with the mean loss; `Some((n, stage, counted))`, burn-shard's strategy with `n` ranks as
/// threads, the sum loss and the item count when `counted`, else the mean loss.
fn train(dir: &std::path::Path, sharding: Option<(usize, Stage, bool)>, accumulation: usize) -> LearningResult<Masked> {
    let device = Device::flex();
    let world_size = sharding.map_or(1, |(n, _, _)| n);
    let sum = sharding.is_some_and(|(_, _, counted)| counted);
    let micro = GLOBAL_BATCH / world_size / accumulation;
    let loader = |items: Vec<Item>| -> Arc<dyn DataLoader<Batch>> {
        DataLoaderBuilder::new(ItemBatcher { sum })
            .batch_size(micro)
            .build(InMemDataset::new(items))
    };
    let train = loader(rank_order(&items(TRAIN_ITEMS, 1), world_size, GLOBAL_BATCH));
    let valid = loader(items(12, 2));
    let model = seeded(Masked::new(&device.clone().autodiff()));
    let mut training = SupervisedTraining::new(dir, train, valid)
        .metrics((LossMetric::new(),))
        .num_epochs(2)
        .renderer(Box::new(LineRenderer::to(GLOBAL_BATCH, std::io::sink())));
    if accumulation > 1 {
        training = training.grads_accumulation(accumulation);
    }
    if let Some((n, stage, counted)) = sharding {
        let strategy = ShardedStrategy::threads(ShardConfig::new(stage), AdamConfig::new(), vec![device; n]);
        training = training.with_training_strategy(match counted {
            true => strategy
                .with_item_count(|item: &ClassificationOutput| {
                    item.targets
                        .clone()
                        .not_equal_elem(PAD)
                        .int()
                        .sum()
                        .into_scalar::<i64>() as u64
                })
                .into(),
            false => strategy.into(),
        });
    }
    training.launch(Learner::new(model, AdamConfig::new().init(), 2e-2))
}

fn finished(result: &LearningResult<Masked>, what: &str) -> Vec<f32> {
    if let Some(e) = &result.error {
        panic!("{what}: training failed: {e}");
    }
    params_of(&result.model)
}

#[test]
fn item_counted_steps_train_as_the_single_device_learner_on_the_global_batch() {
    // Without accumulation: a reference of 24-item batches; with 2 micro-batches per step the
    // same 24 items per step, so the same reference.
    let reference = finished(&train(&scratch("learner_items", "reference"), None, 1), "reference");
    let cases = [
        (2, Stage::Zero, 1),
        (2, Stage::One, 1),
        (2, Stage::Two, 2),
        (2, Stage::Three, 1),
        (3, Stage::Two, 1),
        (4, Stage::Three, 2),
        (4, Stage::One, 1),
    ];
    for (world_size, stage, accumulation) in cases {
        // The class this test is about: the ranks' micro-batches keep different numbers of items.
        let counts = counts_per_rank(world_size, accumulation);
        assert!(
            (0..counts[0].len()).any(|b| counts.iter().any(|c| c[b] != counts[0][b])),
            "world size {world_size}: every rank's micro-batches keep as many items ({counts:?}): the test would \
             not tell the weights apart"
        );
        let ctx = format!("world size {world_size}, stage {stage}, accumulation {accumulation}");
        let dir = scratch("learner_items", &format!("w{world_size}-s{stage}-a{accumulation}"));
        let params = finished(&train(&dir, Some((world_size, stage, true)), accumulation), &ctx);
        let diff = max_abs_diff(&params, &reference);
        // Measured: 1.3e-7 to 4.1e-7 (f32 rounding: sums in another order).
        assert!(
            diff < 1e-5,
            "{ctx}: with the item count the parameters differ from the single-device Learner's by {diff}"
        );
    }
    // Equal weights (the default) on the same unequal counts: the mean of the ranks' means, another
    // gradient.
    let dir = scratch("learner_items", "equal-weights");
    let equal = finished(&train(&dir, Some((3, Stage::Two, false)), 1), "equal weights");
    let diff = max_abs_diff(&equal, &reference);
    // Measured: 0.084.
    assert!(
        diff > 1e-2,
        "equal weights on unequal counts differ from the single-device Learner by only {diff}: the data would not \
         tell the item count from the default"
    );
}
