//! Trains a small character-level GPT on tiny shakespeare with ZeRO sharding on the CPU
//! backend: ranks as threads of this process, or (feature `mpi`) one process per rank started
//! by `mpirun`, with the same losses for the same seed.
//!
//! ```text
//! cargo run --release -p burn-shard-examples --bin shakespeare -- --world-size 2 --stage 2
//! cargo build --release --workspace --features burn-shard-examples/mpi
//! mpirun -np 2 target/release/shakespeare --stage 2
//! ```

use std::path::PathBuf;
use std::time::Instant;

use burn::module::Module;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::{AdamWConfig, AdjustLrFn, MuonConfig};
use burn::prelude::*;
#[cfg(not(feature = "mpi"))]
use burn_shard::comm::InProcessComm;
use burn_shard::comm::{Collective, InProcessGroup, run_ranks};
#[cfg(feature = "mpi")]
use burn_shard::comm::{MpiComm, launched_by_mpirun};
use burn_shard::{MemoryReport, OptimizerGroups, ShardError, Stage};
use burn_shard_examples::char_data::{CharCorpus, sample_batch};
use burn_shard_examples::cli::{ShardArgs, at_least, positive_f64};
use burn_shard_examples::gpt::{Gpt, GptConfig, hidden_matrices};
use burn_shard_examples::metrics::Metrics;
use burn_shard_examples::training::{
    Progress, StepEnd, end_step, lr_at, print_estimate, resume, train_step, training_device, window_loss,
};
use clap::Parser;
use rand::SeedableRng;
use rand::rngs::StdRng;

#[derive(Parser, Debug, Clone)]
#[command(
    about = "Char-level GPT on tiny shakespeare, trained with ZeRO sharding (ranks as threads, or processes under mpirun); default stage 2"
)]
struct Args {
    /// World size (default 2), stage (default 2), checkpoints.
    #[command(flatten)]
    shard: ShardArgs,
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
    /// The optimizer: `adamw` for every parameter, or `muon`: Burn's Muon for the blocks'
    /// matrices (attention projections, MLP) and AdamW for embeddings, LayerNorms, biases and the
    /// head, each matrix stepped whole by one rank (at stage 3 gathered to it for the step;
    /// `--estimate` counts AdamW's state).
    #[arg(long, value_enum, default_value_t = OptimizerChoice::Adamw)]
    optimizer: OptimizerChoice,
    /// Peak learning rate, a finite number above 0 (linear warm-up over 5% of the steps, cosine
    /// decay to 10%); Muon's matrices take the same rate, scaled to AdamW's update size by
    /// Burn's `AdjustLrFn::MatchRmsAdamW` (Liu et al. 2025, "Muon is Scalable for LLM Training").
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
    /// Print this GPT's per-rank model-state memory at --world-size for every stage (measured
    /// on 1 and 2 in-process ranks with AdamW, extrapolated; next to the ZeRO formula) and exit
    /// without training: pick a stage before renting GPUs.
    #[arg(long)]
    estimate: bool,
    /// Seconds a collective between processes (under mpirun) may wait for the other ranks
    /// before every rank fails with an error naming the call: a rank that is gone or a link
    /// that is down ends the job in this time, not TCP's minutes (default: MpiComm's 300 s).
    #[arg(long, value_parser = positive_f64)]
    comm_timeout: Option<f64>,
    /// Folder for metrics.csv and losses.png.
    #[arg(long, default_value = "runs/shakespeare")]
    out: PathBuf,
}

/// `--optimizer`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum OptimizerChoice {
    Adamw,
    Muon,
}

/// The optimizer `init` is given: AdamW everywhere, or Muon for the blocks' matrices with AdamW
/// (the fallback) for the rest, with the same weight decay. Burn's configs (not `.build()`):
/// AdamW then runs the fused step.
fn optimizer(choice: OptimizerChoice) -> OptimizerGroups {
    let adamw = AdamWConfig::new().with_beta_2(0.99).with_weight_decay(0.1);
    match choice {
        OptimizerChoice::Adamw => OptimizerGroups::new(adamw),
        OptimizerChoice::Muon => {
            let matrices = hidden_matrices();
            let muon = MuonConfig::new()
                .with_adjust_lr_fn(AdjustLrFn::MatchRmsAdamW)
                .with_weight_decay(Some(WeightDecayConfig::new(0.1)));
            OptimizerGroups::new(adamw).with_group(matrices, muon, None)
        }
    }
}

struct RankOutcome {
    /// The step training started from (0, or the resumed checkpoint's).
    start: usize,
    val_loss: f32,
    metrics: Metrics,
    memory: MemoryReport,
    sample: Option<String>,
    /// Collective calls of this rank's world communicator per step trained (`init` and the
    /// evaluations included; with `--replicas`, the calls of the shard and replica groups are
    /// not counted).
    calls_per_step: f64,
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(args) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(mut args: Args) -> Result<(), String> {
    args.shard.resolve_resume()?;
    let stage = args.shard.stage_or(Stage::Two);
    if !args.n_embd.is_multiple_of(args.n_head) {
        return Err(format!(
            "--n-embd {} must be a multiple of --n-head {}",
            args.n_embd, args.n_head
        ));
    }
    args.shard.check_batch(args.batch_size)?;
    let path = args
        .data
        .clone()
        .unwrap_or_else(|| burn_shard_examples::examples_data_dir().join("tinyshakespeare.txt"));
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
        args.shard.world_size,
        stage,
        args.steps,
        args.batch_size,
        args.block_size
    );

    if args.estimate {
        return print_estimate(&base, args.shard.world_size);
    }

    let start = Instant::now();
    let outcomes = match mpi_comm(&args)? {
        // One process per rank (mpirun): this process trains its rank; rank 0 reports.
        Some(comm) => {
            let rank = comm.rank();
            let outcome = train_rank(&args, stage, &config, &corpus, &base, comm).map_err(|e| e.to_string())?;
            if rank != 0 {
                println!("[rank {rank}] {}", outcome.memory);
                return Ok(());
            }
            vec![outcome]
        }
        None => {
            let group = InProcessGroup::new(args.shard.world_size).map_err(|e| e.to_string())?;
            run_ranks(group, |comm| train_rank(&args, stage, &config, &corpus, &base, comm))
                .map_err(|e| e.to_string())?
                .into_iter()
                .collect::<Result<Vec<_>, ShardError>>()
                .map_err(|e| e.to_string())?
        }
    };
    let seconds = start.elapsed().as_secs_f64();

    if let Some(sample) = &outcomes[0].sample {
        println!("--- sample ---\n{sample}\n--------------");
    }
    for o in &outcomes {
        println!("{}", o.memory);
    }
    let [csv, png] = outcomes[0]
        .metrics
        .write(&args.out, &format!("char GPT on tiny shakespeare, stage {stage}"))?;
    let tokens = ((args.steps - outcomes[0].start) * args.batch_size * args.block_size) as f64;
    let m = &outcomes[0].memory;
    println!(
        "final: val loss {:.4} nats/char | {:.0} tokens/s | {:.1} s | {:.1} collective calls per step | per-rank memory: params {:.2} MiB, grads {:.2} MiB, optim {:.2} MiB | wrote {} and {}",
        outcomes[0].val_loss,
        tokens / seconds,
        seconds,
        outcomes[0].calls_per_step,
        m.parameters_bytes as f64 / 1048576.0,
        m.gradients_bytes as f64 / 1048576.0,
        m.optimizer_state_bytes as f64 / 1048576.0,
        csv.display(),
        png.display()
    );
    Ok(())
}

/// This process's rank of an MPI job when it was started by `mpirun` (feature `mpi`), else
/// `None`: the ranks are threads.
///
/// # Errors
/// MPI cannot start, or `--world-size` differs from mpirun's `-np`.
#[cfg(feature = "mpi")]
fn mpi_comm(args: &Args) -> Result<Option<MpiComm>, String> {
    if !launched_by_mpirun() {
        return Ok(None);
    }
    let mut comm = MpiComm::init().map_err(|e| e.to_string())?;
    if let Some(seconds) = args.comm_timeout {
        let timeout = std::time::Duration::try_from_secs_f64(seconds)
            .map_err(|e| format!("--comm-timeout {seconds}: {e}; give seconds, for example 60"))?;
        comm = comm.with_timeout(timeout);
    }
    if comm.world_size() != args.shard.world_size {
        return Err(format!(
            "mpirun started {} processes but --world-size is {}: pass --world-size {}",
            comm.world_size(),
            args.shard.world_size,
            comm.world_size()
        ));
    }
    Ok(Some(comm))
}

/// Without the `mpi` feature the ranks are always threads.
#[cfg(not(feature = "mpi"))]
fn mpi_comm(_: &Args) -> Result<Option<InProcessComm>, String> {
    Ok(None)
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
    let sizes = (args.eval_batches, local_batch, args.block_size);
    window_loss(&corpus.val, sizes, args.seed, comm, |x, y| {
        model.loss(x, y).into_scalar::<f32>()
    })
}

fn train_rank(
    args: &Args,
    stage: Stage,
    config: &GptConfig,
    corpus: &CharCorpus,
    base: &Gpt,
    comm: impl Collective + 'static,
) -> Result<RankOutcome, ShardError> {
    let rank = comm.rank();
    let device = training_device(stage);
    let local_batch = args.batch_size / args.shard.world_size;
    let optimizer = optimizer(args.optimizer);

    // The one call: shard the optimizer state (stage 1), gradients (stage 2) and parameters
    // (stage 3) over the ranks.
    let (model, mut optim) = args
        .shard
        .shard_config(stage)
        .init(base.clone().fork(&device), optimizer, comm)?;
    let (mut model, start) = resume(&args.shard, &mut optim, model, args.steps)?;
    let mut rng = StdRng::seed_from_u64(args.seed.wrapping_add(rank as u64 * 7919));
    // The same batches as an uninterrupted run at the same world size: skip the ones seen.
    for _ in 0..start {
        sample_batch(&corpus.train, local_batch, args.block_size, &mut rng, &device);
    }

    let progress = Progress::new(rank, args.steps, start);
    // A resumed run continues the curves of the run it resumes, when they are in --out.
    let mut metrics = Metrics::earlier(&args.out, start).map_err(ShardError::InvalidConfig)?;
    let mut val_loss = f32::NAN;
    for step in start..args.steps {
        let (x, y) = sample_batch(&corpus.train, local_batch, args.block_size, &mut rng, &device);
        let loss = model.loss(x, y);
        let lr = lr_at(step, args.steps, args.lr, args.steps / 20);
        let (stepped, train_loss) = train_step(&mut optim, model, loss, lr)?;
        model = stepped;
        let estimated = end_step(
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
            |model, comm| Ok((estimate_val(model, corpus, args, comm, local_batch)?, None)),
        )?;
        val_loss = estimated.unwrap_or(val_loss);
    }
    progress.finish();
    let calls_per_step = optim.comm().stats().total_calls() as f64 / (args.steps - start).max(1) as f64;
    let memory = optim.report().memory(&model);
    // At stage 3 unsharding is a collective, so every rank takes part; then rank 0 samples.
    let full = model.valid().materialize();
    let sample = (rank == 0).then(|| {
        let mut rng = StdRng::seed_from_u64(args.seed);
        let prompt = corpus.encode("\n");
        let out = full.generate(
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
        metrics,
        memory,
        sample,
        calls_per_step,
    })
}
