//! [`StateHome`]: where this rank's optimizer state, `f32` masters and update live, a run-time
//! choice made by [`ShardConfig::with_optimizer_state_on`](crate::ShardConfig::with_optimizer_state_on).
//!
//! With the parameters (the default), or in host memory: ZeRO-Offload (Ren et al., 2021,
//! "ZeRO-Offload: Democratizing Billion-Scale Model Training", §4.1 data flow), also what
//! NVMe offload of the state steps in (DeepSpeed's `offload_optimizer: {device: nvme}` runs its
//! CPU Adam there too). Per step and per parameter piece of this rank's shard, in host memory:
//! the reduced gradient piece goes device → host (its dtype: 2 bytes per element for
//! `bf16`/`f16`, 4 for `f32`); the optimizer (for the fused Adam: its multi-threaded CPU loop;
//! any other: Burn's own step on the `Flex` device) updates the moments and the `f32` master
//! there; the new parameter piece, in the parameters' dtype, goes host → device. An `f32`
//! parameter has no master: its piece also goes device → host to be updated. With stage-3
//! parameter offload the shard itself lives on the host: only the gradient piece crosses.

use burn::optim::LearningRate;
use burn::tensor::{DType, Device, Tensor};

use crate::optim::master::MasterWeightStep;

/// Where the optimizer state of a run lives and where its update runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) enum StateHome {
    /// On the parameters' device (their shard's device at stage 3).
    #[default]
    WithParams,
    /// In host memory (Burn's `Flex` CPU device), whatever the parameters' device.
    Host,
}

impl StateHome {
    /// The host device: Burn's `Flex` CPU device.
    pub(crate) fn host_device() -> Device {
        Device::flex()
    }

    /// The device the state and masters of parameters on `param_device` live on; where a
    /// checkpoint load places them.
    pub(crate) fn device(self, param_device: &Device) -> Device {
        match self {
            Self::WithParams => param_device.clone(),
            Self::Host => Self::host_device(),
        }
    }

    /// One step of `optim` on `param` (`[len]`) with `grad` (`[len]`) where the state lives;
    /// the new piece comes back on `param`'s device, the state stays home (a state given
    /// elsewhere, from a record of another run, is moved home first).
    ///
    /// With `shape`, `param` is a whole parameter of that shape, stepped with it
    /// ([`MasterWeightStep::step_whole`]); without, a flat piece.
    pub(crate) fn step<O: MasterWeightStep>(
        self,
        optim: &O,
        lr: LearningRate,
        shape: Option<&[usize]>,
        param: Tensor<1>,
        grad: Tensor<1>,
        state: Option<O::State<1>>,
    ) -> (Tensor<1>, Option<O::State<1>>) {
        let step = |param, grad, state| match shape {
            Some(shape) => optim.step_whole(lr, shape, param, grad, state),
            None => optim.step(lr, param, grad, state),
        };
        match self {
            Self::WithParams => step(param, grad, state),
            Self::Host => {
                let (device, host) = (param.device(), Self::host_device());
                let state = state.map(|s| O::to_device(s, &host));
                let (param, state) = step(to(param, &host), to(grad, &host), state);
                (param.to_device(&device), state)
            }
        }
    }

    /// [`MasterWeightStep::step_with_master`] where the state lives. On the host the master is
    /// moved there when it is not (its first step, or after a load elsewhere) and stays; the
    /// parameter's values are not read (the step writes the rounded master into a host buffer
    /// of its dtype and shape), so only the gradient crosses to the host.
    ///
    /// With `shape`, the master is a whole parameter's, stepped with that shape
    /// ([`MasterWeightStep::step_whole`] on the `f32` master, then rounded).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn step_with_master<O: MasterWeightStep>(
        self,
        optim: &O,
        lr: LearningRate,
        shape: Option<&[usize]>,
        master: Tensor<1>,
        param: Tensor<1>,
        grad: Tensor<1>,
        state: Option<O::State<1>>,
    ) -> (Tensor<1>, Tensor<1>, Option<O::State<1>>) {
        let step = |master, param: Tensor<1>, grad: Tensor<1>, state| match shape {
            Some(shape) => {
                let dtype = param.dtype();
                drop(param);
                let (master, state) = optim.step_whole(lr, shape, master, grad.cast(DType::F32), state);
                let param = master.clone().cast(dtype);
                (master, param, state)
            }
            None => optim.step_with_master(lr, master, param, grad, state),
        };
        match self {
            Self::WithParams => step(master, param, grad, state),
            Self::Host => {
                let host = Self::host_device();
                let (device, dtype, shape) = (param.device(), param.dtype(), param.shape());
                drop(param);
                let param = Tensor::<1>::empty(shape, (&host, dtype));
                let state = state.map(|s| O::to_device(s, &host));
                let (master, param, state) = step(to(master, &host), param, to(grad, &host), state);
                (master, param.to_device(&device), state)
            }
        }
    }
}

/// `t` on `device` (unchanged when it is there already).
fn to(t: Tensor<1>, device: &Device) -> Tensor<1> {
    if t.device() == *device { t } else { t.to_device(device) }
}
