//! [`FusedAdam`] itself: its fields, and Burn's Adam state as every step path reads and builds
//! it. The paths (`flex.rs`, `cube.rs`, `path.rs`) and `optimizer.rs` import this module; it
//! imports none of them.

use burn::optim::{Adam, AdamState, AdamW, AdamWState, AdaptiveMomentumState};
use burn::tensor::{DType, Tensor};

use crate::hyper::AdamHyper;

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
