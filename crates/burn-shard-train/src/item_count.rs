//! How a step weighs each rank's gradient: equally (the default), or by the items each rank's
//! batches hold ([`crate::ShardedStrategy::with_item_count`]).

/// How a training step weighs the ranks' gradients, for a `TrainStep` whose output item is `T`.
///
/// Implemented by [`EqualShares`] (every rank's gradient weighs the same: `ShardedOptimizer::step`)
/// and by every `Fn(&T) -> u64` (each rank's gradient weighs its item count:
/// `ShardedOptimizer::step_with_items`). Sealed: those two are the only kinds.
pub trait ItemCount<T>: sealed::Sealed<T> + Send + Sync + 'static {
    /// The count of one micro-batch's output item, or `None` for equal weights.
    fn counter(&self) -> Option<&(dyn Fn(&T) -> u64 + Send + Sync + 'static)>;
}

/// The default: each rank's loss is a mean over as many items as every other rank's, so the
/// ranks' gradients are averaged with equal weights.
#[derive(Clone, Copy, Debug, Default)]
pub struct EqualShares;

mod sealed {
    /// Keeps [`super::ItemCount`] to the kinds this file implements.
    pub trait Sealed<T> {}

    impl<T> Sealed<T> for super::EqualShares {}

    impl<T, F: Fn(&T) -> u64> Sealed<T> for F {}
}

impl<T> ItemCount<T> for EqualShares {
    fn counter(&self) -> Option<&(dyn Fn(&T) -> u64 + Send + Sync + 'static)> {
        None
    }
}

impl<T, F: Fn(&T) -> u64 + Send + Sync + 'static> ItemCount<T> for F {
    fn counter(&self) -> Option<&(dyn Fn(&T) -> u64 + Send + Sync + 'static)> {
        Some(self)
    }
}
