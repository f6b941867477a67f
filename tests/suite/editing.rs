//! Reading and editing a sharded model's parameters with a user's own Burn visitor or mapper
//! (`ShardedOptimizer::visit_params`, `map_params`), and `bf16` masters after an edit: at every
//! stage 0-3 and world size 1-4, against single-device Burn. The reported cases: a visitor that
//! sums squared weights read 0 at stage 3 (3.37 elsewhere); a mapper clamping weights to
//! ±0.01 had no effect at stage 3; pruning half of one `bf16` layer and calling
//! `reset_master_weights` reset every other parameter's `f32` master too.

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
            model = next;
            losses.push(global);
            if step == CLAMP_AFTER {
                model = optim.map_params(model, &mut Clamp).expect("map");
                let params = params_of(&model.clone().materialize());
                assert!(params.iter().all(|v| v.abs() <= LIMIT), "stage {stage}: clamped values");
            }
        }
        (losses, params_of(&model.materialize()))
    });
}

/// Zeroes the first half (row-major) of `l1.weight`, whatever rank's shard holds it.
struct PruneL1 {
    inside_l1: bool,
}

impl ModuleMapper for PruneL1 {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        if name == "l1" {
            self.inside_l1 = true;
        }
    }

    fn exit_module(&mut self, name: &str, _container_type: &str) {
        if name == "l1" {
            self.inside_l1 = false;
        }
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if !self.inside_l1 || D != 2 {
            return param;
        }
        remap(param, |value| {
            let shape = value.shape();
            let numel = shape.num_elements();
            let keep: Vec<f32> = (0..numel).map(|i| if i < PRUNED { 0.0 } else { 1.0 }).collect();
            let mask = Tensor::<1>::from_data(TensorData::new(keep, [numel]), &value.device())
                .reshape(shape)
                .cast(value.dtype());
            value * mask
        })
    }
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
            model = optim.map_params(model, &mut PruneL1 { inside_l1: false }).expect("map");
        }
        let (x, y) = batch(step, GLOBAL_BATCH);
        let x = rows(&x, IN, lo, hi, &device).cast(DType::BF16);
        let y = rows(&y, OUT, lo, hi, &device).cast(DType::BF16);
        let loss = mse(&model, x, y).cast(DType::F32);
        let lr = if step == 3 { 0.0 } else { 1e-2 };
        model = sharded_step(&mut optim, model, loss, lr).0;
    }
    optim
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
