//! [`launch`]: start this node's ranks, watch them, stop them all at the first failure.

use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::thread;
use std::time::{Duration, Instant};

use crate::output::{ReaderEvent, spawn_reader};
use crate::process_group::{self, Exit, SIGKILL, SIGTERM};
use crate::{LaunchConfig, LaunchError, OutputLine, OutputStream, signals};
use burn_shard_rendezvous::{JOB_TOKEN, JOB_TOKEN_FILE, JobToken};

/// How often the ranks' processes are checked (the delay before a failure is acted on).
const POLL: Duration = Duration::from_millis(20);
/// How long to wait, once every rank has been reaped, for the output pipes to close (a process
/// that left its rank's process group may still hold them).
pub(crate) const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// How one rank ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankExit {
    /// Global rank.
    pub rank: usize,
    /// Index on this node.
    pub local_rank: usize,
    /// Exit code or signal of the rank's main process.
    pub status: ExitStatus,
}

/// A launch in which every rank of this node exited with status 0.
#[derive(Clone, Debug)]
pub struct LaunchOutcome {
    /// One entry per rank of this node, in rank order.
    pub ranks: Vec<RankExit>,
    /// Every line the ranks wrote, in arrival order per stream, with
    /// [`OutputMode::Capture`](crate::OutputMode::Capture); empty with
    /// [`OutputMode::Prefix`](crate::OutputMode::Prefix). With restarts ([`run`](crate::run)),
    /// the lines of the start that finished (a failed start's captured lines are not kept;
    /// with `Prefix` every line is printed as it comes).
    pub output: Vec<OutputLine>,
    /// The job's world size in its last start (smaller than `nnodes·nproc_per_node` when an
    /// elastic job lost nodes).
    pub world_size: usize,
    /// Why the job was restarted, one line per restart, in order (empty with [`launch`]).
    pub restarts: Vec<String>,
    /// Why a start of an elastic job was stopped to take in a node that asked to join (a lost
    /// node back), one line each, in order; these are not counted as restarts.
    pub member_changes: Vec<String>,
}

/// One started rank.
struct Rank {
    rank: usize,
    local_rank: usize,
    child: Child,
    exited: bool,
}

/// Why the watch loop stopped early.
enum Failure {
    Rank(usize),
    Signal(i32),
    Watch(usize, String),
    /// Another node's failure, seen by the caller's check ([`launch_with`]).
    Elsewhere(LaunchError),
}

/// What [`launch_with`] asks its caller every poll: `Some(error)` stops this node's ranks
/// and returns the error (another node failed).
pub(crate) type ExternalCheck<'a> = &'a mut dyn FnMut() -> Option<LaunchError>;

/// Starts `config.nproc_per_node` processes of `config.program`, each with its rank's
/// variables ([`LaunchConfig::rank_env`]) and the job token in `BURN_SHARD_JOB_TOKEN` (its own,
/// or a fresh random one per call when it has none: a single node needs nothing shared),
/// forwards or captures their output, and waits.
///
/// Fail-fast, as `torchrun`: when a rank exits non-zero or is killed, every other rank of this
/// node gets SIGTERM (its whole process group), then SIGKILL after `config.stop_grace`; the
/// call returns once all are reaped. Processes a rank leaves behind in its process group are
/// stopped when the launch ends, successful or not.
///
/// On Linux each rank's main process is started with SIGKILL as its parent-death signal, so the
/// ranks die with the launcher even when it is killed outright (SIGKILL, the OOM killer) and
/// cannot stop them. The kernel sends that signal when the *thread* that started the rank
/// exits: this function starts every rank from the calling thread and blocks in it until every
/// rank is reaped, so the signal only fires when the launcher process itself dies. Known limit:
/// processes a rank started itself (a shell's children, data-loader workers) are stopped
/// through the rank's process group only while the launcher lives; when it is killed outright
/// they may keep running after their rank has died.
///
/// # Errors
/// - [`LaunchError::Config`] for an invalid `config` (nothing is started);
/// - [`LaunchError::Token`] when the system cannot make a random token (nothing is started);
/// - [`LaunchError::Spawn`] when the program cannot be started (ranks already started are stopped);
/// - [`LaunchError::RankFailed`] naming the first rank seen failing, with its exit status;
/// - [`LaunchError::Interrupted`] when the launcher got SIGINT/SIGTERM/SIGHUP (with
///   [`forward_termination_signals`](crate::forward_termination_signals));
/// - [`LaunchError::Watch`] if the operating system cannot report a rank's state.
pub fn launch(config: &LaunchConfig) -> Result<LaunchOutcome, LaunchError> {
    // Counted from here, so a signal that arrives while the ranks are being started still stops them.
    launch_with(config, &[], &mut || None, signals::count())
}

/// [`launch`] with `extra_env` set for every rank on top of its rank variables, `external`
/// asked every poll whether to stop (another node of an elastic job failed), and the
/// termination signals counted from `signals_before` (the start of the whole job, so that one
/// that arrives between two starts is not lost).
pub(crate) fn launch_with(
    config: &LaunchConfig,
    extra_env: &[(&str, String)],
    external: ExternalCheck<'_>,
    signals_before: usize,
) -> Result<LaunchOutcome, LaunchError> {
    if let Some(signal) = signals::received_since(signals_before) {
        return Err(LaunchError::Interrupted { signal });
    }
    config.validate()?;
    let token = match &config.token {
        Some(token) => token.clone(),
        None => JobToken::generate().map_err(LaunchError::Token)?,
    };
    let (events, event_rx) = mpsc::channel();
    let mut ranks: Vec<Rank> = Vec::with_capacity(config.nproc_per_node);
    for local_rank in 0..config.nproc_per_node {
        let rank = config.rank(local_rank);
        let mut command = Command::new(&config.program);
        command
            .args(&config.args)
            .envs(config.rank_env(local_rank))
            .envs(extra_env.iter().map(|(k, v)| (k, v)))
            .env(JOB_TOKEN, token.reveal())
            .env_remove(JOB_TOKEN_FILE)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let spawned = process_group::spawn(&mut command).and_then(|mut child| {
            let pipes = (child.stdout.take(), child.stderr.take());
            ranks.push(Rank {
                rank,
                local_rank,
                child,
                exited: false,
            });
            if let (Some(out), Some(err)) = pipes {
                spawn_reader(out, rank, OutputStream::Stdout, config.output, events.clone())?;
                spawn_reader(err, rank, OutputStream::Stderr, config.output, events.clone())?;
            }
            Ok(())
        });
        if let Err(e) = spawned {
            stop(&mut ranks, SIGKILL, Duration::ZERO);
            return Err(LaunchError::Spawn {
                program: config.program.to_string_lossy().into_owned(),
                rank,
                error: e.to_string(),
            });
        }
    }
    drop(events); // the readers hold the remaining senders

    let failure = watch(&mut ranks, signals_before, external);
    let still_running = ranks.iter().filter(|r| !r.exited).count();
    let statuses = match &failure {
        None => stop(&mut ranks, SIGTERM, Duration::ZERO), // only leftovers of finished ranks
        Some(Failure::Signal(signal)) => stop(&mut ranks, *signal, config.stop_grace),
        Some(_) => stop(&mut ranks, SIGTERM, config.stop_grace),
    };
    let output = collect_output(&event_rx, 2 * ranks.len());

    match failure {
        None => Ok(LaunchOutcome {
            ranks: ranks
                .iter()
                .zip(statuses)
                .map(|(r, status)| RankExit {
                    rank: r.rank,
                    local_rank: r.local_rank,
                    status,
                })
                .collect(),
            output,
            world_size: config.world_size(),
            restarts: Vec::new(),
            member_changes: Vec::new(),
        }),
        Some(Failure::Rank(i)) if config.supervise => Err(LaunchError::CommandFailed {
            program: config.program.to_string_lossy().into_owned(),
            status: statuses[i],
        }),
        Some(Failure::Rank(i)) => Err(LaunchError::RankFailed {
            rank: ranks[i].rank,
            local_rank: ranks[i].local_rank,
            status: statuses[i],
            stopped: still_running,
        }),
        Some(Failure::Signal(signal)) => Err(LaunchError::Interrupted { signal }),
        Some(Failure::Watch(i, error)) => Err(LaunchError::Watch {
            rank: ranks[i].rank,
            error,
        }),
        Some(Failure::Elsewhere(error)) => Err(error),
    }
}

/// Polls the ranks until all have exited with status 0 (`None`) or something fails (a
/// termination signal counted after `signals_before` included).
fn watch(ranks: &mut [Rank], signals_before: usize, external: ExternalCheck<'_>) -> Option<Failure> {
    loop {
        if let Some(signal) = signals::received_since(signals_before) {
            return Some(Failure::Signal(signal));
        }
        if let Some(error) = external() {
            return Some(Failure::Elsewhere(error));
        }
        let mut running = 0;
        for (i, r) in ranks.iter_mut().enumerate().filter(|(_, r)| !r.exited) {
            match process_group::peek_exit(&r.child) {
                Ok(Exit::Running) => running += 1,
                Ok(Exit::Succeeded) => r.exited = true,
                Ok(Exit::Failed) => {
                    r.exited = true;
                    return Some(Failure::Rank(i));
                }
                Err(e) => return Some(Failure::Watch(i, e.to_string())),
            }
        }
        if running == 0 {
            return None;
        }
        thread::sleep(POLL);
    }
}

/// Sends `signal` to every rank's process group, waits up to `grace` (less on a second
/// termination signal) for the main processes to exit, SIGKILLs the groups and reaps every
/// main process. Returns the exit statuses in rank order.
fn stop(ranks: &mut [Rank], signal: i32, grace: Duration) -> Vec<ExitStatus> {
    let signals_before = signals::count();
    for r in ranks.iter() {
        process_group::signal_group(&r.child, signal);
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && signals::received_since(signals_before).is_none() {
        let running = ranks
            .iter()
            .filter(|r| matches!(process_group::peek_exit(&r.child), Ok(Exit::Running)))
            .count();
        if running == 0 {
            break;
        }
        thread::sleep(POLL);
    }
    // Every main process is still unreaped here, so each group id is still reserved for it.
    for r in ranks.iter() {
        process_group::signal_group(&r.child, SIGKILL);
    }
    ranks
        .iter_mut()
        .map(|r| {
            r.exited = true;
            // After SIGKILL, `wait` returns as soon as the kernel has ended the process. It can
            // only fail if the child was already reaped, which nothing else here does.
            r.child.wait().unwrap_or_else(|_| killed_status())
        })
        .collect()
}

/// The status of a process ended by SIGKILL, for a child whose real status is lost.
fn killed_status() -> ExitStatus {
    #[cfg(unix)]
    {
        std::os::unix::process::ExitStatusExt::from_raw(SIGKILL)
    }
    #[cfg(not(unix))]
    {
        ExitStatus::default()
    }
}

/// Gathers captured lines until all `pipes` have closed, or [`DRAIN_TIMEOUT`] passes.
fn collect_output(events: &Receiver<ReaderEvent>, pipes: usize) -> Vec<OutputLine> {
    let deadline = Instant::now() + DRAIN_TIMEOUT;
    let mut lines = Vec::new();
    let mut closed = 0;
    while closed < pipes {
        let left = deadline.saturating_duration_since(Instant::now());
        match events.recv_timeout(left) {
            Ok(ReaderEvent::Line(line)) => lines.push(line),
            Ok(ReaderEvent::Closed) => closed += 1,
            Err(_) => break, // timed out, or every reader has ended
        }
    }
    lines
}
