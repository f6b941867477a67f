//! [`FusedAdam`]: Burn's `Optimizer` trait on top of the fused kernels.

use burn::optim::{Adam, AdamState, AdamW, AdamWState, AdaptiveMomentumState, LearningRate, Optimizer};
use burn::tensor::{DType, Device, Tensor};

use crate::AdamHyper;
use crate::path::{StepPath, conform_state, same_layout, state_fits};

/// Burn's own optimizer, for the paths without a fused implementation.
#[derive(Clone)]
pub(crate) enum Fallback {
    Adam(Adam),
    AdamW(AdamW),
}

/// Adam / AdamW whose step is one fused pass on `f32` tensors of Burn's CPU (`Flex`) backend,
/// and Burn's own implementation on every other backend or dtype.
///
/// The state is Burn's [`AdamState`] (`momentum.time`, `momentum.moment_1`,
/// `momentum.moment_2`, `momentum.max_moment_2`), so a record written by `FusedAdam` loads into
/// Burn's `Adam`/`AdamW` and back ([`FusedAdam::from_adamw_state`] for `AdamWState`, whose
/// fields are the same). Updates equal Burn's within `f32` rounding.
#[derive(Clone)]
pub struct FusedAdam {
    pub(crate) hyper: AdamHyper,
    pub(crate) fallback: Fallback,
    /// `false` when the configuration has no fused form: every step is Burn's.
    pub(crate) fused: bool,
    pub(crate) clips_gradients: bool,
}

impl FusedAdam {
    /// Converts Burn's AdamW state (same fields) into this optimizer's state.
    pub fn from_adamw_state<const D: usize>(state: AdamWState<D>) -> AdamState<D> {
        AdamState {
            momentum: state.momentum,
        }
    }

    /// Converts this optimizer's state into Burn's AdamW state.
    pub fn to_adamw_state<const D: usize>(state: AdamState<D>) -> AdamWState<D> {
        AdamWState {
            momentum: state.momentum,
        }
    }

    /// The hyper-parameters of the fused update; `None` when this optimizer always steps with
    /// Burn's (see [`FusedAdam::from_burn_adamw`]).
    pub fn hyper(&self) -> Option<AdamHyper> {
        self.fused.then_some(self.hyper)
    }

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

    /// This step's `(time, m, v, vmax)`: the state's moments, or `f32` zeros shaped and placed
    /// like `like` on the first step; `vmax` only with AMSGrad. `time` is the step count before
    /// this step.
    pub(crate) fn moments<const D: usize>(
        &self,
        like: &Tensor<D>,
        state: Option<AdamState<D>>,
    ) -> (usize, Tensor<D>, Tensor<D>, Option<Tensor<D>>) {
        let zeros = || Tensor::<D>::zeros(like.shape(), (&like.device(), DType::F32));
        let (time, m, v, vmax) = match state {
            Some(s) => (
                s.momentum.time,
                s.momentum.moment_1,
                s.momentum.moment_2,
                s.momentum.max_moment_2,
            ),
            None => (0, zeros(), zeros(), None),
        };
        let vmax = match (self.hyper.amsgrad, vmax) {
            (true, Some(t)) => Some(t),
            (true, None) => Some(zeros()),
            (false, _) => None,
        };
        (time, m, v, vmax)
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

/// Burn's Adam state after step `time` (1-based) with moments `m`, `v` and, with AMSGrad, the
/// running maximum `vmax` of `v`.
pub(crate) fn adam_state<const D: usize>(
    time: usize,
    m: Tensor<D>,
    v: Tensor<D>,
    vmax: Option<Tensor<D>>,
) -> AdamState<D> {
    let momentum = AdaptiveMomentumState {
        time,
        moment_1: m,
        moment_2: v,
        max_moment_2: vmax,
    };
    AdamState { momentum }
}
