//! Gradient clipping under sharding equals single-device clipping at every stage and world size
//! 1-4: Burn's per-parameter clipping from the optimizer config (`Norm`, `Value`), and clipping
//! by global norm (PyTorch's `clip_grad_norm_`), whose pre-clip norm every rank reports. Each
//! would fail if a norm were taken over a rank's shard only.

use burn::grad_clipping::GradientClippingConfig;
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::{AdamWConfig, GradientsParams, SgdConfig};
use burn::prelude::*;
use burn_shard::{IntoOptimizer, ShardConfig, Stage};
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
        norms.extend(optim.last_grad_norm().map(|n| n as f32));
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

/// The ids of a module's float parameters, with their ranks.
fn param_ids<M: Module>(module: &M) -> Vec<(ParamId, usize)> {
    struct Ids(Vec<(ParamId, usize)>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0.push((p.id, D));
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
}

/// `f(grad)` for the gradient of `id` (rank `d`), written back.
fn map_grad(grads: &mut GradientsParams, id: ParamId, d: usize, mut f: impl FnMut(Tensor<2>) -> Tensor<2>) {
    match d {
        1 => {
            let g = grads.remove::<1>(id).expect("a gradient");
            let n = g.dims()[0];
            grads.register(id, f(g.reshape([1, n])).reshape([n]));
        }
        2 => {
            let g = grads.remove::<2>(id).expect("a gradient");
            grads.register(id, f(g));
        }
        _ => unreachable!("TinyMlp has rank-1 and rank-2 parameters"),
    }
}

/// PyTorch's `clip_grad_norm_` in float64: scales every gradient by
/// `min(1, max_norm / (norm + 1e-6))`; returns the pre-clip norm.
fn clip_global(model: &TinyMlp, mut grads: GradientsParams, max_norm: f32) -> (GradientsParams, f64) {
    let ids = param_ids(model);
    let mut sum = 0.0f64;
    for &(id, d) in &ids {
        map_grad(&mut grads, id, d, |g| {
            sum += g
                .clone()
                .into_data()
                .convert::<f64>()
                .iter::<f64>()
                .map(|v| v * v)
                .sum::<f64>();
            g
        });
    }
    let norm = sum.sqrt();
    let coef = (f64::from(max_norm) / (norm + 1e-6)).min(1.0) as f32;
    for &(id, d) in &ids {
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

/// One SGD step with learning rate `1000` moves each parameter by `1000 · clipped gradient`, so
/// the clipped gradient can be read off the parameters and compared element by element.
#[test]
fn clipped_gradients_equal_single_device_within_1e_6_relative() {
    const SGD_LR: f64 = 1000.0;
    let device = Device::flex().autodiff();
    let (x, y) = batch(0, GLOBAL_BATCH);
    let model = base_model().fork(&device);
    let loss = mse(
        &model,
        rows(&x, IN, 0, GLOBAL_BATCH, &device),
        rows(&y, OUT, 0, GLOBAL_BATCH, &device),
    );
    let (grads, norm) = clip_global(&model, GradientsParams::from_grads(loss.backward(), &model), MAX_NORM);
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
    let scale = expected.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let before: Vec<f64> = params_of(&model).iter().map(|&v| f64::from(v)).collect();
    for world_size in 1..=4 {
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            let group = InProcessGroup::new(world_size).unwrap();
            let results = burn_shard_comm::run_ranks(group, |comm| {
                let device = Device::flex().autodiff();
                let (lo, hi) = rank_rows(comm.rank(), comm.world_size(), GLOBAL_BATCH);
                let config = ShardConfig::new(stage).with_max_grad_norm(MAX_NORM);
                let (model, mut optim) = config
                    .init(base_model().fork(&device), SgdConfig::new().build(), comm)
                    .expect("init");
                let loss = mse(&model, rows(&x, IN, lo, hi, &device), rows(&y, OUT, lo, hi, &device));
                let (model, _) = sharded_step(&mut optim, model, loss, SGD_LR);
                (
                    params_of(&model.materialize()),
                    optim.last_grad_norm().expect("measured"),
                )
            })
            .expect("no rank panics");
            let ctx = format!("world_size {world_size}, stage {stage}");
            for (params, reported) in &results {
                assert!(
                    ((reported - norm) / norm).abs() < 1e-6,
                    "{ctx}: reported norm {reported} vs {norm}"
                );
                let worst = params
                    .iter()
                    .zip(&before)
                    .zip(&expected)
                    .map(|((after, before), g)| ((before - f64::from(*after)) / SGD_LR - g).abs())
                    .fold(0.0, f64::max);
                assert!(
                    worst <= 1e-6 * scale,
                    "{ctx}: clipped gradient off by {worst:e} (max |g| {scale:e})"
                );
            }
        }
    }
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
