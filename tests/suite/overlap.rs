//! Stages 0-2 reduce each bucket inside backward (`burn_shard::bucket`): on a small language model of stock layers at
//! every stage 0-2 and world sizes 2-4, with and without Burn's checkpointing, from the second
//! step every bucket's collective is issued inside `backward()` and none in the step, the bytes
//! are those of the step-time reduction, and the parameters equal training on one rank with
//! the global batch; micro-batches given to `accumulate` still send nothing; and backwards that
//! differ from the learned one (a block skipped on every rank, or on one rank only) give the
//! results of the step-time reduction.

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::prelude::*;
use burn::tensor::DType;
use burn::tensor::activation::gelu;
use burn_shard::fsdp::unit;
use burn_shard::{IntoOptimizer, LossScaler, ShardConfig, ShardedOptimizer, Stage};
use burn_shard_comm::{Collective, CollectiveKind, CommStats, InProcessGroup, run_ranks};

use crate::common::{cast, max_abs_diff, params_of, scratch};

const STAGES: [Stage; 3] = [Stage::Zero, Stage::One, Stage::Two];
/// Small enough that the model below spans several buckets.
const BUCKET_NUMEL: usize = 700;
/// Sequences per rank per step, of `SEQ` tokens.
const ROWS: usize = 2;
const SEQ: usize = 8;
const VOCAB: usize = 11;
const WIDTH: usize = 16;
/// Parameters after a few Adam steps against one rank on the global batch, as the equivalence
/// sweep allows: the ranks' sums associate differently, which Adam's normalised update turns
/// into about 1e-5; a wrong reduction (a sum for a mean, a bucket left out) moves them by
/// about the learning rate, 1e-2.
const ONE_RANK_TOLERANCE: f32 = 1e-4;

/// A residual MLP block of stock layers.
#[derive(Module, Debug)]
pub struct Block {
    norm: LayerNorm,
    up: Linear,
    down: Linear,
}

/// Token embedding (also tied into the output), three blocks (each a `unit`), a head: a small
/// language model whose blocks can be left out of a step.
#[derive(Module, Debug)]
pub struct Tower {
    embed: Embedding,
    blocks: Vec<Block>,
    head: Linear,
}

impl Tower {
    fn new(device: &Device) -> Self {
        Self {
            embed: EmbeddingConfig::new(VOCAB, WIDTH).init(device),
            blocks: (0..3)
                .map(|_| Block {
                    norm: LayerNormConfig::new(WIDTH).init(device),
                    up: LinearConfig::new(WIDTH, 2 * WIDTH).init(device),
                    down: LinearConfig::new(2 * WIDTH, WIDTH).init(device),
                })
                .collect(),
            head: LinearConfig::new(WIDTH, VOCAB).init(device),
        }
    }

    /// Mean cross-entropy of predicting the next token of `idx` (`[batch, SEQ]`), block `skip`
    /// left out.
    fn loss(&self, idx: Tensor<2, Int>, skip: Option<usize>) -> Tensor<1> {
        self.loss_with(idx, skip, false)
    }

    /// [`Tower::loss`]; with `frozen_body`, the blocks' output is detached (a warm-up that
    /// trains only the embedding and the head).
    fn loss_with(&self, idx: Tensor<2, Int>, skip: Option<usize>, frozen_body: bool) -> Tensor<1> {
        let [b, t] = idx.dims();
        let mut x = self.embed.forward(idx.clone());
        for (_, block) in self.blocks.iter().enumerate().filter(|(i, _)| Some(*i) != skip) {
            x = unit(&x, || {
                let h = block.up.forward(block.norm.forward(x.clone()));
                x.clone() + block.down.forward(gelu(h))
            });
        }
        if frozen_body {
            x = x.detach();
        }
        // The embedding is read twice (tied into the output, as GPT-2's and Llama's heads): its
        // gradient arrives in two parts.
        let tied = x.clone().matmul(self.embed.weight.val().transpose().unsqueeze::<3>());
        let logits = (self.head.forward(x) + tied).reshape([b * t, VOCAB]);
        let targets = (idx.reshape([b * t]) + 1) % VOCAB as i64;
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, targets)
    }
}

fn device(checkpointing: bool) -> Device {
    match checkpointing {
        true => Device::flex().autodiff().gradient_checkpointing(),
        false => Device::flex().autodiff(),
    }
}

/// The model, made once per test and forked into each run: Burn's CPU backend draws from one
/// process-wide generator, which tests running in parallel share.
fn tower(checkpointing: bool) -> (Tower, Device) {
    let device = device(checkpointing);
    (Tower::new(&device), device)
}

/// Token ids of rows `rows` of step `step`'s global batch, `[rows.len(), SEQ]`.
fn tokens(step: usize, rows: std::ops::Range<usize>, device: &Device) -> Tensor<2, Int> {
    let n = rows.len();
    let ids: Vec<i64> = rows
        .flat_map(|r| (0..SEQ).map(move |t| ((r * 5 + t * 7 + step * 3) % 11) as i64))
        .collect();
    Tensor::from_data(TensorData::new(ids, [n, SEQ]), device)
}

/// `base` sharded at `stage` with `config`'s other options, on `device`.
fn init(
    base: &Tower,
    config: &ShardConfig,
    stage: Stage,
    comm: impl Collective + 'static,
    device: &Device,
) -> (Tower, ShardedOptimizer<<AdamConfig as IntoOptimizer>::Optimizer>) {
    let config = ShardConfig {
        stage,
        ..config.clone()
    };
    config.init(base.clone().fork(device), AdamConfig::new(), comm).unwrap()
}

/// Bucket reductions (all-reduces and reduce-scatters) in `stats`: calls and bytes.
fn reductions(stats: &CommStats) -> (u64, u64) {
    let (ar, rs) = (
        stats.get(CollectiveKind::AllReduce),
        stats.get(CollectiveKind::ReduceScatter),
    );
    (ar.calls + rs.calls, ar.bytes_sent + rs.bytes_sent)
}

/// What one rank saw at each step: buckets started inside `backward()`, and the reductions
/// (calls, bytes) from the start of backward to the end of the step.
#[derive(Debug, Clone, Copy)]
struct StepCalls {
    overlapped: usize,
    reductions: (u64, u64),
}

/// Trains `base` for `steps` steps at `stage` on `n` ranks (`rows_per_rank` rows each of every
/// step's global batch); `skip(step, rank)` names a block that rank leaves out at that step.
/// Returns rank 0's calls per step, its bucket count and the final parameters.
fn train(
    base: &Tower,
    checkpointing: bool,
    n: usize,
    stage: Stage,
    config: ShardConfig,
    steps: usize,
    skip: impl Fn(usize, usize) -> Option<usize> + Sync,
) -> (Vec<StepCalls>, usize, Vec<f32>) {
    let runs = run_ranks(InProcessGroup::new(n).unwrap(), |comm| {
        let device = device(checkpointing);
        let rank = comm.rank();
        let (mut model, mut optim) = init(base, &config, stage, comm, &device);
        let mut calls = Vec::new();
        for step in 0..steps {
            let idx = tokens(step, rank * ROWS..(rank + 1) * ROWS, &device);
            let loss = model.loss(idx, skip(step, rank));
            let before = optim.comm().stats();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-2, model, grads).unwrap();
            calls.push(StepCalls {
                overlapped: optim.report().overlapped_buckets(),
                reductions: reductions(&optim.comm().stats().since(&before)),
            });
        }
        (calls, optim.report().layout().buckets().len(), params_of(&model))
    })
    .unwrap();
    runs.into_iter().next().unwrap()
}

/// One rank, stage 0, the whole global batch of `n` ranks: single-device training.
fn reference(base: &Tower, checkpointing: bool, n: usize, steps: usize, skip: Option<(usize, usize)>) -> Vec<f32> {
    let device = device(checkpointing);
    let comm = InProcessGroup::new(1).unwrap().into_comms().pop().unwrap();
    let (mut model, mut optim) = ShardConfig::new(Stage::Zero)
        .init(base.clone().fork(&device), AdamConfig::new(), comm)
        .unwrap();
    for step in 0..steps {
        let idx = tokens(step, 0..n * ROWS, &device);
        let skip = skip.filter(|&(s, _)| s == step).map(|(_, block)| block);
        let loss = model.loss(idx, skip);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-2, model, grads).unwrap();
    }
    params_of(&model)
}

#[test]
fn stages_0_to_2_reduce_every_bucket_inside_backward_and_train_as_one_rank() {
    let steps = 4;
    for checkpointing in [false, true] {
        let (base, _) = tower(checkpointing);
        for n in 2..=4 {
            let expected = reference(&base, checkpointing, n, steps, None);
            let config = ShardConfig::new(Stage::Zero).with_bucket_numel(BUCKET_NUMEL);
            for stage in STAGES {
                let case = format!("stage {stage}, N={n}, checkpointing={checkpointing}");
                let (calls, buckets, params) =
                    train(&base, checkpointing, n, stage, config.clone(), steps, |_, _| None);
                assert!(buckets >= 4, "{case}: the model spans {buckets} buckets");
                // Step 1 learns: every bucket is reduced in the step. Then inside backward, with
                // the same calls (one per bucket, and the flags' all-reduce) and bytes.
                assert_eq!(calls[0].overlapped, 0, "{case}: {calls:?}");
                for c in &calls {
                    assert_eq!(c.reductions, calls[0].reductions, "{case}: {calls:?}");
                    assert_eq!(c.reductions.0, buckets as u64 + 1, "{case}: {calls:?}");
                }
                assert!(calls[1..].iter().all(|c| c.overlapped == buckets), "{case}: {calls:?}");
                let diff = max_abs_diff(&params, &expected);
                assert!(diff <= ONE_RANK_TOLERANCE, "{case}: drifts from one rank by {diff}");
            }
        }
    }
}

#[test]
fn overlap_comm_off_reduces_in_the_step_with_the_same_results() {
    let (base, _) = tower(false);
    for stage in STAGES {
        let on = ShardConfig::new(stage).with_bucket_numel(BUCKET_NUMEL);
        let off = on.clone().with_overlap_comm(false);
        let (calls_on, buckets, params_on) = train(&base, false, 3, stage, on, 3, |_, _| None);
        let (calls_off, _, params_off) = train(&base, false, 3, stage, off, 3, |_, _| None);
        assert_eq!(calls_on[2].overlapped, buckets, "stage {stage}: {calls_on:?}");
        assert!(
            calls_off.iter().all(|c| c.overlapped == 0),
            "stage {stage}: {calls_off:?}"
        );
        // The same buckets through the same ring: bitwise.
        assert_eq!(params_on, params_off, "stage {stage}");
    }
}

#[test]
fn backwards_that_differ_from_the_learned_one_train_as_the_step_time_reduction() {
    let (base, _) = tower(false);
    let n = 3;
    let steps = 5;
    for stage in STAGES {
        let on = ShardConfig::new(stage).with_bucket_numel(BUCKET_NUMEL);
        let off = on.clone().with_overlap_comm(false);
        // Every rank skips block 1 at step 2: its buckets stay incomplete until the step.
        let everywhere = |step: usize, _rank: usize| (step == 2).then_some(1);
        let (calls, buckets, params) = train(&base, false, n, stage, on.clone(), steps, everywhere);
        let (_, _, params_off) = train(&base, false, n, stage, off.clone(), steps, everywhere);
        let expected = reference(&base, false, n, steps, Some((2, 1)));
        let diff = max_abs_diff(&params, &expected);
        assert!(
            diff <= ONE_RANK_TOLERANCE,
            "stage {stage}: a block skipped everywhere drifts from one rank by {diff}"
        );
        assert!(max_abs_diff(&params, &params_off) <= 1e-6, "stage {stage}");
        assert!(calls[2].overlapped < buckets, "stage {stage}: {calls:?}");
        assert_eq!(
            calls[4].overlapped, buckets,
            "stage {stage}: back to overlap: {calls:?}"
        );
        // Rank 1 alone skips block 0 at steps 1 and 3: its peers start buckets it completes
        // only in the step, in the same order.
        let one_rank = |step: usize, rank: usize| (rank == 1 && step % 2 == 1).then_some(0);
        let (_, _, params) = train(&base, false, n, stage, on, steps, one_rank);
        let (_, _, params_off) = train(&base, false, n, stage, off, steps, one_rank);
        let diff = max_abs_diff(&params, &params_off);
        assert!(
            diff <= 1e-6,
            "stage {stage}: a block skipped on one rank drifts by {diff}"
        );
    }
}

/// Trains `n` ranks for `steps` steps; at the steps in `split`, each rank gives the first of
/// its two rows to `accumulate` and steps on the second (loss / 2 each), unlike the steps the
/// reducer learned from. Returns rank 0's buckets started inside backward per optimizer call and
/// the final parameters.
fn train_with_split_steps(
    base: &Tower,
    stage: Stage,
    config: ShardConfig,
    n: usize,
    steps: usize,
    split: &[usize],
    skip_at_first_step: Option<usize>,
) -> (Vec<usize>, Vec<f32>) {
    let device = device(false);
    let runs = run_ranks(InProcessGroup::new(n).unwrap(), |comm| {
        let rank = comm.rank();
        let (mut model, mut optim) = init(base, &config, stage, comm, &device);
        let mut overlapped = Vec::new();
        for step in 0..steps {
            let rows = rank * ROWS..(rank + 1) * ROWS;
            let skip = skip_at_first_step.filter(|_| step == 0);
            if split.contains(&step) {
                let first = tokens(step, rows.start..rows.start + 1, &device);
                let loss = optim.scale_loss(model.loss(first, skip).div_scalar(2.0));
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                optim.accumulate(&model, grads).unwrap();
                overlapped.push(optim.report().overlapped_buckets());
                let second = tokens(step, rows.start + 1..rows.end, &device);
                let loss = optim.scale_loss(model.loss(second, skip).div_scalar(2.0));
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optim.step(1e-2, model, grads).unwrap();
            } else {
                let loss = optim.scale_loss(model.loss(tokens(step, rows, &device), skip));
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optim.step(1e-2, model, grads).unwrap();
            }
            overlapped.push(optim.report().overlapped_buckets());
        }
        (overlapped, params_of(&model))
    })
    .unwrap();
    runs.into_iter().next().unwrap()
}

#[test]
fn a_micro_batch_the_reducer_did_not_expect_trains_as_the_step_time_reduction() {
    let (base, _) = tower(false);
    for stage in STAGES {
        let on = ShardConfig::new(stage).with_bucket_numel(BUCKET_NUMEL);
        let off = on.clone().with_overlap_comm(false);
        // Step 2's first micro-batch is reduced inside backward (a step was expected) and kept,
        // reduced, until the step, whose own backward passes through (an accumulate came first).
        let (overlapped, params) = train_with_split_steps(&base, stage, on, 3, 4, &[2], None);
        let (_, params_off) = train_with_split_steps(&base, stage, off, 3, 4, &[2], None);
        assert!(overlapped[2] > 0, "stage {stage}: {overlapped:?}");
        assert_eq!(overlapped[3], 0, "stage {stage}: {overlapped:?}");
        let diff = max_abs_diff(&params, &params_off);
        assert!(
            diff <= 1e-6,
            "stage {stage}: drifts from the step-time reduction by {diff}"
        );
        // One rank, whole batch, one backward per step: the same training.
        let expected = reference(&base, false, 3, 4, None);
        let diff = max_abs_diff(&params, &expected);
        assert!(
            diff <= ONE_RANK_TOLERANCE,
            "stage {stage}: drifts from one rank by {diff}"
        );
    }
}

#[test]
fn micro_batch_sums_of_buckets_left_to_the_step_are_reduced_by_the_step() {
    // Block 1 is unused while the reducer learns (step 0, two micro-batches), so the buckets
    // holding its parameters stay with the step; later steps accumulate one micro-batch, whose
    // sums of those buckets must reach the step, not the buckets reduced inside backward.
    let (base, _) = tower(false);
    for stage in STAGES {
        let on = ShardConfig::new(stage).with_bucket_numel(BUCKET_NUMEL);
        let off = on.clone().with_overlap_comm(false);
        let split = [0, 1, 2, 3];
        let (overlapped, params) = train_with_split_steps(&base, stage, on, 2, 4, &split, Some(1));
        let (_, params_off) = train_with_split_steps(&base, stage, off, 2, 4, &split, Some(1));
        assert!(overlapped[3] > 0, "stage {stage}: {overlapped:?}");
        let diff = max_abs_diff(&params, &params_off);
        assert!(
            diff <= 1e-6,
            "stage {stage}: drifts from the step-time reduction by {diff}"
        );
    }
}

#[test]
fn half_precision_micro_batch_sums_reduced_inside_backward_equal_the_step_time_reduction() {
    // bf16/f16 parameters: `accumulate` keeps each micro-batch sum in f32 and, once learned,
    // hands it to the stepping backward's buckets (the seed path). The bucket adds it to the
    // backward's gradient once, in f32, and rounds to the parameters' dtype before the
    // reduction, as the step does: bitwise the same, whatever order the two parts of the
    // embedding's gradient (read twice) arrive in. f16 trains with a fixed loss scale.
    let (base, _) = tower(false);
    for dtype in [DType::BF16, DType::F16] {
        let base = cast(base.clone(), dtype);
        for stage in STAGES {
            let case = format!("{dtype:?} stage {stage}");
            let mut on = ShardConfig::new(stage).with_bucket_numel(BUCKET_NUMEL);
            if dtype == DType::F16 {
                on = on.with_loss_scaler(LossScaler::fixed(1024.0));
            }
            let off = on.clone().with_overlap_comm(false);
            let split = [0, 1, 2, 3];
            let (overlapped, params) = train_with_split_steps(&base, stage, on, 2, 4, &split, None);
            let (_, params_off) = train_with_split_steps(&base, stage, off, 2, 4, &split, None);
            // Per step: after `accumulate`, after `step`. The first step learns.
            assert_eq!(overlapped[..2], [0, 0], "{case}: {overlapped:?}");
            for step in 1..4 {
                assert_eq!(overlapped[2 * step], 0, "{case}: {overlapped:?}");
                assert!(overlapped[2 * step + 1] > 0, "{case}: {overlapped:?}");
            }
            let moved = params_of(&base).iter().zip(&params).filter(|(a, b)| a != b).count();
            assert!(moved > params.len() / 2, "{case}: {moved} of {} moved", params.len());
            let differ = params.iter().zip(&params_off).filter(|(a, b)| a != b).count();
            let diff = max_abs_diff(&params, &params_off);
            assert_eq!(differ, 0, "{case}: {differ} parameters differ, by up to {diff}");
        }
    }
}

#[test]
fn micro_batches_given_to_accumulate_send_nothing_and_the_last_one_reduces_inside_backward() {
    let (base, device) = tower(false);
    let n = 2;
    let k = 3;
    let steps = 3;
    for stage in STAGES {
        let runs = run_ranks(InProcessGroup::new(n).unwrap(), |comm| {
            let rank = comm.rank();
            let (mut model, mut optim) = ShardConfig::new(stage)
                .with_bucket_numel(BUCKET_NUMEL)
                .init(base.clone().fork(&device), AdamConfig::new(), comm)
                .unwrap();
            let buckets = optim.report().layout().buckets().len();
            for step in 0..steps {
                for m in 0..k {
                    // Micro-batch m of this rank's share: one row, loss / k.
                    let row = rank * k + m;
                    let idx = tokens(step, row..row + 1, &device);
                    let loss = model.loss(idx, None).div_scalar(k as f32);
                    let before = optim.comm().stats();
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
                    if m + 1 < k {
                        optim.accumulate(&model, grads).unwrap();
                        let sent = optim.comm().stats().since(&before).total_bytes_sent();
                        assert_eq!(sent, 0, "stage {stage}, step {step}, micro-batch {m}");
                        assert_eq!(optim.report().overlapped_buckets(), 0, "stage {stage}, step {step}");
                        if m + 2 == k {
                            // Pending sums (handed to the next backward's buckets from step 2
                            // on) are state a checkpoint does not hold.
                            let dir = scratch("overlap", &format!("pending-{stage}-{step}")).join("ckpt");
                            let refused = optim.save_checkpoint(&model, &dir, serde_json::Value::Null);
                            let refused = refused.expect_err("refused").to_string();
                            assert!(refused.contains("accumulate"), "stage {stage}: {refused}");
                        }
                    } else {
                        model = optim.step(1e-2, model, grads).unwrap();
                        let expected = if step == 0 { 0 } else { buckets };
                        assert_eq!(
                            optim.report().overlapped_buckets(),
                            expected,
                            "stage {stage}, step {step}"
                        );
                    }
                }
            }
            params_of(&model)
        })
        .unwrap();
        // One rank, one backward per step on the global batch of n·k rows.
        let comm = InProcessGroup::new(1).unwrap().into_comms().pop().unwrap();
        let (mut model, mut optim) = ShardConfig::new(Stage::Zero)
            .init(base.clone().fork(&device), AdamConfig::new(), comm)
            .unwrap();
        for step in 0..steps {
            let idx = tokens(step, 0..n * k, &device);
            let loss = model.loss(idx, None);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-2, model, grads).unwrap();
        }
        let diff = max_abs_diff(&runs[0], &params_of(&model));
        assert!(
            diff <= ONE_RANK_TOLERANCE,
            "stage {stage}: accumulation drifts from one rank by {diff}"
        );
    }
}

#[test]
fn a_dropped_backward_is_discarded_and_a_second_init_is_refused_on_every_rank() {
    let (base, device) = tower(false);
    for stage in STAGES {
        let run = |overlap_comm: bool| {
            run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
                let rank = comm.rank();
                let config = ShardConfig::new(stage)
                    .with_bucket_numel(BUCKET_NUMEL)
                    .with_overlap_comm(overlap_comm);
                let (mut model, mut optim) = config
                    .init(base.clone().fork(&device), AdamConfig::new(), comm)
                    .unwrap();
                for step in 0..4 {
                    let rows = rank * ROWS..(rank + 1) * ROWS;
                    if step == 2 {
                        // A backward whose gradients are not stepped with (a skipped NaN loss).
                        let dropped = model.loss(tokens(step + 10, rows.clone(), &device), None).backward();
                        drop(dropped);
                        optim.discard_gradients().unwrap();
                    }
                    let loss = model.loss(tokens(step, rows, &device), None);
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
                    model = optim.step(1e-2, model, grads).unwrap();
                }
                (params_of(&model), optim.comm().rank(), model)
            })
            .unwrap()
        };
        let on = run(true);
        let off = run(false);
        let diff = max_abs_diff(&on[0].0, &off[0].0);
        assert!(diff <= 1e-6, "stage {stage}: the dropped backward left {diff}");
        // The returned model carries this optimizer's hooks: a second init names the fix.
        let models: Vec<Tower> = on.into_iter().map(|(_, _, model)| model).collect();
        let errors = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
            let model = models[comm.rank()].clone();
            ShardConfig::new(stage)
                .init(model, AdamConfig::new(), comm)
                .err()
                .map(|e| e.to_string())
        })
        .unwrap();
        for error in errors {
            let error = error.expect("refused");
            assert!(error.contains("earlier ShardConfig::init"), "stage {stage}: {error}");
        }
    }
}

/// Trains `steps` steps on `n` ranks with `micro(step)` micro-batches per step (each rank's
/// `ROWS` rows split among them; the first ones given to `accumulate`), the body frozen at
/// `frozen(step)`. Returns rank 0's calls per step and the final parameters.
fn train_changing(
    base: &Tower,
    stage: Stage,
    config: ShardConfig,
    n: usize,
    steps: usize,
    micro: impl Fn(usize) -> usize + Sync,
    frozen: impl Fn(usize) -> bool + Sync,
) -> (Vec<StepCalls>, usize, Vec<f32>) {
    let device = device(false);
    let runs = run_ranks(InProcessGroup::new(n).unwrap(), |comm| {
        let rank = comm.rank();
        let (mut model, mut optim) = init(base, &config, stage, comm, &device);
        let mut calls = Vec::new();
        for step in 0..steps {
            let k = micro(step);
            let before = optim.comm().stats();
            // `ROWS · 3` rows per rank per step, split evenly into `k` micro-batches.
            let rows = ROWS * 3;
            for m in 0..k {
                let start = rank * rows + m * rows / k;
                let end = rank * rows + (m + 1) * rows / k;
                let loss = model.loss_with(tokens(step, start..end, &device), None, frozen(step));
                let loss = loss.mul_scalar((end - start) as f32 / rows as f32);
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                if m + 1 < k {
                    optim.accumulate(&model, grads).unwrap();
                } else {
                    model = optim.step(1e-2, model, grads).unwrap();
                }
            }
            calls.push(StepCalls {
                overlapped: optim.report().overlapped_buckets(),
                reductions: reductions(&optim.comm().stats().since(&before)),
            });
        }
        (calls, optim.report().layout().buckets().len(), params_of(&model))
    })
    .unwrap();
    runs.into_iter().next().unwrap()
}

/// When the backward changes after the first step, the reducer learns again within two steps:
/// from then on every bucket is reduced inside backward and a step sends the bytes of one
/// reduction (the reported cases: micro-batches changed from 2 to 3 after the first step sent
/// 1.49x a step's bytes with nothing overlapped for the rest of the run; a first step that
/// trained only the head left overlap at 0 forever). Results equal the step-time reduction's.
#[test]
fn the_bucket_reducer_learns_again_when_the_backward_changes() {
    let (base, _) = tower(false);
    let steps = 5;
    type Case = (&'static str, fn(usize) -> usize, fn(usize) -> bool);
    let cases: [Case; 2] = [
        (
            "2 micro-batches, then 3",
            |step| if step == 0 { 2 } else { 3 },
            |_| false,
        ),
        ("the body frozen at the first step", |_| 1, |step| step == 0),
    ];
    for stage in STAGES {
        for n in [2, 4] {
            let on = ShardConfig::new(stage).with_bucket_numel(BUCKET_NUMEL);
            let off = on.clone().with_overlap_comm(false);
            // The learning step of an unchanging run: every bucket reduced once, in the step, and
            // the step's flags: what one step must send.
            let (plain, _, _) = train_changing(&base, stage, on.clone(), n, 1, |_| 1, |_| false);
            let one_reduction = plain[0].reductions;
            for (name, micro, frozen) in cases {
                let ctx = format!("{name}, stage {stage}, N={n}");
                let (calls, buckets, params) = train_changing(&base, stage, on.clone(), n, steps, micro, frozen);
                let (_, _, params_off) = train_changing(&base, stage, off.clone(), n, steps, micro, frozen);
                for (step, call) in calls.iter().enumerate().skip(3) {
                    assert_eq!(
                        call.overlapped, buckets,
                        "{ctx}, step {step}: every bucket inside backward: {calls:?}"
                    );
                    assert_eq!(
                        call.reductions, one_reduction,
                        "{ctx}, step {step}: the calls and bytes of one reduction: {calls:?}"
                    );
                }
                let diff = max_abs_diff(&params, &params_off);
                assert!(diff <= 1e-6, "{ctx}: drifts from the step-time reduction by {diff}");
            }
        }
    }
}
