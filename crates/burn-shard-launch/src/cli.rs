//! The command line of `burn-shard-run`, in torchrun's spelling (`--nproc-per-node` and
//! `--nproc_per_node` both work).

use std::ffi::OsString;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};

use burn_shard_rendezvous::JobToken;

use crate::{DEFAULT_MASTER_PORT, LaunchConfig};

/// Starts one process per rank with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
/// MASTER_ADDR and MASTER_PORT set, prefixes their output with `[rank R]`, and stops them all
/// as soon as one fails.
#[derive(Parser, Debug)]
#[command(
    name = "burn-shard-run",
    version,
    after_help = "Examples:\n  \
        burn-shard-run --nproc-per-node 8 -- ./train --steps 1000\n  \
        # two nodes, on each (K = 0, 1):\n  \
        burn-shard-run --nnodes 2 --node-rank K --nproc-per-node 8 --master-addr 10.0.0.1 \\\n    \
        --job-token-file job.token -- ./train\n  \
        # restarted up to 3 times, on 1 or 2 nodes (the program resumes from its newest checkpoint):\n  \
        burn-shard-run --nnodes 1:2 --max-restarts 3 --node-rank K --nproc-per-node 8 --master-addr 10.0.0.1 \\\n    \
        --job-token-file job.token -- ./train --save-dir ckpt --resume auto\n  \
        # an MPI job, restarted up to 3 times:\n  \
        burn-shard-run --supervise --max-restarts 3 -- mpirun -np 4 ./train --save-dir ckpt --resume auto\n\n\
        Job token: node 0's rendezvous admits only ranks that hold the job's token. On one node, \
        burn-shard-run makes a fresh one per job. With several nodes, make one (`openssl rand -hex 32 > \
        job.token && chmod 600 job.token`), copy it to every node and pass it with --job-token-file, \
        BURN_SHARD_JOB_TOKEN_FILE or BURN_SHARD_JOB_TOKEN.\n\n\
        Exit status: 0 when every rank exits 0; else the failed rank's exit code (128+N for signal N), \
        127 when the program cannot be started, 2 for bad options."
)]
pub struct Cli {
    /// Processes (ranks) to start on this node, usually one per GPU.
    #[arg(
        long,
        alias = "nproc_per_node",
        value_name = "N",
        required_unless_present = "supervise"
    )]
    pub nproc_per_node: Option<usize>,
    /// Nodes in the job; start one burn-shard-run on each. `MIN:MAX` makes the job elastic: a
    /// start goes ahead with the nodes present after --node-wait if there are at least MIN,
    /// at a smaller world size; a node started again later is taken in at a new start (not
    /// counted against --max-restarts).
    #[arg(long, default_value = "1", value_name = "M|MIN:MAX", value_parser = node_range)]
    pub nnodes: (usize, usize),
    /// This node's index in 0..nnodes: its ranks are node_rank·N .. node_rank·N+N-1.
    #[arg(long, alias = "node_rank", default_value_t = 0, value_name = "K")]
    pub node_rank: usize,
    /// Host name or IP address of node 0, where rank 0 hosts the rendezvous; it must be
    /// reachable from every node. Default 127.0.0.1, required with --nnodes > 1.
    #[arg(long, alias = "master_addr", value_name = "ADDR")]
    pub master_addr: Option<String>,
    /// TCP port of the rendezvous on node 0, the same on every node.
    #[arg(long, alias = "master_port", default_value_t = DEFAULT_MASTER_PORT, value_name = "PORT")]
    pub master_port: u16,
    /// File holding the job token (readable by its owner only: chmod 600), the same on every
    /// node. Default: $BURN_SHARD_JOB_TOKEN, else the file named by $BURN_SHARD_JOB_TOKEN_FILE,
    /// else (one node only) a fresh random token. Required with --nnodes > 1.
    #[arg(long, value_name = "FILE")]
    pub job_token_file: Option<std::path::PathBuf>,
    /// Seconds between SIGTERM and SIGKILL when stopping the ranks after a failure.
    #[arg(long, default_value_t = 5.0, value_name = "SECONDS")]
    pub stop_grace: f64,
    /// Start every rank again, up to N times, when one fails (exits non-zero or dies of a
    /// signal; on any node). Each start gets BURN_SHARD_RESTART_COUNT; the program resumes
    /// from its newest complete checkpoint (the examples' `--resume auto`). After N restarts
    /// the job ends with the first failure.
    #[arg(long, alias = "max_restarts", default_value_t = 0, value_name = "N")]
    pub max_restarts: usize,
    /// With several nodes and restarts: seconds each start waits for missing nodes.
    #[arg(long, default_value_t = crate::DEFAULT_NODE_WAIT.as_secs_f64(), value_name = "SECONDS")]
    pub node_wait: f64,
    /// With several nodes and restarts: seconds after which a node whose launcher stopped
    /// answering is lost, and the others restart without it.
    #[arg(long, default_value_t = crate::DEFAULT_NODE_TIMEOUT.as_secs_f64(), value_name = "SECONDS")]
    pub node_timeout: f64,
    /// Run the command as it is, without rank variables, and restart it on failure: for a
    /// command that starts the ranks itself (`mpirun -np 4 ./train`).
    #[arg(long, conflicts_with_all = ["nproc_per_node"])]
    pub supervise: bool,
    /// The program to run and its arguments (after `--` when they start with `-`).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "PROGRAM [ARGS]"
    )]
    pub command: Vec<OsString>,
}

impl Cli {
    /// The launch this command line asks for.
    ///
    /// # Errors
    /// A clap error (printable as usage) naming the option: `--nnodes > 1` without
    /// `--master-addr`, a negative or non-finite `--stop-grace`, a job token that cannot be read
    /// (`--job-token-file`, `BURN_SHARD_JOB_TOKEN`, `BURN_SHARD_JOB_TOKEN_FILE`: a file readable
    /// by others, a token too short), or anything [`LaunchConfig::validate`] rejects (several
    /// nodes without a token included).
    pub fn into_config(self) -> Result<LaunchConfig, clap::Error> {
        let invalid = |msg: String| Cli::command().error(ErrorKind::InvalidValue, msg);
        let master_addr = match (self.master_addr, self.nnodes.1) {
            (Some(addr), _) => addr,
            (None, 1) => "127.0.0.1".to_string(),
            (None, n) => {
                return Err(invalid(format!(
                    "--nnodes {n} needs --master-addr: the address of node 0, reachable from every node"
                )));
            }
        };
        let seconds = |name: &str, value: f64| {
            Duration::try_from_secs_f64(value)
                .map_err(|_| invalid(format!("--{name} {value} is not a number of seconds >= 0")))
        };
        let stop_grace = seconds("stop-grace", self.stop_grace)?;
        let node_wait = seconds("node-wait", self.node_wait)?;
        let node_timeout = seconds("node-timeout", self.node_timeout)?;
        let (min_nodes, nnodes) = self.nnodes;
        let token = match &self.job_token_file {
            Some(path) => Some(JobToken::from_file(path)),
            None => JobToken::from_env().transpose(),
        }
        .transpose()
        .map_err(|e| invalid(e.to_string()))?;
        let mut command = self.command.into_iter();
        let program = command.next().unwrap_or_default();
        let config = LaunchConfig::new(program, self.nproc_per_node.unwrap_or(1))
            .with_args(command)
            .with_nodes(nnodes, self.node_rank)
            .with_min_nodes(min_nodes)
            .with_master(master_addr, self.master_port)
            .with_stop_grace(stop_grace)
            .with_max_restarts(self.max_restarts)
            .with_node_timeouts(node_wait, node_timeout);
        let config = if self.supervise { config.supervising() } else { config };
        let config = match token {
            Some(token) => config.with_token(token),
            None => config,
        };
        config.validate().map_err(|e| invalid(e.to_string()))?;
        Ok(config)
    }
}

/// `M` (every start needs M nodes) or `MIN:MAX`, as `(MIN, MAX)`.
fn node_range(s: &str) -> Result<(usize, usize), String> {
    let number = |t: &str| {
        t.trim()
            .parse::<usize>()
            .map_err(|e| format!("{t:?} is not a number of nodes: {e}"))
    };
    let (min, max) = match s.split_once(':') {
        Some((min, max)) => (number(min)?, number(max)?),
        None => (number(s)?, number(s)?),
    };
    if min == 0 || min > max {
        return Err(format!("{s}: MIN:MAX needs 1 <= MIN <= MAX"));
    }
    Ok((min, max))
}

/// Parses `burn-shard-run`'s command line (`args[0]` is the program name).
///
/// # Errors
/// A clap error for unknown or missing options (its `exit()` prints usage and exits 2, or the
/// help text and exits 0 for `--help`), or as [`Cli::into_config`].
pub fn parse_args<I, T>(args: I) -> Result<LaunchConfig, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    Cli::try_parse_from(args)?.into_config()
}
