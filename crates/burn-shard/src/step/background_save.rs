//! Settling a background checkpoint save ([`SaveInFlight`]) on the training thread: the
//! collectives that decide when it is complete and what its outcome is (see
//! `save_in_flight.rs`), and the public calls that wait for it.

use std::path::PathBuf;

use burn::tensor::Device;

use crate::error::ShardError;
use crate::optim::master::MasterWeightStep;
use crate::step::agreement::{after_failed_save, agree, any_rank};
use crate::step::optimizer::ShardedOptimizer;
use crate::step::save_in_flight::{SaveInFlight, lock};

impl<O: MasterWeightStep> ShardedOptimizer<O> {
    /// Waits until the checkpoint saved by
    /// [`ShardedOptimizer::save_checkpoint_async`] is complete on disk (every rank's file
    /// written, then `meta.json`, `COMPLETE` and the rename), and returns its outcome; `Ok` at
    /// once when no save is in flight. A background save that failed since the last call (seen
    /// at the start of a step) is returned here, once. A collective: every rank calls it (at
    /// the end of the run, before reading the checkpoint from another process).
    ///
    /// # Errors
    /// The failed write's error on the rank whose write failed, [`CheckpointError::PeerFailed`]
    /// (in [`ShardError::Checkpoint`]) on the others: the checkpoint's `DIR.partial` is then
    /// removed and no earlier checkpoint is touched; [`ShardError::Comm`].
    ///
    /// [`CheckpointError::PeerFailed`]: crate::checkpoint::CheckpointError::PeerFailed
    pub fn wait_for_checkpoint(&self) -> Result<(), ShardError> {
        self.settle_save(true)?;
        match lock(&self.failed_save).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The directory of the checkpoint being written in the background, if any: `None` once
    /// it has settled, complete or failed (as seen at the start of the last step, or by
    /// [`ShardedOptimizer::wait_for_checkpoint`]).
    pub fn checkpoint_in_flight(&self) -> Option<PathBuf> {
        lock(&self.in_flight).as_ref().map(|s| s.dir().to_path_buf())
    }

    /// Host bytes held by the staged file of the save in flight (0 without one).
    pub(crate) fn staged_bytes(&self) -> usize {
        lock(&self.in_flight).as_ref().map_or(0, |s| s.staged_bytes)
    }

    /// Settles the save in flight, if any: with `wait`, waits for this rank's writer; without,
    /// settles it only when every rank's writer is done (one all-reduce of a flag). Settling:
    /// the ranks agree on the writes, rank 0 completes the directory, and they agree on that;
    /// a failure removes `DIR.partial`. A collective, called by every rank at the same point.
    ///
    /// # Errors
    /// The save's outcome, as [`ShardedOptimizer::wait_for_checkpoint`] describes.
    pub(crate) fn settle_save(&self, wait: bool) -> Result<(), ShardError> {
        let Some(written) = lock(&self.in_flight).as_ref().map(SaveInFlight::written) else {
            return Ok(());
        };
        if !wait && any_rank(self.comm.as_ref(), &[!written], &Device::flex())?[0] {
            return Ok(()); // a writer still runs: settle at a later step
        }
        let Some(mut save) = lock(&self.in_flight).take() else {
            return Ok(());
        };
        let comm = self.comm.clone();
        let written = save.join();
        let commit = std::mem::replace(&mut save.commit, Box::new(|| Ok(())));
        let outcome = agree(comm.as_ref(), written, "save_checkpoint_async")
            .and_then(|()| agree(comm.as_ref(), commit(), "save_checkpoint_async"));
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
        match self.settle_save(wait) {
            Err(e @ ShardError::Comm(_)) => Err(e),
            Err(e) => {
                tracing::error!(
                    rank = self.comm.rank(),
                    "a checkpoint saved in the background failed: {e}"
                );
                lock(&self.failed_save).get_or_insert(e);
                Ok(())
            }
            Ok(()) => Ok(()),
        }
    }

    /// Starts `save` in the background: the optimizer holds it until it settles.
    pub(crate) fn put_in_flight(&self, save: SaveInFlight) {
        *lock(&self.in_flight) = Some(save);
    }
}
