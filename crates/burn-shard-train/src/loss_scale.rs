//! [`scale_loss`]: `f16` loss scaling inside burn-train's `TrainStep`, which runs `backward` in
//! model code where the sharded optimizer is out of reach.

use std::cell::RefCell;

use burn::tensor::Tensor;
use burn_shard::LossScaling;

thread_local! {
    /// The loss scaling of the rank whose training step runs on this thread, while it runs.
    static SCALING: RefCell<Option<LossScaling>> = const { RefCell::new(None) };
}

/// `loss` multiplied by the loss scale of the rank this `TrainStep` runs for, when
/// [`ShardedStrategy`](crate::ShardedStrategy) runs it with a `LossScaler`
/// (`ShardConfig::with_loss_scaler`): call `backward` on this in `TrainStep::step`, and report
/// the unscaled loss to the metrics. The product is in `f32` (an `f16` loss times `2^16` would
/// overflow). Elsewhere (burn-train's own strategies, inference, no scaler) it returns `loss`.
///
/// ```ignore
/// impl TrainStep for Classifier {
///     fn step(&self, batch: Batch) -> TrainOutput<ClassificationOutput> {
///         let item = self.classify(batch);
///         TrainOutput::new(self, burn_shard_train::scale_loss(item.loss.clone()).backward(), item)
///     }
/// }
/// ```
///
/// With a scaler other than `LossScaler::fixed(1.0)` configured, a step whose `TrainStep` did
/// not call this fails with `ShardError::LossNotScaled` on every rank, instead of dividing
/// unscaled gradients by the scale.
pub fn scale_loss<const D: usize>(loss: Tensor<D>) -> Tensor<D> {
    SCALING.with(|scaling| match &*scaling.borrow() {
        Some(scaling) => scaling.scale_loss(loss),
        None => loss,
    })
}

/// Runs `step` (one `TrainStep::step`) with `scaling` serving [`scale_loss`] on this thread.
pub(crate) fn with_scaling<R>(scaling: LossScaling, step: impl FnOnce() -> R) -> R {
    /// Clears the thread's scaling when the step ends, also by a panic.
    struct Active;
    impl Drop for Active {
        fn drop(&mut self) {
            SCALING.with(|s| s.borrow_mut().take());
        }
    }
    SCALING.with(|s| *s.borrow_mut() = Some(scaling));
    let _active = Active;
    step()
}
