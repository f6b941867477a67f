//! `ReadAhead`: reads of stored shards started before their use, so that the disk works while
//! the compute thread does (the gather schedule reads the unit after the next, the step the
//! bucket after the current).

use std::collections::HashMap;
use std::sync::Arc;

use crate::fsdp::shard::Shard;
use crate::swap::shard_store::{ShardRead, StoredShard};

/// Reads started ahead, by shard (the address of its handle: the handle kept beside the read
/// keeps the shard alive, so no other shard takes that address while the entry exists). A read
/// that is never taken is dropped with its entry (the I/O thread finishes it unseen).
#[derive(Default)]
pub(crate) struct ReadAhead {
    reads: HashMap<usize, (Arc<StoredShard>, ShardRead)>,
}

impl ReadAhead {
    /// Starts reading each stored shard of `shards` not started yet (shards in memory need no
    /// read); `ahead` when that is ahead of their use, unset for reads about to be waited for
    /// (started here so that they queue before those of what comes next).
    pub(crate) fn start<'a>(&mut self, shards: impl IntoIterator<Item = &'a Shard>, ahead: bool) {
        for shard in shards {
            if let Shard::Stored(stored) = shard {
                self.reads
                    .entry(key(stored))
                    .or_insert_with(|| (stored.clone(), stored.start_read(ahead)));
            }
        }
    }

    /// The read of `shard`: the one started ahead, or one started now.
    pub(crate) fn take(&mut self, shard: &Shard) -> ShardRead {
        match shard {
            Shard::Stored(stored) => match self.reads.remove(&key(stored)) {
                Some((_, read)) => read,
                None => stored.start_read(false),
            },
            Shard::Held(_) => shard.start_read(),
        }
    }

    /// Drops the reads not taken.
    pub(crate) fn clear(&mut self) {
        self.reads.clear();
    }
}

fn key(stored: &Arc<StoredShard>) -> usize {
    Arc::as_ptr(stored) as usize
}
