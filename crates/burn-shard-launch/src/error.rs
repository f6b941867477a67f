//! Why a launch failed.

use std::process::ExitStatus;

/// Why [`launch`](crate::launch) failed. Every message names the rank involved and what to do.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The configuration cannot describe a job (e.g. `node_rank >= nnodes`).
    #[error("invalid launch configuration: {0}")]
    Config(String),
    /// The program could not be started; the ranks already started were stopped.
    #[error(
        "cannot start {program:?} for rank {rank}: {error}; check the program's path (or that it is on PATH) \
         and that it is executable"
    )]
    Spawn {
        /// The program as given.
        program: String,
        /// The rank it was started for.
        rank: usize,
        /// The operating system's error.
        error: String,
    },
    /// A rank exited non-zero or was killed; the other ranks of this node were stopped.
    #[error(
        "rank {rank} (local rank {local_rank}) failed: {status}; stopped {stopped} other running rank(s) of this node \
         (see rank {rank}'s output above for the cause)"
    )]
    RankFailed {
        /// The global rank that failed first.
        rank: usize,
        /// Its index on this node.
        local_rank: usize,
        /// How it ended (exit code or signal).
        status: ExitStatus,
        /// How many other ranks were still running and were stopped.
        stopped: usize,
    },
    /// The command run with [`LaunchConfig::supervise`](crate::LaunchConfig::supervise)
    /// (`mpirun ...`, which starts the ranks itself) exited non-zero or was killed.
    #[error("{program} failed: {status} (see its output above for the rank and the cause)")]
    CommandFailed {
        /// The command as given.
        program: String,
        /// How it ended (exit code or signal).
        status: ExitStatus,
    },
    /// The launcher received SIGINT, SIGTERM or SIGHUP and passed it on to every rank.
    #[error("interrupted by signal {signal}; stopped every rank of this node")]
    Interrupted {
        /// The signal number.
        signal: i32,
    },
    /// Watching a rank's process failed (an operating-system error); every rank was stopped.
    #[error("cannot watch rank {rank}'s process: {error}; stopped every rank of this node")]
    Watch {
        /// The rank whose process could not be watched.
        rank: usize,
        /// The operating system's error.
        error: String,
    },
    /// Another node's launcher reported a failure in this start of an elastic job; this node's
    /// ranks were stopped (the job restarts or ends as that node's failure says).
    #[error("{cause}; stopped every rank of this node")]
    Stopped {
        /// The failure as the node that saw it published it (`node 1: rank 3 ... failed: ...`).
        cause: String,
        /// Its exit code, as [`LaunchError::exit_code`] of the node that saw it.
        code: u8,
        /// Whether a new start could mend it ([`LaunchError::is_restartable`] of the error the
        /// node saw): every node restarts, or ends, as the published failure says.
        restartable: bool,
    },
    /// Node 0's launcher stopped this start of an elastic job because a node outside it asked
    /// to join (a lost node back, `--nnodes MIN:MAX`): every node stops its ranks and the next
    /// start takes the new node in. Not a failure: it does not count against `--max-restarts`.
    #[error("{cause}; stopped every rank of this node to start again with it")]
    MembersChanged {
        /// Which nodes asked to join, as node 0's launcher published it.
        cause: String,
    },
    /// The launchers of an elastic job cannot agree on a start: fewer than the fewest nodes
    /// came, node 0's launcher (which hosts their store) is gone or did not answer in time, the
    /// job ended while this node waited to join, or another launcher runs with this node's
    /// `--node-rank` (its heartbeat moves in the running start that lists this node).
    #[error("elastic job: {0}")]
    Agent(String),
    /// The job failed again after its last allowed restart (`--max-restarts`); the first
    /// failure is the one reported (a job that fails the same way every time shows its cause,
    /// not the last restart's).
    #[error(
        "gave up after {restarts} restart(s) (--max-restarts {restarts}); the first failure: {first}{}",
        later_failures(.later)
    )]
    GaveUp {
        /// How many restarts were made.
        restarts: usize,
        /// The first failure.
        first: Box<LaunchError>,
        /// Every later failure, in order (the restarts' causes), as text.
        later: Vec<String>,
    },
    /// The system's random source could not make a job token (a token given by the user is
    /// read with the configuration: a bad one is a [`LaunchError::Config`]).
    #[error("job token: {0}")]
    Token(burn_shard_rendezvous::RendezvousError),
    /// This operating system is not supported.
    #[error("burn-shard-run runs on Linux only (it uses process groups and waitid)")]
    Unsupported,
}

impl LaunchError {
    /// The exit code `burn-shard-run` ends with: the failed rank's exit code, `128 + signal`
    /// for a rank killed by a signal or an interrupted launcher (as shells report it), 127 when
    /// the program cannot be started, 2 for a bad configuration (a bad token included), 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            LaunchError::Config(_) => 2,
            LaunchError::Spawn { .. } => 127,
            LaunchError::RankFailed { status, .. } | LaunchError::CommandFailed { status, .. } => status_code(status),
            LaunchError::Interrupted { signal } => (128 + signal).clamp(1, 255) as u8,
            LaunchError::Stopped { code, .. } => *code,
            LaunchError::GaveUp { first, .. } => first.exit_code(),
            LaunchError::Watch { .. }
            | LaunchError::MembersChanged { .. }
            | LaunchError::Agent(_)
            | LaunchError::Token(_)
            | LaunchError::Unsupported => 1,
        }
    }

    /// Whether starting the job again could help: a rank that failed or died (here or on
    /// another node), a rank whose process could not be watched, a lost node, or a node that
    /// asked to join ([`LaunchError::MembersChanged`], not counted as a restart). Not: bad
    /// options, a program that cannot start, an interrupted launcher.
    pub fn is_restartable(&self) -> bool {
        match self {
            LaunchError::RankFailed { .. }
            | LaunchError::CommandFailed { .. }
            | LaunchError::Watch { .. }
            | LaunchError::MembersChanged { .. } => true,
            LaunchError::Stopped { restartable, .. } => *restartable,
            _ => false,
        }
    }
}

fn later_failures(later: &[String]) -> String {
    match later.len() {
        0 => String::new(),
        _ => format!("; later: {}", later.join("; ")),
    }
}

fn status_code(status: &ExitStatus) -> u8 {
    #[cfg(unix)]
    if let Some(signal) = std::os::unix::process::ExitStatusExt::signal(status) {
        return (128 + signal).clamp(1, 255) as u8;
    }
    match status.code() {
        // Exit codes are 0..=255 on Unix; a failure must not map to 0.
        Some(code) if code & 0xff != 0 => (code & 0xff) as u8,
        _ => 1,
    }
}
