//! Steps whose ranks hold unequal shares of the global batch (`step_with_items`): each rank's
//! gradient weighted by its item or token count instead of averaged with equal weights.
//!
//! `step` averages the ranks' gradients: exact when every rank's loss is the mean over an
//! equal number of items. With unequal shares (a global batch that does not divide by the
//! world size, a last partial batch, a token-mean loss over padded sequences) that mean is
//! another gradient than one device's (the class of Hugging Face transformers' 2024
//! gradient-accumulation fix, `num_items_in_batch`). Here each rank's loss is the *sum* over its
//! items (every micro-batch of the step accumulated), and the step divides the ranks' summed
//! gradients by the total count over the ranks: the reduced gradient is their mean, so it is
//! multiplied by `world_size / total`.

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;

use crate::error::ShardError;
use crate::optim::master::MasterWeightStep;
use crate::sharded_optimizer::optimizer::ShardedOptimizer;

impl<O: MasterWeightStep> ShardedOptimizer<O> {
    /// A step on the gradient of the mean loss over every item of the global batch, when the
    /// ranks hold different numbers of items. Each rank passes the gradients of the **sum** of
    /// its per-item losses (`Reduction::Sum`, or its mean times its count) over every
    /// micro-batch of this step ([`ShardedOptimizer::accumulate`] adds sums), and `items`, the
    /// number of items (samples, or tokens for a token-mean loss) those sums cover. The step
    /// adds the ranks' counts (one all-reduce of 8 bytes' limbs over every rank) and divides the
    /// ranks' summed gradients by the total: `(Σ_r ∇L_r) / Σ_r n_r`, the gradient one device
    /// gets from the mean loss over the whole batch, up to `f32` rounding. Clipping and the loss
    /// scaler see this gradient.
    ///
    /// [`ShardedOptimizer::step`] instead averages each rank's gradient with equal weight:
    /// exact only when every rank's loss is a mean over the same number of items. Every rank
    /// calls the same one of the two at each step (`step_with_items` adds a collective: a rank
    /// calling `step` meanwhile gets a collective mismatch error, on the backends that check
    /// call order, as the in-process one does).
    ///
    /// # Errors
    /// As [`ShardedOptimizer::step`]; [`ShardError::InvalidConfig`] on every rank when the
    /// ranks' counts add up to 0 (there is no mean to take); the group then stops, as after any
    /// failed step.
    pub fn step_with_items<M: Module>(
        &mut self,
        lr: impl Into<ModuleLearningRate>,
        model: M,
        grads: GradientsParams,
        items: u64,
    ) -> Result<M, ShardError> {
        self.run_step(lr.into(), model, grads, Some(items))
    }
}
