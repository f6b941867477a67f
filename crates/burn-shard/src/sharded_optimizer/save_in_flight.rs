//! A checkpoint save whose files are being written in the background
//! (`ShardedOptimizer::save_checkpoint` with `SaveOptions::in_background`): the staged rank file's writer thread, and the
//! commit that completes the directory once every rank has written.
//!
//! The writer threads run no collective. Every decision that needs the ranks to agree (whether
//! every writer is done, whether every write succeeded, whether rank 0 completed the directory)
//! is taken on the training thread, at a point where every rank is anyway: the start of each
//! `step` (without waiting: one all-reduce of one flag, and the save settles once every writer
//! is done), the next save or load, and [`ShardedOptimizer::wait_for_checkpoint`](crate::ShardedOptimizer::wait_for_checkpoint) (waiting).
//! The checkpoint layer builds what the writer and the commit do; this file holds them and
//! `background_save.rs` settles them, so the step needs nothing from that layer.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::error::ShardError;

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
    pub(crate) commit: Commit,
    /// Removes `DIR.partial` (rank 0) after a failure.
    pub(crate) discard: Box<dyn FnOnce() + Send>,
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

    /// The checkpoint directory being written.
    pub(crate) fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// Whether this rank's writer is done (never blocks).
    pub(crate) fn written(&self) -> bool {
        self.writer.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// This rank's write outcome, waiting for the writer.
    pub(crate) fn join(&mut self) -> Result<(), ShardError> {
        match self.writer.take().map(JoinHandle::join) {
            None | Some(Ok(Ok(()))) => Ok(()),
            Some(Ok(Err(e))) => Err(e),
            Some(Err(_)) => Err(crate::error::CheckpointError::Io {
                path: self.dir.clone(),
                message: "the background writer of this checkpoint panicked".into(),
            }
            .into()),
        }
    }
}

impl Drop for SaveInFlight {
    /// A save dropped unsettled (the optimizer dropped, or the process ending without
    /// `wait_for_checkpoint`): its file is still written, but no rank completes the directory,
    /// which stays `DIR.partial` (the next save there removes it). Completing it here would
    /// need the ranks to agree, a collective that a rank dropping its optimizer while the
    /// others still train (an error returned early) would pair with a step's collective; so
    /// the loss is said on standard error, on every rank, whether or not a `tracing`
    /// subscriber is installed ([`unsettled_save_message`]).
    fn drop(&mut self) {
        if self.writer.is_some() {
            let written = self.join();
            let message = unsettled_save_message(&self.dir, written.err());
            eprintln!("burn-shard: {message}");
            tracing::error!(dir = %self.dir.display(), "{message}");
        }
    }
}

/// What a rank says when a background save of `dir` is dropped before it settled: that the
/// checkpoint is lost, why, and the call that keeps it. `write_error` is this rank's write
/// failure, if any.
fn unsettled_save_message(dir: &std::path::Path, write_error: Option<ShardError>) -> String {
    let written = match write_error {
        None => "this rank's file was written".to_string(),
        Some(e) => format!("this rank's write failed: {e}"),
    };
    format!(
        "the checkpoint {} saved in the background is LOST: the optimizer was dropped before the save \
         completed ({written}; no rank completes the directory, which stays {}.partial and is removed by the next \
         save there); call optimizer.wait_for_checkpoint()? on every rank before the end of the run",
        dir.display(),
        dir.display()
    )
}

/// The mutex's value; a panic while it was held leaves a value that is still consistent (each
/// holder only takes or puts a whole value).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// The checkpoints being written in the background (`save_checkpoint` with [`SaveOptions::in_background`](crate::checkpoint::SaveOptions::in_background)), and the failure
/// of one that a step saw.
pub(crate) struct SaveQueue {
    /// Oldest first, each until every rank has written and rank 0 completed it.
    pub(crate) in_flight: Mutex<VecDeque<SaveInFlight>>,
    /// How many may be in flight at once (`ShardConfig::with_saves_in_flight`).
    pub(crate) limit: usize,
    /// A background save that failed, seen at the start of a step: returned by the next
    /// `wait_for_checkpoint` or save.
    pub(crate) failed: Mutex<Option<ShardError>>,
}

impl SaveQueue {
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            in_flight: Mutex::new(VecDeque::new()),
            limit,
            failed: Mutex::new(None),
        }
    }

    /// The directories of the saves in flight, oldest first.
    pub(crate) fn dirs(&self) -> Vec<PathBuf> {
        lock(&self.in_flight).iter().map(|s| s.dir().to_path_buf()).collect()
    }
}
