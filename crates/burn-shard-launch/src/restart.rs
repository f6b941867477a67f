//! [`run`]: a job started again after a failure, up to `max_restarts` times (torchrun's
//! `--max-restarts`). One node (or [`LaunchConfig::supervise`]) restarts here; several nodes
//! agree on each start through [`agent`](crate::agent).

use crate::attempts::Attempts;
use crate::launch::launch_with;
use crate::{LaunchConfig, LaunchError, LaunchOutcome, agent};

/// Runs the job as [`launch`](crate::launch) does, and when it fails in a way a new start
/// could mend (a rank exits non-zero or dies of a signal, here or on another node; a node is
/// lost), stops what is left and starts every rank again, up to `config.max_restarts` times.
///
/// Each start's ranks get [`RESTART_COUNT`](crate::RESTART_COUNT) (0, 1, ...) and
/// [`MAX_RESTARTS`](crate::MAX_RESTARTS); the program is
/// expected to resume from its newest complete checkpoint (the examples' `--resume auto`,
/// `burn_shard::checkpoint::newest`). With several nodes and restarts, or `min_nodes <
/// nnodes`, the launchers of all nodes agree on every start through a store that node 0's
/// launcher hosts at [`LaunchConfig::agent_port`] (see [`LaunchConfig::is_elastic`]); a node
/// whose launcher stops answering for [`LaunchConfig::node_timeout`] is lost, and the next
/// start goes ahead without it once [`LaunchConfig::node_wait`] has passed, at the smaller
/// world size, if at least `min_nodes` nodes are left. A node whose launcher starts while a
/// start runs without it is taken in at a new start, which node 0's launcher begins at once
/// (a change of members: [`LaunchOutcome::member_changes`], not counted as a restart).
///
/// Each restart's cause is logged on stderr (with [`OutputMode::Prefix`](crate::OutputMode::Prefix)) and returned in
/// [`LaunchOutcome::restarts`].
///
/// # Errors
/// As [`launch`](crate::launch) when nothing is restarted (`max_restarts` 0, or a failure no
/// restart mends: bad options, a program that cannot start, an interrupted launcher);
/// [`LaunchError::GaveUp`] with the *first* failure (and its exit code) when the job failed
/// again after its last restart; [`LaunchError::Stopped`] on a node stopped because another
/// node failed in a way no restart mends; [`LaunchError::Agent`] when the nodes cannot agree
/// on a start (too few nodes, node 0's launcher gone, the job ended while this node waited, a
/// second launcher with this node's `--node-rank` seen beating in the running start).
pub fn run(config: &LaunchConfig) -> Result<LaunchOutcome, LaunchError> {
    config.validate()?;
    if config.is_elastic() {
        return agent::run_elastic(config);
    }
    let mut attempts = Attempts::new(config);
    loop {
        let env = attempts.env();
        let result = launch_with(config, &env, &mut || None, attempts.signals_before);
        if let Some(outcome) = attempts.settle(result)? {
            return Ok(outcome);
        }
    }
}
