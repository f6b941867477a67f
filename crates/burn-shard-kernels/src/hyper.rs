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

/// The per-step scalars, computed once on the host in `f64` so one compiled kernel serves
/// every step.
///
/// With `t` the 1-based step, `bc1 = 1 - β1^t`, `bc2 = 1 - β2^t`, the update is
/// `p ← p·(1 - lr·λ_decoupled) - step_size · m / (sqrt(v)/sqrt(bc2) + ε)` with
/// `step_size = lr / bc1`, the same value as `lr · m̂ / (sqrt(v̂) + ε)` of the papers.
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
    /// `ε`.
    pub epsilon: f32,
    /// L2 penalty added to the gradient (0 for AdamW).
    pub l2: f32,
    /// Multiplier of the parameter before the update: `1 - lr·λ` for AdamW, 1 for Adam.
    pub decay: f32,
    /// `lr / (1 - β1^t)`.
    pub step_size: f32,
    /// `1 / sqrt(1 - β2^t)`.
    pub inv_sqrt_bc2: f32,
}

impl AdamHyper {
    /// The scalars of step `t` (1-based) at learning rate `lr`.
    pub fn scalars(&self, lr: f64, t: usize) -> AdamScalars {
        let t = t.max(1) as i32;
        let bc1 = 1.0 - (self.beta_1 as f64).powi(t);
        let bc2 = 1.0 - (self.beta_2 as f64).powi(t);
        let (l2, decay) = if self.decoupled_weight_decay {
            (0.0, 1.0 - lr * self.weight_decay as f64)
        } else {
            (self.weight_decay, 1.0)
        };
        AdamScalars {
            beta_1: self.beta_1,
            one_minus_beta_1: 1.0 - self.beta_1,
            beta_2: self.beta_2,
            one_minus_beta_2: 1.0 - self.beta_2,
            epsilon: self.epsilon,
            l2,
            decay: decay as f32,
            step_size: (lr / bc1) as f32,
            inv_sqrt_bc2: (1.0 / bc2.sqrt()) as f32,
        }
    }
}
