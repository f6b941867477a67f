//! Hyper-parameters of one Adam step and the scalars the fused update needs.

/// Adam / AdamW hyper-parameters (Kingma & Ba, 2015; Loshchilov & Hutter, 2019).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamHyper {
    /// Decay of the first moment, `β1`.
    pub beta_1: f32,
    /// Decay of the second moment, `β2`.
    pub beta_2: f32,
    /// `ε` added to `sqrt(v̂)`. Burn's default is 1e-5, PyTorch's 1e-8.
    pub epsilon: f32,
    /// Weight decay `λ`: an L2 term added to the gradient (Adam) or a decoupled shrink of the
    /// parameter by `lr·λ` (AdamW).
    pub weight_decay: f32,
    /// `true` for AdamW's decoupled weight decay, `false` for Adam's L2 penalty.
    pub decoupled_weight_decay: bool,
    /// Use the running maximum of `v` (AMSGrad, Reddi et al., 2018).
    pub amsgrad: bool,
}

/// The per-step scalars of one update, computed on the host once per step so one compiled
/// kernel serves every step.
///
/// The update is Burn 0.22.1's own expression, in Burn's order and with Burn's `f32` scalars,
/// so that on a backend that rounds each operation (Burn's Flex CPU backend, our host loop) it
/// is bitwise Burn's `Adam`/`AdamW`: one expression with five scalars covers both,
///
/// `δ = (m·moment_scale / moment_divisor) / (sqrt(v / variance_divisor) + epsilon)`,
/// `p ← p·decay − δ·lr`,
///
/// where, with `t` the 1-based step, `bc1 = 1 − β1^t` and `bc2 = 1 − β2^t` (in `f32`, as Burn):
/// - AdamW (`burn-optim` `adamw.rs`, `AdaptiveMomentumW::transform`): `m̂ = m / bc1`,
///   `v̂ = v / bc2`, `δ = m̂ / (sqrt(v̂) + ε)`, `p ← p·(1 − lr·λ) − δ·lr`; so `moment_scale = 1`,
///   `moment_divisor = bc1`, `variance_divisor = bc2`, `epsilon = ε`, `decay = 1 − lr·λ`.
/// - Adam (`adam.rs`, `AdaptiveMomentum::transform`): `δ = m·(sqrt(bc2)/bc1) / (sqrt(v) +
///   ε·sqrt(bc2))`, `p ← p − δ·lr`, the gradient first taking the L2 term `p·λ + g`; so
///   `moment_scale = sqrt(bc2)/bc1`, `moment_divisor = 1`, `variance_divisor = 1`,
///   `epsilon = ε·sqrt(bc2)`, `decay = 1`.
///
/// Multiplying or dividing by exactly 1 changes no bit, so each variant computes exactly
/// Burn's operations. Both are Kingma & Ba (2015), Algorithm 1, and Loshchilov & Hutter (2019),
/// Algorithm 2, in exact arithmetic.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamScalars {
    /// `β1`.
    pub beta_1: f32,
    /// `1 - β1`.
    pub one_minus_beta_1: f32,
    /// `β2`.
    pub beta_2: f32,
    /// `1 - β2`.
    pub one_minus_beta_2: f32,
    /// L2 penalty `λ` added to the gradient as `p·λ + g` (Adam; 0 for AdamW).
    pub l2: f32,
    /// Multiplier of the first moment: `sqrt(bc2)/bc1` (Adam) or 1 (AdamW).
    pub moment_scale: f32,
    /// Divisor of the first moment: 1 (Adam) or `bc1` (AdamW).
    pub moment_divisor: f32,
    /// Divisor of the second moment before its square root: 1 (Adam) or `bc2` (AdamW).
    pub variance_divisor: f32,
    /// What is added to the square root: `ε·sqrt(bc2)` (Adam) or `ε` (AdamW).
    pub epsilon: f32,
    /// Multiplier of the parameter before the update: `1 - lr·λ` (AdamW), 1 (Adam).
    pub decay: f32,
    /// The learning rate, as Burn rounds it to `f32`.
    pub lr: f32,
}

impl AdamHyper {
    /// The scalars of step `t` (1-based) at learning rate `lr`, each computed as Burn 0.22.1
    /// computes it (see [`AdamScalars`]).
    pub fn scalars(&self, lr: f64, t: usize) -> AdamScalars {
        let t = t.max(1) as i32;
        let bc1 = 1f32 - self.beta_1.powi(t);
        let bc2 = 1f32 - self.beta_2.powi(t);
        let common = |l2, moment_scale, moment_divisor, variance_divisor, epsilon, decay| AdamScalars {
            beta_1: self.beta_1,
            one_minus_beta_1: 1.0 - self.beta_1,
            beta_2: self.beta_2,
            one_minus_beta_2: 1.0 - self.beta_2,
            l2,
            moment_scale,
            moment_divisor,
            variance_divisor,
            epsilon,
            decay,
            lr: lr as f32,
        };
        if self.decoupled_weight_decay {
            // Burn: `mul_scalar(1.0 - lr * weight_decay as f64)`, the f64 rounded to f32.
            let decay = (1.0 - lr * self.weight_decay as f64) as f32;
            common(0.0, 1.0, bc1, bc2, self.epsilon, decay)
        } else {
            let bc2_sqrt = bc2.sqrt();
            common(
                self.weight_decay,
                bc2_sqrt / bc1,
                1.0,
                1.0,
                self.epsilon * bc2_sqrt,
                1.0,
            )
        }
    }
}
