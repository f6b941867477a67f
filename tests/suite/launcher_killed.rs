//! Ranks die with their launcher: a launcher (this test binary) killed by SIGKILL, at once or
//! while it starts its ranks, leaves no rank running.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use burn_shard_launch::{LaunchConfig, OutputMode, launch};

use crate::job_fixtures::{SECOND, ended, scratch_dir};

/// Where [`launcher_process`] has its ranks record their pids, and how many it starts.
const LAUNCHER_DIR_VAR: &str = "BURN_SHARD_TEST_LAUNCHER_DIR";
const LAUNCHER_NPROC_VAR: &str = "BURN_SHARD_TEST_LAUNCHER_NPROC";
/// The line [`launcher_process`] prints right before it starts its ranks.
const LAUNCHING: &str = "launcher: starting the ranks";

/// A launcher to kill: this test binary, started by [`start_launcher`], does what
/// `burn-shard-run` does (termination signals forwarded, then `launch`) with ranks that record
/// their pid first thing (`pid.<RANK>` in the given directory), then sleep.
#[test]
#[ignore = "the launcher process of the launcher_killed::ranks_die_with_a_launcher_killed_* tests, which start it"]
fn launcher_process() {
    use std::io::Write;
    let (Ok(dir), Ok(nproc)) = (std::env::var(LAUNCHER_DIR_VAR), std::env::var(LAUNCHER_NPROC_VAR)) else {
        return; // started by hand, not by a test: nothing to launch
    };
    let script = r#"echo $$ > "$1/pid.$RANK"; exec sleep 1000"#;
    let config = LaunchConfig::new("sh", nproc.parse().unwrap())
        .with_args(["-c", script, "sh", &dir])
        .with_output(OutputMode::Capture);
    burn_shard_launch::forward_termination_signals().unwrap();
    println!("{LAUNCHING}");
    std::io::stdout().flush().unwrap();
    let _ = launch(&config);
}

/// A [`launcher_process`] and the ranks it started: dropping it (a failed assertion included)
/// kills the launcher and every rank still running, so no test leaves processes behind.
struct KilledLauncher {
    launcher: std::process::Child,
    dir: PathBuf,
}

impl KilledLauncher {
    /// Starts the launcher with `nproc` ranks, and returns once it is about to start them.
    fn start(dir: &Path, nproc: usize) -> Self {
        use std::io::BufRead;
        let mut launcher = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "launcher_killed::launcher_process",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(LAUNCHER_DIR_VAR, dir)
            .env(LAUNCHER_NPROC_VAR, nproc.to_string())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let stdout = launcher.stdout.take().unwrap();
        let this = Self {
            launcher,
            dir: dir.to_path_buf(),
        };
        // The harness prints the test's name first, on the same line.
        let launching = std::io::BufReader::new(stdout)
            .lines()
            .any(|line| line.is_ok_and(|l| l.ends_with(LAUNCHING)));
        assert!(launching, "the launcher process ended before starting its ranks");
        this
    }

    /// The pids the ranks have recorded so far (a file still being written is skipped).
    fn rank_pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = std::fs::read_dir(&self.dir)
            .unwrap()
            .filter_map(|e| std::fs::read_to_string(e.ok()?.path()).ok()?.trim().parse().ok())
            .collect();
        pids.sort();
        pids
    }

    /// Kills the launcher with SIGKILL, so that it cannot stop its ranks itself, and reaps it.
    fn kill(&mut self) {
        self.launcher.kill().unwrap();
        self.launcher.wait().unwrap();
    }

    /// Waits up to `limit` for every recorded rank to end; returns how long that took, or the
    /// pids still running.
    fn ranks_ended_within(&self, limit: Duration) -> Result<Duration, Vec<u32>> {
        let start = Instant::now();
        loop {
            let alive: Vec<u32> = self.rank_pids().into_iter().filter(|&p| !ended(p)).collect();
            if alive.is_empty() {
                return Ok(start.elapsed());
            }
            if start.elapsed() >= limit {
                return Err(alive);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for KilledLauncher {
    fn drop(&mut self) {
        let _ = self.launcher.kill();
        let _ = self.launcher.wait();
        for pid in self.rank_pids().into_iter().filter(|&p| !ended(p)) {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn ranks_die_with_a_launcher_killed_by_sigkill() {
    let mut launcher = KilledLauncher::start(&scratch_dir("killed-launcher"), 2);
    let deadline = Instant::now() + 10 * SECOND;
    while launcher.rank_pids().len() < 2 {
        assert!(
            Instant::now() < deadline,
            "the ranks did not start: {:?}",
            launcher.rank_pids()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let pids = launcher.rank_pids();
    assert!(
        pids.iter().all(|&p| !ended(p)),
        "the ranks run before the launcher is killed"
    );
    launcher.kill();
    match launcher.ranks_ended_within(5 * SECOND) {
        Ok(took) => eprintln!("ranks {pids:?} ended {took:?} after their launcher was reaped"),
        Err(alive) => panic!("ranks {alive:?} outlived their launcher (killed by SIGKILL) by 5 s"),
    }
}

#[test]
fn ranks_die_with_a_launcher_killed_while_it_starts_them() {
    // Killed at once, or during the forks (between a rank's fork and its prctl, the rank must
    // notice it was orphaned already), or just after: no rank that got to record its pid
    // survives.
    let trials = 20;
    let mut started = Vec::new();
    for trial in 0..trials {
        let mut launcher = KilledLauncher::start(&scratch_dir(&format!("launcher-race-{trial}")), 4);
        std::thread::sleep(Duration::from_micros(1500 * trial));
        launcher.kill();
        if let Err(alive) = launcher.ranks_ended_within(5 * SECOND) {
            panic!("trial {trial}: ranks {alive:?} outlived their launcher by 5 s");
        }
        // A rank that survived without having recorded its pid yet would record it now.
        std::thread::sleep(Duration::from_millis(50));
        let alive: Vec<u32> = launcher.rank_pids().into_iter().filter(|&p| !ended(p)).collect();
        assert!(
            alive.is_empty(),
            "trial {trial}: ranks {alive:?} outlived their launcher"
        );
        started.push(launcher.rank_pids().len());
    }
    eprintln!("ranks that recorded their pid before the launcher was killed, per trial: {started:?}");
}
