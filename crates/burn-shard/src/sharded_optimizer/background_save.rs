//! Settling a background checkpoint save ([`SaveInFlight`]) on the training thread: the
//! collectives that decide when it is complete and what its outcome is (see
//! `save_in_flight.rs`), and the public calls that wait for it.

use crate::error::ShardError;
use crate::optim::master::MasterWeightStep;
use crate::sharded_optimizer::optimizer::ShardedOptimizer;
use crate::sharded_optimizer::save_in_flight::{SaveInFlight, lock};
use crate::step::agreement::{after_failed_save, agree, any_rank, flag_device};

impl<O: MasterWeightStep> ShardedOptimizer<O> {
    /// Waits until every checkpoint saved in the background by [`ShardedOptimizer::save_checkpoint`] is
    /// complete on disk (every rank's file written, then `meta.json`, `COMPLETE` and the
    /// rename), oldest first, and returns their outcome; `Ok` at once when no save is in
    /// flight. A background save that failed since the last call (seen at the start of a step)
    /// is returned here, once. A collective: every rank calls it (at the end of the run, before
    /// reading the checkpoint from another process). With hybrid sharding only shard group 0
    /// saves, so only its ranks wait and see a failure; the other groups' ranks return `Ok` at
    /// once (their next save learns of a failure of group 0's: see `save_checkpoint`).
    ///
    /// # Errors
    /// The first failure: the failed write's error on the rank whose write failed,
    /// [`CheckpointError::PeerFailed`] (in [`ShardError::Checkpoint`]) on the others; the
    /// checkpoint's `DIR.partial` is then removed and no earlier checkpoint is touched (the
    /// other saves in flight still settle); [`ShardError::Comm`].
    ///
    /// [`CheckpointError::PeerFailed`]: crate::checkpoint::CheckpointError::PeerFailed
    pub fn wait_for_checkpoint(&self) -> Result<(), ShardError> {
        self.settle_save_keeping_failure(true)?;
        self.report_kept_failure()
    }

    /// Host bytes held by the staged files of the saves in flight (0 without one).
    pub(crate) fn staged_bytes(&self) -> usize {
        lock(&self.saves.in_flight).iter().map(|s| s.staged_bytes).sum()
    }

    /// Before a background save: settles the oldest saves in flight (waiting for them) until
    /// fewer than `saves_in_flight` are, then returns the first failure seen since the last
    /// report. A collective.
    ///
    /// # Errors
    /// As [`ShardedOptimizer::wait_for_checkpoint`].
    pub(crate) fn make_room_for_save(&self) -> Result<(), ShardError> {
        while lock(&self.saves.in_flight).len() >= self.saves.limit {
            if let Err(e) = self.settle_oldest() {
                self.keep_failure(e)?;
            }
        }
        self.report_kept_failure()
    }

    /// Settles the saves in flight, oldest first: with `wait`, each after waiting for this
    /// rank's writer; without, each only once every rank's writer is done (one all-reduce of a
    /// flag per save), stopping at the first still being written. Settling: the ranks agree on
    /// the writes, rank 0 completes the directory, and they agree on that; a failure removes
    /// `DIR.partial`. A collective, called by every rank at the same point (every rank holds
    /// the same saves).
    ///
    /// # Errors
    /// A save's outcome, as [`ShardedOptimizer::wait_for_checkpoint`] describes; the saves
    /// after it stay in flight.
    fn settle_save(&self, wait: bool) -> Result<(), ShardError> {
        loop {
            let Some(written) = lock(&self.saves.in_flight).front().map(SaveInFlight::written) else {
                return Ok(());
            };
            if !wait && any_rank(self.comm.as_ref(), &[!written], &flag_device(self.comm.as_ref()))?[0] {
                return Ok(()); // a writer still runs: settle at a later step
            }
            self.settle_oldest()?;
        }
    }

    /// Settles the oldest save in flight, waiting for this rank's writer.
    fn settle_oldest(&self) -> Result<(), ShardError> {
        let Some(mut save) = lock(&self.saves.in_flight).pop_front() else {
            return Ok(());
        };
        let comm = self.comm.clone();
        let written = save.join();
        let commit = std::mem::replace(&mut save.commit, Box::new(|| Ok(())));
        let outcome = agree(comm.as_ref(), written, "save_checkpoint (background)")
            .and_then(|()| agree(comm.as_ref(), commit(), "save_checkpoint (background)"));
        if let Err(e) = &outcome {
            after_failed_save(comm.as_ref(), e, std::mem::replace(&mut save.discard, Box::new(|| ())));
        }
        outcome
    }

    /// At the start of a step (`wait` false) and before a load (`wait` true): settles the save
    /// in flight as [`ShardedOptimizer::settle_save`] does; a failed one is reported
    /// (`tracing::error!` on every rank) and kept for the next
    /// [`ShardedOptimizer::wait_for_checkpoint`] or save, so training (or the load) goes on.
    ///
    /// # Errors
    /// [`ShardError::Comm`] when the group failed.
    pub(crate) fn settle_save_keeping_failure(&self, wait: bool) -> Result<(), ShardError> {
        // A failed save settles (and leaves the queue); the ones after it settle in turn.
        while let Err(e) = self.settle_save(wait) {
            self.keep_failure(e)?;
        }
        Ok(())
    }

    /// The first background save failure kept since the last report, returned once.
    fn report_kept_failure(&self) -> Result<(), ShardError> {
        match lock(&self.saves.failed).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Logs a background save's failure on this rank and keeps the first for the next report;
    /// a failed group is returned instead (nothing more can settle).
    fn keep_failure(&self, e: ShardError) -> Result<(), ShardError> {
        if let ShardError::Comm(_) = e {
            return Err(e);
        }
        tracing::error!(
            rank = self.world().rank(),
            "a checkpoint saved in the background failed: {e}"
        );
        lock(&self.saves.failed).get_or_insert(e);
        Ok(())
    }

    /// Starts `save` in the background: the optimizer holds it until it settles.
    pub(crate) fn put_in_flight(&self, save: SaveInFlight) {
        lock(&self.saves.in_flight).push_back(save);
    }

    /// Allows `saves` background saves in flight at once (at least 1).
    pub(crate) fn with_saves_in_flight(mut self, saves: usize) -> Self {
        self.saves.limit = saves.max(1);
        self
    }
}
