//! `cargo xtask bench hsdp`: flat sharding against hybrid sharding (`ShardConfig::with_replicas`)
//! on 4 ranks as threads of one process, seen as 2 "nodes" (ranks 0-1 and 2-3), in one run: per
//! rank and step, the bytes that cross nodes and those that stay inside one, against
//! `estimate::step_traffic`'s theory, and the median step time.
//!
//! Flat, every collective spans both nodes; on the 2 x 2 mesh (consecutive shard groups, one
//! per node) only the replicas' all-reduce and the world's small agreements do. The ranks share
//! one machine, so step times here measure compute and the collectives' host copies, not a
//! network: the bytes are what carries over to real nodes.

use std::time::Instant;

use burn::module::Module;
use burn::optim::AdamWConfig;
use burn::tensor::Device;
use burn_shard::comm::{Collective, InProcessGroup, run_ranks};
use burn_shard::estimate::{ParamDtype, step_traffic};
use burn_shard::{ShardConfig, Stage};
use burn_shard_examples::char_data::sample_batch;
use burn_shard_examples::gpt::Gpt;
use burn_shard_examples::gpu_bench::median;
use burn_shard_examples::training::{train_step, training_device_on};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::bench_infinity::{corpus, date, gpt_config};

/// Ranks of the benchmark, and shard groups ("nodes") of the mesh.
const WORLD_SIZE: usize = 4;
const REPLICAS: usize = 2;
const MB: f64 = 1e6;

/// Arguments of `cargo xtask bench hsdp`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// ZeRO stage (1-3).
    #[arg(long, default_value_t = 3)]
    stage: u8,
    /// Width (n_embd) of the GPT (heads: n_embd / 128).
    #[arg(long, default_value_t = 256)]
    n_embd: usize,
    /// Blocks of the GPT.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Steps of each run (the first warms up and is not counted).
    #[arg(long, default_value_t = 8)]
    steps: usize,
}

/// One run, per rank: bytes per step across nodes and within them (means over the counted
/// steps), and rank 0's median step time.
struct Run {
    across: Vec<f64>,
    within: Vec<f64>,
    step_s: f64,
}

pub fn run(args: &Args) -> Result<(), String> {
    let stage = Stage::try_from(args.stage).map_err(|e| e.to_string())?;
    if stage == Stage::Zero || args.steps < 2 {
        return Err("hybrid sharding needs stage 1, 2 or 3, and at least 2 steps".into());
    }
    let corpus = corpus()?;
    let config = gpt_config(&corpus, 64, args.n_embd, args.layers);
    let params = Gpt::new(&config, &Device::flex()).num_params();
    let mut runs = Vec::new();
    for replicas in [1, REPLICAS] {
        eprintln!("{replicas} replica(s) ...");
        let ranks = run_ranks(InProcessGroup::new(WORLD_SIZE).map_err(|e| e.to_string())?, |comm| {
            let rank = comm.rank();
            let device = training_device_on(&Device::flex(), stage);
            device.seed(1337);
            let model = Gpt::new(&config, &device);
            let sharding = ShardConfig::new(stage).with_replicas(replicas);
            let (mut model, mut optim) = sharding.init(model, AdamWConfig::new(), comm)?;
            let mut rng = StdRng::seed_from_u64(7 + rank as u64);
            let (mut across, mut within, mut step_s) = (0.0, 0.0, Vec::new());
            for step in 0..args.steps {
                let world = optim.comm().stats();
                let groups = optim.mesh().map(|m| (m.shard().stats(), m.replicate().stats()));
                let began = Instant::now();
                let (x, y) = sample_batch(&corpus.train, 8, 64, &mut rng, &device);
                let loss = model.loss(x, y);
                model = train_step(&mut optim, model, loss, 1e-3)?.0;
                if step == 0 {
                    continue; // warm-up: learns the backward, agrees on the layout
                }
                step_s.push(began.elapsed().as_secs_f64());
                let world = optim.comm().stats().since(&world).total_bytes_sent() as f64;
                let (shard, replica) = match (optim.mesh(), groups) {
                    (Some(mesh), Some((s, r))) => (
                        mesh.shard().stats().since(&s).total_bytes_sent() as f64,
                        mesh.replicate().stats().since(&r).total_bytes_sent() as f64,
                    ),
                    // Flat: the world is the shard group, and it spans both nodes.
                    _ => (0.0, 0.0),
                };
                across += world + replica;
                within += shard;
            }
            let counted = (args.steps - 1) as f64;
            Ok::<_, burn_shard::ShardError>((across / counted, within / counted, median(&step_s)))
        })
        .map_err(|e| e.to_string())?;
        let ranks: Vec<(f64, f64, f64)> = ranks.into_iter().collect::<Result<_, _>>().map_err(|e| e.to_string())?;
        runs.push(Run {
            across: ranks.iter().map(|r| r.0).collect(),
            within: ranks.iter().map(|r| r.1).collect(),
            step_s: ranks[0].2,
        });
    }
    print_table(args, stage, params, &runs);
    Ok(())
}

fn print_table(args: &Args, stage: Stage, params: usize, runs: &[Run]) {
    let psi = params as f64;
    let flat = step_traffic(psi, WORLD_SIZE, 1, stage, ParamDtype::F32);
    let mesh = step_traffic(psi, WORLD_SIZE, REPLICAS, stage, ParamDtype::F32);
    println!(
        "\nHybrid sharding: GPT of {params} parameters (width {}, {} layers), stage {stage}, {WORLD_SIZE} ranks as threads \
         seen as 2 nodes (ranks 0-1, 2-3), f32, batch 8 x 64 tokens per rank, {} counted steps, {}",
        args.n_embd,
        args.layers,
        args.steps - 1,
        date()
    );
    println!("\n| run | rank | across nodes MB/step | theory | within a node MB/step | theory | across / flat's |");
    println!("|---|---|---|---|---|---|---|");
    let names = ["flat", "2 x 2 mesh"];
    let theory = [
        (flat.shard_group_bytes, 0.0),
        (mesh.replica_group_bytes, mesh.shard_group_bytes),
    ];
    for (i, run) in runs.iter().enumerate() {
        for rank in 0..WORLD_SIZE {
            println!(
                "| {} | {rank} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} |",
                names[i],
                run.across[rank] / MB,
                theory[i].0 / MB,
                run.within[rank] / MB,
                theory[i].1 / MB,
                run.across[rank] / runs[0].across[rank]
            );
        }
    }
    println!(
        "\nMedian step (rank 0): flat {:.3} s, mesh {:.3} s ({:.2} x); one machine, so no network time is in it. \
         Theory: `burn-shard estimate --params {params} --world-size {WORLD_SIZE} --replicas {REPLICAS} --dtype f32` \
         (ring volumes; stage 3 counts two all-gathers, and backward skips re-gathering a weight whose input needs \
         no gradient, so a model sends up to it).",
        runs[0].step_s,
        runs[1].step_s,
        runs[1].step_s / runs[0].step_s
    );
}
