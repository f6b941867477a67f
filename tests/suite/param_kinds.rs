//! Parameters that are not simply "used every step": per-parameter optimizer state (a
//! parameter first used at a later step, one used on alternate steps), empty parameters, a
//! model with no trainable parameter, two sharded models on one rank, and Burn's LoRA.

use std::sync::Arc;

use burn::module::{Lora, Module, Param};
use burn::nn::{Linear, LinearConfig, RmsNorm, RmsNormConfig};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::prelude::*;
use burn_shard::{IntoOptimizer, ShardConfig, ShardError, Stage};
use burn_shard_comm::{Collective, InProcessGroup, run_ranks};

use crate::common::{Rng, max_abs_diff, params_of, sharded_step};

const STAGES: [Stage; 4] = [Stage::Zero, Stage::One, Stage::Two, Stage::Three];
const GLOBAL_BATCH: usize = 12;
const LR: f64 = 1e-2;

/// `always` is used at every step, `late` from step 2 on, `alternate` at even steps only.
#[derive(Module, Debug)]
struct Branches {
    always: Linear,
    late: Linear,
    alternate: Linear,
}

impl Branches {
    fn new(device: &Device) -> Self {
        Self {
            always: LinearConfig::new(2, 1).init(device),
            late: LinearConfig::new(2, 1).init(device),
            alternate: LinearConfig::new(2, 1).init(device),
        }
    }

    fn forward(&self, x: Tensor<2>, step: usize) -> Tensor<2> {
        let mut y = self.always.forward(x.clone());
        if step >= 2 {
            y = y + self.late.forward(x.clone());
        }
        if step.is_multiple_of(2) {
            y = y + self.alternate.forward(x);
        }
        y
    }
}

fn branch_loss(model: &Branches, step: usize, lo: usize, hi: usize, device: &Device) -> Tensor<1> {
    let x = Rng::new(40 + step as u64).vec(GLOBAL_BATCH * 2);
    let x = Tensor::<2>::from_data(TensorData::new(x[lo * 2..hi * 2].to_vec(), [hi - lo, 2]), device);
    let target = x.clone().sum_dim(1).mul_scalar(0.7).add_scalar(0.2);
    (model.forward(x, step) - target).powi_scalar(2).mean()
}

const BRANCH_STEPS: usize = 5;

fn branches_reference(base: &Branches, mut optim: ModuleOptimizer) -> Vec<f32> {
    let device = Device::flex().autodiff();
    let mut model = base.clone().fork(&device);
    for step in 0..BRANCH_STEPS {
        let l = branch_loss(&model, step, 0, GLOBAL_BATCH, &device);
        let grads = GradientsParams::from_grads(l.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    params_of(&model)
}

fn branches_sharded<O: IntoOptimizer + Clone + Send + Sync>(
    base: &Branches,
    optim: O,
    world_size: usize,
    stage: Stage,
) -> Vec<Vec<f32>> {
    run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
        let rank = comm.rank();
        let device = Device::flex().autodiff();
        let (mut model, mut optim) = ShardConfig::new(stage)
            .init(base.clone().fork(&device), optim.clone(), comm)
            .expect("init");
        let per_rank = GLOBAL_BATCH / world_size;
        for step in 0..BRANCH_STEPS {
            let l = branch_loss(&model, step, rank * per_rank, (rank + 1) * per_rank, &device);
            model = sharded_step(&mut optim, model, l, LR).0;
        }
        params_of(&model.materialize())
    })
    .expect("no rank panics")
}

fn check_branches<O: IntoOptimizer + Clone + Send + Sync>(name: &str, reference: ModuleOptimizer, optim: O) {
    let device = Device::flex().autodiff();
    let base = Branches::new(&device);
    let expected = branches_reference(&base, reference);
    for world_size in 1..=4 {
        for stage in STAGES {
            for (rank, got) in branches_sharded(&base, optim.clone(), world_size, stage)
                .iter()
                .enumerate()
            {
                let diff = max_abs_diff(got, &expected);
                assert!(
                    diff < 1e-5,
                    "{name}, stage {stage}, world size {world_size}, rank {rank}: parameters differ from Burn's by {diff}"
                );
            }
        }
    }
}

#[test]
fn adam_steps_each_parameter_from_its_own_first_gradient() {
    check_branches("Adam", AdamConfig::new().init(), AdamConfig::new());
}

#[test]
fn adamw_steps_each_parameter_from_its_own_first_gradient() {
    // The reported case: `late` joins at the third step; its first AdamW update must be about
    // `lr` per element (its own step count 1), not 0.64·lr (a shared count of 3).
    let cfg = AdamWConfig::new().with_weight_decay(0.1);
    check_branches("AdamW", cfg.init(), cfg);
}

#[test]
fn sgd_momentum_keeps_each_parameter_s_velocity_while_it_is_unused() {
    let cfg = SgdConfig::new().with_momentum(Some(MomentumConfig::new()));
    check_branches("SGD+momentum", cfg.init(), cfg.build());
}

/// A `[4, 0]` parameter next to a `[3]` one.
#[derive(Module, Debug)]
struct WithEmpty {
    empty: Param<Tensor<2>>,
    gain: Param<Tensor<1>>,
}

#[test]
fn empty_parameters_are_skipped_and_keep_their_shape_at_every_stage() {
    let device = Device::flex().autodiff();
    let base = WithEmpty {
        empty: Param::from_tensor(Tensor::<2>::zeros([4, 0], &device).require_grad()),
        gain: Param::from_tensor(Tensor::<1>::from_floats([1.0, 2.0, 3.0], &device).require_grad()),
    };
    let loss_of = |m: &WithEmpty, lo: usize, hi: usize, device: &Device| {
        let x = Tensor::<1>::from_floats([0.5, -1.0, 2.0, 1.5, -0.5, 0.25, 1.0, -2.0], device);
        let scale = x.narrow(0, lo, hi - lo).mean();
        (m.gain.val() * scale.unsqueeze()).sub_scalar(1.0).powi_scalar(2).sum()
    };
    // Reference: Burn's AdamW on the mean of the ranks' losses.
    let reference_for = |world_size: usize| {
        let mut reference = base.clone().fork(&device);
        let mut optim = AdamWConfig::new().init();
        let per_rank = 8 / world_size;
        for _ in 0..3 {
            let l = (0..world_size)
                .map(|r| loss_of(&reference, r * per_rank, (r + 1) * per_rank, &device))
                .reduce(|a, b| a + b)
                .unwrap()
                .div_scalar(world_size as f32);
            let grads = GradientsParams::from_grads(l.backward(), &reference);
            reference = optim.step(LR, reference, grads);
        }
        params_of(&reference)
    };
    for world_size in [2, 4] {
        let expected = reference_for(world_size);
        for stage in STAGES {
            let results = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
                let rank = comm.rank();
                let device = Device::flex().autodiff();
                let (mut model, mut optim) = ShardConfig::new(stage)
                    .init(base.clone().fork(&device), AdamWConfig::new(), comm)
                    .expect("an empty parameter must not fail init");
                assert_eq!(model.empty.dims(), [4, 0], "the empty parameter keeps its shape");
                let per_rank = 8 / world_size;
                for _ in 0..3 {
                    let l = loss_of(&model, rank * per_rank, (rank + 1) * per_rank, &device);
                    model = sharded_step(&mut optim, model, l, LR).0;
                }
                let full = model.materialize();
                assert_eq!(full.empty.dims(), [4, 0]);
                params_of(&full)
            })
            .unwrap();
            for got in results {
                let diff = max_abs_diff(&got, &expected);
                assert!(diff < 1e-5, "stage {stage}, world size {world_size}: off by {diff}");
            }
        }
    }
}

/// A student and a frozen teacher of another shape, both sharded on every rank over one
/// collective: the teacher has no trainable parameter (no optimizer state) and runs forward.
#[test]
fn a_frozen_teacher_shards_and_runs_forward_beside_a_student() {
    let device = Device::flex().autodiff();
    let teacher_base = LinearConfig::new(5, 3).init(&device).no_grad();
    let student_base = LinearConfig::new(5, 3).init(&device);
    let x = Tensor::<2>::from_data(TensorData::new(Rng::new(9).vec(8 * 5), [8, 5]), &device);
    let teacher_out: Vec<f32> = teacher_base.forward(x.clone()).into_data().iter::<f32>().collect();
    for stage in STAGES {
        let results = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
            let device = Device::flex().autodiff();
            let comm = Arc::new(comm);
            let (teacher, mut teacher_optim) = ShardConfig::new(stage)
                .init(teacher_base.clone().fork(&device), AdamWConfig::new(), comm.clone())
                .expect("a model without trainable parameters shards");
            assert!(
                teacher_optim.report().layout().slots().is_empty(),
                "no optimizer state for a frozen model"
            );
            let (mut student, mut optim) = ShardConfig::new(stage)
                .init(student_base.clone().fork(&device), AdamWConfig::new(), comm.clone())
                .expect("student");
            let x = x.clone();
            let rank = comm.rank();
            let mine = x.clone().narrow(0, rank * 4, 4);
            // Distillation: the student follows the teacher's outputs.
            let target = teacher.forward(mine.clone()).detach();
            let l = (student.forward(mine) - target).powi_scalar(2).mean();
            student = sharded_step(&mut optim, student, l, LR).0;
            let teacher = teacher_optim
                .step(LR, teacher, GradientsParams::new())
                .expect("a frozen model's step is a no-op");
            teacher_optim.check_collectives().expect("no collective failed");
            let out: Vec<f32> = teacher.forward(x).inner().into_data().iter::<f32>().collect();
            (out, student.num_params(), teacher.num_params())
        })
        .unwrap();
        for (out, student_params, teacher_params) in results {
            assert!(
                max_abs_diff(&out, &teacher_out) < 1e-6,
                "stage {stage}: the teacher's forward changed"
            );
            assert_eq!((student_params, teacher_params), (18, 18), "stage {stage}: full sizes");
        }
    }
}

/// Burn's LoRA before sharding: only the adapters train (sharded at stage 3, the frozen bases
/// kept whole), equal to single-device LoRA training.
#[test]
fn lora_adapters_train_at_every_stage_like_single_device_lora() {
    #[derive(Module, Debug)]
    struct Net {
        l1: Linear,
        norm: RmsNorm,
        l2: Linear,
    }
    impl Net {
        fn forward(&self, x: Tensor<2>) -> Tensor<2> {
            self.l2.forward(self.norm.forward(self.l1.forward(x)).tanh())
        }
    }
    let device = Device::flex().autodiff();
    let base = Net {
        l1: LinearConfig::new(5, 8).init(&device),
        norm: RmsNormConfig::new(8).init(&device),
        l2: LinearConfig::new(8, 3).init(&device),
    }
    .apply_lora(Lora::new(2, 4.0));
    let loss_of = |m: &Net, step: usize, lo: usize, hi: usize, device: &Device| {
        let x = Rng::new(60 + step as u64).vec(GLOBAL_BATCH * 5);
        let x = Tensor::<2>::from_data(TensorData::new(x[lo * 5..hi * 5].to_vec(), [hi - lo, 5]), device);
        m.forward(x).sub_scalar(0.5).powi_scalar(2).mean()
    };
    let mut reference = base.clone().fork(&device);
    let mut optim = AdamWConfig::new().init();
    for step in 0..4 {
        let l = loss_of(&reference, step, 0, GLOBAL_BATCH, &device);
        let grads = GradientsParams::from_grads(l.backward(), &reference);
        reference = optim.step(LR, reference, grads);
    }
    let expected = params_of(&reference.clone().materialize());
    let adapter_before = params_of(&base.l1.weight.adapter().unwrap().b);
    let adapter_after = params_of(&reference.l1.weight.adapter().unwrap().b);
    assert!(
        max_abs_diff(&adapter_before, &adapter_after) > 1e-3,
        "the reference must train the adapters"
    );
    for world_size in [1, 2, 3] {
        for stage in STAGES {
            let results = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
                let rank = comm.rank();
                let device = Device::flex().autodiff();
                let (mut model, mut optim) = ShardConfig::new(stage)
                    .init(base.clone().fork(&device), AdamWConfig::new(), comm)
                    .expect("LoRA model");
                let per_rank = GLOBAL_BATCH / world_size;
                for step in 0..4 {
                    let l = loss_of(&model, step, rank * per_rank, (rank + 1) * per_rank, &device);
                    model = sharded_step(&mut optim, model, l, LR).0;
                }
                // Only the adapters have optimizer state (stage 3: this rank's shards of them).
                let trained: usize = optim.report().layout().slots().iter().map(|s| s.numel).sum();
                (params_of(&model.materialize()), trained)
            })
            .unwrap_or_else(|e| panic!("stage {stage}, world size {world_size}: {e:?}"));
            // l1: a [5, 2], b [2, 8]; l2: a [8, 2], b [2, 3]. Biases and norms are frozen by LoRA.
            let adapters = [10usize, 16, 16, 6];
            let expected_trained: usize = match stage {
                Stage::Three => adapters.iter().map(|n| n.div_ceil(world_size)).sum(),
                _ => adapters.iter().sum(),
            };
            for (got, trained) in results {
                let diff = max_abs_diff(&got, &expected);
                assert!(
                    diff < 1e-5,
                    "stage {stage}, world size {world_size}: off single-device LoRA by {diff}"
                );
                assert_eq!(
                    trained, expected_trained,
                    "stage {stage}: only the adapters are trained"
                );
            }
        }
    }
}

/// A trainable parameter with a reparameterization of its own cannot be sharded at stage 3:
/// init says which one and what to do, on every rank.
#[test]
fn a_trainable_reparameterized_parameter_is_refused_at_stage_3_with_the_fix() {
    let device = Device::flex().autodiff();
    // LoRA, then unfreeze the bases: trainable parameters that carry a reparameterization.
    let base = LinearConfig::new(4, 4)
        .init(&device)
        .apply_lora(Lora::new(2, 4.0))
        .unfreeze();
    let results = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        ShardConfig::new(Stage::Three)
            .init(base.clone().fork(&Device::flex().autodiff()), AdamWConfig::new(), comm)
            .err()
    })
    .unwrap();
    for err in results {
        let err = err.expect("refused");
        assert!(matches!(err, ShardError::UnsupportedParam { .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains("`weight`") && text.contains("stage 2"), "{text}");
    }
}

/// Stages 0-2 allow rank-dependent branches: `late` is used by rank 0 only, so the other ranks
/// have no gradient for it. The ranks must agree that it got one (its gradient then counts as
/// zero on the other ranks), step it and its state on every rank, and match single-device
/// training on the mean of the ranks' losses.
#[test]
fn a_parameter_used_on_one_rank_only_is_stepped_on_every_rank() {
    let device = Device::flex().autodiff();
    let base = Branches::new(&device);
    let loss_of = |m: &Branches, step: usize, rank: usize, world_size: usize, device: &Device| {
        let per_rank = GLOBAL_BATCH / world_size;
        let x = Rng::new(90 + step as u64).vec(GLOBAL_BATCH * 2);
        let x = &x[rank * per_rank * 2..(rank + 1) * per_rank * 2];
        let x = Tensor::<2>::from_data(TensorData::new(x.to_vec(), [per_rank, 2]), device);
        let mut y = m.always.forward(x.clone());
        if rank == 0 {
            y = y + m.late.forward(x.clone());
        }
        (y - x.sum_dim(1)).powi_scalar(2).mean()
    };
    let cfg = AdamWConfig::new().with_weight_decay(0.1);
    for world_size in 2..=4 {
        let mut reference = base.clone().fork(&device);
        let mut optim = cfg.init();
        for step in 0..4 {
            let l = (0..world_size)
                .map(|r| loss_of(&reference, step, r, world_size, &device))
                .reduce(|a, b| a + b)
                .unwrap()
                .div_scalar(world_size as f32);
            let grads = GradientsParams::from_grads(l.backward(), &reference);
            reference = optim.step(LR, reference, grads);
        }
        let expected = params_of(&reference);
        for stage in [Stage::Zero, Stage::One, Stage::Two] {
            let results = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
                let rank = comm.rank();
                let device = Device::flex().autodiff();
                let (mut model, mut optim) = ShardConfig::new(stage)
                    .init(base.clone().fork(&device), cfg.clone(), comm)
                    .expect("init");
                for step in 0..4 {
                    let l = loss_of(&model, step, rank, world_size, &device);
                    model = sharded_step(&mut optim, model, l, LR).0;
                }
                params_of(&model)
            })
            .unwrap();
            for (rank, got) in results.iter().enumerate() {
                let diff = max_abs_diff(got, &expected);
                assert!(
                    diff < 1e-5,
                    "stage {stage}, world size {world_size}, rank {rank}: off by {diff}"
                );
            }
        }
    }
}
