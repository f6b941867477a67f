//! The measurements of the GPU benchmark (`gpu-bench`, bundled by `cargo xtask gpu-bundle` and
//! run on a GPU machine by the bundle's `run.sh`). They take the device as an argument, so the
//! test suite runs them on the CPU at toy sizes; the `gpu-bench` binary runs them on CUDA.
//!
//! - [`adam_row`]: one AdamW step on a flat `f32` shard, burn-shard's fused step (the CubeCL
//!   kernel on a CubeCL device) next to Burn's own AdamW on the same device.
//! - [`train_gpt_rank`] / [`gpt_in_process`]: the shakespeare example's GPT trained for a few
//!   steps at one stage, with the step time, the tokens per second, each rank's model-state
//!   bytes from [`burn_shard::RankReport::memory`], the device allocator's bytes
//!   ([`Device::memory_pool_usage`]) and the share of collective time hidden behind compute
//!   ([`CommStats::hidden_share`]).

use std::time::Instant;

use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn_shard::comm::{Collective, CommStats, InProcessGroup, ReduceOp, run_ranks};
use burn_shard::kernels::FusedAdamConfig;
use burn_shard::{ShardConfig, ShardError, Stage};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::char_data::{CharCorpus, sample_batch};
use crate::gpt::{Gpt, GptConfig};
use crate::training::training_device_on;

/// Bytes one AdamW step moves per element: it reads the parameter, the gradient and both
/// moments (16 B) and writes the parameter and both moments (12 B).
pub const ADAM_BYTES_PER_ELEMENT: f64 = 28.0;

/// One row of the Adam table: the fastest of the timed steps of each implementation.
#[derive(Debug, Clone)]
pub struct AdamRow {
    /// Elements of the flat `f32` shard.
    pub elements: usize,
    /// burn-shard's fused AdamW step, milliseconds.
    pub fused_ms: f64,
    /// Burn's `AdamW` on the same tensors, milliseconds.
    pub burn_ms: f64,
    /// How the fused step ran (`CubeKernel` on a CubeCL device).
    pub path: String,
}

impl AdamRow {
    /// GB/s (1e9 bytes per second) of a step that took `ms`, at [`ADAM_BYTES_PER_ELEMENT`].
    pub fn gbs(&self, ms: f64) -> f64 {
        ADAM_BYTES_PER_ELEMENT * self.elements as f64 / (ms / 1e3) / 1e9
    }
}

/// Times one AdamW step (lr 1e-3, both configs' default weight decay 1e-4) on `[elements]`
/// `f32` tensors on `device`, the fused step and Burn's, `reps` timed steps each after one
/// warm-up step, the optimizer state carried from step to step as in training. Each step is
/// timed from the host between two `device.sync()` calls.
///
/// # Errors
/// The device reported a failure at a synchronisation (a lost device). An allocation the
/// device cannot hold panics inside CubeCL: callers that sweep sizes catch it.
pub fn adam_row(device: &Device, elements: usize, reps: usize) -> Result<AdamRow, String> {
    let fused = FusedAdamConfig::adamw().init();
    let probe = Tensor::<1>::zeros([1], device);
    let path = format!("{:?}", fused.path_for(&probe));
    let fused_ms = time_steps(device, elements, reps, |p, g, s| fused.step(1e-3, p, g, s))?;
    let burn = AdamWConfig::new().build();
    let burn_ms = time_steps(device, elements, reps, |p, g, s| burn.step(1e-3, p, g, s))?;
    Ok(AdamRow {
        elements,
        fused_ms,
        burn_ms,
        path,
    })
}

fn time_steps<S>(
    device: &Device,
    n: usize,
    reps: usize,
    step: impl Fn(Tensor<1>, Tensor<1>, Option<S>) -> (Tensor<1>, Option<S>),
) -> Result<f64, String> {
    let mut param = Tensor::<1>::random([n], Distribution::Default, device);
    let grad = Tensor::<1>::random([n], Distribution::Default, device);
    let sync = || device.sync().map_err(|e| format!("the device failed: {e:?}"));
    let mut state = None;
    let mut best = f64::INFINITY;
    for i in 0..=reps.max(1) {
        let g = grad.clone();
        sync()?;
        let start = Instant::now();
        let (p, s) = step(param, g, state);
        sync()?;
        if i > 0 {
            best = best.min(start.elapsed().as_secs_f64() * 1e3);
        }
        param = p;
        state = s;
    }
    Ok(best)
}

/// One GPT configuration of the benchmark.
#[derive(Debug, Clone)]
pub struct GptSpec {
    /// (n_embd, n_head, n_layer) of the shakespeare example's GPT.
    pub dims: (usize, usize, usize),
    /// Context length, tokens.
    pub block_size: usize,
    /// Sequences per step over all ranks (divisible by the world size).
    pub global_batch: usize,
    /// Untimed steps first (kernel compilation, autotune, the bucket order).
    pub warmup: usize,
    /// Timed steps.
    pub steps: usize,
    /// The ZeRO stage.
    pub stage: Stage,
}

/// What one rank measured over the timed steps of a [`GptSpec`].
#[derive(Debug, Clone)]
pub struct GptRankRun {
    /// Parameters of the whole model.
    pub params: usize,
    /// Wall time of each timed step, milliseconds (forward, backward, sharded step, then a
    /// device synchronisation).
    pub step_ms: Vec<f64>,
    /// The mean over ranks of each step's loss (all steps, warm-up included).
    pub losses: Vec<f32>,
    /// This rank's parameters + gradients + optimizer state, bytes
    /// ([`burn_shard::RankReport::memory`] after the last step).
    pub model_state_bytes: u64,
    /// The largest `bytes_in_use` of the device's allocator seen after backward or after a step, bytes; `None`
    /// where the backend does not report it (Burn's Flex CPU backend). Ranks that share one
    /// device see the same allocator.
    pub device_in_use_peak: Option<u64>,
    /// The largest `bytes_reserved` (in use plus pages kept for reuse) seen at the same points, bytes.
    pub device_reserved_peak: Option<u64>,
    /// Share of the collectives' time hidden behind compute over the timed steps; `None` when
    /// nothing was communicated.
    pub hidden_share: Option<f64>,
    /// Bytes this rank sent per timed step.
    pub sent_per_step: f64,
}

impl GptRankRun {
    /// Raises the device peaks to what `device`'s allocator holds now (a no-op on backends that
    /// do not report it).
    fn sample_device_memory(&mut self, device: &Device) {
        if let Some(usage) = device.memory_pool_usage() {
            self.device_in_use_peak = self.device_in_use_peak.max(Some(usage.bytes_in_use));
            self.device_reserved_peak = self.device_reserved_peak.max(Some(usage.bytes_reserved));
        }
    }

    /// Median of [`step_ms`](Self::step_ms).
    pub fn median_step_ms(&self) -> f64 {
        median(&self.step_ms)
    }
}

/// The median of `values` (the mean of the middle two for an even count; NaN when empty): the
/// benchmarks' summary of repeated timings.
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The GPT of `spec` on `vocab_size` characters, initialised from a fixed seed on the CPU's
/// [`training_device_on`] of the stage, so that every configuration starts from the same
/// weights (its parameters require gradients and keep that device's checkpointing strategy,
/// which every rank's device shares). Fork it onto each rank's device.
pub fn gpt_base(spec: &GptSpec, vocab_size: usize) -> Gpt {
    let device = training_device_on(&Device::flex(), spec.stage);
    let (n_embd, n_head, n_layer) = spec.dims;
    device.seed(1337);
    Gpt::new(
        &GptConfig {
            vocab_size,
            block_size: spec.block_size,
            n_embd,
            n_head,
            n_layer,
        },
        &device,
    )
}

/// One rank's training of `base` (already on `device`, an autodiff device from [`training_device_on`]) for `spec`, through
/// `comm`: AdamW (β₂ 0.99, weight decay 0.1, lr 1e-3), this rank's slice of each global batch
/// of `corpus`' training text.
///
/// # Errors
/// The global batch does not divide by the world size; sharding or a step failed (a
/// [`ShardError`]'s message; every rank gets the error of a collective); the device failed to
/// synchronise.
pub fn train_gpt_rank<C: Collective + 'static>(
    comm: C,
    device: &Device,
    base: Gpt,
    corpus: &CharCorpus,
    spec: &GptSpec,
) -> Result<GptRankRun, String> {
    train(comm, device, base, corpus, spec).map_err(|e| e.to_string())
}

/// Why a rank's training stopped.
enum Stop {
    Shard(ShardError),
    Device(String),
}

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stop::Shard(e) => write!(f, "{e}"),
            Stop::Device(e) => write!(f, "the device failed: {e}"),
        }
    }
}

impl From<ShardError> for Stop {
    fn from(e: ShardError) -> Self {
        Stop::Shard(e)
    }
}

impl From<burn_shard::comm::CommError> for Stop {
    fn from(e: burn_shard::comm::CommError) -> Self {
        Stop::Shard(e.into())
    }
}

fn train<C: Collective + 'static>(
    comm: C,
    device: &Device,
    base: Gpt,
    corpus: &CharCorpus,
    spec: &GptSpec,
) -> Result<GptRankRun, Stop> {
    let (rank, world_size) = (comm.rank(), comm.world_size());
    if !spec.global_batch.is_multiple_of(world_size) {
        return Err(Stop::Shard(ShardError::InvalidConfig(format!(
            "the global batch {} must divide by the world size {world_size}",
            spec.global_batch
        ))));
    }
    let local = spec.global_batch / world_size;
    let params = base.num_params();
    let optimizer = AdamWConfig::new().with_beta_2(0.99).with_weight_decay(0.1);
    let (mut model, mut optim) = ShardConfig::new(spec.stage).init(base, optimizer, comm)?;
    let mut rng = StdRng::seed_from_u64(1337 + rank as u64 * 7919);
    let mut run = GptRankRun {
        params,
        step_ms: Vec::new(),
        losses: Vec::new(),
        model_state_bytes: 0,
        device_in_use_peak: None,
        device_reserved_peak: None,
        hidden_share: None,
        sent_per_step: 0.0,
    };
    let mut before = CommStats::default();
    for step in 0..spec.warmup + spec.steps {
        if step == spec.warmup {
            before = optim.comm().stats();
        }
        let (x, y) = sample_batch(&corpus.train, local, spec.block_size, &mut rng, device);
        let start = Instant::now();
        let loss = model.loss(x, y);
        let logged = loss.clone();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        // After backward the gradients and what backward kept are all alive: the step's peak.
        run.sample_device_memory(device);
        model = optim.step(1e-3, model, grads)?;
        device.sync().map_err(|e| Stop::Device(format!("{e:?}")))?;
        if step >= spec.warmup {
            run.step_ms.push(start.elapsed().as_secs_f64() * 1e3);
        }
        run.sample_device_memory(device);
        run.losses.push(logged.into_scalar::<f32>());
    }
    let timed = optim.comm().stats().since(&before);
    run.hidden_share = timed.hidden_share();
    run.sent_per_step = timed.total_bytes_sent() as f64 / spec.steps.max(1) as f64;
    // The mean over ranks of each step's loss, in one collective after the timed steps (so it
    // counts in neither the step times nor the traffic), on the rank's device (NCCL takes only
    // CUDA tensors).
    let local = Tensor::<1>::from_floats(run.losses.as_slice(), &device.clone().without_autodiff());
    let mean = optim.comm().all_reduce(local, ReduceOp::Avg)?;
    run.losses = mean.into_data().convert::<f32>().iter::<f32>().collect();
    run.model_state_bytes = optim.report().memory(&model).model_state_bytes() as u64;
    Ok(run)
}

/// `spec` trained by `world_size` ranks as threads of this process, all on `device`, through
/// the in-process backend. Returns every rank's run.
///
/// # Errors
/// A rank failed or panicked (the message names it).
pub fn gpt_in_process(
    device: &Device,
    world_size: usize,
    corpus: &CharCorpus,
    spec: &GptSpec,
) -> Result<Vec<GptRankRun>, String> {
    let autodiff = training_device_on(device, spec.stage);
    let base = gpt_base(spec, corpus.vocab_size());
    let group = InProcessGroup::new(world_size).map_err(|e| e.to_string())?;
    run_ranks(group, |comm| {
        train_gpt_rank(comm, &autodiff, base.clone().fork(&autodiff), corpus, spec)
    })
    .map_err(|f| format!("rank {} panicked: {}", f.rank, f.message))?
    .into_iter()
    .collect()
}
