//! `f32` master weights for buckets of `bf16`/`f16` parameters.
//!
//! Mixed-precision training (Micikevicius et al., "Mixed Precision Training", 2018) keeps an
//! `f32` copy of the weights for the optimizer: an update smaller than half a `bf16` ulp of the
//! weight would round away in `bf16`, while it accumulates in `f32`. ZeRO partitions that copy
//! with the optimizer state (Rajbhandari et al., 2020, §3: `K = 12` bytes per parameter for
//! mixed-precision Adam: master, momentum, variance).

use burn::optim::{AdaGrad, Adam, AdamState, AdamW, Adan, LearningRate, Lion, Optimizer, RmsProp, Sgd};
use burn::tensor::{DType, Tensor};
use burn_shard_kernels::FusedAdam;

/// Whether parameters of `dtype` are trained through an `f32` master copy (`bf16`, `f16`);
/// `f32` and `f64` parameters are stepped directly.
pub(crate) fn needs_master(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// How an optimizer steps the `f32` master weights of `bf16`/`f16` parameters: what the sharded
/// step needs of an optimizer beyond Burn's [`Optimizer`].
///
/// The provided method steps the master with [`Optimizer::step`] and rounds the result to the
/// parameter's dtype (two passes). [`FusedAdam`] overrides it with its one-pass kernel (CPU and
/// CubeCL) that updates the master and writes the rounded parameter together. Burn's built
/// element-wise optimizers and [`ElementWise`](crate::ElementWise) use the provided method.
pub trait MasterWeightStep: Optimizer {
    /// One step on this rank's `f32` `master` (`[len]`) from `grad` (`[len]`, the parameters'
    /// dtype); returns `(master, param, state)` with `param` the new master rounded to
    /// `param`'s dtype (`bf16` or `f16`).
    fn step_with_master(
        &self,
        lr: LearningRate,
        master: Tensor<1>,
        param: Tensor<1>,
        grad: Tensor<1>,
        state: Option<Self::State<1>>,
    ) -> (Tensor<1>, Tensor<1>, Option<Self::State<1>>) {
        let dtype = param.dtype();
        drop(param);
        let (master, state) = self.step(lr, master, grad.cast(DType::F32), state);
        let param = master.clone().cast(dtype);
        (master, param, state)
    }
}

impl MasterWeightStep for FusedAdam {
    fn step_with_master(
        &self,
        lr: LearningRate,
        master: Tensor<1>,
        param: Tensor<1>,
        grad: Tensor<1>,
        state: Option<AdamState<1>>,
    ) -> (Tensor<1>, Tensor<1>, Option<AdamState<1>>) {
        FusedAdam::step_with_master(self, lr, master, param, grad, state)
    }
}

macro_rules! provided {
    ($($t:ty),*) => {$(impl MasterWeightStep for $t {})*};
}

provided!(Adam, AdamW, Sgd, AdaGrad, RmsProp, Adan, Lion);
