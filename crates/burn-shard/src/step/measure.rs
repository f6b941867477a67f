//! Phase 2 of a step: the gradient's norms where clipping or loss scaling needs them, the loss
//! scaler's verdict (an overflow skips the step on every rank), and [`Clip`], how the update
//! phase clips each piece.

use burn::optim::grad_clipping::GradientClipping;
use burn::tensor::Tensor;

use crate::error::ShardError;
use crate::optim::groups::Groups;
use crate::optim::loss_scale::LossScaler;
use crate::optim::master::MasterWeightStep;
use crate::step::bucket_grads::BucketGrads;
use crate::step::context::StepContext;
use crate::step::grad_norm::{self, GradNorms};

/// What the measuring phase decided.
pub(crate) enum Measured {
    /// An overflow: every rank saw the same non-finite global norm (the value held) and skips
    /// the step.
    Skipped(f64),
    /// Apply the step, with the norms where clipping or loss scaling measured them.
    Apply(Option<GradNorms>),
}

impl Measured {
    /// The global norm of the averaged, unscaled gradient before clipping, where measured.
    pub(crate) fn grad_norm(&self) -> Option<f64> {
        match self {
            Measured::Skipped(norm) => Some(*norm),
            Measured::Apply(norms) => norms.as_ref().map(|n| n.total),
        }
    }
}

/// Measures the norms when `needs_norms` (one small all-gather at stages 1-3, see
/// [`grad_norm::measure`]; stored gradients are read once more for it) and lets `scaler` decide
/// on them: an overflow backs the scale off and skips the step. Without a loss scaler a
/// non-finite norm is applied, with a warning (as PyTorch's `clip_grad_norm_` without
/// `error_if_nonfinite`).
///
/// # Errors
/// [`ShardError::Comm`] when the all-gather fails; [`ShardError::Nvme`] when a stored gradient
/// shard cannot be read.
pub(crate) fn measure(
    cx: &StepContext,
    grads: &BucketGrads,
    needs_norms: bool,
    scaler: Option<&mut LossScaler>,
) -> Result<Measured, ShardError> {
    let norms = match needs_norms {
        true => {
            // Taken from a clone (handles): stored gradients are read once more for their norms.
            let mut grads = grads.clone();
            Some(grad_norm::measure(cx, &mut |index| grads.take(cx, index))?)
        }
        false => None,
    };
    if let (Some(scaler), Some(norms)) = (scaler, &norms)
        && !scaler.update(norms.total)
    {
        tracing::warn!(
            rank = cx.world.rank(),
            scale = scaler.scale(),
            "gradient overflow: step skipped, loss scale backed off"
        );
        return Ok(Measured::Skipped(norms.total));
    }
    if let Some(norms) = norms.as_ref().filter(|n| !n.total.is_finite()) {
        // Without a loss scaler nothing skips: say so, as PyTorch's clip_grad_norm_ would
        // with error_if_nonfinite.
        tracing::warn!(
            rank = cx.world.rank(),
            norm = norms.total,
            "non-finite gradient norm: the step applies it (configure a LossScaler to skip such steps)"
        );
    }
    Ok(Measured::Apply(norms))
}

/// How this step clips: the global-norm factor and the norms per-parameter clipping reads.
pub(crate) struct Clip<'a> {
    global: f32,
    norms: Option<&'a GradNorms>,
}

impl<'a> Clip<'a> {
    /// The clipping of a step that measured `norms`: by global norm to `max_grad_norm`
    /// (PyTorch's `clip_grad_norm_` factor) where both are given, else a factor of 1.
    pub(crate) fn new(max_grad_norm: Option<f32>, norms: Option<&'a GradNorms>) -> Self {
        Self {
            global: match (max_grad_norm, norms) {
                (Some(max), Some(norms)) => grad_norm::global_clip_coef(max, norms.total),
                _ => 1.0,
            },
            norms,
        }
    }

    /// Layout slot `slot`'s piece `grad` clipped: by global norm, then by its group's clipping
    /// (Burn's `GradientClipping`, with the norm of the whole parameter).
    pub(crate) fn piece<O: MasterWeightStep>(&self, groups: &Groups<O>, slot: usize, grad: Tensor<1>) -> Tensor<1> {
        let grad = grad_norm::scale(grad, self.global);
        match groups.clipping(slot) {
            Some(clipping) => {
                let norm = self.norms.map_or(0.0, |n| n.per_slot[slot]);
                grad_norm::clip_piece(clipping, grad, norm)
            }
            None => grad,
        }
    }
}

/// One norm-based clipping at a time: by global norm (`ShardConfig::with_max_grad_norm`) or by
/// each parameter's norm (Burn's `GradientClipping::Norm`), not both.
///
/// # Errors
/// [`ShardError::InvalidConfig`] naming both settings.
pub(crate) fn check_one_norm_clipping(
    max_grad_norm: Option<f32>,
    clipping: Option<&GradientClipping>,
) -> Result<(), ShardError> {
    if let (Some(max), Some(GradientClipping::Norm(t))) = (max_grad_norm, clipping) {
        return Err(ShardError::InvalidConfig(format!(
            "gradients would be clipped twice by norm: by global norm (with_max_grad_norm({max})) and by each \
             parameter's norm (GradientClippingConfig::Norm({t}) in the optimizer config); keep one"
        )));
    }
    Ok(())
}
