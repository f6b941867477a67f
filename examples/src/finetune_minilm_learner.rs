//! `finetune-minilm-learner`: the MiniLM fine-tuning of `finetune-minilm`, written the way the
//! Burn book writes training: a `TrainStep`/`InferenceStep` model, a `Batcher`, data loaders,
//! `SupervisedTraining` with metrics and `Learner`. Sharding is one line: the
//! `with_training_strategy(ShardedStrategy::threads(..))` in [`run`].

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::AdamWConfig;
use burn::optim::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::prelude::*;
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::{
    ClassificationOutput, InferenceStep, Learner, LearningResult, SupervisedTraining, TrainOutput, TrainStep,
};
use burn_shard::{ShardConfig, Stage};
use burn_shard_train::{LineRenderer, ShardedStrategy};
use clap::Parser;

use crate::bert::SentenceClassifier;
use crate::cli::{at_least, positive_f64, probability};
use crate::finetune_minilm::{DataArgs, Loaded};
use crate::sentences::{Sentence, Task, batch};
use crate::training::training_device;

/// Options of `finetune-minilm-learner`.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "finetune-minilm-learner",
    about = "Fine-tunes pretrained all-MiniLM-L6-v2 on TREC or SST-2 through burn-train's Learner with ZeRO sharding (ranks as threads)"
)]
pub struct Args {
    /// Ranks (threads), one per copy of the CPU device.
    #[arg(long, default_value_t = 2, value_parser = at_least(1, 64))]
    pub world_size: usize,
    /// ZeRO stage: 0 (DDP), 1, 2 or 3 (FSDP).
    #[arg(long, default_value_t = Stage::Two)]
    pub stage: Stage,
    /// Data set: trec (6 question classes, 500 test questions) or sst2 (binary sentiment).
    #[arg(long, value_enum, default_value_t = Task::Trec)]
    pub task: Task,
    /// Weights, data and how much of it.
    #[command(flatten)]
    pub data: DataArgs,
    /// Epochs over the training sentences.
    #[arg(long, default_value_t = 1, value_parser = at_least(1, 1000))]
    pub epochs: usize,
    /// Global batch size (sentences per step over all ranks); a multiple of --world-size.
    #[arg(long, default_value_t = 32, value_parser = at_least(1, 1 << 20))]
    pub batch_size: usize,
    /// Learning rate (AdamW), decayed linearly to a tenth over the training.
    #[arg(long, default_value_t = 1e-4, value_parser = positive_f64)]
    pub lr: f64,
    /// Dropout of BERT's hidden states and attention, and before the head.
    #[arg(long, default_value_t = 0.1, value_parser = probability)]
    pub dropout: f64,
    /// Random seed (the head's initialisation, the data order, dropout).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Steps between progress lines when the output is not a terminal (in a terminal with the
    /// `tui` feature, burn-train's dashboard shows every step).
    #[arg(long, default_value_t = 20, value_parser = at_least(1, usize::MAX as u64))]
    pub log_every: usize,
    /// Plain progress lines also in a terminal, instead of burn-train's dashboard.
    #[arg(long)]
    pub plain: bool,
    /// burn-train's directory: its metric logs, and burn-shard's sharded checkpoints under
    /// `checkpoints/`.
    #[arg(long, default_value = "runs/finetune-minilm-learner")]
    pub out: PathBuf,
}

/// A batch of sentences: `ids` and `pad` `[batch, seq]` (as [`crate::bert::Bert::forward`]),
/// `labels` `[batch]`.
#[derive(Clone, Debug)]
pub struct SentenceBatch {
    /// WordPiece ids.
    pub ids: Tensor<2, Int>,
    /// True at padding.
    pub pad: Tensor<2, Bool>,
    /// Class ids.
    pub labels: Tensor<1, Int>,
}

/// Pads sentences into a [`SentenceBatch`] on the loader's device.
#[derive(Clone, Debug, Default)]
pub struct SentenceBatcher;

impl Batcher<Sentence, SentenceBatch> for SentenceBatcher {
    fn batch(&self, items: Vec<Sentence>, device: &Device) -> SentenceBatch {
        let refs: Vec<&Sentence> = items.iter().collect();
        let (ids, pad, labels) = batch(&refs, device);
        SentenceBatch { ids, pad, labels }
    }
}

impl SentenceClassifier {
    /// Logits, cross-entropy and targets of `batch`, as burn-train's classification metrics take them.
    pub fn forward_classification(&self, batch: SentenceBatch) -> ClassificationOutput {
        let logits = self.forward(batch.ids, batch.pad);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.labels.clone());
        ClassificationOutput::new(loss, logits, batch.labels)
    }
}

impl TrainStep for SentenceClassifier {
    type Input = SentenceBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: SentenceBatch) -> TrainOutput<ClassificationOutput> {
        let item = self.forward_classification(batch);
        // Scaled when ShardedStrategy runs a loss scaler (f16); the metrics get the unscaled loss.
        TrainOutput::new(self, burn_shard_train::scale_loss(item.loss.clone()).backward(), item)
    }
}

impl InferenceStep for SentenceClassifier {
    type Input = SentenceBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: SentenceBatch) -> ClassificationOutput {
        self.forward_classification(batch)
    }
}

/// Trains; burn-train's dashboard (in a terminal, with the `tui` feature) or burn-shard's
/// [`LineRenderer`] shows the progress; burn-train writes its metric logs under `--out`.
///
/// # Errors
/// Bad options, missing weights or data (each message says what to do), or a failed run
/// (burn-train's error, naming the failed ranks).
pub fn run(args: Args) -> Result<LearningResult<SentenceClassifier>, String> {
    if !args.batch_size.is_multiple_of(args.world_size) {
        return Err(format!(
            "--batch-size {} is not a multiple of --world-size {}: each rank takes an equal part of a step's batch",
            args.batch_size, args.world_size
        ));
    }
    let Loaded {
        source,
        train,
        eval: valid,
        config,
        model_dir,
    } = args.data.load(args.task)?;
    let device = training_device(args.stage);
    let bert = config
        .init(args.dropout, &device)
        .load_safetensors(&model_dir.join("model.safetensors"))?;
    let model = SentenceClassifier::new(bert, args.task.classes(), args.dropout, args.seed, &device);
    device.seed(args.seed);

    let per_rank = args.batch_size / args.world_size;
    let train_loader: Arc<dyn DataLoader<SentenceBatch>> = DataLoaderBuilder::new(SentenceBatcher)
        .batch_size(per_rank)
        .shuffle(args.seed)
        .build(InMemDataset::new(train.clone()));
    let valid_loader: Arc<dyn DataLoader<SentenceBatch>> = DataLoaderBuilder::new(SentenceBatcher)
        .batch_size(per_rank)
        .build(InMemDataset::new(valid.clone()));
    let steps = args.epochs * (train.len() / args.world_size).div_ceil(per_rank);
    let scheduler = LinearLrSchedulerConfig::new(args.lr, args.lr / 10.0, steps.max(1))
        .init()
        .map_err(|e| format!("learning-rate schedule: {e}"))?;
    let optim = AdamWConfig::new().with_weight_decay(0.01);
    println!(
        "{source}: {} training / {} validation sentences; all-MiniLM-L6-v2 ({} params); world_size {}, stage {}, \
         {} epochs, {steps} steps of {} sentences",
        train.len(),
        valid.len(),
        model.num_params(),
        args.world_size,
        args.stage,
        args.epochs,
        args.batch_size,
    );

    let mut training = SupervisedTraining::new(&args.out, train_loader, valid_loader)
        .metrics((LossMetric::new(), AccuracyMetric::new()))
        .num_epochs(args.epochs)
        .label(&format!("all-MiniLM-L6-v2 on {}", args.task));
    // In a terminal, burn-train's dashboard (the `tui` feature) and its summary; elsewhere (a
    // log file, CI) a line every --log-every steps and a summary of each epoch.
    if cfg!(feature = "tui") && !args.plain && std::io::stdout().is_terminal() {
        training = training.summary();
    } else {
        training = training.renderer(Box::new(LineRenderer::new(args.log_every * args.batch_size)));
    }
    let result = training
        // The one sharding-specific line: ZeRO stage `--stage` over `--world-size` ranks.
        .with_training_strategy(
            ShardedStrategy::threads(
                ShardConfig::new(args.stage),
                optim.clone(),
                vec![device; args.world_size],
            )
            .into(),
        )
        .launch(Learner::new(model, optim.init(), scheduler));
    match &result.error {
        Some(e) => Err(format!("training failed: {e}")),
        None => Ok(result),
    }
}
