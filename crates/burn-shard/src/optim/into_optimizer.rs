//! [`IntoOptimizer`]: what [`ShardConfig::init`](crate::ShardConfig::init) accepts as the
//! optimizer, and which implementation it steps the flat shards with.

use burn::optim::grad_clipping::{GradientClipping, GradientClippingConfig};
use burn::optim::{AdaGrad, Adam, AdamConfig, AdamW, AdamWConfig, Adan, LearningRate, Lion, Optimizer, RmsProp, Sgd};
use burn::tensor::{Device, Tensor};
use burn_shard_kernels::{FusedAdam, FusedAdamConfig};

use crate::error::ShardError;
use crate::optim::master::MasterWeightStep;

/// An optimizer for the flat shards of a [`ShardedOptimizer`](crate::ShardedOptimizer).
///
/// - Burn's **configs** `AdamConfig` and `AdamWConfig` give [`FusedAdam`] with the same
///   hyper-parameters: the fused step where the backend has it (Burn's `Flex` CPU backend; the
///   CubeCL backends when `burn-shard-kernels` is built with `cube`), Burn's own Adam/AdamW
///   everywhere else. This is the recommended way to pass Adam.
/// - Burn's **built** element-wise optimizers (`Adam`, `AdamW`, `Sgd`, `AdaGrad`, `RmsProp`,
///   `Adan`, `Lion`) and [`FusedAdam`] / [`FusedAdamConfig`] are used as they are.
/// - Any other optimizer goes through [`ElementWise`], which states the contract the flat step
///   relies on: the update of each element depends on that element alone.
///
/// Optimizers that mix the elements of a tensor (LAMB's trust ratio, Muon, Adafactor's
/// factored moments) would see buckets of many parameters instead of one parameter, so none of
/// them implements this trait. Burn's gradient clipping (`grad_clipping` of a Burn config) is
/// applied by the sharded step itself, per parameter, with norms summed over the ranks.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot step flat shards",
    note = "pass Burn's optimizer config itself (`AdamWConfig::new()`), a built element-wise optimizer (`SgdConfig::new().build()`), or wrap your own in `burn_shard::ElementWise`; `config.init()` returns a whole-module optimizer, which is not one"
)]
pub trait IntoOptimizer {
    /// The optimizer each flat shard is stepped with.
    type Optimizer: MasterWeightStep;

    /// Builds it.
    ///
    /// # Errors
    /// [`ShardError::InvalidConfig`] for options the sharded step cannot honour.
    fn into_optimizer(self) -> Result<Self::Optimizer, ShardError>;

    /// The per-parameter gradient clipping this asks for (`grad_clipping` of Burn's
    /// `AdamConfig`/`AdamWConfig`, which Burn's `config.init()` applies); `None` for built
    /// optimizers, which carry none in Burn either.
    ///
    /// # Errors
    /// [`ShardError::InvalidConfig`] when the config's clipping cannot be read.
    fn grad_clipping(&self) -> Result<Option<GradientClipping>, ShardError> {
        Ok(None)
    }
}

/// Wraps an optimizer whose update is element-wise (each element's new value and state depend
/// on that element alone), so it can step flat buckets that hold many parameters. It steps as
/// the wrapped optimizer does; `bf16`/`f16` masters use [`MasterWeightStep`]'s provided method.
#[derive(Clone, Debug)]
pub struct ElementWise<O>(pub O);

impl<O: Optimizer> Optimizer for ElementWise<O> {
    type State<const D: usize> = O::State<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        self.0.step(lr, tensor, grad, state)
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        O::to_device(state, device)
    }
}

impl<O: Optimizer> MasterWeightStep for ElementWise<O> {}

impl<O: Optimizer> IntoOptimizer for ElementWise<O> {
    type Optimizer = ElementWise<O>;

    fn into_optimizer(self) -> Result<ElementWise<O>, ShardError> {
        Ok(self)
    }
}

/// The `grad_clipping` field of a Burn config (private in Burn; read through its serde form,
/// which Burn's `Config` derive provides).
fn config_clipping(config: &impl serde::Serialize, name: &str) -> Result<Option<GradientClipping>, ShardError> {
    let unreadable = |e: String| ShardError::InvalidConfig(format!("{name}: cannot read grad_clipping: {e}"));
    let value = serde_json::to_value(config).map_err(|e| unreadable(e.to_string()))?;
    match value.get("grad_clipping") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => serde_json::from_value::<GradientClippingConfig>(v.clone())
            .map(|c| Some(c.init()))
            .map_err(|e| unreadable(e.to_string())),
    }
}

impl IntoOptimizer for AdamConfig {
    type Optimizer = FusedAdam;

    fn into_optimizer(self) -> Result<FusedAdam, ShardError> {
        Ok(FusedAdam::from_burn_adam(&self))
    }

    fn grad_clipping(&self) -> Result<Option<GradientClipping>, ShardError> {
        config_clipping(self, "AdamConfig")
    }
}

impl IntoOptimizer for AdamWConfig {
    type Optimizer = FusedAdam;

    fn into_optimizer(self) -> Result<FusedAdam, ShardError> {
        Ok(FusedAdam::from_burn_adamw(&self))
    }

    fn grad_clipping(&self) -> Result<Option<GradientClipping>, ShardError> {
        config_clipping(self, "AdamWConfig")
    }
}

impl IntoOptimizer for FusedAdamConfig {
    type Optimizer = FusedAdam;

    fn into_optimizer(self) -> Result<FusedAdam, ShardError> {
        Ok(self.init())
    }
}

/// Optimizers used as they are.
macro_rules! as_is {
    ($($t:ty),*) => {$(
        impl IntoOptimizer for $t {
            type Optimizer = $t;

            fn into_optimizer(self) -> Result<$t, ShardError> {
                Ok(self)
            }
        }
    )*};
}

as_is!(Adam, AdamW, Sgd, AdaGrad, RmsProp, Adan, Lion);

impl IntoOptimizer for FusedAdam {
    type Optimizer = FusedAdam;

    /// A built `FusedAdam` carries no clipping, as Burn's `config.build()` carries none; one
    /// built from a Burn config that asked for clipping is refused rather than silently not
    /// clipping.
    fn into_optimizer(self) -> Result<FusedAdam, ShardError> {
        if self.clips_gradients() {
            return Err(ShardError::InvalidConfig(
                "this FusedAdam was built from a Burn config with grad_clipping, which a built optimizer does not \
                 apply; pass the Burn config itself (ShardConfig::init(model, adamw_config, comm)) to have it clipped"
                    .to_string(),
            ));
        }
        Ok(self)
    }
}
