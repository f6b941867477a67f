//! [`FusedAdamConfig`], and [`FusedAdam`] built from Burn's own Adam/AdamW configs.

use burn::optim::decay::WeightDecayConfig;
use burn::optim::{AdamConfig, AdamWConfig};

use crate::fused_adam::{Fallback, FusedAdam};
use crate::hyper::AdamHyper;

/// Configuration of [`FusedAdam`], with Burn's defaults and Burn's builder style.
///
/// | field | [`FusedAdamConfig::adam`] | [`FusedAdamConfig::adamw`] |
/// |---|---|---|
/// | `beta_1` | 0.9 | 0.9 |
/// | `beta_2` | 0.999 | 0.999 |
/// | `epsilon` | 1e-5 (Burn's; PyTorch uses 1e-8) | 1e-5 |
/// | `weight_decay` | 0 (L2 penalty) | 1e-4 (decoupled) |
/// | `amsgrad` | false | false |
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FusedAdamConfig {
    hyper: AdamHyper,
}

impl FusedAdamConfig {
    /// Adam (L2 weight decay added to the gradient), as `burn::optim::AdamConfig::new()`.
    pub fn adam() -> Self {
        Self {
            hyper: AdamHyper {
                beta_1: 0.9,
                beta_2: 0.999,
                epsilon: 1e-5,
                weight_decay: 0.0,
                decoupled_weight_decay: false,
                amsgrad: false,
            },
        }
    }

    /// AdamW (decoupled weight decay), as `burn::optim::AdamWConfig::new()`.
    pub fn adamw() -> Self {
        Self {
            hyper: AdamHyper {
                weight_decay: 1e-4,
                decoupled_weight_decay: true,
                ..Self::adam().hyper
            },
        }
    }

    /// Sets `β1`.
    pub fn with_beta_1(mut self, beta_1: f32) -> Self {
        self.hyper.beta_1 = beta_1;
        self
    }

    /// Sets `β2`.
    pub fn with_beta_2(mut self, beta_2: f32) -> Self {
        self.hyper.beta_2 = beta_2;
        self
    }

    /// Sets `ε`.
    pub fn with_epsilon(mut self, epsilon: f32) -> Self {
        self.hyper.epsilon = epsilon;
        self
    }

    /// Sets the weight decay (L2 penalty for Adam, decoupled rate for AdamW).
    pub fn with_weight_decay(mut self, weight_decay: f32) -> Self {
        self.hyper.weight_decay = weight_decay;
        self
    }

    /// Enables AMSGrad.
    pub fn with_amsgrad(mut self, amsgrad: bool) -> Self {
        self.hyper.amsgrad = amsgrad;
        self
    }

    /// The hyper-parameters.
    pub fn hyper(&self) -> AdamHyper {
        self.hyper
    }

    /// Builds the optimizer.
    pub fn init(&self) -> FusedAdam {
        let h = self.hyper;
        let fallback = if h.decoupled_weight_decay {
            Fallback::AdamW(
                AdamWConfig::new()
                    .with_beta_1(h.beta_1)
                    .with_beta_2(h.beta_2)
                    .with_epsilon(h.epsilon)
                    .with_weight_decay(h.weight_decay)
                    .with_amsgrad(h.amsgrad)
                    .build(),
            )
        } else {
            let decay = (h.weight_decay != 0.0).then(|| WeightDecayConfig::new(h.weight_decay));
            Fallback::Adam(
                AdamConfig::new()
                    .with_beta_1(h.beta_1)
                    .with_beta_2(h.beta_2)
                    .with_epsilon(h.epsilon)
                    .with_weight_decay(decay)
                    .with_amsgrad(h.amsgrad)
                    .build(),
            )
        };
        FusedAdam {
            hyper: h,
            fallback,
            fused: true,
            clips_gradients: false,
        }
    }
}

/// The fields of Burn's `AdamConfig` / `AdamWConfig`, read through their serde form (Burn keeps
/// the fields private; `Config` types are serde types by contract).
#[derive(serde::Deserialize)]
struct BurnAdamFields {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    amsgrad: bool,
    /// A number (AdamW) or `null` / `{"penalty": x}` (Adam).
    weight_decay: serde_json::Value,
    #[serde(default)]
    cautious_weight_decay: bool,
}

impl BurnAdamFields {
    fn read(config: &impl serde::Serialize) -> Option<Self> {
        serde_json::from_value(serde_json::to_value(config).ok()?).ok()
    }

    fn weight_decay(&self) -> Option<f32> {
        match &self.weight_decay {
            serde_json::Value::Null => Some(0.0),
            serde_json::Value::Number(n) => n.as_f64().map(|x| x as f32),
            serde_json::Value::Object(o) => o.get("penalty")?.as_f64().map(|x| x as f32),
            _ => None,
        }
    }

    fn config(&self, decoupled_weight_decay: bool) -> Option<FusedAdamConfig> {
        Some(FusedAdamConfig {
            hyper: AdamHyper {
                beta_1: self.beta_1,
                beta_2: self.beta_2,
                epsilon: self.epsilon,
                weight_decay: self.weight_decay()?,
                decoupled_weight_decay,
                amsgrad: self.amsgrad,
            },
        })
    }
}

impl FusedAdam {
    /// The fused optimizer with the hyper-parameters of Burn's `config` (ε included: Burn's
    /// default 1e-5 stays 1e-5). On paths without a fused implementation it steps with
    /// `config.build()` itself, so results equal Burn's within `f32` rounding everywhere.
    ///
    /// Like `config.build()`, the result does not clip gradients; see
    /// [`FusedAdam::clips_gradients`].
    pub fn from_burn_adam(config: &AdamConfig) -> Self {
        let fused = BurnAdamFields::read(config).and_then(|f| f.config(false));
        Self::from_burn(config, fused, Fallback::Adam(config.build()))
    }

    /// As [`FusedAdam::from_burn_adam`], for AdamW. Cautious weight decay (Burn's
    /// `cautious_weight_decay`) has no fused implementation: such a config always steps with
    /// Burn's `AdamW`.
    pub fn from_burn_adamw(config: &AdamWConfig) -> Self {
        let fused = BurnAdamFields::read(config)
            .filter(|f| !f.cautious_weight_decay)
            .and_then(|f| f.config(true));
        Self::from_burn(config, fused, Fallback::AdamW(config.build()))
    }

    fn from_burn(config: &impl serde::Serialize, fused: Option<FusedAdamConfig>, fallback: Fallback) -> Self {
        // Read on its own, so a renamed field elsewhere cannot hide a clipping request.
        let clips_gradients = serde_json::to_value(config)
            .ok()
            .and_then(|v| v.get("grad_clipping").map(|g| !g.is_null()))
            .unwrap_or(false);
        match fused {
            Some(config) => FusedAdam {
                hyper: config.hyper,
                fallback,
                fused: true,
                clips_gradients,
            },
            // Fields Burn may rename or options without a fused form: Burn's optimizer alone.
            None => FusedAdam {
                hyper: FusedAdamConfig::adam().hyper,
                fallback,
                fused: false,
                clips_gradients,
            },
        }
    }

    /// Whether the Burn config this was built from asked for gradient clipping, which a bare
    /// optimizer does not apply (Burn's `ModuleOptimizer` does; so does not `config.build()`).
    pub fn clips_gradients(&self) -> bool {
        self.clips_gradients
    }
}
