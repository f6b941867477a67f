//! `finetune-minilm`: fine-tunes the pretrained all-MiniLM-L6-v2 encoder (BERT, 6 layers,
//! hidden 384, 22.7M parameters) with mean pooling and a linear head on SST-2 (or TREC), with
//! ZeRO sharding over ranks that are threads on the CPU backend.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::AdamWConfig;
use burn::prelude::*;
use burn_shard::comm::{Collective, InProcessComm, InProcessGroup, ReduceOp, run_ranks};
use burn_shard::{MemoryReport, ShardError, Stage};
use clap::Parser;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use crate::bert::{BertConfig, SentenceClassifier};
use crate::cli::{ShardArgs, at_least, positive_f64, probability};
use crate::data_dir::examples_data_dir;
use crate::metrics::Metrics;
use crate::minilm_weights;
use crate::sentences::{Sentence, Task, batch, load_tokenizer, read_labelled};
use crate::training::{Progress, StepEnd, end_step, lr_at, resume, train_step, training_device};

/// Options of `finetune-minilm`.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "finetune-minilm",
    about = "Fine-tunes pretrained all-MiniLM-L6-v2 on SST-2 or TREC with ZeRO sharding (ranks as threads); default stage 2"
)]
pub struct Args {
    /// World size, stage, checkpoints.
    #[command(flatten)]
    pub shard: ShardArgs,
    /// Data set: sst2 (binary sentiment, scored on the 872-sentence dev set) or trec (6 question classes, 500 test questions).
    #[arg(long, value_enum, default_value_t = Task::Sst2)]
    pub task: Task,
    /// Weights, data and how much of it.
    #[command(flatten)]
    pub data: DataArgs,
    /// Optimizer steps.
    #[arg(long, default_value_t = 400, value_parser = at_least(1, usize::MAX as u64))]
    pub steps: usize,
    /// Global batch size (sentences per step over all ranks); a multiple of --world-size.
    #[arg(long, default_value_t = 16, value_parser = at_least(1, 1 << 20))]
    pub batch_size: usize,
    /// Peak learning rate (AdamW; linear warm-up over --warmup of the steps, cosine decay to 10%).
    #[arg(long, default_value_t = 1e-4, value_parser = positive_f64)]
    pub lr: f64,
    /// Share of the steps spent warming up, in [0, 1).
    #[arg(long, default_value_t = 0.1, value_parser = probability)]
    pub warmup: f64,
    /// AdamW weight decay.
    #[arg(long, default_value_t = 0.01)]
    pub weight_decay: f32,
    /// Dropout of BERT's hidden states and attention, and before the head.
    #[arg(long, default_value_t = 0.1, value_parser = probability)]
    pub dropout: f64,
    /// Steps between evaluations on the dev set (also before the first and after the last step).
    #[arg(long, default_value_t = 100, value_parser = at_least(1, usize::MAX as u64))]
    pub eval_interval: usize,
    /// Sentences per evaluation batch per rank.
    #[arg(long, default_value_t = 64, value_parser = at_least(1, 1 << 20))]
    pub eval_batch_size: usize,
    /// Random seed (head initialisation, data order, dropout).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Folder for metrics.csv and losses.png.
    #[arg(long, default_value = "runs/finetune-minilm")]
    pub out: PathBuf,
}

/// Where the MiniLM weights and the sentence data are, and how much of them to use: the
/// options `finetune-minilm` and `finetune-minilm-learner` share (`#[command(flatten)]`).
#[derive(clap::Args, Debug, Clone)]
pub struct DataArgs {
    /// Folder with all-MiniLM-L6-v2's model.safetensors and config.json (default: the cache
    /// that `cargo xtask fetch-minilm` fills).
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// Folder with sst2/, trec/ and all-MiniLM-L6-v2-tokenizer/ (default: examples/data).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Longest sentence in tokens, `[CLS]` and `[SEP]` included (longer ones are truncated), 2-512.
    #[arg(long, default_value_t = 64, value_parser = at_least(2, 512))]
    pub max_len: usize,
    /// Train on the first N training sentences only (quick checks).
    #[arg(long, value_parser = at_least(1, usize::MAX as u64))]
    pub limit_train: Option<usize>,
    /// Evaluate on the first N evaluation sentences only (quick checks).
    #[arg(long, value_parser = at_least(1, usize::MAX as u64))]
    pub limit_eval: Option<usize>,
}

/// What [`DataArgs::load`] read.
pub struct Loaded {
    /// What was read, for the output: the data set and its two files, e.g. `TREC
    /// (examples/data/trec/TREC.train.all, examples/data/trec/TREC.test.all)`.
    pub source: String,
    /// Tokenized training sentences.
    pub train: Vec<Sentence>,
    /// Tokenized evaluation sentences (SST-2's dev set, TREC's test set).
    pub eval: Vec<Sentence>,
    /// The model's `config.json`.
    pub config: BertConfig,
    /// Where `model.safetensors` is.
    pub model_dir: PathBuf,
}

impl DataArgs {
    /// Tokenizes `task`'s sentences and reads the model's config, checking that the weights
    /// are there and that the tokenizer and `--max-len` fit the model.
    ///
    /// # Errors
    /// Missing weights (naming `cargo xtask fetch-minilm`), missing or malformed data, a
    /// tokenizer or `--max-len` the model cannot take.
    pub fn load(&self, task: Task) -> Result<Loaded, String> {
        let data_dir = self.data_dir.clone().unwrap_or_else(examples_data_dir);
        let model_dir = self.model_dir.clone().unwrap_or_else(minilm_weights::default_model_dir);
        minilm_weights::require_files(&model_dir)?;
        let tokenizer = load_tokenizer(
            &data_dir.join("all-MiniLM-L6-v2-tokenizer/tokenizer.json"),
            self.max_len,
        )?;
        let (train_path, eval_path) = task.files(&data_dir);
        let mut train = read_labelled(&train_path, task.classes(), &tokenizer)?;
        let mut eval = read_labelled(&eval_path, task.classes(), &tokenizer)?;
        train.truncate(self.limit_train.unwrap_or(usize::MAX));
        eval.truncate(self.limit_eval.unwrap_or(usize::MAX));
        let config = BertConfig::from_file(&model_dir.join("config.json"))?;
        if self.max_len > config.max_position_embeddings {
            return Err(format!(
                "--max-len {} is longer than the model's {} positions",
                self.max_len, config.max_position_embeddings
            ));
        }
        if tokenizer.get_vocab_size(true) > config.vocab_size {
            return Err(format!(
                "the tokenizer has {} tokens, the model's embedding {}: they do not belong together",
                tokenizer.get_vocab_size(true),
                config.vocab_size
            ));
        }
        Ok(Loaded {
            source: format!("{task} ({}, {})", train_path.display(), eval_path.display()),
            train,
            eval,
            config,
            model_dir,
        })
    }
}

/// What a run measured.
#[derive(Debug)]
pub struct Summary {
    /// The step training started from (0, or the resumed checkpoint's).
    pub start: usize,
    /// Every training loss and evaluation (rank 0's copy; all ranks agree).
    pub metrics: Metrics,
    /// Dev-set accuracy after the last step, `[0, 1]`.
    pub accuracy: f32,
    /// Wall time of training and evaluation, seconds.
    pub seconds: f64,
    /// Rank 0's bytes held after training.
    pub memory: MemoryReport,
}

/// Runs the fine-tuning; prints progress and a summary, writes `metrics.csv` and `losses.png`.
///
/// # Errors
/// Bad options, missing or wrong weights or data (each message says what to do), or a failed
/// rank.
pub fn run(mut args: Args) -> Result<Summary, String> {
    args.shard.resolve_resume()?;
    args.shard.check_batch(args.batch_size)?;
    let stage = args.shard.stage_or(Stage::Two);
    let Loaded {
        source,
        train,
        eval,
        config,
        model_dir,
    } = args.data.load(args.task)?;
    if train.len() < args.batch_size {
        return Err(format!(
            "{} training sentences are fewer than --batch-size {}",
            train.len(),
            args.batch_size
        ));
    }
    let device = training_device(stage);
    let weights = model_dir.join("model.safetensors");
    // Checks the file is there (the message says how to fetch it); the ranks read it.
    drop(SentenceClassifier::pretrained(&weights)?);
    // Lazy (nothing initialised or loaded): for its size; each rank builds its own.
    let base = SentenceClassifier::new(
        config.init(args.dropout, &device),
        args.task.classes(),
        args.dropout,
        args.seed,
        &device,
    );
    // Dropout draws from Burn's CPU generator, which is one per process and shared by the rank
    // threads in the order they ask: seeded once, but not reproducible draw for draw.
    device.seed(args.seed);
    println!(
        "{source}: {} training / {} eval sentences (up to {} tokens); all-MiniLM-L6-v2 from {} ({} params); \
         world_size {}, stage {stage}, {} steps of {} sentences",
        train.len(),
        eval.len(),
        args.data.max_len,
        model_dir.display(),
        base.num_params(),
        args.shard.world_size,
        args.steps,
        args.batch_size,
    );

    let started = Instant::now();
    let group = InProcessGroup::new(args.shard.world_size).map_err(|e| e.to_string())?;
    let mut outcomes = run_ranks(group, |comm| {
        train_rank(&args, stage, &train, &eval, (&config, &weights), comm)
    })
    .map_err(|e| e.to_string())?
    .into_iter()
    .collect::<Result<Vec<_>, ShardError>>()
    .map_err(|e| match e {
        ShardError::PretrainedMismatch { .. } | ShardError::PretrainedRead { .. } => format!(
            "{e}\n(is its config.json the one that came with it? for all-MiniLM-L6-v2, delete the folder and run \
             `cargo xtask fetch-minilm`)"
        ),
        e => e.to_string(),
    })?;
    let seconds = started.elapsed().as_secs_f64();
    let (start, metrics, memory) = outcomes.swap_remove(0);
    let accuracy = metrics
        .rows
        .iter()
        .rev()
        .find_map(|r| r.val_accuracy)
        .unwrap_or(f32::NAN);
    let [csv, png] = metrics.write(&args.out, &format!("all-MiniLM-L6-v2 on {}, stage {stage}", args.task))?;
    println!("{memory}");
    println!(
        "final: {} accuracy {:.2}% on {} sentences | {:.1} s | wrote {} and {}",
        args.task,
        accuracy * 100.0,
        eval.len(),
        seconds,
        csv.display(),
        png.display()
    );
    Ok(Summary {
        start,
        metrics,
        accuracy,
        seconds,
        memory,
    })
}

fn train_rank(
    args: &Args,
    stage: Stage,
    train: &[Sentence],
    eval: &[Sentence],
    (config, weights): (&BertConfig, &Path),
    comm: InProcessComm,
) -> Result<(usize, Metrics, MemoryReport), ShardError> {
    let rank = comm.rank();
    let device = training_device(stage);
    let local = args.batch_size / args.shard.world_size;
    let optimizer = AdamWConfig::new().with_weight_decay(args.weight_decay);
    // Built lazily and loaded by `init_pretrained` straight into this rank's shards: no rank
    // holds the whole pretrained encoder at stage 3 (the head is new: rank 0's, broadcast).
    let model = SentenceClassifier::new(
        config.init(args.dropout, &device),
        args.task.classes(),
        args.dropout,
        args.seed,
        &device,
    );
    let pretrained = SentenceClassifier::pretrained(weights).map_err(ShardError::InvalidConfig)?;
    let (model, mut optim) = args
        .shard
        .shard_config(stage)
        .init_pretrained(model, pretrained, optimizer, comm)?;
    let (mut model, start) = resume(&args.shard, &mut optim, model, args.steps)?;

    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    // A resumed run continues the curves of the run it resumes, when they are in --out.
    let mut metrics = Metrics::earlier(&args.out, start).map_err(ShardError::InvalidConfig)?;
    let progress = Progress::new(rank, args.steps, start);
    if start == 0 {
        let (loss, accuracy) = evaluate(&model, eval, args.eval_batch_size, optim.comm())?;
        progress.println(&format!(
            "step     0: val loss {loss:.4}, accuracy {:.2}%",
            accuracy * 100.0
        ));
        metrics.val(0, loss, Some(accuracy));
    }
    // Every rank walks the same shuffled order; global batch i is sentences [i*B, (i+1)*B) of
    // it and this rank takes its `local` slice, so the step equals one on the whole batch.
    let per_epoch = train.len() / args.batch_size;
    let mut order: Vec<usize> = (0..train.len()).collect();
    let mut epoch = usize::MAX;
    for step in start..args.steps {
        if step / per_epoch != epoch {
            epoch = step / per_epoch;
            order = (0..train.len()).collect();
            order.shuffle(&mut StdRng::seed_from_u64(args.seed.wrapping_add(epoch as u64)));
        }
        let first = (step % per_epoch) * args.batch_size + rank * local;
        let sentences: Vec<&Sentence> = order[first..first + local].iter().map(|&i| &train[i]).collect();
        let (ids, pad, labels) = batch(&sentences, &device);
        let loss = loss_fn.forward(model.forward(ids, pad), labels);
        let lr = lr_at(step, args.steps, args.lr, (args.steps as f64 * args.warmup) as usize);
        let (stepped, train_loss) = train_step(&mut optim, model, loss, lr)?;
        model = stepped;
        end_step(
            StepEnd {
                done: step + 1,
                steps: args.steps,
                eval_interval: args.eval_interval,
                train_loss,
            },
            &args.shard,
            &optim,
            &model,
            &mut metrics,
            &progress,
            |model, comm| {
                let (loss, accuracy) = evaluate(model, eval, args.eval_batch_size, comm)?;
                Ok((loss, Some(accuracy)))
            },
        )?;
    }
    progress.finish();
    let memory = optim.report().memory(&model);
    Ok((start, metrics, memory))
}

/// Mean loss and accuracy over `eval`, split over the ranks (rank `r` takes sentences `r`,
/// `r + W`, ...). A collective: at stage 3 every forward gathers, so every rank runs the same
/// number of batches (a rank out of sentences runs one it then ignores).
fn evaluate(
    model: &SentenceClassifier,
    eval: &[Sentence],
    batch_size: usize,
    comm: &dyn Collective,
) -> Result<(f32, f32), ShardError> {
    let model = model.valid();
    let device = Device::flex();
    let (rank, world) = (comm.rank(), comm.world_size());
    let mine: Vec<&Sentence> = eval.iter().skip(rank).step_by(world).collect();
    let most = eval.len().div_ceil(world);
    let (mut loss_sum, mut correct) = (0.0f64, 0.0f64);
    for b in 0..most.div_ceil(batch_size) {
        let part = &mine[(b * batch_size).min(mine.len())..((b + 1) * batch_size).min(mine.len())];
        let stand_in = [&eval[0]];
        let sentences = if part.is_empty() { &stand_in[..] } else { part };
        let (ids, pad, labels) = batch(sentences, &device);
        let logits = model.forward(ids, pad);
        if part.is_empty() {
            continue;
        }
        let n = sentences.len();
        let loss = CrossEntropyLossConfig::new()
            .init(&device)
            .forward(logits.clone(), labels.clone())
            .into_scalar::<f32>();
        loss_sum += f64::from(loss) * n as f64;
        correct += logits
            .argmax(1)
            .squeeze_dim::<1>(1)
            .equal(labels)
            .int()
            .sum()
            .into_scalar::<i64>() as f64;
    }
    let totals = Tensor::<1>::from_floats([loss_sum as f32, correct as f32], &device);
    let totals: Vec<f32> = comm
        .all_reduce(totals, ReduceOp::Sum)?
        .into_data()
        .convert::<f32>()
        .iter::<f32>()
        .collect();
    let n = eval.len().max(1) as f32;
    Ok((totals[0] / n, totals[1] / n))
}
