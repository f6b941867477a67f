//! Optimizers that read whole parameters (Burn's Muon, LAMB and Adafactor, and any optimizer
//! through `AnyOptimizer::whole_params`), and groups of different optimizers
//! (`OptimizerGroups`), train as Burn's `ModuleOptimizer` with the same groups on one device:
//! at stages 0-3 and world sizes 1-4, bitwise at world size 1, with HSDP, after
//! a resume at another world size, and with refusals that name the parameter and the fix.

use burn::module::{Module, ParamGroup};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdafactorConfig, AdamWConfig, GradientsParams, LambConfig, ModuleOptimizer, MuonConfig, SgdConfig};
use burn::prelude::*;
use burn_shard::{AnyOptimizer, FlatLayout, Home, IntoOptimizer, OptimizerGroups, ShardConfig, Stage};
use burn_shard_comm::{Collective, InProcessComm, InProcessGroup, run_ranks};

use crate::common::*;
use crate::equivalence::{GLOBAL_BATCH, STEPS};
use crate::mixed_precision::{bf16_stuck, grads_to_f32, ulp};

const LR: f64 = 1e-2;

/// The hidden matrices of `TinyMlp` (`l1.weight` `[5, 7]`, `l2.weight` `[7, 3]`): Muon's group,
/// as the Muon recipes route them; biases and `scale` stay with AdamW.
fn matrices() -> ParamGroup {
    ParamGroup::from_regex(r"^l[12]\.weight$").expect("a valid regex")
}

/// One optimizer setup, built alike for Burn and for burn-shard.
#[derive(Clone, Copy, Debug)]
enum Case {
    /// AdamW for everything, Muon for the matrices.
    MuonWithAdamW,
    Lamb,
    Adafactor,
    /// Burn's AdamW, stepped on whole parameters.
    WholeAdamW,
}

const CASES: [Case; 4] = [Case::MuonWithAdamW, Case::Lamb, Case::Adafactor, Case::WholeAdamW];

impl Case {
    fn burn(self) -> ModuleOptimizer {
        match self {
            Case::MuonWithAdamW => AdamWConfig::new()
                .init()
                .with_group(matrices(), MuonConfig::new().build(), None),
            Case::Lamb => LambConfig::new().init(),
            Case::Adafactor => AdafactorConfig::new().init(),
            Case::WholeAdamW => AdamWConfig::new().init(),
        }
    }

    fn sharded(self) -> OptimizerGroups {
        match self {
            Case::MuonWithAdamW => {
                OptimizerGroups::new(AdamWConfig::new()).with_group(matrices(), MuonConfig::new(), None)
            }
            Case::Lamb => OptimizerGroups::new(LambConfig::new()),
            Case::Adafactor => OptimizerGroups::new(AdafactorConfig::new()),
            Case::WholeAdamW => OptimizerGroups::new(AnyOptimizer::whole_params(AdamWConfig::new().build())),
        }
    }
}

fn reference(base: &TinyMlp, mut optim: ModuleOptimizer) -> (Vec<f32>, Vec<f32>) {
    reference_loop(base, STEPS, GLOBAL_BATCH, |_, model, grads| {
        optim.step(LR, model, grads)
    })
}

/// `steps` sharded steps from step `first` on this rank's rows; returns the global losses and
/// the final parameters.
fn train<O: burn_shard::MasterWeightStep>(
    comm_rank: (usize, usize),
    mut model: TinyMlp,
    optim: &mut burn_shard::ShardedOptimizer<O>,
    first: usize,
    steps: usize,
) -> (TinyMlp, Vec<f32>) {
    let device = Device::flex().autodiff();
    let (lo, hi) = rank_rows(comm_rank.0, comm_rank.1, GLOBAL_BATCH);
    let mut losses = Vec::new();
    for step in first..first + steps {
        let (x, y) = batch(step, GLOBAL_BATCH);
        let loss = mse(&model, rows(&x, IN, lo, hi, &device), rows(&y, OUT, lo, hi, &device));
        let (next, global) = sharded_step(optim, model, loss, LR);
        model = next;
        losses.push(global);
    }
    (model, losses)
}

fn run(comm: InProcessComm, config: ShardConfig, base: &TinyMlp, case: Case) -> (Vec<f32>, Vec<f32>) {
    let device = Device::flex().autodiff();
    let rank = (comm.rank(), comm.world_size());
    let (model, mut optim) = config
        .init(base.clone().fork(&device), case.sharded(), comm)
        .expect("init");
    let (model, losses) = train(rank, model, &mut optim, 0, STEPS);
    (losses, params_of(&model.clone().materialize()))
}

/// Runs `case` on `world_size` rank threads; checks that every rank holds the same parameters
/// and returns rank 0's losses and parameters.
fn on_ranks(world_size: usize, config: &ShardConfig, base: &TinyMlp, case: Case) -> (Vec<f32>, Vec<f32>) {
    let group = InProcessGroup::new(world_size).unwrap();
    let results = run_ranks(group, |comm| run(comm, config.clone(), base, case)).expect("no rank panics");
    for (rank, (_, params)) in results.iter().enumerate().skip(1) {
        assert_eq!(
            params, &results[0].1,
            "{case:?}: rank {rank} holds other parameters than rank 0"
        );
    }
    results.into_iter().next().unwrap()
}

fn assert_close(ctx: &str, got: &(Vec<f32>, Vec<f32>), want: &(Vec<f32>, Vec<f32>), tolerance: f32) {
    for (step, (a, b)) in got.0.iter().zip(&want.0).enumerate() {
        let rel = (a - b).abs() / b.abs().max(1e-12);
        assert!(
            rel <= tolerance,
            "{ctx}: step {step}: loss {a} vs Burn's {b} (rel {rel:e})"
        );
    }
    let diff = max_abs_diff(&got.1, &want.1);
    assert!(diff <= tolerance, "{ctx}: max |param - Burn's| = {diff:e}");
}

fn base() -> TinyMlp {
    let device = Device::flex().autodiff();
    device.seed(11);
    TinyMlp::new(&device)
}

/// The class: every optimizer that reads whole parameters, alone or as a group beside AdamW,
/// at stages 0-3 x world sizes 1-4, against Burn's `ModuleOptimizer`
/// with the same groups: 20 steps within 1e-4, bitwise on one rank. World sizes 2-4 hold
/// `TinyMlp`'s matrices whole although the flat layout would cut them (checked); stage 3 keeps
/// them as shards and gathers each to its owner for the step.
#[test]
fn every_whole_parameter_optimizer_matches_burn_at_stages_0_to_3() {
    let base = base();
    let adamw = reference(&base, AdamWConfig::new().init());
    // The flat layout cuts `l1.weight` (elements 0..35 of a 35 + 7 + 21 + 3 + 1 bucket) across
    // ranks 0 and 1 at world size 2: the whole-parameter layout must not.
    let flat = FlatLayout::from_module(&base, 2, 1 << 20).unwrap();
    let l1 = flat.slots().iter().position(|s| s.path == "l1.weight").unwrap();
    assert!(!flat.owned_whole(l1), "the flat layout was expected to cut l1.weight");
    for case in CASES {
        let want = reference(&base, case.burn());
        if !matches!(case, Case::WholeAdamW) {
            let diff = max_abs_diff(&want.1, &adamw.1);
            assert!(
                diff > 1e-3,
                "{case:?} must train differently from AdamW (max diff {diff:e})"
            );
        }
        for world_size in 1..=4 {
            for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
                let got = on_ranks(world_size, &ShardConfig::new(stage), &base, case);
                let ctx = format!("{case:?}, world size {world_size}, {stage:?}");
                match world_size {
                    1 => assert_eq!(got, want, "{ctx}: one rank must be bitwise Burn's"),
                    _ => assert_close(&ctx, &got, &want, 1e-4),
                }
            }
        }
    }
}

/// Muon really orthogonalises (DeepSpeed#8441 trained plain SGD with momentum under the name):
/// Burn's Muon and SGD with Muon's momentum differ, and the sharded Muon (stage 2 over 2 ranks)
/// is Burn's Muon.
#[test]
fn sharded_muon_is_not_sgd_with_momentum() {
    let base = base();
    let muon = reference(&base, Case::MuonWithAdamW.burn());
    let momentum = MomentumConfig {
        momentum: 0.95,
        dampening: 0.0,
        nesterov: true,
    };
    let sgd =
        AdamWConfig::new()
            .init()
            .with_group(matrices(), SgdConfig::new().with_momentum(Some(momentum)).build(), None);
    let sgd = reference(&base, sgd);
    let diff = max_abs_diff(&muon.1, &sgd.1);
    assert!(
        diff > 1e-3,
        "Muon and SGD with momentum must differ (max diff {diff:e})"
    );
    let got = on_ranks(2, &ShardConfig::new(Stage::Two), &base, Case::MuonWithAdamW);
    assert_close("Muon at stage 2 over 2 ranks", &got, &muon, 1e-4);
}

/// Hybrid sharding (2 replicas of 2-rank shard groups) with Muon and AdamW: Burn's numbers.
#[test]
fn muon_with_hsdp_2x2_matches_burn() {
    let base = base();
    let want = reference(&base, Case::MuonWithAdamW.burn());
    for stage in [Stage::One, Stage::Two, Stage::Three] {
        let config = ShardConfig::new(stage).with_replicas(2);
        let got = on_ranks(4, &config, &base, Case::MuonWithAdamW);
        assert_close(&format!("HSDP 2x2, {stage:?}"), &got, &want, 1e-4);
    }
}

/// Muon's, LAMB's and Adafactor's state (its row and column statistics saved whole by their
/// owner, with their shapes) saved at one stage and world size resumes at another: stage 2
/// over 2 ranks -> stage 1 over 3 (another layout: LAMB's and Adafactor's biases and `scale`
/// change owners, the matrices keep theirs), stage 3 over 3 -> stage 3 over 2 (other owners),
/// stage 1 over 2 -> stage 3 over 4, stage 3 over 2 with the parameter shards on disk -> stage 2
/// over 3: the 20 steps equal Burn's uninterrupted run within 1e-4.
/// `ckpt consolidate`'s optimizer record loads into Burn's own `ModuleOptimizer`, which then
/// continues as the uninterrupted run; the offline reshard refuses Adafactor's factored state,
/// naming the fix.
#[test]
fn whole_parameter_state_resumes_at_another_world_size() {
    let base = base();
    // (stage, ranks, the parameter shards on disk) saving, then (stage, ranks) loading.
    let legs = [
        ((Stage::Two, 2, false), (Stage::One, 3)),
        ((Stage::Three, 3, false), (Stage::Three, 2)),
        ((Stage::One, 2, false), (Stage::Three, 4)),
        ((Stage::Three, 2, true), (Stage::Two, 3)),
    ];
    for case in [Case::MuonWithAdamW, Case::Lamb, Case::Adafactor] {
        for ((save_stage, save_ranks, on_disk), (load_stage, load_ranks)) in legs {
            let want = reference(&base, case.burn());
            let root = scratch("whole_params", &format!("{case:?}-{save_stage:?}{save_ranks}{on_disk}"));
            let shards = root.join("shards");
            std::fs::create_dir_all(&shards).unwrap();
            let save_config = match on_disk {
                true => ShardConfig::new(save_stage).with_params_on(Home::Disk(shards.as_path().into())),
                false => ShardConfig::new(save_stage),
            };
            let dir = root.join("step-10");
            let half = STEPS / 2;
            let group = InProcessGroup::new(save_ranks).unwrap();
            let first = run_ranks(group, |comm| {
                let device = Device::flex().autodiff();
                let rank = (comm.rank(), comm.world_size());
                let (model, mut optim) = save_config
                    .clone()
                    .init(base.clone().fork(&device), case.sharded(), comm)
                    .expect("init");
                let (model, losses) = train(rank, model, &mut optim, 0, half);
                optim
                    .save_checkpoint(&model, &dir, serde_json::Value::Null)
                    .expect("save");
                losses
            })
            .expect("no rank panics");
            let group = InProcessGroup::new(load_ranks).unwrap();
            let second = run_ranks(group, |comm| {
                let device = Device::flex().autodiff();
                let rank = (comm.rank(), comm.world_size());
                let (model, mut optim) = ShardConfig::new(load_stage)
                    .init(base.clone().fork(&device), case.sharded(), comm)
                    .expect("init");
                let (model, _) = optim.load_checkpoint(model, &dir).expect("load");
                let (model, losses) = train(rank, model, &mut optim, half, STEPS - half);
                (losses, params_of(&model.clone().materialize()))
            })
            .expect("no rank panics");
            let losses = first[0].iter().chain(&second[0].0).copied().collect();
            let ctx =
                format!("{case:?} saved at {save_stage:?} x {save_ranks}, resumed at {load_stage:?} x {load_ranks}");
            assert_close(&ctx, &(losses, second[0].1.clone()), &want, 1e-4);

            // Burn's own optimizer from the consolidated record, on the consolidated model (loaded
            // from its file, as docs/checkpoints.md says: the record's states are keyed by its ids).
            let record = root.join("optimizer.bpk");
            burn_shard::checkpoint::consolidate(&dir, &record, burn_shard::checkpoint::Selection::OptimizerState)
                .expect("consolidate");
            let mut optim = case.burn().load(&record).expect("Burn loads the record");
            let model_file = root.join("model.bpk");
            burn_shard::checkpoint::consolidate(&dir, &model_file, burn_shard::checkpoint::Selection::All)
                .expect("consolidate the model");
            let model = base.clone().fork(&Device::flex().autodiff()).load_file(&model_file);
            let rest = reference_from(model.clone(), half, &mut optim);
            let diff = max_abs_diff(&rest, &want.1);
            assert!(
                diff <= 1e-4,
                "{ctx}: Burn resumed from the consolidated record differs by {diff:e}"
            );
            // A fresh optimizer does not: the record matters.
            let fresh = reference_from(model, half, &mut case.burn());
            assert!(
                max_abs_diff(&fresh, &want.1) > 1e-3,
                "{ctx}: a fresh optimizer continues alike"
            );

            let resharded = burn_shard::checkpoint::reshard(&dir, 4, root.join("resharded"));
            match case {
                Case::Adafactor => {
                    let e = resharded.expect_err("refused").to_string();
                    assert!(e.contains("factored") && e.contains("load_checkpoint"), "{e}");
                }
                _ => {
                    resharded.expect("reshard");
                }
            }
        }
    }
}

/// Burn's single-device loop from step `first` to `STEPS` on `model` with `optim`: the final
/// parameters.
fn reference_from(mut model: TinyMlp, first: usize, optim: &mut ModuleOptimizer) -> Vec<f32> {
    let device = Device::flex().autodiff();
    for step in first..STEPS {
        let (x, y) = batch(step, GLOBAL_BATCH);
        let loss = mse(
            &model,
            rows(&x, IN, 0, GLOBAL_BATCH, &device),
            rows(&y, OUT, 0, GLOBAL_BATCH, &device),
        );
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    params_of(&model.clone().materialize())
}

/// Every rank fails `init` (or `with_group`) with the parameter, its shape and the fix: Muon
/// given 1-D parameters (Burn's Muon would panic, also at stage 3, whose shards are 1-D), a
/// Muon group added after `init` at stage 2, and a group of another type on a base that is not
/// type-erased.
#[test]
fn what_cannot_be_stepped_whole_is_refused_on_every_rank_with_the_fix() {
    let base = base();
    // Muon alone: the biases and `scale` are 1-D.
    for e in init_errors(2, ShardConfig::new(Stage::Two), || {
        OptimizerGroups::new(MuonConfig::new())
    }) {
        assert!(e.contains("l1.bias") && e.contains("[7]") && e.contains("2-D"), "{e}");
    }
    for e in init_errors(3, ShardConfig::new(Stage::Three), || {
        OptimizerGroups::new(MuonConfig::new())
    }) {
        assert!(e.contains("l1.bias") && e.contains("[7]") && e.contains("2-D"), "{e}");
    }
    let muon = || OptimizerGroups::new(AdamWConfig::new()).with_group(matrices(), MuonConfig::new(), None);
    // After init: a Muon group at stage 2 (the layout cut the matrices), and a group of another
    // type on a base that is not type-erased.
    let late = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (_, optim) = ShardConfig::new(Stage::Two)
            .init(
                base.clone().fork(&device),
                OptimizerGroups::new(AdamWConfig::new()),
                comm,
            )
            .expect("init");
        optim
            .with_group(matrices(), MuonConfig::new(), None)
            .err()
            .expect("refused")
            .to_string()
    })
    .expect("no rank panics");
    let other = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (_, optim) = ShardConfig::new(Stage::Two)
            .init(base.clone().fork(&device), AdamWConfig::new(), comm)
            .expect("init");
        let refused = optim.with_group(matrices(), SgdConfig::new().build(), None);
        refused.err().expect("refused").to_string()
    })
    .expect("no rank panics");
    let refused = late.into_iter().zip(other);
    for (late, other) in refused {
        assert!(late.contains("l1.weight") && late.contains("OptimizerGroups"), "{late}");
        assert!(other.contains("OptimizerGroups"), "{other}");
    }
    // Burn's Muon through `whole_params` is checked as Muon is.
    let whole_muon = || AnyOptimizer::whole_params(MuonConfig::new().build());
    for e in init_errors(2, ShardConfig::new(Stage::Two), whole_muon) {
        assert!(e.contains("l1.bias") && e.contains("2-D"), "{e}");
    }
    // An OptimizerGroups with groups given to with_group: its groups would be dropped.
    let dropped = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (_, optim) = ShardConfig::new(Stage::Zero)
            .init(
                base.clone().fork(&device),
                OptimizerGroups::new(AdamWConfig::new()),
                comm,
            )
            .expect("init");
        let groups = OptimizerGroups::new(AdamWConfig::new()).with_group(matrices(), LambConfig::new(), None);
        optim
            .with_group(matrices(), groups, None)
            .err()
            .expect("refused")
            .to_string()
    })
    .expect("no rank panics");
    for e in dropped {
        assert!(e.contains("would drop"), "{e}");
    }
    // Ranks given different groups fail together at `init`, none waits for another.
    let started = std::time::Instant::now();
    let differ = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let groups = match comm.rank() {
            0 => muon(),
            _ => OptimizerGroups::new(AdamWConfig::new()).with_group(matrices(), LambConfig::new(), None),
        };
        let result = ShardConfig::new(Stage::Zero).init(base.clone().fork(&device), groups, comm);
        result.err().expect("refused").to_string()
    })
    .expect("no rank panics");
    assert!(started.elapsed().as_secs() < 10, "within seconds");
    for e in differ {
        assert!(
            e.contains("differ") || e.contains("mismatch") || e.contains("Mismatch"),
            "{e}"
        );
    }
}

/// `init`'s error on every rank of `world_size`, each rank building its optimizer with `optim`.
fn init_errors<C: IntoOptimizer>(world_size: usize, config: ShardConfig, optim: impl Fn() -> C + Sync) -> Vec<String> {
    let base = base();
    let group = InProcessGroup::new(world_size).unwrap();
    let errors = run_ranks(group, |comm| {
        let device = Device::flex().autodiff();
        match config.clone().init(base.clone().fork(&device), optim(), comm) {
            Ok(_) => "init succeeded".to_string(),
            Err(e) => e.to_string(),
        }
    })
    .expect("no rank panics");
    assert_eq!(errors.len(), world_size);
    errors
}

/// Muon and AdamW on bf16 parameters with `f32` masters (Newton-Schulz on the master) against
/// Burn's `ModuleOptimizer` with the same groups on an `f32` master model fed the `f32`-cast
/// gradients of its bf16 copy: every final weight within two bf16 ulps of the reference's, at
/// stages 0-3 over 1, 2 and 4 ranks, and weights whose updates round away in plain bf16 move.
#[test]
fn muon_on_bf16_parameters_steps_the_f32_master() {
    use burn::tensor::DType;
    const LR16: f64 = 2e-4;
    let base = base();
    let device = Device::flex().autodiff();
    let bf16_rows = |data: &[f32], width, lo, hi, device: &Device| rows(data, width, lo, hi, device).cast(DType::BF16);
    // The reference: the f32 master stepped by Burn with the f32-cast gradients of its bf16 copy.
    let mut master = base.clone().fork(&device);
    let mut optim = Case::MuonWithAdamW.burn();
    for step in 0..STEPS {
        let model = cast(master.clone(), DType::BF16);
        let (x, y) = batch(step, GLOBAL_BATCH);
        let loss = mse(
            &model,
            bf16_rows(&x, IN, 0, GLOBAL_BATCH, &device),
            bf16_rows(&y, OUT, 0, GLOBAL_BATCH, &device),
        );
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let grads = grads_to_f32(&model, grads);
        master = optim.step(LR16, master, grads);
    }
    let want = params_of(&cast(master, DType::BF16));
    let start = params_of(&cast(base.clone(), DType::BF16));
    let stuck = bf16_stuck(&start, &want, LR16);
    assert!(
        stuck.len() >= 5,
        "the reference must move bf16-stuck weights ({})",
        stuck.len()
    );
    let base16 = cast(base, DType::BF16);
    for world_size in [1, 2, 4] {
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            let ctx = format!("bf16, world size {world_size}, {stage:?}");
            let runs = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
                let device = Device::flex().autodiff();
                let (lo, hi) = rank_rows(comm.rank(), world_size, GLOBAL_BATCH);
                let (mut model, mut optim) = ShardConfig::new(stage)
                    .init(base16.clone().fork(&device), Case::MuonWithAdamW.sharded(), comm)
                    .expect("init");
                for step in 0..STEPS {
                    let (x, y) = batch(step, GLOBAL_BATCH);
                    let loss = mse(
                        &model,
                        bf16_rows(&x, IN, lo, hi, &device),
                        bf16_rows(&y, OUT, lo, hi, &device),
                    );
                    model = sharded_step(&mut optim, model, loss, LR16).0;
                }
                params_of(&model.clone().materialize())
            })
            .expect("no rank panics");
            for (rank, got) in runs.iter().enumerate() {
                for i in 0..got.len() {
                    // Within two bf16 ulps: the f32 masters differ by rounding (the fused AdamW
                    // step against Burn's, gradient sums split by rank), which a bf16 rounding
                    // can turn into one ulp and 20 steps into two, for some initial weights.
                    let diff = (got[i] - want[i]).abs();
                    assert!(
                        diff <= 2.0 * ulp(want[i]),
                        "{ctx} rank {rank} param {i}: {} vs {}",
                        got[i],
                        want[i]
                    );
                }
                let unmoved = stuck.iter().filter(|&&i| got[i] == start[i]).count();
                assert_eq!(unmoved, 0, "{ctx} rank {rank}: updates below bf16 resolution were lost");
            }
        }
    }
}

/// Gradient accumulation (two micro-batches a step, the loss halved) with per-parameter
/// clipping on the Muon group (`Norm(0.05)`, which the first steps' gradients exceed): Burn's
/// full-batch run with the same clipping, at stages 0-3 over 2 and 3 ranks, within 1e-4.
#[test]
fn muon_with_accumulation_and_group_clipping_matches_burn() {
    use burn::optim::grad_clipping::GradientClipping;
    let base = base();
    let clip = || Some(GradientClipping::Norm(0.05));
    let burn = AdamWConfig::new()
        .init()
        .with_group(matrices(), MuonConfig::new().build(), clip());
    let want = reference(&base, burn);
    let unclipped = reference(&base, Case::MuonWithAdamW.burn());
    assert!(max_abs_diff(&want.1, &unclipped.1) > 1e-4, "the clipping must bite");
    for world_size in [2, 3] {
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            let runs = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
                let device = Device::flex().autodiff();
                let (lo, hi) = rank_rows(comm.rank(), world_size, GLOBAL_BATCH);
                let groups = OptimizerGroups::new(AdamWConfig::new()).with_group(matrices(), MuonConfig::new(), clip());
                let (mut model, mut optim) = ShardConfig::new(stage)
                    .init(base.clone().fork(&device), groups, comm)
                    .expect("init");
                let mid = lo + (hi - lo) / 2;
                let mut losses = Vec::new();
                for step in 0..STEPS {
                    let (x, y) = batch(step, GLOBAL_BATCH);
                    let half = |a, b| {
                        let loss = mse(&model, rows(&x, IN, a, b, &device), rows(&y, OUT, a, b, &device));
                        loss.mul_scalar((b - a) as f32 / (hi - lo) as f32)
                    };
                    let first = half(lo, mid);
                    let first_value = first.clone().into_scalar::<f32>();
                    optim
                        .accumulate(&model, GradientsParams::from_grads(first.backward(), &model))
                        .expect("accumulate");
                    let second = half(mid, hi);
                    let (next, global) = sharded_step(&mut optim, model, second, LR);
                    model = next;
                    // The step's global loss is the mean of the second halves; add the first's.
                    let first_global = optim
                        .comm()
                        .all_reduce(
                            Tensor::<1>::from_floats([first_value], &Device::flex()),
                            burn_shard_comm::ReduceOp::Avg,
                        )
                        .expect("all_reduce")
                        .into_scalar::<f32>();
                    losses.push(first_global + global);
                }
                (losses, params_of(&model.clone().materialize()))
            })
            .expect("no rank panics");
            assert_close(
                &format!("accumulation + clipping, {world_size} ranks, {stage:?}"),
                &runs[0],
                &want,
                1e-4,
            );
        }
    }
}

/// The optimizer state on disk (`Home::Disk`, NVMe offload) with Muon's whole matrices and
/// AdamW's flat pieces, and with Adafactor's factored statistics: the same numbers as in
/// memory, bit for bit, at stages 1-3 over 2 ranks (each state rebuilt by its own optimizer,
/// with its shape, when read back; the swap file is read every step). Adafactor's state saved
/// from disk resumes in memory over 3 ranks as Burn's uninterrupted run.
#[test]
fn whole_parameter_state_on_disk_trains_bitwise_as_in_memory() {
    let base = base();
    for case in [Case::MuonWithAdamW, Case::Adafactor] {
        for stage in [Stage::One, Stage::Two, Stage::Three] {
            let memory = on_ranks(2, &ShardConfig::new(stage), &base, case);
            let dir = scratch("whole_params", &format!("nvme-{case:?}-{stage:?}"));
            let disk = ShardConfig::new(stage).with_optimizer_state_on(Home::Disk(burn_shard::NvmeOffload::new(&dir)));
            let runs = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
                let device = Device::flex().autodiff();
                let rank = (comm.rank(), comm.world_size());
                let (model, mut optim) = disk
                    .clone()
                    .init(base.clone().fork(&device), case.sharded(), comm)
                    .expect("init");
                let (model, losses) = train(rank, model, &mut optim, 0, STEPS);
                assert!(optim.report().nvme_io_bytes().0 > 0, "the swap file was read");
                (losses, params_of(&model.clone().materialize()))
            })
            .expect("no rank panics");
            assert_eq!(
                runs[0], memory,
                "{case:?}, {stage:?}: the state on disk must train as in memory"
            );
        }
    }
    // Saved from disk (the factored statistics read from the swap file with their shapes).
    let want = reference(&base, Case::Adafactor.burn());
    let root = scratch("whole_params", "nvme-save");
    let ckpt = root.join("step-10");
    std::fs::create_dir_all(root.join("swap")).unwrap();
    let disk = ShardConfig::new(Stage::Two)
        .with_optimizer_state_on(Home::Disk(burn_shard::NvmeOffload::new(root.join("swap"))));
    let first = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let rank = (comm.rank(), comm.world_size());
        let (model, mut optim) = disk
            .clone()
            .init(base.clone().fork(&device), Case::Adafactor.sharded(), comm)
            .expect("init");
        let (model, losses) = train(rank, model, &mut optim, 0, STEPS / 2);
        optim
            .save_checkpoint(&model, &ckpt, serde_json::Value::Null)
            .expect("save");
        losses
    })
    .expect("no rank panics");
    let second = run_ranks(InProcessGroup::new(3).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let rank = (comm.rank(), comm.world_size());
        let (model, mut optim) = ShardConfig::new(Stage::One)
            .init(base.clone().fork(&device), Case::Adafactor.sharded(), comm)
            .expect("init");
        let (model, _) = optim.load_checkpoint(model, &ckpt).expect("load");
        let (model, losses) = train(rank, model, &mut optim, STEPS / 2, STEPS / 2);
        (losses, params_of(&model.clone().materialize()))
    })
    .expect("no rank panics");
    let losses = first[0].iter().chain(&second[0].0).copied().collect();
    assert_close(
        "Adafactor saved from disk, resumed",
        &(losses, second[0].1.clone()),
        &want,
        1e-4,
    );
}

/// Stage 3 with the parameter and gradient shards on disk (`Home::Disk` for the parameters,
/// NVMe parameter offload): Muon's matrices, read from the shard file and exchanged with their
/// owners, train bitwise as with the shards in memory, over 2 and 3 ranks, `f32`, `bf16` and
/// `f16` (with loss scaling: the gradient exchanged in `f32`).
#[test]
fn whole_parameters_with_shards_on_disk_train_bitwise_as_in_memory() {
    use burn::tensor::DType;

    use crate::nvme_offload::{assert_same_training, config, run};
    let base = base();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for world_size in [2, 3] {
            let dir = scratch("whole_params", &format!("shards-{dtype:?}-{world_size}"));
            let plain = config(Stage::Three, dtype);
            let disk = plain.clone().with_params_on(Home::Disk(dir.as_path().into()));
            let optim = Case::MuonWithAdamW.sharded();
            let memory = run(&Device::flex(), world_size, &base, &plain, optim.clone(), dtype);
            let stored = run(&Device::flex(), world_size, &base, &disk, optim, dtype);
            for (rank, (m, s)) in memory.into_iter().zip(stored).enumerate() {
                let ctx = format!("{dtype:?}, {world_size} ranks, rank {rank}");
                let s = s.unwrap_or_else(|e| panic!("{ctx}: {e}"));
                assert_same_training(&ctx, &m.expect("in memory"), &s);
            }
        }
    }
}

/// At stage 3 a Muon group added with `with_group` after `init` (the base an `AnyOptimizer`)
/// gives its matrices owners there and trains as Burn's `ModuleOptimizer` with the group,
/// within 1e-4 over 2 and 3 ranks; each rank reports the matrices it steps whole, every matrix
/// on exactly one rank.
#[test]
fn a_whole_parameter_group_added_after_init_at_stage_3_matches_burn() {
    let base = base();
    let want = reference(&base, Case::MuonWithAdamW.burn());
    for world_size in [2, 3] {
        let runs = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
            let device = Device::flex().autodiff();
            let rank = (comm.rank(), comm.world_size());
            let (model, optim) = ShardConfig::new(Stage::Three)
                .init(
                    base.clone().fork(&device),
                    OptimizerGroups::new(AdamWConfig::new()),
                    comm,
                )
                .expect("init");
            let mut optim = optim
                .with_group(matrices(), MuonConfig::new(), None)
                .expect("with_group");
            let stepped: Vec<String> = optim
                .report()
                .stepped_whole()
                .into_iter()
                .map(|(path, _)| path)
                .collect();
            let (model, losses) = train(rank, model, &mut optim, 0, STEPS);
            ((losses, params_of(&model.clone().materialize())), stepped)
        })
        .expect("no rank panics");
        let mut stepped: Vec<String> = runs.iter().flat_map(|(_, s)| s.clone()).collect();
        stepped.sort();
        assert_eq!(
            stepped,
            ["l1.weight", "l2.weight"],
            "{world_size} ranks: each matrix on one rank"
        );
        assert_close(
            &format!("with_group at stage 3, {world_size} ranks"),
            &runs[0].0,
            &want,
            1e-4,
        );
    }
}

/// Tied (`embed`: the input projection and the head), frozen and unused parameters
/// (stage3.rs's `Net3`, three `unit`s): Muon for the 2-D ones (the tied embedding and the
/// blocks' weights) beside AdamW, and LAMB for all, at stages 0-3 x world sizes 1-4 against
/// Burn's `ModuleOptimizer`: within 1e-4, bitwise on one rank, the frozen and unused
/// parameters never moved (`check_equivalence`).
#[test]
fn tied_frozen_and_unused_parameters_with_whole_parameter_optimizers_match_burn() {
    use crate::stage3::check_equivalence;
    let two_d = || ParamGroup::from_regex(r"^(embed|blocks\.\d+\.weight)$").expect("a valid regex");
    for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
        check_equivalence(
            "Muon+AdamW",
            AdamWConfig::new()
                .init()
                .with_group(two_d(), MuonConfig::new().build(), None),
            OptimizerGroups::new(AdamWConfig::new()).with_group(two_d(), MuonConfig::new(), None),
            ShardConfig::new(stage),
        );
        check_equivalence(
            "LAMB",
            LambConfig::new().init(),
            OptimizerGroups::new(LambConfig::new()),
            ShardConfig::new(stage),
        );
    }
}

/// `init_pretrained` with Muon groups: a model whose values come from a safetensors file (each
/// rank reads only its share at stage 3) trains as Burn's `ModuleOptimizer` from those values,
/// at stages 0-3 over 2 and 3 ranks, within 1e-4; the model given holds other (lazy) values.
#[test]
fn init_pretrained_with_muon_groups_matches_burn() {
    use burn_store::{ModuleSnapshot, SafetensorsStore};
    let base = base();
    let want = reference(&base, Case::MuonWithAdamW.burn());
    let file = scratch("whole_params", "pretrained").join("model.safetensors");
    base.clone()
        .save_into(&mut SafetensorsStore::from_file(&file))
        .expect("save");
    for world_size in [2, 3] {
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            let runs = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
                let device = Device::flex().autodiff();
                device.seed(99);
                let rank = (comm.rank(), comm.world_size());
                let pretrained = burn_shard::Pretrained::safetensors(&file);
                let (model, mut optim) = ShardConfig::new(stage)
                    .init_pretrained(TinyMlp::new(&device), pretrained, Case::MuonWithAdamW.sharded(), comm)
                    .expect("init_pretrained");
                let (model, losses) = train(rank, model, &mut optim, 0, STEPS);
                (losses, params_of(&model.clone().materialize()))
            })
            .expect("no rank panics");
            assert_close(
                &format!("init_pretrained, {world_size} ranks, {stage:?}"),
                &runs[0],
                &want,
                1e-4,
            );
        }
    }
}
