//! Gradient clipping under sharding equals single-device clipping at every stage and world size
//! 1-4: Burn's per-parameter clipping from the optimizer config (`Norm`, `Value`), and clipping
//! by global norm (PyTorch's `clip_grad_norm_`), whose pre-clip norm every rank reports. Each
//! would fail if a norm were taken over a rank's shard only.

use burn::grad_clipping::{GradientClipping, GradientClippingConfig};
use burn::module::{Module, Param, ParamGroup};
use burn::optim::{AdamWConfig, GradientsParams, MuonConfig, SgdConfig};
use burn::prelude::*;
use burn_shard::{IntoOptimizer, OptimizerGroups, ShardConfig, Stage};
use burn_shard_comm::{Collective, InProcessGroup};

use crate::common::*;
use crate::equivalence::{GLOBAL_BATCH, LR, STEPS};

/// Small enough that the first steps' gradients are clipped (checked by each test).
const MAX_NORM: f32 = 0.05;

/// One rank: `STEPS` AdamW-family steps with `config` and `optim`; returns the globally averaged
/// losses followed by the norms the optimizer reported (when it measured them), and the final
/// parameters.
fn rank_run<O: IntoOptimizer>(comm: impl Collective + 'static, config: ShardConfig, optim: O) -> (Vec<f32>, Vec<f32>) {
    let device = Device::flex().autodiff();
    let (lo, hi) = rank_rows(comm.rank(), comm.world_size(), GLOBAL_BATCH);
    let base = base_model();
    let global = config.max_grad_norm.is_some();
    let (mut model, mut optim) = config.init(base.fork(&device), optim, comm).expect("init");
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for step in 0..STEPS {
        let (x, y) = batch(step, GLOBAL_BATCH);
        let loss = mse(&model, rows(&x, IN, lo, hi, &device), rows(&y, OUT, lo, hi, &device));
        let (next, global) = sharded_step(&mut optim, model, loss, LR);
        model = next;
        losses.push(global);
        norms.extend(optim.report().last_grad_norm().map(|n| n as f32));
    }
    // The norms are compared where the reference clips by global norm.
    if global {
        losses.extend(norms);
    }
    (losses, params_of(&model.materialize()))
}

fn base_model() -> TinyMlp {
    let device = Device::flex().autodiff();
    let mut rng = Rng::new(11);
    // Deterministic parameters from our own stream (Burn's RNG is process-wide).
    TinyMlp::new(&device).map(&mut Fill(&mut rng))
}

struct Fill<'a>(&'a mut Rng);

impl burn::module::ModuleMapper for Fill<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, tensor, mapper) = param.consume();
        let shape = tensor.shape();
        let values = self.0.vec(shape.num_elements());
        let fresh = Tensor::<D>::from_data(TensorData::new(values, shape), &tensor.device()).require_grad();
        Param::from_mapped_value(id, fresh, mapper)
    }
}

/// Single-device Burn training on the whole global batch with `clip` applied to the gradients
/// before Burn's AdamW step: the losses followed by the norms `clip` returned, and the final
/// parameters.
fn reference<C>(optim: burn::optim::ModuleOptimizer, mut clip: C) -> (Vec<f32>, Vec<f32>)
where
    C: FnMut(&TinyMlp, GradientsParams) -> (GradientsParams, Option<f64>),
{
    let mut optim = optim;
    let mut norms = Vec::new();
    let (mut losses, params) = reference_loop(&base_model(), STEPS, GLOBAL_BATCH, |_, model, grads| {
        let (grads, norm) = clip(&model, grads);
        norms.extend(norm.map(|n| n as f32));
        optim.step(LR, model, grads)
    });
    losses.extend(norms);
    (losses, params)
}

/// PyTorch's `clip_grad_norm_` in float64: scales every gradient by
/// `min(1, max_norm / (norm + 1e-6))`; returns the pre-clip norm.
fn clip_global(model: &TinyMlp, mut grads: GradientsParams, max_norm: f32) -> (GradientsParams, f64) {
    let norm = grad_norm(model, &mut grads);
    let coef = (f64::from(max_norm) / (norm + 1e-6)).min(1.0) as f32;
    for (id, d) in param_ids(model) {
        map_grad(&mut grads, id, d, |g| g.mul_scalar(coef));
    }
    (grads, norm)
}

/// The reference must differ from unclipped training, or the test proves nothing.
fn assert_clipping_acts(name: &str, clipped: &(Vec<f32>, Vec<f32>)) {
    let unclipped = reference(AdamWConfig::new().init(), |_, g| (g, None));
    let diff = max_abs_diff(&clipped.1, &unclipped.1);
    assert!(diff > 1e-3, "{name}: clipping must change training (max diff {diff:e})");
}

#[test]
fn burn_norm_clipping_in_the_config_clips_each_parameter_by_its_whole_norm() {
    let config = AdamWConfig::new().with_grad_clipping(Some(GradientClippingConfig::Norm(MAX_NORM)));
    // Burn's ModuleOptimizer clips each parameter by its own norm.
    let reference = reference(config.init(), |_, g| (g, None));
    assert_clipping_acts("Norm", &reference);
    sweep("per-parameter Norm clipping", &reference, 1e-4, |comm, stage| {
        rank_run(comm, ShardConfig::new(stage), config.clone())
    });
}

#[test]
fn burn_value_clipping_in_the_config_clamps_each_element() {
    let config = AdamWConfig::new().with_grad_clipping(Some(GradientClippingConfig::Value(0.02)));
    let reference = reference(config.init(), |_, g| (g, None));
    assert_clipping_acts("Value", &reference);
    sweep("Value clipping", &reference, 1e-4, |comm, stage| {
        rank_run(comm, ShardConfig::new(stage), config.clone())
    });
}

#[test]
fn clipping_by_global_norm_matches_clip_grad_norm_and_reports_the_pre_clip_norm() {
    let reference = reference(AdamWConfig::new().init(), |model, g| {
        let (g, norm) = clip_global(model, g, MAX_NORM);
        (g, Some(norm))
    });
    assert_clipping_acts("global norm", &reference);
    // Losses and the pre-clip norm of every step, relative 1e-4 as every equivalence test: after
    // some steps the f32 trajectories of the fused AdamW and Burn's differ by rounding (the norm
    // itself is checked to 1e-6 in the one-step test below).
    sweep("global-norm clipping", &reference, 1e-4, |comm, stage| {
        rank_run(
            comm,
            ShardConfig::new(stage).with_max_grad_norm(MAX_NORM),
            AdamWConfig::new(),
        )
    });
}

/// Clipping by global norm with Muon for the matrices beside AdamW (`OptimizerGroups`; each
/// matrix stepped whole by one rank, at stage 3 gathered to it): the global norm is taken over
/// every parameter before Muon's whole-matrix step, as `clip_grad_norm_` then Burn's
/// `ModuleOptimizer` with the same groups, at every stage and world size.
#[test]
fn clipping_by_global_norm_with_muon_groups_matches_clip_grad_norm() {
    let matrices = || ParamGroup::from_regex(r"^l[12]\.weight$").expect("a valid regex");
    let burn = || {
        AdamWConfig::new()
            .init()
            .with_group(matrices(), MuonConfig::new().build(), None)
    };
    let unclipped = reference(burn(), |_, g| (g, None));
    let clipped = reference(burn(), |model, g| {
        let (g, norm) = clip_global(model, g, MAX_NORM);
        (g, Some(norm))
    });
    let diff = max_abs_diff(&clipped.1, &unclipped.1);
    assert!(diff > 1e-3, "clipping must change Muon's training (max diff {diff:e})");
    sweep("global-norm clipping, Muon groups", &clipped, 1e-4, |comm, stage| {
        let groups = OptimizerGroups::new(AdamWConfig::new()).with_group(matrices(), MuonConfig::new(), None);
        rank_run(comm, ShardConfig::new(stage).with_max_grad_norm(MAX_NORM), groups)
    });
}

#[test]
fn an_infinite_max_norm_measures_without_clipping() {
    let reference = reference(AdamWConfig::new().init(), |model, g| {
        let (g, norm) = clip_global(model, g, f32::INFINITY);
        (g, Some(norm))
    });
    sweep("norm measured, not clipped", &reference, 1e-4, |comm, stage| {
        rank_run(
            comm,
            ShardConfig::new(stage).with_max_grad_norm(f32::INFINITY),
            AdamWConfig::new(),
        )
    });
}

/// Learning rate of the one-step tests: one SGD step moves each parameter by `SGD_LR · clipped
/// gradient`, so the clipped gradient can be read off the parameters element by element.
const SGD_LR: f64 = 1000.0;

/// The clipped gradient `(before - after) / SGD_LR` of every parameter element, in float64.
fn update_of(before: &[f32], after: &[f32]) -> Vec<f64> {
    before
        .iter()
        .zip(after)
        .map(|(b, a)| (f64::from(*b) - f64::from(*a)) / SGD_LR)
        .collect()
}

/// One sharded SGD step on the first global batch at every world size 1-4 and stage, with
/// `config(stage)` and per-parameter `clipping` on every parameter (a `ParamGroup::all()`
/// group); checks every rank's update against `expected` within `1e-6 · max|expected|`, and the
/// reported norm against `norm` within 1e-6 relative when one is given.
fn check_one_sgd_step(
    name: &str,
    config: impl Fn(Stage) -> ShardConfig + Sync,
    clipping: Option<GradientClipping>,
    expected: &[f64],
    norm: Option<f64>,
) {
    let before = params_of(&base_model());
    let scale = expected.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let (x, y) = batch(0, GLOBAL_BATCH);
    for world_size in 1..=4 {
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            let group = InProcessGroup::new(world_size).unwrap();
            let results = burn_shard_comm::run_ranks(group, |comm| {
                let device = Device::flex().autodiff();
                let (lo, hi) = rank_rows(comm.rank(), comm.world_size(), GLOBAL_BATCH);
                let (model, optim) = config(stage)
                    .init(base_model().fork(&device), SgdConfig::new().build(), comm)
                    .expect("init");
                let mut optim = match clipping.clone() {
                    Some(c) => optim
                        .with_group(ParamGroup::all(), SgdConfig::new().build(), Some(c))
                        .expect("group"),
                    None => optim,
                };
                let loss = mse(&model, rows(&x, IN, lo, hi, &device), rows(&y, OUT, lo, hi, &device));
                let (model, _) = sharded_step(&mut optim, model, loss, SGD_LR);
                (params_of(&model.materialize()), optim.report().last_grad_norm())
            })
            .expect("no rank panics");
            let ctx = format!("{name}, world_size {world_size}, stage {stage}");
            for (params, reported) in &results {
                if let Some(norm) = norm {
                    let reported = reported.expect("the norm is measured");
                    assert!(
                        ((reported - norm) / norm).abs() < 1e-6,
                        "{ctx}: reported norm {reported} vs {norm}"
                    );
                }
                let worst = update_of(&before, params)
                    .iter()
                    .zip(expected)
                    .map(|(got, want)| (got - want).abs())
                    .fold(0.0, f64::max);
                assert!(
                    worst <= 1e-6 * scale,
                    "{ctx}: clipped gradient off by {worst:e} (max |g| {scale:e})"
                );
            }
        }
    }
}

/// The gradient of the whole first global batch, single device.
fn first_gradient() -> (TinyMlp, GradientsParams) {
    let device = Device::flex().autodiff();
    let (x, y) = batch(0, GLOBAL_BATCH);
    let model = base_model().fork(&device);
    let loss = mse(
        &model,
        rows(&x, IN, 0, GLOBAL_BATCH, &device),
        rows(&y, OUT, 0, GLOBAL_BATCH, &device),
    );
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    (model, grads)
}

#[test]
fn globally_clipped_gradients_equal_clip_grad_norm_within_1e_6_relative() {
    let (model, grads) = first_gradient();
    let (grads, norm) = clip_global(&model, grads, MAX_NORM);
    assert!(
        norm > f64::from(MAX_NORM) * 2.0,
        "the gradient must be clipped (norm {norm})"
    );
    let mut expected = Vec::new();
    for (id, d) in param_ids(&model) {
        let g = match d {
            1 => grads.get::<1>(id).unwrap().into_data(),
            _ => grads.get::<2>(id).unwrap().into_data(),
        };
        expected.extend(g.convert::<f64>().iter::<f64>());
    }
    let config = |stage| ShardConfig::new(stage).with_max_grad_norm(MAX_NORM);
    check_one_sgd_step("global norm", config, None, &expected, Some(norm));
}

/// Burn's per-parameter `Norm` clipping against Burn's own SGD with that clipping, one step:
/// a norm taken over a rank's piece of a parameter instead of the whole parameter would
/// scale that piece differently.
#[test]
fn per_parameter_norm_clipped_gradients_equal_burns_within_1e_6_relative() {
    let (model, grads) = first_gradient();
    let before = params_of(&model);
    let mut optim = SgdConfig::new()
        .with_gradient_clipping(Some(GradientClippingConfig::Norm(MAX_NORM)))
        .init();
    let expected = update_of(&before, &params_of(&optim.step(SGD_LR, model, grads)));
    let (model, grads) = first_gradient();
    let unclipped: f64 = {
        let mut grads = grads;
        grad_norm(&model, &mut grads)
    };
    assert!(
        unclipped > f64::from(MAX_NORM) * 2.0,
        "parameters must be clipped (norm {unclipped})"
    );
    let clipping = Some(GradientClipping::Norm(MAX_NORM));
    check_one_sgd_step("per-parameter Norm", ShardConfig::new, clipping, &expected, None);
}

#[test]
fn clipping_twice_by_norm_or_by_a_bad_norm_is_refused_at_init() {
    let device = Device::flex().autodiff();
    let cases = [
        (
            ShardConfig::new(Stage::Two).with_max_grad_norm(1.0),
            AdamWConfig::new().with_grad_clipping(Some(GradientClippingConfig::Norm(1.0))),
            "clipped twice by norm",
        ),
        (
            ShardConfig::new(Stage::One).with_max_grad_norm(0.0),
            AdamWConfig::new(),
            "must be positive",
        ),
        (
            ShardConfig::new(Stage::Three).with_max_grad_norm(f32::NAN),
            AdamWConfig::new(),
            "must be positive",
        ),
    ];
    for (config, optim, expected) in cases {
        let comm = InProcessGroup::new(1).unwrap().into_comms().pop().unwrap();
        let err = config.init(TinyMlp::new(&device), optim, comm).err().expect("refused");
        assert!(err.to_string().contains(expected), "{err}");
    }
}

/// A model of one `f32` parameter of `numel` elements whose loss is `Σ p·c`, so its gradient is
/// exactly `c` on every rank (and after averaging).
#[derive(Module, Debug)]
struct Linear1 {
    p: Param<Tensor<1>>,
}

/// One SGD step (learning rate 1) at `stage` on `world_size` ranks with `max_grad_norm`: the
/// pre-clip global norm every rank reported, and the update `p_before - p_after` of rank 0.
fn norm_and_update(stage: Stage, world_size: usize, coefficient: &[f32], max_norm: f32) -> (Vec<f64>, Vec<f32>) {
    let numel = coefficient.len();
    let results = burn_shard_comm::run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let p = Tensor::<1>::zeros([numel], &device).require_grad();
        let model = Linear1 {
            p: Param::from_tensor(p),
        };
        let config = ShardConfig::new(stage).with_max_grad_norm(max_norm);
        let (model, mut optim) = config.init(model, SgdConfig::new().build(), comm).expect("init");
        let c = Tensor::<1>::from_data(TensorData::new(coefficient.to_vec(), [numel]), &device);
        let loss = model.p.val().mul(c).sum();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let model = optim.step(1.0, model, grads).expect("step");
        let update = params_of(&model.materialize()).iter().map(|v| -v).collect::<Vec<f32>>();
        (optim.report().last_grad_norm().expect("measured"), update)
    })
    .unwrap();
    let norms = results.iter().map(|(n, _)| *n).collect();
    (norms, results.into_iter().next().unwrap().1)
}

/// The global norm is exact to `f32` rounding however long a parameter is, and the same at every
/// stage and world size: a sequential `f32` sum of squares stops growing past `2^24` terms (the
/// reported case: `2^25` gradients of 1 measured `4096` instead of `5792.6`, 1.41x too small, at
/// stage 0 and on one rank). Swept over stages 0-3 and world sizes 1-4, against the `f64` norm.
#[test]
fn the_global_norm_of_a_long_parameter_is_exact_at_every_stage_and_world_size() {
    let numel = (1 << 25) + 3;
    let mut rng = Rng::new(5);
    // Values in [0.5, 1.5): every square adds to the sum, none dominates it.
    let coefficient: Vec<f32> = (0..numel).map(|_| 1.0 + 0.5 * rng.next_f32()).collect();
    let exact = coefficient
        .iter()
        .map(|&c| f64::from(c) * f64::from(c))
        .sum::<f64>()
        .sqrt();
    for stage in burn_shard::estimate::STAGES {
        for world_size in 1..=4 {
            let (norms, _) = norm_and_update(stage, world_size, &coefficient, f32::INFINITY);
            for (rank, norm) in norms.iter().enumerate() {
                let relative = (norm - exact).abs() / exact;
                assert!(
                    relative < 1e-6,
                    "stage {stage}, N={world_size}, rank {rank}: norm {norm} vs exact {exact} (relative {relative:e})"
                );
            }
        }
    }
}

/// A finite gradient whose squares overflow `f32` (elements of `1e30`) has a finite norm and is
/// clipped: the update's norm is `max_norm` (SGD, learning rate 1), not the gradient itself
/// (the reported case: an infinite norm, and the gradient applied unclipped).
#[test]
fn a_finite_gradient_whose_squares_overflow_f32_is_clipped_at_every_stage_and_world_size() {
    let numel = 1000;
    let coefficient: Vec<f32> = (0..numel).map(|i| if i % 2 == 0 { 1e30 } else { -3e29 }).collect();
    let exact = coefficient
        .iter()
        .map(|&c| f64::from(c) * f64::from(c))
        .sum::<f64>()
        .sqrt();
    let max_norm = 2.0;
    for stage in burn_shard::estimate::STAGES {
        for world_size in 1..=4 {
            let (norms, update) = norm_and_update(stage, world_size, &coefficient, max_norm);
            let name = format!("stage {stage}, N={world_size}");
            for norm in norms {
                assert!((norm - exact).abs() / exact < 1e-6, "{name}: norm {norm} vs {exact}");
            }
            let update_norm = update.iter().map(|&u| f64::from(u) * f64::from(u)).sum::<f64>().sqrt();
            assert!(
                (update_norm - f64::from(max_norm)).abs() < 1e-4,
                "{name}: the update's norm is {update_norm}"
            );
            // The direction is the gradient's: element 0 is positive, element 1 negative, ratio 1e30/-3e29.
            assert!(
                (update[0] / update[1] + 1e30 / 3e29).abs() < 1e-3,
                "{name}: update {:?}",
                &update[..2]
            );
        }
    }
}
