//! Sharded training equals unwrapped single-device Burn training: same per-step losses
//! (relative difference <= 1e-4) and final parameters (max abs difference <= 1e-4) for world
//! sizes 1-4 and stages 0-2; world size 1 is bitwise identical.

use burn::module::Module;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::prelude::*;
use burn_shard::{IntoOptimizer, ShardConfig, Stage};
use burn_shard_comm::{Collective, InProcessGroup, run_ranks};

use crate::common::*;

pub(crate) const STEPS: usize = 20;
pub(crate) const GLOBAL_BATCH: usize = 12; // divisible by 1, 2, 3 and 4
pub(crate) const LR: f64 = 1e-2;

/// Runs `STEPS` sharded steps on `world_size` rank threads; returns rank 0's globally averaged
/// losses and every rank's final parameters.
fn sharded_run<O: IntoOptimizer + Clone + Send + Sync>(
    base: &TinyMlp,
    optim: O,
    world_size: usize,
    config: ShardConfig,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    sharded_run_on(&Device::flex().autodiff(), base, optim, world_size, config)
}

/// [`sharded_run`] with every rank's model and data on `device` (an autodiff device).
fn sharded_run_on<O: IntoOptimizer + Clone + Send + Sync>(
    device: &Device,
    base: &TinyMlp,
    optim: O,
    world_size: usize,
    config: ShardConfig,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let results = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
        train_rank(comm, device, base, optim.clone(), config.clone())
    })
    .expect("no rank panics");
    let losses = results[0].losses.clone();
    (losses, results.into_iter().map(|r| r.params).collect())
}

/// What one rank of [`train_rank`] ends with.
pub(crate) struct RankRun {
    /// The globally averaged loss of each step.
    pub(crate) losses: Vec<f32>,
    /// The final parameters, every rank's the same.
    pub(crate) params: Vec<f32>,
    /// `RankReport::overlapped_buckets` at the last step: buckets reduced inside backward
    /// (read by the CubeCL device tests: a build with neither `wgpu` nor `cuda` leaves it unread).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    pub(crate) overlapped_buckets: usize,
    /// Buckets of the optimizer's layout.
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    pub(crate) buckets: usize,
}

/// One rank of a sharded run on any backend: `STEPS` steps on this rank's share of the global
/// batch.
pub(crate) fn train_rank<O: IntoOptimizer, C: Collective + 'static>(
    comm: C,
    device: &Device,
    base: &TinyMlp,
    optim: O,
    config: ShardConfig,
) -> RankRun {
    let (rank, world_size) = (comm.rank(), comm.world_size());
    let model = base.clone().fork(device);
    let (mut model, mut optim) = config.init(model, optim, comm).expect("init");
    let per_rank = GLOBAL_BATCH / world_size;
    let (start, end) = (rank * per_rank, (rank + 1) * per_rank);
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batch(step, GLOBAL_BATCH);
        let loss = mse(
            &model,
            rows(&x, IN, start, end, device),
            rows(&y, OUT, start, end, device),
        );
        let (next, global) = sharded_step(&mut optim, model, loss, LR);
        model = next;
        losses.push(global);
    }
    let (overlapped_buckets, buckets) = (
        optim.report().overlapped_buckets(),
        optim.report().layout().buckets().len(),
    );
    // Stage 3 unshards with a collective, so every rank does it.
    RankRun {
        losses,
        params: params_of(&model.materialize()),
        overlapped_buckets,
        buckets,
    }
}

/// `exact_at_one`: world size 1 must reproduce the reference bit for bit (true when the sharded
/// run uses Burn's own update math, or the fused Adam, which computes Burn's expression in
/// Burn's order).
fn check_all<O: IntoOptimizer + Clone + Send + Sync>(
    name: &str,
    reference: ModuleOptimizer,
    optim: O,
    bucket_numel: Option<usize>,
    exact_at_one: bool,
) {
    let device = Device::flex().autodiff();
    device.seed(7);
    let base = TinyMlp::new(&device);
    let (ref_losses, ref_params) = reference_run(&base, reference, STEPS, GLOBAL_BATCH, LR);
    assert!(
        ref_losses[STEPS - 1] < ref_losses[0],
        "{name}: the reference run must learn"
    );
    for world_size in 1..=4 {
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            let mut config = ShardConfig::new(stage);
            if let Some(b) = bucket_numel {
                config = config.with_bucket_numel(b);
            }
            let (losses, params) = sharded_run(&base, optim.clone(), world_size, config);
            let ctx = format!("{name}, world_size {world_size}, stage {stage}");
            for rank_params in &params[1..] {
                assert_eq!(
                    rank_params, &params[0],
                    "{ctx}: ranks must hold bitwise-identical parameters"
                );
            }
            if world_size == 1 && exact_at_one {
                assert_eq!(
                    losses, ref_losses,
                    "{ctx}: world_size 1 must be bitwise identical (losses)"
                );
                assert_eq!(
                    params[0], ref_params,
                    "{ctx}: world_size 1 must be bitwise identical (params)"
                );
                continue;
            }
            for (step, (a, b)) in losses.iter().zip(&ref_losses).enumerate() {
                let rel = (a - b).abs() / b.abs().max(1e-12);
                assert!(
                    rel <= 1e-4,
                    "{ctx}: step {step} loss {a} vs reference {b} (rel {rel:e})"
                );
            }
            let diff = max_abs_diff(&params[0], &ref_params);
            assert!(diff <= 1e-4, "{ctx}: max |param - reference| = {diff:e}");
        }
    }
}

#[test]
fn adam_matches_single_device() {
    check_all("Adam", AdamConfig::new().init(), AdamConfig::new().build(), None, true);
}

#[test]
fn adamw_matches_single_device() {
    let cfg = AdamWConfig::new().with_weight_decay(0.1);
    check_all("AdamW", cfg.init(), cfg.build(), None, true);
}

#[test]
fn sgd_momentum_matches_single_device() {
    let cfg = SgdConfig::new().with_momentum(Some(MomentumConfig::new().with_nesterov(true)));
    check_all("SGD+momentum", cfg.init(), cfg.build(), None, true);
}

#[test]
fn fused_adamw_matches_burn_adamw_at_every_stage() {
    let cfg = AdamWConfig::new().with_weight_decay(0.1);
    let fused = burn_shard_kernels::FusedAdamConfig::adamw()
        .with_weight_decay(0.1)
        .init();
    check_all("FusedAdamW", cfg.init(), fused, None, true);
}

#[test]
fn burn_adamw_config_runs_the_fused_step_and_matches_single_device() {
    // Passing Burn's config (not its built optimizer) selects the fused step.
    let cfg = AdamWConfig::new().with_weight_decay(0.1).with_amsgrad(true);
    check_all("AdamWConfig", cfg.init(), cfg.clone(), None, true);
    let device = Device::flex().autodiff();
    let paths = step_paths(&device, &TinyMlp::new(&device), cfg, Stage::Two);
    assert_eq!(paths, [burn_shard_kernels::StepPath::FusedCpu; 2]);
}

/// Which path each of 2 ranks' fused optimizer took in one sharded step of `base` on `device`:
/// asked of the state's moments, which are shaped and placed like the shard that was stepped.
pub(crate) fn step_paths(
    device: &Device,
    base: &TinyMlp,
    cfg: AdamWConfig,
    stage: Stage,
) -> Vec<burn_shard_kernels::StepPath> {
    run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let (model, mut optim) = ShardConfig::new(stage)
            .init(base.clone().fork(device), cfg.clone(), comm)
            .unwrap();
        let (x, y) = batch(0, 4);
        let loss = mse(&model, rows(&x, IN, 0, 2, device), rows(&y, OUT, 0, 2, device));
        sharded_step(&mut optim, model, loss, LR);
        let state = optim
            .report()
            .slot_states()
            .iter()
            .flatten()
            .next()
            .cloned()
            .expect("stepped");
        optim.optimizer().path_for(&state.momentum.moment_1)
    })
    .unwrap()
}

#[test]
fn many_small_buckets_match_single_device() {
    // 16-element buckets: every parameter of TinyMlp lands in a bucket of its own or shares one.
    check_all(
        "Adam, 16-element buckets",
        AdamConfig::new().init(),
        AdamConfig::new().build(),
        Some(16),
        true,
    );
}

#[test]
fn ranks_start_from_rank_zero_parameters() {
    // Each rank shifts its copy by its rank; init must broadcast rank 0's (unshifted) values.
    let device = Device::flex().autodiff();
    let base = TinyMlp::new(&device);
    let expected = params_of(&base);
    for stage in [Stage::Zero, Stage::Three] {
        let results = run_ranks(InProcessGroup::new(3).unwrap(), |comm| {
            let device = Device::flex().autodiff();
            let shifted = base.clone().fork(&device).map(&mut AddScalar(comm.rank() as f32));
            let (model, _optim) = ShardConfig::new(stage)
                .init(shifted, AdamConfig::new().build(), comm)
                .unwrap();
            params_of(&model.materialize())
        })
        .unwrap();
        for (rank, p) in results.iter().enumerate() {
            assert_eq!(
                p, &expected,
                "stage {stage}: rank {rank} must start from rank 0's parameters"
            );
        }
    }
}

struct AddScalar(f32);
impl burn::module::ModuleMapper for AddScalar {
    fn map_float<const D: usize>(&mut self, p: burn::module::Param<Tensor<D>>) -> burn::module::Param<Tensor<D>> {
        let s = self.0;
        p.map(|t| (t.inner().add_scalar(s)).autodiff().require_grad())
    }
}

/// The example's GPT (embeddings, layer norm, causal attention, GELU MLP) on real tiny
/// shakespeare windows: stage 2 on 2 ranks follows unwrapped training.
#[test]
fn gpt_on_shakespeare_matches_single_device() {
    use burn_shard_examples::char_data::{CharCorpus, sample_batch};
    use burn_shard_examples::gpt::{Gpt, GptConfig};
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    let text = include_str!("../../examples/data/tinyshakespeare.txt");
    let corpus = CharCorpus::new(&text[..20_000]);
    let config = GptConfig {
        vocab_size: corpus.vocab_size(),
        block_size: 8,
        n_embd: 16,
        n_head: 2,
        n_layer: 1,
    };
    let device = Device::flex().autodiff();
    let base = Gpt::new(&config, &device);
    let optim_cfg = AdamWConfig::new().with_weight_decay(0.1);
    const STEPS: usize = 5;
    let batches: Vec<_> = {
        let mut rng = StdRng::seed_from_u64(3);
        (0..STEPS)
            .map(|_| sample_batch(&corpus.train, 4, 8, &mut rng, &device))
            .collect()
    };

    let mut model = base.clone().fork(&device);
    let mut reference = optim_cfg.init();
    let mut ref_losses = Vec::new();
    for (x, y) in &batches {
        let loss = model.loss(x.clone(), y.clone());
        ref_losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = reference.step(1e-2, model, grads);
    }
    let ref_params = params_of(&model);

    for stage in [Stage::Two, Stage::Three] {
        let out = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
            let rank = comm.rank();
            let device = Device::flex().autodiff();
            let (mut model, mut optim) = ShardConfig::new(stage)
                .init(base.clone().fork(&device), optim_cfg.build(), comm)
                .unwrap();
            let mut losses = Vec::new();
            for (x, y) in &batches {
                let (x, y) = (x.clone().narrow(0, 2 * rank, 2), y.clone().narrow(0, 2 * rank, 2));
                let loss = model.loss(x, y);
                let (next, global) = sharded_step(&mut optim, model, loss, 1e-2);
                model = next;
                losses.push(global);
            }
            (losses, params_of(&model.materialize()))
        })
        .unwrap();
        for (step, (a, b)) in out[0].0.iter().zip(&ref_losses).enumerate() {
            assert!(
                (a - b).abs() / b.abs() <= 1e-4,
                "GPT stage {stage} step {step}: loss {a} vs reference {b}"
            );
        }
        let diff = max_abs_diff(&out[0].1, &ref_params);
        assert!(diff <= 1e-4, "GPT stage {stage}: max |param - reference| = {diff:e}");
        assert_eq!(out[0].1, out[1].1, "ranks hold identical GPT parameters");
    }
}

/// Stages 0-3 and world sizes 1-3 on Burn's CubeCL backend through wgpu (lavapipe on CI), built
/// as GPU users build Burn (`fusion` on: the suite's default features) and without `fusion`
/// (`--no-default-features --features wgpu,autotune`): stage 3's gather op, the stage 0-2 bucket hooks
/// reducing inside backward, and the fused Adam kernel, all on CubeCL tensors, against
/// single-device training on the CPU.
#[cfg(feature = "wgpu")]
#[test]
fn sharded_training_on_wgpu_matches_single_device_on_the_cpu() {
    let Some(wgpu) = crate::fused_adam_wgpu::device() else {
        return;
    };
    check_on_cube_device(&wgpu, 1..=3, 1e-4);
}

/// Stages 0-3 at `world_sizes` with every rank (a thread) on the CubeCL device `cube` (wgpu in
/// the suite, CUDA in the GPU suite), against single-device training on the CPU: losses
/// (relative) and parameters (absolute) within `tolerance`, identical parameters on every rank,
/// the fused Adam kernel stepping the shards, and every bucket of stages 0-2 reduced inside
/// backward. Prints the largest differences.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub(crate) fn check_on_cube_device(cube: &Device, world_sizes: impl IntoIterator<Item = usize>, tolerance: f32) {
    assert_eq!(
        burn_shard_kernels::fusion_on(),
        cfg!(feature = "fusion"),
        "CubeCL devices run Fusion<CubeBackend> exactly when the build turns Burn's `fusion` on"
    );
    let device = Device::flex().autodiff();
    device.seed(7);
    let base = TinyMlp::new(&device);
    let cfg = AdamWConfig::new().with_weight_decay(0.1);
    let (ref_losses, ref_params) = reference_run(&base, cfg.init(), STEPS, GLOBAL_BATCH, LR);
    let cube = cube.clone().autodiff();
    // The local shards are stepped by the CubeCL kernel, not by Burn's optimizer.
    for stage in [Stage::One, Stage::Three] {
        let paths = step_paths(&cube, &base, cfg.clone(), stage);
        assert_eq!(paths, [burn_shard_kernels::StepPath::CubeKernel; 2], "stage {stage}");
    }
    for world_size in world_sizes {
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            let ctx = format!(
                "{cube:?} (fusion {}), world_size {world_size}, stage {stage}",
                cfg!(feature = "fusion")
            );
            let runs = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
                train_rank(comm, &cube, &base, cfg.clone(), ShardConfig::new(stage))
            })
            .expect("no rank panics");
            for run in &runs {
                assert_eq!(
                    run.params, runs[0].params,
                    "{ctx}: ranks must hold identical parameters"
                );
                // Stages 0-2 reduce every bucket inside backward once the first step learned
                // the order (the in-process backend overlaps on any device with the hook).
                let inside = if world_size > 1 && stage != Stage::Three {
                    run.buckets
                } else {
                    0
                };
                assert_eq!(run.overlapped_buckets, inside, "{ctx}: buckets reduced inside backward");
            }
            for (step, (a, b)) in runs[0].losses.iter().zip(&ref_losses).enumerate() {
                let rel = (a - b).abs() / b.abs().max(1e-12);
                assert!(rel <= tolerance, "{ctx}: step {step} loss {a} vs reference {b}");
            }
            let diff = max_abs_diff(&runs[0].params, &ref_params);
            eprintln!("{ctx}: max |param - reference| = {diff:e}");
            assert!(diff <= tolerance, "{ctx}: max |param - reference| = {diff:e}");
        }
    }
}
