//! [`StepOptions`]: what `ShardConfig` asks of the step beyond the stage, handed to
//! `ShardedOptimizer::new` by `init`.

use std::hash::{DefaultHasher, Hash, Hasher};

use burn::optim::grad_clipping::GradientClipping;
use burn::tensor::Device;

use crate::optim::loss_scale::LossScaler;
use crate::optim::state_home::StateHome;
use crate::swap::swapper::Swapper;

/// What `ShardConfig` asks of the step beyond the stage (global-norm clipping, loss scaling,
/// NVMe offload), and where the parameters live.
pub(crate) struct StepOptions {
    /// Clip the global norm of the averaged, unscaled gradient to this (PyTorch's
    /// `clip_grad_norm_`); `None`: no global clipping.
    pub(crate) max_grad_norm: Option<f32>,
    /// Dynamic or static loss scaling (f16 training); `None`: the loss is not scaled.
    pub(crate) loss_scaler: Option<LossScaler>,
    /// The base group's per-parameter clipping (from the optimizer's Burn config).
    pub(crate) clipping: Option<GradientClipping>,
    /// The parameters' plain device.
    pub(crate) device: Device,
    /// Where the optimizer state lives and the update runs.
    pub(crate) state_home: StateHome,
    /// NVMe offload: the swap file the optimizer state lives in between steps (the step then
    /// ends with one more all-reduce, of the ranks whose swap failed).
    pub(crate) swap: Option<Swapper>,
    /// NVMe parameter offload (stage 3): the step starts and ends with one more all-reduce
    /// each, of the ranks whose shard file failed.
    pub(crate) stores_shards: bool,
}

impl StepOptions {
    /// A hash of what changes the step's collectives and decisions, equal on ranks configured
    /// alike.
    pub(crate) fn fingerprint(&self) -> u64 {
        let mut h = DefaultHasher::new();
        self.max_grad_norm.map(f32::to_bits).hash(&mut h);
        self.loss_scaler.as_ref().map(LossScaler::fingerprint).hash(&mut h);
        crate::optim::groups::clipping_key(self.clipping.as_ref()).hash(&mut h);
        self.state_home.hash(&mut h);
        self.swap.is_some().hash(&mut h);
        self.stores_shards.hash(&mut h);
        h.finish()
    }
}
