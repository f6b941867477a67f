//! [`LossScaler`]: loss scaling for `f16` training, decided identically on every rank.
//!
//! `f16` has 5 exponent bits: gradients below about `6e-8` flush to zero and above `65504`
//! overflow to infinity. Scaling the loss by `S` before backward shifts the gradients into
//! range; the step divides them by `S` again before anything else reads them (Micikevicius et
//! al., "Mixed Precision Training", ICLR 2018, §3.2). Dynamic scaling grows `S` after a run of
//! finite steps and, when a gradient overflows, skips the step and backs `S` off (the defaults
//! are PyTorch's `torch.amp.GradScaler`: `2^16`, ×2 every 2000 finite steps, ×0.5 on overflow).
//!
//! Sharded, an overflow may land on one rank only (its micro-batch, or at stage 2 its shard of
//! the reduced gradient). The step therefore decides on the global gradient norm, which is
//! summed over all ranks: one infinity anywhere makes it non-finite on every rank, so every
//! rank skips the same step and backs off to the same scale.
//!
//! `bf16` has `f32`'s exponent range and needs no scaling.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use burn::tensor::{DType, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::ShardError;

/// Loss scale for `f16` training: call `backward` on `ShardedOptimizer::scale_loss(loss)` (in a
/// burn-train `TrainStep` run by burn-shard-train's `ShardedStrategy`:
/// `burn_shard_train::scale_loss(loss)`); the sharded step unscales, checks for overflow on all
/// ranks together and updates the scale. A step (or `accumulate`) after a backward whose loss
/// was not scaled that way fails with [`ShardError::LossNotScaled`] instead of dividing
/// unscaled gradients by the scale (a scale of exactly 1 needs no call).
///
/// ```ignore
/// let config = ShardConfig::new(Stage::Two).with_loss_scaler(LossScaler::dynamic());
/// let (model, mut optim) = config.init(model, AdamWConfig::new(), comm)?;
/// let grads = GradientsParams::from_grads(optim.scale_loss(loss).backward(), &model);
/// model = optim.step(lr, model, grads)?; // skipped (model unchanged) if a gradient overflowed
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    /// The current scale `S` (the loss is multiplied by it).
    scale: f32,
    /// Factor applied after `growth_interval` consecutive finite steps (1 for a fixed scale).
    growth_factor: f32,
    /// Factor applied on overflow (1 for a fixed scale, which still skips the step).
    backoff_factor: f32,
    /// Consecutive finite steps before the scale grows.
    growth_interval: usize,
    /// Finite steps since the last growth or overflow.
    finite_steps: usize,
    /// Steps skipped for overflow so far.
    skipped_steps: usize,
}

impl LossScaler {
    /// Dynamic scaling with PyTorch `GradScaler`'s defaults: initial scale `2^16`, doubled after
    /// 2000 consecutive finite steps, halved on overflow.
    pub fn dynamic() -> Self {
        Self {
            scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            finite_steps: 0,
            skipped_steps: 0,
        }
    }

    /// A fixed scale (`1.0`: no scaling). A step whose gradient overflows is still skipped.
    pub fn fixed(scale: f32) -> Self {
        Self {
            scale,
            growth_factor: 1.0,
            backoff_factor: 1.0,
            ..Self::dynamic()
        }
    }

    /// Sets the current (initial) scale.
    pub fn with_scale(mut self, scale: f32) -> Self {
        self.scale = scale;
        self
    }

    /// Sets the growth factor (> 1 for dynamic scaling).
    pub fn with_growth_factor(mut self, growth_factor: f32) -> Self {
        self.growth_factor = growth_factor;
        self
    }

    /// Sets the back-off factor on overflow (in `(0, 1)` for dynamic scaling).
    pub fn with_backoff_factor(mut self, backoff_factor: f32) -> Self {
        self.backoff_factor = backoff_factor;
        self
    }

    /// Sets how many consecutive finite steps grow the scale (at least 1).
    pub fn with_growth_interval(mut self, growth_interval: usize) -> Self {
        self.growth_interval = growth_interval;
        self
    }

    /// The current scale `S`.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Steps skipped because a gradient overflowed (on any rank).
    pub fn skipped_steps(&self) -> usize {
        self.skipped_steps
    }

    /// The settings and state as exact bits (`scale`, factors, interval), for checking that
    /// every rank configured the same scaler.
    pub(crate) fn fingerprint(&self) -> [u64; 4] {
        [
            u64::from(self.scale.to_bits()),
            u64::from(self.growth_factor.to_bits()),
            u64::from(self.backoff_factor.to_bits()),
            self.growth_interval as u64,
        ]
    }

    /// Continues from `saved` (a checkpoint's scaler): its running state (scale, finite steps,
    /// skipped steps), keeping this scaler's settings (factors, interval), as a resumed run may
    /// change them.
    ///
    /// # Errors
    /// [`ShardError::InvalidConfig`] when the saved scale is not finite and positive.
    pub(crate) fn resume(&mut self, saved: &LossScaler) -> Result<(), ShardError> {
        let resumed = Self {
            scale: saved.scale,
            finite_steps: saved.finite_steps,
            skipped_steps: saved.skipped_steps,
            ..self.clone()
        };
        resumed.validate()?;
        *self = resumed;
        Ok(())
    }

    /// # Errors
    /// [`ShardError::InvalidConfig`] for a scale that is not finite and positive, a growth
    /// factor below 1, a back-off factor outside `(0, 1]` or a zero growth interval.
    pub(crate) fn validate(&self) -> Result<(), ShardError> {
        let bad = |what: String| Err(ShardError::InvalidConfig(format!("LossScaler: {what}")));
        if !(self.scale.is_finite() && self.scale > 0.0) {
            return bad(format!("the scale must be finite and positive, got {}", self.scale));
        }
        if !(self.growth_factor >= 1.0 && self.growth_factor.is_finite()) {
            return bad(format!(
                "the growth factor must be at least 1, got {}",
                self.growth_factor
            ));
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor <= 1.0) {
            return bad(format!(
                "the back-off factor must be in (0, 1], got {}",
                self.backoff_factor
            ));
        }
        if self.growth_interval == 0 {
            return bad("the growth interval must be at least 1 step".to_string());
        }
        Ok(())
    }

    /// Records one step whose global gradient norm (of the unscaled gradient) was `norm`; returns
    /// whether the step is taken (`norm` finite). The same `norm` on every rank gives the same
    /// scale on every rank.
    pub(crate) fn update(&mut self, norm: f64) -> bool {
        if norm.is_finite() {
            self.finite_steps += 1;
            if self.finite_steps >= self.growth_interval {
                self.scale = grown(self.scale, self.growth_factor);
                self.finite_steps = 0;
            }
            true
        } else {
            self.scale *= self.backoff_factor;
            self.finite_steps = 0;
            self.skipped_steps += 1;
            false
        }
    }
}

/// `scale · factor`, kept finite (a scale that reached `f32::MAX` stays there).
fn grown(scale: f32, factor: f32) -> f32 {
    let next = scale * factor;
    if next.is_finite() { next } else { scale }
}

/// Scales losses for one [`ShardedOptimizer`](crate::ShardedOptimizer) where the optimizer is
/// out of reach (burn-train's `TrainStep`: burn-shard-train hands this to its rank's thread),
/// and records the scale it multiplied by: the optimizer's next `step` or `accumulate` checks
/// the record against its scale (see [`ShardError::LossNotScaled`]) and clears it. Cheap to
/// clone (an `Arc`), `Send`; from `ShardedOptimizer::loss_scaling`, valid until that
/// optimizer's next call (a handle kept longer may hold an old scale, which that check refuses).
#[derive(Clone, Debug)]
pub struct LossScaling {
    /// The scale of the optimizer's next step; `None` without a [`LossScaler`].
    scale: Option<f32>,
    /// The bits of the last scale [`LossScaling::scale_loss`] multiplied by (`0`: none since
    /// the last optimizer call); shared with the optimizer.
    scaled_by: Arc<AtomicU32>,
}

impl LossScaling {
    pub(crate) fn new(scale: Option<f32>, scaled_by: Arc<AtomicU32>) -> Self {
        Self { scale, scaled_by }
    }

    /// `loss` in `f32` multiplied by the loss scale (`loss` itself without a [`LossScaler`]):
    /// call `backward` on this. The product is taken in `f32` so that an `f16` loss times the
    /// scale (`2^16` by default) does not overflow; backward casts the scaled gradient back to
    /// the loss's dtype.
    pub fn scale_loss<const D: usize>(&self, loss: Tensor<D>) -> Tensor<D> {
        // A scale is finite and positive (`LossScaler::validate`), so its bits are never 0.
        self.scaled_by
            .store(self.scale.unwrap_or(1.0).to_bits(), Ordering::SeqCst);
        match self.scale {
            Some(scale) => loss.cast(DType::F32).mul_scalar(scale),
            None => loss,
        }
    }

    /// The scale [`LossScaling::scale_loss`] multiplies by; `None` without a [`LossScaler`].
    pub fn scale(&self) -> Option<f32> {
        self.scale
    }
}

/// Whether a backward since the last optimizer call scaled its loss by `scaler`'s current scale
/// (`scaled_by`, cleared here).
///
/// # Errors
/// [`ShardError::LossNotScaled`] when `scaler` has a scale other than 1 and no loss was scaled
/// by it: none at all, or one by an older scale (a [`LossScaling`] kept across a step).
pub(crate) fn check_scaled(scaler: Option<&LossScaler>, scaled_by: &AtomicU32) -> Result<(), ShardError> {
    let used = scaled_by.swap(0, Ordering::SeqCst);
    match scaler {
        Some(scaler) if scaler.scale() != 1.0 && used != scaler.scale().to_bits() => Err(ShardError::LossNotScaled {
            scale: scaler.scale(),
            scaled_by: (used != 0).then(|| f32::from_bits(used)),
        }),
        _ => Ok(()),
    }
}
