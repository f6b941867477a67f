//! `finetune-stories`: loads the pretrained `stories260K` tiny Llama (llama2.c format) and its
//! tokenizer, shows its greedy story (the port's check), then fine-tunes it on tiny
//! shakespeare with ZeRO sharding (stage 3 by default) and shows the validation loss before
//! and after and a sample.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::Module;
use burn::optim::AdamWConfig;
use burn::prelude::*;
use burn_shard::comm::{Collective, InProcessComm, InProcessGroup, run_ranks};
use burn_shard::{MemoryReport, ShardError, Stage};
use clap::Parser;
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::char_data::global_batch_slice;
use crate::cli::{ShardArgs, at_least, positive_f64};
use crate::data_dir::examples_data_dir;
use crate::llama::{Llama, LlamaConfig};
use crate::llama2c_tokenizer::{BOS, Llama2cTokenizer};
use crate::metrics::Metrics;
use crate::training::{
    Progress, StepEnd, end_step, lr_at, mean_over_ranks, read_data, resume, train_step, training_device,
};

/// Options of `finetune-stories`.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "finetune-stories",
    about = "Fine-tunes the pretrained stories260K tiny Llama on tiny shakespeare with ZeRO sharding (ranks as threads); default stage 3"
)]
pub struct Args {
    /// World size, stage, checkpoints.
    #[command(flatten)]
    pub shard: ShardArgs,
    /// llama2.c checkpoint (default: examples/data/stories260K/stories260K.bin).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Its llama2.c tokenizer (default: examples/data/stories260K/tok512.bin).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Text to fine-tune on, split 90/10 into train and validation (default: examples/data/tinyshakespeare.txt).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Use only the first N characters of --data (quick checks).
    #[arg(long)]
    pub limit_chars: Option<usize>,
    /// Optimizer steps.
    #[arg(long, default_value_t = 600, value_parser = at_least(1, usize::MAX as u64))]
    pub steps: usize,
    /// Global batch size (windows per step over all ranks); a multiple of --world-size.
    #[arg(long, default_value_t = 16, value_parser = at_least(1, 1 << 20))]
    pub batch_size: usize,
    /// Window length in tokens, 1 to the model's context (512).
    #[arg(long, default_value_t = 128, value_parser = at_least(1, 1 << 16))]
    pub block_size: usize,
    /// Peak learning rate (AdamW; linear warm-up over 5% of the steps, cosine decay to 10%).
    #[arg(long, default_value_t = 2e-3, value_parser = positive_f64)]
    pub lr: f64,
    /// AdamW weight decay.
    #[arg(long, default_value_t = 0.01)]
    pub weight_decay: f32,
    /// Steps between validation estimates (also before the first and after the last step).
    #[arg(long, default_value_t = 100, value_parser = at_least(1, usize::MAX as u64))]
    pub eval_interval: usize,
    /// Validation batches per estimate (global batches of --batch-size windows, split over the
    /// ranks; the same windows every time).
    #[arg(long, default_value_t = 8, value_parser = at_least(1, usize::MAX as u64))]
    pub eval_batches: usize,
    /// Tokens of the samples printed before and after fine-tuning.
    #[arg(long, default_value_t = 120)]
    pub sample_tokens: usize,
    /// Random seed (batches, sampling).
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    /// Folder for metrics.csv and losses.png.
    #[arg(long, default_value = "runs/finetune-stories")]
    pub out: PathBuf,
}

/// What a run measured.
#[derive(Debug)]
pub struct Summary {
    /// The step training started from (0, or the resumed checkpoint's).
    pub start: usize,
    /// The pretrained model's greedy continuation of BOS (its story).
    pub pretrained_story: String,
    /// Every training loss and validation estimate (rank 0's copy; all ranks agree).
    pub metrics: Metrics,
    /// A sample of the fine-tuned model (temperature 0.8).
    pub sample: String,
    /// Wall time of training and evaluation, seconds.
    pub seconds: f64,
    /// Rank 0's bytes held after training.
    pub memory: MemoryReport,
}

/// The greedy continuation of BOS by `model`, `tokens` long, as text.
pub fn greedy_story(model: &Llama, tokenizer: &Llama2cTokenizer, tokens: usize, context: usize) -> String {
    let mut rng = StdRng::seed_from_u64(0);
    let out = model.generate(&[BOS], tokens, context, 0.0, &mut rng, &Device::flex());
    tokenizer.decode(BOS, &out)
}

/// Runs the fine-tuning; prints progress, the story and the sample, writes `metrics.csv` and
/// `losses.png`.
///
/// # Errors
/// Bad options, unreadable or malformed model, tokenizer or text, or a failed rank.
pub fn run(mut args: Args) -> Result<Summary, String> {
    args.shard.resolve_resume()?;
    args.shard.check_batch(args.batch_size)?;
    let stage = args.shard.stage_or(Stage::Three);
    let data_dir = examples_data_dir();
    let model_path = args
        .model
        .clone()
        .unwrap_or_else(|| data_dir.join("stories260K/stories260K.bin"));
    let tok_path = args
        .tokenizer
        .clone()
        .unwrap_or_else(|| data_dir.join("stories260K/tok512.bin"));
    let text_path = args
        .data
        .clone()
        .unwrap_or_else(|| data_dir.join("tinyshakespeare.txt"));

    let device = training_device(stage);
    // The header and the file's length are checked here; the ranks read the weights in
    // `init_pretrained`. `base` is lazy (nothing initialised): for its size.
    let (config, _) = Llama::llama2c_pretrained(&model_path)?;
    let base = config.init(&device);
    if args.block_size > config.seq_len {
        return Err(format!(
            "--block-size {} is longer than the model's context {}",
            args.block_size, config.seq_len
        ));
    }
    let tokenizer = Llama2cTokenizer::from_file(&tok_path, config.vocab_size)?;
    println!("{} ({} params)", model_path.display(), base.num_params());

    let bytes = read_data(&text_path)?;
    let mut text = String::from_utf8_lossy(&bytes).into_owned();
    if let Some(n) = args.limit_chars {
        text = text.chars().take(n).collect();
    }
    let ids: Vec<u16> = tokenizer
        .encode(&text, false)
        .into_iter()
        .map(|t| u16::try_from(t).map_err(|_| format!("token {t}: vocabularies over 65,536 tokens are not supported")))
        .collect::<Result<_, _>>()?;
    let split = ids.len() * 9 / 10;
    let (train, val) = ids.split_at(split);
    if val.len() <= args.block_size + 1 {
        return Err(format!(
            "{}: its 10% validation split has {} tokens, too few for --block-size {}",
            text_path.display(),
            val.len(),
            args.block_size
        ));
    }
    println!(
        "{}: {} bytes -> {} train / {} val tokens ({:.2} bytes per token); world_size {}, stage {stage}, {} steps of {}x{} tokens",
        text_path.display(),
        text.len(),
        train.len(),
        val.len(),
        text.len() as f64 / ids.len() as f64,
        args.shard.world_size,
        args.steps,
        args.batch_size,
        args.block_size
    );

    let started = Instant::now();
    let group = InProcessGroup::new(args.shard.world_size).map_err(|e| e.to_string())?;
    let mut outcomes = run_ranks(group, |comm| {
        train_rank(&args, stage, (&config, &model_path), train, val, &tokenizer, comm)
    })
    .map_err(|e| e.to_string())?
    .into_iter()
    .collect::<Result<Vec<_>, ShardError>>()
    .map_err(|e| e.to_string())?;
    let seconds = started.elapsed().as_secs_f64();
    let (start, metrics, memory, [story, sample]) = outcomes.swap_remove(0);
    let (story, sample) = (story.unwrap_or_default(), sample.unwrap_or_default());
    println!("--- sample after fine-tuning (temperature 0.8) ---\n{sample}\n--------------");
    let [csv, png] = metrics.write(
        &args.out,
        &format!("stories260K fine-tuned on tiny shakespeare, stage {stage}"),
    )?;
    let vals: Vec<f32> = metrics.rows.iter().filter_map(|r| r.val_loss).collect();
    println!("{memory}");
    println!(
        "final: val loss {:.4} -> {:.4} nats/token | {:.1} s | wrote {} and {}",
        vals.first().copied().unwrap_or(f32::NAN),
        vals.last().copied().unwrap_or(f32::NAN),
        seconds,
        csv.display(),
        png.display()
    );
    Ok(Summary {
        start,
        pretrained_story: story,
        metrics,
        sample,
        seconds,
        memory,
    })
}

/// Rank 0's pretrained story and sample (`None` on the other ranks).
type RankOutcome = (usize, Metrics, MemoryReport, [Option<String>; 2]);

#[allow(clippy::too_many_arguments)]
fn train_rank(
    args: &Args,
    stage: Stage,
    (config, model_path): (&LlamaConfig, &Path),
    train: &[u16],
    val: &[u16],
    tokenizer: &Llama2cTokenizer,
    comm: InProcessComm,
) -> Result<RankOutcome, ShardError> {
    let rank = comm.rank();
    let device = training_device(stage);
    let local = args.batch_size / args.shard.world_size;
    let optimizer = AdamWConfig::new().with_weight_decay(args.weight_decay);
    // Built lazily and loaded by `init_pretrained` straight into this rank's shards.
    let (_, pretrained) = Llama::llama2c_pretrained(model_path).map_err(ShardError::InvalidConfig)?;
    let (model, mut optim) =
        args.shard
            .shard_config(stage)
            .init_pretrained(config.init(&device), pretrained, optimizer, comm)?;
    // The pretrained model's story, told by the sharded model (at stage 3 every rank takes
    // part in each forward's gathers; greedy, so all ranks generate the same tokens).
    let story = greedy_story(&model.valid(), tokenizer, args.sample_tokens, config.seq_len);
    if rank == 0 {
        println!("pretrained, from BOS, greedy:\n  {story}");
    }
    let story = (rank == 0).then_some(story);
    let (mut model, start) = resume(&args.shard, &mut optim, model, args.steps)?;
    let world_size = args.shard.world_size;
    // Global batch `b` of the validation windows, the same at every world size.
    let validate = |model: &Llama, comm: &dyn Collective| {
        let eval = model.valid();
        let mut sum = 0.0;
        for b in 0..args.eval_batches {
            let seed = (args.seed ^ 0x7a11_da7e, b as u64);
            let (x, y) = global_batch_slice(val, seed, (rank, world_size, local), args.block_size, &Device::flex());
            sum += eval.loss(x, y).into_scalar::<f32>();
        }
        mean_over_ranks(comm, sum / args.eval_batches as f32)
    };

    // A resumed run continues the curves of the run it resumes, when they are in --out.
    let mut metrics = Metrics::earlier(&args.out, start).map_err(ShardError::InvalidConfig)?;
    let progress = Progress::new(rank, args.steps, start);
    if start == 0 {
        let loss = validate(&model, optim.comm())?;
        progress.println(&format!("step     0: val loss {loss:.4} (pretrained)"));
        metrics.val(0, loss, None);
    }
    for step in start..args.steps {
        let (x, y) = global_batch_slice(
            train,
            (args.seed, step as u64),
            (rank, world_size, local),
            args.block_size,
            &device,
        );
        let loss = model.loss(x, y);
        let (stepped, train_loss) = train_step(
            &mut optim,
            model,
            loss,
            lr_at(step, args.steps, args.lr, args.steps / 20),
        )?;
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
            |model, comm| Ok((validate(model, comm)?, None)),
        )?;
    }
    progress.finish();
    let memory = optim.report().memory(&model);
    // At stage 3 unsharding is a collective, so every rank takes part; then rank 0 samples.
    let full = model.valid().materialize();
    let sample = (rank == 0).then(|| {
        let mut rng = StdRng::seed_from_u64(args.seed);
        let prompt = tokenizer.encode("ROMEO:\n", true);
        let out = full.generate(
            &prompt,
            args.sample_tokens,
            config.seq_len,
            0.8,
            &mut rng,
            &Device::flex(),
        );
        format!("ROMEO:\n{}", tokenizer.decode(*prompt.last().expect("prompt"), &out))
    });
    Ok((start, metrics, memory, [story, sample]))
}
