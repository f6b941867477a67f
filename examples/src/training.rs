//! The pieces of a sharded training loop the examples share: the device, the learning-rate
//! schedule, rank 0's progress bar, resuming and saving checkpoints.

use std::path::Path;

use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::activation::softmax;
use burn_shard::checkpoint::SaveOptions;
use burn_shard::comm::{Collective, ReduceOp};
use burn_shard::{MasterWeightStep, ShardError, ShardedOptimizer, Stage};
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::char_data::sample_batch;
use crate::cli::ShardArgs;
use crate::metrics::Metrics;

/// The autodiff device of every rank. At stage 3, Burn's balanced checkpointing lets the
/// reshape that `Linear` applies to a gathered weight be recomputed like the gather itself, so
/// no gathered weight outlives its use in forward. Parameters keep the strategy of the device
/// they were created on, so the model is forked onto this device before sharding.
pub fn training_device(stage: Stage) -> Device {
    training_device_on(&Device::flex(), stage)
}

/// [`training_device`] on `device` (a GPU's, in the GPU benchmark): its autodiff device, with
/// Burn's balanced gradient checkpointing at stage 3.
pub fn training_device_on(device: &Device, stage: Stage) -> Device {
    match stage {
        Stage::Three => device.clone().autodiff().gradient_checkpointing(),
        _ => device.clone().autodiff(),
    }
}

/// Learning rate at `step` (0-based) of `steps`: linear warm-up over the first `warmup` steps
/// (at least one), then cosine decay to 10% of `peak`.
pub fn lr_at(step: usize, steps: usize, peak: f64, warmup: usize) -> f64 {
    let warmup = warmup.max(1);
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let progress = (step - warmup) as f64 / (steps - warmup).max(1) as f64;
    peak * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()))
}

/// The mean over ranks of a per-rank scalar (a collective: every rank calls it).
///
/// # Errors
/// The collective failed (a peer died or timed out).
pub fn mean_over_ranks(comm: &dyn Collective, value: f32) -> Result<f32, ShardError> {
    let local = Tensor::<1>::from_floats([value], &Device::flex());
    Ok(comm.all_reduce(local, ReduceOp::Avg)?.into_scalar::<f32>())
}

/// One training step from this rank's `loss` (a scalar of the rank's slice of the global
/// batch): backward, then the sharded optimizer step at learning rate `lr`. Returns the
/// updated model and the mean of the ranks' losses, for logging (a collective).
///
/// # Errors
/// A collective or the optimizer step failed (every rank gets the error).
pub fn train_step<M: Module, O: MasterWeightStep>(
    optim: &mut ShardedOptimizer<O>,
    model: M,
    loss: Tensor<1>,
    lr: f64,
) -> Result<(M, f32), ShardError> {
    let mean_loss = optim
        .comm()
        .all_reduce(loss.clone().inner(), ReduceOp::Avg)?
        .into_scalar::<f32>();
    // Scaled when a loss scaler is configured (f16), unchanged otherwise.
    let grads = GradientsParams::from_grads(optim.scale_loss(loss).backward(), &model);
    Ok((optim.step(lr, model, grads)?, mean_loss))
}

/// Mean cross-entropy (nats per token) of next-token `logits` (`[batch, seq, vocab]`) against
/// `targets` (`[batch, seq]`).
pub fn next_token_loss(logits: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
    let [b, t, v] = logits.dims();
    let device = logits.device();
    CrossEntropyLossConfig::new()
        .init(&device)
        .forward(logits.reshape([b * t, v]), targets.reshape([b * t]))
}

/// Samples an index from the softmax of `logits` (`[n]`) at `temperature`; the argmax when
/// `temperature` is 0.
pub fn sample_index(logits: Tensor<1>, temperature: f32, rng: &mut impl Rng) -> usize {
    if temperature == 0.0 {
        return logits.argmax(0).into_scalar::<i64>() as usize;
    }
    let probs: Vec<f32> = softmax(logits.div_scalar(temperature), 0)
        .into_data()
        .convert::<f32>()
        .iter::<f32>()
        .collect();
    let mut u: f32 = rng.random();
    probs
        .iter()
        .position(|&p| {
            u -= p;
            u < 0.0
        })
        .unwrap_or(probs.len() - 1)
}

/// Rank 0's progress bar over the steps; a no-op on every other rank.
pub struct Progress(Option<ProgressBar>);

impl Progress {
    /// A bar over `steps` steps on rank 0, positioned at `start` (a resumed run).
    pub fn new(rank: usize, steps: usize, start: usize) -> Self {
        Self((rank == 0).then(|| {
            let bar = ProgressBar::new(steps as u64);
            bar.set_style(
                ProgressStyle::with_template("{bar:30} {pos}/{len} steps [{elapsed_precise}<{eta_precise}] {msg}")
                    .expect("valid template"),
            );
            bar.set_position(start as u64);
            bar
        }))
    }

    /// Prints a line above the bar (rank 0 only). `suspend` + `println`, not `bar.println`,
    /// so the line also reaches a log that is not a terminal.
    pub fn println(&self, line: &str) {
        if let Some(bar) = &self.0 {
            bar.suspend(|| println!("{line}"));
        }
    }

    /// Advances one step and shows `message` after the bar.
    pub fn step(&self, message: String) {
        if let Some(bar) = &self.0 {
            bar.set_message(message);
            bar.inc(1);
        }
    }

    /// Removes the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.0 {
            bar.finish_and_clear();
        }
    }
}

/// Loads `args.resume` (if any) into `model` and `optim`; returns the model and the step to
/// start from (the checkpoint payload's `"step"`, 0 without `--resume`). When `--save-dir`
/// holds checkpoints after the resumed one (a rollback), they move into
/// `--save-dir/abandoned-<run id>/` and a line says so (a collective: every rank calls it).
///
/// # Errors
/// The checkpoint's errors (corrupt, another model, ...), or a checkpoint at or past `steps`.
pub fn resume<M: Module, O: MasterWeightStep>(
    args: &ShardArgs,
    optim: &mut ShardedOptimizer<O>,
    model: M,
    steps: usize,
) -> Result<(M, usize), ShardError> {
    let Some(dir) = &args.resume else {
        return Ok((model, 0));
    };
    let (model, restored) = optim.load_checkpoint(model, dir)?;
    let start = restored.payload["step"].as_u64().unwrap_or(0) as usize;
    if start >= steps && args.resumed_auto {
        // A job restarted after it had saved its last step (a rank failed on its way out).
        if optim.comm().rank() == 0 {
            println!(
                "{} is at step {start} of {steps}: the run is already finished",
                dir.display()
            );
        }
        return Ok((model, steps));
    }
    if start >= steps {
        return Err(ShardError::InvalidConfig(format!(
            "--resume {} is at step {start}, but --steps is {steps}: nothing is left to train; raise --steps",
            dir.display()
        )));
    }
    if optim.comm().rank() == 0 {
        println!("resumed from {} at step {start}", dir.display());
    }
    // A rollback: the later checkpoints of --save-dir belong to the abandoned run. They move
    // aside now (never deleted), so this run's saves, `keep_last` and `--resume DIR` see its
    // own lineage only.
    if let Some(root) = &args.save_dir {
        let moved = optim.set_aside_abandoned(root)?;
        if let (0, Some(first)) = (optim.comm().rank(), moved.first()) {
            let names: Vec<String> = moved
                .iter()
                .filter_map(|p| Some(p.file_name()?.to_string_lossy().into_owned()))
                .collect();
            println!(
                "{} is not the newest checkpoint of {}: moved the later ones ({}) into {}",
                dir.display(),
                root.display(),
                names.join(", "),
                first.parent().unwrap_or(root).display()
            );
        }
    }
    Ok((model, start))
}

/// After step `done` (1-based) of `steps`: saves a checkpoint under `--save-dir` every
/// `--save-every` steps and after the last, with `{"step": done}` as payload, and keeps the
/// newest `--keep` complete ones (a collective: every rank calls it). The saves are written in
/// the background (`SaveOptions::in_background`: training goes on while the files are written); the
/// last one is waited for.
///
/// # Errors
/// The save failed on some rank, or the previous background save did (every rank gets the
/// error).
pub fn save_if_due<M: Module, O: MasterWeightStep>(
    args: &ShardArgs,
    optim: &ShardedOptimizer<O>,
    model: &M,
    done: usize,
    steps: usize,
    progress: &Progress,
) -> Result<(), ShardError> {
    let Some(root) = &args.save_dir else {
        return Ok(());
    };
    if !done.is_multiple_of(args.save_every) && done != steps {
        return Ok(());
    }
    let dir = root.join(format!("step-{done:06}"));
    let last = done == steps;
    optim.save_checkpoint(
        model,
        &dir,
        SaveOptions::new(serde_json::json!({ "step": done })).in_background(),
    )?;
    if last {
        optim.wait_for_checkpoint()?;
    }
    if optim.comm().rank() == 0 {
        burn_shard::checkpoint::keep_last(root, args.keep)?;
        progress.println(&match last {
            true => format!("saved {}", dir.display()),
            false => format!("saving {} (in the background)", dir.display()),
        });
    }
    Ok(())
}

/// Where a step ended: `done` steps (1-based) of `steps`, validation every `eval_interval`.
#[derive(Clone, Copy, Debug)]
pub struct StepEnd {
    /// Steps done, counting this one.
    pub done: usize,
    /// Steps of the whole run.
    pub steps: usize,
    /// Steps between validation estimates (also after the last step).
    pub eval_interval: usize,
    /// This step's loss, mean over the ranks.
    pub train_loss: f32,
}

/// The end of every step of the examples' loops: records the training loss; every
/// `eval_interval` steps and after the last, runs `validate` (mean loss and, for classifiers,
/// accuracy in `[0, 1]`), prints and records it; saves a checkpoint when due
/// ([`save_if_due`]); advances the progress bar. A collective: every rank calls it. Returns
/// the validation loss when one was estimated.
///
/// # Errors
/// `validate` or the checkpoint failed (every rank gets the error).
pub fn end_step<M: Module, O: MasterWeightStep>(
    at: StepEnd,
    args: &ShardArgs,
    optim: &ShardedOptimizer<O>,
    model: &M,
    metrics: &mut Metrics,
    progress: &Progress,
    validate: impl FnOnce(&M, &dyn Collective) -> Result<(f32, Option<f32>), ShardError>,
) -> Result<Option<f32>, ShardError> {
    let StepEnd {
        done,
        steps,
        eval_interval,
        train_loss,
    } = at;
    metrics.train(done, train_loss);
    let mut val_loss = None;
    if done.is_multiple_of(eval_interval) || done == steps {
        let (loss, accuracy) = validate(model, optim.comm())?;
        let accuracy_text = accuracy.map_or(String::new(), |a| format!(", accuracy {:.2}%", a * 100.0));
        progress.println(&format!(
            "step {done:>5}: train loss {train_loss:.4}, val loss {loss:.4}{accuracy_text}"
        ));
        metrics.val(done, loss, accuracy);
        val_loss = Some(loss);
    }
    save_if_due(args, optim, model, done, steps, progress)?;
    progress.step(format!("loss {train_loss:.3}"));
    Ok(val_loss)
}

/// Reads a whole data file with an error that names it and says where it comes from.
///
/// # Errors
/// The file is missing or unreadable.
pub fn read_data(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| {
        format!(
            "cannot read {}: {e} (the examples ship their data in examples/data; see examples/data/README.md)",
            path.display()
        )
    })
}

/// Mean loss over `batches` random windows per rank of `ids` (`batch` windows of `block`
/// tokens each), averaged over the ranks. The windows are the same at every call: the
/// generator is seeded from `seed` and the rank. A collective: every rank calls it.
///
/// # Errors
/// The collective failed.
pub fn window_loss(
    ids: &[u16],
    (batches, batch, block): (usize, usize, usize),
    seed: u64,
    comm: &dyn Collective,
    loss: impl Fn(Tensor<2, Int>, Tensor<2, Int>) -> f32,
) -> Result<f32, ShardError> {
    let device = Device::flex();
    let mut rng = StdRng::seed_from_u64(seed ^ 0xe7a1 ^ ((comm.rank() as u64) << 32));
    let mut sum = 0.0;
    for _ in 0..batches {
        let (x, y) = sample_batch(ids, batch, block, &mut rng, &device);
        sum += loss(x, y);
    }
    mean_over_ranks(comm, sum / batches as f32)
}

/// Prints `model`'s per-rank model-state memory at `world_size` ranks for every stage, measured
/// and extrapolated by [`burn_shard::estimate::estimate_model`] (AdamW, the model's dtype), next
/// to the ZeRO paper's `f32` formula for its parameter count (§5.1: 16Ψ, 8Ψ+8Ψ/N, 4Ψ+12Ψ/N,
/// 16Ψ/N bytes). MiB = 2^20 bytes.
///
/// # Errors
/// The measurement failed (see `estimate_model`).
pub fn print_estimate<M: Module>(model: &M, world_size: usize) -> Result<(), String> {
    use burn_shard::estimate::{OffloadTarget, ParamDtype, STAGES, estimate_model, zero_formula};
    const MIB: f64 = 1024.0 * 1024.0;
    let estimate = estimate_model(model, world_size).map_err(|e| e.to_string())?;
    let psi = estimate.parameter_count;
    println!("per-rank model state at world size {world_size}, {psi} trainable parameters, AdamW (MiB):");
    println!("stage | parameters | gradients | optimizer state | total | ZeRO formula (f32)");
    for stage in STAGES {
        let e = estimate.stage(stage);
        let formula = zero_formula(psi as f64, world_size, stage, ParamDtype::F32, OffloadTarget::None);
        println!(
            "{stage} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2}",
            e.parameters_bytes / MIB,
            e.gradients_bytes / MIB,
            e.optimizer_state_bytes / MIB,
            e.total_bytes() / MIB,
            formula.total_bytes() / MIB
        );
    }
    println!("measured on 1 and 2 ranks and fitted to a + b/N (exact up to padding; activations not included)");
    Ok(())
}
