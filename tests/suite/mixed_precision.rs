//! bf16 parameters with `f32` master weights: sharded training against Burn's own AdamW run on an
//! `f32` master model with a bf16 forward/backward, the reference recipe of mixed-precision
//! training (Micikevicius et al., 2018).

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::prelude::*;
use burn::tensor::DType;
use burn_shard::{FlatLayout, ShardConfig, Stage};
use burn_shard_comm::{Collective, InProcessGroup, run_ranks};

use crate::common::*;

const STEPS: usize = 20;
const GLOBAL_BATCH: usize = 12;
/// Adam moves each weight by at most about `LR` per step: below half a bf16 ulp for
/// |w| >= 2^-3 (half ulp 2^-11 ≈ 4.9e-4), so without a master copy those weights would never
/// change.
const LR: f64 = 2e-4;

/// The distance between `x` and the next bf16 (8 significant bits).
pub(crate) fn ulp(x: f32) -> f32 {
    2f32.powi(x.abs().max(2f32.powi(-100)).log2().floor() as i32 - 7)
}

/// `grads` (of `module`'s parameters) cast to `f32`.
pub(crate) fn grads_to_f32<M: Module>(module: &M, mut grads: GradientsParams) -> GradientsParams {
    struct Collect<'a>(&'a mut GradientsParams, GradientsParams);
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.0.remove::<D>(param.id) {
                self.1.register::<D>(param.id, g.cast(DType::F32));
            }
        }
    }
    let mut c = Collect(&mut grads, GradientsParams::new());
    module.visit(&mut c);
    c.1
}

/// The weights whose every update (at most about `lr` a step) rounds away in plain bf16 but
/// that the reference moves from `start` to `moved` by two or more ulps: a run without master
/// weights would leave them unchanged.
pub(crate) fn bf16_stuck(start: &[f32], moved: &[f32], lr: f64) -> Vec<usize> {
    (0..start.len())
        .filter(|&i| ulp(start[i]) / 2.0 > 1.5 * lr as f32 && (moved[i] - start[i]).abs() >= 2.0 * ulp(start[i]))
        .collect()
}

fn adamw() -> AdamWConfig {
    AdamWConfig::new().with_weight_decay(0.1)
}

fn bf16_rows(data: &[f32], width: usize, start: usize, end: usize, device: &Device) -> Tensor<2> {
    rows(data, width, start, end, device).cast(DType::BF16)
}

/// Single device: an `f32` master model stepped by Burn's AdamW with the `f32`-cast gradients of
/// its bf16 copy. Returns the losses and the final bf16 parameters (as f32).
fn reference(base: &TinyMlp) -> (Vec<f32>, Vec<f32>) {
    let device = Device::flex().autodiff();
    let mut master = base.clone().fork(&device);
    let mut optim = adamw().init();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let model = cast(master.clone(), DType::BF16);
        let (x, y) = batch(step, GLOBAL_BATCH);
        let loss = mse(
            &model,
            bf16_rows(&x, IN, 0, GLOBAL_BATCH, &device),
            bf16_rows(&y, OUT, 0, GLOBAL_BATCH, &device),
        );
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = grads_to_f32(&model, GradientsParams::from_grads(loss.backward(), &model));
        master = optim.step(LR, master, grads);
    }
    (losses, params_of(&cast(master, DType::BF16)))
}

#[test]
fn bf16_training_with_master_weights_matches_the_f32_master_reference() {
    let device = Device::flex().autodiff();
    device.seed(11);
    let base = TinyMlp::new(&device);
    let (ref_losses, ref_params) = reference(&base);
    let start = params_of(&cast(base.clone(), DType::BF16));
    let stuck = bf16_stuck(&start, &ref_params, LR);
    assert!(
        stuck.len() >= 10,
        "the reference must move bf16-stuck weights ({})",
        stuck.len()
    );

    let base16 = cast(base, DType::BF16);
    for world_size in [1, 2, 4] {
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            let ctx = format!("N={world_size} stage {}", stage.number());
            let runs = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
                let rank = comm.rank();
                let device = Device::flex().autodiff();
                let (mut model, mut optim) = ShardConfig::new(stage)
                    .init(base16.clone().fork(&device), adamw(), comm)
                    .expect("init");
                let per_rank = GLOBAL_BATCH / world_size;
                let mut losses = Vec::new();
                for step in 0..STEPS {
                    let (x, y) = batch(step, GLOBAL_BATCH);
                    let (lo, hi) = (rank * per_rank, (rank + 1) * per_rank);
                    let loss = mse(
                        &model,
                        bf16_rows(&x, IN, lo, hi, &device),
                        bf16_rows(&y, OUT, lo, hi, &device),
                    );
                    let (next, global) = sharded_step(&mut optim, model, loss, LR);
                    model = next;
                    losses.push(global);
                }
                let masters: Vec<DType> = optim
                    .report()
                    .master_weights()
                    .iter()
                    .flatten()
                    .map(|t| t.dtype())
                    .collect();
                let report = optim.report().memory(&model);
                // Stage 0 steps whole buckets; stages 1-3 this rank's shard (stage 3's layout
                // is built over the local shards at world size 1).
                // Padding is never stepped, so it holds no state.
                let owned = optim.report().stepped_numel();
                (losses, params_of(&model.materialize()), masters, report, owned)
            })
            .expect("no rank panics");
            for (rank, (losses, params, masters, report, owned)) in runs.iter().enumerate() {
                assert!(
                    !masters.is_empty() && masters.iter().all(|d| *d == DType::F32),
                    "{ctx}: f32 masters"
                );
                // ZeRO's K = 12 bytes per owned element: f32 master + Adam's two f32 moments.
                assert_eq!(
                    report.optimizer_state_bytes,
                    12 * owned,
                    "{ctx} rank {rank}: optimizer state"
                );
                for (step, (ours, theirs)) in losses.iter().zip(&ref_losses).enumerate() {
                    // bf16 forward passes on different batch splits differ by bf16 rounding.
                    assert!(
                        (ours - theirs).abs() <= 2e-2 * theirs.abs().max(1e-3),
                        "{ctx} step {step}: loss {ours} vs reference {theirs}"
                    );
                }
                // Equal to the reference's final weights, or its bf16 neighbour (the f32 masters
                // differ by rounding: other batch splits, fused vs Burn's update).
                for i in 0..params.len() {
                    let diff = (params[i] - ref_params[i]).abs();
                    assert!(
                        diff <= ulp(ref_params[i]),
                        "{ctx} rank {rank} param {i}: {} vs {}",
                        params[i],
                        ref_params[i]
                    );
                }
                let unmoved = stuck.iter().filter(|&&i| params[i] == start[i]).count();
                assert_eq!(unmoved, 0, "{ctx} rank {rank}: updates below bf16 resolution were lost");
            }
        }
    }
}

#[test]
fn buckets_group_dtypes_without_fragmenting() {
    let device = Device::flex().autodiff();
    let mut model = cast(TinyMlp::new(&device), DType::BF16);
    // An f32 layer between bf16 ones: one bf16 bucket (l1, scale) and one f32 bucket (l2), not
    // three, and no bucket holds two dtypes.
    model.l2 = cast(model.l2, DType::F32);
    let layout = FlatLayout::from_module(&model, 2, 1 << 20).unwrap();
    let dtypes: Vec<DType> = layout.buckets().iter().map(|b| b.dtype).collect();
    assert_eq!(dtypes, [DType::BF16, DType::F32]);
    let paths: Vec<&str> = layout.slots().iter().map(|s| s.path.as_str()).collect();
    assert_eq!(paths, ["l1.weight", "l1.bias", "scale", "l2.weight", "l2.bias"]);
    for bucket in layout.buckets() {
        for slot in &layout.slots()[bucket.slots.clone()] {
            assert_eq!(slot.dtype, bucket.dtype, "{}", slot.path);
        }
    }
}

/// TinyMlp plus a bf16 parameter that only some steps use.
#[derive(Module, Debug)]
struct WithOptional {
    mlp: TinyMlp,
    optional: Param<Tensor<1>>,
}

#[test]
fn a_parameter_without_gradient_keeps_its_value_and_its_master() {
    // AdamW's decay (lr 0.1 · wd 0.1 = 1% a step) would move a stepped master visibly.
    let device = Device::flex().autodiff();
    device.seed(3);
    let optional = Tensor::from_floats([0.75, -1.25, 1.5], &device).require_grad();
    let base = cast(
        WithOptional {
            mlp: TinyMlp::new(&device),
            optional: Param::from_tensor(optional),
        },
        DType::BF16,
    );
    let start: Vec<f32> = base.optional.val().into_data().convert::<f32>().iter::<f32>().collect();
    for (world_size, stage) in [(1, Stage::Zero), (2, Stage::One), (2, Stage::Two), (2, Stage::Three)] {
        let ctx = format!("N={world_size} stage {}", stage.number());
        run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
            let device = Device::flex().autodiff();
            let (mut model, mut optim) = ShardConfig::new(stage)
                .init(base.clone().fork(&device), adamw(), comm)
                .expect("init");
            for step in 0..4 {
                let (x, y) = batch(step, 4);
                let mut loss = mse(
                    &model.mlp,
                    bf16_rows(&x, IN, 0, 4, &device),
                    bf16_rows(&y, OUT, 0, 4, &device),
                );
                if step == 3 {
                    // Only now does the parameter get a gradient.
                    loss = loss + model.optional.val().sum() * 0.0;
                }
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optim.step(0.1, model, grads).expect("step");
                let now = params_of(&model.optional.clone().materialize());
                if step < 3 {
                    assert_eq!(
                        now, start,
                        "{ctx} step {step}: a parameter without gradient must not move"
                    );
                } else {
                    // Its first real update starts from its own value: a zero gradient leaves
                    // Adam's moments at 0, so only the 1% decay acts (bf16 rounding aside).
                    for (a, b) in now.iter().zip(&start) {
                        assert!((a - b * 0.99).abs() <= 2.0 * ulp(*b), "{ctx}: {a} vs {}", b * 0.99);
                    }
                }
            }
        })
        .expect("no rank panics");
    }
}

#[test]
fn reset_master_weights_takes_newly_loaded_values() {
    let device = Device::flex().autodiff();
    device.seed(5);
    let base16 = cast(TinyMlp::new(&device), DType::BF16);
    let comm = InProcessGroup::new(1).unwrap().into_comms().pop().unwrap();
    let (mut model, mut optim) = ShardConfig::new(Stage::Two)
        .init(base16.clone().fork(&device), adamw(), comm)
        .unwrap();
    let step = |optim: &mut burn_shard::ShardedOptimizer<_>, model: TinyMlp, lr: f64| {
        let (x, y) = batch(0, 4);
        let loss = mse(
            &model,
            bf16_rows(&x, IN, 0, 4, &device),
            bf16_rows(&y, OUT, 0, 4, &device),
        );
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        optim.step(lr, model, grads).unwrap()
    };
    model = step(&mut optim, model, 1e-1);
    let trained = params_of(&model);
    assert_ne!(trained, params_of(&base16));
    // "Load a checkpoint": the initial values. A step at lr 0 without a reset brings back the
    // masters' values; after a reset it keeps the loaded ones.
    let stale = step(&mut optim, base16.clone().fork(&device), 0.0);
    assert_eq!(params_of(&stale), trained, "the old masters overwrite loaded values");
    optim.reset_master_weights();
    let loaded = step(&mut optim, base16.clone().fork(&device), 0.0);
    assert_eq!(
        params_of(&loaded),
        params_of(&base16),
        "after a reset the loaded values stay"
    );
}
