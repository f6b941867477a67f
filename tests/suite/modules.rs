//! Every module of `burn::nn` that has parameters or buffers trains under every stage 0-3, at
//! world sizes 1-4, like unwrapped single-device Burn training: parameters within 1e-4 after
//! three AdamW steps, BatchNorm's running statistics equal to the documented buffer rule (the
//! mean over ranks of each rank's update), identical on every rank.
//!
//! The reference is one device computing the mean of the ranks' losses, each on its own part of
//! the global batch: for modules without cross-sample statistics that is the loss of the whole
//! batch; for BatchNorm, whose training forward normalises each rank's batch by its own
//! statistics (no SyncBatchNorm), it is what data-parallel training computes.

use burn::module::{Module, ModuleVisitor, Param, RunningState};
use burn::nn::attention::{
    CrossAttention, CrossAttentionConfig, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig,
};
use burn::nn::conv::{
    Conv1d, Conv1dConfig, Conv2d, Conv2dConfig, Conv3d, Conv3dConfig, ConvTranspose1d, ConvTranspose1dConfig,
    ConvTranspose2d, ConvTranspose2dConfig, ConvTranspose3d, ConvTranspose3dConfig, DeformConv2d, DeformConv2dConfig,
};
use burn::nn::transformer::{
    PositionWiseFeedForward, PositionWiseFeedForwardConfig, TransformerDecoder, TransformerDecoderConfig,
    TransformerDecoderInput, TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{
    BatchNorm, BatchNormConfig, BiGru, BiGruConfig, BiLstm, BiLstmConfig, BiRnn, BiRnnConfig, Embedding,
    EmbeddingConfig, GroupNorm, GroupNormConfig, Gru, GruConfig, InstanceNorm, InstanceNormConfig, LayerNorm,
    LayerNormConfig, Linear, LinearConfig, Lstm, LstmConfig, PRelu, PReluConfig, RmsNorm, RmsNormConfig, Rnn,
    RnnConfig, SwiGlu, SwiGluConfig,
};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::prelude::*;
use burn_shard::{Home, MasterWeightStep, NvmeOffload, ShardConfig, ShardedOptimizer, Stage};
use burn_shard_comm::{Collective, InProcessGroup, run_ranks};

use crate::common::{Rng, max_abs_diff, scratch, sharded_step};

/// Features per sample; every layer reads a sample as its own input shape.
const F: usize = 24;
/// Divisible by every world size 1-4.
const GLOBAL_BATCH: usize = 12;
const STEPS: usize = 3;
const LR: f64 = 1e-2;
/// BatchNorm's running mean and running variance.
type Stats = (Vec<f32>, Vec<f32>);

const STAGES: [Stage; 4] = [Stage::Zero, Stage::One, Stage::Two, Stage::Three];

/// One stock layer of each kind (dropout off: it would draw different masks on each rank).
/// The variants differ in size; a test builds a handful of them, so boxing buys nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Layer {
    Linear(Linear),
    Embedding(Embedding),
    Conv1d(Conv1d),
    Conv2d(Conv2d),
    Conv3d(Conv3d),
    ConvTranspose1d(ConvTranspose1d),
    ConvTranspose2d(ConvTranspose2d),
    ConvTranspose3d(ConvTranspose3d),
    DeformConv2d(DeformConv2d),
    LayerNorm(LayerNorm),
    RmsNorm(RmsNorm),
    GroupNorm(GroupNorm),
    InstanceNorm(InstanceNorm),
    BatchNorm(BatchNorm),
    MultiHeadAttention(MultiHeadAttention),
    CrossAttention(CrossAttention),
    TransformerEncoder(TransformerEncoder),
    TransformerDecoder(TransformerDecoder),
    PositionWiseFeedForward(PositionWiseFeedForward),
    Rnn(Rnn),
    BiRnn(BiRnn),
    Gru(Gru),
    BiGru(BiGru),
    Lstm(Lstm),
    BiLstm(BiLstm),
    PRelu(PRelu),
    SwiGlu(SwiGlu),
}

/// Every `burn::nn` module with parameters or buffers that the sweep covers, in the order of docs/training.md.
pub const MODULES: [&str; 27] = [
    "Linear",
    "Embedding",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "DeformConv2d",
    "LayerNorm",
    "RmsNorm",
    "GroupNorm",
    "InstanceNorm",
    "BatchNorm",
    "MultiHeadAttention",
    "CrossAttention",
    "TransformerEncoder",
    "TransformerDecoder",
    "PositionWiseFeedForward",
    "Rnn",
    "BiRnn",
    "Gru",
    "BiGru",
    "Lstm",
    "BiLstm",
    "PRelu",
    "SwiGlu",
];

impl Layer {
    pub(crate) fn new(name: &str, d: &Device) -> Self {
        match name {
            "Linear" => Layer::Linear(LinearConfig::new(F, 5).init(d)),
            "Embedding" => Layer::Embedding(EmbeddingConfig::new(7, 4).init(d)),
            "Conv1d" => Layer::Conv1d(Conv1dConfig::new(2, 3, 3).init(d)),
            "Conv2d" => Layer::Conv2d(Conv2dConfig::new([2, 3], [2, 2]).init(d)),
            "Conv3d" => Layer::Conv3d(Conv3dConfig::new([2, 2], [2, 2, 2]).init(d)),
            "ConvTranspose1d" => Layer::ConvTranspose1d(ConvTranspose1dConfig::new([2, 3], 3).init(d)),
            "ConvTranspose2d" => Layer::ConvTranspose2d(ConvTranspose2dConfig::new([2, 3], [2, 2]).init(d)),
            "ConvTranspose3d" => Layer::ConvTranspose3d(ConvTranspose3dConfig::new([2, 2], [2, 2, 2]).init(d)),
            "DeformConv2d" => Layer::DeformConv2d(DeformConv2dConfig::new([2, 3], [2, 2]).init(d)),
            "LayerNorm" => Layer::LayerNorm(LayerNormConfig::new(F).init(d)),
            "RmsNorm" => Layer::RmsNorm(RmsNormConfig::new(F).init(d)),
            "GroupNorm" => Layer::GroupNorm(GroupNormConfig::new(2, 4).init(d)),
            "InstanceNorm" => Layer::InstanceNorm(InstanceNormConfig::new(4).init(d)),
            "BatchNorm" => Layer::BatchNorm(BatchNormConfig::new(4).init(d)),
            "MultiHeadAttention" => {
                Layer::MultiHeadAttention(MultiHeadAttentionConfig::new(8, 2).with_dropout(0.0).init(d))
            }
            "CrossAttention" => {
                Layer::CrossAttention(CrossAttentionConfig::new(8, 8, 2, 1, 4).with_dropout(0.0).init(d))
            }
            "TransformerEncoder" => {
                Layer::TransformerEncoder(TransformerEncoderConfig::new(8, 16, 2, 1).with_dropout(0.0).init(d))
            }
            "TransformerDecoder" => {
                Layer::TransformerDecoder(TransformerDecoderConfig::new(8, 16, 2, 1).with_dropout(0.0).init(d))
            }
            "PositionWiseFeedForward" => {
                Layer::PositionWiseFeedForward(PositionWiseFeedForwardConfig::new(8, 16).with_dropout(0.0).init(d))
            }
            "Rnn" => Layer::Rnn(RnnConfig::new(8, 4, true).init(d)),
            "BiRnn" => Layer::BiRnn(BiRnnConfig::new(8, 4, true).init(d)),
            "Gru" => Layer::Gru(GruConfig::new(8, 4, true).init(d)),
            "BiGru" => Layer::BiGru(BiGruConfig::new(8, 4, true).init(d)),
            "Lstm" => Layer::Lstm(LstmConfig::new(8, 4, true).init(d)),
            "BiLstm" => Layer::BiLstm(BiLstmConfig::new(8, 4, true).init(d)),
            "PRelu" => Layer::PRelu(PReluConfig::new().with_num_parameters(F).init(d)),
            "SwiGlu" => Layer::SwiGlu(SwiGluConfig::new(F, 5).with_bias(true).init(d)),
            other => panic!("no sweep case for {other}"),
        }
    }

    /// `x`: `[batch, F]`, each sample read in the layer's input shape; returns the layer's
    /// output flattened to `[batch, -]`.
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let b = x.dims()[0];
        let seq = || x.clone().reshape([b, 3, 8]);
        let out: Tensor<2> = match self {
            Layer::Linear(m) => m.forward(x.clone()),
            Layer::Embedding(m) => {
                let ids = x
                    .clone()
                    .narrow(1, 0, 3)
                    .add_scalar(1.0)
                    .mul_scalar(3.5)
                    .floor()
                    .clamp(0.0, 6.0)
                    .int();
                m.forward(ids).flatten_rows()
            }
            Layer::Conv1d(m) => m.forward(x.clone().reshape([b, 2, 12])).flatten_rows(),
            Layer::Conv2d(m) => m.forward(x.clone().reshape([b, 2, 3, 4])).flatten_rows(),
            Layer::Conv3d(m) => m.forward(x.clone().reshape([b, 2, 2, 2, 3])).flatten_rows(),
            Layer::ConvTranspose1d(m) => m.forward(x.clone().reshape([b, 2, 12])).flatten_rows(),
            Layer::ConvTranspose2d(m) => m.forward(x.clone().reshape([b, 2, 3, 4])).flatten_rows(),
            Layer::ConvTranspose3d(m) => m.forward(x.clone().reshape([b, 2, 2, 2, 3])).flatten_rows(),
            Layer::DeformConv2d(m) => {
                // A constant, non-zero offset: the bilinear sampling path, not a plain conv.
                let offset = Tensor::<4>::full([b, 8, 2, 3], 0.25, &x.device());
                m.forward(x.clone().reshape([b, 2, 3, 4]), offset, None).flatten_rows()
            }
            Layer::LayerNorm(m) => m.forward(x.clone()),
            Layer::RmsNorm(m) => m.forward(x.clone()),
            Layer::GroupNorm(m) => m.forward(x.clone().reshape([b, 4, 6])).flatten_rows(),
            Layer::InstanceNorm(m) => m.forward(x.clone().reshape([b, 4, 6])).flatten_rows(),
            Layer::BatchNorm(m) => m.forward(x.clone().reshape([b, 4, 6])).flatten_rows(),
            Layer::MultiHeadAttention(m) => m.forward(MhaInput::self_attn(seq())).context.flatten_rows(),
            Layer::CrossAttention(m) => m.forward(seq(), seq().flip([1]), None).flatten_rows(),
            Layer::TransformerEncoder(m) => m.forward(TransformerEncoderInput::new(seq())).flatten_rows(),
            Layer::TransformerDecoder(m) => m
                .forward(TransformerDecoderInput::new(seq(), seq().flip([1])))
                .flatten_rows(),
            Layer::PositionWiseFeedForward(m) => m.forward(seq()).flatten_rows(),
            Layer::Rnn(m) => m.forward(seq(), None).0.flatten_rows(),
            Layer::BiRnn(m) => m.forward(seq(), None).0.flatten_rows(),
            Layer::Gru(m) => m.forward(seq(), None).flatten_rows(),
            Layer::BiGru(m) => m.forward(seq(), None).0.flatten_rows(),
            Layer::Lstm(m) => m.forward(seq(), None).0.flatten_rows(),
            Layer::BiLstm(m) => m.forward(seq(), None).0.flatten_rows(),
            Layer::PRelu(m) => m.forward(x.clone()),
            Layer::SwiGlu(m) => m.forward(x.clone()),
        };
        out
    }

    /// The running statistics of a BatchNorm layer, settled (`valid` applies pending updates).
    fn running_stats(&self) -> Option<Stats> {
        match self.valid() {
            Layer::BatchNorm(bn) => Some((to_vec(bn.running_mean.value()), to_vec(bn.running_var.value()))),
            _ => None,
        }
    }
}

/// `[batch, ..]` -> `[batch, rest]`.
trait FlattenRows {
    fn flatten_rows(self) -> Tensor<2>;
}

impl<const D: usize> FlattenRows for Tensor<D> {
    fn flatten_rows(self) -> Tensor<2> {
        let dims = self.dims();
        let rest = dims[1..].iter().product::<usize>();
        self.reshape([dims[0], rest])
    }
}

/// The trainable parameters of `module` in traversal order (buffers left out).
pub(crate) fn trainable_of<M: Module>(module: &M) -> Vec<f32> {
    struct Collect(Vec<f32>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if p.is_require_grad() {
                self.0.extend(p.val().into_data().convert::<f32>().iter::<f32>());
            }
        }
    }
    let mut c = Collect(Vec::new());
    module.visit(&mut c);
    c.0
}

fn to_vec<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().convert::<f32>().iter::<f32>().collect()
}

/// Samples `[lo, hi)` of step `step`'s global batch: `[hi - lo, F]`.
fn samples(step: usize, lo: usize, hi: usize, device: &Device) -> Tensor<2> {
    let all = Rng::new(700 + step as u64).vec(GLOBAL_BATCH * F);
    Tensor::from_data(TensorData::new(all[lo * F..hi * F].to_vec(), [hi - lo, F]), device)
}

/// A loss with a non-trivial gradient for every output.
fn loss(layer: &Layer, x: Tensor<2>) -> Tensor<1> {
    layer.forward(x).sub_scalar(0.3).powi_scalar(2).mean()
}

/// A copy of `base` with running states of its own (clones share them) on `device`.
fn own_copy(base: &Layer, device: &Device) -> Layer {
    base.valid().train().fork(device)
}

/// Single-device Burn: the mean of the `world_size` ranks' losses, AdamW. Returns the final
/// parameters and, for BatchNorm, the running statistics the buffer rule gives.
pub(crate) fn reference(base: &Layer, world_size: usize) -> (Vec<f32>, Option<Stats>) {
    let device = Device::flex().autodiff();
    let mut model = own_copy(base, &device);
    let mut optim = adamw().init();
    let per_rank = GLOBAL_BATCH / world_size;
    let mut stats = base.running_stats();
    for step in 0..STEPS {
        let losses: Vec<Tensor<1>> = (0..world_size)
            .map(|r| loss(&model, samples(step, r * per_rank, (r + 1) * per_rank, &device)))
            .collect();
        let total = Tensor::cat(losses, 0).mean();
        let grads = GradientsParams::from_grads(total.backward(), &model);
        model = optim.step(LR, model, grads);
        // The rule: each rank updates the statistics from the same start with its own batch,
        // then the ranks' values are averaged. The BatchNorm layer reads the data directly, so
        // its updates do not depend on the parameters.
        if let Some((mean, var)) = stats.take() {
            let (mut sum_mean, mut sum_var) = (vec![0.0f32; mean.len()], vec![0.0f32; var.len()]);
            for r in 0..world_size {
                let mut bn = BatchNormConfig::new(4).init(&device);
                bn.running_mean = RunningState::new(Tensor::from_data(TensorData::new(mean.clone(), [4]), &device));
                bn.running_var = RunningState::new(Tensor::from_data(TensorData::new(var.clone(), [4]), &device));
                let layer = Layer::BatchNorm(bn);
                drop(layer.forward(samples(step, r * per_rank, (r + 1) * per_rank, &device)));
                let (m, v) = layer.running_stats().expect("batch norm");
                sum_mean.iter_mut().zip(&m).for_each(|(s, x)| *s += x);
                sum_var.iter_mut().zip(&v).for_each(|(s, x)| *s += x);
            }
            let n = world_size as f32;
            stats = Some((
                sum_mean.iter().map(|s| s / n).collect(),
                sum_var.iter().map(|s| s / n).collect(),
            ));
        }
    }
    (trainable_of(&model), stats)
}

struct RankResult {
    params: Vec<f32>,
    stats: Option<Stats>,
    num_params: usize,
}

/// `shared_buffers`: ranks share the running states of one clone, as threads of one program
/// do (Burn then averages their pending updates itself); otherwise each rank has its own, as
/// separate processes do, and only the sharded optimizer's buffer rule brings them together.
/// The ranks train on `device` (an autodiff device: the CPU's, or a GPU's in the GPU suite).
fn sharded(
    base: &Layer,
    device: &Device,
    world_size: usize,
    config: &ShardConfig,
    shared_buffers: bool,
) -> Vec<RankResult> {
    let stage = config.stage;
    let base = own_copy(base, device);
    run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
        let rank = comm.rank();
        let device = device.clone();
        let model = match shared_buffers {
            true => base.clone().fork(&device),
            false => own_copy(&base, &device),
        };
        let (mut model, mut optim) = config
            .init(model, adamw(), comm)
            .unwrap_or_else(|e| panic!("init at stage {stage}: {e}"));
        let num_params = model.num_params();
        model = train_rank(model, &mut optim, rank, world_size, &device);
        RankResult {
            params: trainable_of(&model.clone().materialize()),
            stats: model.running_stats(),
            num_params,
        }
    })
    .unwrap_or_else(|e| panic!("a rank failed at stage {stage}, world size {world_size}: {e:?}"))
}

/// The optimizer of the sweep and of its reference.
pub(crate) fn adamw() -> AdamWConfig {
    AdamWConfig::new().with_weight_decay(0.05)
}

/// `STEPS` sharded steps of rank `rank` of `world_size` on its part of the sweep's batches.
pub(crate) fn train_rank(
    mut model: Layer,
    optim: &mut ShardedOptimizer<impl MasterWeightStep>,
    rank: usize,
    world_size: usize,
    device: &Device,
) -> Layer {
    let per_rank = GLOBAL_BATCH / world_size;
    for step in 0..STEPS {
        let l = loss(&model, samples(step, rank * per_rank, (rank + 1) * per_rank, device));
        model = sharded_step(optim, model, l, LR).0;
    }
    model
}

/// Trains `name` at every stage and world size and compares with the reference.
fn sweep(name: &str) {
    sweep_on(name, &Device::flex().autodiff(), 1..=4, 1e-4);
}

/// Trains `name` at every stage and at `world_sizes` with the ranks on `rank_device` (an
/// autodiff device), against single-device training on the CPU: parameters within `tolerance`,
/// running statistics within a tenth of it. The GPU suite runs it on CUDA.
pub(crate) fn sweep_on(name: &str, rank_device: &Device, world_sizes: impl IntoIterator<Item = usize>, tolerance: f32) {
    let runs = STAGES
        .into_iter()
        .flat_map(|s| [(ShardConfig::new(s), true), (ShardConfig::new(s), false)]);
    sweep_configs(name, rank_device, world_sizes, tolerance, &runs.collect::<Vec<_>>());
}

/// The sweep of `name` on the CPU at `world_size` with the configurations `config_of` gives for
/// `stages` (hybrid sharding's mesh), each rank with its own running-state buffers.
pub(crate) fn sweep_with(name: &str, config_of: impl Fn(Stage) -> ShardConfig, stages: &[Stage], world_size: usize) {
    let runs: Vec<_> = stages.iter().map(|&s| (config_of(s), false)).collect();
    sweep_configs(name, &Device::flex().autodiff(), [world_size], 1e-4, &runs);
}

/// [`sweep_on`] with each `(config, shared_buffers)` of `runs` at every world size.
fn sweep_configs(
    name: &str,
    rank_device: &Device,
    world_sizes: impl IntoIterator<Item = usize>,
    tolerance: f32,
    runs: &[(ShardConfig, bool)],
) {
    let device = Device::flex().autodiff();
    device.seed(3);
    let base = Layer::new(name, &device);
    let expected_num_params = base.num_params();
    for world_size in world_sizes {
        let (ref_params, ref_stats) = reference(&base, world_size);
        for (config, shared_buffers) in runs {
            let (stage, shared_buffers) = (config.stage, *shared_buffers);
            let ranks = sharded(&base, rank_device, world_size, config, shared_buffers);
            for (rank, r) in ranks.iter().enumerate() {
                let at = format!(
                    "{name} on {rank_device:?}, stage {stage}, world size {world_size}, {} replicas, rank {rank}, buffers \
                     shared: {shared_buffers}",
                    config.mesh.replicas
                );
                assert_eq!(
                    r.num_params, expected_num_params,
                    "{at}: num_params must be the full model's"
                );
                let diff = max_abs_diff(&r.params, &ref_params);
                assert!(
                    diff < tolerance,
                    "{at}: parameters differ from single-device training by {diff}"
                );
                match (&r.stats, &ref_stats) {
                    (Some((mean, var)), Some((ref_mean, ref_var))) => {
                        let d = max_abs_diff(mean, ref_mean).max(max_abs_diff(var, ref_var));
                        assert!(
                            d < tolerance / 10.0,
                            "{at}: running statistics off the buffer rule by {d}"
                        );
                        assert_eq!(
                            (mean, var),
                            (&ranks[0].stats.as_ref().unwrap().0, &ranks[0].stats.as_ref().unwrap().1),
                            "{at}: buffers differ between ranks"
                        );
                    }
                    (None, None) => {}
                    _ => panic!("{at}: running statistics on one side only"),
                }
            }
        }
    }
}

macro_rules! sweep_tests {
    ($($test:ident => $name:literal),* $(,)?) => {
        $(
            #[test]
            fn $test() {
                sweep($name);
            }
        )*

        #[test]
        fn the_sweep_covers_every_listed_module() {
            let tested = [$($name),*];
            assert_eq!(tested, MODULES);
        }
    };
}

sweep_tests! {
    linear_trains_exactly_at_every_stage => "Linear",
    embedding_trains_exactly_at_every_stage => "Embedding",
    conv1d_trains_exactly_at_every_stage => "Conv1d",
    conv2d_trains_exactly_at_every_stage => "Conv2d",
    conv3d_trains_exactly_at_every_stage => "Conv3d",
    conv_transpose1d_trains_exactly_at_every_stage => "ConvTranspose1d",
    conv_transpose2d_trains_exactly_at_every_stage => "ConvTranspose2d",
    conv_transpose3d_trains_exactly_at_every_stage => "ConvTranspose3d",
    deform_conv2d_trains_exactly_at_every_stage => "DeformConv2d",
    layer_norm_trains_exactly_at_every_stage => "LayerNorm",
    rms_norm_trains_exactly_at_every_stage => "RmsNorm",
    group_norm_trains_exactly_at_every_stage => "GroupNorm",
    instance_norm_trains_exactly_at_every_stage => "InstanceNorm",
    batch_norm_trains_exactly_and_keeps_buffers_in_sync_at_every_stage => "BatchNorm",
    multi_head_attention_trains_exactly_at_every_stage => "MultiHeadAttention",
    cross_attention_trains_exactly_at_every_stage => "CrossAttention",
    transformer_encoder_trains_exactly_at_every_stage => "TransformerEncoder",
    transformer_decoder_trains_exactly_at_every_stage => "TransformerDecoder",
    position_wise_feed_forward_trains_exactly_at_every_stage => "PositionWiseFeedForward",
    rnn_trains_exactly_at_every_stage => "Rnn",
    bi_rnn_trains_exactly_at_every_stage => "BiRnn",
    gru_trains_exactly_at_every_stage => "Gru",
    bi_gru_trains_exactly_at_every_stage => "BiGru",
    lstm_trains_exactly_at_every_stage => "Lstm",
    bi_lstm_trains_exactly_at_every_stage => "BiLstm",
    prelu_trains_exactly_at_every_stage => "PRelu",
    swiglu_trains_exactly_at_every_stage => "SwiGlu",
}

/// Every module trains at stage 3 with its parameter and gradient shards on disk
/// (`ShardConfig::with_params_on(Home::Disk(..))`) bitwise as with them in memory (parameters and
/// running statistics; each rank with its own copy of the buffers, since ranks sharing one
/// race on it), at world sizes 1 and 3.
#[test]
fn every_module_trains_bitwise_with_its_shards_on_disk() {
    let dir = scratch("nvme-params", "modules");
    let resident = ShardConfig::new(Stage::Three);
    let stored = resident.clone().with_params_on(Home::Disk(NvmeOffload::new(&dir)));
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for name in MODULES {
        let device = Device::flex().autodiff();
        device.seed(3);
        let base = Layer::new(name, &device);
        for world_size in [1, 3] {
            let memory = sharded(&base, &device, world_size, &resident, false);
            let on_disk = sharded(&base, &device, world_size, &stored, false);
            for (rank, (m, s)) in memory.iter().zip(&on_disk).enumerate() {
                let at = format!("{name}, world size {world_size}, rank {rank}");
                assert!(!m.params.is_empty(), "{at}: trainable parameters");
                assert_eq!(bits(&s.params), bits(&m.params), "{at}: parameters");
                let stats = |r: &RankResult| r.stats.as_ref().map(|(mean, var)| (bits(mean), bits(var)));
                assert_eq!(stats(s), stats(m), "{at}: running statistics");
            }
        }
    }
    assert!(
        std::fs::read_dir(&dir).unwrap().next().is_none(),
        "files left in {}",
        dir.display()
    );
}

/// docs/training.md's "What works at stage 3" list names exactly the modules the sweep trains.
#[test]
fn training_guide_lists_the_modules_the_sweep_covers() {
    let guide = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/training.md")).unwrap();
    let section = guide
        .split("### What works at stage 3")
        .nth(1)
        .expect("docs/training.md has a `### What works at stage 3` section")
        .split("\n#")
        .next()
        .unwrap();
    for name in MODULES {
        assert!(
            section.contains(&format!("`{name}`")),
            "docs/training.md's stage-3 list lacks `{name}`"
        );
    }
}
