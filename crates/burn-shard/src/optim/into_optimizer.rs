//! [`IntoOptimizer`]: what [`ShardConfig::init`](crate::ShardConfig::init) accepts as the
//! optimizer, and which implementation it steps the flat shards with.

use burn::module::ParamGroup;
use burn::optim::grad_clipping::{GradientClipping, GradientClippingConfig};
use burn::optim::{AdaGrad, Adam, AdamConfig, AdamW, AdamWConfig, Adan, LearningRate, Lion, Optimizer, RmsProp, Sgd};
use burn::tensor::{Device, Tensor};
use burn_shard_kernels::{FusedAdam, FusedAdamConfig};

use crate::error::ShardError;
use crate::optim::master::MasterWeightStep;

/// A parameter group: which parameters (Burn's `ParamGroup`: ids or a module-path regex), the
/// optimizer that steps them, and its per-parameter clipping (`None`: none), as Burn's
/// `ModuleOptimizer::with_group` takes them.
pub type OptimizerGroup<O> = (ParamGroup, O, Option<GradientClipping>);

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
/// - Burn's optimizers that read a whole parameter (`MuonConfig`/`Muon`, `LambConfig`/`Lamb`,
///   `AdafactorConfig`/`Adafactor`) give an [`AnyOptimizer`](crate::AnyOptimizer) that steps
///   each parameter whole, with its shape; [`AnyOptimizer::whole_params`](crate::AnyOptimizer::whole_params)
///   does so for any other.
/// - [`OptimizerGroups`](crate::OptimizerGroups): a base optimizer and groups of other
///   optimizers, as Burn's `ModuleOptimizer::with_group` builds them.
///
/// Burn's gradient clipping (`grad_clipping` of a Burn config) is applied by the sharded step
/// itself, per parameter, with norms summed over the ranks.
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

    /// The base optimizer and the groups added to it, each `(selector, optimizer, clipping)`
    /// in the order added (the last group that matches a parameter steps it): what `init`
    /// builds the layout from, since a group that needs whole parameters decides where they
    /// live. The provided method gives [`IntoOptimizer::into_optimizer`] and no group.
    ///
    /// # Errors
    /// What [`IntoOptimizer::into_optimizer`] returns, for the base or a group.
    #[allow(clippy::type_complexity)]
    fn into_parts(
        self,
    ) -> Result<
        (
            Self::Optimizer,
            Vec<(ParamGroup, Self::Optimizer, Option<GradientClipping>)>,
        ),
        ShardError,
    >
    where
        Self: Sized,
    {
        Ok((self.into_optimizer()?, Vec::new()))
    }
}

/// Wraps an optimizer whose update is element-wise (each element's new value and state depend
/// on that element alone), so it can step flat buckets that hold many parameters. It steps as
/// the wrapped optimizer does; `bf16`/`f16` masters use [`MasterWeightStep`]'s provided method.
/// `init` refuses Burn's LAMB, Adafactor and Muon by type, and any optimizer that fails a probe
/// of the contract on Burn's Flex CPU device (two steps of 8 elements against two of each
/// half). The probe cannot see mixing that these 8 values do not trigger (an update that reads
/// other elements only past a threshold), and refuses an optimizer that cannot step a Flex
/// tensor: the contract is the user's to keep beyond it.
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

    /// # Errors
    /// [`ShardError::InvalidConfig`] when `O` is one of Burn's optimizers that mix the elements
    /// of a tensor (LAMB, Adafactor, Muon), or when the wrapped optimizer fails the element-wise
    /// probe ([`probe_element_wise`]): either would train silently wrong on flat shards.
    fn into_optimizer(self) -> Result<ElementWise<O>, ShardError> {
        refuse_burn_non_element_wise::<O>()?;
        probe_element_wise(&self.0)?;
        Ok(self)
    }
}

/// Refuses Burn's optimizers whose update of an element depends on other elements of the
/// tensor: LAMB (the trust ratio `‖p‖/‖update‖` per tensor), Adafactor (row and column
/// statistics, update clipping by the tensor's RMS), Muon (Newton-Schulz orthogonalisation of
/// a whole matrix). Named by type so the error says which and why, before any step.
fn refuse_burn_non_element_wise<O: Optimizer>() -> Result<(), ShardError> {
    use std::any::TypeId;
    let what = [
        (
            TypeId::of::<burn::optim::Lamb>(),
            "LAMB scales each parameter's update by a per-tensor trust ratio",
        ),
        (
            TypeId::of::<burn::optim::Adafactor>(),
            "Adafactor keeps row and column statistics and clips by the tensor's RMS",
        ),
        (
            TypeId::of::<burn::optim::Muon>(),
            "Muon orthogonalises each whole matrix",
        ),
    ];
    match what.iter().find(|(id, _)| *id == TypeId::of::<O>()) {
        Some((_, why)) => Err(ShardError::InvalidConfig(format!(
            "ElementWise({}) is refused: {why}, so on flat shards (pieces of buckets of many \
             parameters) it would train silently wrong; pass it without ElementWise (its config or \
             the built optimizer), which steps each parameter whole",
            std::any::type_name::<O>()
        ))),
        None => Ok(()),
    }
}

/// Checks the element-wise contract on the CPU before training: two steps of a 1-D tensor of 8
/// elements (as the flat step hands it: a piece of a bucket) must give bit for bit what two
/// steps of its two halves give on their own. An optimizer that reads any other element (a
/// norm, a mean, an RMS, a matrix) fails it for these values, which differ in scale, as
/// parameters of different layers do; one that panics on a 1-D tensor fails it too, here
/// rather than at the first step.
///
/// # Errors
/// [`ShardError::InvalidConfig`] naming the optimizer and the differing element.
fn probe_element_wise<O: Optimizer>(optim: &O) -> Result<(), ShardError> {
    let device = Device::flex();
    let values = |v: [f32; 8]| Tensor::<1>::from_floats(v, &device);
    let param = [0.5f32, -1.5, 2.0, 0.25, 40.0, -30.0, 0.001, 12.0];
    let grads = [
        [0.1f32, -0.2, 0.3, -0.4, 5.0, -6.0, 7.0, 0.05],
        [-0.3f32, 0.1, 0.2, 0.7, -2.0, 3.0, -1.0, 0.5],
    ];
    let steps = |from: usize, len: usize| -> Vec<f32> {
        let mut p = values(param).narrow(0, from, len);
        let mut state = None;
        for g in grads {
            let (next, next_state) = optim.step(1e-2, p, values(g).narrow(0, from, len), state);
            (p, state) = (next, next_state);
        }
        p.into_data().convert::<f32>().iter::<f32>().collect()
    };
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let whole = steps(0, 8);
        let halves: Vec<f32> = steps(0, 4).into_iter().chain(steps(4, 4)).collect();
        (whole, halves)
    }));
    let name = std::any::type_name::<O>();
    let (whole, halves) = run.map_err(|_| {
        ShardError::InvalidConfig(format!(
            "ElementWise({name}) panicked stepping a 1-D tensor, as the flat step hands it pieces of buckets; \
             only an optimizer whose update is element-wise can step flat shards"
        ))
    })?;
    match whole.iter().zip(&halves).position(|(a, b)| a != b) {
        Some(i) => Err(ShardError::InvalidConfig(format!(
            "ElementWise({name}) is not element-wise: stepping 8 elements together gives element {i} = {}, \
             stepping them as two halves gives {}; its update reads other elements of the tensor, so on \
             flat shards it would train silently wrong",
            whole[i], halves[i]
        ))),
        None => Ok(()),
    }
}

/// The `grad_clipping` field of a Burn config (private in Burn; read through its serde form,
/// which Burn's `Config` derive provides).
pub(crate) fn config_clipping(
    config: &impl serde::Serialize,
    name: &str,
) -> Result<Option<GradientClipping>, ShardError> {
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
