//! `cargo xtask bench checkpoint`: what saving costs a training run, in one run: the same GPT
//! trained for the same steps without saving, with `save_checkpoint` every k steps, and with
//! `save_checkpoint` in the background every k steps (waited for at the end), ranks as threads of one
//! process. Prints each run's total time against the run without saves, the median time of a
//! step that saves against one that does not, and the bytes each save staged.

use std::path::PathBuf;
use std::time::Instant;

use burn::module::Module;
use burn::optim::AdamWConfig;
use burn::tensor::Device;
use burn_shard::checkpoint::SaveOptions;
use burn_shard::comm::{InProcessGroup, run_ranks};
use burn_shard::{Home, NvmeOffload, ShardConfig, Stage};
use burn_shard_examples::char_data::sample_batch;
use burn_shard_examples::gpt::Gpt;
use burn_shard_examples::gpu_bench::median;
use burn_shard_examples::training::{train_step, training_device_on};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::bench_infinity::{corpus, date, gpt_config};

const MODES: [&str; 3] = ["no saves", "save_checkpoint", "save_checkpoint in the background"];
const GB: f64 = 1e9;

/// Arguments of `cargo xtask bench checkpoint`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Ranks (threads of one process).
    #[arg(long, default_value_t = 2)]
    world_size: usize,
    /// ZeRO stage (0-3).
    #[arg(long, default_value_t = 2)]
    stage: u8,
    /// Width (n_embd) of the GPT (heads: n_embd / 128).
    #[arg(long, default_value_t = 512)]
    n_embd: usize,
    /// Blocks of the GPT.
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// Steps of each run.
    #[arg(long, default_value_t = 30)]
    steps: usize,
    /// Steps between saves.
    #[arg(long, default_value_t = 10)]
    save_every: usize,
    /// Where the checkpoints are written (removed after each run).
    #[arg(long, default_value = "target/bench-checkpoint")]
    dir: PathBuf,
    /// Keep the optimizer state in swap files in this directory (NVMe offload, stages 1-3):
    /// a background save then reads it from disk while the steps go on.
    #[arg(long, value_name = "DIR")]
    nvme: Option<PathBuf>,
}

/// One run, as rank 0 measured it.
struct Run {
    /// Seconds of each step, the save after it included.
    step_s: Vec<f64>,
    total_s: f64,
    /// Bytes rank 0 staged per background save.
    staged: usize,
    /// Bytes of one checkpoint on disk (every rank's file).
    checkpoint_bytes: u64,
}

pub fn run(args: &Args) -> Result<(), String> {
    let stage = Stage::try_from(args.stage).map_err(|e| e.to_string())?;
    if args.save_every == 0 || args.steps < args.save_every {
        return Err("--save-every must be between 1 and --steps".into());
    }
    if let Some(swap) = &args.nvme {
        std::fs::create_dir_all(swap).map_err(|e| format!("{}: {e}", swap.display()))?;
    }
    let corpus = corpus()?;
    let config = gpt_config(&corpus, 64, args.n_embd, args.layers);
    let params = Gpt::new(&config, &Device::flex()).num_params();
    let mut runs = Vec::new();
    for (mode, name) in MODES.iter().enumerate() {
        eprintln!("{name} ...");
        let root = args.dir.join(format!("mode-{mode}"));
        if root.exists() {
            std::fs::remove_dir_all(&root).map_err(|e| format!("{}: {e}", root.display()))?;
        }
        let ranks = run_ranks(
            InProcessGroup::new(args.world_size).map_err(|e| e.to_string())?,
            |comm| {
                let device = training_device_on(&Device::flex(), stage);
                device.seed(1337);
                let model = Gpt::new(&config, &device);
                let config = match &args.nvme {
                    Some(swap) => ShardConfig::new(stage).with_optimizer_state_on(Home::Disk(NvmeOffload::new(swap))),
                    None => ShardConfig::new(stage),
                };
                let (mut model, mut optim) = config.init(model, AdamWConfig::new(), comm)?;
                let mut rng = StdRng::seed_from_u64(7 + optim.comm().rank() as u64);
                let (mut step_s, mut staged) = (Vec::new(), 0);
                let start = Instant::now();
                for step in 1..=args.steps {
                    let began = Instant::now();
                    let (x, y) = sample_batch(&corpus.train, 8, 64, &mut rng, &device);
                    let loss = model.loss(x, y);
                    model = train_step(&mut optim, model, loss, 1e-3)?.0;
                    if step % args.save_every == 0 {
                        let dir = root.join(format!("step-{step:06}"));
                        let payload = serde_json::json!({ "step": step });
                        match mode {
                            1 => optim.save_checkpoint(&model, &dir, &payload)?,
                            2 => {
                                optim.save_checkpoint(&model, &dir, SaveOptions::from(&payload).in_background())?;
                                staged = optim.report().memory(&model).checkpoint_staging_bytes;
                            }
                            _ => {}
                        }
                    }
                    step_s.push(began.elapsed().as_secs_f64());
                }
                optim.wait_for_checkpoint()?;
                Ok::<_, burn_shard::ShardError>((step_s, start.elapsed().as_secs_f64(), staged))
            },
        )
        .map_err(|e| e.to_string())?;
        let (step_s, total_s, staged) = ranks.into_iter().next().expect("rank 0").map_err(|e| e.to_string())?;
        let checkpoint_bytes = match mode {
            0 => 0,
            _ => burn_shard::checkpoint::inspect(root.join(format!("step-{:06}", args.save_every)))
                .map_err(|e| e.to_string())?
                .bytes_per_rank()
                .iter()
                .sum(),
        };
        let _ = std::fs::remove_dir_all(&root);
        runs.push(Run {
            step_s,
            total_s,
            staged,
            checkpoint_bytes,
        });
    }
    print_table(args, params, &runs);
    Ok(())
}

fn print_table(args: &Args, params: usize, runs: &[Run]) {
    let saving = |s: usize| s.is_multiple_of(args.save_every);
    // Step 1 warms up; the others split into saving and plain steps.
    let plain = |run: &Run| {
        median(
            &(2..=args.steps)
                .filter(|s| !saving(*s))
                .map(|s| run.step_s[s - 1])
                .collect::<Vec<_>>(),
        )
    };
    let saves = |run: &Run| {
        median(
            &(1..=args.steps)
                .filter(|s| saving(*s))
                .map(|s| run.step_s[s - 1])
                .collect::<Vec<_>>(),
        )
    };
    println!(
        "\nSaving during training: GPT of {params} parameters (width {}, {} layers), {} ranks as threads, stage {}, \
         Flex CPU{}, {} steps of 8 × 64 tokens, a save every {} steps ({:.3} GB per checkpoint), {}",
        args.n_embd,
        args.layers,
        args.world_size,
        args.stage,
        match &args.nvme {
            Some(swap) => format!(", optimizer state in swap files in {} (NVMe offload)", swap.display()),
            None => String::new(),
        },
        args.steps,
        args.save_every,
        runs[1].checkpoint_bytes as f64 / GB,
        date()
    );
    println!("\n| run | total s | total / no saves | median step s | median saving step s | saving / plain step |");
    println!("|---|---|---|---|---|---|");
    for (mode, run) in runs.iter().enumerate() {
        let (plain_s, save_s) = (plain(run), saves(run));
        println!(
            "| {} | {:.2} | {:.3} | {:.3} | {:.3} | {:.2} |",
            MODES[mode],
            run.total_s,
            run.total_s / runs[0].total_s,
            plain_s,
            save_s,
            save_s / plain_s
        );
    }
    let run = &runs[2];
    let extra = saves(run) - plain(run);
    println!(
        "\na background save_checkpoint staged {:.3} GB on rank 0 per save; its saving step took {:.3} s more than a plain \
         step ({:.2} GB/s if all of it were the staging copy). The background writers share the CPU with training \
         here (2 cores, {} rank threads).",
        run.staged as f64 / GB,
        extra,
        run.staged as f64 / GB / extra.max(1e-9),
        args.world_size
    );
}
