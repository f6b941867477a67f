//! Which implementation a [`FusedAdam`] step runs (the dispatch by device, dtype and layout,
//! written once for both steps), and the checks it makes on its operands.

use burn::optim::AdamState;
use burn::tensor::{DType, Device, Tensor};

use crate::fused_adam::{FusedAdam, adam_state};

/// The implementation a [`FusedAdam`] step runs for a given tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepPath {
    /// The fused CPU loop ([`crate::cpu::adam_step`]) on Burn's `Flex` backend.
    FusedCpu,
    /// The CubeCL kernel on Burn's CubeCL backend.
    CubeKernel,
    /// Burn's own Adam/AdamW (other backends, other dtypes, autodiff tensors).
    BurnFallback,
}

impl FusedAdam {
    /// Which implementation [`Optimizer::step`](burn::optim::Optimizer::step) uses for `tensor`.
    pub fn path_for<const D: usize>(&self, tensor: &Tensor<D>) -> StepPath {
        if !self.fused {
            return StepPath::BurnFallback;
        }
        if Self::fused_cpu_applies(tensor) {
            return StepPath::FusedCpu;
        }
        #[cfg(feature = "cube")]
        if crate::cube::applies(tensor) {
            return StepPath::CubeKernel;
        }
        StepPath::BurnFallback
    }

    /// Whether `tensor` can take the fused CPU path: `f32` on the `Flex` device, no autodiff.
    pub(crate) fn fused_cpu_applies<const D: usize>(tensor: &Tensor<D>) -> bool {
        tensor.dtype() == DType::F32 && !tensor.is_autodiff() && tensor.device() == Device::flex()
    }

    /// Which implementation [`FusedAdam::step_with_master`] uses for these tensors.
    pub fn master_path_for<const D: usize>(&self, master: &Tensor<D>, param: &Tensor<D>, grad: &Tensor<D>) -> StepPath {
        let shapes_match = param.shape() == master.shape() && grad.shape() == master.shape();
        let path = self.path_for(master);
        let low = [DType::BF16, DType::F16, DType::F32];
        let on_flex = |t: &Tensor<D>| !t.is_autodiff() && t.device() == Device::flex() && low.contains(&t.dtype());
        if shapes_match && path == StepPath::FusedCpu && on_flex(param) && on_flex(grad) {
            return StepPath::FusedCpu;
        }
        #[cfg(feature = "cube")]
        if shapes_match
            && path == StepPath::CubeKernel
            && crate::cube::applies_with_master(param, &master.device())
            && crate::cube::applies_with_master(grad, &master.device())
        {
            return StepPath::CubeKernel;
        }
        StepPath::BurnFallback
    }
}

/// Whether `b` can be read alongside `a` by a fused path: same shape, dtype and device, and not
/// tracked by autodiff.
pub(crate) fn same_layout<const D: usize>(a: &Tensor<D>, b: &Tensor<D>) -> bool {
    a.shape() == b.shape() && a.dtype() == b.dtype() && a.device() == b.device() && !b.is_autodiff()
}

/// Whether `state`'s moments are `f32` tensors shaped and placed like `like` (a state loaded from
/// elsewhere may not be; Burn's own step then handles it).
pub(crate) fn state_fits<const D: usize>(state: Option<&AdamState<D>>, like: &Tensor<D>) -> bool {
    let Some(state) = state else { return true };
    let fits = |t: &Tensor<D>| {
        t.dtype() == DType::F32 && t.shape() == like.shape() && t.device() == like.device() && !t.is_autodiff()
    };
    let m = &state.momentum;
    fits(&m.moment_1) && fits(&m.moment_2) && m.max_moment_2.as_ref().is_none_or(fits)
}

/// `state` with its moments in `like`'s dtype and on its device (a state loaded from a
/// checkpoint of another precision or device); unchanged when they already are.
pub(crate) fn conform_state<const D: usize>(state: AdamState<D>, like: &Tensor<D>) -> AdamState<D> {
    let (dtype, device) = (like.dtype(), like.device());
    let conform = |t: Tensor<D>| {
        let t = if t.device() != device { t.to_device(&device) } else { t };
        if t.dtype() != dtype { t.cast(dtype) } else { t }
    };
    let m = state.momentum;
    adam_state(
        m.time,
        conform(m.moment_1),
        conform(m.moment_2),
        m.max_moment_2.map(conform),
    )
}
