//! A checkpoint save whose files are being written in the background
//! (`ShardedOptimizer::save_checkpoint_async`): the staged rank file's writer thread, and the
//! commit that completes the directory once every rank has written.
//!
//! The writer threads run no collective. Every decision that needs the ranks to agree (whether
//! every writer is done, whether every write succeeded, whether rank 0 completed the directory)
//! is taken on the training thread, at a point where every rank is anyway: the start of each
//! `step` (without waiting: one all-reduce of one flag, and the save settles once every writer
//! is done), the next save or load, and [`ShardedOptimizer::wait_for_checkpoint`] (waiting).
//! The checkpoint layer builds what the writer and the commit do; this file only runs them, so
//! the step needs nothing from that layer.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::thread::JoinHandle;

use burn::tensor::Device;

use crate::error::ShardError;
use crate::optim::master::MasterWeightStep;
use crate::step::agreement::{agree, any_rank};
use crate::step::optimizer::ShardedOptimizer;

/// Completes the checkpoint directory on rank 0 once every rank has written (reads the rank
/// files' digests, writes `meta.json` and `COMPLETE`, renames `DIR.partial` to `DIR`); does
/// nothing on the other ranks.
pub(crate) type Commit = Box<dyn FnOnce() -> Result<(), ShardError> + Send>;

/// A save in flight on this rank.
pub(crate) struct SaveInFlight {
    /// The checkpoint directory being written.
    dir: PathBuf,
    /// Writes this rank's staged file into `DIR.partial` (rank 0 also the scheduler's); `None`
    /// once joined.
    writer: Option<JoinHandle<Result<(), ShardError>>>,
    commit: Commit,
    /// Removes `DIR.partial` (rank 0) after a failure.
    discard: Box<dyn FnOnce() + Send>,
    /// Host bytes the staged file holds until it is written.
    pub(crate) staged_bytes: usize,
}

impl SaveInFlight {
    /// A save of `dir` whose writer is running, `staged_bytes` of host memory held until it
    /// ends.
    pub(crate) fn new(
        dir: PathBuf,
        writer: JoinHandle<Result<(), ShardError>>,
        commit: Commit,
        discard: Box<dyn FnOnce() + Send>,
        staged_bytes: usize,
    ) -> Self {
        Self {
            dir,
            writer: Some(writer),
            commit,
            discard,
            staged_bytes,
        }
    }

    /// Whether this rank's writer is done (never blocks).
    fn written(&self) -> bool {
        self.writer.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// This rank's write outcome, waiting for the writer.
    fn join(&mut self) -> Result<(), ShardError> {
        match self.writer.take().map(JoinHandle::join) {
            None | Some(Ok(Ok(()))) => Ok(()),
            Some(Ok(Err(e))) => Err(e),
            Some(Err(_)) => Err(ShardError::InvalidConfig(format!(
                "the background writer of checkpoint {} panicked",
                self.dir.display()
            ))),
        }
    }
}

impl Drop for SaveInFlight {
    /// A save dropped unsettled (the optimizer dropped, or the process ending without
    /// `wait_for_checkpoint`): its file is still written, but no rank completes the directory,
    /// which stays `DIR.partial` (the next save there removes it).
    fn drop(&mut self) {
        if self.writer.is_some() {
            let _ = self.join();
            tracing::warn!(
                dir = %self.dir.display(),
                "a checkpoint saved with save_checkpoint_async was not completed: call wait_for_checkpoint() \
                 before the end of the run; its DIR.partial is removed by the next save there"
            );
        }
    }
}

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
    /// it is complete (as seen at the start of the last step, or by
    /// [`ShardedOptimizer::wait_for_checkpoint`]).
    pub fn checkpoint_in_flight(&self) -> Option<PathBuf> {
        lock(&self.in_flight).as_ref().map(|s| s.dir.clone())
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
            if comm.rank() == 0 {
                (std::mem::replace(&mut save.discard, Box::new(|| ())))();
            }
            // Every rank reached the failure through `agree`: none returns before the removal.
            if !matches!(e, ShardError::Comm(_)) {
                let _ = comm.barrier();
            }
        }
        outcome
    }

    /// At the start of a step: settles a save whose writers are all done; a failed one is
    /// reported (`tracing::error!` on every rank) and kept for the next
    /// [`ShardedOptimizer::wait_for_checkpoint`] or save, so training goes on.
    ///
    /// # Errors
    /// [`ShardError::Comm`] when the group failed.
    pub(crate) fn settle_save_in_step(&self) -> Result<(), ShardError> {
        match self.settle_save(false) {
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

/// The mutex's value; a panic while it was held leaves a value that is still consistent (each
/// holder only takes or puts a whole value).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}
