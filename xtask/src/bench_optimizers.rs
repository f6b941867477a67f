//! `cargo xtask bench optimizers`: Muon for the GPT's hidden matrices with AdamW for the rest
//! (`OptimizerGroups`), against AdamW alone, on one rank and on 2 and 4 ranks as threads at
//! stages 1-3, in one run: optimizer-state bytes per rank (largest and mean, against the
//! total over the world size), the median step time, and the time each rank spends in the
//! optimizer's own steps (Newton-Schulz included) against single-device Muon's.
//!
//! The ranks are threads of one process on this machine's cores, and Burn's CPU backend spreads
//! a matmul over the cores too: one rank alone uses every core, several ranks share them. So
//! the per-rank optimizer wall time is reported with, beside it, the work that decides it
//! whatever the cores: the Newton-Schulz floating-point operations of the matrices each rank
//! owns (5 iterations of `A = X Xᵀ`, `B = bA + cA²`, `X = aX + BX` on the `m x n` update with
//! `m <= n`: `5 (4 m² n + 2 m³)`; Jordan et al. 2024, Burn's `muon.rs`). Memory is what each
//! rank holds (`MemoryReport`: the tensors it keeps and the step's tracked peak), not an
//! estimate.

use std::time::Instant;

use burn::module::Module;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::{AdamWConfig, AdjustLrFn, MuonConfig};
use burn::tensor::Device;
use burn_shard::comm::{Collective, InProcessGroup, run_ranks};
use burn_shard::{OptimizerGroups, ShardConfig, Stage};
use burn_shard_examples::char_data::sample_batch;
use burn_shard_examples::gpt::{Gpt, hidden_matrices};
use burn_shard_examples::gpu_bench::median;
use burn_shard_examples::training::{train_step, training_device_on};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::bench_infinity::{corpus, date, gpt_config};

const MIB: f64 = 1048576.0;

/// Arguments of `cargo xtask bench optimizers`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Width (n_embd) of the GPT (heads: n_embd / 32, at least 1).
    #[arg(long, default_value_t = 256)]
    n_embd: usize,
    /// Blocks of the GPT.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Steps of each run (the first warms up and is not counted).
    #[arg(long, default_value_t = 6)]
    steps: usize,
}

/// The two optimizer setups.
#[derive(Clone, Copy, PartialEq)]
enum Setup {
    AdamW,
    MuonAdamW,
}

impl Setup {
    fn name(self) -> &'static str {
        match self {
            Setup::AdamW => "AdamW",
            Setup::MuonAdamW => "Muon+AdamW",
        }
    }

    fn optimizer(self) -> OptimizerGroups {
        let adamw = AdamWConfig::new().with_weight_decay(0.1);
        match self {
            Setup::AdamW => OptimizerGroups::new(adamw),
            Setup::MuonAdamW => {
                let muon = MuonConfig::new()
                    .with_adjust_lr_fn(AdjustLrFn::MatchRmsAdamW)
                    .with_weight_decay(Some(WeightDecayConfig::new(0.1)));
                OptimizerGroups::new(adamw).with_group(hidden_matrices(), muon, None)
            }
        }
    }
}

/// One rank's measurements: optimizer-state bytes, peak step bytes, median step time, median
/// wall seconds in the optimizer's own steps, and the Newton-Schulz FLOPs of its matrices.
struct Rank {
    state_bytes: usize,
    peak_bytes: usize,
    step_s: f64,
    optim_s: f64,
    ns_flops: f64,
}

/// Newton-Schulz FLOPs of one step on an `rows x cols` matrix (see the module docs).
fn ns_flops(rows: usize, cols: usize) -> f64 {
    let (m, n) = (rows.min(cols) as f64, rows.max(cols) as f64);
    5.0 * (4.0 * m * m * n + 2.0 * m * m * m)
}

fn measure(args: &Args, setup: Setup, world_size: usize, stage: Stage) -> Result<Vec<Rank>, String> {
    let corpus = corpus()?;
    let mut config = gpt_config(&corpus, 64, args.n_embd, args.layers);
    config.n_head = (args.n_embd / 32).max(1);
    let ranks = run_ranks(InProcessGroup::new(world_size).map_err(|e| e.to_string())?, |comm| {
        let rank = comm.rank();
        let device = training_device_on(&Device::flex(), stage);
        device.seed(1337);
        let model = Gpt::new(&config, &device);
        let (mut model, mut optim) = ShardConfig::new(stage).init(model, setup.optimizer(), comm)?;
        let mut rng = StdRng::seed_from_u64(7 + rank as u64);
        let (mut step_s, mut optim_s) = (Vec::new(), Vec::new());
        let mut peak_bytes = 0;
        for step in 0..args.steps {
            let (x, y) = sample_batch(&corpus.train, 8, 64, &mut rng, &device);
            let began = Instant::now();
            let loss = model.loss(x, y);
            model = train_step(&mut optim, model, loss, 1e-3)?.0;
            let wall = began.elapsed().as_secs_f64();
            let report = optim.report();
            let memory = report.memory(&model);
            // Held model state plus the step's tracked temporaries (gathers, exchanges).
            peak_bytes = peak_bytes.max(memory.total_bytes() + memory.temporary_peak_bytes);
            if step == 0 {
                continue; // warm-up
            }
            step_s.push(wall);
            optim_s.push(report.last_optimizer_seconds());
        }
        let report = optim.report();
        let state_bytes = report.memory(&model).optimizer_state_bytes;
        // The Muon matrices this rank steps whole (AdamW steps the rest as flat pieces).
        let ns_flops = report
            .stepped_whole()
            .iter()
            .map(|(_, shape)| ns_flops(shape[0], shape[1]))
            .sum();
        Ok::<_, burn_shard::ShardError>(Rank {
            state_bytes,
            peak_bytes,
            step_s: median(&step_s),
            optim_s: median(&optim_s),
            ns_flops,
        })
    })
    .map_err(|e| e.to_string())?;
    ranks.into_iter().collect::<Result<_, _>>().map_err(|e| e.to_string())
}

pub fn run(args: &Args) -> Result<(), String> {
    if args.steps < 2 {
        return Err("at least 2 steps (the first warms up)".into());
    }
    let corpus = corpus()?;
    let params = Gpt::new(&gpt_config(&corpus, 64, args.n_embd, args.layers), &Device::flex()).num_params();
    let configs: Vec<(usize, Stage)> = std::iter::once((1, Stage::Zero))
        .chain(
            [2, 4]
                .into_iter()
                .flat_map(|w| [(w, Stage::One), (w, Stage::Two), (w, Stage::Three)]),
        )
        .collect();
    let mut rows = Vec::new();
    for setup in [Setup::AdamW, Setup::MuonAdamW] {
        for &(world_size, stage) in &configs {
            eprintln!("{} on {world_size} rank(s), {stage} ...", setup.name());
            rows.push((setup, world_size, stage, measure(args, setup, world_size, stage)?));
        }
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "\nOptimizers: GPT of {params} parameters (width {}, {} layers), f32, batch 8 x 64 tokens per rank, {} counted \
         steps, ranks as threads on {cores} cores, {}",
        args.n_embd,
        args.layers,
        args.steps - 1,
        date()
    );
    println!(
        "\n| optimizer | ranks | stage | state MiB/rank: largest | mean | largest / (single / W) | peak MiB/rank | \
         step s | optimizer s/rank: largest | largest / (single / W) | Newton-Schulz GFLOP/rank: largest | largest / (single / W) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut goals = Vec::new();
    for (setup, world_size, stage, ranks) in &rows {
        let single = &rows
            .iter()
            .find(|(s, w, _, _)| s == setup && *w == 1)
            .expect("the single-rank run")
            .3[0];
        let w = *world_size as f64;
        let largest = ranks.iter().map(|r| r.state_bytes).max().unwrap_or(0) as f64;
        let mean = ranks.iter().map(|r| r.state_bytes).sum::<usize>() as f64 / w;
        let peak = ranks.iter().map(|r| r.peak_bytes).max().unwrap_or(0) as f64;
        let optim_wall = ranks.iter().map(|r| r.optim_s).fold(0.0, f64::max);
        let flops = ranks.iter().map(|r| r.ns_flops).fold(0.0, f64::max);
        let flops_ratio = match single.ns_flops > 0.0 {
            true => format!("{:.2}", flops / (single.ns_flops / w)),
            false => "-".to_string(),
        };
        let state_ratio = largest / (single.state_bytes as f64 / w);
        if *setup == Setup::MuonAdamW && *world_size > 1 {
            goals.push((state_ratio, flops / (single.ns_flops / w)));
        }
        println!(
            "| {} | {world_size} | {stage} | {:.3} | {:.3} | {:.3} | {:.2} | {:.3} | {:.4} | {:.2} | {:.3} | {flops_ratio} |",
            setup.name(),
            largest / MIB,
            mean / MIB,
            state_ratio,
            peak / MIB,
            ranks[0].step_s,
            optim_wall,
            optim_wall / (single.optim_s / w),
            flops / 1e9,
        );
    }
    let state = goals.iter().map(|g| g.0).fold(0.0, f64::max);
    let work = goals.iter().map(|g| g.1).fold(0.0, f64::max);
    println!(
        "\nMuon+AdamW on 2 and 4 ranks: the largest rank's optimizer state is {state:.3} x the single-device state / W \
         (goal <= 1.15) and its Newton-Schulz work {work:.2} x the single-device work / W (goal <= 1.3: divided over \
         the ranks, not repeated). The optimizer wall time per rank shares {cores} cores between the ranks and each \
         matmul's threads, so / W is reached only with a core per rank; step time is on one machine, no network."
    );
    Ok(())
}
