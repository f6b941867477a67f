//! Ranks that hold unequal shares of the global batch: `step_with_items` gives single-device
//! training on the mean over every item, at stages 0-3, world sizes 2-4, with gradient
//! accumulation over micro-batches of different sizes and with hybrid sharding; `step` (equal
//! weights) is measurably not it on the same input.

use burn::nn::loss::{MseLoss, Reduction};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::prelude::*;
use burn_shard::{ShardConfig, Stage};
use burn_shard_comm::{Collective, InProcessGroup, run_ranks};

use crate::common::*;

/// A global batch of 23 rows: divides by no world size in 2..=4.
const GLOBAL: usize = 23;
const STEPS: usize = 8;
const LR: f64 = 1e-2;

/// Rows `[start, end)` of rank `rank` of `world_size`: shares in proportion to `rank + 1`
/// (23 rows as 7 + 16, 3 + 8 + 12, 2 + 4 + 7 + 10), so no two ranks hold as many, and each at
/// least 2 (every rank runs the same two micro-batches: stage 3 communicates in each backward).
fn share(rank: usize, world_size: usize) -> (usize, usize) {
    let weights: usize = (1..=world_size).sum();
    let end = |r: usize| {
        if r == world_size {
            GLOBAL
        } else {
            GLOBAL * (1..=r).sum::<usize>() / weights
        }
    };
    (end(rank), end(rank + 1))
}

/// The sum (not the mean) of the squared errors of rows `[start, end)` of step `step`'s batch.
fn summed_loss(model: &TinyMlp, step: usize, (start, end): (usize, usize), device: &Device) -> Tensor<1> {
    let (x, y) = batch(step, GLOBAL);
    let out = model.forward(rows(&x, IN, start, end, device));
    MseLoss::new().forward(out, rows(&y, OUT, start, end, device), Reduction::Sum)
}

/// One rank: each step's share as two micro-batches (the first half accumulated) and
/// `step_with_items` with the share's element count, or plain `step` with the mean loss when
/// `equal_weights`. Rank 0's final parameters (gathered at stage 3).
fn rank_run(
    comm: burn_shard_comm::InProcessComm,
    base: &TinyMlp,
    config: ShardConfig,
    equal_weights: bool,
) -> Vec<f32> {
    let (rank, world_size) = (comm.rank(), comm.world_size());
    let device = Device::flex().autodiff();
    let (mut model, mut optim) = config
        .init(base.clone().fork(&device), AdamWConfig::new(), comm)
        .unwrap();
    let (start, end) = share(rank, world_size);
    for step in 0..STEPS {
        if equal_weights {
            let (x, y) = batch(step, GLOBAL);
            let loss = mse(
                &model,
                rows(&x, IN, start, end, &device),
                rows(&y, OUT, start, end, &device),
            );
            model = sharded_step(&mut optim, model, loss, LR).0;
            continue;
        }
        let middle = start + (end - start) / 2;
        let grads = GradientsParams::from_grads(summed_loss(&model, step, (start, middle), &device).backward(), &model);
        optim.accumulate(&model, grads).unwrap();
        let grads = GradientsParams::from_grads(summed_loss(&model, step, (middle, end), &device).backward(), &model);
        let items = ((end - start) * OUT) as u64;
        model = optim.step_with_items(LR, model, grads, items).unwrap();
    }
    params_of(&model.materialize())
}

#[test]
fn unequal_shares_weighted_by_their_items_train_as_one_device() {
    let device = Device::flex().autodiff();
    device.seed(7);
    let base = TinyMlp::new(&device);
    let (_, reference) = reference_run(&base, AdamWConfig::new().init(), STEPS, GLOBAL, LR);
    let mut runs: Vec<(usize, Stage, usize)> = Vec::new();
    for world_size in 2..=4 {
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            runs.push((world_size, stage, 1));
        }
    }
    runs.extend([(4, Stage::Two, 2), (4, Stage::Three, 2)]);
    for (world_size, stage, replicas) in runs {
        let at = format!("world size {world_size}, stage {stage}, {replicas} replicas");
        let mut config = ShardConfig::new(stage);
        if replicas > 1 {
            config = config.with_replicas(replicas);
        }
        let params = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
            rank_run(comm, &base, config.clone(), false)
        })
        .unwrap();
        for p in &params {
            assert_eq!(p, &params[0], "{at}: ranks hold identical parameters");
        }
        let diff = max_abs_diff(&params[0], &reference);
        assert!(diff <= 1e-5, "{at}: max |param - single device| = {diff:e}");
    }

    // The same shares through `step` with each rank's mean loss: every rank's mean weighs as
    // much as any other's, which is another gradient.
    let params = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        rank_run(comm, &base, ShardConfig::new(Stage::Two), true)
    })
    .unwrap();
    let diff = max_abs_diff(&params[0], &reference);
    eprintln!("step with equal weights on shares of 7 and 16 rows: max |param - single device| = {diff:e}");
    assert!(
        diff > 1e-4,
        "equal weights on shares of 7 and 16 rows should not match: {diff:e}"
    );
}

#[test]
fn zero_items_on_every_rank_is_an_error_on_every_rank() {
    let device = Device::flex().autodiff();
    let base = TinyMlp::new(&device);
    let errors = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let (model, mut optim) = ShardConfig::new(Stage::One)
            .init(base.clone().fork(&device), AdamWConfig::new(), comm)
            .unwrap();
        let grads = GradientsParams::from_grads(summed_loss(&model, 0, (0, 2), &device).backward(), &model);
        optim
            .step_with_items(LR, model, grads, 0)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    })
    .unwrap();
    for e in errors {
        assert!(e.contains("0 items"), "{e}");
    }
}
