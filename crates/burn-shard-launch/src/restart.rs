//! [`run`]: a job started again after a failure, up to `max_restarts` times (torchrun's
//! `--max-restarts`). One node (or [`LaunchConfig::supervise`]) restarts here; several nodes
//! agree on each start through [`agent`](crate::agent).

use crate::launch::launch_with;
use crate::{LaunchConfig, LaunchError, LaunchOutcome, MAX_RESTARTS, OutputMode, RESTART_COUNT, agent, signals};

/// Runs the job as [`launch`](crate::launch) does, and when it fails in a way a new start
/// could mend (a rank exits non-zero or dies of a signal, here or on another node; a node is
/// lost), stops what is left and starts every rank again, up to `config.max_restarts` times.
///
/// Each start's ranks get [`RESTART_COUNT`] (0, 1, ...) and [`MAX_RESTARTS`]; the program is
/// expected to resume from its newest complete checkpoint (the examples' `--resume auto`,
/// `burn_shard::checkpoint::newest`). With several nodes and restarts, or `min_nodes <
/// nnodes`, the launchers of all nodes agree on every start through a store that node 0's
/// launcher hosts at [`LaunchConfig::agent_port`] (see [`LaunchConfig::is_elastic`]); a node
/// whose launcher stops answering for [`LaunchConfig::node_timeout`] is lost, and the next
/// start goes ahead without it once [`LaunchConfig::node_wait`] has passed, at the smaller
/// world size, if at least `min_nodes` nodes are left.
///
/// Each restart's cause is logged on stderr (with [`OutputMode::Prefix`]) and returned in
/// [`LaunchOutcome::restarts`].
///
/// # Errors
/// As [`launch`](crate::launch) when nothing is restarted (`max_restarts` 0, or a failure no
/// restart mends: bad options, a program that cannot start, an interrupted launcher);
/// [`LaunchError::GaveUp`] with the *first* failure (and its exit code) when the job failed
/// again after its last restart; [`LaunchError::Stopped`] on a node stopped because another
/// node failed in a way no restart mends; [`LaunchError::Agent`] when the nodes cannot agree
/// on a start (too few nodes, node 0's launcher gone, this node too late).
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

/// The starts of one job so far: the failures that led to restarts.
pub(crate) struct Attempts<'a> {
    config: &'a LaunchConfig,
    failures: Vec<LaunchError>,
    /// Starts made before this launcher joined (a node that joined an elastic job late).
    skipped: usize,
    /// Termination signals counted before the job began: one that arrives at any point
    /// (between two starts too) ends the job instead of a restart.
    pub(crate) signals_before: usize,
}

impl<'a> Attempts<'a> {
    pub(crate) fn new(config: &'a LaunchConfig) -> Self {
        Self {
            config,
            failures: Vec::new(),
            skipped: 0,
            signals_before: signals::count(),
        }
    }

    /// The number of this start: 0 for the first, then one more per restart.
    pub(crate) fn count(&self) -> usize {
        self.skipped + self.failures.len()
    }

    /// Counts this launcher's first start as the job's start `round` (it joined late).
    pub(crate) fn join_at(&mut self, round: usize) {
        self.skipped = round.saturating_sub(self.failures.len());
    }

    /// The termination signal received since the job began, as the error that ends it.
    pub(crate) fn interrupted(&self) -> Option<LaunchError> {
        signals::received_since(self.signals_before).map(|signal| LaunchError::Interrupted { signal })
    }

    /// The variables every rank of this start gets on top of its rank variables.
    pub(crate) fn env(&self) -> [(&'static str, String); 2] {
        [
            (RESTART_COUNT, self.count().to_string()),
            (MAX_RESTARTS, self.config.max_restarts.to_string()),
        ]
    }

    /// Takes one start's result: `Ok(Some(outcome))` when the job finished (with the restarts'
    /// causes), `Ok(None)` when it should start again (the cause is logged), or the error that
    /// ends the job.
    pub(crate) fn settle(
        &mut self,
        result: Result<LaunchOutcome, LaunchError>,
    ) -> Result<Option<LaunchOutcome>, LaunchError> {
        // A signal during the stop of a failed start, or since: no new start.
        let result = match (result, self.interrupted()) {
            (Err(e), Some(signal)) if e.is_restartable() => Err(signal),
            (result, _) => result,
        };
        match result {
            Ok(mut outcome) => {
                outcome.restarts = self.failures.iter().map(ToString::to_string).collect();
                Ok(Some(outcome))
            }
            Err(error) if error.is_restartable() && self.count() < self.config.max_restarts => {
                if self.config.output == OutputMode::Prefix {
                    eprintln!(
                        "burn-shard-run: restart {} of {} after: {error}",
                        self.count() + 1,
                        self.config.max_restarts
                    );
                }
                self.failures.push(error);
                Ok(None)
            }
            Err(error) => Err(self.give_up(error)),
        }
    }

    /// The error that ends the job: `last` itself when nothing was restarted or when `last`
    /// is not a failure a restart mends (an interrupt), else [`LaunchError::GaveUp`] with the
    /// first failure.
    fn give_up(&mut self, last: LaunchError) -> LaunchError {
        if self.failures.is_empty() || !last.is_restartable() {
            return last;
        }
        let mut failures = std::mem::take(&mut self.failures).into_iter();
        let first = failures.next().expect("checked: not empty");
        let later = failures.map(|e| e.to_string()).chain([last.to_string()]).collect();
        LaunchError::GaveUp {
            restarts: self.config.max_restarts,
            first: Box::new(first),
            later,
        }
    }
}
