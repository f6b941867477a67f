//! [`Attempts`]: the starts of one job and the failures that led to restarts, as the
//! single-node restart loop (`restart.rs`) and the nodes' agreement (`agent.rs`) both count
//! them.

use crate::{LaunchConfig, LaunchError, LaunchOutcome, MAX_RESTARTS, OutputMode, RESTART_COUNT, signals};

/// The starts of one job so far: the failures that led to restarts.
pub(crate) struct Attempts<'a> {
    config: &'a LaunchConfig,
    /// The failures this launcher saw end a start, in order.
    failures: Vec<LaunchError>,
    /// Starts this launcher saw stopped because a node asked to join (not failures).
    member_changes: Vec<String>,
    /// The number of the next start: 0 for the first, then one more per restart or change of
    /// members (the job's count: a launcher that joined late takes it from node 0).
    round: usize,
    /// The job's restarts so far, counted against `max_restarts` (changes of members are not).
    restarts: usize,
    /// Termination signals counted before the job began: one that arrives at any point
    /// (between two starts too) ends the job instead of a restart.
    pub(crate) signals_before: usize,
}

impl<'a> Attempts<'a> {
    pub(crate) fn new(config: &'a LaunchConfig) -> Self {
        Self {
            config,
            failures: Vec::new(),
            member_changes: Vec::new(),
            round: 0,
            restarts: 0,
            signals_before: signals::count(),
        }
    }

    /// The number of this start: 0 for the first, then one more per restart or change of
    /// members.
    pub(crate) fn count(&self) -> usize {
        self.round
    }

    /// The job's restarts so far (what node 0's launcher publishes with each start's members).
    pub(crate) fn restarts(&self) -> usize {
        self.restarts
    }

    /// Counts this launcher's next start as the job's start `round` (it joined late, or comes
    /// back after a start went on without it).
    pub(crate) fn join_at(&mut self, round: usize) {
        self.round = round;
    }

    /// Takes the job's restart count from node 0's launcher, so that every node gives up at
    /// the same start, also one that joined late.
    pub(crate) fn agree(&mut self, restarts: usize) {
        self.restarts = restarts;
    }

    /// The termination signal received since the job began, as the error that ends it.
    pub(crate) fn interrupted(&self) -> Option<LaunchError> {
        signals::received_since(self.signals_before).map(|signal| LaunchError::Interrupted { signal })
    }

    /// The variables every rank of this start gets on top of its rank variables: the job's
    /// restarts so far (as torchrun's `TORCHELASTIC_RESTART_COUNT`, changes of members are not
    /// restarts) and `--max-restarts`.
    pub(crate) fn env(&self) -> [(&'static str, String); 2] {
        [
            (RESTART_COUNT, self.restarts.to_string()),
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
                outcome.member_changes = std::mem::take(&mut self.member_changes);
                Ok(Some(outcome))
            }
            Err(LaunchError::MembersChanged { cause }) => {
                if self.config.output == OutputMode::Prefix {
                    eprintln!("burn-shard-run: start {} after: {cause}", self.round + 1);
                }
                self.member_changes.push(cause);
                self.round += 1;
                Ok(None)
            }
            Err(error) if error.is_restartable() && self.restarts < self.config.max_restarts => {
                if self.config.output == OutputMode::Prefix {
                    eprintln!(
                        "burn-shard-run: restart {} of {} after: {error}",
                        self.restarts + 1,
                        self.config.max_restarts
                    );
                }
                self.failures.push(error);
                self.restarts += 1;
                self.round += 1;
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

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;
    use std::process::ExitStatus;

    use super::*;

    fn failed(code: i32) -> LaunchError {
        LaunchError::CommandFailed {
            program: "train".into(),
            status: ExitStatus::from_raw(code << 8),
        }
    }

    /// Restarts are counted from the first start: `max_restarts` failures restart, the next
    /// one gives up naming the first failure and the later ones; a finished start reports the
    /// restarts' causes; a launcher that joined at start `k` counts from there.
    #[test]
    fn restarts_are_counted_and_the_first_failure_is_kept() {
        let config = LaunchConfig::new("train", 1)
            .with_max_restarts(2)
            .with_output(OutputMode::Capture);
        let mut attempts = Attempts::new(&config);
        assert_eq!(attempts.count(), 0);
        assert!(attempts.settle(Err(failed(3))).unwrap().is_none());
        assert_eq!(attempts.count(), 1);
        assert_eq!(attempts.env()[0], (RESTART_COUNT, "1".to_string()));
        assert!(attempts.settle(Err(failed(4))).unwrap().is_none());
        match attempts.settle(Err(failed(5))) {
            Err(LaunchError::GaveUp { restarts, first, later }) => {
                assert_eq!(restarts, 2);
                assert_eq!(first.to_string(), failed(3).to_string());
                assert_eq!(later, [failed(4).to_string(), failed(5).to_string()]);
            }
            other => panic!("expected GaveUp, got {other:?}"),
        }
        let mut attempts = Attempts::new(&config);
        assert!(attempts.settle(Err(failed(3))).unwrap().is_none());
        let outcome = LaunchOutcome {
            ranks: Vec::new(),
            output: Vec::new(),
            world_size: 1,
            restarts: Vec::new(),
            member_changes: Vec::new(),
        };
        let done = attempts.settle(Ok(outcome)).unwrap().expect("finished");
        assert_eq!(done.restarts, [failed(3).to_string()]);
        // A node asking to join starts the job again without using up a restart.
        let mut attempts = Attempts::new(&config);
        for _ in 0..3 {
            let changed = LaunchError::MembersChanged {
                cause: "node 1 asked to join".into(),
            };
            assert!(attempts.settle(Err(changed)).unwrap().is_none());
        }
        assert!(attempts.settle(Err(failed(3))).unwrap().is_none());
        assert!(attempts.settle(Err(failed(4))).unwrap().is_none());
        assert_eq!(attempts.count(), 5);
        assert!(matches!(
            attempts.settle(Err(failed(5))),
            Err(LaunchError::GaveUp { restarts: 2, .. })
        ));
        let mut late = Attempts::new(&config);
        late.join_at(2);
        late.agree(2);
        assert_eq!(late.count(), 2, "joined at start 2");
        assert!(
            matches!(late.settle(Err(failed(6))), Err(LaunchError::CommandFailed { .. })),
            "no restart left, nothing restarted here"
        );
    }
}
