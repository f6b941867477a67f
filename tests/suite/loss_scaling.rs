//! Loss scaling decided on all ranks together: an infinity in the gradient of one rank only
//! makes every rank skip that step and back off the scale the same way, at every stage and
//! world size 1-4 (equal to single-device training that skips the step); `f16` trains with a
//! dynamic scaler and is refused without one; `bf16` needs none.

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::prelude::*;
use burn::tensor::DType;
use burn_shard::{LossScaler, ShardConfig, Stage};
use burn_shard_comm::{Collective, InProcessGroup, ReduceOp, run_ranks};

use crate::common::*;
use crate::equivalence::{GLOBAL_BATCH, LR, STEPS};

/// The step whose gradient overflows (on the last rank only).
const OVERFLOW_STEP: usize = 5;
/// Growth every 4 finite steps, so the run also exercises growth.
const GROWTH_INTERVAL: usize = 4;

fn scaler() -> LossScaler {
    LossScaler::dynamic().with_growth_interval(GROWTH_INTERVAL)
}

/// `loss` plus `factor` times the first element of `model.l1.weight`: with an infinite factor,
/// backward gives that one element an infinite gradient. The poison goes through backward (not
/// into `GradientsParams`) so that it reaches the gradients also where stages 0-2 reduce them
/// inside backward, where they never enter `GradientsParams`. Every rank reads the weight (a
/// gather at stage 3), the others with factor 0.
fn poison(model: &TinyMlp, loss: Tensor<1>, factor: f32) -> Tensor<1> {
    let first = model.l1.weight.val().slice([0..1, 0..1]).reshape([1]);
    loss + first.mul_scalar(factor)
}

/// Single-device Burn AdamW on the whole batch, skipping the overflow step: the losses, then
/// the gradient norm of every step taken (unscaled; what `last_grad_norm` must report), and the
/// final parameters.
fn reference(base: &TinyMlp) -> (Vec<f32>, Vec<f32>) {
    let mut optim = AdamWConfig::new().init();
    let mut norms = Vec::new();
    let (mut losses, params) = reference_loop(base, STEPS, GLOBAL_BATCH, |step, model, mut grads| match step {
        OVERFLOW_STEP => model,
        _ => {
            norms.push(grad_norm(&model, &mut grads) as f32);
            optim.step(LR, model, grads)
        }
    });
    losses.extend(norms);
    (losses, params)
}

/// One rank's run: scaled losses, the last rank poisons its gradient at `OVERFLOW_STEP`.
/// Returns the global losses, the final parameters, the parameters before and after the
/// overflow step, and the scaler.
#[allow(clippy::type_complexity)]
fn rank_run(
    comm: impl Collective + 'static,
    config: ShardConfig,
    base: &TinyMlp,
    dtype: DType,
) -> (Vec<f32>, Vec<f32>, (Vec<f32>, Vec<f32>), LossScaler) {
    let device = Device::flex().autodiff();
    let (rank, world_size) = (comm.rank(), comm.world_size());
    let (lo, hi) = rank_rows(rank, world_size, GLOBAL_BATCH);
    let model = cast(base.clone().fork(&device), dtype);
    let (mut model, mut optim) = config.init(model, AdamWConfig::new(), comm).expect("init");
    let (mut losses, mut norms, mut around) = (Vec::new(), Vec::new(), (Vec::new(), Vec::new()));
    for step in 0..STEPS {
        let (x, y) = batch(step, GLOBAL_BATCH);
        let x = rows(&x, IN, lo, hi, &device).cast(dtype);
        let y = rows(&y, OUT, lo, hi, &device).cast(dtype);
        let loss = mse(&model, x, y);
        let global = optim
            .comm()
            .all_reduce(loss.clone().inner().cast(DType::F32), ReduceOp::Avg)
            .expect("loss all_reduce");
        losses.push(global.into_scalar::<f32>());
        let overflow = step == OVERFLOW_STEP;
        let factor = match overflow && rank == world_size - 1 {
            true => f32::INFINITY,
            false => 0.0,
        };
        let loss = poison(&model, loss, factor);
        let grads = GradientsParams::from_grads(optim.scale_loss(loss).backward(), &model);
        if overflow {
            around.0 = params_of(&model.clone().materialize());
        }
        model = optim.step(LR, model, grads).expect("step");
        assert_eq!(
            optim.report().last_step_applied(),
            !overflow,
            "rank {rank}, step {step}: last_step_applied must say whether the scaler skipped the step"
        );
        let norm = optim.report().last_grad_norm().expect("measured");
        if overflow {
            around.1 = params_of(&model.clone().materialize());
            assert!(
                !norm.is_finite(),
                "rank {rank}: the overflow must reach every rank (norm {norm})"
            );
        } else {
            norms.push(norm as f32);
        }
    }
    // The losses, then the unscaled norm of every step taken.
    losses.extend(norms);
    let params = params_of(&model.materialize());
    (losses, params, around, optim.loss_scaler().expect("configured").clone())
}

/// Finite steps 0-4 grow the scale once (after 4), the overflow at step 5 halves it, and the 14
/// finite steps after it grow it 3 times: `2^16 · 2 · 0.5 · 2^3`.
const FINAL_SCALE: f32 = 65536.0 * 2.0 * 0.5 * 8.0;

#[test]
fn an_overflow_on_one_rank_skips_the_step_on_every_rank() {
    let device = Device::flex().autodiff();
    device.seed(13);
    let base = TinyMlp::new(&device);
    let reference = reference(&base);
    sweep("overflow on the last rank", &reference, 1e-4, |comm, stage| {
        let rank = comm.rank();
        let config = ShardConfig::new(stage).with_loss_scaler(scaler());
        let (losses, params, (before, after), scaler) = rank_run(comm, config, &base, DType::F32);
        let ctx = format!("rank {rank}, stage {stage}");
        assert_eq!(
            before, after,
            "{ctx}: the overflow step must leave the parameters as they were"
        );
        assert_eq!(scaler.skipped_steps(), 1, "{ctx}: one step skipped");
        assert_eq!(
            scaler.scale(),
            FINAL_SCALE,
            "{ctx}: scale after growth, back-off and growth"
        );
        (losses, params)
    });
}

#[test]
fn f16_trains_with_dynamic_loss_scaling_and_skips_overflows_together() {
    let device = Device::flex().autodiff();
    device.seed(17);
    let base = TinyMlp::new(&device);
    // 2^10 keeps this model's scaled f16 gradients finite; the default 2^16 would overflow
    // them and back off on its own, which is what it is for, but not what is tested here.
    let f16_scaler = LossScaler::dynamic().with_scale(1024.0);
    // The f32 run of the same steps: the f16 run's unscaled norms must follow it (a wrong
    // unscale would be off by the scale).
    let reference = reference(&base);
    for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
        let config = ShardConfig::new(stage).with_loss_scaler(f16_scaler.clone());
        let results = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
            rank_run(comm, config.clone(), &base, DType::F16)
        })
        .expect("no rank panics");
        let (losses, params, (before, after), scaler) = &results[0];
        assert_eq!(
            &results[1].1, params,
            "stage {stage}: ranks hold the same f16 parameters"
        );
        assert_eq!(before, after, "stage {stage}: the overflow step is skipped");
        assert_eq!(scaler, &results[1].3, "stage {stage}: ranks agree on the scaler");
        assert_eq!(
            scaler.skipped_steps(),
            1,
            "stage {stage}: only the poisoned step is skipped"
        );
        assert_eq!(
            scaler.scale(),
            512.0,
            "stage {stage}: one back-off, no growth within 2000 steps"
        );
        for step in 0..OVERFLOW_STEP {
            let (got, want) = (losses[STEPS + step], reference.0[STEPS + step]);
            assert!(
                ((got - want) / want).abs() < 2e-2,
                "stage {stage}, step {step}: f16 gradient norm {got} vs f32 {want}"
            );
        }
        assert!(
            losses[STEPS - 1] < 0.8 * losses[0],
            "stage {stage}: f16 training must learn ({} -> {})",
            losses[0],
            losses[STEPS - 1]
        );
    }
}

#[test]
fn f16_without_a_loss_scaler_is_refused_and_bf16_needs_none() {
    let device = Device::flex().autodiff();
    let init = |dtype: DType, config: ShardConfig| {
        let comm = InProcessGroup::new(1).unwrap().into_comms().pop().unwrap();
        config
            .init(cast(TinyMlp::new(&device), dtype), AdamWConfig::new(), comm)
            .map(|_| ())
    };
    for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
        let err = init(DType::F16, ShardConfig::new(stage)).expect_err("f16 without a scaler");
        assert!(err.to_string().contains("with_loss_scaler"), "{err}");
        init(DType::BF16, ShardConfig::new(stage)).expect("bf16 needs no scaler");
        init(
            DType::F16,
            ShardConfig::new(stage).with_loss_scaler(LossScaler::dynamic()),
        )
        .expect("f16 with a scaler");
    }
    let bad = [
        LossScaler::dynamic().with_scale(0.0),
        LossScaler::dynamic().with_growth_factor(0.5),
        LossScaler::dynamic().with_backoff_factor(1.5),
        LossScaler::dynamic().with_growth_interval(0),
    ];
    for scaler in bad {
        let err = init(
            DType::F16,
            ShardConfig::new(Stage::Two).with_loss_scaler(scaler.clone()),
        )
        .expect_err("an invalid scaler");
        assert!(err.to_string().contains("LossScaler"), "{scaler:?}: {err}");
    }
}

#[test]
fn the_loss_scale_resumes_from_a_checkpoint() {
    let dir = scratch("loss-scaling", "resume").join("step-5");
    let device = Device::flex().autodiff();
    device.seed(19);
    let base = TinyMlp::new(&device);
    let results = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let comm = std::sync::Arc::new(comm);
        let (lo, hi) = rank_rows(comm.rank(), comm.world_size(), GLOBAL_BATCH);
        let init = |scaler: LossScaler| {
            ShardConfig::new(Stage::Two)
                .with_loss_scaler(scaler)
                .init(base.clone().fork(&device), AdamWConfig::new(), comm.clone())
                .expect("init")
        };
        let (mut model, mut optim) = init(LossScaler::dynamic().with_growth_interval(2));
        for step in 0..5 {
            let (x, y) = batch(step, GLOBAL_BATCH);
            let loss = mse(&model, rows(&x, IN, lo, hi, &device), rows(&y, OUT, lo, hi, &device));
            let grads = GradientsParams::from_grads(optim.scale_loss(loss).backward(), &model);
            model = optim.step(LR, model, grads).expect("step");
        }
        optim
            .save_checkpoint(&model, &dir, serde_json::Value::Null)
            .expect("save");
        let saved = optim.loss_scaler().unwrap().clone();
        let (fresh, mut resumed) = init(LossScaler::dynamic().with_growth_interval(2));
        resumed.load_checkpoint(fresh, &dir).expect("load");
        (saved, resumed.loss_scaler().unwrap().clone())
    })
    .expect("no rank panics");
    for (saved, resumed) in results {
        // 5 finite steps with growth every 2: 2^16 · 2 · 2, one finite step since.
        assert_eq!(saved.scale(), 65536.0 * 4.0);
        assert_eq!(resumed, saved, "the scaler continues where it was saved");
    }
}

/// The class of the Learner's `f16` bug (its loop never scaled the loss, the step still divided
/// the gradients by `2^16`, and parameters moved 0.118x as far as in `f32`): a backward whose
/// loss did not go through `scale_loss` reaching `step` or `accumulate` with a loss scaler
/// configured fails on every rank, at every stage and world size, naming the call to make;
/// `LossScaler::fixed(1.0)` (nothing to undo) and a scaled loss pass, and a scaled loss that
/// `discard_gradients` dropped does not cover the next backward.
#[test]
fn a_loss_not_scaled_for_a_configured_scaler_fails_the_step_on_every_rank() {
    let device = Device::flex().autodiff();
    device.seed(17);
    let base = TinyMlp::new(&device);
    // (scaler, how the run calls the optimizer, whether it must fail)
    #[derive(Clone, Copy, Debug)]
    enum Call {
        Step,
        Accumulate,
        StepAfterDiscard,
    }
    let cases = [
        (LossScaler::dynamic(), Call::Step, true),
        (LossScaler::fixed(256.0), Call::Accumulate, true),
        (LossScaler::dynamic(), Call::StepAfterDiscard, true),
        (LossScaler::fixed(1.0), Call::Step, false),
    ];
    for stage in burn_shard::estimate::STAGES {
        for world_size in 1..=4 {
            for (scaler, call, fails) in cases.clone() {
                let ctx = format!("stage {stage}, N={world_size}, {call:?}, scale {}", scaler.scale());
                let results = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
                    let (lo, hi) = rank_rows(comm.rank(), comm.world_size(), GLOBAL_BATCH);
                    let config = ShardConfig::new(stage).with_loss_scaler(scaler.clone());
                    // A rank still finishing `init` when another's step failed sees the abort there.
                    let (model, mut optim) = match config.init(base.clone().fork(&device), AdamWConfig::new(), comm) {
                        Ok(built) => built,
                        Err(e) => return Some(e),
                    };
                    let (x, y) = batch(0, GLOBAL_BATCH);
                    let loss = || mse(&model, rows(&x, IN, lo, hi, &device), rows(&y, OUT, lo, hi, &device));
                    match call {
                        Call::Step => {
                            let grads = GradientsParams::from_grads(loss().backward(), &model);
                            optim.step(LR, model.clone(), grads).err()
                        }
                        Call::Accumulate => {
                            let grads = GradientsParams::from_grads(loss().backward(), &model);
                            optim.accumulate(&model, grads).err()
                        }
                        Call::StepAfterDiscard => {
                            let discarded = optim.scale_loss(loss()).backward();
                            drop(discarded);
                            optim.discard_gradients().expect("discard");
                            let grads = GradientsParams::from_grads(loss().backward(), &model);
                            optim.step(LR, model.clone(), grads).err()
                        }
                    }
                })
                .expect("no rank panics");
                for (rank, err) in results.into_iter().enumerate() {
                    match (fails, err) {
                        (true, Some(err)) => {
                            let msg = err.to_string();
                            // This rank's own check, or the abort of the rank that checked first.
                            let own_or_abort = matches!(
                                err,
                                burn_shard::ShardError::LossNotScaled { .. }
                                    | burn_shard::ShardError::Comm(burn_shard_comm::CommError::Aborted(_))
                            );
                            assert!(
                                own_or_abort
                                    && msg.contains("scale_loss")
                                    && msg.contains("burn_shard_train::scale_loss"),
                                "{ctx}, rank {rank}: {msg}"
                            );
                        }
                        (false, None) => {}
                        (_, err) => panic!("{ctx}, rank {rank}: expected failure {fails}, got {err:?}"),
                    }
                }
            }
        }
    }
}

/// A `LossScaling` handle kept across a step whose scaler grew the scale multiplies by the old
/// scale: the next step refuses it, naming both scales, instead of unscaling by the new one.
#[test]
fn a_loss_scaled_by_an_older_scale_fails_the_step() {
    let device = Device::flex().autodiff();
    device.seed(18);
    let base = TinyMlp::new(&device);
    for stage in burn_shard::estimate::STAGES {
        let results = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
            let (lo, hi) = rank_rows(comm.rank(), comm.world_size(), GLOBAL_BATCH);
            // The scale doubles after every finite step.
            let config = ShardConfig::new(stage).with_loss_scaler(LossScaler::dynamic().with_growth_interval(1));
            let (mut model, mut optim) = match config.init(base.clone().fork(&device), AdamWConfig::new(), comm) {
                Ok(built) => built,
                Err(e) => return Some(e),
            };
            let (x, y) = batch(0, GLOBAL_BATCH);
            let loss = |model: &TinyMlp| mse(model, rows(&x, IN, lo, hi, &device), rows(&y, OUT, lo, hi, &device));
            let stale = optim.loss_scaling();
            let grads = GradientsParams::from_grads(stale.scale_loss(loss(&model)).backward(), &model);
            model = optim
                .step(LR, model, grads)
                .expect("the first step, scaled by the current scale");
            let grads = GradientsParams::from_grads(stale.scale_loss(loss(&model)).backward(), &model);
            optim.step(LR, model, grads).err()
        })
        .expect("no rank panics");
        for (rank, err) in results.into_iter().enumerate() {
            let msg = err.map(|e| e.to_string()).unwrap_or_default();
            assert!(
                msg.contains("scale 131072") && msg.contains("scaled by 65536, an older scale"),
                "stage {stage}, rank {rank}: {msg:?}"
            );
        }
    }
}
