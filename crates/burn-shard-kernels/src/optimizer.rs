//! [`FusedAdam`]'s steps: Burn's `Optimizer` trait and the mixed-precision step, dispatched by
//! [`StepPath`] to the fused paths (`flex.rs`, `cube.rs`) or to Burn's own Adam.

use burn::optim::{Adam, AdamState, AdamWState, LearningRate, Optimizer};
use burn::tensor::{DType, Device, Tensor};

use crate::fused_adam::{Fallback, FusedAdam};
use crate::path::{StepPath, conform_state, same_layout, state_fits};

impl FusedAdam {
    /// One mixed-precision step: updates the `f32` master copy `master` (shape `S`) and the state
    /// from `grad` (shape `S`, `f32`, `bf16` or `f16`), and returns `(master, param, state)` where
    /// `param` (shape `S`, the dtype of the `param` given: `bf16`, `f16` or `f32`) is the new
    /// master rounded to that dtype. `param`'s values are not read; its buffer is reused when
    /// this step holds the only reference.
    ///
    /// On `Flex` tensors this is one fused pass ([`crate::cpu::adam_step_master`]), on the CubeCL
    /// backend one kernel (feature `cube`; the device must support the dtype: wgpu has no
    /// `bf16`); elsewhere it is [`Optimizer::step`](burn::optim::Optimizer::step) on the master followed by a cast. Updates equal those of
    /// `step(lr, master, grad.cast(F32), state)` within `f32` rounding.
    pub fn step_with_master<const D: usize>(
        &self,
        lr: LearningRate,
        master: Tensor<D>,
        param: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AdamState<D>>,
    ) -> (Tensor<D>, Tensor<D>, Option<AdamState<D>>) {
        let state = state.map(|s| conform_state(s, &master));
        let path = match state_fits(state.as_ref(), &master) {
            true => self.master_path_for(&master, &param, &grad),
            false => StepPath::BurnFallback,
        };
        match path {
            StepPath::FusedCpu => return self.fused_cpu_master(lr, master, param, grad, state),
            #[cfg(feature = "cube")]
            StepPath::CubeKernel => return self.fused_cube_master(lr, master, param, grad, state),
            _ => {}
        }
        let dtype = param.dtype();
        drop(param);
        let (master, state) = self.step(lr, master, grad.cast(DType::F32), state);
        let param = master.clone().cast(dtype);
        (master, param, state)
    }
}

impl Optimizer for FusedAdam {
    type State<const D: usize> = AdamState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        // A gradient of another float dtype is cast to the parameter's, as the update needs.
        let grad = if grad.dtype() != tensor.dtype() {
            grad.cast(tensor.dtype())
        } else {
            grad
        };
        let state = state.map(|s| conform_state(s, &tensor));
        if same_layout(&tensor, &grad) && state_fits(state.as_ref(), &tensor) {
            match self.path_for(&tensor) {
                StepPath::FusedCpu => return self.fused_cpu(lr, tensor, grad, state),
                #[cfg(feature = "cube")]
                StepPath::CubeKernel => return self.fused_cube(lr, tensor, grad, state),
                _ => {}
            }
        }
        match &self.fallback {
            Fallback::Adam(adam) => adam.step(lr, tensor, grad, state),
            Fallback::AdamW(adamw) => {
                let (t, s) = adamw.step(lr, tensor, grad, state.map(|s| AdamWState { momentum: s.momentum }));
                (t, s.map(Self::from_adamw_state))
            }
        }
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        <Adam as Optimizer>::to_device(state, device)
    }
}
