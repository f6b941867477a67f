//! Gradient accumulation without communication: `k` micro-batches given to
//! `ShardedOptimizer::accumulate`, then one `step`, equal one step on the concatenated batch
//! (single-device Burn on the global batch), at every stage and world size 1-4; and the bytes
//! sent per optimizer step are those of one plain step at stages 0-2 (so per micro-batch they
//! drop by `k`), while stage 3 sends each micro-batch's gathers and reduce-scatter (`k` times
//! the bytes of a plain step).

use std::sync::Arc;

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::prelude::*;
use burn_shard::{ShardConfig, Stage};
use burn_shard_comm::{Collective, ReduceOp};

use crate::common::*;
use crate::equivalence::{GLOBAL_BATCH, LR, STEPS};

/// Micro-batches per step for a rank's share of `rows` rows (every share of the global batch of
/// 12 at world sizes 1-4 divides by it).
fn micro_batches(rows: usize) -> usize {
    if rows.is_multiple_of(3) { 3 } else { 2 }
}

#[test]
fn accumulated_micro_batches_equal_one_step_on_the_whole_batch_and_send_once() {
    let device = Device::flex().autodiff();
    device.seed(9);
    let base = TinyMlp::new(&device);
    let reference = reference_run(&base, AdamWConfig::new().init(), STEPS, GLOBAL_BATCH, LR);
    sweep("accumulation", &reference, 1e-4, |comm, stage| {
        let device = Device::flex().autodiff();
        let comm = Arc::new(comm);
        let (lo, hi) = rank_rows(comm.rank(), comm.world_size(), GLOBAL_BATCH);
        let k = micro_batches(hi - lo);
        let micro = (hi - lo) / k;
        let plain_bytes = plain_step_bytes(&base, comm.clone(), stage, lo, hi);

        let (mut model, mut optim) = ShardConfig::new(stage)
            .init(base.clone().fork(&device), AdamWConfig::new(), comm.clone())
            .expect("init");
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let (x, y) = batch(step, GLOBAL_BATCH);
            let before = comm.stats();
            let mut local = 0.0;
            for m in 0..k {
                let (a, b) = (lo + m * micro, lo + (m + 1) * micro);
                // Each micro-batch's mean loss divided by k: the sum is the mean over the share.
                let loss = mse(&model, rows(&x, IN, a, b, &device), rows(&y, OUT, a, b, &device)).div_scalar(k as f32);
                local += loss.clone().into_scalar::<f32>();
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                if m + 1 < k {
                    optim.accumulate(&model, grads).expect("accumulate");
                    if stage != Stage::Three {
                        assert_eq!(
                            comm.stats().since(&before).total_bytes_sent(),
                            0,
                            "stage {stage}: no bytes before the step"
                        );
                    }
                } else {
                    model = optim.step(LR, model, grads).expect("step");
                }
            }
            let sent = comm.stats().since(&before).total_bytes_sent();
            // The first step also agrees on what stages 0-2 learned (a broadcast of a few bytes).
            let plain_bytes = plain_bytes[step.min(1)];
            let expected = if stage == Stage::Three {
                k as u64 * plain_bytes
            } else {
                plain_bytes
            };
            assert_eq!(sent, expected, "stage {stage}, k {k}: bytes per optimizer step");
            let mean = comm
                .all_reduce(Tensor::<1>::from_floats([local], &device).inner(), ReduceOp::Avg)
                .expect("loss all_reduce");
            losses.push(mean.into_scalar::<f32>());
        }
        (losses, params_of(&model.materialize()))
    });
}

/// Bytes this rank sends for the first and the second plain step (forward, backward and step on
/// rows `lo..hi`) of a second sharded copy of the model on the same collective.
fn plain_step_bytes<C: Collective + 'static>(
    base: &TinyMlp,
    comm: Arc<C>,
    stage: Stage,
    lo: usize,
    hi: usize,
) -> [u64; 2] {
    let device = Device::flex().autodiff();
    let (mut model, mut optim) = ShardConfig::new(stage)
        .init(base.clone().fork(&device), AdamWConfig::new(), comm.clone())
        .expect("init");
    [0, 1].map(|step| {
        let (x, y) = batch(step, GLOBAL_BATCH);
        let before = comm.stats();
        let loss = mse(&model, rows(&x, IN, lo, hi, &device), rows(&y, OUT, lo, hi, &device));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model.clone(), grads).expect("step");
        comm.stats().since(&before).total_bytes_sent()
    })
}

/// Micro-batch sums are state a checkpoint does not hold: saving while some are pending is
/// refused (on every rank), and the memory report counts them with the gradients.
#[test]
fn pending_micro_batches_block_a_checkpoint_and_count_as_gradient_memory() {
    let dir = scratch("accumulation", "pending").join("ckpt");
    let device = Device::flex().autodiff();
    let base = TinyMlp::new(&device);
    let results = burn_shard_comm::run_ranks(burn_shard_comm::InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (lo, hi) = rank_rows(comm.rank(), comm.world_size(), GLOBAL_BATCH);
        let (model, mut optim) = ShardConfig::new(Stage::Two)
            .init(base.clone().fork(&device), AdamWConfig::new(), comm)
            .expect("init");
        let (x, y) = batch(0, GLOBAL_BATCH);
        let grads = |model: &TinyMlp| {
            let loss = mse(model, rows(&x, IN, lo, hi, &device), rows(&y, OUT, lo, hi, &device));
            GradientsParams::from_grads(loss.backward(), model)
        };
        optim.accumulate(&model, grads(&model)).expect("accumulate");
        let refused = optim
            .save_checkpoint(&model, &dir, serde_json::Value::Null)
            .expect_err("refused")
            .to_string();
        let last = grads(&model);
        let model = optim.step(LR, model, last).expect("step");
        let report = optim.report().memory(&model);
        let shards: usize = optim
            .report()
            .layout()
            .buckets()
            .iter()
            .map(|b| b.shard_numel * 4)
            .sum();
        (
            refused,
            report.gradients_bytes,
            shards,
            optim
                .report()
                .layout()
                .slots()
                .iter()
                .map(|s| s.numel * 4)
                .sum::<usize>(),
        )
    })
    .expect("no rank panics");
    for (refused, gradients_bytes, shards, whole) in results {
        assert!(refused.contains("save the checkpoint after step()"), "{refused}");
        // Stage 2 holds its reduced shard, plus the whole local sum held before the step.
        assert_eq!(gradients_bytes, shards + whole);
    }
    assert!(!dir.exists(), "nothing written");
}
