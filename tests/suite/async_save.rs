//! Checkpoints written in the background (`save_checkpoint` with `SaveOptions::in_background`): what is written is the step
//! the save was staged at, whatever the steps after it do; the checkpoint completes at a later
//! step or at `wait_for_checkpoint`; a failure is reported on every rank and leaves nothing
//! behind; the next save waits for the previous one.

use std::path::Path;

use burn::module::{Module, Param};
use burn::optim::AdamWConfig;
use burn::prelude::*;
use burn::tensor::DType;
use burn_shard::checkpoint::{CheckpointMeta, SaveOptions, inspect};
use burn_shard::{Home, NvmeOffload, ShardConfig, Stage};
use burn_shard_comm::{Collective, InProcessGroup, run_ranks};

use crate::common::{Rng, params_of, scratch, sharded_step};

/// One `[d_in, d_out]` layer: at `[1024, 512]` 0.5 M parameters (2 MB of values, 4 MB of Adam
/// moments); at `[4096, 2048]` 8 M, large enough that a rank's writer is still writing while the
/// next steps run.
#[derive(Module, Debug)]
struct Wide {
    w: Param<Tensor<2>>,
    b: Param<Tensor<1>>,
}

impl Wide {
    fn new(device: &Device, dtype: DType) -> Self {
        Self::sized(device, dtype, [1024, 512])
    }

    fn sized(device: &Device, dtype: DType, [d_in, d_out]: [usize; 2]) -> Self {
        let mut rng = Rng::new(5);
        let w = Tensor::<2>::from_data(TensorData::new(rng.vec(d_in * d_out), [d_in, d_out]), device).cast(dtype);
        let b = Tensor::<1>::from_data(TensorData::new(rng.vec(d_out), [d_out]), device).cast(dtype);
        Self {
            w: Param::from_tensor(w.require_grad()),
            b: Param::from_tensor(b.require_grad()),
        }
    }

    fn loss(&self, step: usize, device: &Device) -> Tensor<1> {
        let d_in = self.w.shape().num_elements() / self.b.shape().num_elements();
        let x = Tensor::<2>::from_data(
            TensorData::new(Rng::new(40 + step as u64).vec(4 * d_in), [4, d_in]),
            device,
        )
        .cast(self.w.dtype());
        (x.matmul(self.w.val()) + self.b.val().unsqueeze())
            .cast(DType::F32)
            .tanh()
            .powi_scalar(2)
            .mean()
    }
}

/// A model trained one step at a time by the tests below.
trait Stepped: Module + Clone + Send + Sync + 'static {
    fn step_loss(&self, step: usize, device: &Device) -> Tensor<1>;
}

impl Stepped for Wide {
    fn step_loss(&self, step: usize, device: &Device) -> Tensor<1> {
        self.loss(step, device)
    }
}

/// A large frozen matrix ahead of a [`Wide`]: a rank's writer writes its half of it first (64
/// MB at `[8192, 4096]`) before it reads `wide`'s optimizer state, so the steps after the save
/// may rewrite that state first.
#[derive(Module, Debug)]
struct Led {
    frozen: Param<Tensor<2>>,
    wide: Wide,
}

impl Stepped for Led {
    fn step_loss(&self, step: usize, device: &Device) -> Tensor<1> {
        self.wide.loss(step, device)
    }
}

/// The rank files' sizes and digests: equal when the files hold the same bytes.
fn files_of(dir: &Path) -> Vec<(String, u64, String)> {
    CheckpointMeta::read(dir)
        .unwrap()
        .files
        .into_iter()
        .map(|f| (f.name, f.bytes, f.sha256))
        .collect()
}

/// On 2 ranks with `config`: a save staged after 3 steps of `base`, followed at once by 3 more
/// steps, writes the same bytes as a synchronous save after 3 steps (every rank file's SHA-256).
/// While in flight it is reported in `report().memory` and by `report().checkpoints_in_flight()`, and the
/// directory is not complete; `wait_for_checkpoint` completes it. The bytes staged in memory,
/// as a share of the rank's file, lie in `share` (all but the header for tensors in memory;
/// what NVMe offload keeps on disk is not staged).
fn check_staged<M: Stepped>(
    at: &str,
    base: &M,
    config: &ShardConfig,
    root: &Path,
    share: std::ops::RangeInclusive<f64>,
) {
    let (sync_dir, async_dir) = (root.join(format!("{at}-sync")), root.join(format!("{at}-async")));
    let ranks = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (mut model, mut optim) = config
            .init(base.clone().fork(&device), AdamWConfig::new(), comm)
            .unwrap();
        for step in 0..3 {
            let loss = model.step_loss(step, &device);
            model = sharded_step(&mut optim, model, loss, 1e-2).0;
        }
        optim
            .save_checkpoint(&model, &sync_dir, serde_json::json!({ "step": 3 }))
            .unwrap();
        optim
            .save_checkpoint(
                &model,
                &async_dir,
                SaveOptions::new(serde_json::json!({ "step": 3 })).in_background(),
            )
            .unwrap();
        let in_flight = optim.report().checkpoints_in_flight().first().cloned();
        let staged = optim.report().memory(&model).checkpoint_staging_bytes;
        let complete_before = async_dir.join("COMPLETE").exists();
        let before = params_of(&model.valid().materialize());
        for step in 3..6 {
            let loss = model.step_loss(step, &device);
            model = sharded_step(&mut optim, model, loss, 1e-2).0;
        }
        optim.wait_for_checkpoint().unwrap();
        let after = params_of(&model.valid().materialize());
        (
            in_flight,
            staged,
            complete_before,
            before != after,
            optim.report().checkpoints_in_flight().first().cloned(),
        )
    })
    .unwrap();
    assert_eq!(
        files_of(&async_dir),
        files_of(&sync_dir),
        "{at}: the background save wrote the step it was staged at"
    );
    for (rank, (in_flight, staged, complete_before, moved, settled)) in ranks.into_iter().enumerate() {
        assert_eq!(in_flight.as_deref(), Some(async_dir.as_path()), "{at} rank {rank}");
        assert!(
            !complete_before,
            "{at} rank {rank}: not complete before the writers are done"
        );
        assert!(moved, "{at}: the steps after the save changed the parameters");
        assert_eq!(settled, None, "{at} rank {rank}");
        let file = inspect(&async_dir).unwrap().bytes_per_rank()[rank] as usize;
        // The staged tensors are the file's in memory, less its header and scalars (a rank
        // that holds nothing, rank 1 at stage 0, stages nothing).
        let staged_share = staged as f64 / file as f64;
        println!("{at} rank {rank}: staged {staged} bytes of a {file}-byte file");
        assert!(
            staged <= file && (file < 4096 || share.contains(&staged_share)),
            "{at} rank {rank}: staged {staged} bytes, file {file}: {staged_share:.3} not in {share:?}"
        );
        assert!(
            rank > 0 || *share.start() < 0.5 || staged > 1 << 20,
            "{at}: rank 0 staged {staged} bytes"
        );
    }
}

/// [`check_staged`] at stages 0-3, `f32` and `bf16` with `f32` masters.
#[test]
fn a_background_save_writes_the_step_it_was_staged_at() {
    let root = scratch("async-save", "staged");
    for dtype in [DType::F32, DType::BF16] {
        let base = Wide::new(&Device::flex().autodiff(), dtype);
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            check_staged(
                &format!("{dtype:?}-{stage}"),
                &base,
                &ShardConfig::new(stage),
                &root,
                0.9..=1.0,
            );
        }
    }
}

/// [`check_staged`] with the optimizer state in swap files (stages 1 and 3) and the parameter
/// shards in a shard file (stage 3), which the steps that follow the save rewrite: the writer
/// reads the files, and still writes the step the save was staged at, bit for bit, while only
/// what is in memory was staged: the parameters at stage 1 (a third of the file: parameter,
/// first and second moment, all f32), nothing at stage 3. 8 M parameters (a 50 MB rank file).
#[test]
fn a_background_save_stages_what_nvme_offload_keeps_on_disk() {
    let root = scratch("async-save", "nvme");
    let base = Wide::sized(&Device::flex().autodiff(), DType::F32, [4096, 2048]);
    for stage in [Stage::One, Stage::Three] {
        let swap = root.join(format!("swap-{stage}"));
        std::fs::create_dir_all(&swap).unwrap();
        let mut config = ShardConfig::new(stage).with_optimizer_state_on(Home::Disk(NvmeOffload::new(&swap)));
        if stage == Stage::Three {
            config = config.with_params_on(Home::Disk(NvmeOffload::new(&swap)));
        }
        let share = match stage {
            Stage::Three => 0.0..=0.001,
            _ => 0.32..=0.34,
        };
        check_staged(&format!("nvme-{stage}"), &base, &config, &root, share);
    }
}

/// The copy-on-write of the swap file: behind 64 MB of a frozen matrix, the writer reads the
/// trainable layer's optimizer state from the swap file while the 3 steps that follow the save
/// may rewrite it (stage 1, state on disk); the checkpoint still holds the state of the step it
/// was staged at, bit for bit. Over 4 saves the swap file stays within twice the state: the
/// space the steps moved away from is reused once the writer is done.
#[test]
fn a_background_save_reads_its_step_from_the_swap_file_while_the_next_steps_write_beside_it() {
    let root = scratch("async-save", "nvme-cow");
    let swap = root.join("swap");
    std::fs::create_dir_all(&swap).unwrap();
    let device = Device::flex().autodiff();
    let frozen = Tensor::<2>::from_data(TensorData::new(Rng::new(9).vec(8192 * 4096), [8192, 4096]), &device);
    let base = Led {
        frozen: Param::from_tensor(frozen),
        wide: Wide::new(&device, DType::F32),
    };
    let config = ShardConfig::new(Stage::One).with_optimizer_state_on(Home::Disk(NvmeOffload::new(&swap)));
    check_staged("nvme-cow", &base, &config, &root, 0.9..=1.0);

    // The swap file over 4 rounds of a background save followed by 3 steps: before the first
    // save, and in each round after the steps.
    let sizes = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let rank = comm.rank();
        let (mut model, mut optim) = config
            .init(base.clone().fork(&device), AdamWConfig::new(), comm)
            .unwrap();
        let file = swap.join(format!("burn-shard-rank{rank}.swap"));
        let size = || std::fs::metadata(&file).unwrap().len();
        let loss = model.step_loss(0, &device);
        model = sharded_step(&mut optim, model, loss, 1e-2).0;
        let mut sizes = vec![size()];
        for round in 0..4 {
            let dir = root.join(format!("rounds/step-{round}"));
            optim
                .save_checkpoint(&model, &dir, SaveOptions::new(serde_json::Value::Null).in_background())
                .unwrap();
            for step in 0..3 {
                let loss = model.step_loss(step, &device);
                model = sharded_step(&mut optim, model, loss, 1e-2).0;
            }
            sizes.push(size());
            optim.wait_for_checkpoint().unwrap();
            std::fs::remove_dir_all(&dir).unwrap();
        }
        sizes
    })
    .unwrap();
    // Whether a step rewrites a slot before the writer has read it depends on the threads'
    // timing (on 2 cores the writers often finish first); when one does, the bitwise checks
    // above catch a slot written over in place (tried: a CRC-32 mismatch from the writer).
    for (rank, sizes) in sizes.iter().enumerate() {
        // The space is reused after: the file stays within twice the state plus a block per
        // slot (a leak would add the state at every round).
        assert!(
            sizes.iter().all(|&s| s <= 2 * sizes[0] + (64 << 10)),
            "rank {rank}: the swap file keeps growing: {sizes:?}"
        );
    }
}

/// A background save that cannot complete (a rank's digest damaged after its writer is done):
/// every rank sees the failure, logged at the next step and returned by `wait_for_checkpoint`
/// (once); nothing is left behind and the next save works.
#[test]
fn a_failed_background_save_is_reported_on_every_rank_and_leaves_nothing() {
    let root = scratch("async-save", "failed");
    let (dir, next) = (root.join("step-3"), root.join("step-4"));
    let base = Wide::new(&Device::flex().autodiff(), DType::F32);
    let errors = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (mut model, mut optim) = ShardConfig::new(Stage::Two)
            .init(base.clone().fork(&device), AdamWConfig::new(), comm)
            .unwrap();
        let loss = model.loss(0, &device);
        model = sharded_step(&mut optim, model, loss, 1e-2).0;
        optim
            .save_checkpoint(&model, &dir, SaveOptions::new(serde_json::Value::Null).in_background())
            .unwrap();
        optim.comm().barrier().unwrap();
        if optim.comm().rank() == 0 {
            // Once both writers are done (each writes its digest last), rank 1's digest is
            // damaged: the commit cannot complete the directory.
            let digests = [0, 1].map(|r| root.join("step-3.partial").join(format!("rank-{r}.sha256")));
            let start = std::time::Instant::now();
            while !digests.iter().all(|d| d.exists()) {
                assert!(start.elapsed().as_secs() < 60, "the writers did not finish");
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            std::fs::write(&digests[1], "damaged").unwrap();
        }
        optim.comm().barrier().unwrap();
        // Training goes on; the failure is seen (and logged) at a step once the writers are done.
        for step in 1..3 {
            let loss = model.loss(step, &device);
            model = sharded_step(&mut optim, model, loss, 1e-2).0;
        }
        let error = optim.wait_for_checkpoint().unwrap_err().to_string();
        let again = optim.wait_for_checkpoint().is_ok();
        optim
            .save_checkpoint(&model, &next, SaveOptions::new(serde_json::Value::Null).in_background())
            .unwrap();
        optim.wait_for_checkpoint().unwrap();
        (error, again)
    })
    .unwrap();
    for (rank, (error, again)) in errors.iter().enumerate() {
        assert!(
            match rank {
                0 => error.contains("rank-1.sha256") && error.contains("corrupt"),
                _ => error.contains("rank(s) [0] failed in save_checkpoint (background)"),
            },
            "rank {rank}: {error}"
        );
        assert!(again, "rank {rank}: reported once");
    }
    assert!(
        !dir.exists() && !root.join("step-3.partial").exists(),
        "nothing left behind"
    );
    assert!(inspect(&next).unwrap().is_intact(), "the next save works");
}

/// Two background saves in a row (the second waits for the first) and a load right after one:
/// both checkpoints complete, and the load reads the one just saved.
#[test]
fn the_next_save_and_a_load_wait_for_the_background_save() {
    let root = scratch("async-save", "in-a-row");
    let base = Wide::new(&Device::flex().autodiff(), DType::F32);
    let ranks = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (mut model, mut optim) = ShardConfig::new(Stage::Three)
            .init(base.clone().fork(&device), AdamWConfig::new(), comm)
            .unwrap();
        let loss = model.loss(0, &device);
        model = sharded_step(&mut optim, model, loss, 1e-2).0;
        optim
            .save_checkpoint(
                &model,
                root.join("a"),
                SaveOptions::new(serde_json::json!(1)).in_background(),
            )
            .unwrap();
        optim
            .save_checkpoint(
                &model,
                root.join("b"),
                SaveOptions::new(serde_json::json!(2)).in_background(),
            )
            .unwrap();
        let saved = params_of(&model.valid().materialize());
        let loss = model.loss(1, &device);
        model = sharded_step(&mut optim, model, loss, 1e-2).0;
        let (model, restored) = optim.load_checkpoint(model, root.join("b")).unwrap();
        (saved == params_of(&model.valid().materialize()), restored.payload)
    })
    .unwrap();
    for (rank, (same, payload)) in ranks.into_iter().enumerate() {
        assert!(same, "rank {rank}: the load reads the state saved");
        assert_eq!(payload, serde_json::json!(2), "rank {rank}");
    }
    assert!(inspect(root.join("a")).unwrap().is_intact());
}

/// `ShardConfig::with_saves_in_flight(2)`: a second background save does not wait for the
/// first (both in flight, both staged copies counted), a third waits for the oldest only; each
/// checkpoint holds the step it was staged at (the same rank files as a synchronous save at
/// that step, in a run of its own); with the default 1, the second save settles the first.
/// 0 is refused at `init`, and ranks that differ fail `init` on every rank.
#[test]
fn saves_in_flight_lets_a_background_save_start_before_the_previous_one_completes() {
    let root = scratch("async-save", "in-flight");
    let device = Device::flex().autodiff();
    let frozen = Tensor::<2>::from_data(TensorData::new(Rng::new(9).vec(4096 * 4096), [4096, 4096]), &device);
    let base = Led {
        frozen: Param::from_tensor(frozen),
        wide: Wide::new(&device, DType::F32),
    };
    // Step 1, saves A and B; step 2, save C: synchronous (the reference) or in the background.
    // No step runs between A and B, so nothing settles A but B itself.
    let run = |config: ShardConfig, name: &str, background: bool| {
        let dirs = ["a", "b", "c"].map(|d| root.join(format!("{name}/{d}")));
        let seen = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
            let (mut model, mut optim) = config
                .init(base.clone().fork(&device), AdamWConfig::new(), comm)
                .unwrap();
            let mut seen = Vec::new();
            for (i, dir) in dirs.iter().enumerate() {
                if i != 1 {
                    let loss = model.step_loss(i, &device);
                    model = sharded_step(&mut optim, model, loss, 1e-2).0;
                }
                match background {
                    true => optim
                        .save_checkpoint(&model, dir, SaveOptions::new(serde_json::Value::Null).in_background())
                        .unwrap(),
                    false => optim.save_checkpoint(&model, dir, serde_json::Value::Null).unwrap(),
                }
                let staged = optim.report().memory(&model).checkpoint_staging_bytes;
                seen.push((optim.report().checkpoints_in_flight(), staged));
            }
            optim.wait_for_checkpoint().unwrap();
            assert!(optim.report().checkpoints_in_flight().is_empty());
            seen
        })
        .unwrap();
        (dirs, seen)
    };
    let (sync, _) = run(ShardConfig::new(Stage::One), "sync", false);
    let (two_dirs, two) = run(ShardConfig::new(Stage::One).with_saves_in_flight(2), "two", true);
    let (one_dirs, one) = run(ShardConfig::new(Stage::One), "one", true);
    for dirs in [&two_dirs, &one_dirs] {
        for (dir, reference) in dirs.iter().zip(&sync) {
            assert_eq!(
                files_of(dir),
                files_of(reference),
                "{}: the step it was staged at",
                dir.display()
            );
        }
    }
    let [a, b, c] = &two_dirs;
    for rank in 0..2 {
        let in_flight: Vec<&Vec<std::path::PathBuf>> = two[rank].iter().map(|(dirs, _)| dirs).collect();
        assert_eq!(
            in_flight[1],
            &vec![a.clone(), b.clone()],
            "rank {rank}: B did not wait for A"
        );
        // C waited for the oldest (A, unless the step before it had settled A already); B
        // settles at a step or at C only once two are in flight again.
        assert_eq!(in_flight[2].last(), Some(c), "rank {rank}");
        assert!(!in_flight[2].contains(a), "rank {rank}: {in_flight:?}");
        let one_flight: Vec<usize> = one[rank].iter().map(|(dirs, _)| dirs.len()).collect();
        assert_eq!(one_flight, [1, 1, 1], "rank {rank}: one at a time");
        // Both staged copies are counted while two are in flight.
        assert_eq!(
            two[rank][1].1,
            2 * one[rank][0].1,
            "rank {rank}: staged bytes of A and B"
        );
    }

    let zero = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        ShardConfig::new(Stage::One)
            .with_saves_in_flight(0)
            .init(base.clone().fork(&device), AdamWConfig::new(), comm)
            .err()
            .map(|e| e.to_string())
    })
    .unwrap();
    assert!(
        zero.iter()
            .all(|e| e.as_ref().is_some_and(|e| e.contains("with_saves_in_flight"))),
        "{zero:?}"
    );
    let differ = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let saves = 1 + comm.rank();
        ShardConfig::new(Stage::One)
            .with_saves_in_flight(saves)
            .init(base.clone().fork(&device), AdamWConfig::new(), comm)
            .is_err()
    })
    .unwrap();
    assert_eq!(differ, [true, true], "ranks with different saves_in_flight fail init");
}

/// A loop that returns with a background save in flight (no `wait_for_checkpoint`) loses that
/// checkpoint, and every rank says so on standard error, naming the checkpoint and
/// `wait_for_checkpoint`, with no `tracing` subscriber installed (the child process has none);
/// nothing is listed as a checkpoint.
#[test]
fn a_save_in_flight_when_the_optimizer_drops_is_reported_on_stderr_by_every_rank() {
    let dir = scratch("async-save", "dropped");
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "async_save::dropped_save_child", "--ignored", "--nocapture"])
        .env("BURN_SHARD_DROPPED_SAVE_DIR", &dir)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child failed:\n{stdout}\n{stderr}"
    );
    let said: Vec<&str> = stderr.lines().filter(|l| l.contains("is LOST")).collect();
    assert_eq!(said.len(), 2, "one line per rank:\n{stderr}");
    for line in said {
        assert!(
            line.starts_with("burn-shard: ") && line.contains("step-1") && line.contains("wait_for_checkpoint"),
            "{line}"
        );
    }
    assert_eq!(
        burn_shard::checkpoint::list(&dir).unwrap(),
        Vec::<std::path::PathBuf>::new()
    );
}

/// The child of [`a_save_in_flight_when_the_optimizer_drops_is_reported_on_stderr_by_every_rank`].
#[test]
#[ignore = "run by a_save_in_flight_when_the_optimizer_drops_is_reported_on_stderr_by_every_rank"]
fn dropped_save_child() {
    let dir =
        std::path::PathBuf::from(std::env::var_os("BURN_SHARD_DROPPED_SAVE_DIR").expect("run by the parent test"));
    run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (model, mut optim) = ShardConfig::new(Stage::One)
            .init(Wide::new(&device, DType::F32), AdamWConfig::new(), comm)
            .unwrap();
        let (model, _) = sharded_step(&mut optim, model.clone(), model.loss(0, &device), 1e-3);
        optim
            .save_checkpoint(
                &model,
                dir.join("step-1"),
                SaveOptions::new(serde_json::json!({})).in_background(),
            )
            .unwrap();
        // The loop ends here: `optim` drops with the save in flight.
    })
    .unwrap();
}
