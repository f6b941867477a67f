//! How stage 3 schedules its collectives: one grouped all-gather and one grouped
//! reduce-scatter per unit once the schedule is learned (two forwards per step, several
//! backwards before a step, a backward that changes, units named by path), grouped collectives
//! of two dtypes bit for bit, a parameter left out of the gradients, and the example GPT.

use burn::module::{Module, Param};
use burn::nn::transformer::{TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::prelude::*;
use burn::tensor::DType;
use burn::tensor::activation::relu;
use burn_shard::fsdp::unit;
use burn_shard::{ShardConfig, Stage};
use burn_shard_comm::{Collective, CollectiveKind, InProcessGroup, run_ranks};
use burn_shard_examples::gpt::{Gpt, GptConfig};

use crate::common::{Rng, max_abs_diff, params_of};
use crate::stage3::*;

/// Per-step `(all-gather calls, bytes, reduce-scatter calls, bytes, parameters with a gradient
/// after backward)` of rank 0 training `Net3::new(vocab, width)` at stage 3.
fn collectives_per_step(
    (vocab, width): (usize, usize),
    n: usize,
    reshard: bool,
    steps: usize,
) -> Vec<(u64, u64, u64, u64, usize)> {
    collectives_per_step_of(
        &Net3::new(vocab, width, &Device::flex().autodiff()),
        n,
        reshard,
        steps,
        1,
    )
    .0
}

/// [`collectives_per_step`] of `base` with `forwards` forward passes per step (their losses
/// summed, one backward): rank 0's (all-gather calls, bytes, reduce-scatter calls, bytes,
/// gradients) per step, and its full parameters after the last step.
#[allow(clippy::type_complexity)]
fn collectives_per_step_of(
    base: &Net3,
    n: usize,
    reshard: bool,
    steps: usize,
    forwards: usize,
) -> (Vec<(u64, u64, u64, u64, usize)>, Vec<f32>) {
    let vocab = base.embed.dims()[0];
    let runs = run_ranks(InProcessGroup::new(n).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let config = ShardConfig::new(Stage::Three).with_reshard_after_forward(reshard);
        let (mut model, mut optim) = config
            .init(base.clone().fork(&device), AdamConfig::new().build(), comm)
            .unwrap();
        let mut per_step = Vec::new();
        for _ in 0..steps {
            let before = optim.comm().stats();
            let l = (0..forwards)
                .map(|f| {
                    let x = Tensor::<2>::ones([3, vocab], &device)
                        .mul_scalar(1.0 + f as f32)
                        .require_grad();
                    model.forward(x).powi_scalar(2).mean()
                })
                .reduce(|a, b| a + b)
                .expect("at least one forward");
            let grads = GradientsParams::from_grads(l.backward(), &model);
            let with_grad = grads.len();
            model = optim.step(1e-3, model, grads).unwrap();
            let st = optim.comm().stats().since(&before);
            let (ag, rs) = (st.get(CollectiveKind::AllGather), st.get(CollectiveKind::ReduceScatter));
            per_step.push((ag.calls, ag.bytes_sent, rs.calls, rs.bytes_sent, with_grad));
        }
        (per_step, params_of(&model.materialize()))
    })
    .unwrap();
    runs.into_iter().next().unwrap()
}

/// Two forwards per step (two losses summed, as a contrastive pair) gather each pass grouped
/// as the first: from the second step on, forward's all-gathers are twice one forward's, one per
/// unit per pass (the reported case: 8 all-gathers per step where 6 were due, the second pass
/// gathering each parameter alone). Parameters equal stage 0's with the same two forwards.
#[test]
fn stage3_two_forwards_per_step_are_each_gathered_per_unit() {
    let base = Net3::new(8, 12, &Device::flex().autodiff());
    for n in [2usize, 3] {
        // Without resharding nothing is re-gathered in backward: the all-gathers are forward's.
        let (one, _) = collectives_per_step_of(&base, n, false, 3, 1);
        let (two, params) = collectives_per_step_of(&base, n, false, 3, 2);
        for step in 1..3 {
            assert_eq!(
                two[step].0,
                2 * one[step].0,
                "N={n}, step {step}: all-gather calls: {two:?} vs {one:?}"
            );
            assert_eq!(two[step].1, 2 * one[step].1, "N={n}, step {step}: all-gather bytes");
        }
        let (with_reshard, resharded) = collectives_per_step_of(&base, n, true, 3, 2);
        assert_eq!(
            with_reshard[2].0, with_reshard[1].0,
            "N={n}: the same calls at every step from the second: {with_reshard:?}"
        );
        let reference = run_ranks(InProcessGroup::new(n).unwrap(), |comm| {
            let device = Device::flex().autodiff();
            let (mut model, mut optim) = ShardConfig::new(Stage::Zero)
                .init(base.clone().fork(&device), AdamConfig::new().build(), comm)
                .unwrap();
            for _ in 0..3 {
                let l = (0..2)
                    .map(|f| {
                        let x = Tensor::<2>::ones([3, 8], &device)
                            .mul_scalar(1.0 + f as f32)
                            .require_grad();
                        model.forward(x).powi_scalar(2).mean()
                    })
                    .reduce(|a, b| a + b)
                    .unwrap();
                let grads = GradientsParams::from_grads(l.backward(), &model);
                model = optim.step(1e-3, model, grads).unwrap();
            }
            params_of(&model)
        })
        .unwrap()
        .remove(0);
        for (name, p) in [("reshard", &resharded), ("no reshard", &params)] {
            let diff = max_abs_diff(p, &reference);
            assert!(
                diff <= 1e-5,
                "N={n}, {name}: two forwards at stage 3 drift from stage 0 by {diff}"
            );
        }
    }
}

#[test]
fn stage3_gathers_each_unit_with_one_collective_from_the_second_step() {
    // Net3 gathers, per step: forward, in units, the embedding (unit 0) and each block's weight
    // and bias (units 1-3), then outside any unit the frozen gain and the tied head. The first
    // step gathers each use alone and learns the units; from the second on each unit's
    // forward gathers are one collective moving the same bytes.
    for n in [2usize, 3] {
        for reshard in [true, false] {
            let per_step = collectives_per_step((8, 12), n, reshard, 3);
            let steps: Vec<(u64, u64)> = per_step.iter().map(|s| (s.0, s.1)).collect();
            let (first_calls, first_bytes) = steps[0];
            let forward_alone = 1 + 3 * 2 + 2;
            let forward_grouped = 1 + 3 + 2;
            // Backward re-gathers what its consumers need (counted on the first step, alone or
            // in groups of one: Net3's units re-gather one weight each); none without resharding.
            let backward = first_calls - forward_alone;
            assert!(
                if reshard { backward > 0 } else { backward == 0 },
                "N={n} reshard={reshard}: {steps:?}"
            );
            for &(calls, bytes) in &steps[1..] {
                assert_eq!(
                    bytes, first_bytes,
                    "N={n} reshard={reshard}: grouping moves the same bytes: {steps:?}"
                );
                assert_eq!(
                    calls,
                    forward_grouped + backward,
                    "N={n} reshard={reshard}: one all-gather per unit in forward: {steps:?}"
                );
            }
        }
    }
}

#[test]
fn stage3_reduce_scatters_each_unit_with_one_collective_from_the_second_step() {
    // Net3's gradients per step: the embedding's twice (its use in unit 0 and the tied head
    // outside any unit), each block's weight and bias (units 1-3); the frozen gain has none and
    // the unused parameter is never gathered. The first step reduce-scatters each gradient
    // alone and learns the units; from the second on each unit's gradients are one
    // reduce-scatter and the head's is one of its own. Width 10 pads the chunks at N=3 and 4:
    // the ring sends (N-1) padded chunks of each gradient, grouped or not. Every trainable
    // parameter's gradient is in what `backward` returns, the last unit's included.
    let (vocab, width) = (6usize, 10usize);
    for n in [2usize, 3, 4] {
        for reshard in [true, false] {
            let ring = |numel: usize| ((n - 1) * numel.div_ceil(n) * 4) as u64;
            let theory = 2 * ring(vocab * width) + 3 * (ring(width * width) + ring(width));
            let per_step = collectives_per_step((vocab, width), n, reshard, 3);
            for (step, &(_, _, calls, bytes, with_grad)) in per_step.iter().enumerate() {
                let expected_calls = if step == 0 { 2 + 3 * 2 } else { 1 + 3 + 1 };
                assert_eq!(
                    calls, expected_calls,
                    "N={n} reshard={reshard} step {step}: {per_step:?}"
                );
                assert_eq!(bytes, theory, "N={n} reshard={reshard} step {step}: bytes of the ring");
                assert_eq!(
                    with_grad,
                    1 + 3 * 2,
                    "N={n} reshard={reshard} step {step}: gradients after backward"
                );
            }
        }
    }
}

#[test]
fn stage3_parameter_left_out_of_the_gradients_is_not_stepped() {
    // Burn's way to freeze a parameter for a step: leave its gradient out. The embedding is in
    // the last unit of backward, whose reduce-scatter is the last to finish.
    let device = Device::flex().autodiff();
    let base = Net3::new(VOCAB, WIDTH, &device);
    let embed_before = base.embed.val().into_data();
    for n in [2usize, 3] {
        let runs = run_ranks(InProcessGroup::new(n).unwrap(), |comm| {
            let device = Device::flex().autodiff();
            let (mut model, mut optim) = ShardConfig::new(Stage::Three)
                .init(base.clone().fork(&device), AdamConfig::new().build(), comm)
                .unwrap();
            for _ in 0..3 {
                let x = Tensor::<2>::ones([3, VOCAB], &device).require_grad();
                let l = model.forward(x).powi_scalar(2).mean();
                let mut grads = GradientsParams::from_grads(l.backward(), &model);
                assert!(
                    grads.remove::<2>(model.embed.id).is_some(),
                    "the embedding has a gradient"
                );
                model = optim.step(1e-2, model, grads).unwrap();
            }
            let full = model.clone().materialize();
            (full.embed.val().into_data(), full.blocks[0].weight.val().into_data())
        })
        .unwrap();
        for (rank, (embed, block)) in runs.into_iter().enumerate() {
            assert_eq!(embed, embed_before, "N={n} rank {rank}: the embedding was stepped");
            assert_ne!(
                block,
                base.blocks[0].weight.val().into_data(),
                "N={n} rank {rank}: the blocks train"
            );
        }
    }
}

/// What rank 0's all-gathers did in one step: calls in forward, calls in backward and the
/// optimizer step, and bytes sent in the whole step.
#[derive(Clone, Copy, Debug, PartialEq)]
struct StepGathers {
    forward_calls: u64,
    backward_calls: u64,
    bytes: u64,
}

/// Per-step all-gathers of rank 0 training the examples' GPT at `stage`, on an autodiff device
/// with or without Burn's balanced gradient checkpointing (the examples use it at stage 3:
/// backward then also recomputes activations, which re-gathers the weights they need). Also
/// returns rank 0's parameters after the last step.
fn gpt_gathers_per_step(
    base: &Gpt,
    n: usize,
    stage: Stage,
    checkpointing: bool,
    steps: usize,
) -> (Vec<StepGathers>, Vec<f32>) {
    let device_of = || gpt_device(checkpointing);
    let runs = run_ranks(InProcessGroup::new(n).unwrap(), |comm| {
        let device = device_of();
        let (mut model, mut optim) = ShardConfig::new(stage)
            .init(base.clone().fork(&device), AdamConfig::new().build(), comm)
            .unwrap();
        let mut per_step = Vec::new();
        for step in 0..steps {
            let ids: Vec<i64> = (0..16).map(|i| ((i * 7 + step * 3) % 11) as i64).collect();
            let idx = Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [2, 8]), &device);
            let targets = Tensor::<2, Int>::from_data(TensorData::new(ids, [2, 8]), &device);
            let before = optim.comm().stats();
            let l = model.loss(idx, targets);
            let after_forward = optim.comm().stats();
            let grads = GradientsParams::from_grads(l.backward(), &model);
            model = optim.step(1e-3, model, grads).unwrap();
            let end = optim.comm().stats();
            per_step.push(StepGathers {
                forward_calls: after_forward.since(&before).get(CollectiveKind::AllGather).calls,
                backward_calls: end.since(&after_forward).get(CollectiveKind::AllGather).calls,
                bytes: end.since(&before).get(CollectiveKind::AllGather).bytes_sent,
            });
        }
        // Unsharding is a collective at stage 3: every rank does it.
        (per_step, params_of(&model.clone().materialize()))
    })
    .unwrap();
    runs.into_iter().next().unwrap()
}

fn gpt_device(checkpointing: bool) -> Device {
    match checkpointing {
        true => Device::flex().autodiff().gradient_checkpointing(),
        false => Device::flex().autodiff(),
    }
}

#[test]
fn stage3_gathers_the_example_gpt_once_per_unit_in_forward_and_backward_and_trains_as_stage_0() {
    for n in [2usize, 3] {
        for checkpointing in [false, true] {
            let config = GptConfig {
                vocab_size: 11,
                block_size: 8,
                n_embd: 16,
                n_head: 2,
                n_layer: 3,
            };
            let base = Gpt::new(&config, &gpt_device(checkpointing));
            let (steps, params) = gpt_gathers_per_step(&base, n, Stage::Three, checkpointing, 3);
            let (_, reference) = gpt_gathers_per_step(&base, n, Stage::Zero, checkpointing, 3);
            let diff = max_abs_diff(&params, &reference);
            assert!(
                diff <= 1e-5,
                "N={n} checkpointing={checkpointing}: stage 3 with grouped gathers drifts from stage 0 by {diff}"
            );
            // From the second step: one all-gather per unit (the blocks and the final norm and
            // head) in forward, the two embeddings alone (outside units), and in backward at most
            // one per unit. With Burn's checkpointing that needs each unit's output kept as a
            // checkpoint (`fsdp::unit`): recomputing the residual stream across units would
            // re-gather earlier units' biases and norms out of order, each alone (46 calls here).
            let units = config.n_layer as u64 + 1;
            let first = steps[0];
            for step in &steps[1..] {
                let case = format!("N={n} checkpointing={checkpointing}: {steps:?}");
                assert_eq!(step.bytes, first.bytes, "{case}");
                assert_eq!(step.forward_calls, units + 2, "{case}");
                match checkpointing {
                    // Every unit's re-gather is one group fetch.
                    true => assert_eq!(step.backward_calls, units, "{case}"),
                    // Weights reshaped by `Linear` are kept, not re-gathered.
                    false => assert!((1..=units).contains(&step.backward_calls), "{case}"),
                }
            }
        }
    }
}

/// A block with parameters of two dtypes: `w` (`f32`, `[width, width]`), `b` (`f32`, `[width]`)
/// and a `bf16` gain `g` (`[width]`, cast to `f32` where it is used).
#[derive(Module, Debug)]
pub struct MixedBlock {
    w: Param<Tensor<2>>,
    b: Param<Tensor<1>>,
    g: Param<Tensor<1>>,
}

#[derive(Module, Debug)]
pub struct MixedNet {
    blocks: Vec<MixedBlock>,
}

impl MixedNet {
    fn new(width: usize, device: &Device) -> Self {
        let mut rng = Rng::new(5);
        let mut tensor = |shape: Vec<usize>, scale: f32| {
            let numel = shape.iter().product();
            Tensor::<1>::from_data(TensorData::new(rng.vec(numel), [numel]), device).mul_scalar(scale)
        };
        let blocks = (0..2)
            .map(|_| MixedBlock {
                w: Param::from_tensor(tensor(vec![width, width], 0.3).reshape([width, width]).require_grad()),
                b: Param::from_tensor(tensor(vec![width], 0.1).require_grad()),
                g: Param::from_tensor(
                    tensor(vec![width], 0.5)
                        .add_scalar(1.0)
                        .cast(DType::BF16)
                        .require_grad(),
                ),
            })
            .collect();
        Self { blocks }
    }

    /// `x`: `[batch, width]` -> `[batch, width]`; each block a unit when `units`.
    fn forward(&self, x: Tensor<2>, units: bool) -> Tensor<2> {
        let mut h = x;
        for block in &self.blocks {
            let run = |h: Tensor<2>| {
                let gain = block.g.val().cast(DType::F32).unsqueeze::<2>();
                relu(h.matmul(block.w.val()) + block.b.val().unsqueeze::<2>()) * gain
            };
            h = match units {
                true => unit(&h, || run(h.clone())),
                false => run(h),
            };
        }
        h
    }
}

#[test]
fn stage3_grouped_reduce_scatters_of_two_dtypes_give_the_bits_of_reducing_each_gradient_alone() {
    // Each unit holds f32 and bf16 gradients: one reduce-scatter per dtype and unit from the
    // second step on (without units: one per gradient). Width 10 pads the chunks at N=3 and 4.
    // The in-process ring sums each chunk in the same rank order however chunks are grouped, so
    // the parameters after three steps are bitwise those of reducing each gradient alone.
    let width = 10;
    let device = Device::flex().autodiff();
    let base = MixedNet::new(width, &device);
    for n in [2usize, 3, 4] {
        let train = |units: bool| {
            calls_and_params(&base, n, Stage::Three, 3, |model, step, rank, device| {
                let x = Tensor::<2>::ones([2, width], device).mul_scalar((1 + rank + step) as f32 * 0.1);
                GradientsParams::from_grads(model.forward(x, units).powi_scalar(2).mean().backward(), model)
            })
        };
        let (grouped_calls, grouped) = train(true);
        let (alone_calls, alone) = train(false);
        assert_eq!(
            alone_calls,
            [6, 6, 6],
            "N={n}: one reduce-scatter per gradient without units"
        );
        assert_eq!(
            grouped_calls,
            [6, 2 * 2, 2 * 2],
            "N={n}: one per dtype and unit from step 2"
        );
        assert_eq!(grouped, alone, "N={n}: grouping changed the bits of the result");
        let start = params_of(&base);
        assert!(max_abs_diff(&grouped, &start) > 1e-3, "N={n}: the model trained");
    }
}

#[test]
fn stage3_several_backwards_before_a_step_keep_each_backward_to_itself() {
    // Each step back-propagates twice (a GAN's generator loss through a sharded discriminator,
    // say) and steps on the second backward's gradients only: the result must equal stepping on
    // one backward per step, bitwise, at N=2 and 3. Learning from two backwards must not make
    // the first backward's last unit end up in the second's gradients.
    let device = Device::flex().autodiff();
    let base = Net3::new(VOCAB, WIDTH, &device);
    for n in [2usize, 3] {
        let train = |backwards: usize| {
            let (_, params) = calls_and_params(&base, n, Stage::Three, 4, |model, step, _, device| {
                let mut grads = None;
                for b in 0..backwards {
                    let scale = if b + 1 == backwards { 1.0 } else { 5.0 };
                    let x = Tensor::<2>::ones([3, VOCAB], device).mul_scalar(scale + step as f32 * 0.1);
                    let l = model.forward(x).powi_scalar(2).mean();
                    grads = Some(GradientsParams::from_grads(l.backward(), model));
                }
                grads.expect("at least one backward")
            });
            params
        };
        let once = train(1);
        let twice = train(2);
        assert_eq!(twice, once, "N={n}: the discarded backward leaked into the step");
    }
}

#[test]
fn stage3_learns_again_when_the_backward_changes() {
    // Step 3 skips block 1 on every rank: its backward has 6 gradients where 8 were learned, so
    // its last unit is finished by the step and the next step learns again (each gradient
    // alone), then groups. Parameters equal stage 0's with the same forwards.
    let device = Device::flex().autodiff();
    let base = Net3::new(VOCAB, WIDTH, &device);
    let skips = [None, None, Some(1), None, None];
    for n in [2usize, 3] {
        let train = |stage: Stage| {
            calls_and_params(&base, n, stage, skips.len(), |model, step, _, device| {
                let x = Tensor::<2>::ones([3, VOCAB], device).mul_scalar(1.0 + step as f32 * 0.1);
                let l = model.forward_skipping(x, skips[step]).powi_scalar(2).mean();
                GradientsParams::from_grads(l.backward(), model)
            })
        };
        let (calls, sharded) = train(Stage::Three);
        let (_, reference) = train(Stage::Zero);
        assert_eq!(calls, [8, 5, 4, 8, 5], "N={n}: reduce-scatters per step");
        let diff = max_abs_diff(&sharded, &reference);
        assert!(diff <= 1e-5, "N={n}: stage 3 drifts from stage 0 by {diff}");
    }
}

/// Trains `base` on `n` in-process ranks at `stage` with Adam (lr 1e-2), one step per element of
/// `steps`; rank `r`'s step `s` runs `backwards(&model, s, r, &device)` and steps on the
/// gradients it returns. Returns rank 0's reduce-scatter calls per step and its full parameters
/// after the last step.
fn calls_and_params<M: Module + Send + Sync>(
    base: &M,
    n: usize,
    stage: Stage,
    steps: usize,
    backwards: impl Fn(&M, usize, usize, &Device) -> GradientsParams + Sync,
) -> (Vec<u64>, Vec<f32>) {
    let runs = run_ranks(InProcessGroup::new(n).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let rank = comm.rank();
        let (mut model, mut optim) = ShardConfig::new(stage)
            .init(base.clone().fork(&device), AdamConfig::new().build(), comm)
            .unwrap();
        let mut calls = Vec::new();
        for step in 0..steps {
            let before = optim.comm().stats();
            let grads = backwards(&model, step, rank, &device);
            model = optim.step(1e-2, model, grads).unwrap();
            let reduce_scatters = optim.comm().stats().since(&before).get(CollectiveKind::ReduceScatter);
            calls.push(reduce_scatters.calls);
        }
        (calls, params_of(&model.clone().materialize()))
    })
    .unwrap();
    runs.into_iter().next().unwrap()
}

/// A stock `burn::nn::transformer::TransformerEncoder` (its layers' forward cannot be
/// annotated) with a linear head.
#[derive(Module, Debug)]
pub struct EncoderNet {
    encoder: TransformerEncoder,
    head: Linear,
}

impl EncoderNet {
    fn new(device: &Device) -> Self {
        Self {
            encoder: TransformerEncoderConfig::new(8, 16, 2, 3)
                .with_dropout(0.0)
                .init(device),
            head: LinearConfig::new(8, 3).init(device),
        }
    }

    /// As the user wrote it: no `fsdp::unit`.
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.head.forward(self.encoder.forward(TransformerEncoderInput::new(x)))
    }

    /// The same computation with every layer, and the head, in an `fsdp::unit` scope.
    fn forward_annotated(&self, x: Tensor<3>) -> Tensor<3> {
        let mut x = x;
        for layer in &self.encoder.layers {
            x = unit(&x, || layer.forward(x.clone(), None, None));
        }
        unit(&x, || self.head.forward(x.clone()))
    }
}

/// One step's `(all-gather calls, bytes, reduce-scatter calls, bytes)`.
type StepCollectives = (u64, u64, u64, u64);

/// Rank 0's per-step `(all-gather calls, bytes, reduce-scatter calls, bytes)` training
/// `base` at stage 3 with `config`, annotated or not, and its full parameters at the end.
fn encoder_collectives(
    base: &EncoderNet,
    n: usize,
    config: ShardConfig,
    annotated: bool,
    micro_batches: usize,
) -> (Vec<StepCollectives>, Vec<f32>) {
    let runs = run_ranks(InProcessGroup::new(n).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (mut model, mut optim) = config
            .init(base.clone().fork(&device), AdamConfig::new().build(), comm)
            .unwrap();
        let mut per_step = Vec::new();
        for step in 0..3 {
            let before = optim.comm().stats();
            for micro in 0..micro_batches {
                let values = Rng::new(40 + 10 * step + micro as u64).vec(2 * 4 * 8);
                let x = Tensor::<1>::from_data(TensorData::new(values, [64]), &device).reshape([2, 4, 8]);
                let out = match annotated {
                    true => model.forward_annotated(x),
                    false => model.forward(x),
                };
                let grads = GradientsParams::from_grads(out.powi_scalar(2).mean().backward(), &model);
                match micro + 1 == micro_batches {
                    true => model = optim.step(1e-3, model, grads).unwrap(),
                    false => optim.accumulate(&model, grads).unwrap(),
                }
            }
            let st = optim.comm().stats().since(&before);
            let (ag, rs) = (st.get(CollectiveKind::AllGather), st.get(CollectiveKind::ReduceScatter));
            per_step.push((ag.calls, ag.bytes_sent, rs.calls, rs.bytes_sent));
        }
        (per_step, params_of(&model.materialize()))
    })
    .unwrap();
    runs.into_iter().next().unwrap()
}

/// Units named by path (`ShardConfig::with_units`) on a model whose forward has no
/// `fsdp::unit`: from the second step, the same all-gathers and reduce-scatters (calls and
/// bytes) as the annotated model, far fewer than without units, and the same parameters.
#[test]
fn stage3_units_by_path_gather_and_reduce_as_annotated_units() {
    let base = EncoderNet::new(&Device::flex().autodiff());
    // With 2 micro-batches per step (gradient accumulation), each backward ends a pass.
    for (n, micro_batches) in [(2usize, 1), (3, 1), (2, 2)] {
        let plain = ShardConfig::new(Stage::Three);
        let by_path = plain.clone().with_units(["encoder.layers.*", "head"]);
        let (annotated, reference) = encoder_collectives(&base, n, plain.clone(), true, micro_batches);
        let (policy, params) = encoder_collectives(&base, n, by_path, false, micro_batches);
        let (none, _) = encoder_collectives(&base, n, plain, false, micro_batches);
        let case = format!(
            "N={n}, {micro_batches} micro-batches: annotated {annotated:?}, by path {policy:?}, no units {none:?}"
        );
        assert_eq!(policy[1..], annotated[1..], "{case}");
        // 3 layers and the head: 4 units, each one all-gather in forward.
        assert!(policy[1].0 < none[1].0 && policy[1].2 < none[1].2, "{case}");
        let diff = max_abs_diff(&params, &reference);
        assert!(diff <= 1e-5, "{case}: parameters differ by {diff}");
    }
    // A pattern that names nothing is refused at init, with the paths to choose from.
    let err = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        ShardConfig::new(Stage::Three)
            .with_units(["encoder.layer.*"])
            .init(base.clone(), AdamConfig::new().build(), comm)
            .err()
            .map(|e| e.to_string())
    })
    .unwrap();
    let message = err[0].as_deref().expect("refused");
    assert!(
        message.contains("`encoder.layer.*` matches no sharded parameter"),
        "{message}"
    );
    assert!(message.contains("e.g. `encoder.layers.0.mha.query`"), "{message}");
}
