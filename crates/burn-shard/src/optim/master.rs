//! `f32` master weights for buckets of `bf16`/`f16` parameters.
//!
//! Mixed-precision training (Micikevicius et al., "Mixed Precision Training", 2018) keeps an
//! `f32` copy of the weights for the optimizer: an update smaller than half a `bf16` ulp of the
//! weight would round away in `bf16`, while it accumulates in `f32`. ZeRO partitions that copy
//! with the optimizer state (Rajbhandari et al., 2020, §3: `K = 12` bytes per parameter for
//! mixed-precision Adam: master, momentum, variance).

use burn::optim::{
    AdaGrad, Adam, AdamState, AdamW, AdamWState, Adan, AdaptiveMomentumState, LearningRate, Lion, Optimizer,
    RecordState, RmsProp, Sgd, StateSink,
};
use burn::tensor::{DType, Device, Tensor};
use burn_shard_kernels::FusedAdam;

use crate::model::flat::tensor_bytes;

/// Whether parameters of `dtype` are trained through an `f32` master copy (`bf16`, `f16`);
/// `f32` and `f64` parameters are stepped directly.
pub(crate) fn needs_master(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// `t` in `f32` when it is `bf16`/`f16` (the master dtype), as it is otherwise: where a
/// half-precision gradient is summed or divided without rounding at every operation.
pub(crate) fn widen_half(t: Tensor<1>) -> Tensor<1> {
    match needs_master(t.dtype()) {
        true => t.cast(DType::F32),
        false => t,
    }
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
    ///
    /// Only `param`'s dtype, shape and device may be used, never its values: the new values
    /// come from the master alone, and with the state in host memory
    /// (`with_optimizer_state_on(Home::Host)`) `param` is an uninitialised host buffer of that
    /// dtype and shape, so that only the gradient crosses to the host.
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

    /// Bytes of `state`'s tensors as `(on device, elsewhere)`, `device` being the parameters'
    /// device: what [`MemoryReport`](crate::MemoryReport) counts as device-resident optimizer
    /// state and as host bytes.
    ///
    /// The provided method reads the sizes through Burn's `RecordState` (a copy of the state),
    /// which does not say where a tensor lives, and counts everything on `device` (the sharded
    /// step asks with the device the state lives on); the Adam family (Burn's `Adam`, `AdamW`,
    /// [`FusedAdam`]) looks at each moment tensor's device.
    fn state_bytes(state: &Self::State<1>, device: &Device) -> (usize, usize) {
        let _ = device;
        let mut sink = StateSink::default();
        state.state_flatten("", &mut sink);
        let bytes = sink
            .tensors
            .iter()
            .map(|(_, d)| d.num_elements() * d.dtype().size())
            .sum();
        (bytes, 0)
    }
}

/// Bytes of Adam's moments as `(on device, elsewhere)`.
pub(crate) fn momentum_bytes(momentum: &AdaptiveMomentumState<1>, device: &Device) -> (usize, usize) {
    let moments = [
        Some(&momentum.moment_1),
        Some(&momentum.moment_2),
        momentum.max_moment_2.as_ref(),
    ];
    moments
        .into_iter()
        .flatten()
        .fold((0, 0), |(on, off), t| match t.device() == *device {
            true => (on + tensor_bytes(t), off),
            false => (on, off + tensor_bytes(t)),
        })
}

impl MasterWeightStep for Adam {
    fn state_bytes(state: &AdamState<1>, device: &Device) -> (usize, usize) {
        momentum_bytes(&state.momentum, device)
    }
}

impl MasterWeightStep for AdamW {
    fn state_bytes(state: &AdamWState<1>, device: &Device) -> (usize, usize) {
        momentum_bytes(&state.momentum, device)
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

    fn state_bytes(state: &AdamState<1>, device: &Device) -> (usize, usize) {
        momentum_bytes(&state.momentum, device)
    }
}

macro_rules! provided {
    ($($t:ty),*) => {$(impl MasterWeightStep for $t {})*};
}

provided!(Sgd, AdaGrad, RmsProp, Adan, Lion);

/// `master` (`f32`, `[n]`) with each element whose parameter (`param`, `bf16`/`f16`, `[n]`) no
/// longer equals the master rounded to the parameter's dtype replaced by the parameter's value:
/// an edit made since the last step is taken, while unedited elements keep their sub-ulp
/// progress. On `master`'s device (the host when the state lives there).
pub(crate) fn follow_edits(master: Tensor<1>, param: &Tensor<1>) -> Tensor<1> {
    let param = param.clone().to_device(&master.device());
    let edited = master.clone().cast(param.dtype()).not_equal(param.clone());
    master.mask_where(edited, param.cast(DType::F32))
}
