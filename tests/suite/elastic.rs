//! `burn-shard-run --max-restarts` and `--nnodes MIN:MAX` ([`burn_shard_launch::run`]) with
//! processes: a stand-in training program (this test binary's [`rank_process`]) that joins the
//! rendezvous, exchanges its part of each step through the store, checkpoints every few steps
//! and resumes from its newest checkpoint when started again. Its "training" sums per-sample
//! contributions in sample order, so any world size gives the same state bit for bit, and the
//! test computes the uninterrupted run itself ([`reference`]).
//!
//! Killed at a random step (SIGKILL), a rank's job restarts and ends where an uninterrupted
//! run ends; a lost node (its launcher killed with SIGKILL) restarts the job at world size 2;
//! a crash loop ends after `--max-restarts` with the first failure. No test leaves a rank
//! running (checked by pid), and every wait is bounded. Real sharded training restarted under
//! `mpirun` is in the MPI suite (`mpi::a_killed_rank_restarts_the_mpi_job_*`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use burn_shard_comm::{Rendezvous, RendezvousEnv};
use burn_shard_launch::{LaunchConfig, LaunchError, OutputMode, RESTART_COUNT, parse_args, run};

use crate::job_fixtures::{SECOND, ended, scratch_dir, token};

/// The stand-in's options, passed in the environment by the tests.
const DIR: &str = "BURN_SHARD_ELASTIC_DIR";
const STEPS: &str = "BURN_SHARD_ELASTIC_STEPS";
/// `start:rank:step`: in that start (restart count), that rank SIGKILLs itself before that step.
const KILL: &str = "BURN_SHARD_ELASTIC_KILL";
/// `rank:step`: in every start, that rank exits with code `3 + restart count` before that step.
const FAIL: &str = "BURN_SHARD_ELASTIC_FAIL";
/// The node launcher's options (see [`node_process`]).
const NODE: &str = "BURN_SHARD_ELASTIC_NODE";

/// Samples per step; divisible by every world size used (2, 4).
const SAMPLES: usize = 12;
/// Steps between checkpoints.
const EVERY: usize = 3;
/// The state's length.
const WIDTH: usize = 4;

/// Sample `i`'s contribution at `step`: a smooth function of the state, never exact in f64,
/// so that an order of summation or a lost step would change the bits.
fn contribution(state: &[f64; WIDTH], step: usize, i: usize) -> f64 {
    let x = state[i % WIDTH];
    (x * (i as f64 + 1.0) + step as f64 * 0.37).sin() / (1.0 + i as f64)
}

/// One step: `sums` holds every sample's contribution, in sample order.
fn update(state: &mut [f64; WIDTH], contributions: &[f64]) {
    for (j, s) in state.iter_mut().enumerate() {
        let sum: f64 = contributions.iter().skip(j).step_by(WIDTH).sum();
        *s = 0.9 * *s + 0.3 * sum;
    }
}

fn initial() -> [f64; WIDTH] {
    [0.1, -0.7, 1.3, 0.5]
}

/// The uninterrupted run, computed here.
fn reference(steps: usize) -> [f64; WIDTH] {
    let mut state = initial();
    for step in 0..steps {
        let c: Vec<f64> = (0..SAMPLES).map(|i| contribution(&state, step, i)).collect();
        update(&mut state, &c);
    }
    state
}

fn encode(values: &[f64]) -> String {
    values
        .iter()
        .map(|v| format!("{:016x}", v.to_bits()))
        .collect::<Vec<_>>()
        .join(" ")
}

fn decode(text: &str) -> Vec<f64> {
    text.split_whitespace()
        .map(|w| f64::from_bits(u64::from_str_radix(w, 16).unwrap()))
        .collect()
}

/// The newest `ckpt-NNNN` of `dir`: its step and state.
fn newest_checkpoint(dir: &Path) -> Option<(usize, [f64; WIDTH])> {
    let mut steps: Vec<usize> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("ckpt-")?.parse().ok())
        .collect();
    steps.sort();
    let step = *steps.last()?;
    let values = decode(&std::fs::read_to_string(dir.join(format!("ckpt-{step:04}"))).ok()?);
    Some((step, values.try_into().ok()?))
}

/// Writes `path` whole or not at all (a rank killed mid-write leaves the previous checkpoint).
fn write_atomic(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// `start:rank:step` / `rank:step` numbers of an option, if set.
fn numbers(var: &str) -> Option<Vec<usize>> {
    let text = std::env::var(var).ok().filter(|t| !t.is_empty())?;
    Some(text.split(':').map(|n| n.parse().unwrap()).collect())
}

/// One rank of the stand-in program, started by `run` through the tests below.
#[test]
#[ignore = "a rank process of the elastic tests, which start it through the launcher"]
fn rank_process() {
    let (Ok(env), Ok(dir)) = (RendezvousEnv::from_env(), std::env::var(DIR)) else {
        return; // started by hand: there is no job
    };
    let dir = PathBuf::from(dir);
    let steps: usize = std::env::var(STEPS).unwrap().parse().unwrap();
    let restart: usize = std::env::var(RESTART_COUNT).unwrap().parse().unwrap();
    let (rank, world) = (env.rank, env.world_size);
    std::fs::write(
        dir.join(format!("pid-{restart}-{world}-{rank}")),
        std::process::id().to_string(),
    )
    .unwrap();
    let rendezvous = Rendezvous::new(env, 30 * SECOND).unwrap();
    let store = rendezvous.store();
    let (start, mut state) = newest_checkpoint(&dir).unwrap_or((0, initial()));
    for step in start..steps {
        if numbers(KILL) == Some(vec![restart, rank, step]) {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &std::process::id().to_string()])
                .status();
            std::thread::sleep(10 * SECOND); // the signal is on its way
        }
        if numbers(FAIL) == Some(vec![rank, step]) {
            eprintln!("rank {rank} fails at step {step} (start {restart})");
            std::process::exit(3 + restart as i32);
        }
        let mine: Vec<f64> = (rank..SAMPLES)
            .step_by(world)
            .map(|i| contribution(&state, step, i))
            .collect();
        store
            .set(&format!("step-{step}/rank-{rank}"), encode(&mine).as_bytes())
            .unwrap();
        if rank == 0 {
            let mut all = vec![0.0; SAMPLES];
            for peer in 0..world {
                let theirs = decode(
                    &String::from_utf8(store.get(&format!("step-{step}/rank-{peer}"), 30 * SECOND).unwrap()).unwrap(),
                );
                for (k, v) in theirs.into_iter().enumerate() {
                    all[peer + k * world] = v;
                }
            }
            update(&mut state, &all);
            if (step + 1) % EVERY == 0 {
                write_atomic(&dir.join(format!("ckpt-{:04}", step + 1)), &encode(&state));
            }
            store
                .set(&format!("step-{step}/state"), encode(&state).as_bytes())
                .unwrap();
        } else {
            let text = store.get(&format!("step-{step}/state"), 30 * SECOND).unwrap();
            state = decode(&String::from_utf8(text).unwrap()).try_into().unwrap();
        }
        std::thread::sleep(Duration::from_millis(30)); // a step takes time, so a kill lands mid-run
    }
    if rank == 0 {
        write_atomic(&dir.join("final"), &format!("{world} {start} {}", encode(&state)));
    }
    rendezvous.barrier(30 * SECOND).unwrap();
}

/// The stand-in's launch on node `node` of `nnodes` (`min` at least), `nproc` ranks each, up to
/// 2 restarts; `options` are the stand-in's variables ([`KILL`], [`FAIL`]). The ranks are
/// started through `env`, which sets them and execs this binary (same pid): the test process's
/// own environment is left alone.
fn stand_in(
    dir: &Path,
    steps: usize,
    nproc: usize,
    (node, min, nnodes): (usize, usize, usize),
    port: u16,
    options: &[(&str, String)],
) -> LaunchConfig {
    let vars = [(DIR, dir.display().to_string()), (STEPS, steps.to_string())];
    let mut args: Vec<std::ffi::OsString> = vars
        .iter()
        .chain(options)
        .map(|(k, v)| format!("{k}={v}").into())
        .collect();
    args.push(std::env::current_exe().unwrap().into());
    args.extend(
        [
            "elastic::rank_process",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ]
        .map(Into::into),
    );
    LaunchConfig::new("env", nproc)
        .with_args(args)
        .with_nodes(nnodes, node)
        .with_min_nodes(min)
        .with_master("127.0.0.1", port)
        .with_token(token())
        .with_output(OutputMode::Capture)
        .with_stop_grace(SECOND)
        .with_node_timeouts(4 * SECOND, 4 * SECOND)
        .with_max_restarts(2)
}

/// The final state the stand-in wrote: world size, the step its last start began at, state.
fn final_state(dir: &Path) -> (usize, usize, Vec<f64>) {
    let text = std::fs::read_to_string(dir.join("final")).unwrap();
    let mut words = text.splitn(3, ' ');
    let world = words.next().unwrap().parse().unwrap();
    let start = words.next().unwrap().parse().unwrap();
    (world, start, decode(words.next().unwrap()))
}

/// Every rank the stand-in started (`pid-*` files) has ended: no orphan.
fn assert_no_rank_left(dir: &Path) {
    let deadline = Instant::now() + 10 * SECOND;
    loop {
        let alive: Vec<u32> = std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| {
                let e = e.ok()?;
                e.file_name().to_str()?.starts_with("pid-").then_some(())?;
                std::fs::read_to_string(e.path()).ok()?.trim().parse().ok()
            })
            .filter(|&pid| !ended(pid))
            .collect();
        if alive.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "ranks still running after the job: {alive:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A port `p` for the ranks' rendezvous with `p + 1` (the launchers' store) free too, a moment
/// ago.
fn free_port() -> u16 {
    loop {
        let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = first.local_addr().unwrap().port();
        if port < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
}

/// A random step in `lo..hi`, printed so that a failure can be replayed.
fn random_step(lo: usize, hi: usize) -> usize {
    let step = lo + rand::random_range(0..hi - lo);
    println!("killing at step {step}");
    step
}

#[test]
fn a_rank_killed_at_a_random_step_restarts_the_two_node_job_which_ends_as_if_uninterrupted() {
    // 4 ranks: 2 "nodes" of 2 on localhost, each node's launcher on its own thread.
    let dir = scratch_dir("elastic-kill");
    let steps = 12;
    let kill_step = random_step(1, steps);
    let port = free_port();
    let started = Instant::now();
    let kill = [(KILL, format!("0:3:{kill_step}"))]; // rank 3 of the first start kills itself
    let nodes: Vec<_> = (0..2)
        .map(|node| {
            let config = stand_in(&dir, steps, 2, (node, 2, 2), port, &kill);
            std::thread::spawn(move || run(&config))
        })
        .collect();
    let outcomes: Vec<_> = nodes.into_iter().map(|n| n.join().unwrap()).collect();
    for (node, outcome) in outcomes.iter().enumerate() {
        let outcome = outcome.as_ref().unwrap_or_else(|e| panic!("node {node}: {e}"));
        assert_eq!(outcome.world_size, 4);
        assert_eq!(outcome.restarts.len(), 1, "node {node}: {:?}", outcome.restarts);
        assert!(
            outcome.restarts[0].contains("rank 3") && outcome.restarts[0].contains("signal: 9"),
            "node {node}'s restart names the killed rank: {:?}",
            outcome.restarts
        );
    }
    let start = assert_finished(&dir, 4, steps, started);
    assert_eq!(
        start,
        kill_step / EVERY * EVERY,
        "resumed from the newest checkpoint before the kill"
    );
}

/// The job in `dir` finished at `world` ranks with the uninterrupted run's state, bit for bit,
/// within a minute of `started`, and left no rank running; returns the step its last start
/// began at.
fn assert_finished(dir: &Path, world: usize, steps: usize, started: Instant) -> usize {
    let (world_seen, start, state) = final_state(dir);
    assert_eq!(world_seen, world);
    assert_eq!(
        encode(&state),
        encode(&reference(steps)),
        "bitwise the uninterrupted run"
    );
    // The node timeout (4 s) and node wait (4 s) at most, and the steps: well under a minute.
    assert!(started.elapsed() < 60 * SECOND, "{:?}", started.elapsed());
    assert_no_rank_left(dir);
    start
}

/// A node's launcher (`--nnodes 1:2`, 2 ranks, `--max-restarts 1`) in a process of its own, so that a test can
/// kill it with SIGKILL (its ranks die with it) or start it in a cluster's node. Writes how it
/// ended to `outcome-node-K` in the job's folder ([`node_outcome`]).
#[test]
#[ignore = "a node launcher of the elastic tests, which start it"]
fn node_process() {
    let Ok(options) = std::env::var(NODE) else {
        return; // started by hand: there is no job
    };
    let [dir, steps, port, node, master]: [&str; 5] = options.split(' ').collect::<Vec<_>>().try_into().unwrap();
    let node: usize = node.parse().unwrap();
    let mut config = stand_in(
        Path::new(dir),
        steps.parse().unwrap(),
        2,
        (node, 1, 2),
        port.parse().unwrap(),
        &[],
    );
    config.master_addr = master.to_string();
    config.max_restarts = 1;
    let text = match run(&config) {
        Ok(outcome) => {
            let lines = [format!("world_size {}", outcome.world_size)].into_iter();
            let restarts = outcome.restarts.iter().map(|r| format!("restart {r}"));
            let changes = outcome.member_changes.iter().map(|c| format!("member_change {c}"));
            lines.chain(restarts).chain(changes).collect::<Vec<_>>().join("\n")
        }
        Err(e) => format!("error {e}"),
    };
    write_atomic(&Path::new(dir).join(format!("outcome-node-{node}")), &text);
}

/// [`node_process`] as node `node` of the job in `dir`, with its ranks' store at
/// `master:port`, run by `command` (this test binary, perhaps inside a cluster's node).
pub(crate) fn node_process_command(
    mut command: std::process::Command,
    dir: &Path,
    steps: usize,
    port: u16,
    (node, master): (usize, &str),
) -> std::process::Command {
    command
        .args([
            "elastic::node_process",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(NODE, format!("{} {steps} {port} {node} {master}", dir.display()))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    command
}

/// How [`node_process`] `node` of the job in `dir` ended: its world size, restarts' causes and
/// changes of members, or its error.
pub(crate) fn node_outcome(dir: &Path, node: usize) -> Result<(usize, Vec<String>, Vec<String>), String> {
    let text = std::fs::read_to_string(dir.join(format!("outcome-node-{node}")))
        .map_err(|e| format!("node {node} wrote no outcome: {e}"))?;
    if let Some(error) = text.strip_prefix("error ") {
        return Err(error.to_string());
    }
    let (mut world, mut restarts, mut changes) = (0, Vec::new(), Vec::new());
    for line in text.lines() {
        let (what, rest) = line.split_once(' ').unwrap();
        match what {
            "world_size" => world = rest.parse().unwrap(),
            "restart" => restarts.push(rest.to_string()),
            _ => changes.push(rest.to_string()),
        }
    }
    Ok((world, restarts, changes))
}

/// A lost node back: 2 nodes of 2 ranks ([`node_process`], started by `node_command(node)`,
/// with the ranks' store at `master`). Node 1's launcher is killed with SIGKILL (its ranks die
/// with it) after a random checkpoint; node 0 restarts the job at world size 2; then node 1's
/// launcher is started again, node 0 stops that start, and the next start takes node 1 in. The
/// job ends at world size 4 with the uninterrupted run's state, bit for bit, one restart (the
/// lost node) and one change of members (not counted as a restart: `--max-restarts 1`, and
/// the ranks' `BURN_SHARD_RESTART_COUNT` stays 1), within a minute; no rank or launcher is
/// left running.
pub(crate) fn a_lost_node_comes_back(
    test: &str,
    dir: &Path,
    master: &str,
    node_command: impl Fn(usize) -> std::process::Command,
) {
    let steps = 240;
    let port = free_port();
    let started = Instant::now();
    let start_node = |node: usize| {
        node_process_command(node_command(node), dir, steps, port, (node, master))
            .spawn()
            .unwrap()
    };
    // Killed on every way out, a failed assertion included.
    let mut nodes = Launchers(vec![start_node(0), start_node(1)]);
    let kill_at = random_step(1, 4) * EVERY;
    while newest_checkpoint(dir).is_none_or(|(step, _)| step < kill_at) {
        assert!(
            started.elapsed() < 60 * SECOND,
            "{test}: the 4-rank job made no checkpoint"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    nodes.0[1].kill().unwrap();
    nodes.0[1].wait().unwrap();
    let killed_at = newest_checkpoint(dir).unwrap().0;
    // Start 1 runs without node 1 (its rank 0 records its pid, restart 1, world size 2):
    // bring node 1 back.
    while !dir.join("pid-1-2-0").exists() {
        assert!(started.elapsed() < 60 * SECOND, "{test}: no start without node 1");
        std::thread::sleep(Duration::from_millis(5));
    }
    let back_at = newest_checkpoint(dir).map_or(0, |(step, _)| step);
    nodes.0[1] = start_node(1);
    for (node, child) in nodes.0.iter_mut().enumerate() {
        while child.try_wait().unwrap().is_none() {
            assert!(
                started.elapsed() < 90 * SECOND,
                "{test}: node {node}'s launcher still runs"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let (world, restarts, changes) = node_outcome(dir, 0).unwrap_or_else(|e| panic!("{test}: node 0: {e}"));
    println!(
        "{test}: node 1 killed after checkpoint {killed_at}, back after {back_at}, done in {:?}; restart: \
         {restarts:?}; change: {changes:?}",
        started.elapsed()
    );
    assert_eq!(world, 4, "{test}: the last start has node 1 again");
    assert_eq!(restarts.len(), 1, "{test}: {restarts:?}");
    assert!(
        restarts[0].contains("node 1's launcher stopped answering"),
        "{test}: {restarts:?}"
    );
    assert_eq!(changes.len(), 1, "{test}: {changes:?}");
    assert!(changes[0].contains("node(s) 1 asked to join"), "{test}: {changes:?}");
    let (world1, _, _) = node_outcome(dir, 1).unwrap_or_else(|e| panic!("{test}: node 1 back: {e}"));
    assert_eq!(world1, 4);
    let start = assert_finished(dir, 4, steps, started);
    assert!(
        start >= back_at,
        "{test}: resumed from step {start}, the newest checkpoint was {back_at}"
    );
    assert!(
        dir.join("pid-1-4-3").exists(),
        "{test}: start 2 ran node 1's ranks with BURN_SHARD_RESTART_COUNT 1"
    );
}

/// Node launcher processes, killed when dropped (a failed test leaves none running).
struct Launchers(Vec<std::process::Child>);

impl Drop for Launchers {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[test]
fn a_lost_node_that_comes_back_is_taken_in_and_the_job_ends_as_if_uninterrupted() {
    let dir = scratch_dir("elastic-back");
    let test = "a_lost_node_that_comes_back_is_taken_in_and_the_job_ends_as_if_uninterrupted";
    a_lost_node_comes_back(test, &dir, "127.0.0.1", |_| {
        std::process::Command::new(std::env::current_exe().unwrap())
    });
}

#[test]
fn a_lost_node_restarts_the_job_at_world_size_two() {
    let dir = scratch_dir("elastic-lost-node");
    let steps = 60;
    let port = free_port();
    let started = Instant::now();
    let node0 = {
        let config = stand_in(&dir, steps, 2, (0, 1, 2), port, &[]);
        std::thread::spawn(move || run(&config))
    };
    let exe = std::process::Command::new(std::env::current_exe().unwrap());
    let mut node1 = node_process_command(exe, &dir, steps, port, (1, "127.0.0.1"))
        .spawn()
        .unwrap();
    // Lose node 1 (its launcher and, with it, ranks 2 and 3) once the job has checkpointed.
    let kill_at = random_step(1, 4) * EVERY;
    while newest_checkpoint(&dir).is_none_or(|(step, _)| step < kill_at) {
        assert!(started.elapsed() < 60 * SECOND, "the 4-rank job made no checkpoint");
        std::thread::sleep(Duration::from_millis(5));
    }
    node1.kill().unwrap();
    node1.wait().unwrap();
    let killed_after = newest_checkpoint(&dir).unwrap().0;

    let outcome = node0.join().unwrap().unwrap();
    assert_eq!(outcome.world_size, 2, "restarted without node 1");
    assert_eq!(outcome.restarts.len(), 1, "{:?}", outcome.restarts);
    assert!(
        outcome.restarts[0].contains("node 1's launcher stopped answering"),
        "{:?}",
        outcome.restarts
    );
    let start = assert_finished(&dir, 2, steps, started);
    assert!(
        start >= killed_after,
        "resumed from step {start}, the newest checkpoint was {killed_after}"
    );
}

#[test]
fn a_crash_loop_ends_after_max_restarts_with_the_first_failure() {
    let dir = scratch_dir("elastic-crash-loop");
    let started = Instant::now();
    // One node, 2 ranks: rank 1 exits with 3 + restart count at step 2 of every start.
    let config = stand_in(&dir, 6, 2, (0, 1, 1), free_port(), &[(FAIL, "1:2".into())]);
    let error = run(&config).unwrap_err();
    match &error {
        LaunchError::GaveUp { restarts, first, later } => {
            assert_eq!(*restarts, 2);
            assert!(
                matches!(**first, LaunchError::RankFailed { rank: 1, status, .. } if status.code() == Some(3)),
                "the first failure is reported: {first}"
            );
            assert_eq!(later.len(), 2, "{later:?}");
            assert!(later[1].contains("exit status: 5"), "{later:?}");
        }
        other => panic!("expected GaveUp, got {other}"),
    }
    assert_eq!(error.exit_code(), 3, "the first failure's exit code");
    let text = error.to_string();
    assert!(
        text.starts_with("gave up after 2 restart(s)") && text.contains("rank 1"),
        "{text}"
    );
    assert!(started.elapsed() < 30 * SECOND, "{:?}", started.elapsed());
    assert_no_rank_left(&dir);
}

#[test]
fn the_command_line_takes_restarts_an_elastic_node_range_and_a_supervised_command() {
    let dir = scratch_dir("elastic-cli");
    let token_file = dir.join("job.token");
    std::fs::write(&token_file, crate::job_fixtures::TEST_TOKEN).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let token = token_file.to_str().unwrap();
    let config = parse_args([
        "burn-shard-run",
        "--nnodes",
        "1:3",
        "--node-rank",
        "2",
        "--nproc-per-node",
        "4",
        "--max-restarts",
        "5",
        "--node-wait",
        "10",
        "--node-timeout",
        "7.5",
        "--master-addr",
        "h",
        "--job-token-file",
        token,
        "./train",
    ])
    .unwrap();
    assert_eq!((config.min_nodes, config.nnodes, config.node_rank), (1, 3, 2));
    assert_eq!((config.max_restarts, config.world_size()), (5, 12));
    assert_eq!(
        (config.node_wait, config.node_timeout),
        (10 * SECOND, Duration::from_millis(7500))
    );
    assert!(config.is_elastic());
    assert_eq!(config.agent_port(), 29501);

    let config = parse_args([
        "burn-shard-run",
        "--supervise",
        "--max-restarts",
        "2",
        "--",
        "mpirun",
        "-np",
        "4",
        "./t",
    ])
    .unwrap();
    assert!(config.supervise && !config.is_elastic());
    assert_eq!((config.program.to_str(), config.nproc_per_node), (Some("mpirun"), 1));
    assert!(config.rank_env(0).is_empty(), "mpirun sets its ranks' own variables");

    let err = |args: &[&str]| parse_args(args.iter().copied()).unwrap_err().to_string();
    assert!(err(&["burn-shard-run", "--nproc-per-node", "2", "--nnodes", "0:2", "x"]).contains("MIN:MAX"));
    assert!(err(&["burn-shard-run", "--nproc-per-node", "2", "--nnodes", "3:2", "x"]).contains("MIN:MAX"));
    assert!(err(&["burn-shard-run", "--supervise", "--nproc-per-node", "2", "x"]).contains("--nproc-per-node"));
    assert!(err(&["burn-shard-run", "--nproc-per-node", "1", "--node-wait=-1", "x"]).contains("--node-wait"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_node_that_cannot_start_its_program_ends_the_job_on_every_node_without_a_restart() {
    let dir = scratch_dir("elastic-final");
    let port = free_port();
    let started = Instant::now();
    let node0 = {
        let config = stand_in(&dir, 60, 2, (0, 2, 2), port, &[]);
        std::thread::spawn(move || run(&config))
    };
    let mut broken = stand_in(&dir, 60, 2, (1, 2, 2), port, &[]);
    broken.program = "/nonexistent/burn-shard-elastic-program".into();
    // Both nodes end with the failure node 1 published, as it is not one a restart mends.
    for (node, error) in [(1, run(&broken).unwrap_err()), (0, node0.join().unwrap().unwrap_err())] {
        match &error {
            LaunchError::Stopped {
                cause,
                restartable,
                code,
            } => {
                assert!(
                    !restartable && cause.starts_with("node 1: cannot start"),
                    "node {node}: {error}"
                );
                assert_eq!(*code, 127, "node {node}: the program's start failure");
                assert_eq!(error.exit_code(), 127);
            }
            other => panic!("node {node}: expected Stopped, got {other}"),
        }
    }
    assert!(started.elapsed() < 30 * SECOND, "{:?}", started.elapsed());
    assert_no_rank_left(&dir);
}

/// Node 1 starts after node 0 went ahead alone: node 0 stops its start and the next one has
/// both nodes (a change of members, not a restart).
#[test]
fn a_node_that_starts_while_the_job_runs_without_it_joins_the_next_start() {
    let dir = scratch_dir("elastic-late");
    let port = free_port();
    // Node 0 waits 4 s for node 1, then starts alone (MIN 1) at world size 2.
    let node0 = {
        let config = stand_in(&dir, 90, 2, (0, 1, 2), port, &[]);
        std::thread::spawn(move || run(&config))
    };
    let started = Instant::now();
    while newest_checkpoint(&dir).is_none() {
        assert!(started.elapsed() < 30 * SECOND, "node 0 did not start alone");
        std::thread::sleep(Duration::from_millis(5));
    }
    let late = run(&stand_in(&dir, 90, 2, (1, 1, 2), port, &[])).unwrap();
    let outcome = node0.join().unwrap().unwrap();
    for (node, outcome) in [(0, &outcome), (1, &late)] {
        assert_eq!((outcome.world_size, outcome.restarts.len()), (4, 0), "node {node}");
    }
    assert_eq!(outcome.member_changes.len(), 1, "{:?}", outcome.member_changes);
    assert!(
        outcome.member_changes[0].contains("node(s) 1 asked to join"),
        "{:?}",
        outcome.member_changes
    );
    assert_eq!(encode(&final_state(&dir).2), encode(&reference(90)));
    assert_eq!(final_state(&dir).0, 4);
    assert_no_rank_left(&dir);
}

/// Two launchers with the same `--node-rank 1` while the first start forms (node 0 waits its
/// whole `--node-wait` for a third node, so both register before it counts): the one node 0
/// counted runs node 1's ranks, the other is refused once it sees that one's heartbeat move,
/// and the job ends at world size 4 with the uninterrupted run's state (no rank numbers twice).
#[test]
fn of_two_launchers_with_one_node_rank_one_runs_and_the_other_is_refused() {
    let dir = scratch_dir("elastic-twice");
    let port = free_port();
    let started = Instant::now();
    let launchers: Vec<_> = [0, 1, 1]
        .into_iter()
        .map(|node| {
            let config = stand_in(&dir, 60, 2, (node, 2, 3), port, &[]);
            std::thread::spawn(move || run(&config))
        })
        .collect();
    let outcomes: Vec<_> = launchers.into_iter().map(|l| l.join().unwrap()).collect();
    let node0 = outcomes[0].as_ref().unwrap_or_else(|e| panic!("node 0: {e}"));
    assert_eq!((node0.world_size, node0.restarts.len()), (4, 0));
    let refused: Vec<String> = outcomes[1..]
        .iter()
        .filter_map(|o| o.as_ref().err())
        .map(|e| e.to_string())
        .collect();
    assert_eq!(
        refused.len(),
        1,
        "exactly one of the two node-1 launchers is refused: {refused:?}"
    );
    assert!(
        refused[0].contains("another burn-shard-run with --node-rank 1 is running") && refused[0].contains("unique"),
        "{}",
        refused[0]
    );
    assert!(
        outcomes[1..]
            .iter()
            .any(|o| o.as_ref().is_ok_and(|o| o.world_size == 4))
    );
    assert_finished(&dir, 4, 60, started);
}

#[test]
fn a_supervised_command_is_started_again_and_its_first_failure_reported() {
    let dir = scratch_dir("elastic-supervise");
    let count = dir.join("starts");
    // Fails with 3, then 4; succeeds at the third start.
    let script = format!(
        "echo x >> {0}; n=$(wc -l < {0}); echo \"start $BURN_SHARD_RESTART_COUNT of $BURN_SHARD_MAX_RESTARTS, RANK=${{RANK-unset}}\"; \
         [ $n -ge 3 ] || exit $((n + 2))",
        count.display()
    );
    let config = LaunchConfig::new("sh", 1)
        .with_args(["-c", &script])
        .supervising()
        .with_max_restarts(2)
        .with_output(OutputMode::Capture);
    let outcome = run(&config).unwrap();
    let lines: Vec<&str> = outcome.output.iter().map(|l| l.text.as_str()).collect();
    assert_eq!(
        lines,
        ["start 2 of 2, RANK=unset"],
        "the finished start's lines, without rank variables"
    );
    assert_eq!(outcome.restarts.len(), 2);
    assert!(
        outcome.restarts[0].starts_with("sh failed: exit status: 3"),
        "{:?}",
        outcome.restarts
    );

    std::fs::remove_file(&count).unwrap();
    let error = run(&config.with_max_restarts(1)).unwrap_err();
    assert!(
        matches!(&error, LaunchError::GaveUp { first, .. } if matches!(**first, LaunchError::CommandFailed { .. }))
    );
    assert_eq!(error.exit_code(), 3, "{error}");
}
