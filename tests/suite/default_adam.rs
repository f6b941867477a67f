//! The path README and every example take, Burn's `AdamWConfig`/`AdamConfig` passed to
//! `ShardConfig::init` (the fused Adam step), against single-device Burn training with
//! `config.init()` over 110 steps of a conv net and a transformer: bitwise at world size 1 and
//! every stage; at world sizes 2 and 4 bitwise Burn's built optimizer on the same shards, and
//! within 1e-2 of one device (the gradient is summed over the ranks in another order than one
//! device sums it over the batch, and 110 Adam steps amplify the last bits).

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{GroupNorm, GroupNormConfig, Linear, LinearConfig, PaddingConfig2d, Relu};
use burn::optim::{AdamConfig, AdamWConfig, GradientsParams};
use burn::prelude::*;
use burn_shard::{IntoOptimizer, ShardConfig, Stage};
use burn_shard_comm::{Collective, InProcessGroup, run_ranks};

use crate::common::{Rng, max_abs_diff, params_of, rank_rows, sharded_step};

/// Steps of each run: past the 22 after which the earlier fused order was 1e-3 away.
const STEPS: usize = 110;
/// Global batch: divides by world sizes 1, 2 and 4.
const BATCH: usize = 64;
const LR: f64 = 1e-3;
/// Against one device at world sizes 2 and 4 after 110 steps. Measured: 1e-7 to 4e-4 for the
/// losses, 1e-7 to 2.1e-3 for the parameters, depending on the initial values (a lazy
/// parameter draws from the device's RNG when first read, which tests running beside this one
/// also draw from); Burn's built optimizer drifts exactly as much (asserted bitwise).
const TOLERANCE: f32 = 1e-2;

/// The conv net: `[b, 1, 8, 8]` images → Conv2d 1→16 → GroupNorm(4) → ReLU → Conv2d
/// 16→32 → ReLU → Linear 2048→10 logits.
#[derive(Module, Debug)]
struct SmallCnn {
    conv1: Conv2d,
    norm: GroupNorm,
    conv2: Conv2d,
    act: Relu,
    head: Linear,
}

impl SmallCnn {
    fn new(device: &Device) -> Self {
        let conv = |i, o| {
            Conv2dConfig::new([i, o], [3, 3])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(device)
        };
        Self {
            conv1: conv(1, 16),
            norm: GroupNormConfig::new(4, 16).init(device),
            conv2: conv(16, 32),
            act: Relu::new(),
            head: LinearConfig::new(32 * 8 * 8, 10).init(device),
        }
    }

    fn loss(&self, images: Tensor<4>, labels: Tensor<1, Int>) -> Tensor<1> {
        let h = self.act.forward(self.norm.forward(self.conv1.forward(images)));
        let h = self.act.forward(self.conv2.forward(h));
        let logits = self.head.forward(h.flatten::<2>(1, 3));
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, labels)
    }
}

/// Rows `[start, end)` of step `step`'s global batch: images `[n, 1, 8, 8]` and labels from a
/// fixed random linear teacher (so the loss can fall).
fn cnn_batch(step: usize, (start, end): (usize, usize), device: &Device) -> (Tensor<4>, Tensor<1, Int>) {
    let teacher = Rng::new(17).vec(64 * 10);
    let images = Rng::new(5000 + step as u64).vec(BATCH * 64);
    let labels: Vec<i64> = (0..BATCH)
        .map(|b| {
            let score = |c: usize| (0..64).map(|i| images[b * 64 + i] * teacher[i * 10 + c]).sum::<f32>();
            (0..10).max_by(|&a, &c| score(a).total_cmp(&score(c))).unwrap() as i64
        })
        .collect();
    let n = end - start;
    (
        Tensor::from_data(
            TensorData::new(images[start * 64..end * 64].to_vec(), [n, 1, 8, 8]),
            device,
        ),
        Tensor::from_data(TensorData::new(labels[start..end].to_vec(), [n]), device),
    )
}

/// One step's token ids and next-token targets, `[BATCH / 4, 16]` each, row-major.
type Windows = (Vec<i64>, Vec<i64>);

/// The GPT of the examples on tiny shakespeare windows.
fn gpt_parts() -> (burn_shard_examples::gpt::GptConfig, Vec<Windows>) {
    use burn_shard_examples::char_data::CharCorpus;
    let text = include_str!("../../examples/data/tinyshakespeare.txt");
    let corpus = CharCorpus::new(&text[..40_000]);
    let config = burn_shard_examples::gpt::GptConfig {
        vocab_size: corpus.vocab_size(),
        block_size: 16,
        n_embd: 32,
        n_head: 2,
        n_layer: 2,
    };
    // Windows picked by a fixed stream: `BATCH / 4` sequences per step (a transformer step
    // costs more than the conv net's).
    let mut rng = Rng::new(99);
    let batches = (0..STEPS)
        .map(|_| {
            let (mut x, mut y) = (Vec::new(), Vec::new());
            for _ in 0..BATCH / 4 {
                let at = ((rng.next_f32() + 1.0) / 2.0 * (corpus.train.len() - 17) as f32) as usize;
                x.extend(corpus.train[at..at + 16].iter().map(|&c| c as i64));
                y.extend(corpus.train[at + 1..at + 17].iter().map(|&c| c as i64));
            }
            (x, y)
        })
        .collect();
    (config, batches)
}

fn gpt_batch(
    batch: &(Vec<i64>, Vec<i64>),
    (start, end): (usize, usize),
    device: &Device,
) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let rows = |v: &Vec<i64>| {
        Tensor::from_data(
            TensorData::new(v[start * 16..end * 16].to_vec(), [end - start, 16]),
            device,
        )
    };
    (rows(&batch.0), rows(&batch.1))
}

/// Single-device Burn: `config.init()` over every step's whole batch; the losses and final
/// parameters.
fn reference<M, F>(model: M, mut optim: burn::optim::ModuleOptimizer, loss: F) -> (Vec<f32>, Vec<f32>)
where
    M: Module,
    F: Fn(&M, usize) -> Tensor<1>,
{
    let mut model = model;
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let l = loss(&model, step);
        losses.push(l.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(l.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    (losses, params_of(&model))
}

/// The same steps sharded: each rank's loss is over its equal share of the batch.
fn sharded<M, O, F>(model: &M, optim: O, world_size: usize, stage: Stage, loss: F) -> (Vec<f32>, Vec<f32>)
where
    M: Module + Send + Sync,
    O: IntoOptimizer + Clone + Send + Sync,
    F: Fn(&M, usize, (usize, usize)) -> Tensor<1> + Sync,
{
    let runs = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
        let rows = (comm.rank(), comm.world_size());
        let device = Device::flex().autodiff();
        let (mut model, mut optim) = ShardConfig::new(stage)
            .init(model.clone().fork(&device), optim.clone(), comm)
            .expect("init");
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let l = loss(&model, step, rank_rows(rows.0, rows.1, BATCH));
            let (next, global) = sharded_step(&mut optim, model, l, LR);
            model = next;
            losses.push(global);
        }
        (losses, params_of(&model.materialize()))
    })
    .expect("no rank panics");
    runs.into_iter().next().unwrap()
}

/// `a` and `b` are the same numbers (`==` per element: bit for bit but for the sign of a zero).
fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
}

/// The sweep for one model: world size 1 at every stage bitwise single-device Burn; world sizes
/// 2 and 4 at stages 1 and 3 bitwise the same run with Burn's built optimizer (`built`, which
/// steps the same shards with Burn's own code), and within `tolerance` of single-device Burn
/// (losses relative, parameters absolute: the ranks' gradients are summed in another order than
/// one device sums the batch, and Adam amplifies the last bits of small gradients over 110
/// steps). Prints the largest differences.
fn check<M, O, B, F>(
    name: &str,
    model: &M,
    (optim, built): (O, B),
    reference: &(Vec<f32>, Vec<f32>),
    tolerance: f32,
    loss: F,
) where
    M: Module + Send + Sync,
    O: IntoOptimizer + Clone + Send + Sync,
    B: IntoOptimizer + Clone + Send + Sync,
    F: Fn(&M, usize, (usize, usize)) -> Tensor<1> + Sync,
{
    let (ref_losses, ref_params) = reference;
    assert!(
        ref_losses[STEPS - 1] < ref_losses[0],
        "{name}: the reference must learn"
    );
    for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
        let (losses, params) = sharded(model, optim.clone(), 1, stage, &loss);
        assert!(
            same(&losses, ref_losses),
            "{name}, world size 1, stage {stage}: losses are not Burn's"
        );
        assert!(
            same(&params, ref_params),
            "{name}, world size 1, stage {stage}: parameters are not Burn's (max diff {:e})",
            max_abs_diff(&params, ref_params)
        );
    }
    for world_size in [2, 4] {
        for stage in [Stage::One, Stage::Three] {
            let at = format!("{name}, world size {world_size}, stage {stage}");
            let (losses, params) = sharded(model, optim.clone(), world_size, stage, &loss);
            let (built_losses, built_params) = sharded(model, built.clone(), world_size, stage, &loss);
            assert!(
                same(&losses, &built_losses) && same(&params, &built_params),
                "{at}: the default path is not Burn's built optimizer on the same shards (max diff {:e})",
                max_abs_diff(&params, &built_params)
            );
            let rel = losses
                .iter()
                .zip(ref_losses)
                .map(|(a, b)| (a - b).abs() / b.abs().max(1e-12))
                .fold(0.0, f32::max);
            let diff = max_abs_diff(&params, ref_params);
            eprintln!("{at}: against one device, losses rel {rel:e}, params abs {diff:e}");
            assert!(rel <= tolerance, "{at}: losses rel {rel:e}");
            assert!(diff <= tolerance, "{at}: params {diff:e}");
        }
    }
}

#[test]
fn default_adamw_is_burn_adamw_on_a_conv_net() {
    let device = Device::flex().autodiff();
    device.seed(11);
    let model = SmallCnn::new(&device);
    let cfg = AdamWConfig::new().with_weight_decay(0.01);
    let reference = reference(model.clone(), cfg.init(), |m, step| {
        let (x, y) = cnn_batch(step, (0, BATCH), &device);
        m.loss(x, y)
    });
    // The default path is the fused CPU step (not a fallback to Burn's own AdamW).
    let paths = crate::equivalence::step_paths(&device, &crate::common::TinyMlp::new(&device), cfg.clone(), Stage::One);
    assert_eq!(paths, [burn_shard_kernels::StepPath::FusedCpu; 2]);
    let built = cfg.build();
    check(
        "conv net, AdamWConfig",
        &model,
        (cfg, built),
        &reference,
        TOLERANCE,
        |m, step, rows| {
            let (x, y) = cnn_batch(step, rows, &Device::flex().autodiff());
            m.loss(x, y)
        },
    );
}

#[test]
fn default_adam_is_burn_adam_on_a_transformer() {
    use burn_shard_examples::gpt::Gpt;
    let device = Device::flex().autodiff();
    device.seed(12);
    let (config, batches) = gpt_parts();
    let model = Gpt::new(&config, &device);
    let sequences = BATCH / 4;
    for (name, cfg) in [
        (
            "GPT, AdamWConfig",
            Either::AdamW(AdamWConfig::new().with_weight_decay(0.1).with_epsilon(1e-8)),
        ),
        (
            "GPT, AdamConfig with L2",
            Either::Adam(AdamConfig::new().with_weight_decay(Some(burn::optim::decay::WeightDecayConfig::new(0.01)))),
        ),
    ] {
        let reference = reference(model.clone(), cfg.init(), |m, step| {
            let (x, y) = gpt_batch(&batches[step], (0, sequences), &device);
            m.loss(x, y)
        });
        let loss = |m: &Gpt, step: usize, (start, end): (usize, usize)| {
            // `rows` count images of the conv net's batch; a step here has a quarter as many
            // sequences.
            let (x, y) = gpt_batch(&batches[step], (start / 4, end / 4), &Device::flex().autodiff());
            m.loss(x, y)
        };
        match cfg {
            Either::AdamW(c) => check(name, &model, (c.clone(), c.build()), &reference, TOLERANCE, loss),
            Either::Adam(c) => check(name, &model, (c.clone(), c.build()), &reference, TOLERANCE, loss),
        }
    }
}

/// One of Burn's two Adam configs, so one loop covers both.
enum Either {
    AdamW(AdamWConfig),
    Adam(AdamConfig),
}

impl Either {
    fn init(&self) -> burn::optim::ModuleOptimizer {
        match self {
            Either::AdamW(c) => c.init(),
            Either::Adam(c) => c.init(),
        }
    }
}
