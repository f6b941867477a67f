//! Stage 3 (FSDP): equivalence with single-device training on a model with three units, a tied
//! parameter, a frozen one and an unused one; measured memory against 16Ψ/N and the largest
//! unit; measured traffic against 3Ψ(N-1)/N.

use burn::module::{Module, Param};
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, AdamWConfig, GradientsParams, ModuleOptimizer};
use burn::prelude::*;
use burn::tensor::activation::relu;
use burn_shard::fsdp::unit;
use burn_shard::{IntoOptimizer, ShardConfig, Stage};
use burn_shard_comm::{Collective, CollectiveKind, InProcessGroup, run_ranks};

use crate::common::{Rng, max_abs_diff, params_of, rows, sharded_step};

/// `embed` is tied (input projection and output head), `frozen` never trains, `unused` is
/// trainable but never read, and the three `blocks` are the units.
#[derive(Module, Debug)]
pub(crate) struct Net3 {
    pub(crate) embed: Param<Tensor<2>>,
    pub(crate) blocks: Vec<Linear>,
    frozen: Param<Tensor<1>>,
    unused: Param<Tensor<1>>,
}

impl Net3 {
    pub fn new(vocab: usize, width: usize, device: &Device) -> Self {
        let mut rng = Rng::new(11);
        let embed = Tensor::from_data(TensorData::new(rng.vec(vocab * width), [vocab, width]), device).mul_scalar(0.3);
        let frozen = Tensor::from_data(TensorData::new(rng.vec(width), [width]), device).add_scalar(1.0);
        Self {
            embed: Param::from_tensor(embed.require_grad()),
            blocks: (0..3).map(|_| LinearConfig::new(width, width).init(device)).collect(),
            frozen: Param::from_tensor(frozen).set_require_grad(false),
            unused: Param::from_tensor(Tensor::ones([7], device).require_grad()),
        }
    }

    /// `x`: `[batch, vocab]` -> `[batch, vocab]`.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let mut h = unit(&x, || x.clone().matmul(self.embed.val()));
        for block in &self.blocks {
            h = unit(&h, || relu(block.forward(h.clone())));
        }
        let h = h * self.frozen.val().unsqueeze::<2>();
        h.matmul(self.embed.val().transpose())
    }
}

impl Net3 {
    /// `forward` without block `skip` (when given): a backward with fewer gradients.
    pub(crate) fn forward_skipping(&self, x: Tensor<2>, skip: Option<usize>) -> Tensor<2> {
        let mut h = unit(&x, || x.clone().matmul(self.embed.val()));
        for (i, block) in self.blocks.iter().enumerate() {
            if Some(i) != skip {
                h = unit(&h, || relu(block.forward(h.clone())));
            }
        }
        let h = h * self.frozen.val().unsqueeze::<2>();
        h.matmul(self.embed.val().transpose())
    }

    /// `forward` with the blocks run in reverse order: a rank-dependent control flow.
    fn forward_reversed(&self, x: Tensor<2>) -> Tensor<2> {
        let mut h = unit(&x, || x.clone().matmul(self.embed.val()));
        for block in self.blocks.iter().rev() {
            h = unit(&h, || relu(block.forward(h.clone())));
        }
        let h = h * self.frozen.val().unsqueeze::<2>();
        h.matmul(self.embed.val().transpose())
    }
}

pub(crate) const VOCAB: usize = 6;
pub(crate) const WIDTH: usize = 10;
pub(crate) const STEPS: usize = 20;
pub(crate) const GLOBAL_BATCH: usize = 12;
pub(crate) const LR: f64 = 1e-2;

/// Inputs and teacher targets of step `step`, both `[batch, vocab]`.
pub(crate) fn batch(step: usize, vocab: usize, batch: usize) -> (Vec<f32>, Vec<f32>) {
    let teacher = Rng::new(5).vec(vocab * vocab);
    let x = Rng::new(500 + step as u64).vec(batch * vocab);
    let y = (0..batch)
        .flat_map(|b| {
            let (x, t) = (&x, &teacher);
            (0..vocab).map(move |o| {
                (0..vocab)
                    .map(|i| x[b * vocab + i] * t[i * vocab + o])
                    .sum::<f32>()
                    .tanh()
            })
        })
        .collect();
    (x, y)
}

pub(crate) fn loss(model: &Net3, step: usize, range: (usize, usize), device: &Device) -> Tensor<1> {
    let (x, y) = batch(step, VOCAB, GLOBAL_BATCH);
    let out = model.forward(rows(&x, VOCAB, range.0, range.1, device));
    MseLoss::new().forward(out, rows(&y, VOCAB, range.0, range.1, device), Reduction::Mean)
}

pub(crate) fn reference(base: &Net3, mut optim: ModuleOptimizer) -> (Vec<f32>, Vec<f32>) {
    let device = Device::flex().autodiff();
    let mut model = base.clone().fork(&device);
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let l = loss(&model, step, (0, GLOBAL_BATCH), &device);
        losses.push(l.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(l.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    (losses, params_of(&model))
}

pub(crate) struct RankRun {
    losses: Vec<f32>,
    full_params: Vec<f32>,
}

pub(crate) fn sharded<O: IntoOptimizer + Clone + Send + Sync>(
    base: &Net3,
    optim: O,
    world_size: usize,
    config: ShardConfig,
) -> Vec<RankRun> {
    run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
        let rank = comm.rank();
        let device = Device::flex().autodiff();
        let (mut model, mut optim) = config
            .init(base.clone().fork(&device), optim.clone(), comm)
            .expect("init");
        let per_rank = GLOBAL_BATCH / world_size;
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let l = loss(&model, step, (rank * per_rank, (rank + 1) * per_rank), &device);
            let (next, global) = sharded_step(&mut optim, model, l, LR);
            model = next;
            losses.push(global);
        }
        // Unsharding is a collective at stage 3: every rank does it.
        let full_params = params_of(&model.clone().materialize());
        RankRun { losses, full_params }
    })
    .expect("no rank panics")
}

pub(crate) fn check_equivalence<O: IntoOptimizer + Clone + Send + Sync>(
    name: &str,
    reference_optim: ModuleOptimizer,
    optim: O,
    config: ShardConfig,
) {
    check_equivalence_at(name, reference_optim, optim, config, [1, 2, 3, 4]);
}

/// [`check_equivalence`] at `world_sizes`.
pub(crate) fn check_equivalence_at<O: IntoOptimizer + Clone + Send + Sync>(
    name: &str,
    reference_optim: ModuleOptimizer,
    optim: O,
    config: ShardConfig,
    world_sizes: impl IntoIterator<Item = usize>,
) {
    let device = Device::flex().autodiff();
    let base = Net3::new(VOCAB, WIDTH, &device);
    let (ref_losses, ref_params) = reference(&base, reference_optim);
    assert!(
        ref_losses[STEPS - 1] < ref_losses[0] * 0.9,
        "{name}: the reference must learn: {ref_losses:?}"
    );
    for world_size in world_sizes {
        let runs = sharded(&base, optim.clone(), world_size, config.clone());
        let ctx = format!(
            "{name}, stage {}, world_size {world_size}, {} replicas",
            config.stage, config.mesh.replicas
        );
        if world_size == 1 {
            assert_eq!(
                runs[0].losses, ref_losses,
                "{ctx}: world_size 1 must be bitwise identical (losses)"
            );
            assert_eq!(
                runs[0].full_params, ref_params,
                "{ctx}: world_size 1 must be bitwise identical (params)"
            );
        }
        for (step, (a, b)) in runs[0].losses.iter().zip(&ref_losses).enumerate() {
            let rel = (a - b).abs() / b.abs().max(1e-12);
            assert!(
                rel <= 1e-4,
                "{ctx}: step {step} loss {a} vs reference {b} (rel {rel:e})"
            );
        }
        let diff = max_abs_diff(&runs[0].full_params, &ref_params);
        assert!(diff <= 1e-4, "{ctx}: max |param - reference| = {diff:e}");
        for r in &runs[1..] {
            assert_eq!(r.full_params, runs[0].full_params, "{ctx}: ranks must agree");
        }
        // The frozen gain and the unused parameter never change.
        let frozen_and_unused = |p: &[f32]| p[p.len() - WIDTH - 7..].to_vec();
        assert_eq!(
            frozen_and_unused(&runs[0].full_params),
            frozen_and_unused(&params_of(&base)),
            "{ctx}"
        );
    }
}

#[test]
fn adam_with_tied_frozen_and_unused_parameters_matches_single_device_at_every_stage() {
    for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
        check_equivalence(
            "Adam",
            AdamConfig::new().init(),
            AdamConfig::new().build(),
            ShardConfig::new(stage),
        );
    }
}

#[test]
fn adamw_with_tied_frozen_and_unused_parameters_matches_single_device_at_every_stage() {
    // Weight decay would move a parameter that has no gradient: it must stay put, as in Burn.
    let cfg = AdamWConfig::new().with_weight_decay(0.1);
    for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
        check_equivalence("AdamW", cfg.init(), cfg.build(), ShardConfig::new(stage));
    }
}

/// Hybrid sharding with tied, frozen and unused parameters: 2 replicas of shard groups of 1 and
/// 2 ranks, stages 1-3, against single-device Burn (the class `hsdp.rs` sweeps, on the model
/// whose parameters are of every kind).
#[test]
fn tied_frozen_and_unused_parameters_under_hybrid_sharding_match_single_device() {
    let cfg = AdamWConfig::new().with_weight_decay(0.1);
    for stage in [Stage::One, Stage::Two, Stage::Three] {
        let config = ShardConfig::new(stage).with_replicas(2);
        check_equivalence_at("AdamW, 2 replicas", cfg.init(), cfg.build(), config, [2, 4]);
    }
}

#[test]
fn stage3_without_resharding_matches_single_device() {
    let config = ShardConfig::new(Stage::Three).with_reshard_after_forward(false);
    check_equivalence(
        "Adam, reshard_after_forward=false",
        AdamConfig::new().init(),
        AdamConfig::new().build(),
        config,
    );
}

/// Trainable parameters of `Net3::new(vocab, width)`: Ψ.
pub(crate) fn psi(vocab: usize, width: usize) -> usize {
    vocab * width + 3 * (width * width + width) + 7
}

/// Per-parameter padded sizes of the trainable parameters, in elements.
pub(crate) fn padded_trainable(vocab: usize, width: usize, n: usize) -> usize {
    [
        vocab * width,
        width * width,
        width,
        width * width,
        width,
        width * width,
        width,
        7,
    ]
    .iter()
    .map(|k| k.div_ceil(n) * n)
    .sum()
}

#[test]
fn stage3_memory_follows_16_psi_over_n_and_the_largest_unit() {
    let (vocab, width, n) = (32, 64, 4);
    let device = Device::flex().autodiff();
    let base = Net3::new(vocab, width, &device);
    let psi = psi(vocab, width);
    let pad_bytes = 16 * (padded_trainable(vocab, width, n) - psi) + 4 * width.div_ceil(n) * n;
    let runs = run_ranks(InProcessGroup::new(n).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (mut model, mut optim) = ShardConfig::new(Stage::Three)
            .init(base.clone().fork(&device), AdamConfig::new().build(), comm)
            .unwrap();
        for _ in 0..2 {
            let x = Tensor::<2>::ones([4, vocab], &device);
            let l = model.forward(x).powi_scalar(2).mean();
            let grads = GradientsParams::from_grads(l.backward(), &model);
            model = optim.step(1e-3, model, grads).unwrap();
        }
        optim.report().memory(&model)
    })
    .unwrap();
    // The largest unit's bytes: one block's weight + bias. In backward a unit's gathered
    // parameters and its full gradients (kept for the unit's one reduce-scatter) live with the
    // previous unit's gradients still being reduce-scattered: FSDP2's "one unit + one in flight".
    let largest_unit = 3 * 4 * (width * width + width).max(vocab * width);
    // The frozen gain's gather is kept by its consumer until backward (it has no gradient to
    // trigger a re-gather): it is counted on top.
    let frozen = 4 * width;
    for r in runs {
        // Persistent: parameter shards (frozen one included) + gradient shards + Adam state.
        let formula = 16 * psi / n;
        let measured = r.model_state_bytes();
        assert!(
            measured as f64 >= formula as f64 * 0.95 && measured as f64 <= formula as f64 * 1.05 + pad_bytes as f64,
            "persistent {measured} B vs 16Ψ/N = {formula} B (+{pad_bytes} B padding): {r}"
        );
        assert!(r.temporary_peak_bytes > 0, "transients are measured");
        assert!(
            r.temporary_peak_bytes <= largest_unit + frozen,
            "transient peak {} B exceeds the largest unit's gathered params + grads + grads in flight {} B (+{} B frozen): {r}",
            r.temporary_peak_bytes,
            largest_unit,
            frozen
        );
    }
}

#[test]
fn stage3_traffic_is_at_most_three_psi_per_step() {
    let (vocab, width) = (8, 12);
    let device = Device::flex().autodiff();
    let base = Net3::new(vocab, width, &device);
    for n in [2usize, 4] {
        let runs = run_ranks(InProcessGroup::new(n).unwrap(), |comm| {
            let device = Device::flex().autodiff();
            let (mut model, mut optim) = ShardConfig::new(Stage::Three)
                .init(base.clone().fork(&device), AdamConfig::new().build(), comm)
                .unwrap();
            let before = optim.comm().stats();
            let x = Tensor::<2>::ones([3, vocab], &device).require_grad(); // tracked: every weight is re-gathered
            let l = model.forward(x).powi_scalar(2).mean();
            let grads = GradientsParams::from_grads(l.backward(), &model);
            model = optim.step(1e-3, model, grads).unwrap();
            let _ = model;
            optim.comm().stats().since(&before)
        })
        .unwrap();
        // Bytes one rank sends to move Ψ padded elements once around the ring.
        let once = |elements: usize| (4 * elements * (n - 1) / n) as u64;
        // Trainable parameters that receive a gradient (the unused one does not), plus the
        // tied embedding's second use: each reduce-scatters once per use.
        let used = padded_trainable(vocab, width, n) - 7usize.div_ceil(n) * n;
        let tied = (vocab * width).div_ceil(n) * n;
        let frozen = width.div_ceil(n) * n;
        for st in runs {
            let rs = st.get(CollectiveKind::ReduceScatter).bytes_sent;
            let ag = st.get(CollectiveKind::AllGather).bytes_sent;
            assert_eq!(
                rs,
                once(used + tied),
                "reduce-scatter: once per use of each trained parameter"
            );
            // Forward gathers every use (frozen included); backward re-gathers at most once more.
            let forward = once(used + tied + frozen);
            assert!(
                ag >= forward && ag <= 2 * forward,
                "all-gather {ag} B vs forward {forward} B"
            );
            let total = st.total_bytes_sent();
            assert!(
                total <= 3 * once(used + tied) + 2 * once(frozen),
                "stage-3 traffic {total} B exceeds 3Ψ(N-1)/N = {} B",
                3 * once(used + tied)
            );
            assert_eq!(st.get(CollectiveKind::AllReduce).calls, 0, "no all-reduce in stage 3");
        }
    }
}

#[test]
fn stage3_without_resharding_gathers_once() {
    let (vocab, width, n) = (8, 12, 2);
    let device = Device::flex().autodiff();
    let base = Net3::new(vocab, width, &device);
    let runs = run_ranks(InProcessGroup::new(n).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let config = ShardConfig::new(Stage::Three).with_reshard_after_forward(false);
        let (model, mut optim) = config
            .init(base.clone().fork(&device), AdamConfig::new().build(), comm)
            .unwrap();
        let before = optim.comm().stats();
        let x = Tensor::<2>::ones([3, vocab], &device).require_grad();
        let l = model.forward(x).powi_scalar(2).mean();
        let grads = GradientsParams::from_grads(l.backward(), &model);
        let _ = optim.step(1e-3, model, grads).unwrap();
        optim.comm().stats().since(&before)
    })
    .unwrap();
    let once = |elements: usize| (4 * elements * (n - 1) / n) as u64;
    let uses = padded_trainable(vocab, width, n) - 8 + (vocab * width) + width; // + tied second use + frozen
    for st in runs {
        assert_eq!(
            st.get(CollectiveKind::AllGather).bytes_sent,
            once(uses),
            "one gather per use, none in backward"
        );
    }
}

#[test]
fn ranks_that_gather_different_parameters_fail_instead_of_mixing_them() {
    // Rank 1 runs the (equal-sized) blocks in reverse: its gathers meet rank 0's for other
    // parameters of the same length. The tags make that an error, returned by `step`.
    let device = Device::flex().autodiff();
    let base = Net3::new(VOCAB, WIDTH, &device);
    let start = std::time::Instant::now();
    let out = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let rank = comm.rank();
        let device = Device::flex().autodiff();
        let (model, mut optim) = ShardConfig::new(Stage::Three)
            .init(base.clone().fork(&device), AdamConfig::new().build(), comm)
            .unwrap();
        let x = Tensor::<2>::ones([2, VOCAB], &device);
        let y = if rank == 0 {
            model.forward(x)
        } else {
            model.forward_reversed(x)
        };
        let grads = GradientsParams::from_grads(y.powi_scalar(2).mean().backward(), &model);
        optim.step(1e-3, model, grads).err().map(|e| e.to_string())
    })
    .unwrap();
    for (rank, err) in out.iter().enumerate() {
        let err = err.as_ref().unwrap_or_else(|| panic!("rank {rank} must fail"));
        assert!(
            err.contains("mismatch") || err.contains("aborted"),
            "rank {rank}: {err}"
        );
    }
    assert!(start.elapsed() < std::time::Duration::from_secs(30));
}
