//! The shakespeare job under `mpirun` on a cluster of network namespaces (`burn-shard-cluster`):
//! 2 nodes x 2 ranks, the ranks of a node on shared memory, the nodes across a link. Its losses
//! are bit for bit those of the same job on one host; a link cut in the middle of training
//! fails every rank within the job's `--comm-timeout`, each naming the other node's ranks, and
//! the supervised job resumes from its newest checkpoint once the link is back. Runs in the MPI
//! suite (`cargo xtask mpi-test` runs this module after `mpi`, one test at a time); needs root
//! and iproute2, and skips saying why without them.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use burn_shard_cluster::{Cluster, ClusterSpec, mpirun_on_this_host};
use burn_shard_launch::{LaunchConfig, OutputMode};

use crate::cluster::capabilities_or_skip;
use crate::common::scratch;
use crate::mpi::{run_bounded, shakespeare_bin};

/// Nodes, and ranks on each.
const NODES: usize = 2;
const RANKS_PER_NODE: usize = 2;
/// Longest one job of this module may run.
const JOB_LIMIT: Duration = Duration::from_secs(240);

/// A tiny GPT's job arguments on 4 ranks (after the program).
fn job_args(stage: u8, replicas: usize, steps: usize, out: &Path) -> Vec<String> {
    let mut args: Vec<String> = [
        "--world-size",
        "4",
        "--stage",
        &stage.to_string(),
        "--replicas",
        &replicas.to_string(),
        "--steps",
        &steps.to_string(),
        "--eval-interval",
        &steps.to_string(),
        "--eval-batches",
        "1",
        "--batch-size",
        "8",
        "--block-size",
        "16",
        "--n-embd",
        "32",
        "--n-head",
        "2",
        "--n-layer",
        "1",
        "--sample-chars",
        "0",
    ]
    .map(String::from)
    .to_vec();
    args.extend(["--out".into(), out.display().to_string()]);
    args
}

/// Runs `command` to its end within [`JOB_LIMIT`]; panics with its output when it fails or
/// runs over.
fn run_ok(command: Command, what: &str) -> String {
    let (status, text) = run_bounded(command, JOB_LIMIT);
    match status {
        Some(status) if status.success() => text,
        Some(status) => panic!("{what} failed ({status}):\n{text}"),
        None => panic!("{what} ran over {JOB_LIMIT:?}:\n{text}"),
    }
}

/// `mpirun` of 4 ranks on this host, every rank on shared memory.
fn one_host(bin: &Path, args: &[String]) -> Command {
    let mut command = mpirun_on_this_host(NODES * RANKS_PER_NODE);
    command.arg(bin).args(args);
    command
}

/// The step, train loss and validation loss cells of the job's `metrics.csv` in `out`, as
/// written.
fn losses(out: &Path) -> Vec<[String; 3]> {
    let text = std::fs::read_to_string(out.join("metrics.csv")).unwrap();
    text.lines()
        .skip(1)
        .map(|line| {
            let cells: Vec<&str> = line.split(',').collect();
            [0, 1, 2].map(|i| cells[i].to_string())
        })
        .collect()
}

/// Stage 3 flat and on a 2 x 2 mesh (one shard group per node), on two nodes whose links run
/// at 1 Gbit/s: the losses of every step equal those of the same job on one host bit for bit
/// (OpenMPI picks its algorithms by message size and process count, not by where the ranks
/// run), and the hybrid mesh sends less across the nodes than the flat one.
#[test]
fn a_job_on_two_nodes_has_the_losses_of_the_same_job_on_one_host() {
    let test = "a_job_on_two_nodes_has_the_losses_of_the_same_job_on_one_host";
    if capabilities_or_skip(test).is_none() {
        return;
    }
    let bin = shakespeare_bin();
    let dir = scratch("cluster_mpi", "losses");
    let mut across = Vec::new();
    for replicas in [1, 2] {
        let steps = 6;
        let host_out = dir.join(format!("one-host-{replicas}"));
        run_ok(
            one_host(&bin, &job_args(3, replicas, steps, &host_out)),
            "the one-host job",
        );
        let cluster = Cluster::create(&ClusterSpec::new(NODES).with_rate_mbit(1000.0)).unwrap();
        let sent = |c: &Cluster| -> u64 { (0..NODES).map(|n| c.link_bytes(n).unwrap().sent).sum() };
        let before = sent(&cluster);
        let cluster_out = dir.join(format!("cluster-{replicas}"));
        let mut command = cluster.mpirun(RANKS_PER_NODE).unwrap();
        command.arg(&bin).args(job_args(3, replicas, steps, &cluster_out));
        let text = run_ok(command, "the job across the cluster");
        assert!(text.contains("[rank 3]"), "4 MPI processes: {text}");
        let bytes = sent(&cluster) - before;
        let (host, nodes) = (losses(&host_out), losses(&cluster_out));
        assert_eq!(host.len(), steps, "one row per step: {host:?}");
        assert_eq!(
            nodes, host,
            "replicas {replicas}: losses across the cluster against one host"
        );
        println!("{test}: replicas {replicas}: {bytes} bytes across the nodes' links, losses bitwise");
        across.push(bytes);
    }
    assert!(
        across[1] < across[0],
        "the hybrid mesh sends less across nodes: {across:?}"
    );
}

/// `burn-shard-run --supervise -- mpirun ...` on two nodes; node 1's link cut at the bridge for
/// 30 s once the job has saved a checkpoint. Every rank fails within `--comm-timeout` (5 s) of
/// the cut, not after TCP's minutes, its error naming the other node's ranks as silent (each
/// side hears only its own node's heartbeats); once the link is back `mpirun` ends, the
/// supervisor starts the job again, and it resumes from its newest checkpoint and finishes
/// with the losses of an uninterrupted job, bit for bit.
#[test]
fn a_link_cut_fails_every_rank_within_the_timeout_and_the_supervised_job_resumes() {
    let test = "a_link_cut_fails_every_rank_within_the_timeout_and_the_supervised_job_resumes";
    if capabilities_or_skip(test).is_none() {
        return;
    }
    let bin = shakespeare_bin();
    let dir = scratch("cluster_mpi", "cut");
    let (steps, timeout, cut_for) = (400, 5.0, Duration::from_secs(30));
    let save_dir = dir.join("checkpoints");
    let logs = dir.join("logs");
    let mut job = job_args(3, 1, steps, &dir.join("out"));
    job.extend(
        [
            "--save-every",
            "10",
            "--keep",
            "2",
            "--resume",
            "auto",
            "--comm-timeout",
            &timeout.to_string(),
        ]
        .map(String::from),
    );
    job.extend(["--save-dir".into(), save_dir.display().to_string()]);

    let cluster = Cluster::create(&ClusterSpec::new(NODES)).unwrap();
    let mut mpirun = cluster.mpirun(RANKS_PER_NODE).unwrap();
    // Each rank's output in a file of its own, written by its node's daemon: readable while the
    // link that would carry it to mpirun is down.
    mpirun.arg("--output-filename").arg(&logs).arg(&bin).args(&job);
    let config = LaunchConfig::new(mpirun.get_program(), 1)
        .with_args(mpirun.get_args())
        .supervising()
        .with_max_restarts(1)
        .with_stop_grace(Duration::from_secs(5))
        .with_output(OutputMode::Capture);
    let started = Instant::now();
    let supervisor = std::thread::spawn(move || burn_shard_launch::run(&config));

    let first = save_dir.join("step-000020");
    while !first.join("COMPLETE").exists() {
        assert!(
            started.elapsed() < JOB_LIMIT,
            "no checkpoint {} was written",
            first.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    cluster.set_link(1, false).unwrap();
    let cut = Instant::now();
    println!("{test}: node 1's link cut after {}", first.display());
    // Every rank's error, within the timeout (plus a poll and a loaded host's slack).
    let bound = Duration::from_secs_f64(timeout) + Duration::from_secs(5);
    let mut errors: Vec<Option<(String, Duration)>> = vec![None; NODES * RANKS_PER_NODE];
    while errors.iter().any(Option::is_none) && cut.elapsed() < bound + Duration::from_secs(5) {
        for (rank, slot) in errors.iter_mut().enumerate().filter(|(_, s)| s.is_none()) {
            let stderr = logs.join("1").join(format!("rank.{rank}")).join("stderr");
            let text = std::fs::read_to_string(&stderr).unwrap_or_default();
            if let Some(line) = text.lines().find(|l| l.starts_with("error:")) {
                *slot = Some((line.to_string(), cut.elapsed()));
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let link_back = cut_for.saturating_sub(cut.elapsed());
    std::thread::sleep(link_back);
    cluster.set_link(1, true).unwrap();
    println!("{test}: node 1's link restored after {:?}", cut.elapsed());
    for (rank, error) in errors.iter().enumerate() {
        let Some((line, after)) = error else {
            panic!("rank {rank} printed no error within {bound:?} of the cut")
        };
        println!("{test}: rank {rank} after {after:?}: {line}");
        assert!(*after < bound, "rank {rank} failed {after:?} after the cut: {line}");
        let others = if rank < RANKS_PER_NODE {
            "rank(s) 2, 3 "
        } else {
            "rank(s) 0, 1 "
        };
        assert!(
            line.contains("did not complete within") && line.contains(&format!("no word from mpirun {others}")),
            "rank {rank}: {line}"
        );
    }

    // Bounded: a hung job fails the test (the cluster's drop then kills what runs in its nodes).
    while !supervisor.is_finished() {
        assert!(
            started.elapsed() < JOB_LIMIT + cut_for,
            "the supervised job ran over {:?}",
            JOB_LIMIT + cut_for
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let outcome = supervisor
        .join()
        .unwrap()
        .unwrap_or_else(|e| panic!("the restarted job failed: {e}"));
    println!("{test}: the supervised job ended {:?} after the cut", cut.elapsed());
    assert!(started.elapsed() < JOB_LIMIT + cut_for, "{:?}", started.elapsed());
    assert_eq!(outcome.restarts.len(), 1, "one restart: {:?}", outcome.restarts);
    let rank0 = std::fs::read_to_string(logs.join("1").join("rank.0").join("stdout")).unwrap_or_default();
    let resumed: usize = rank0
        .lines()
        .find_map(|l| {
            l.split_once("resumed from ")?
                .1
                .split_once(" at step ")?
                .1
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("the second start resumed from no checkpoint:\n{rank0}"));
    assert!(
        resumed >= 20,
        "resumed from step {resumed}, before the cut's checkpoint"
    );

    // The same job on one host, uninterrupted: the resumed job's losses at every step it ran.
    let whole = dir.join("uninterrupted");
    run_ok(one_host(&bin, &job_args(3, 1, steps, &whole)), "the uninterrupted job");
    let (after, whole) = (losses(&dir.join("out")), losses(&whole));
    assert_eq!(after.len(), steps - resumed, "the resumed job's rows: {after:?}");
    assert_eq!(
        after[..],
        whole[resumed..],
        "losses of the resumed job against the uninterrupted one"
    );
}
