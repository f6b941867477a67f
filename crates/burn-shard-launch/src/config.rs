//! [`LaunchConfig`]: what to start, how many times, and where each process sits in the job.

use std::ffi::OsString;
use std::time::Duration;

use burn_shard_rendezvous::{
    JOB_TOKEN, JOB_TOKEN_FILE, JobToken, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
};

use crate::LaunchError;

/// Default port of the rendezvous on node 0 (torchrun's default too).
pub const DEFAULT_MASTER_PORT: u16 = 29500;
/// Default time between SIGTERM and SIGKILL when stopping ranks (5 s).
pub const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(5);
/// Default time a round of an elastic job waits for missing nodes before it starts without
/// them (30 s).
pub const DEFAULT_NODE_WAIT: Duration = Duration::from_secs(30);
/// Default time after which a node whose launcher stopped answering counts as lost (15 s).
pub const DEFAULT_NODE_TIMEOUT: Duration = Duration::from_secs(15);
/// The variable that tells each rank how many times the job was restarted after a failure
/// before this start (0 the first time; torchrun's `TORCHELASTIC_RESTART_COUNT`). A start that
/// takes in a node that asked to join is not a restart: it keeps the count.
pub const RESTART_COUNT: &str = "BURN_SHARD_RESTART_COUNT";
/// The variable that tells each rank the job's `--max-restarts`.
pub const MAX_RESTARTS: &str = "BURN_SHARD_MAX_RESTARTS";

/// Where the ranks' output goes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OutputMode {
    /// Each line is written to this process's stdout (or stderr, for the rank's stderr) as it
    /// arrives, prefixed with `[rank R] `.
    #[default]
    Prefix,
    /// Lines are kept and returned in [`LaunchOutcome::output`](crate::LaunchOutcome::output)
    /// (for tests and tools); nothing is printed.
    Capture,
}

/// One node's share of a job: `nproc_per_node` copies of `program args...`, global ranks
/// `node_rank·nproc_per_node .. (node_rank+1)·nproc_per_node`, world size
/// `nnodes·nproc_per_node`.
///
/// Each process gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and
/// `MASTER_PORT` (the names `torchrun` uses) and `BURN_SHARD_JOB_TOKEN` on top of this
/// process's environment, which is otherwise passed unchanged (`CUDA_VISIBLE_DEVICES`
/// included; `BURN_SHARD_JOB_TOKEN_FILE` removed, the token taking its place). Stdin is closed.
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchConfig {
    /// The program (a path, or a name looked up on `PATH`).
    pub program: OsString,
    /// Its arguments, identical for every rank.
    pub args: Vec<OsString>,
    /// Processes on this node, usually one per GPU (at least 1).
    pub nproc_per_node: usize,
    /// Nodes in the job, each running its own launcher (at least 1; default 1).
    pub nnodes: usize,
    /// This node's index in `0..nnodes` (default 0).
    pub node_rank: usize,
    /// Host name or IP address of node 0, where rank 0 hosts the rendezvous (default `127.0.0.1`).
    pub master_addr: String,
    /// TCP port of the rendezvous (default [`DEFAULT_MASTER_PORT`]).
    pub master_port: u16,
    /// Where the ranks' output goes (default [`OutputMode::Prefix`]).
    pub output: OutputMode,
    /// When stopping ranks, how long to wait after SIGTERM before SIGKILL (default
    /// [`DEFAULT_STOP_GRACE`]).
    pub stop_grace: Duration,
    /// The job's secret, which the rendezvous store asks every rank to prove (default `None`:
    /// [`launch`](crate::launch) makes a fresh random one for a single node). Required with
    /// `nnodes > 1`, the same on every node: node 0's store admits only ranks that hold it.
    pub token: Option<JobToken>,
    /// How many times [`run`](crate::run) starts the job's ranks again after a failure
    /// (default 0: fail-fast, as [`launch`](crate::launch)).
    pub max_restarts: usize,
    /// The fewest nodes a round of an elastic job may start with (default `nnodes`: every
    /// node). With `min_nodes < nnodes`, [`run`](crate::run) starts without the nodes missing
    /// after [`LaunchConfig::node_wait`], at a smaller world size.
    pub min_nodes: usize,
    /// How long a round of a multi-node job with restarts waits for missing nodes (default
    /// [`DEFAULT_NODE_WAIT`]).
    pub node_wait: Duration,
    /// How long a node's launcher may stay silent before the others count it lost and restart
    /// without it (default [`DEFAULT_NODE_TIMEOUT`]).
    pub node_timeout: Duration,
    /// Start `program` once per attempt as it is, without rank variables (`nproc_per_node`
    /// is 1): for a command that starts the ranks itself, such as `mpirun -np 4 ./train`
    /// (default `false`). Only the restarts apply.
    pub supervise: bool,
}

impl LaunchConfig {
    /// `nproc_per_node` copies of `program` on one node, with the defaults above.
    pub fn new(program: impl Into<OsString>, nproc_per_node: usize) -> Self {
        Self {
            program: program.into(),
            args: Vec::new(),
            nproc_per_node,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
            output: OutputMode::default(),
            stop_grace: DEFAULT_STOP_GRACE,
            token: None,
            max_restarts: 0,
            min_nodes: 1,
            node_wait: DEFAULT_NODE_WAIT,
            node_timeout: DEFAULT_NODE_TIMEOUT,
            supervise: false,
        }
    }

    /// Restarts the job up to `max_restarts` times after a failure ([`run`](crate::run)).
    pub fn with_max_restarts(mut self, max_restarts: usize) -> Self {
        self.max_restarts = max_restarts;
        self
    }

    /// Lets a round of the job start with as few as `min_nodes` of its `nnodes` nodes.
    pub fn with_min_nodes(mut self, min_nodes: usize) -> Self {
        self.min_nodes = min_nodes;
        self
    }

    /// Sets how long a round waits for missing nodes, and after how long a silent node is lost.
    pub fn with_node_timeouts(mut self, wait: Duration, timeout: Duration) -> Self {
        self.node_wait = wait;
        self.node_timeout = timeout;
        self
    }

    /// Starts `program` as it is, once per attempt, without rank variables (for `mpirun`).
    pub fn supervising(mut self) -> Self {
        self.supervise = true;
        self.nproc_per_node = 1;
        self
    }

    /// Whether the nodes of this job agree on each start through the launchers' own store on
    /// node 0 ([`LaunchConfig::agent_port`]): several nodes, and restarts or a minimum below
    /// `nnodes`.
    pub fn is_elastic(&self) -> bool {
        self.nnodes > 1 && (self.max_restarts > 0 || self.min_nodes < self.nnodes)
    }

    /// The TCP port of the launchers' store on node 0 in an elastic job: `master_port + 1`
    /// (the ranks' own rendezvous keeps `master_port`).
    pub fn agent_port(&self) -> u16 {
        self.master_port.saturating_add(1)
    }

    /// Sets the program's arguments.
    pub fn with_args<A: Into<OsString>>(mut self, args: impl IntoIterator<Item = A>) -> Self {
        self.args = args.into_iter().map(Into::into).collect();
        self
    }

    /// Sets the number of nodes and this node's index (and the fewest nodes to `nnodes`).
    pub fn with_nodes(mut self, nnodes: usize, node_rank: usize) -> Self {
        self.nnodes = nnodes;
        self.min_nodes = nnodes;
        self.node_rank = node_rank;
        self
    }

    /// Sets where rank 0 hosts the rendezvous.
    pub fn with_master(mut self, addr: impl Into<String>, port: u16) -> Self {
        self.master_addr = addr.into();
        self.master_port = port;
        self
    }

    /// Sets where the ranks' output goes.
    pub fn with_output(mut self, output: OutputMode) -> Self {
        self.output = output;
        self
    }

    /// Sets the time between SIGTERM and SIGKILL when stopping ranks.
    pub fn with_stop_grace(mut self, grace: Duration) -> Self {
        self.stop_grace = grace;
        self
    }

    /// Sets the job token (the same on every node of the job).
    pub fn with_token(mut self, token: JobToken) -> Self {
        self.token = Some(token);
        self
    }

    /// Ranks in the job over all nodes: `nnodes·nproc_per_node`.
    pub fn world_size(&self) -> usize {
        self.nnodes.saturating_mul(self.nproc_per_node)
    }

    /// The global rank of this node's `local_rank`.
    pub fn rank(&self, local_rank: usize) -> usize {
        self.node_rank * self.nproc_per_node + local_rank
    }

    /// Checks that the configuration describes a job.
    ///
    /// # Errors
    /// [`LaunchError::Config`] naming the field: zero processes or nodes, `node_rank >= nnodes`,
    /// an empty program or `master_addr`, port 0, a world size that overflows, or several nodes
    /// without a token (the message says how to make one and pass it to every node).
    pub fn validate(&self) -> Result<(), LaunchError> {
        let fail = |msg: String| Err(LaunchError::Config(msg));
        if self.program.is_empty() {
            return fail("no program to run: pass it after the options, e.g. `-- python train.py`".into());
        }
        if self.nproc_per_node == 0 {
            return fail("nproc_per_node is 0; start at least one process per node".into());
        }
        if self.nnodes == 0 {
            return fail("nnodes is 0; a job has at least one node".into());
        }
        if self.node_rank >= self.nnodes {
            return fail(format!(
                "node_rank {} is out of range for nnodes {} (valid: 0..{})",
                self.node_rank, self.nnodes, self.nnodes
            ));
        }
        if self.nnodes.checked_mul(self.nproc_per_node).is_none() {
            return fail("nnodes × nproc_per_node overflows".into());
        }
        if self.master_addr.trim().is_empty() {
            return fail("master_addr is empty; give node 0's host name or IP address".into());
        }
        if self.master_port == 0 {
            return fail("master_port is 0; give a fixed TCP port (the same on every node)".into());
        }
        if self.min_nodes == 0 || self.min_nodes > self.nnodes {
            return fail(format!(
                "the fewest nodes ({}) must be in 1..={} (nnodes): pass --nnodes MIN:MAX with MIN <= MAX",
                self.min_nodes, self.nnodes
            ));
        }
        if self.is_elastic() && self.master_port == u16::MAX {
            return fail(format!(
                "master_port {} leaves no port for the launchers' store (master_port + 1); choose a lower one",
                self.master_port
            ));
        }
        if self.is_elastic() && self.node_timeout <= self.stop_grace + crate::launch::DRAIN_TIMEOUT {
            return fail(format!(
                "node_timeout {:?} must exceed stop_grace {:?} + {:?}: a node that stops its failed ranks sends no \
                 heartbeat meanwhile, and would be taken for lost; raise --node-timeout or lower --stop-grace",
                self.node_timeout,
                self.stop_grace,
                crate::launch::DRAIN_TIMEOUT
            ));
        }
        if self.supervise && (self.nnodes > 1 || self.nproc_per_node != 1) {
            return fail(
                "--supervise starts one command that starts the ranks itself (mpirun): it takes no --nnodes \
                 and no --nproc-per-node"
                    .into(),
            );
        }
        if self.nnodes > 1 && self.token.is_none() {
            return fail(format!(
                "nnodes is {} but no job token was given: node 0's rendezvous admits only ranks that hold the \
                 job's token, so every node needs the same one. Make one per job (`openssl rand -hex 32 > job.token \
                 && chmod 600 job.token`), copy it to every node, and on each set {JOB_TOKEN_FILE}=job.token (or \
                 pass --job-token-file job.token, or set {JOB_TOKEN}=<its text>)",
                self.nnodes
            ));
        }
        Ok(())
    }

    /// The variables set for `local_rank`'s process, but for the token: [`launch`](crate::launch)
    /// adds `BURN_SHARD_JOB_TOKEN` (this configuration's token, or one it makes) and removes
    /// `BURN_SHARD_JOB_TOKEN_FILE`.
    /// With [`LaunchConfig::supervise`], none: the command sets its ranks' own.
    pub fn rank_env(&self, local_rank: usize) -> Vec<(&'static str, String)> {
        if self.supervise {
            return Vec::new();
        }
        vec![
            (RANK, self.rank(local_rank).to_string()),
            (WORLD_SIZE, self.world_size().to_string()),
            (LOCAL_RANK, local_rank.to_string()),
            (LOCAL_WORLD_SIZE, self.nproc_per_node.to_string()),
            (MASTER_ADDR, self.master_addr.clone()),
            (MASTER_PORT, self.master_port.to_string()),
        ]
    }
}
