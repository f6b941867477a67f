//! ZeRO-Offload (Ren et al., 2021, "ZeRO-Offload: Democratizing Billion-Scale Model
//! Training"): the optimizer state, the `f32` master weights and the update of this rank's
//! shard live in host memory and run on the fused CPU Adam; the accelerator keeps only the
//! parameters and the gradients.
//!
//! The wrapper is type-level: [`Offload`] around Burn's `AdamWConfig` / `AdamConfig` (or a
//! [`FusedAdamConfig`](burn_shard_kernels::FusedAdamConfig) / [`FusedAdam`]) gives an
//! [`Offloaded`] optimizer, and the sharded step, checkpoints and
//! [`MemoryReport`](crate::MemoryReport) need nothing else:
//!
//! ```ignore
//! let (model, mut optim) = ShardConfig::new(Stage::Two).init(model, Offload(AdamWConfig::new()), comm)?;
//! ```
//!
//! Per step and per parameter piece of this rank's shard (ZeRO-Offload's §4.1 data flow, one
//! piece at a time): the reduced gradient piece goes device → host (its dtype: 2 bytes per
//! element for `bf16`/`f16`, 4 for `f32`); the fused CPU Adam updates the moments (and the
//! `f32` master) in host memory; the new parameter piece, in the parameters' dtype, goes host →
//! device. An `f32` parameter has no master: its piece also goes device → host to be updated.
//! With [`ShardConfig::with_offload_params`](crate::ShardConfig::with_offload_params) at stage
//! 3 the shard itself lives on the host: only the gradient piece crosses, device → host.

use burn::optim::grad_clipping::GradientClipping;
use burn::optim::{LearningRate, Optimizer};
use burn::tensor::{Device, Tensor};
use burn_shard_kernels::FusedAdam;

use crate::error::ShardError;
use crate::optim::into_optimizer::IntoOptimizer;
use crate::optim::master::MasterWeightStep;

/// Offloads the optimizer of a sharded model to host memory (ZeRO-Offload): wrap the optimizer
/// config given to [`ShardConfig::init`](crate::ShardConfig::init) in it.
///
/// `C` is Burn's `AdamWConfig` or `AdamConfig`, a
/// [`FusedAdamConfig`](burn_shard_kernels::FusedAdamConfig) or a built [`FusedAdam`]: anything
/// [`IntoOptimizer`] turns into the fused Adam, whose CPU path is the point of offloading. The
/// optimizer is then [`Offloaded<FusedAdam>`](Offloaded). Gradient clipping configured in `C`
/// is applied as without `Offload`.
///
/// What moves: this rank's Adam moments (8 bytes per element it steps, 12 with AMSGrad) and,
/// for `bf16`/`f16` parameters, its `f32` master weights (4 bytes per element) leave the
/// device for host memory; [`MemoryReport::host_bytes`](crate::MemoryReport::host_bytes)
/// counts them and `optimizer_state_bytes` drops to 0. Gradients and the collectives stay on
/// the device, and so do the parameters unless
/// [`ShardConfig::with_offload_params`](crate::ShardConfig::with_offload_params) moves stage
/// 3's shards to the host too (which needs `Offload`: the update runs where the shards are).
///
/// # Errors (at `init`)
/// [`ShardError::InvalidConfig`] when the model's parameters already live in host memory
/// (Burn's `Flex` CPU device): offloading would move nothing, so it is refused rather than
/// ignored; pass `C` without `Offload` there.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Offload<C>(pub C);

impl<C: IntoOptimizer<Optimizer = FusedAdam>> IntoOptimizer for Offload<C> {
    type Optimizer = Offloaded<FusedAdam>;

    fn into_optimizer(self) -> Result<Offloaded<FusedAdam>, ShardError> {
        self.0.into_optimizer().map(Offloaded::new)
    }

    fn grad_clipping(&self) -> Result<Option<GradientClipping>, ShardError> {
        self.0.grad_clipping()
    }
}

/// An optimizer whose state, `f32` master weights and update live in host memory (Burn's
/// `Flex` CPU device, see [`Offloaded::host_device`]), for parameters on an accelerator
/// (CUDA, wgpu, any CubeCL device). Built by [`Offload`] around the fused Adam.
///
/// [`Optimizer::step`] copies the parameter piece and its gradient to the host, steps them
/// there with the inner optimizer (for [`FusedAdam`]: the fused multi-threaded CPU loop) and
/// returns the updated piece on the parameter's device. The state it returns is on the host;
/// a state given on another device (a record of a run without offload) is moved to the host
/// first. [`MasterWeightStep::step_with_master`] does the same with the `f32` master, which
/// stays on the host: only the gradient (parameters' dtype) goes to the host and the rounded
/// parameter comes back, as in ZeRO-Offload.
///
/// [`Optimizer::to_device`] ignores the device asked for and moves the state to the host, so
/// Burn code that places states next to their parameters (`ModuleOptimizer::load_record`)
/// keeps them offloaded; checkpoints loaded by
/// [`ShardedOptimizer::load_checkpoint`](crate::ShardedOptimizer::load_checkpoint) land on the
/// host too ([`MasterWeightStep::state_device`]). The state type is the inner optimizer's
/// (Burn's `AdamState` for `FusedAdam`), so checkpoints move between offloaded and
/// device-resident runs.
#[derive(Clone)]
pub struct Offloaded<O> {
    inner: O,
}

impl<O> Offloaded<O> {
    /// Wraps `inner`, which will step on the host.
    pub fn new(inner: O) -> Self {
        Self { inner }
    }

    /// The optimizer that steps on the host (e.g. to ask a [`FusedAdam`] which path it takes
    /// for a host tensor).
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The host device the state, the masters and the update live on: Burn's `Flex` CPU
    /// device (`Device::flex()`).
    pub fn host_device() -> Device {
        Device::flex()
    }
}

/// `t` on the host device (unchanged when it is there already).
fn to_host<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    let host = Offloaded::<()>::host_device();
    if t.device() == host { t } else { t.to_device(&host) }
}

impl<O: Optimizer> Optimizer for Offloaded<O> {
    type State<const D: usize> = O::State<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let device = tensor.device();
        let host = Self::host_device();
        let state = state.map(|s| O::to_device(s, &host));
        let (tensor, state) = self.inner.step(lr, to_host(tensor), to_host(grad), state);
        (tensor.to_device(&device), state)
    }

    /// Moves `state` to the host, whatever `device` is (see [`Offloaded`]).
    fn to_device<const D: usize>(state: Self::State<D>, _device: &Device) -> Self::State<D> {
        O::to_device(state, &Self::host_device())
    }
}

impl<O: MasterWeightStep> MasterWeightStep for Offloaded<O> {
    /// `master` is moved to the host when it is not there (its first step, when the sharded
    /// step initialises it from the parameter, or after loading it elsewhere) and stays there;
    /// `param`'s values are not read (only its dtype and shape: the inner step gets an
    /// uninitialised host buffer of that dtype to write the rounded parameter into), so only
    /// `grad` crosses to the host.
    fn step_with_master(
        &self,
        lr: LearningRate,
        master: Tensor<1>,
        param: Tensor<1>,
        grad: Tensor<1>,
        state: Option<Self::State<1>>,
    ) -> (Tensor<1>, Tensor<1>, Option<Self::State<1>>) {
        let host = Self::host_device();
        let (device, dtype, shape) = (param.device(), param.dtype(), param.shape());
        drop(param);
        let param = Tensor::<1>::empty(shape, (&host, dtype));
        let state = state.map(|s| O::to_device(s, &host));
        let (master, param, state) = self
            .inner
            .step_with_master(lr, to_host(master), param, to_host(grad), state);
        (master, param.to_device(&device), state)
    }

    /// Refuses parameters that already live on the host device: nothing would move.
    fn check_device(&self, device: &Device) -> Result<(), ShardError> {
        if device.clone().without_autodiff() == Self::host_device() {
            return Err(ShardError::InvalidConfig(
                "Offload moves the optimizer state and master weights to host memory (Burn's Flex CPU device), \
                 but the model's parameters already live there, so nothing would be offloaded; pass the optimizer \
                 config without Offload (e.g. AdamWConfig::new() instead of Offload(AdamWConfig::new())), or build \
                 the model on an accelerator device (CUDA, wgpu) to offload its optimizer"
                    .into(),
            ));
        }
        self.inner.check_device(device)
    }

    /// The host device, whatever the parameters' device.
    fn state_device(_param_device: &Device) -> Device {
        Self::host_device()
    }

    fn state_bytes(state: &Self::State<1>, device: &Device) -> (usize, usize) {
        O::state_bytes(state, device)
    }
}
