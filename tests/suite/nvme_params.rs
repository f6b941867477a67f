//! NVMe offload of stage-3 parameter shards (`ShardConfig::with_params_on(Home::Disk(..))`,
//! ZeRO-Infinity's `offload_param: {device: nvme}`): each rank's shards live in one file between
//! uses. On Burn's Flex CPU device, where the same kernels run either way, training with it gives
//! bitwise the parameters of training with the shards in memory, at world sizes 1-4, in `f32` and
//! `bf16`/`f16` with masters, alone and with the optimizer state on disk too; checkpoints are the
//! same files and load into either; the shard file has no name while the job runs, so nothing
//! can damage it and nothing is left after the job; a full disk fails the step on every rank; a
//! dynamic loss scale that grows at a step unscales the gradient shards stored on disk by the
//! scale their backward used, as in memory.

use std::path::{Path, PathBuf};

use burn::optim::{AdamWConfig, GradientsParams};
use burn::prelude::*;
use burn::tensor::DType;
use burn_shard::{Home, LossScaler, NvmeOffload, ShardConfig, ShardError, Stage};
use burn_shard_comm::{InProcessGroup, run_ranks};

use crate::common::*;
use crate::nvme_offload::{
    GLOBAL_BATCH, LR, STEPS, Span, assert_disk_full, assert_same_training, base, config, run, run_child, train_span,
};

/// The same training with the shards in memory and in `dir`, optionally with the optimizer
/// state on disk too, gathered parameter by parameter or unit by unit: bitwise the same losses
/// and parameters on every rank; no parameter bytes in memory, the shards counted on disk
/// instead; no gradient bytes held by the step (the gradient shards go to disk as backward
/// reduces them); the files removed at the end.
fn check_against_memory(ctx: &str, world_size: usize, dtype: DType, units: &[&str], with_state: bool, dir: &Path) {
    let base = base();
    let plain = config(Stage::Three, dtype).with_units(units.to_vec());
    let mut nvme = plain.clone().with_params_on(Home::Disk(dir.into()));
    if with_state {
        nvme = nvme.with_optimizer_state_on(Home::Disk(NvmeOffload::new(dir)));
    }
    let adamw = AdamWConfig::new().with_weight_decay(0.1);
    let memory = run(&Device::flex(), world_size, &base, &plain, adamw.clone(), dtype);
    let stored = run(&Device::flex(), world_size, &base, &nvme, adamw, dtype);
    for (rank, (m, s)) in memory.into_iter().zip(stored).enumerate() {
        let ctx = format!("{ctx}, rank {rank}");
        let (m, s) = (m.expect("in-memory run"), s.unwrap_or_else(|e| panic!("{ctx}: {e}")));
        assert_same_training(&ctx, &m, &s);
        let (m, s) = (m.report, s.report);
        assert!(m.parameters_bytes > 0 && m.disk_bytes == 0, "{ctx}: {m:?}");
        assert_eq!(s.parameters_bytes, 0, "{ctx}: no parameter bytes in memory: {s:?}");
        let state_on_disk = if with_state { m.optimizer_state_bytes } else { 0 };
        assert_eq!(
            s.disk_bytes,
            m.parameters_bytes + state_on_disk,
            "{ctx}: the shards (and the state) are on disk instead"
        );
        assert!(m.gradients_bytes > 0, "{ctx}: {m:?}");
        assert_eq!(
            s.gradients_bytes, 0,
            "{ctx}: the gradient shards went to disk, never held by the step"
        );
    }
    assert!(entries(dir).is_empty(), "{ctx}: files left: {:?}", entries(dir));
}

/// World sizes 1-4 × `f32`, `bf16` and `f16` (masters, loss scaling) × gathered per parameter
/// or per unit (grouped gathers read a unit's shards together) × the optimizer state in memory
/// or on disk too, with AdamW.
#[test]
fn nvme_param_offload_trains_bitwise_as_in_memory_at_every_world_size() {
    let dir = scratch("nvme-params", "sweep");
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for world_size in 1..=4 {
            for units in [&[][..], &["l1", "l2"]] {
                for with_state in [false, true] {
                    let ctx =
                        format!("{dtype:?}, world_size {world_size}, units {units:?}, state on disk {with_state}");
                    check_against_memory(&ctx, world_size, dtype, units, with_state, &dir);
                }
            }
        }
    }
}

/// One rank's parameters as bits, and its loss scale and skipped steps where a scaler is set.
type RankOutcome = (Vec<u32>, Option<(f32, usize)>);

/// Rank `comm.rank()` trains `STEPS` steps of 3 micro-batches each (`accumulate` twice, then
/// `step`) with `config` (the caller's config may clip or scale the loss), in `dtype`; returns its
/// parameters' bits, and the loss scale and skipped steps at the end where a scaler is set.
fn accumulate_rank<C: burn_shard_comm::Collective + 'static>(
    comm: C,
    base: &TinyMlp,
    config: &ShardConfig,
    dtype: DType,
) -> RankOutcome {
    let device = Device::flex().autodiff();
    let (rank, world_size) = (comm.rank(), comm.world_size());
    let model = cast(base.clone().fork(&device), dtype);
    let (mut model, mut optim) = config.init(model, AdamWConfig::new(), comm).unwrap();
    let (start, end) = rank_rows(rank, world_size, GLOBAL_BATCH);
    for step in 0..STEPS {
        for micro in 0..3 {
            let (x, y) = batch(3 * step + micro, GLOBAL_BATCH);
            let x = rows(&x, IN, start, end, &device).cast(dtype);
            let y = rows(&y, OUT, start, end, &device).cast(dtype);
            let loss = mse(&model, x, y).div_scalar(3.0);
            let grads = GradientsParams::from_grads(optim.scale_loss(loss).backward(), &model);
            match micro {
                2 => model = optim.step(LR, model, grads).unwrap(),
                _ => optim.accumulate(&model, grads).unwrap(),
            }
        }
    }
    let scaler = optim.loss_scaler().map(|s| (s.scale(), s.skipped_steps()));
    (
        params_of(&model.materialize()).iter().map(|p| p.to_bits()).collect(),
        scaler,
    )
}

/// [`accumulate_rank`] on `world_size` ranks as threads; each rank's result.
fn accumulate_ranks(world_size: usize, base: &TinyMlp, config: &ShardConfig, dtype: DType) -> Vec<RankOutcome> {
    run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
        accumulate_rank(comm, base, config, dtype)
    })
    .expect("no rank panics")
}

/// Gradient accumulation and clipping read the gradient shards from disk as the in-memory
/// path holds them: 3 micro-batches per step (`accumulate`, summed in `f32` for `bf16`/`f16`
/// as in memory), global-norm clipping (the norms read the shards once more), at world sizes
/// 1-3, `f32`, `bf16` and `f16` (with loss scaling): bitwise the parameters of the same
/// training in memory.
#[test]
fn accumulation_and_clipping_with_gradient_shards_on_disk_match_memory() {
    let dir = scratch("nvme-params", "accumulate");
    // Built once: ranks building it at once would draw from the seeded generator in turn.
    let base = base();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for world_size in 1..=3 {
            let ctx = format!("{dtype:?}, world_size {world_size}");
            let plain = config(Stage::Three, dtype).with_max_grad_norm(0.05);
            let stored = plain.clone().with_params_on(Home::Disk(NvmeOffload::new(&dir)));
            let run = |config: &ShardConfig| accumulate_ranks(world_size, &base, config, dtype);
            let (memory, on_disk) = (run(&plain), run(&stored));
            assert!(memory == on_disk, "{ctx}: parameters differ from the in-memory run's");
            assert!(memory != run(&config(Stage::Three, dtype)), "{ctx}: the clipping clips");
            assert!(entries(&dir).is_empty(), "{ctx}: files left: {:?}", entries(&dir));
        }
    }
}

/// A loss scale that changes at a step (a dynamic scaler that grows after every finite step)
/// divides that step's gradients by the scale their losses were multiplied by, whether the
/// gradient shards are read from disk or held in memory: the update reads stored shards after
/// the scaler has measured the step and grown, so it must not take the scale anew (it did, and
/// divided by twice the scale on every step that grew it). World sizes 1-3, `f32`, `bf16` and
/// `f16`, 3 micro-batches per step: bitwise the in-memory run, the scale grown on every step.
#[test]
fn a_loss_scale_that_grows_at_a_step_unscales_stored_gradients_as_in_memory() {
    let dir = scratch("nvme-params", "growing-scale");
    let base = base();
    let scaler = LossScaler::dynamic().with_scale(256.0).with_growth_interval(1);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for world_size in 1..=3 {
            let ctx = format!("{dtype:?}, world_size {world_size}");
            let plain = ShardConfig::new(Stage::Three)
                .with_bucket_numel(64)
                .with_loss_scaler(scaler.clone());
            let stored = plain.clone().with_params_on(Home::Disk(NvmeOffload::new(&dir)));
            let run = |config: &ShardConfig| accumulate_ranks(world_size, &base, config, dtype);
            let (memory, on_disk) = (run(&plain), run(&stored));
            let grown = 256.0 * 2f32.powi(STEPS as i32);
            assert_eq!(memory[0].1, Some((grown, 0)), "{ctx}: the scale grew at every step");
            assert!(memory == on_disk, "{ctx}: parameters differ from the in-memory run's");
            assert!(entries(&dir).is_empty(), "{ctx}: files left: {:?}", entries(&dir));
        }
    }
}

/// A checkpoint saved with the shards on disk (2 ranks) is byte for byte the one saved with
/// them in memory (`meta.json` aside) and resumes in memory at 3 ranks; one saved in memory
/// resumes with the shards on disk at 3 ranks, into a model that already took a step (so the
/// loaded shards replace stored ones): both resumed runs end bitwise alike, and where 4
/// uninterrupted steps end (within 1e-6: other world sizes sum in another order).
#[test]
fn checkpoints_move_between_stored_and_resident_shards() {
    let dir = scratch("nvme-params", "checkpoints");
    let swap = dir.join("swap");
    std::fs::create_dir_all(&swap).unwrap();
    let resident = ShardConfig::new(Stage::Three);
    let stored = resident.clone().with_params_on(Home::Disk(NvmeOffload::new(&swap)));
    let base = base();
    let run = |world_size: usize, config: &ShardConfig, span: Span, steps: std::ops::Range<usize>| {
        let ranks = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
            train_span(comm, &base, config, DType::F32, &span, steps.clone())
        });
        ranks.expect("no rank panics").swap_remove(0)
    };
    let (from_disk, from_memory) = (dir.join("saved-stored"), dir.join("saved-resident"));
    let saving = |dir: &PathBuf| Span {
        save: Some(dir.clone()),
        ..Span::default()
    };
    run(2, &stored, saving(&from_disk), 0..2);
    run(2, &resident, saving(&from_memory), 0..2);
    assert!(
        checkpoint_files(&from_disk) == checkpoint_files(&from_memory),
        "the checkpoint saved with the shards on disk differs from the one saved with them in memory"
    );
    let in_memory = Span {
        resume: Some(from_disk),
        ..Span::default()
    };
    let on_disk = Span {
        resume: Some(from_memory),
        warm: true,
        ..Span::default()
    };
    let in_memory = run(3, &resident, in_memory, 2..4);
    let on_disk = run(3, &stored, on_disk, 2..4);
    assert!(in_memory == on_disk, "the two resumed runs differ");
    let reference = run(2, &resident, Span::default(), 0..4);
    let as_f32 = |bits: &[u32]| bits.iter().map(|b| f32::from_bits(*b)).collect::<Vec<_>>();
    let diff = max_abs_diff(&as_f32(&on_disk), &as_f32(&reference));
    assert!(diff <= 1e-6, "resumed vs uninterrupted: max |diff| = {diff:e}");
    assert!(entries(&swap).is_empty(), "files left: {:?}", entries(&swap));
}

/// Every entry of `dir`, whatever its name.
fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut all: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    all.sort();
    all
}

/// The shard file has no name while the job runs (it is unlinked as soon as it is made), so
/// nothing can delete, truncate or overwrite it, two jobs in one directory never share it, and
/// nothing is left after the job, even one killed or one whose autodiff graph outlives it: the
/// directory is empty while the shards are on disk, and a second job there trains too.
#[test]
fn the_shard_file_has_no_name_while_the_job_runs() {
    let dir = scratch("nvme-params", "unnamed");
    let config = ShardConfig::new(Stage::Three).with_params_on(Home::Disk(NvmeOffload::new(&dir)));
    let device = Device::flex().autodiff();
    let comm = InProcessGroup::new(1).unwrap().into_comms().pop().unwrap();
    let (model, optim) = config
        .init(base().fork(&device), AdamWConfig::new(), comm)
        .expect("init");
    let report = optim.report().memory(&model);
    assert!(report.disk_bytes > 0 && report.parameters_bytes == 0, "{report:?}");
    assert!(entries(&dir).is_empty(), "no file has a name: {:?}", entries(&dir));
    // A second job in the same directory, while the first holds its shards there.
    let second = run(&Device::flex(), 2, &base(), &config, AdamWConfig::new(), DType::F32);
    assert!(second.iter().all(Result::is_ok), "{second:?}");
    drop((model, optim));
    assert!(entries(&dir).is_empty(), "files left: {:?}", entries(&dir));
}

/// A disk that fills during training: the shard file's writes fail with "File too large"
/// under a file-size limit (`ulimit -f`, SIGXFSZ ignored), in a child process. `init` writes
/// the shards of the 5 parameters (a 4 KiB block each after the first block: 24 KiB); backward
/// writes the 5 gradient shards (44 KiB); the step writes each updated shard beside the old
/// one (64 KiB). Under 24 KiB ([`backward_disk_full_child`]) backward's writes fail, and the
/// step reports it; under 44 KiB ([`step_disk_full_child`]) the step's own writes fail. Either
/// way the step fails on both ranks within seconds, each naming its file, what was written,
/// "File too large" and the fix; nothing is left in the directory. A step whose own writes
/// failed is half applied: the next step and a save are refused, naming the resume. Under 8 KiB
/// ([`init_disk_full_child`]) `init`'s writes fail, and `init` returns that (its writes are
/// queued behind the sharding and waited for before it returns).
#[test]
fn a_disk_that_fills_mid_step_fails_the_step_with_the_shard_file_named() {
    let children = [
        ("8", "init_disk_full_child"),
        ("24", "backward_disk_full_child"),
        ("44", "step_disk_full_child"),
    ];
    for (limit, child) in children {
        let dir = scratch("nvme-params", &format!("disk-full-{limit}"));
        run_child(
            &format!("ulimit -f {limit}"),
            &format!("nvme_params::{child}"),
            "BURN_SHARD_DISK_FULL_DIR",
            &dir,
        );
        assert!(entries(&dir).is_empty(), "{child}: files left: {:?}", entries(&dir));
    }
}

/// Under the limit the parent set, `init` fits and training fails writing a `what` shard; a
/// failure in the step's own writes (`half_applied`) then refuses the next step and a save.
fn shard_disk_full(what: &str, half_applied: bool) {
    let dir = PathBuf::from(std::env::var_os("BURN_SHARD_DISK_FULL_DIR").expect("run by the parent test"));
    let config = ShardConfig::new(Stage::Three).with_params_on(Home::Disk(NvmeOffload::new(&dir)));
    // `init` fits under the limit: what fails below is training.
    let device = Device::flex().autodiff();
    let comm = InProcessGroup::new(1).unwrap().into_comms().pop().unwrap();
    drop(
        config
            .init(base().fork(&device), AdamWConfig::new(), comm)
            .expect("init fits"),
    );
    let started = std::time::Instant::now();
    assert_disk_full(
        &config,
        "burn-shard-rank{rank}-params.swap",
        &format!("writing a {what} shard"),
        half_applied,
    );
    assert!(started.elapsed().as_secs() < 10, "within seconds");
}

/// A child of [`a_disk_that_fills_mid_step_fails_the_step_with_the_shard_file_named`].
#[test]
#[ignore = "run by a_disk_that_fills_mid_step_fails_the_step_with_the_shard_file_named under a file-size limit"]
fn init_disk_full_child() {
    let dir = PathBuf::from(std::env::var_os("BURN_SHARD_DISK_FULL_DIR").expect("run by the parent test"));
    let config = ShardConfig::new(Stage::Three).with_params_on(Home::Disk(NvmeOffload::new(&dir)));
    let started = std::time::Instant::now();
    assert_disk_full(
        &config,
        "burn-shard-rank{rank}-params.swap",
        "writing a parameter shard",
        false,
    );
    assert!(started.elapsed().as_secs() < 10, "within seconds");
}

/// A child of [`a_disk_that_fills_mid_step_fails_the_step_with_the_shard_file_named`].
#[test]
#[ignore = "run by a_disk_that_fills_mid_step_fails_the_step_with_the_shard_file_named under a file-size limit"]
fn backward_disk_full_child() {
    shard_disk_full("gradient", false);
}

/// A child of [`a_disk_that_fills_mid_step_fails_the_step_with_the_shard_file_named`].
#[test]
#[ignore = "run by a_disk_that_fills_mid_step_fails_the_step_with_the_shard_file_named under a file-size limit"]
fn step_disk_full_child() {
    shard_disk_full("parameter", true);
}

/// `init` refuses NVMe parameter offload below stage 3 (nothing is sharded there) and a
/// directory that does not exist, on every rank, naming the fix.
#[test]
fn nvme_param_offload_is_refused_where_it_cannot_apply() {
    let dir = scratch("nvme-params", "refused");
    for stage in [Stage::Zero, Stage::One, Stage::Two] {
        let config = ShardConfig::new(stage).with_params_on(Home::Disk(NvmeOffload::new(&dir)));
        for result in run(&Device::flex(), 2, &base(), &config, AdamWConfig::new(), DType::F32) {
            let err = result.expect_err("below stage 3");
            assert!(
                matches!(err, ShardError::InvalidConfig(_)) && err.to_string().contains("use stage 3"),
                "stage {stage}: {err}"
            );
        }
    }
    let missing = dir.join("missing");
    let config = ShardConfig::new(Stage::Three).with_params_on(Home::Disk(NvmeOffload::new(&missing)));
    for result in run(&Device::flex(), 2, &base(), &config, AdamWConfig::new(), DType::F32) {
        let msg = result.expect_err("a missing directory").to_string();
        assert!(
            msg.contains(&missing.display().to_string()) && msg.contains("does not exist") && msg.contains("mkdir -p"),
            "{msg}"
        );
    }
    assert!(entries(&dir).is_empty(), "files left: {:?}", entries(&dir));
}

/// Rank `comm.rank()` trains `STEPS` steps; before each, a backward on another batch whose
/// gradients `discard_gradients` drops (when `extra`). At the end it gives `accumulate` one more
/// micro-batch and tries to save. Returns the parameters' bits and the save's error.
fn discard_rank<C: burn_shard_comm::Collective + 'static>(
    comm: C,
    base: &TinyMlp,
    config: &ShardConfig,
    extra: bool,
    dir: &Path,
) -> (Vec<u32>, Option<String>) {
    let device = Device::flex().autodiff();
    let (rank, world_size) = (comm.rank(), comm.world_size());
    let (mut model, mut optim) = config
        .init(base.clone().fork(&device), AdamWConfig::new(), comm)
        .unwrap();
    let (start, end) = rank_rows(rank, world_size, GLOBAL_BATCH);
    let grads = |model: &TinyMlp, index: usize| {
        let (x, y) = batch(index, GLOBAL_BATCH);
        let loss = mse(
            model,
            rows(&x, IN, start, end, &device),
            rows(&y, OUT, start, end, &device),
        );
        GradientsParams::from_grads(loss.backward(), model)
    };
    for step in 0..STEPS {
        if extra {
            drop(grads(&model, 50 + step));
            optim.discard_gradients().unwrap();
        }
        let g = grads(&model, step);
        model = optim.step(LR, model, g).unwrap();
    }
    let params = params_of(&model.clone().materialize())
        .iter()
        .map(|p| p.to_bits())
        .collect();
    let g = grads(&model, 99);
    optim.accumulate(&model, g).unwrap();
    let saved = optim.save_checkpoint(&model, dir, serde_json::json!({}));
    (params, saved.err().map(|e| e.to_string()))
}

/// With the gradient shards on disk, `discard_gradients` drops those of a backward the step
/// must not apply (the parameters are bitwise those of the same steps without that backward,
/// in memory or not), and a save between `accumulate` and `step` is refused as in memory: the
/// gradient shards on disk would not be in the checkpoint.
#[test]
fn discarded_and_pending_gradient_shards_behave_as_in_memory() {
    let dir = scratch("nvme-params", "discard");
    let swap = dir.join("swap");
    std::fs::create_dir_all(&swap).unwrap();
    let base = base();
    let resident = ShardConfig::new(Stage::Three);
    let stored = resident.clone().with_params_on(Home::Disk(NvmeOffload::new(&swap)));
    let run = |config: &ShardConfig, extra: bool, name: &str| {
        run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
            discard_rank(comm, &base, config, extra, &dir.join(name))
        })
        .expect("no rank panics")
    };
    let plain = run(&resident, false, "plain");
    for (config, name) in [(&resident, "resident"), (&stored, "stored")] {
        for (rank, (params, refused)) in run(config, true, name).into_iter().enumerate() {
            assert!(
                params == plain[rank].0,
                "{name}, rank {rank}: the discarded backward was applied"
            );
            let refused = refused.unwrap_or_else(|| panic!("{name}, rank {rank}: the save must be refused"));
            assert!(refused.contains("accumulate()"), "{name}, rank {rank}: {refused}");
        }
    }
    assert!(entries(&swap).is_empty(), "files left: {:?}", entries(&swap));
}

/// `DEPTH` linear layers, each a unit: a model long enough for the gather schedule to read
/// units ahead.
#[derive(Module, Debug)]
struct Deep {
    layers: Vec<burn::nn::Linear>,
}

const DEPTH: usize = 6;
const DEEP_WIDTH: usize = 16;

impl Deep {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let mut h = x;
        for layer in &self.layers {
            h = burn_shard::fsdp::unit(&h, || burn::tensor::activation::relu(layer.forward(h.clone())));
        }
        h
    }
}

/// Rank `comm.rank()` trains 3 steps of `Deep` with its shards on disk (one layer per bucket:
/// stage 3's buckets hold shards); returns `nvme_io_bytes().0` and
/// `report().nvme_read_on_demand_bytes()` of the last step.
fn deep_rank<C: burn_shard_comm::Collective + 'static>(comm: C, base: &Deep, dir: &Path) -> (u64, u64) {
    let device = Device::flex().autodiff();
    let world_size = comm.world_size();
    let layer_shards = (DEEP_WIDTH * DEEP_WIDTH).div_ceil(world_size) + DEEP_WIDTH.div_ceil(world_size);
    let config = ShardConfig::new(Stage::Three)
        .with_params_on(Home::Disk(dir.into()))
        .with_bucket_numel(layer_shards);
    let (mut model, mut optim) = config
        .init(base.clone().fork(&device), AdamWConfig::new(), comm)
        .unwrap();
    for step in 0..3 {
        let mut rng = Rng::new(step as u64);
        let x = Tensor::<2>::from_data(TensorData::new(rng.vec(4 * DEEP_WIDTH), [4, DEEP_WIDTH]), &device);
        let loss = model.forward(x).powi_scalar(2).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads).unwrap();
    }
    (
        optim.report().nvme_io_bytes().0,
        optim.report().nvme_read_on_demand_bytes(),
    )
}

/// The shard file is read ahead of its use, off the compute thread: once the gather schedule
/// knows the units (from the second step), a pass waits for the disk only for its first two
/// units (the one it gathers on entry and the one it prefetches then); the others are read
/// while the unit two before computes. The step waits only for its first bucket's gradient
/// and parameter shards; the next bucket's are read while one is stepped. With `DEPTH` units
/// whose shards on a rank are `u` bytes (`w` of them the weight's), a step reads: forward
/// `DEPTH·u`; backward `(DEPTH - 1)·w` (it re-gathers only weights, and not the first unit's,
/// whose input needs no gradient); the update's gradient and parameter shards `2·DEPTH·u`.
/// It waits for `2u + 2w + 2u` of them, at world sizes 1-3.
#[test]
fn shard_reads_run_ahead_of_the_units_and_buckets_that_use_them() {
    let dir = scratch("nvme-params", "read-ahead");
    let device = Device::flex().autodiff();
    let base = Deep {
        layers: (0..DEPTH)
            .map(|_| burn::nn::LinearConfig::new(DEEP_WIDTH, DEEP_WIDTH).init(&device))
            .collect(),
    };
    for world_size in 1..=3 {
        let w = 4 * (DEEP_WIDTH * DEEP_WIDTH).div_ceil(world_size) as u64;
        let u = w + 4 * DEEP_WIDTH.div_ceil(world_size) as u64;
        let depth = DEPTH as u64;
        let io = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
            deep_rank(comm, &base, &dir)
        })
        .unwrap();
        for (rank, (read, on_demand)) in io.into_iter().enumerate() {
            let ctx = format!("world_size {world_size}, rank {rank}");
            assert_eq!(read, depth * u + (depth - 1) * w + 2 * depth * u, "{ctx}: bytes read");
            assert_eq!(on_demand, 2 * u + 2 * w + 2 * u, "{ctx}: bytes waited for");
        }
    }
}
