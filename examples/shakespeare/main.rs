//! Trains a small character-level GPT on tiny shakespeare with ZeRO sharding, ranks as threads
//! on the CPU backend.
//!
//! ```text
//! cargo run --release -p burn-shard-examples --bin shakespeare -- --world-size 2 --stage 2
//! ```

use std::path::PathBuf;
use std::time::Instant;

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::prelude::*;
use burn_shard::comm::{Collective, InProcessGroup, ReduceOp, run_ranks};
use burn_shard::{MemoryReport, ShardConfig, ShardError, Stage};
use burn_shard_examples::char_data::{CharCorpus, sample_batch};
use burn_shard_examples::gpt::{Gpt, GptConfig};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use rand::SeedableRng;
use rand::rngs::StdRng;

#[derive(Parser, Debug, Clone)]
#[command(about = "Char-level GPT on tiny shakespeare, trained with ZeRO sharding (ranks as threads)")]
struct Args {
    /// Number of ranks (threads), 1-1024; the global batch is split evenly between them.
    #[arg(long, default_value_t = 2, value_parser = at_least(1, 1024))]
    world_size: usize,
    /// ZeRO stage: 0 (data parallel), 1 (optimizer state sharded), 2 (+ gradients sharded),
    /// 3 (+ parameters sharded, FSDP).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(0..=3))]
    stage: u8,
    /// Optimizer steps.
    #[arg(long, default_value_t = 2000, value_parser = at_least(1, usize::MAX as u64))]
    steps: usize,
    /// Global batch size (sequences per step, over all ranks); must divide by world size.
    #[arg(long, default_value_t = 32, value_parser = at_least(1, 1 << 20))]
    batch_size: usize,
    /// Context length in characters, 1-65536 (and shorter than the validation split).
    #[arg(long, default_value_t = 64, value_parser = at_least(1, 1 << 16))]
    block_size: usize,
    /// Embedding width, 1-65536; a multiple of --n-head.
    #[arg(long, default_value_t = 128, value_parser = at_least(1, 1 << 16))]
    n_embd: usize,
    /// Attention heads, 1-1024.
    #[arg(long, default_value_t = 4, value_parser = at_least(1, 1024))]
    n_head: usize,
    /// Transformer blocks, 1-1024.
    #[arg(long, default_value_t = 4, value_parser = at_least(1, 1024))]
    n_layer: usize,
    /// Peak learning rate, a finite number above 0 (linear warm-up over 5% of the steps, cosine
    /// decay to 10%).
    #[arg(long, default_value_t = 3e-3, value_parser = positive_f64)]
    lr: f64,
    /// Steps between validation estimates (at least 1).
    #[arg(long, default_value_t = 250, value_parser = at_least(1, usize::MAX as u64))]
    eval_interval: usize,
    /// Validation batches per rank per estimate (at least 1).
    #[arg(long, default_value_t = 8, value_parser = at_least(1, usize::MAX as u64))]
    eval_batches: usize,
    /// Random seed (model init, batch sampling, generation).
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Characters to generate at the end.
    #[arg(long, default_value_t = 300)]
    sample_chars: usize,
    /// Training text (default: the copy shipped with the examples).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Save sharded checkpoints under this directory (`DIR/step-000500`, ...), every
    /// --save-every steps and after the last step.
    #[arg(long)]
    save_dir: Option<PathBuf>,
    /// Steps between checkpoints when --save-dir is given (at least 1).
    #[arg(long, default_value_t = 500, value_parser = at_least(1, usize::MAX as u64))]
    save_every: usize,
    /// Checkpoints kept under --save-dir (the newest ones; at least 1).
    #[arg(long, default_value_t = 3, value_parser = at_least(1, 1 << 20))]
    keep: usize,
    /// Resume from this checkpoint (a `step-*` directory, or a --save-dir, whose newest
    /// checkpoint is taken), at any --world-size and --stage.
    #[arg(long)]
    resume: Option<PathBuf>,
}

struct RankOutcome {
    /// The step training started from (0, or the resumed checkpoint's).
    start: usize,
    val_loss: f32,
    memory: MemoryReport,
    sample: Option<String>,
}

/// A `usize` option in `min..=max`; clap names the option and the range in its error.
fn at_least(min: u64, max: u64) -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new().range(min..=max)
}

fn positive_f64(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        Ok(v) => Err(format!("{v} is not a finite number above 0")),
        Err(e) => Err(e.to_string()),
    }
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(args) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(mut args: Args) -> Result<(), String> {
    if let Some(dir) = &args.resume
        && !dir.join("meta.json").exists()
    {
        // A --save-dir: its newest complete checkpoint.
        let newest = burn_shard::checkpoint::list(dir).map_err(|e| e.to_string())?.pop();
        args.resume = Some(newest.ok_or_else(|| format!("--resume {}: no complete checkpoint there", dir.display()))?);
    }
    let stage = Stage::try_from(args.stage).map_err(|e| e.to_string())?;
    if !args.n_embd.is_multiple_of(args.n_head) {
        return Err(format!(
            "--n-embd {} must be a multiple of --n-head {}",
            args.n_embd, args.n_head
        ));
    }
    if !args.batch_size.is_multiple_of(args.world_size) {
        return Err(format!(
            "--batch-size {} must be a positive multiple of --world-size {}",
            args.batch_size, args.world_size
        ));
    }
    let path = args
        .data
        .clone()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/tinyshakespeare.txt"));
    let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let corpus = CharCorpus::new(&text);
    if corpus.val.len() <= args.block_size + 1 {
        return Err(format!(
            "{} is too short for --block-size {}: its 10% validation split has {} characters",
            path.display(),
            args.block_size,
            corpus.val.len()
        ));
    }
    let config = GptConfig {
        vocab_size: corpus.vocab_size(),
        block_size: args.block_size,
        n_embd: args.n_embd,
        n_head: args.n_head,
        n_layer: args.n_layer,
    };
    let device = training_device(stage);
    device.seed(args.seed);
    let base = Gpt::new(&config, &device);
    println!(
        "{}: {} train / {} val chars, vocab {}; GPT {} params; world_size {}, stage {}, {} steps of {}x{} chars",
        path.display(),
        corpus.train.len(),
        corpus.val.len(),
        corpus.vocab_size(),
        base.num_params(),
        args.world_size,
        stage,
        args.steps,
        args.batch_size,
        args.block_size
    );

    let start = Instant::now();
    let group = InProcessGroup::new(args.world_size).map_err(|e| e.to_string())?;
    let outcomes = run_ranks(group, |comm| train_rank(&args, stage, &config, &corpus, &base, comm))
        .map_err(|e| e.to_string())?
        .into_iter()
        .collect::<Result<Vec<_>, ShardError>>()
        .map_err(|e| e.to_string())?;
    let seconds = start.elapsed().as_secs_f64();

    if let Some(sample) = &outcomes[0].sample {
        println!("--- sample ---\n{sample}\n--------------");
    }
    for o in &outcomes {
        println!("{}", o.memory);
    }
    let tokens = ((args.steps - outcomes[0].start) * args.batch_size * args.block_size) as f64;
    let m = &outcomes[0].memory;
    println!(
        "final: val loss {:.4} nats/char | {:.0} tokens/s | {:.1} s | per-rank memory: params {:.2} MiB, grads {:.2} MiB, optim {:.2} MiB",
        outcomes[0].val_loss,
        tokens / seconds,
        seconds,
        m.parameters_bytes as f64 / 1048576.0,
        m.gradients_bytes as f64 / 1048576.0,
        m.optimizer_state_bytes as f64 / 1048576.0,
    );
    Ok(())
}

/// Prints a line above rank 0's progress bar (no-op on other ranks). `suspend` + `println`,
/// not `bar.println`, so the line also reaches a log that is not a terminal.
fn bar_println(bar: &Option<ProgressBar>, line: &str) {
    if let Some(bar) = bar {
        bar.suspend(|| println!("{line}"));
    }
}

/// The autodiff device of every rank. At stage 3, Burn's balanced checkpointing lets the
/// reshape that `Linear` applies to a gathered weight be recomputed like the gather itself, so
/// no gathered weight outlives its use in forward. Parameters keep the strategy of the device
/// they were created on, so the model is built on this device too.
fn training_device(stage: Stage) -> Device {
    match stage {
        Stage::Three => Device::flex().autodiff().gradient_checkpointing(),
        _ => Device::flex().autodiff(),
    }
}

/// Learning rate at `step`: linear warm-up over the first 5% of steps, then cosine to 10% of `peak`.
fn lr_at(step: usize, steps: usize, peak: f64) -> f64 {
    let warmup = (steps / 20).max(1);
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let progress = (step - warmup) as f64 / (steps - warmup).max(1) as f64;
    peak * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()))
}

/// Mean validation loss over `eval_batches` per rank, averaged over ranks (same windows each call).
fn estimate_val(
    model: &Gpt,
    corpus: &CharCorpus,
    args: &Args,
    comm: &dyn Collective,
    local_batch: usize,
) -> Result<f32, ShardError> {
    let model = model.valid();
    let device = Device::flex();
    let mut rng = StdRng::seed_from_u64(args.seed ^ 0xe7a1 ^ ((comm.rank() as u64) << 32));
    let mut sum = 0.0;
    for _ in 0..args.eval_batches {
        let (x, y) = sample_batch(&corpus.val, local_batch, args.block_size, &mut rng, &device);
        sum += model.loss(x, y).into_scalar::<f32>();
    }
    let local = Tensor::<1>::from_floats([sum / args.eval_batches as f32], &device);
    Ok(comm.all_reduce(local, ReduceOp::Avg)?.into_scalar::<f32>())
}

fn train_rank(
    args: &Args,
    stage: Stage,
    config: &GptConfig,
    corpus: &CharCorpus,
    base: &Gpt,
    comm: burn_shard::comm::InProcessComm,
) -> Result<RankOutcome, ShardError> {
    let rank = comm.rank();
    let device = training_device(stage);
    let local_batch = args.batch_size / args.world_size;
    // Burn's config (not `.build()`): the sharded optimizer then runs the fused AdamW step.
    let optimizer = AdamWConfig::new().with_beta_2(0.99).with_weight_decay(0.1);

    // The one call: shard the optimizer state (stage 1), gradients (stage 2) and parameters
    // (stage 3) over the ranks.
    let (mut model, mut optim) = ShardConfig::new(stage).init(base.clone().fork(&device), optimizer, comm)?;
    let mut rng = StdRng::seed_from_u64(args.seed.wrapping_add(rank as u64 * 7919));
    let mut start = 0;
    if let Some(dir) = &args.resume {
        let (loaded, payload) = optim.load_checkpoint(model, dir)?;
        model = loaded;
        start = payload["step"].as_u64().unwrap_or(0) as usize;
        if start >= args.steps {
            return Err(ShardError::InvalidConfig(format!(
                "--resume {} is at step {start}, but --steps is {}: nothing is left to train; raise --steps",
                dir.display(),
                args.steps
            )));
        }
        // The same batches as an uninterrupted run at the same world size: skip the ones seen.
        for _ in 0..start {
            sample_batch(&corpus.train, local_batch, args.block_size, &mut rng, &device);
        }
        if rank == 0 {
            println!("resumed from {} at step {start}", dir.display());
        }
    }

    let bar = (rank == 0).then(|| {
        let bar = ProgressBar::new(args.steps as u64);
        bar.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} steps [{elapsed_precise}<{eta_precise}] {msg}")
                .expect("valid template"),
        );
        bar
    });
    if let Some(bar) = &bar {
        bar.set_position(start as u64);
    }
    let mut val_loss = f32::NAN;
    for step in start..args.steps {
        let (x, y) = sample_batch(&corpus.train, local_batch, args.block_size, &mut rng, &device);
        let loss = model.loss(x, y);
        let train_loss = optim
            .comm()
            .all_reduce(loss.clone().inner(), ReduceOp::Avg)?
            .into_scalar::<f32>();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr_at(step, args.steps, args.lr), model, grads)?;

        let last = step + 1 == args.steps;
        if (step + 1) % args.eval_interval == 0 || last {
            val_loss = estimate_val(&model, corpus, args, optim.comm(), local_batch)?;
            bar_println(
                &bar,
                &format!(
                    "step {:>5}: train loss {train_loss:.4}, val loss {val_loss:.4}",
                    step + 1
                ),
            );
        }
        if let Some(root) = &args.save_dir
            && ((step + 1) % args.save_every == 0 || last)
        {
            let dir = root.join(format!("step-{:06}", step + 1));
            optim.save_checkpoint(
                &model,
                &dir,
                &serde_json::json!({ "step": step + 1, "seed": args.seed }),
            )?;
            if rank == 0 {
                burn_shard::checkpoint::keep_last(root, args.keep)?;
                bar_println(&bar, &format!("saved {}", dir.display()));
            }
        }
        if let Some(bar) = &bar {
            bar.set_message(format!("loss {train_loss:.3}"));
            bar.inc(1);
        }
    }
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    let memory = optim.memory_report(&model);
    // At stage 3 unsharding is a collective, so every rank takes part; then rank 0 samples.
    let full = model.valid().materialize();
    let sample = (rank == 0).then(|| {
        let eval = full;
        let mut rng = StdRng::seed_from_u64(args.seed);
        let prompt = corpus.encode("\n");
        let out = eval.generate(
            &prompt,
            args.sample_chars,
            config.block_size,
            0.8,
            &mut rng,
            &Device::flex(),
        );
        corpus.decode(&out)
    });
    Ok(RankOutcome {
        start,
        val_loss,
        memory,
        sample,
    })
}
