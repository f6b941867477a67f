//! Running one closure per rank on threads, with failures reported per rank.

use std::any::Any;
use std::thread;

use crate::{InProcessComm, InProcessGroup};

/// A rank whose closure panicked.
#[derive(Debug, Clone, thiserror::Error)]
#[error("rank {rank} panicked: {message}")]
pub struct RankFailure {
    /// The rank.
    pub rank: usize,
    /// The panic payload, when it was a string.
    pub message: String,
}

/// Runs `f(comm)` on `world_size` threads, one per rank of a fresh [`InProcessGroup`] built by
/// `group`, and returns the results in rank order.
///
/// A panic on one rank drops its communicator, so the other ranks' collectives fail with
/// [`CommError`](crate::CommError) instead of hanging; the first panic is returned as [`RankFailure`].
pub fn run_ranks<T, F>(group: InProcessGroup, f: F) -> Result<Vec<T>, RankFailure>
where
    T: Send,
    F: Fn(InProcessComm) -> T + Sync,
{
    let comms = group.into_comms();
    thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let f = &f;
                let rank = crate::Collective::rank(&comm);
                let handle = thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || f(comm))
                    .expect("spawning a rank thread");
                (rank, handle)
            })
            .collect();
        let mut results = Vec::with_capacity(handles.len());
        let mut failure = None;
        for (rank, handle) in handles {
            match handle.join() {
                Ok(v) => results.push(v),
                Err(payload) => {
                    failure.get_or_insert(RankFailure {
                        rank,
                        message: panic_message(payload.as_ref()),
                    });
                }
            }
        }
        match failure {
            Some(f) => Err(f),
            None => Ok(results),
        }
    })
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}
