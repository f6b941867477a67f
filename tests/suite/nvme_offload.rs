//! NVMe offload (`burn_shard::NvmeOffload`, ZeRO-Infinity's optimizer-state offload): the
//! optimizer state and `f32` masters live in one swap file per rank between steps. On Burn's
//! Flex CPU device, where the step runs the same kernels either way, training with it gives
//! bitwise the parameters of training without it, at every stage, world sizes 1-4, `f32` and
//! `bf16`/`f16` with masters, and with every kind of optimizer state; checkpoints move between
//! the two; a bad directory, a second job, a swap file deleted, truncated or overwritten under
//! the job end with a clear error on every rank; the files are gone when the job ends.

use std::path::{Path, PathBuf};

use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, GradientsParams, SgdConfig};
use burn::prelude::*;
use burn::tensor::DType;
use burn_shard::{
    Home, IntoOptimizer, LossScaler, MasterWeightStep, MemoryReport, NvmeOffload, ShardConfig, ShardError,
    ShardedOptimizer, Stage,
};
use burn_shard_comm::{Collective, InProcessGroup, ReduceOp, run_ranks};

use crate::common::*;

pub(super) const STEPS: usize = 4;
pub(super) const GLOBAL_BATCH: usize = 12;
pub(super) const LR: f64 = 1e-2;

/// What one rank ends a run with.
#[derive(Debug)]
pub(super) struct RankRun {
    pub(super) losses: Vec<f32>,
    pub(super) params: Vec<u32>,
    pub(super) report: MemoryReport,
    /// `nvme_io_bytes` after the last step.
    pub(super) io: (u64, u64),
}

/// `STEPS` sharded steps of `dtype` parameters on `device` (plain; Flex unless said) from
/// `base`, with `config`.
fn train_rank<O: IntoOptimizer, C: Collective + 'static>(
    comm: C,
    device: &Device,
    base: &TinyMlp,
    config: &ShardConfig,
    optim: O,
    dtype: DType,
) -> Result<RankRun, ShardError> {
    let device = device.clone().autodiff();
    let (rank, world_size) = (comm.rank(), comm.world_size());
    let model = cast(base.clone().fork(&device), dtype);
    let (mut model, mut optim) = config.init(model, optim, comm)?;
    let (start, end) = rank_rows(rank, world_size, GLOBAL_BATCH);
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batch(step, GLOBAL_BATCH);
        let x = rows(&x, IN, start, end, &device).cast(dtype);
        let y = rows(&y, OUT, start, end, &device).cast(dtype);
        let loss = mse(&model, x, y);
        let global = optim
            .comm()
            .all_reduce(loss.clone().inner().cast(DType::F32), ReduceOp::Avg)?
            .into_scalar::<f32>();
        losses.push(global);
        let grads = GradientsParams::from_grads(optim.scale_loss(loss).backward(), &model);
        model = optim.step(LR, model, grads)?;
    }
    let report = optim.report().memory(&model);
    Ok(RankRun {
        losses,
        params: params_of(&model.materialize()).iter().map(|p| p.to_bits()).collect(),
        report,
        io: optim.report().nvme_io_bytes(),
    })
}

pub(super) fn config(stage: Stage, dtype: DType) -> ShardConfig {
    let config = ShardConfig::new(stage).with_bucket_numel(64);
    match dtype {
        DType::F16 => config.with_loss_scaler(LossScaler::fixed(256.0)),
        _ => config,
    }
}

/// Every rank's run on `device` (plain), or the first error.
pub(super) fn run<O: IntoOptimizer + Clone + Send + Sync>(
    device: &Device,
    world_size: usize,
    base: &TinyMlp,
    config: &ShardConfig,
    optim: O,
    dtype: DType,
) -> Vec<Result<RankRun, ShardError>> {
    run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
        train_rank(comm, device, base, config, optim.clone(), dtype)
    })
    .expect("no rank panics")
}

/// The swap files left in `dir`.
fn swap_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "swap"))
        .collect();
    files.sort();
    files
}

pub(super) fn base() -> TinyMlp {
    let device = Device::flex().autodiff();
    device.seed(11);
    TinyMlp::new(&device)
}

/// Compares a run with NVMe offload against the same run in memory: bitwise the same losses
/// and parameters on every rank; the state the in-memory run holds is on disk instead, once per
/// rank; the last step read and wrote it whole; the swap files are removed at the end.
fn check_against_memory<O: IntoOptimizer + Clone + Send + Sync>(
    ctx: &str,
    world_size: usize,
    stage: Stage,
    dtype: DType,
    optim: O,
    dir: &Path,
) {
    let base = base();
    let plain = config(stage, dtype);
    let nvme = plain
        .clone()
        .with_optimizer_state_on(Home::Disk(NvmeOffload::new(dir).with_max_in_flight(2)));
    let memory = run(&Device::flex(), world_size, &base, &plain, optim.clone(), dtype);
    let swapped = run(&Device::flex(), world_size, &base, &nvme, optim, dtype);
    for (rank, (m, s)) in memory.into_iter().zip(swapped).enumerate() {
        let ctx = format!("{ctx}, rank {rank}");
        let (m, s) = (m.expect("in-memory run"), s.unwrap_or_else(|e| panic!("{ctx}: {e}")));
        assert_same_training(&ctx, &m, &s);
        let (m, s, io) = (m.report, s.report, s.io);
        assert!(m.optimizer_state_bytes > 0 && m.disk_bytes == 0, "{ctx}: {m:?}");
        assert_eq!(s.optimizer_state_bytes, 0, "{ctx}: no state in memory between steps");
        assert_eq!(
            s.disk_bytes, m.optimizer_state_bytes,
            "{ctx}: the state is on disk instead"
        );
        assert_eq!(
            io,
            (s.disk_bytes as u64, s.disk_bytes as u64),
            "{ctx}: the last step reads and writes the whole state once"
        );
        assert_eq!(
            (s.parameters_bytes, s.gradients_bytes),
            (m.parameters_bytes, m.gradients_bytes)
        );
    }
    assert!(
        swap_files(dir).is_empty(),
        "{ctx}: swap files left: {:?}",
        swap_files(dir)
    );
}

/// `s` trained bitwise as the in-memory run `m` (the same losses and parameters), which
/// learned.
pub(super) fn assert_same_training(ctx: &str, m: &RankRun, s: &RankRun) {
    assert!(
        m.losses[STEPS - 1] < m.losses[0],
        "{ctx}: the run learns: {:?}",
        m.losses
    );
    assert_eq!(
        s.losses.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
        m.losses.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
        "{ctx}: losses"
    );
    assert!(
        s.params == m.params,
        "{ctx}: parameters differ from the in-memory run's"
    );
}

/// Stages 0-3 × world sizes 1-4 × `f32`, `bf16` and `f16` (masters, loss scaling) with AdamW.
#[test]
fn nvme_offload_trains_bitwise_as_in_memory_at_every_stage_and_world_size() {
    let dir = scratch("nvme", "sweep");
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for world_size in 1..=4 {
            for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
                let ctx = format!("{dtype:?}, world_size {world_size}, stage {stage}");
                let adamw = AdamWConfig::new().with_weight_decay(0.1);
                check_against_memory(&ctx, world_size, stage, dtype, adamw, &dir);
            }
        }
    }
}

/// Any Burn optimizer's state swaps (through Burn's `RecordState`): Adam with AMSGrad (a third
/// moment), SGD with momentum (Burn's own state), at stages 1 and 3 on 2 ranks.
#[test]
fn nvme_offload_swaps_every_optimizers_state() {
    let dir = scratch("nvme", "optimizers");
    for stage in [Stage::One, Stage::Three] {
        let ctx = format!("Adam with AMSGrad, stage {stage}");
        let amsgrad = AdamConfig::new().with_amsgrad(true);
        check_against_memory(&ctx, 2, stage, DType::F32, amsgrad, &dir);
        let ctx = format!("SGD with momentum, stage {stage}");
        let sgd = SgdConfig::new().with_momentum(Some(MomentumConfig::new())).build();
        check_against_memory(&ctx, 2, stage, DType::BF16, sgd, &dir);
    }
}

/// Where a [`train_span`] starts and ends.
#[derive(Clone, Default)]
pub(super) struct Span {
    /// Load this checkpoint first.
    pub(super) resume: Option<PathBuf>,
    /// Before loading, take one step on another batch (so the load replaces state that exists).
    pub(super) warm: bool,
    /// Save into this directory at the end.
    pub(super) save: Option<PathBuf>,
}

/// Rank `comm.rank()` trains `dtype` parameters for `steps` from `base` with `config`, as
/// `span` says; returns the parameters' bits.
pub(super) fn train_span<C: Collective + 'static>(
    comm: C,
    base: &TinyMlp,
    config: &ShardConfig,
    dtype: DType,
    span: &Span,
    steps: std::ops::Range<usize>,
) -> Vec<u32> {
    let device = Device::flex().autodiff();
    let (rank, world_size) = (comm.rank(), comm.world_size());
    let model = cast(base.clone().fork(&device), dtype);
    let (mut model, mut optim) = config.init(model, AdamWConfig::new(), comm).unwrap();
    let (start, end) = rank_rows(rank, world_size, GLOBAL_BATCH);
    let step = |optim: &mut ShardedOptimizer<_>, model: TinyMlp, index| {
        let (x, y) = batch(index, GLOBAL_BATCH);
        let x = rows(&x, IN, start, end, &device).cast(dtype);
        let y = rows(&y, OUT, start, end, &device).cast(dtype);
        let loss = mse(&model, x, y);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        optim.step(LR, model, grads).expect("step")
    };
    if span.warm {
        model = step(&mut optim, model, 100);
    }
    if let Some(dir) = &span.resume {
        model = optim.load_checkpoint(model, dir).expect("load").0;
    }
    for index in steps {
        model = step(&mut optim, model, index);
    }
    if let Some(dir) = &span.save {
        optim.save_checkpoint(&model, dir, serde_json::json!({})).expect("save");
    }
    params_of(&model.materialize()).iter().map(|p| p.to_bits()).collect()
}

/// A checkpoint saved with NVMe offload (2 ranks, stage 3) is byte for byte the one saved in
/// memory (`meta.json` aside: it names the run) and resumes without it (3 ranks, stage
/// 1), and one saved without it resumes with it, loaded into an optimizer that already has
/// state on disk: both end bitwise alike (the saved state, masters included, is the same),
/// and for `f32` where 4 uninterrupted steps end (within 1e-6: other world sizes sum in
/// another order).
#[test]
fn checkpoints_move_between_nvme_offload_and_memory() {
    for dtype in [DType::F32, DType::BF16] {
        let dir = scratch("nvme", &format!("checkpoints-{dtype:?}"));
        let swap = dir.join("swap");
        std::fs::create_dir_all(&swap).unwrap();
        let first = ShardConfig::new(Stage::Three);
        let second = ShardConfig::new(Stage::One);
        let on_disk = |config: &ShardConfig| {
            config
                .clone()
                .with_optimizer_state_on(Home::Disk(NvmeOffload::new(&swap)))
        };
        // Built once: ranks building it at once would draw from the seeded generator in turn.
        let base = base();
        let run = |world_size: usize, config: ShardConfig, span: Span, steps: std::ops::Range<usize>| {
            let group = InProcessGroup::new(world_size).unwrap();
            let ranks = run_ranks(group, |comm| {
                train_span(comm, &base, &config, dtype, &span, steps.clone())
            });
            ranks.expect("no rank panics").swap_remove(0)
        };
        let (from_disk, from_memory) = (dir.join("saved-with-nvme"), dir.join("saved-in-memory"));
        let saving = |dir: &PathBuf| Span {
            save: Some(dir.clone()),
            ..Span::default()
        };
        run(2, on_disk(&first), saving(&from_disk), 0..2);
        run(2, first.clone(), saving(&from_memory), 0..2);
        // The state saved from the swap file (read tensor by tensor as the file is written) is
        // byte for byte the state saved from memory.
        assert!(
            checkpoint_files(&from_disk) == checkpoint_files(&from_memory),
            "{dtype:?}: the checkpoint saved with NVMe offload differs from the one saved in memory"
        );
        let resumed_in_memory = Span {
            resume: Some(from_disk),
            ..Span::default()
        };
        let resumed_on_disk = Span {
            resume: Some(from_memory),
            warm: true,
            ..Span::default()
        };
        let resumed_in_memory = run(3, second.clone(), resumed_in_memory, 2..4);
        let resumed_on_disk = run(3, on_disk(&second), resumed_on_disk, 2..4);
        assert!(
            resumed_in_memory == resumed_on_disk,
            "{dtype:?}: the two resumed runs differ: the checkpoints did not hold the same state"
        );
        if dtype == DType::F32 {
            let reference = run(2, first.clone(), Span::default(), 0..4);
            let as_f32 = |bits: &[u32]| bits.iter().map(|b| f32::from_bits(*b)).collect::<Vec<_>>();
            let diff = max_abs_diff(&as_f32(&resumed_on_disk), &as_f32(&reference));
            assert!(diff <= 1e-6, "resumed vs uninterrupted: max |diff| = {diff:e}");
        }
        assert!(swap_files(&swap).is_empty(), "swap files left: {:?}", swap_files(&swap));
    }
}

/// `init` refuses, on every rank and within seconds, a directory that does not exist, a path
/// that is a file and a directory where no file can be made (a read-only filesystem), naming
/// the path, the cause and the fix.
#[test]
fn unusable_nvme_paths_are_refused_at_init_on_every_rank() {
    let dir = scratch("nvme", "unusable");
    let file = dir.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let cases = [
        (dir.join("missing"), "does not exist", "mkdir -p"),
        (file, "not a directory", "mkdir -p"),
        (PathBuf::from("/proc/self"), "cannot be created", "writable directory"),
    ];
    for (path, cause, fix) in cases {
        let started = std::time::Instant::now();
        let config = ShardConfig::new(Stage::Two).with_optimizer_state_on(Home::Disk(NvmeOffload::new(&path)));
        for (rank, result) in run(&Device::flex(), 2, &base(), &config, AdamWConfig::new(), DType::F32)
            .into_iter()
            .enumerate()
        {
            let err = result.expect_err("init must refuse the path");
            let msg = err.to_string();
            println!("{}: rank {rank}: {msg}", path.display());
            assert!(matches!(err, ShardError::Nvme { .. }), "rank {rank}: {err:?}");
            assert!(
                msg.contains(&path.display().to_string()) && msg.contains(cause) && msg.contains(fix),
                "rank {rank}: the error names the path, the cause ({cause}) and the fix ({fix}): {msg}"
            );
        }
        assert!(started.elapsed().as_secs() < 10, "refused within seconds");
    }
    let config =
        ShardConfig::new(Stage::One).with_optimizer_state_on(Home::Disk(NvmeOffload::new(&dir).with_io_threads(0)));
    let err = run(&Device::flex(), 1, &base(), &config, AdamWConfig::new(), DType::F32)
        .pop()
        .unwrap()
        .expect_err("0 threads");
    assert!(
        matches!(err, ShardError::InvalidConfig(_)) && err.to_string().contains("io_threads = 0"),
        "{err}"
    );
}

/// A second job given a directory a running job uses is refused on every rank, naming the
/// file and the fix; once the first job ends (its optimizer dropped), its files are gone and
/// the directory can be used again.
#[test]
fn a_second_job_on_the_same_directory_is_refused() {
    let dir = scratch("nvme", "two-jobs");
    let config = ShardConfig::new(Stage::One).with_optimizer_state_on(Home::Disk(NvmeOffload::new(&dir)));
    let device = Device::flex().autodiff();
    let comm = InProcessGroup::new(1).unwrap().into_comms().pop().unwrap();
    let first = config
        .init(TinyMlp::new(&device), AdamWConfig::new(), comm)
        .expect("the first job");
    assert_eq!(swap_files(&dir), vec![dir.join("burn-shard-rank0.swap")]);
    for (rank, result) in run(&Device::flex(), 2, &base(), &config, AdamWConfig::new(), DType::F32)
        .into_iter()
        .enumerate()
    {
        let msg = result.expect_err("the second job must be refused").to_string();
        println!("rank {rank}: {msg}");
        assert!(
            msg.contains("burn-shard-rank0.swap") && msg.contains("another job") && msg.contains("its own"),
            "rank {rank}: {msg}"
        );
    }
    drop(first);
    assert!(
        swap_files(&dir).is_empty(),
        "the first job's file is removed at its end"
    );
    let again = run(&Device::flex(), 2, &base(), &config, AdamWConfig::new(), DType::F32);
    assert!(
        again.iter().all(Result::is_ok),
        "the directory is free again: {again:?}"
    );
}

/// How a test damages rank 1's swap file while the job runs.
type Sabotage = fn(&Path);

/// Trains 2 ranks with `config`; after step 2 rank 1 applies `sabotage` to `file`. Returns
/// each rank's failing step and error (a rank whose steps all pass panics).
fn run_sabotaged(config: &ShardConfig, file: &Path, sabotage: Sabotage) -> Vec<(usize, ShardError)> {
    let base = base();
    run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let rank = comm.rank();
        let (mut model, mut optim) = config
            .init(base.clone().fork(&device), AdamWConfig::new(), comm)
            .unwrap();
        let (start, end) = rank_rows(rank, 2, GLOBAL_BATCH);
        for step in 0..6 {
            if step == 2 {
                if rank == 1 {
                    sabotage(file);
                }
                optim.comm().barrier().unwrap();
            }
            let (x, y) = batch(step, GLOBAL_BATCH);
            let loss = mse(
                &model,
                rows(&x, IN, start, end, &device),
                rows(&y, OUT, start, end, &device),
            );
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            match optim.step(LR, model, grads) {
                Ok(next) => model = next,
                Err(e) => return (step, e),
            }
        }
        panic!("rank {rank}: the damaged swap file went unnoticed");
    })
    .expect("no rank panics")
}

/// Ways to damage a file under a running job: name, what does it, and the cause the error names.
const SABOTAGES: [(&str, Sabotage, &str); 3] = [
    (
        "deleted",
        |p| std::fs::remove_file(p).unwrap(),
        "deleted while the job ran",
    ),
    (
        "truncated",
        |p| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(p)
                .unwrap()
                .set_len(4096)
                .unwrap()
        },
        "truncated",
    ),
    (
        "overwritten",
        |p| {
            use std::os::unix::fs::FileExt;
            let file = std::fs::OpenOptions::new().write(true).open(p).unwrap();
            file.write_all_at(&[0xA5; 64], 4096).unwrap();
        },
        "CRC-32 mismatch",
    ),
];

/// A swap file deleted, truncated or overwritten under a running job: the next step fails on
/// every rank within seconds, rank 1 naming its file, the cause and the fix, rank 0 naming rank
/// 1; the files are removed when the job ends.
#[test]
fn a_swap_file_damaged_under_a_running_job_fails_the_next_step_on_every_rank() {
    for stage in [Stage::One, Stage::Three] {
        for (name, sabotage, cause) in SABOTAGES {
            let dir = scratch("nvme", &format!("damaged-{name}-{stage}"));
            let started = std::time::Instant::now();
            let config = ShardConfig::new(stage).with_optimizer_state_on(Home::Disk(NvmeOffload::new(&dir)));
            let failures = run_sabotaged(&config, &dir.join("burn-shard-rank1.swap"), sabotage);
            let ctx = format!("{name}, stage {stage}");
            for (rank, (step, err)) in failures.iter().enumerate() {
                println!("{ctx}: rank {rank} failed at step {step}: {err}");
                assert_eq!(*step, 2, "{ctx}: rank {rank} fails at the first step after the damage");
                assert!(matches!(err, ShardError::Nvme { .. }), "{ctx}: rank {rank}: {err:?}");
            }
            let own = failures[1].1.to_string();
            assert!(
                own.contains("burn-shard-rank1.swap") && own.contains(cause) && own.contains("last checkpoint"),
                "{ctx}: rank 1 names its file, the cause ({cause}) and the fix: {own}"
            );
            let peer = failures[0].1.to_string();
            assert!(peer.contains("rank(s) [1]"), "{ctx}: rank 0 names rank 1: {peer}");
            assert!(started.elapsed().as_secs() < 10, "{ctx}: within seconds");
            assert!(swap_files(&dir).is_empty(), "{ctx}: files left: {:?}", swap_files(&dir));
        }
    }
}

/// A disk that fills mid-step: the swap file's writes fail with "File too large" under a 4 KiB
/// file-size limit (`ulimit -f 4`, SIGXFSZ ignored), set for a child process that runs
/// [`disk_full_child`], since the limit is process-wide. The first step's writes fail: the step
/// ends with the error on every rank, naming the file and "full", and the files are removed.
/// The step failed half-way (some slots' state written, some not): the next step and a save
/// are refused, naming the resume from the last checkpoint.
#[test]
fn a_disk_that_fills_mid_step_fails_the_step_on_every_rank() {
    let dir = scratch("nvme", "disk-full");
    run_child(
        "ulimit -f 4",
        "nvme_offload::disk_full_child",
        "BURN_SHARD_DISK_FULL_DIR",
        &dir,
    );
    assert!(swap_files(&dir).is_empty(), "files left: {:?}", swap_files(&dir));
}

/// Runs the ignored test `{child}` (its path in the suite) in a child process of this test binary, after
/// the shell command `limit` (a process-wide limit the other tests must not share), with
/// SIGXFSZ ignored (a write past a file-size limit then fails with EFBIG instead of killing the
/// child) and `dir` in the environment variable `var`; asserts it passed.
pub(super) fn run_child(limit: &str, child: &str, var: &str, dir: &Path) {
    let exe = std::env::current_exe().unwrap();
    let script = format!(r#"trap "" XFSZ; {limit}; exec "$0" --exact {child} --ignored --nocapture"#);
    let out = std::process::Command::new("bash")
        .args(["-c", &script])
        .arg(&exe)
        .env(var, dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    // "1 passed": libtest may print the test's name before or after its output.
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "the child run failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The child of [`a_disk_that_fills_mid_step_fails_the_step_on_every_rank`] (ignored unless
/// run by it).
#[test]
#[ignore = "run by a_disk_that_fills_mid_step_fails_the_step_on_every_rank under a file-size limit"]
fn disk_full_child() {
    let dir = PathBuf::from(std::env::var_os("BURN_SHARD_DISK_FULL_DIR").expect("run by the parent test"));
    let config = ShardConfig::new(Stage::Two).with_optimizer_state_on(Home::Disk(NvmeOffload::new(&dir)));
    // Each rank's own writes fail (its file holds more than 4 KiB): the step, not init.
    assert_disk_full(&config, "burn-shard-rank{rank}.swap", "writing a piece", true);
    let own = swap_files(&dir);
    assert!(own.is_empty(), "files left: {own:?}");
}

/// Trains 2 ranks with `config` under a file-size limit: both fail with `ShardError::Nvme`
/// naming their own file (`file` with `{rank}` replaced), `what` failed, "File too large" and
/// the fix ("is full"). With `half_applied` (a step that failed while it updated), one more
/// step and a save are then refused on both ranks, naming the cause and the resume.
pub(super) fn assert_disk_full(config: &ShardConfig, file: &str, what: &str, half_applied: bool) {
    let results =
        run_ranks(InProcessGroup::new(2).unwrap(), |comm| fail_then_retry(comm, config)).expect("no rank panics");
    for (rank, (err, later)) in results.into_iter().enumerate() {
        let msg = err.to_string();
        println!("rank {rank}: {msg}");
        assert!(matches!(err, ShardError::Nvme { .. }), "rank {rank}: {err:?}");
        let file = file.replace("{rank}", &rank.to_string());
        assert!(
            msg.contains(&file) && msg.contains(what) && msg.contains("File too large") && msg.contains("is full"),
            "rank {rank}: {msg}"
        );
        if !half_applied {
            continue;
        }
        for (call, later) in ["the next step", "a save"].into_iter().zip(later) {
            let later = later.unwrap_or_else(|| panic!("rank {rank}: {call} after a half-applied step returned Ok"));
            let msg = later.to_string();
            assert!(
                matches!(later, ShardError::HalfAppliedStep { .. })
                    && msg.contains("resume from the last checkpoint")
                    && msg.contains("File too large"),
                "rank {rank}: {call} after a half-applied step: {msg}"
            );
        }
    }
}

/// One rank's run with `config` until `init` or a step fails: that error, and, after a failed
/// step, what one more step (on the model from before it) and a save return.
fn fail_then_retry<C: Collective + 'static>(comm: C, config: &ShardConfig) -> (ShardError, Vec<Option<ShardError>>) {
    let device = Device::flex().autodiff();
    let (rank, world_size) = (comm.rank(), comm.world_size());
    let (mut model, mut optim) = match config.init(base().fork(&device), AdamWConfig::new(), comm) {
        Ok(built) => built,
        Err(e) => return (e, Vec::new()),
    };
    let (start, end) = rank_rows(rank, world_size, GLOBAL_BATCH);
    let (x, y) = batch(0, GLOBAL_BATCH);
    let (x, y) = (rows(&x, IN, start, end, &device), rows(&y, OUT, start, end, &device));
    for _ in 0..STEPS {
        let loss = mse(&model, x.clone(), y.clone());
        let grads = GradientsParams::from_grads(optim.scale_loss(loss).backward(), &model);
        let kept = model.clone();
        match optim.step(LR, model, grads) {
            Ok(next) => model = next,
            Err(e) => {
                // At stage 3 this forward's gathers fail (the group is aborted) and give zeros.
                let loss = mse(&kept, x.clone(), y.clone());
                let grads = GradientsParams::from_grads(optim.scale_loss(loss).backward(), &kept);
                let step = optim.step(LR, kept.clone(), grads).err();
                let dir = std::env::temp_dir().join("burn-shard-half-applied-never-written");
                let save = optim.save_checkpoint(&kept, &dir, serde_json::Value::Null).err();
                assert!(!dir.exists(), "rank {rank}: the refused save wrote {}", dir.display());
                return (e, vec![step, save]);
            }
        }
    }
    panic!("rank {rank}: no step failed")
}

/// On an accelerator (wgpu over lavapipe here), the optimizer state on disk is stepped in host
/// memory, as DeepSpeed's NVMe offload of the state runs its CPU Adam: at stages 1 and 3 on 2
/// ranks, `f32` and `f16` with masters, the parameters are bitwise those of the state in host
/// memory (`Home::Host`: the same host kernels run), and what that keeps in host memory is on
/// disk instead.
#[cfg(feature = "wgpu")]
#[test]
fn the_state_on_disk_steps_on_the_host_on_wgpu() {
    let Some(wgpu) = crate::fused_adam_wgpu::device() else {
        return;
    };
    let dir = scratch("nvme", "wgpu");
    let base = base();
    for dtype in [DType::F32, DType::F16] {
        for stage in [Stage::One, Stage::Three] {
            let ctx = format!("{dtype:?}, stage {stage}");
            let host = config(stage, dtype).with_optimizer_state_on(Home::Host);
            let disk = host.clone().with_optimizer_state_on(Home::Disk(NvmeOffload::new(&dir)));
            let adamw = AdamWConfig::new().with_weight_decay(0.1);
            let on_host = run(&wgpu, 2, &base, &host, adamw.clone(), dtype);
            let on_disk = run(&wgpu, 2, &base, &disk, adamw, dtype);
            for (rank, (h, d)) in on_host.into_iter().zip(on_disk).enumerate() {
                let (h, d) = (
                    h.expect("state in host memory"),
                    d.unwrap_or_else(|e| panic!("{ctx}: {e}")),
                );
                assert!(
                    d.params == h.params,
                    "{ctx}, rank {rank}: parameters differ from the state in host memory"
                );
                assert!(h.report.host_bytes > 0, "{ctx}: {:?}", h.report);
                assert_eq!(
                    (d.report.host_bytes, d.report.disk_bytes),
                    (0, h.report.host_bytes),
                    "{ctx}, rank {rank}: the host's state is on disk instead"
                );
                assert_eq!(d.report.optimizer_state_bytes, 0, "{ctx}, rank {rank}");
            }
            assert!(swap_files(&dir).is_empty(), "{ctx}: files left");
        }
    }
}

/// One sharded step of rank `rank` of 2 on batch `index` (`f32`, on `device`).
fn step_batch<O: MasterWeightStep>(
    optim: &mut ShardedOptimizer<O>,
    model: TinyMlp,
    index: usize,
    device: &Device,
) -> Result<TinyMlp, ShardError> {
    let (start, end) = rank_rows(optim.comm().rank(), optim.comm().world_size(), GLOBAL_BATCH);
    let (x, y) = batch(index, GLOBAL_BATCH);
    let loss = mse(
        &model,
        rows(&x, IN, start, end, device),
        rows(&y, OUT, start, end, device),
    );
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    optim.step(LR, model, grads)
}

/// A save that reads a damaged swap file (overwritten under the job between steps: a tensor's
/// CRC-32 does not match) fails on every rank, rank 1 naming its file and the cause, rank 0
/// naming rank 1, and leaves no checkpoint behind, not even a partial one; the save before the
/// damage is intact.
#[test]
fn a_save_that_reads_a_damaged_swap_file_fails_on_every_rank_and_leaves_no_checkpoint() {
    let dir = scratch("nvme", "save-damaged");
    let (swap, good, bad) = (dir.join("swap"), dir.join("good"), dir.join("bad"));
    std::fs::create_dir_all(&swap).unwrap();
    let config = ShardConfig::new(Stage::One).with_optimizer_state_on(Home::Disk(NvmeOffload::new(&swap)));
    let base = base();
    let errors = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let rank = comm.rank();
        let model = base.clone().fork(&device);
        let (mut model, mut optim) = config.init(model, AdamWConfig::new(), comm).unwrap();
        for index in 0..2 {
            model = step_batch(&mut optim, model, index, &device).unwrap();
        }
        optim
            .save_checkpoint(&model, &good, serde_json::json!({}))
            .expect("a save before the damage");
        if rank == 1 {
            use std::os::unix::fs::FileExt;
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(swap.join("burn-shard-rank1.swap"))
                .unwrap();
            // The first block after the probe: a tensor of the first slot rank 1 stepped.
            file.write_all_at(&[0xA5; 64], 4096).unwrap();
        }
        optim.comm().barrier().unwrap();
        optim
            .save_checkpoint(&model, &bad, serde_json::json!({}))
            .expect_err("a damaged swap file must fail the save")
            .to_string()
    })
    .expect("no rank panics");
    println!("{errors:#?}");
    assert!(
        errors[1].contains("burn-shard-rank1.swap") && errors[1].contains("CRC-32 mismatch"),
        "rank 1 names its file and the cause: {}",
        errors[1]
    );
    assert!(errors[0].contains("rank(s) [1]"), "rank 0 names rank 1: {}", errors[0]);
    let mut left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["good", "swap"], "no checkpoint, not even a partial one, is left");
    assert!(burn_shard::checkpoint::inspect(&good).unwrap().is_intact());
}

/// A checkpoint load whose swap writes fail (a disk that fills: the files may not grow past
/// their size, set as the file-size limit of a child process running [`failed_load_child`])
/// fails on every rank, and leaves the optimizer state as it was: the loaded state is written
/// past the live one and made live only once every rank has written all of its own.
#[test]
fn a_load_whose_swap_writes_fail_leaves_the_optimizer_as_it_was() {
    let dir = scratch("nvme", "failed-load");
    // The child sets its limit itself, once the swap files exist (`limit_file_size_to`).
    run_child(
        "true",
        "nvme_offload::failed_load_child",
        "BURN_SHARD_FAILED_LOAD_DIR",
        &dir,
    );
}

/// The child of [`a_load_whose_swap_writes_fail_leaves_the_optimizer_as_it_was`] (ignored
/// unless run by it): 2 ranks at stage 2 with NVMe offload take steps 0-1, save, take step 2;
/// then no file may grow past the larger swap file, the load of the checkpoint fails on the
/// rank with that file (naming the full disk and that the optimizer is unchanged) and on the
/// other, which wrote its whole loaded state but must not make it live; the files are as long
/// as before the load, and steps 3-4 end bitwise where 5 steps in memory end.
#[test]
#[ignore = "run by a_load_whose_swap_writes_fail_leaves_the_optimizer_as_it_was under a file-size limit"]
fn failed_load_child() {
    let dir = PathBuf::from(std::env::var_os("BURN_SHARD_FAILED_LOAD_DIR").expect("run by the parent test"));
    let (swap, ckpt) = (dir.join("swap"), dir.join("ckpt"));
    std::fs::create_dir_all(&swap).unwrap();
    let base = base();
    let train = |config: ShardConfig, load_after: Option<usize>| {
        run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
            let device = Device::flex().autodiff();
            let model = base.clone().fork(&device);
            let (mut model, mut optim) = config.init(model, AdamWConfig::new(), comm).unwrap();
            let mut error = None;
            for index in 0..5 {
                if load_after == Some(index) {
                    optim.comm().barrier().unwrap();
                    let lengths = || {
                        swap_files(&swap)
                            .iter()
                            .map(|f| f.metadata().unwrap().len())
                            .collect::<Vec<_>>()
                    };
                    let before = lengths();
                    if optim.comm().rank() == 0 {
                        limit_file_size_to(&swap_files(&swap));
                    }
                    optim.comm().barrier().unwrap();
                    let failed = optim.load_checkpoint(model.clone(), &ckpt);
                    error = Some(failed.expect_err("the load must fail").to_string());
                    optim.comm().barrier().unwrap();
                    assert_eq!(lengths(), before, "a failed load gives back the disk it took");
                }
                model = step_batch(&mut optim, model, index, &device).unwrap();
                if index == 1 && load_after.is_some() {
                    optim.save_checkpoint(&model, &ckpt, serde_json::json!({})).unwrap();
                }
            }
            (error, params_of(&model).iter().map(|p| p.to_bits()).collect::<Vec<_>>())
        })
        .expect("no rank panics")
    };
    let reference = train(ShardConfig::new(Stage::Two), None);
    let failed = train(
        ShardConfig::new(Stage::Two).with_optimizer_state_on(Home::Disk(NvmeOffload::new(&swap))),
        Some(3),
    );
    for (rank, ((error, params), (_, expected))) in failed.iter().zip(&reference).enumerate() {
        let error = error.as_deref().unwrap();
        println!("rank {rank}: {error}");
        assert!(
            error.contains("File too large") || error.contains("rank(s)"),
            "rank {rank}: its own write error or its peer's: {error}"
        );
        assert!(params == expected, "rank {rank}: the failed load changed the training");
    }
    let errors: Vec<&str> = failed.iter().map(|(e, _)| e.as_deref().unwrap()).collect();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("is full") && e.contains("load again") && e.contains("unchanged")),
        "a rank names the full disk, that the optimizer is unchanged, and the fix: {errors:?}"
    );
    assert!(
        errors.iter().any(|e| e.contains("rank(s) [")),
        "a rank whose own writes passed fails with its peer (and keeps its state): {errors:?}"
    );
}

/// Loading checkpoints again and again into an optimizer with NVMe offload reuses the space of
/// the state each load replaced: after the first load (which writes beside the live state) the
/// swap files grow no more (past the block the first load's state ends in), and training goes
/// on after each load.
#[test]
fn repeated_loads_reuse_the_swap_files_space() {
    let dir = scratch("nvme", "repeated-loads");
    let (swap, ckpt) = (dir.join("swap"), dir.join("ckpt"));
    std::fs::create_dir_all(&swap).unwrap();
    let config = ShardConfig::new(Stage::Three).with_optimizer_state_on(Home::Disk(NvmeOffload::new(&swap)));
    let base = base();
    let lengths = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let model = base.clone().fork(&device);
        let (mut model, mut optim) = config.init(model, AdamWConfig::new(), comm).unwrap();
        let rank = optim.comm().rank();
        let file = swap.join(format!("burn-shard-rank{rank}.swap"));
        let mut lengths = Vec::new();
        for index in 0..2 {
            model = step_batch(&mut optim, model, index, &device).unwrap();
        }
        optim.save_checkpoint(&model, &ckpt, serde_json::json!({})).unwrap();
        for index in 2..6 {
            model = optim.load_checkpoint(model, &ckpt).unwrap().0;
            model = step_batch(&mut optim, model, index, &device).unwrap();
            lengths.push(file.metadata().unwrap().len());
        }
        lengths
    })
    .expect("no rank panics");
    for (rank, lengths) in lengths.iter().enumerate() {
        println!("rank {rank}: swap file after each load and step: {lengths:?} bytes");
        // The file ends with the last slot's bytes, not its whole block: it may end anywhere
        // in the block the first load's state ends in, not past it.
        let cap = lengths[0].next_multiple_of(4096);
        assert!(
            lengths.iter().all(|&l| l <= cap),
            "rank {rank}: the swap file grows with each load: {lengths:?}"
        );
    }
}

/// Limits this process's file size to the largest of `files` (`prlimit`), so none can grow.
fn limit_file_size_to(files: &[PathBuf]) {
    let limit = files.iter().map(|f| std::fs::metadata(f).unwrap().len()).max().unwrap();
    let status = std::process::Command::new("prlimit")
        .args([
            "--pid",
            &std::process::id().to_string(),
            &format!("--fsize={limit}:{limit}"),
        ])
        .status()
        .expect("prlimit (util-linux) runs");
    assert!(status.success(), "prlimit failed");
}
