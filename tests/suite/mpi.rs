//! The MPI suite (feature `mpi`, run by `cargo xtask mpi-test`): the MPI backend across real
//! processes. Each test starts `mpirun -np N` on this test binary, which runs only the ignored
//! test [`rank`] with a scenario named in `BURN_SHARD_MPI_SCENARIO`; every rank prints one
//! `RESULT rank <r>: ...` line and the test reads them from mpirun's output.

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::optim::AdamWConfig;
use burn::prelude::*;
use burn::tensor::DType;
use burn_shard::{ShardConfig, Stage};
use burn_shard_comm::{Collective, CommError, InProcessGroup, MpiComm, ReduceOp, run_ranks};

use crate::common::*;
use crate::equivalence::{GLOBAL_BATCH, LR, STEPS, train_rank};
use crate::sharded_init::{assert_bitwise, entries_of, next_draws};

const SCENARIO: &str = "BURN_SHARD_MPI_SCENARIO";
/// Longest an mpirun of this suite may take before it is killed and the test fails.
const MPIRUN_LIMIT: Duration = Duration::from_secs(240);

/// Runs `scenario` on `np` processes; returns mpirun's exit success and its stdout + stderr.
fn mpirun(np: usize, scenario: &str) -> (bool, String) {
    let exe = std::env::current_exe().unwrap();
    let mut spawned = Command::new("mpirun");
    spawned
        .args(["--allow-run-as-root", "--oversubscribe", "-np", &np.to_string()])
        .args(["-x", SCENARIO, "-x", "RUST_BACKTRACE"])
        .arg(exe)
        .args(["mpi::rank", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env(SCENARIO, scenario)
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::null());
    let (status, text) = run_bounded(spawned, MPIRUN_LIMIT);
    let Some(status) = status else {
        panic!("mpirun -np {np} ({scenario}) ran over {MPIRUN_LIMIT:?}:\n{text}");
    };
    (status.success(), text)
}

/// Runs `command` for at most `limit` (killed past it) and returns its exit status (`None`
/// when it was killed for the limit) and its standard output followed by its standard error.
/// Both pipes are drained on threads, so a chatty child cannot block on a full pipe.
///
/// # Panics
/// When the command cannot start (naming OpenMPI's install, which every caller runs).
pub(crate) fn run_bounded(mut command: Command, limit: Duration) -> (Option<std::process::ExitStatus>, String) {
    let mut child = match command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn() {
        Ok(child) => child,
        Err(e) => panic!(
            "cannot start {:?} ({e}): install OpenMPI with `cargo xtask setup`",
            command.get_program()
        ),
    };
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (status, format!("{}{}", out.join().unwrap(), err.join().unwrap()))
}

/// The `RESULT` line of each of `np` ranks, in rank order; fails naming a rank that printed none.
fn results(np: usize, scenario: &str, text: &str) -> Vec<String> {
    (0..np)
        .map(|rank| {
            let tag = format!("RESULT rank {rank}: ");
            let line = text
                .lines()
                .find_map(|l| l.split_once(&tag).map(|(_, rest)| rest.to_string()));
            line.unwrap_or_else(|| panic!("rank {rank} of {np} printed no result in {scenario}:\n{text}"))
        })
        .collect()
}

/// One rank process of this suite: started by [`mpirun`], never by hand.
#[test]
#[ignore = "a rank process of the mpi tests, which start it under mpirun"]
fn rank() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return; // started by hand: there is no job
    };
    // Short enough that a rank which never hears of a failure ends the test, not the 4 minutes.
    let timeout = if scenario == "timeout" { 1 } else { 60 };
    let comm = Arc::new(
        MpiComm::init()
            .expect("MPI init")
            .with_timeout(Duration::from_secs(timeout)),
    );
    let rank = comm.rank();
    let result = match scenario.as_str() {
        "collectives" => collectives(&comm),
        "training" => training(&comm),
        "mismatch" => mismatch(&comm),
        "abort" => abort(&comm),
        "reject" => reject(&comm),
        "timeout" => timeout_scenario(&comm),
        "learner" => learner(&comm),
        "lazy_init" => lazy_init(&comm),
        "hsdp" => hsdp(&comm),
        "hsdp_abort" => hsdp_abort(&comm),
        other => panic!("unknown scenario {other}"),
    };
    println!("RESULT rank {rank}: {result}");
    if matches!(scenario.as_str(), "abort" | "timeout" | "reject" | "hsdp_abort") {
        // Let every rank print before the first to exit without finalising ends the job.
        std::thread::sleep(Duration::from_secs(2));
    }
    // MPI is finalised at exit even if a handle is still held (at stage 3 Burn's autodiff graph
    // keeps one until its next clean-up): this one is kept on purpose.
    std::mem::forget(comm);
}

/// This rank's inputs for case `case`: whole numbers in [-8, 8], so that every sum over at most
/// 4 ranks is exact in f32, bf16 and f16 whatever order a backend adds in.
fn input(case: usize, rank: usize, len: usize) -> Vec<f32> {
    let mut rng = Rng::new((case * 1000 + rank) as u64);
    (0..len).map(|_| (rng.next_f32() * 8.0).round()).collect()
}

fn tensor(values: Vec<f32>, dtype: DType) -> Tensor<1> {
    let len = values.len();
    Tensor::from_data(TensorData::new(values, [len]), (&Device::flex(), dtype))
}

fn host(t: Tensor<1>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

/// Every collective, in every dtype, on lengths that do and do not divide by the world size,
/// with each output compared bit for bit with the in-process backend's on the same inputs (its
/// ranks run here as threads), and the traffic counters compared with its counters.
fn run_cases(comm: &dyn Collective, n: usize) -> Vec<Vec<f32>> {
    let rank = comm.rank();
    let mut outputs = Vec::new();
    let mut case = 0;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for len in [1, 7, 64] {
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                case += 1;
                let x = tensor(input(case, rank, len), dtype);
                outputs.push(host(comm.all_reduce(x, op).unwrap()));
                case += 1;
                let x = tensor(input(case, rank, len * n), dtype);
                outputs.push(host(comm.reduce_scatter(x, op).unwrap()));
            }
            case += 1;
            outputs.push(host(comm.all_gather(tensor(input(case, rank, len), dtype)).unwrap()));
            for root in 0..n {
                case += 1;
                let x = tensor(input(case, rank, len), dtype);
                outputs.push(host(comm.broadcast(x, root).unwrap()));
            }
        }
        // A bucket of three tensors of different lengths, grouped.
        case += 1;
        let bucket: Vec<_> = [3usize, 1, 5]
            .iter()
            .map(|&c| tensor(input(case + c, rank, c), dtype))
            .collect();
        outputs.extend(comm.all_gather_many(bucket).unwrap().into_iter().map(host));
        case += 10;
        let bucket: Vec<_> = [2usize, 4]
            .iter()
            .map(|&c| tensor(input(case + c, rank, c * n), dtype))
            .collect();
        outputs.extend(
            comm.reduce_scatter_many(bucket, ReduceOp::Avg)
                .unwrap()
                .into_iter()
                .map(host),
        );
        case += 10;
    }
    comm.barrier().unwrap();
    outputs
}

fn collectives(comm: &MpiComm) -> String {
    let (rank, n) = (comm.rank(), comm.world_size());
    let ours = run_cases(comm, n);
    let reference = run_ranks(InProcessGroup::new(n).unwrap(), |c| {
        let outputs = run_cases(&c, n);
        (outputs, c.stats())
    })
    .unwrap();
    let (theirs, their_stats) = &reference[rank];
    assert_eq!(ours.len(), theirs.len());
    for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
        let (a, b): (Vec<u32>, Vec<u32>) = (
            a.iter().map(|v| v.to_bits()).collect(),
            b.iter().map(|v| v.to_bits()).collect(),
        );
        assert_eq!(a, b, "rank {rank}: output {i} differs from the in-process backend's");
    }
    // Reduce-scatter, all-gather, broadcast and barrier count the same bytes as the in-process
    // ring; all-reduce counts the ring volume of its padded buffer.
    let stats = comm.stats();
    for kind in [
        burn_shard_comm::CollectiveKind::ReduceScatter,
        burn_shard_comm::CollectiveKind::AllGather,
        burn_shard_comm::CollectiveKind::Broadcast,
        burn_shard_comm::CollectiveKind::Barrier,
    ] {
        assert_eq!(stats.get(kind), their_stats.get(kind), "rank {rank}: {kind:?} counters");
    }
    let all_reduce = stats.get(burn_shard_comm::CollectiveKind::AllReduce);
    assert_eq!(
        all_reduce.calls,
        their_stats.get(burn_shard_comm::CollectiveKind::AllReduce).calls
    );
    // On fractional inputs the sum depends on the order of addition: every rank must still get
    // the same bits (each element is reduced once, by its owner, then gathered).
    for len in [5, 64, 1000] {
        let mut rng = Rng::new(77 + rank as u64 + 10 * len as u64);
        let reduced = host(
            comm.all_reduce(tensor(rng.vec(len), DType::F32), ReduceOp::Avg)
                .unwrap(),
        );
        let everyone = host(comm.all_gather(tensor(reduced.clone(), DType::F32)).unwrap());
        for peer in 0..n {
            let theirs = &everyone[peer * len..(peer + 1) * len];
            let same = theirs.iter().zip(&reduced).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "rank {rank}: all_reduce of {len} fractions differs from rank {peer}'s"
            );
        }
    }
    format!("{} outputs equal the in-process backend's", ours.len())
}

/// burn-train's Learner with `ShardedStrategy::process` at stage 3, early stopping on rank 0
/// only, against the single-device Learner.
fn learner(comm: &Arc<MpiComm>) -> String {
    use crate::learner::{Run, finished, train, train_with};
    use burn_shard_train::ShardedStrategy;
    let rank = comm.rank();
    let dir = |name: &str| {
        std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join("mpi-learner")
            .join(name)
    };
    let checkpoints = dir("checkpoints");
    if rank == 0 {
        let _ = std::fs::remove_dir_all(dir(""));
        std::fs::create_dir_all(&checkpoints).unwrap();
    }
    comm.barrier().unwrap();
    let reference = finished(
        &train(&dir(&format!("reference-{rank}")), None, &Run::epochs(2)),
        "reference",
    );
    comm.barrier().unwrap();
    let strategy = ShardedStrategy::process(
        ShardConfig::new(Stage::Three),
        burn::optim::AdamConfig::new(),
        comm.clone(),
        Device::flex(),
    );
    let run = Run {
        stop_at_epoch: (rank == 0).then_some(2),
        checkpoints: Some(checkpoints),
        ..Run::epochs(4)
    };
    let params = finished(
        &train_with(&dir(&format!("rank-{rank}")), Some(strategy), &run),
        "sharded",
    );
    let diff = max_abs_diff(&params, &reference);
    assert!(
        diff < 1e-4,
        "rank {rank}: parameters differ from the single-device Learner by {diff}"
    );
    format!("stage 3, early stopping at epoch 2 on rank 0: equal to the single-device Learner (max diff {diff:e})")
}

/// Sharded training at every stage on the MPI processes equals single-process Burn training.
fn training(comm: &Arc<MpiComm>) -> String {
    let (rank, n) = (comm.rank(), comm.world_size());
    let device = Device::flex().autodiff();
    device.seed(7);
    let base = TinyMlp::new(&device);
    let optim = AdamWConfig::new().with_weight_decay(0.1);
    let (ref_losses, ref_params) = reference_run(&base, optim.init(), STEPS, GLOBAL_BATCH, LR);
    let mut report = Vec::new();
    for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
        let run = train_rank(comm.clone(), &device, &base, optim.clone(), ShardConfig::new(stage));
        let (losses, params) = (run.losses, run.params);

        let loss_rel = losses
            .iter()
            .zip(&ref_losses)
            .map(|(a, b)| (a - b).abs() / b.abs().max(1e-12))
            .fold(0.0f32, f32::max);
        let param_diff = max_abs_diff(&params, &ref_params);
        assert!(
            loss_rel <= 1e-4,
            "rank {rank} stage {stage}: loss rel diff {loss_rel:e}"
        );
        assert!(
            param_diff <= 1e-4,
            "rank {rank} stage {stage}: param diff {param_diff:e}"
        );
        // Every rank holds the same parameters, bit for bit.
        let gathered = host(comm.all_gather(tensor(params.clone(), DType::F32)).unwrap());
        for peer in 0..n {
            let theirs = &gathered[peer * params.len()..(peer + 1) * params.len()];
            let same = theirs.iter().zip(&params).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "rank {rank} stage {stage}: rank {peer} holds other parameters");
        }
        report.push(format!("stage {stage} loss rel {loss_rel:.1e} param {param_diff:.1e}"));
    }
    assert!(ref_losses[STEPS - 1] < ref_losses[0], "the reference run must learn");
    report.join(", ")
}

/// Hybrid sharding on a 2 x 2 mesh of MPI processes (`MPI_Comm_split`): the shard groups are
/// ranks {0, 1} and {2, 3}; training at stages 1-3 equals single-process Burn training, every
/// rank holding the same parameters bit for bit, and the replicas all-reduce once per bucket and
/// step.
fn hsdp(comm: &Arc<MpiComm>) -> String {
    let rank = comm.rank();
    let device = Device::flex().autodiff();
    device.seed(7);
    let base = TinyMlp::new(&device);
    let optim = AdamWConfig::new().with_weight_decay(0.1);
    let (_, ref_params) = reference_run(&base, optim.init(), STEPS, GLOBAL_BATCH, LR);
    let mut report = Vec::new();
    for stage in [Stage::One, Stage::Two, Stage::Three] {
        let config = ShardConfig::new(stage).with_replicas(2);
        let run = train_rank(comm.clone(), &device, &base, optim.clone(), config);
        let param_diff = max_abs_diff(&run.params, &ref_params);
        assert!(
            param_diff <= 1e-4,
            "rank {rank} stage {stage}: param diff {param_diff:e}"
        );
        let gathered = host(comm.all_gather(tensor(run.params.clone(), DType::F32)).unwrap());
        let len = run.params.len();
        for peer in 0..comm.world_size() {
            let same = gathered[peer * len..(peer + 1) * len]
                .iter()
                .zip(&run.params)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "rank {rank} stage {stage}: rank {peer} holds other parameters");
        }
        report.push(format!("stage {stage} param {param_diff:.1e}"));
    }
    let mesh = burn_shard_comm::Mesh::new(comm.clone(), 2, burn_shard::MeshLayout::Consecutive).expect("mesh");
    let hot = |r: usize| tensor((0..4).map(|i| f32::from(u8::from(i == r))).collect(), DType::F32);
    let shard = host(mesh.shard().all_reduce(hot(rank), ReduceOp::Sum).unwrap());
    let replica = host(mesh.replicate().all_reduce(hot(rank), ReduceOp::Sum).unwrap());
    let members = |v: &[f32]| {
        (0..4)
            .filter(|&i| v[i] == 1.0)
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(" ")
    };
    report.push(format!(
        "shard group {}, replica group {}",
        members(&shard),
        members(&replica)
    ));
    report.join(", ")
}

/// Rank 3 fails alone in its replica group (ranks 1 and 3), 200 ms in, while rank 0 waits in its
/// shard group's all-reduce (ranks 0 and 1), which rank 1 never joins, and rank 2 in its replica
/// group's (ranks 0 and 2), which rank 0 never joins: neither call can complete, and both ranks
/// must learn of the abort through the job's control communicator within a poll (their timeout
/// is 60 s). Rank 1's later call fails too: on the abort notice, or, when MPI has not delivered
/// it yet (a notice travels when the aborted sender's MPI progresses), on meeting rank 0's
/// abandoned call.
fn hsdp_abort(comm: &Arc<MpiComm>) -> String {
    let mesh = burn_shard_comm::Mesh::new(comm.clone(), 2, burn_shard::MeshLayout::Consecutive).expect("mesh");
    let start = Instant::now();
    let ones = || tensor(vec![1.0; 16], DType::F32);
    let err = match comm.rank() {
        3 => {
            std::thread::sleep(Duration::from_millis(200));
            mesh.replicate().abort("rank 3 lost its disk");
            return "aborted".to_string();
        }
        0 => mesh.shard().all_reduce(ones(), ReduceOp::Sum).unwrap_err(),
        1 => {
            std::thread::sleep(Duration::from_secs(1));
            let start = Instant::now();
            let err = mesh.shard().barrier().unwrap_err();
            return format!("{} after {} ms: {err}", kind_of(&err), start.elapsed().as_millis());
        }
        _ => mesh.replicate().all_reduce(ones(), ReduceOp::Sum).unwrap_err(),
    };
    format!("{} after {} ms: {err}", kind_of(&err), start.elapsed().as_millis())
}

/// `init` of a lazy model and `init_pretrained` from a safetensors file, one process per rank
/// (each with its own random generator) at stages 0-3: every rank's entries after `init`
/// (gathered at stage 3) equal bitwise what single-device Burn initialises from the same seed
/// (lazy `Linear` layers and an eager parameter); rank 0's generator moved as the single
/// device's did and no other rank's moved (rank 0 initialised, the others received); from the
/// file (each process its own copy, written from that init), the same values, every rank
/// reading its own byte ranges.
fn lazy_init(comm: &Arc<MpiComm>) -> String {
    use burn_shard::Pretrained;
    use burn_store::{ModuleSnapshot, SafetensorsStore};
    const SEED: u64 = 41;
    let rank = comm.rank();
    let device = Device::flex().autodiff();
    device.seed(SEED);
    let untouched = next_draws(&device);
    device.seed(SEED);
    let single = TinyMlp::new(&device);
    let expected = entries_of(&single);
    let drawn = next_draws(&device);
    let file = scratch("mpi-lazy-init", &format!("rank{rank}")).join("model.safetensors");
    single.save_into(&mut SafetensorsStore::from_file(&file)).unwrap();
    for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
        device.seed(SEED);
        let (model, _) = ShardConfig::new(stage)
            .init(TinyMlp::new(&device), AdamWConfig::new(), comm.clone())
            .unwrap_or_else(|e| panic!("rank {rank} stage {stage}: {e}"));
        let got = entries_of(&model.materialize());
        assert_bitwise(&format!("rank {rank}, stage {stage}, lazy init"), &got, &expected);
        let draws = next_draws(&device);
        let want = if rank == 0 { &drawn } else { &untouched };
        assert_eq!(
            &draws, want,
            "rank {rank}, stage {stage}: the random generator moved otherwise"
        );
        let pretrained = Pretrained::safetensors(&file);
        let (model, _) = ShardConfig::new(stage)
            .init_pretrained(TinyMlp::new(&device), pretrained, AdamWConfig::new(), comm.clone())
            .unwrap_or_else(|e| panic!("rank {rank} stage {stage}: {e}"));
        let got = entries_of(&model.materialize());
        assert_bitwise(&format!("rank {rank}, stage {stage}, pretrained"), &got, &expected);
    }
    "stages 0-3: lazy init and pretrained load equal single-device init bitwise".into()
}

fn kind_of(err: &CommError) -> &'static str {
    match err {
        CommError::Mismatch { .. } => "Mismatch",
        CommError::Aborted(_) => "Aborted",
        CommError::MpiTimeout { .. } => "MpiTimeout",
        CommError::NotDivisible { .. } => "NotDivisible",
        _ => "other",
    }
}

/// Rank 1 all-gathers 3 elements where the others gather 2: every rank reports the mismatch,
/// and the group is aborted for later calls.
fn mismatch(comm: &MpiComm) -> String {
    let rank = comm.rank();
    let len = if rank == 1 { 3 } else { 2 };
    let err = comm.all_gather(tensor(vec![1.0; len], DType::F32)).unwrap_err();
    let later = comm.barrier().unwrap_err();
    format!("{} then {}: {err}", kind_of(&err), kind_of(&later))
}

/// Rank 1 fails on its own (as `ShardConfig::init` does when its model differs) while the others
/// wait in an all-reduce with a 5-minute timeout: they must hear of it within a poll.
fn abort(comm: &MpiComm) -> String {
    if comm.rank() == 1 {
        comm.abort("rank 1 cannot build its model");
        return "aborted".to_string();
    }
    let start = Instant::now();
    let err = comm
        .all_reduce(tensor(vec![1.0; 16], DType::F32), ReduceOp::Sum)
        .unwrap_err();
    format!("{} after {} ms: {err}", kind_of(&err), start.elapsed().as_millis())
}

/// Rank 1 passes a length that does not divide by the world size to reduce_scatter: it gets
/// the error naming the fix, and the others, whose call was valid, hear of it within a poll.
fn reject(comm: &MpiComm) -> String {
    let len = if comm.rank() == 1 { 7 } else { 6 };
    let start = Instant::now();
    let err = comm
        .reduce_scatter(tensor(vec![1.0; len], DType::F32), ReduceOp::Sum)
        .unwrap_err();
    format!("{} after {} ms: {err}", kind_of(&err), start.elapsed().as_millis())
}

/// Rank 1 never joins the barrier: the others fail after their 1 s timeout, not later.
fn timeout_scenario(comm: &MpiComm) -> String {
    if comm.rank() == 1 {
        println!("RESULT rank 1: stayed away");
        std::thread::sleep(Duration::from_secs(4));
        return "stayed away".to_string();
    }
    let start = Instant::now();
    let err = comm.barrier().unwrap_err();
    format!("{} after {} ms: {err}", kind_of(&err), start.elapsed().as_millis())
}

/// Milliseconds in a `... after <ms> ms` result.
fn millis(result: &str) -> u128 {
    let after = result.split_once(" after ").expect("an 'after' in the result").1;
    after.split_once(" ms").unwrap().0.parse().unwrap()
}

#[test]
fn collectives_match_the_in_process_backend_bit_for_bit() {
    for np in [2, 3] {
        let (ok, text) = mpirun(np, "collectives");
        assert!(ok, "mpirun -np {np} failed:\n{text}");
        for line in results(np, "collectives", &text) {
            assert!(line.ends_with("outputs equal the in-process backend's"), "{line}");
        }
    }
}

#[test]
fn sharded_training_across_processes_matches_single_process_training_at_every_stage() {
    for np in [2, 3] {
        let (ok, text) = mpirun(np, "training");
        assert!(ok, "mpirun -np {np} failed:\n{text}");
        let lines = results(np, "training", &text);
        assert!(lines[0].starts_with("stage 0"), "{}", lines[0]);
        println!("np {np}: {}", lines[0]);
    }
}

/// Sharded init of a lazy model and a pretrained load with one process per rank: see
/// [`lazy_init`].
#[test]
fn lazy_init_and_pretrained_load_across_processes_equal_single_device_init() {
    for np in [2, 3] {
        let (ok, text) = mpirun(np, "lazy_init");
        assert!(ok, "mpirun -np {np} failed:\n{text}");
        let lines = results(np, "lazy_init", &text);
        assert!(lines.iter().all(|l| l.starts_with("stages 0-3")), "{lines:?}");
    }
}

/// burn-train's Learner with `ShardedStrategy::process` over MPI, one process per rank:
/// every rank ends with the single-device Learner's parameters, and early stopping configured on
/// rank 0 alone stops every rank at the same epoch.
#[test]
fn learner_with_one_process_per_rank_trains_as_the_single_device_learner() {
    let (ok, text) = mpirun(2, "learner");
    assert!(ok, "mpirun -np 2 failed:\n{text}");
    for line in results(2, "learner", &text) {
        assert!(line.contains("equal to the single-device Learner"), "{line}");
    }
}

#[test]
fn mismatched_calls_fail_on_every_rank() {
    let (ok, text) = mpirun(3, "mismatch");
    assert!(ok, "every rank saw the mismatch, so all can finalise:\n{text}");
    for line in results(3, "mismatch", &text) {
        assert!(line.starts_with("Mismatch then Aborted"), "{line}");
        assert!(
            line.contains("all_gather(len=3") && line.contains("all_gather(len=2"),
            "{line}"
        );
    }
}

/// HSDP on 4 processes as a 2 x 2 mesh: see [`hsdp`].
#[test]
fn hybrid_sharding_on_a_two_by_two_mesh_of_processes_matches_single_process_training() {
    let (ok, text) = mpirun(4, "hsdp");
    assert!(ok, "mpirun -np 4 failed:\n{text}");
    let lines = results(4, "hsdp", &text);
    for (rank, line) in lines.iter().enumerate() {
        let (shard, replica) = (
            [["0 1"; 2], ["2 3"; 2]].concat()[rank],
            ["0 2", "1 3", "0 2", "1 3"][rank],
        );
        assert!(
            line.starts_with("stage 1") && line.ends_with(&format!("shard group {shard}, replica group {replica}")),
            "rank {rank}: {line}"
        );
    }
}

/// A rank that fails in one sub-group of a 2 x 2 mesh stops every rank within seconds, also
/// those blocked in a group it is not part of: see [`hsdp_abort`].
#[test]
fn a_rank_that_fails_in_one_sub_group_stops_every_rank_of_the_mesh_within_seconds() {
    let (_, text) = mpirun(4, "hsdp_abort");
    let lines = results(4, "hsdp_abort", &text);
    assert_eq!(lines[3], "aborted");
    for line in [&lines[0], &lines[2]] {
        assert!(
            line.starts_with("Aborted") && line.contains("rank 3 lost its disk"),
            "{line}"
        );
        assert!(millis(line) < 5000, "{line}");
    }
    assert!(
        lines[1].starts_with("Aborted") || lines[1].starts_with("Mismatch"),
        "{}",
        lines[1]
    );
    assert!(millis(&lines[1]) < 5000, "{}", lines[1]);
}

#[test]
fn a_rank_that_fails_alone_stops_the_others_within_seconds() {
    let (_, text) = mpirun(3, "abort");
    let lines = results(3, "abort", &text);
    assert_eq!(lines[1], "aborted");
    for line in [&lines[0], &lines[2]] {
        assert!(
            line.starts_with("Aborted") && line.contains("rank 1 cannot build its model"),
            "{line}"
        );
        assert!(millis(line) < 5000, "{line}");
    }
}

#[test]
fn a_call_only_one_rank_finds_invalid_fails_every_rank_within_seconds() {
    let (_, text) = mpirun(3, "reject");
    let lines = results(3, "reject", &text);
    assert!(
        lines[1].starts_with("NotDivisible") && lines[1].contains("got 7"),
        "{}",
        lines[1]
    );
    for line in [&lines[0], &lines[2]] {
        assert!(line.starts_with("Aborted") && line.contains("reduce_scatter"), "{line}");
        assert!(millis(line) < 5000, "{line}");
    }
}

/// Rank 1 of 3 skips a barrier: the others fail after their 1 s timeout (not a hang), naming
/// rank 1 as the process they heard no heartbeat from.
#[test]
fn a_rank_that_stays_away_is_a_timeout_not_a_hang() {
    let (ok, text) = mpirun(3, "timeout");
    assert!(!ok, "an abandoned collective must end the job with a failure:\n{text}");
    let lines = results(3, "timeout", &text);
    for line in [&lines[0], &lines[2]] {
        // The first rank to time out tells the other, which may hear that before its own timeout;
        // either way the error names the rank that sent no heartbeat, and only it (ranks 0 and
        // 2 wait in the barrier together and hear each other).
        assert!(line.contains("did not complete within"), "{line}");
        assert!(line.contains("no word from mpirun rank(s) 1 during the wait"), "{line}");
        assert!((900..4000).contains(&millis(line)), "{line}");
    }
}

/// The shakespeare job's `metrics.csv` in `dir`, as rows of fields.
fn metrics(dir: &std::path::Path) -> Vec<Vec<String>> {
    let text = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
    text.lines()
        .map(|l| l.split(',').map(str::to_string).collect())
        .collect()
}

/// The shakespeare job, which `cargo xtask mpi-test` builds with the mpi feature before this suite.
pub(crate) fn shakespeare_bin() -> std::path::PathBuf {
    let bin = std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("shakespeare");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo xtask mpi-test`, which builds it",
        bin.display()
    );
    bin
}

#[test]
fn shakespeare_across_processes_trains_with_its_in_process_losses() {
    let bin = shakespeare_bin();
    let dir = scratch("mpi", "shakespeare");
    let small = [
        "--steps",
        "8",
        "--eval-interval",
        "4",
        "--eval-batches",
        "2",
        "--batch-size",
        "8",
        "--block-size",
        "32",
        "--n-embd",
        "32",
        "--n-head",
        "2",
        "--n-layer",
        "1",
        "--sample-chars",
        "20",
        "--stage",
        "3",
    ];
    let threads = Command::new(&bin)
        .args(small)
        .arg("--out")
        .arg(dir.join("threads"))
        .output()
        .unwrap();
    assert!(threads.status.success(), "{}", String::from_utf8_lossy(&threads.stderr));
    let processes = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
        .arg(&bin)
        .args(small)
        .arg("--out")
        .arg(dir.join("processes"))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&processes.stdout),
        String::from_utf8_lossy(&processes.stderr)
    );
    assert!(processes.status.success(), "{text}");
    assert!(text.contains("[rank 1] "), "rank 1 reports its memory: {text}");
    let (a, b) = (metrics(&dir.join("threads")), metrics(&dir.join("processes")));
    assert_eq!(a.len(), b.len(), "same rows");
    assert_eq!(a[0], b[0], "same header");
    for (ra, rb) in a[1..].iter().zip(&b[1..]) {
        assert_eq!(ra[0], rb[0], "same steps");
        // The losses (train, val, accuracy); the last column, seconds, is each run's own clock.
        for (x, y) in ra[1..4].iter().zip(&rb[1..4]) {
            if x.is_empty() || y.is_empty() {
                assert_eq!(x, y, "step {}: same columns filled", ra[0]);
                continue;
            }
            let (x, y): (f32, f32) = (x.parse().unwrap(), y.parse().unwrap());
            assert!(
                (x - y).abs() <= 1e-4 * y.abs().max(1.0),
                "step {}: {x} (threads) vs {y} (mpirun)",
                ra[0]
            );
        }
    }
    assert!(a.len() >= 9, "every step is recorded: {a:?}");
}

/// The pids of the processes of `bin` (argv[0]) whose command line names `marker`: one MPI
/// job's ranks, not mpirun (whose argv[0] is mpirun).
fn ranks_of(bin: &std::path::Path, marker: &std::path::Path) -> Vec<u32> {
    let (bin, marker) = (bin.to_string_lossy(), marker.to_string_lossy());
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let args: Vec<String> = cmdline
                .split(|&b| b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            (args.first()? == &*bin && args.iter().any(|a| a.contains(&*marker))).then_some(pid)
        })
        .collect()
}

/// `burn-shard-run --supervise --max-restarts 2 -- mpirun -np 4 shakespeare ... --resume auto`
/// with one rank killed by SIGKILL after a random checkpoint: mpirun ends the job, the
/// launcher starts it again, the job resumes from its newest checkpoint and finishes. Its
/// final parameters equal, bit for bit, those of an uninterrupted run (plain mpirun) that
/// resumed from the same checkpoint; no rank is left running.
#[test]
fn a_killed_rank_restarts_the_mpi_job_which_ends_as_an_uninterrupted_run_from_its_checkpoint() {
    use burn_shard_launch::{LaunchConfig, OutputMode};
    let bin = shakespeare_bin();
    let dir = scratch("mpi", "elastic");
    // Long enough that the job is still running when a rank is killed after step 6 at most.
    let steps = 40;
    let job = |save_dir: &std::path::Path| -> Vec<String> {
        let mut args: Vec<String> = ["--allow-run-as-root", "--oversubscribe", "-np", "4"]
            .map(String::from)
            .to_vec();
        args.push(bin.display().to_string());
        args.extend(
            [
                "--world-size",
                "4",
                "--steps",
                &steps.to_string(),
                "--eval-interval",
                "20",
                "--eval-batches",
                "1",
                "--batch-size",
                "8",
                "--block-size",
                "16",
                "--n-embd",
                "16",
                "--n-head",
                "2",
                "--n-layer",
                "1",
                "--sample-chars",
                "4",
                "--stage",
                "3",
                "--save-every",
                "2",
                "--keep",
                "100",
                "--resume",
                "auto",
            ]
            .map(String::from),
        );
        args.extend(["--save-dir".into(), save_dir.display().to_string()]);
        args.extend(["--out".into(), save_dir.join("out").display().to_string()]);
        args
    };
    let run_dir = dir.join("restarted");
    let config = LaunchConfig::new("mpirun", 1)
        .with_args(job(&run_dir))
        .supervising()
        .with_max_restarts(2)
        .with_stop_grace(Duration::from_secs(5))
        .with_output(OutputMode::Capture);
    let started = Instant::now();
    let supervisor = std::thread::spawn(move || burn_shard_launch::run(&config));

    let kill_after = 2 * (1 + rand::random_range(0..3)); // step 2, 4 or 6
    let checkpoint = run_dir.join(format!("step-{kill_after:06}"));
    while !checkpoint.join("COMPLETE").exists() {
        assert!(
            started.elapsed() < MPIRUN_LIMIT,
            "no checkpoint {} was written",
            checkpoint.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let ranks = ranks_of(&bin, &run_dir);
    assert_eq!(ranks.len(), 4, "4 rank processes of the job: {ranks:?}");
    let victim = ranks[rand::random_range(0..ranks.len())];
    println!("killing pid {victim} after {}", checkpoint.display());
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &victim.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());

    let outcome = supervisor
        .join()
        .unwrap()
        .unwrap_or_else(|e| panic!("the restarted job failed: {e}"));
    assert!(started.elapsed() < MPIRUN_LIMIT, "{:?}", started.elapsed());
    assert_eq!(outcome.restarts.len(), 1, "one restart: {:?}", outcome.restarts);
    println!("restarted after: {}", outcome.restarts[0]);
    assert!(
        outcome.restarts[0].starts_with("mpirun failed"),
        "{:?}",
        outcome.restarts
    );
    let text: Vec<&str> = outcome.output.iter().map(|l| l.text.as_str()).collect();
    let resumed = text
        .iter()
        .find_map(|l| {
            l.split_once("resumed from ")
                .map(|(_, rest)| rest.split(' ').next().unwrap().to_string())
        })
        .unwrap_or_else(|| panic!("the second start resumed from no checkpoint:\n{}", text.join("\n")));
    let resumed = std::path::PathBuf::from(resumed);
    let step: usize = resumed.file_name().unwrap().to_str().unwrap()[5..].parse().unwrap();
    assert!(
        step >= kill_after,
        "resumed from {}, older than {}",
        resumed.display(),
        checkpoint.display()
    );
    for pid in ranks {
        assert!(crate::job_fixtures::ended(pid), "rank pid {pid} is still running");
    }
    // A save the kill interrupted left a `DIR.partial`, which the restarted job's saves
    // removed; every checkpoint left is complete.
    for entry in std::fs::read_dir(&run_dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(!name.ends_with(".partial"), "{name} was left behind");
        if name.starts_with("step-") {
            assert!(path.join("COMPLETE").exists(), "{name} is not complete");
        }
    }

    // The reference: plain mpirun, resumed from a copy of the same checkpoint, never killed.
    let reference_dir = dir.join("uninterrupted");
    copy_dir(&resumed, &reference_dir.join(resumed.file_name().unwrap()));
    let reference = Command::new("mpirun").args(job(&reference_dir)).output().unwrap();
    assert!(
        reference.status.success(),
        "{}",
        String::from_utf8_lossy(&reference.stderr)
    );

    let last = format!("step-{steps:06}");
    let consolidated = |root: &std::path::Path| {
        let out = root.join("final.safetensors");
        burn_shard::checkpoint::consolidate(
            root.join(&last),
            &out,
            burn_shard::checkpoint::RecordFormat::Safetensors,
        )
        .unwrap();
        std::fs::read(out).unwrap()
    };
    println!("resumed from {}; whole job {:?}", resumed.display(), started.elapsed());
    assert!(
        consolidated(&run_dir) == consolidated(&reference_dir),
        "the restarted job's final parameters differ from the uninterrupted run's from {}",
        resumed.display()
    );
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        match entry.file_type().unwrap().is_dir() {
            true => copy_dir(&entry.path(), &target),
            false => {
                std::fs::copy(entry.path(), target).unwrap();
            }
        }
    }
}
