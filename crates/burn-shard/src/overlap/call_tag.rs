//! [`CallTag`]: how every collective call burn-shard makes is named. The collectives compare a
//! call's tag across ranks, so ranks that issue different calls of equal length fail with an
//! error instead of mixing their buffers. One place decides every tag, so no two kinds of call
//! that can be in flight together share a value; 0 means "untagged" and is never produced.

use std::hash::{DefaultHasher, Hash, Hasher};

/// A collective call, named for the collectives' cross-rank check.
pub(crate) enum CallTag<'a> {
    /// Stages 0-2: the reduction of bucket `index` (odd values).
    BucketReduction(usize),
    /// Stages 1-2: the all-gather of bucket `index`'s updated shards (even values, so never a
    /// bucket reduction's, which can be in flight at the same time).
    BucketPublish(usize),
    /// Stage 3: one parameter's collectives, by its module path (the same on every rank).
    Param(&'a str),
    /// Stage 3: a grouped collective, by its members' [`CallTag::Param`] values in order.
    Group(&'a [u64]),
    /// Stage 3: the step's exchange of a parameter stepped whole with its owner, by its module
    /// path (`crate::step::whole_owner`).
    WholeExchange(&'a str),
}

impl CallTag<'_> {
    /// The tag's value, never 0.
    pub(crate) fn value(&self) -> u64 {
        match self {
            CallTag::BucketReduction(index) => (*index as u64) << 1 | 1,
            CallTag::BucketPublish(index) => (*index as u64 + 1) << 1,
            CallTag::Param(path) => hashed(path),
            CallTag::Group(tags) => hashed(tags),
            CallTag::WholeExchange(path) => hashed(&("whole", path)),
        }
    }
}

/// A hash, odd so never 0 (stage 3 has no bucket calls to tell it from).
fn hashed<T: Hash + ?Sized>(value: &T) -> u64 {
    let mut h = DefaultHasher::new();
    value.hash(&mut h);
    h.finish() | 1
}
