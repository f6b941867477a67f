//! Reading and editing a sharded model's parameters with a user's own Burn visitor or mapper
//! (`ShardedOptimizer::visit_params`, `map_params`), and `bf16` masters after an edit: at every
//! stage 0-3 and world size 1-4, against single-device Burn. The reported cases: a visitor that
//! sums squared weights read 0 at stage 3 (3.37 elsewhere; `model.visit` now reads NaN there,
//! which no one takes for weights, and `visit_params` the weights); a mapper clamping weights to
//! ±0.01 had no effect at stage 3; pruning half of one `bf16` layer and calling
//! `reset_master_weights` reset every other parameter's `f32` master too; at stage 3 a mapper that
//! froze a layer was ignored, one that grew an embedding panicked and one that transposed a
//! weight returned `Ok` with the old shape.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::AdamWConfig;
use burn::prelude::*;
use burn::tensor::DType;
use burn_shard::ShardConfig;
use burn_shard::estimate::STAGES;
use burn_shard_comm::{Collective, InProcessGroup, run_ranks};

use crate::common::*;
use crate::equivalence::{GLOBAL_BATCH, LR, STEPS};

/// Sums the squares of every float parameter it visits, in `f64`.
#[derive(Default)]
struct SumSquares(f64);

impl ModuleVisitor for SumSquares {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let values = param.val().into_data().convert::<f32>();
        self.0 += values.iter::<f32>().map(|v| f64::from(v) * f64::from(v)).sum::<f64>();
    }
}

/// WGAN-style weight clipping: every float parameter clamped to ±`LIMIT`.
struct Clamp;
const LIMIT: f32 = 0.01;

impl ModuleMapper for Clamp {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        remap(param, |value| value.clamp(-LIMIT, LIMIT))
    }
}

#[test]
fn a_visitor_given_to_visit_params_sees_the_real_values_at_every_stage_and_world_size() {
    let device = Device::flex().autodiff();
    device.seed(21);
    let base = TinyMlp::new(&device);
    let mut expected = SumSquares::default();
    base.visit(&mut expected);
    assert!(expected.0 > 0.1, "the model has weights to sum ({})", expected.0);
    for stage in STAGES {
        for world_size in 1..=4 {
            let sums = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
                let (model, optim) = ShardConfig::new(stage)
                    .init(base.clone().fork(&device), AdamWConfig::new(), comm)
                    .expect("init");
                let mut sum = SumSquares::default();
                optim.visit_params(&model, &mut sum).expect("visit");
                // Burn's own traversal: the weights at stages 0-2; at stage 3 the placeholders,
                // NaN so that they cannot pass for weights.
                let mut raw = SumSquares::default();
                model.visit(&mut raw);
                let raw_ok = match stage {
                    burn_shard::Stage::Three => raw.0.is_nan(),
                    _ => (raw.0 - expected.0).abs() <= 1e-6 * expected.0,
                };
                assert!(
                    raw_ok,
                    "stage {stage}: model.visit summed {} (model {})",
                    raw.0, expected.0
                );
                sum.0
            })
            .expect("no rank panics");
            for (rank, sum) in sums.into_iter().enumerate() {
                let relative = (sum - expected.0).abs() / expected.0;
                assert!(
                    relative < 1e-6,
                    "stage {stage}, N={world_size}, rank {rank}: the visitor summed {sum}, the model holds {}",
                    expected.0
                );
            }
        }
    }
}

/// Clamping after step 1 with `map_params` trains as single-device Burn clamping the same
/// parameters with the same mapper (`model.map`), loss for loss.
#[test]
fn a_mapper_given_to_map_params_changes_the_real_values_at_every_stage_and_world_size() {
    let device = Device::flex().autodiff();
    device.seed(22);
    let base = TinyMlp::new(&device);
    const CLAMP_AFTER: usize = 1;
    let mut optim = AdamWConfig::new().init();
    let reference = reference_loop(&base, STEPS, GLOBAL_BATCH, |step, model, grads| {
        let model = optim.step(LR, model, grads);
        if step == CLAMP_AFTER {
            model.map(&mut Clamp)
        } else {
            model
        }
    });
    sweep("clamp with map_params", &reference, 1e-4, |comm, stage| {
        train_editing(comm, stage, &base, |step, optim, model| {
            if step != CLAMP_AFTER {
                return model;
            }
            let model = optim.map_params(model, &mut Clamp).expect("map");
            let params = params_of(&model.clone().materialize());
            assert!(params.iter().all(|v| v.abs() <= LIMIT), "stage {stage}: clamped values");
            model
        })
    });
}

/// One rank's `STEPS` sharded AdamW steps from `base` at `stage`, `edit(step, optim, model)`
/// after each: the global losses and the final parameters, as [`sweep`] takes them.
fn train_editing(
    comm: burn_shard_comm::InProcessComm,
    stage: burn_shard::Stage,
    base: &TinyMlp,
    mut edit: impl FnMut(
        usize,
        &mut burn_shard::ShardedOptimizer<<AdamWConfig as burn_shard::IntoOptimizer>::Optimizer>,
        TinyMlp,
    ) -> TinyMlp,
) -> (Vec<f32>, Vec<f32>) {
    let device = Device::flex().autodiff();
    let (lo, hi) = rank_rows(comm.rank(), comm.world_size(), GLOBAL_BATCH);
    let (mut model, mut optim) = ShardConfig::new(stage)
        .init(base.clone().fork(&device), AdamWConfig::new(), comm)
        .expect("init");
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batch(step, GLOBAL_BATCH);
        let loss = mse(&model, rows(&x, IN, lo, hi, &device), rows(&y, OUT, lo, hi, &device));
        let (next, global) = sharded_step(&mut optim, model, loss, LR);
        losses.push(global);
        model = edit(step, &mut optim, next);
    }
    (losses, params_of(&model.materialize()))
}

/// `value` (`l1.weight`) with its first [`PRUNED`] elements (row-major) zeroed, whatever rank's
/// shard holds them.
fn prune(value: Tensor<2>) -> Tensor<2> {
    let shape = value.shape();
    let numel = shape.num_elements();
    let keep: Vec<f32> = (0..numel).map(|i| if i < PRUNED { 0.0 } else { 1.0 }).collect();
    let mask = Tensor::<1>::from_data(TensorData::new(keep, [numel]), &value.device())
        .reshape(shape)
        .cast(value.dtype());
    value * mask
}

/// `l1.weight` is `[5, 7]`: the first 17 elements are pruned.
const PRUNED: usize = 17;

/// Three `bf16` steps, then (in `edit` runs) `l1.weight` half pruned with `map_params`, then one
/// step at learning rate 0 (the masters do not move): this rank's masters, per layout slot
/// (empty for a slot this rank does not step).
fn bf16_masters(
    comm: impl Collective + 'static,
    stage: burn_shard::Stage,
    base: &TinyMlp,
    edit: bool,
) -> Vec<Vec<f32>> {
    let device = Device::flex().autodiff();
    let (lo, hi) = rank_rows(comm.rank(), comm.world_size(), GLOBAL_BATCH);
    let model = cast(base.clone().fork(&device), DType::BF16);
    let (mut model, mut optim) = ShardConfig::new(stage)
        .init(model, AdamWConfig::new(), comm)
        .expect("init");
    for step in 0..4 {
        if step == 3 && edit {
            model = optim.map_params(model, &mut EditIn::value("l1", prune)).expect("map");
        }
        let (x, y) = batch(step, GLOBAL_BATCH);
        let x = rows(&x, IN, lo, hi, &device).cast(DType::BF16);
        let y = rows(&y, OUT, lo, hi, &device).cast(DType::BF16);
        let loss = mse(&model, x, y).cast(DType::F32);
        let lr = if step == 3 { 0.0 } else { 1e-2 };
        model = sharded_step(&mut optim, model, loss, lr).0;
    }
    optim
        .report()
        .master_weights()
        .iter()
        // A slot outside this rank's range (stages 1-2) has no master here: empty.
        .map(|m| match m {
            Some(m) => m.clone().into_data().convert::<f32>().iter::<f32>().collect(),
            None => Vec::new(),
        })
        .collect()
}

/// Editing some `bf16` weights re-takes the masters of the edited elements only: every other
/// element keeps its `f32` master bitwise (the sub-ulp progress of three steps), and the pruned
/// elements' masters are 0.
#[test]
fn editing_some_bf16_weights_keeps_the_other_elements_masters_at_every_stage_and_world_size() {
    let device = Device::flex().autodiff();
    device.seed(23);
    let base = TinyMlp::new(&device);
    for stage in STAGES {
        for world_size in 1..=4 {
            let ctx = format!("stage {stage}, N={world_size}");
            let run = |edit| {
                run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
                    bf16_masters(comm, stage, &base, edit)
                })
                .expect("no rank panics")
            };
            let (kept, edited) = (run(false), run(true));
            let mut pruned = 0;
            let mut sub_ulp = false;
            for (rank, (a, b)) in kept.iter().zip(&edited).enumerate() {
                // Slot 0 is l1.weight; every other slot must be untouched.
                for (slot, (a, b)) in a.iter().zip(b).enumerate().skip(1) {
                    assert_eq!(
                        a, b,
                        "{ctx}, rank {rank}, slot {slot}: an unedited parameter's master changed"
                    );
                }
                for (&a, &b) in a[0].iter().zip(&b[0]) {
                    assert!(
                        b == a || b == 0.0,
                        "{ctx}, rank {rank}: l1.weight master {b} is neither kept ({a}) nor 0"
                    );
                    pruned += usize::from(b == 0.0 && a != 0.0);
                }
                sub_ulp |= a.iter().flatten().any(|&m| half::bf16::from_f32(m).to_f32() != m);
            }
            assert!(
                sub_ulp,
                "{ctx}: the masters must hold sub-ulp progress, or the test proves nothing"
            );
            let expected = if stage == burn_shard::Stage::Zero {
                PRUNED * world_size
            } else {
                PRUNED
            };
            assert_eq!(pruned, expected, "{ctx}: pruned elements whose master became 0");
        }
    }
}

/// What [`EditIn`] does to each float parameter of its module.
#[derive(Clone, Copy)]
enum Edit {
    /// `param.set_require_grad(_)`, as Burn's `Module::set_require_grad` does.
    RequireGrad(bool),
    /// The 2-D parameters' values replaced by `f(value)` (a fresh leaf, `require_grad` kept).
    Value(fn(Tensor<2>) -> Tensor<2>),
}

/// Applies `edit` to the float parameters inside the module field named `module`.
struct EditIn {
    module: &'static str,
    edit: Edit,
    inside: bool,
}

impl EditIn {
    fn require_grad(module: &'static str, require_grad: bool) -> Self {
        Self::new(module, Edit::RequireGrad(require_grad))
    }

    fn value(module: &'static str, f: fn(Tensor<2>) -> Tensor<2>) -> Self {
        Self::new(module, Edit::Value(f))
    }

    fn new(module: &'static str, edit: Edit) -> Self {
        Self {
            module,
            edit,
            inside: false,
        }
    }
}

impl ModuleMapper for EditIn {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.inside |= name == self.module;
    }

    fn exit_module(&mut self, name: &str, _container_type: &str) {
        if name == self.module {
            self.inside = false;
        }
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        match (self.inside, self.edit) {
            (false, _) => param,
            (true, Edit::RequireGrad(require_grad)) => param.set_require_grad(require_grad),
            (true, Edit::Value(_)) if D != 2 => param,
            (true, Edit::Value(f)) => remap(param, |value| {
                // D is 2 here: reshapes keep the dtype and the device.
                let [rows, cols] = [value.dims()[0], value.dims()[1]];
                let edited = f(value.reshape([rows, cols]));
                let mut dims = [0usize; D];
                dims.copy_from_slice(&edited.dims());
                edited.reshape(dims)
            }),
        }
    }
}

/// The reported case: a mapper given to `map_params` that froze a layer was ignored at stage 3
/// (the layer moved 2.9e-2, the other drifted 8.5e-4 from single-device Burn). Freezing `l1`
/// after step 2 and unfreezing it after step 9 with `map_params` trains as single-device Burn
/// doing the same with `model.map`, loss for loss, at every stage and world size.
#[test]
fn freezing_and_unfreezing_a_layer_with_map_params_trains_as_burn_at_every_stage_and_world_size() {
    const FREEZE_AFTER: usize = 2;
    const UNFREEZE_AFTER: usize = 9;
    let device = Device::flex().autodiff();
    device.seed(24);
    let base = TinyMlp::new(&device);
    let edit = |step: usize| match step {
        FREEZE_AFTER => Some(EditIn::require_grad("l1", false)),
        UNFREEZE_AFTER => Some(EditIn::require_grad("l1", true)),
        _ => None,
    };
    let mut optim = AdamWConfig::new().init();
    let mut frozen_l1 = None;
    let reference = reference_loop(&base, STEPS, GLOBAL_BATCH, |step, model, grads| {
        let model = optim.step(LR, model, grads);
        if step == UNFREEZE_AFTER {
            frozen_l1 = Some(params_of(&model.l1));
        }
        match edit(step) {
            Some(mut mapper) => model.map(&mut mapper),
            None => model,
        }
    });
    // The reference froze for real: l1 did not move between the freeze and the unfreeze.
    let mut ref_optim = AdamWConfig::new().init();
    let at_freeze = reference_loop(&base, FREEZE_AFTER + 1, GLOBAL_BATCH, |_, model, grads| {
        ref_optim.step(LR, model, grads)
    });
    assert_ne!(at_freeze.1, params_of(&base), "the first steps moved the model");
    let l1_numel = params_of(&base.l1).len();
    assert_eq!(
        frozen_l1.as_deref(),
        Some(&at_freeze.1[..l1_numel]),
        "single-device Burn kept the frozen l1"
    );
    sweep("freeze with map_params", &reference, 1e-4, |comm, stage| {
        train_editing(comm, stage, &base, |step, optim, model| match edit(step) {
            Some(mut mapper) => optim.map_params(model, &mut mapper).expect("map"),
            None => model,
        })
    });
}

/// The reported model: a `[6, 8]` embedding and a linear head with a `[8, 4]` weight.
#[derive(Module, Debug)]
struct Vocab {
    embed: burn::nn::Embedding,
    head: burn::nn::Linear,
}

/// The reported cases: growing a `[6, 8]` embedding to `[8, 8]` panicked inside burn-shard at
/// stage 3, and transposing a `[8, 4]` weight returned `Ok` with the old shape and the values
/// laid out wrongly. A mapper that changes a parameter's shape or dtype, or unfreezes a
/// parameter frozen at `init`, is refused on every rank at every stage and world size, naming
/// the parameter, both values and what to do; the model keeps its values.
#[test]
fn a_mapper_that_changes_a_shape_or_dtype_or_unfreezes_is_refused_at_every_stage_and_world_size() {
    let device = Device::flex().autodiff();
    device.seed(25);
    let base = Vocab {
        embed: burn::nn::EmbeddingConfig::new(6, 8).init(&device),
        head: burn::nn::LinearConfig::new(8, 4).init(&device),
    };
    let grow: fn(Tensor<2>) -> Tensor<2> = |v| Tensor::cat(vec![v.clone(), v.narrow(0, 0, 2).zeros_like()], 0);
    let transpose: fn(Tensor<2>) -> Tensor<2> = |v| v.swap_dims(0, 1);
    let to_bf16: fn(Tensor<2>) -> Tensor<2> = |v| v.cast(DType::BF16);
    let cases = [
        ("embed", grow, "embed.weight", "shape from [6, 8] to [8, 8]"),
        ("head", transpose, "head.weight", "shape from [8, 4] to [4, 8]"),
        ("head", to_bf16, "head.weight", "dtype from F32 to BF16"),
    ];
    let expected = params_of(&base);
    for stage in STAGES {
        for world_size in 1..=4 {
            for (module, edit, path, what) in cases {
                let ctx = format!("stage {stage}, N={world_size}, {what}");
                let results = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
                    let (model, mut optim) = ShardConfig::new(stage)
                        .init(base.clone().fork(&device), AdamWConfig::new(), comm)
                        .expect("init");
                    let err = optim.map_params(model.clone(), &mut EditIn::value(module, edit)).err();
                    (err, params_of(&model.materialize()))
                })
                .expect("no rank panics");
                for (rank, (err, params)) in results.into_iter().enumerate() {
                    let err = err.unwrap_or_else(|| panic!("{ctx}, rank {rank}: returned Ok"));
                    let msg = err.to_string();
                    assert!(
                        matches!(err, burn_shard::ShardError::MappedParamChanged { .. })
                            && msg.contains(path)
                            && msg.contains(what)
                            && msg.contains("ShardConfig::init"),
                        "{ctx}, rank {rank}: {msg}"
                    );
                    assert_eq!(params, expected, "{ctx}, rank {rank}: the model changed");
                }
            }
            // Unfreezing what was frozen at init.
            let frozen = Vocab {
                embed: base.embed.clone(),
                head: base.head.clone().no_grad(),
            };
            let errors = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
                let (model, mut optim) = ShardConfig::new(stage)
                    .init(frozen.clone().fork(&device), AdamWConfig::new(), comm)
                    .expect("init");
                optim.map_params(model, &mut EditIn::require_grad("head", true)).err()
            })
            .expect("no rank panics");
            for (rank, err) in errors.into_iter().enumerate() {
                let msg = err.map(|e| e.to_string()).unwrap_or_default();
                assert!(
                    msg.contains("head.weight") && msg.contains("require_grad from false to true"),
                    "stage {stage}, N={world_size}, rank {rank}: unfreezing a parameter frozen at init: {msg:?}"
                );
            }
        }
    }
}
