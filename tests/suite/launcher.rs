//! `burn-shard-run`'s core (`launch`) on `sh` children and on this test binary: every rank's
//! environment, processes meeting through the launcher, fail-fast (a failing rank stops the
//! others within seconds, SIGTERM then SIGKILL after the grace period), start and
//! configuration errors, and the torchrun-like command line.

use std::path::Path;
use std::time::{Duration, Instant};

use burn_shard_comm::{Rendezvous, RendezvousEnv};
use burn_shard_launch::{LaunchConfig, LaunchError, OutputLine, OutputMode, OutputStream, launch, parse_args};

use crate::job_fixtures::{SECOND, TEST_TOKEN, ended, free_port, scratch_dir, token};

fn sh(script: &str, nproc: usize) -> LaunchConfig {
    LaunchConfig::new("sh", nproc)
        .with_args(["-c", script, "sh"])
        .with_output(OutputMode::Capture)
}

fn pids_in(dir: &Path, prefix: &str) -> Vec<u32> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let e = e.unwrap();
            let name = e.file_name().into_string().unwrap();
            name.starts_with(prefix)
                .then(|| std::fs::read_to_string(e.path()).unwrap().trim().parse().unwrap())
        })
        .collect()
}

#[test]
fn every_rank_runs_with_its_rank_environment() {
    // Node 1 of 2, three ranks per node: global ranks 3, 4, 5 of 6.
    let config = sh(
        "env; echo \"CVD=${CUDA_VISIBLE_DEVICES-unset}\"; echo to-stderr >&2; printf 'no newline\\r\\nlast'",
        3,
    )
    .with_nodes(2, 1)
    .with_master("10.1.2.3", 29511)
    .with_token(token());
    let outcome = launch(&config).unwrap();
    let ranks: Vec<(usize, usize, Option<i32>)> = outcome
        .ranks
        .iter()
        .map(|r| (r.rank, r.local_rank, r.status.code()))
        .collect();
    assert_eq!(ranks, vec![(3, 0, Some(0)), (4, 1, Some(0)), (5, 2, Some(0))]);
    let cvd = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into());
    for local_rank in 0..3 {
        let rank = 3 + local_rank;
        let stdout: Vec<&OutputLine> = outcome
            .output
            .iter()
            .filter(|l| l.rank == rank && l.stream == OutputStream::Stdout)
            .collect();
        let vars = stdout.iter().filter_map(|l| l.text.split_once('='));
        let env = RendezvousEnv::from_vars(vars).unwrap();
        assert_eq!(
            env,
            RendezvousEnv {
                rank,
                world_size: 6,
                local_rank,
                local_world_size: 3,
                master_addr: "10.1.2.3".into(),
                master_port: 29511,
                token: token(),
            }
        );
        assert!(
            stdout.iter().any(|l| l.text == format!("CVD={cvd}")),
            "CUDA_VISIBLE_DEVICES is passed unchanged"
        );
        let tail: Vec<&str> = stdout.iter().rev().take(2).rev().map(|l| l.text.as_str()).collect();
        assert_eq!(tail, ["no newline", "last"], "CRLF and an unterminated last line");
        let stderr: Vec<String> = outcome
            .output
            .iter()
            .filter(|l| l.rank == rank && l.stream == OutputStream::Stderr)
            .map(ToString::to_string)
            .collect();
        assert_eq!(stderr, [format!("[rank {rank}] to-stderr")]);
    }
}

/// One rank of [`processes_meet_through_the_launcher`]: this test binary, started by `launch`.
#[test]
#[ignore = "a rank process of launcher::processes_meet_through_the_launcher, which starts it"]
fn rank_process() {
    let Ok(env) = RendezvousEnv::from_env() else {
        return; // started by hand, not by the launcher: there is no job to join
    };
    let rendezvous = Rendezvous::new(env.clone(), 30 * SECOND).unwrap();
    if env.rank == 0 {
        rendezvous.store().set("greeting", b"hello from rank 0").unwrap();
    }
    let got = rendezvous.store().get("greeting", 30 * SECOND).unwrap();
    rendezvous.barrier(30 * SECOND).unwrap();
    println!(
        "rank {} of {} (local {}) got {:?}",
        env.rank,
        env.world_size,
        env.local_rank,
        String::from_utf8_lossy(&got)
    );
}

#[test]
fn processes_meet_through_the_launcher() {
    // Three processes of this test binary, each running only `rank_process`, exchange a key
    // through the store that rank 0 hosts at the address the launcher gave them all.
    let config = LaunchConfig::new(std::env::current_exe().unwrap(), 3)
        .with_args([
            "launcher::rank_process",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .with_master("127.0.0.1", free_port())
        .with_output(OutputMode::Capture);
    let outcome = launch(&config).unwrap();
    assert_eq!(outcome.ranks.len(), 3);
    for rank in 0..3 {
        // The test harness prints the test name first on the same line.
        let want = format!("rank {rank} of 3 (local {rank}) got \"hello from rank 0\"");
        assert!(
            outcome.output.iter().any(|l| l.rank == rank && l.text.ends_with(&want)),
            "rank {rank} did not report {want:?}: {:#?}",
            outcome.output
        );
    }
}

#[test]
fn a_failing_rank_stops_every_other_rank_within_seconds() {
    let dir = scratch_dir("fail-fast");
    // Every rank records its shell and a child it started, then rank 1 fails once all four
    // ranks are up (so the others are surely running when it does).
    let script = r#"
        sleep 30 & echo $! > "$1/.c$RANK" && mv "$1/.c$RANK" "$1/child.$RANK"
        echo $$ > "$1/.s$RANK" && mv "$1/.s$RANK" "$1/shell.$RANK"
        if [ "$RANK" = 1 ]; then
            while [ "$(ls "$1" | wc -l)" -lt 8 ]; do sleep 0.02; done
            echo "rank 1 gives up" >&2
            exit 3
        fi
        wait
    "#;
    let config = LaunchConfig::new("sh", 4)
        .with_args(["-c", script, "sh", dir.to_str().unwrap()])
        .with_output(OutputMode::Capture);
    let start = Instant::now();
    let err = launch(&config).unwrap_err();
    let took = start.elapsed();
    assert!(took < 10 * SECOND, "took {took:?}: the sleeping ranks were not stopped");
    match &err {
        LaunchError::RankFailed {
            rank: 1,
            local_rank: 1,
            status,
            stopped: 3,
        } => assert_eq!(status.code(), Some(3)),
        other => panic!("expected rank 1 to fail, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("rank 1") && msg.contains("exit status: 3"), "{msg}");
    assert_eq!(err.exit_code(), 3);
    assert!(!ended(std::process::id()), "the liveness check sees a live process");
    let pids = [pids_in(&dir, "shell."), pids_in(&dir, "child.")].concat();
    assert_eq!(pids.len(), 8, "every rank started");
    // The children are killed with their rank's process group; give init a moment to reap them.
    let deadline = Instant::now() + 5 * SECOND;
    while !pids.iter().all(|&p| ended(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let alive: Vec<_> = pids.iter().filter(|&&p| !ended(p)).collect();
    assert!(alive.is_empty(), "still running after launch returned: {alive:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_that_ignores_sigterm_is_killed_after_the_grace_period() {
    let dir = scratch_dir("grace");
    let script = r#"
        if [ "$RANK" = 0 ]; then
            while [ ! -e "$1/ready" ]; do sleep 0.02; done
            exit 1
        fi
        trap '' TERM
        touch "$1/ready"
        sleep 30
    "#;
    let grace = Duration::from_millis(400);
    let config = LaunchConfig::new("sh", 2)
        .with_args(["-c", script, "sh", dir.to_str().unwrap()])
        .with_output(OutputMode::Capture)
        .with_stop_grace(grace);
    let start = Instant::now();
    let err = launch(&config).unwrap_err();
    let took = start.elapsed();
    assert!(took >= grace && took < 10 * SECOND, "took {took:?}");
    assert!(
        matches!(
            err,
            LaunchError::RankFailed {
                rank: 0,
                stopped: 1,
                ..
            }
        ),
        "{err:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_killed_by_a_signal_is_a_failure() {
    let err = launch(&sh("if [ \"$RANK\" = 0 ]; then kill -9 $$; fi; sleep 30", 2)).unwrap_err();
    match &err {
        LaunchError::RankFailed { rank: 0, status, .. } => {
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(status.signal(), Some(9));
        }
        other => panic!("expected rank 0 killed, got {other:?}"),
    }
    assert_eq!(err.exit_code(), 128 + 9);
    assert!(err.to_string().contains("SIGKILL"), "{err}");
}

#[test]
fn a_program_that_cannot_start_is_an_error_naming_it() {
    let config = LaunchConfig::new("/nonexistent/burn-shard-program", 3);
    let err = launch(&config).unwrap_err();
    assert!(matches!(err, LaunchError::Spawn { rank: 0, .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("/nonexistent/burn-shard-program") && msg.contains("PATH"),
        "{msg}"
    );
    assert_eq!(err.exit_code(), 127);
}

#[test]
fn invalid_configurations_are_errors_before_anything_starts() {
    let base = || LaunchConfig::new("true", 2);
    let cases = [
        (LaunchConfig::new("true", 0), "nproc_per_node"),
        (base().with_nodes(2, 2), "node_rank 2"),
        (base().with_nodes(0, 0), "nnodes"),
        (base().with_master("10.0.0.1", 0), "master_port"),
        (base().with_master("", 29500), "master_addr"),
        (LaunchConfig::new("", 1), "no program"),
    ];
    for (config, want) in cases {
        match launch(&config) {
            Err(e @ LaunchError::Config(_)) => {
                assert!(e.to_string().contains(want), "{e}");
                assert_eq!(e.exit_code(), 2);
            }
            other => panic!("{want}: expected a configuration error, got {other:?}"),
        }
    }
}

#[test]
fn the_command_line_reads_like_torchrun() {
    let dir = scratch_dir("cli-token");
    let token_file = dir.join("job.token");
    std::fs::write(&token_file, format!("{TEST_TOKEN}\n")).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let config = parse_args([
        "burn-shard-run",
        "--nproc-per-node",
        "8",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "10.0.0.1",
        "--master-port",
        "29600",
        "--job-token-file",
        token_file.to_str().unwrap(),
        "--",
        "python",
        "train.py",
        "--lr",
        "3e-4",
    ])
    .unwrap();
    assert_eq!(config.program, "python");
    assert_eq!(config.args, ["train.py", "--lr", "3e-4"]);
    assert_eq!((config.nproc_per_node, config.nnodes, config.node_rank), (8, 2, 1));
    assert_eq!((config.master_addr.as_str(), config.master_port), ("10.0.0.1", 29600));
    assert_eq!((config.world_size(), config.rank(3)), (16, 11));
    assert_eq!(config.token, Some(token()), "the token is read from --job-token-file");

    // torchrun's underscores, and no `--` before the program.
    let config = parse_args(["burn-shard-run", "--nproc_per_node=2", "./train", "-v"]).unwrap();
    assert_eq!((config.program.to_str(), config.args.len()), (Some("./train"), 1));
    assert_eq!((config.master_addr.as_str(), config.master_port), ("127.0.0.1", 29500));

    let err = |args: &[&str]| parse_args(args.iter().copied()).unwrap_err().to_string();
    assert!(err(&["burn-shard-run", "--nproc-per-node", "2", "--nnodes", "2", "x"]).contains("--master-addr"));
    assert!(err(&["burn-shard-run", "--nproc-per-node", "2"]).contains("PROGRAM"));
    assert!(err(&["burn-shard-run", "x"]).contains("--nproc-per-node"));
    assert!(err(&["burn-shard-run", "--nproc-per-node", "1", "--stop-grace=-1", "x"]).contains("--stop-grace"));
    let _ = std::fs::remove_dir_all(&dir);
}
