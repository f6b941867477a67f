//! `f32` master weights for buckets of `bf16`/`f16` parameters.
//!
//! Mixed-precision training (Micikevicius et al., "Mixed Precision Training", 2018) keeps an
//! `f32` copy of the weights for the optimizer: an update smaller than half a `bf16` ulp of the
//! weight would round away in `bf16`, while it accumulates in `f32`. ZeRO partitions that copy
//! with the optimizer state (Rajbhandari et al., 2020, §3: `K = 12` bytes per parameter for
//! mixed-precision Adam: master, momentum, variance).

use burn::optim::{
    AdaGrad, Adam, AdamState, AdamW, AdamWState, Adan, AdaptiveMomentumState, LearningRate, Lion, Optimizer,
    RecordState, RmsProp, Sgd, StateSink, StateSource,
};
use burn::tensor::{DType, Device, Tensor};
use burn_shard_kernels::FusedAdam;

use crate::error::ShardError;
use crate::model::flat::tensor_bytes;

/// Whether parameters of `dtype` are trained through an `f32` master copy (`bf16`, `f16`);
/// `f32` and `f64` parameters are stepped directly.
pub(crate) fn needs_master(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// `t` in `f32` when it is `bf16`/`f16` (the master dtype), as it is otherwise: where a
/// half-precision gradient is summed or divided without rounding at every operation.
pub(crate) fn widen_half(t: Tensor<1>) -> Tensor<1> {
    match needs_master(t.dtype()) {
        true => t.cast(DType::F32),
        false => t,
    }
}

/// How an optimizer steps the `f32` master weights of `bf16`/`f16` parameters: what the sharded
/// step needs of an optimizer beyond Burn's [`Optimizer`].
///
/// The provided method steps the master with [`Optimizer::step`] and rounds the result to the
/// parameter's dtype (two passes). [`FusedAdam`] overrides it with its one-pass kernel (CPU and
/// CubeCL) that updates the master and writes the rounded parameter together. Burn's built
/// element-wise optimizers and [`ElementWise`](crate::ElementWise) use the provided method.
pub trait MasterWeightStep: Optimizer {
    /// One step on this rank's `f32` `master` (`[len]`) from `grad` (`[len]`, the parameters'
    /// dtype); returns `(master, param, state)` with `param` the new master rounded to
    /// `param`'s dtype (`bf16` or `f16`).
    ///
    /// Only `param`'s dtype, shape and device may be used, never its values: the new values
    /// come from the master alone, and with the state in host memory
    /// (`with_optimizer_state_on(Home::Host)`) `param` is an uninitialised host buffer of that
    /// dtype and shape, so that only the gradient crosses to the host.
    fn step_with_master(
        &self,
        lr: LearningRate,
        master: Tensor<1>,
        param: Tensor<1>,
        grad: Tensor<1>,
        state: Option<Self::State<1>>,
    ) -> (Tensor<1>, Tensor<1>, Option<Self::State<1>>) {
        let dtype = param.dtype();
        drop(param);
        let (master, state) = self.step(lr, master, grad.cast(DType::F32), state);
        let param = master.clone().cast(dtype);
        (master, param, state)
    }

    /// Bytes of `state`'s tensors as `(on device, elsewhere)`, `device` being the parameters'
    /// device: what [`MemoryReport`](crate::MemoryReport) counts as device-resident optimizer
    /// state and as host bytes.
    ///
    /// The provided method reads the sizes through Burn's `RecordState` (a copy of the state),
    /// which does not say where a tensor lives, and counts everything on `device` (the sharded
    /// step asks with the device the state lives on); the Adam family (Burn's `Adam`, `AdamW`,
    /// [`FusedAdam`]) looks at each moment tensor's device.
    fn state_bytes(state: &Self::State<1>, device: &Device) -> (usize, usize) {
        let _ = device;
        let mut sink = StateSink::default();
        state.state_flatten("", &mut sink);
        let bytes = sink
            .tensors
            .iter()
            .map(|(_, d)| d.num_elements() * d.dtype().size())
            .sum();
        (bytes, 0)
    }

    /// Whether each parameter must be stepped whole, with its shape ([`MasterWeightStep::step_whole`]),
    /// because the update of an element reads other elements of its parameter: `true` for
    /// [`AnyOptimizer`](crate::AnyOptimizer)s of Burn's Muon, LAMB and Adafactor and of
    /// [`AnyOptimizer::whole_params`](crate::AnyOptimizer::whole_params); `false` (flat pieces)
    /// for every element-wise optimizer.
    fn needs_whole_params(&self) -> bool {
        false
    }

    /// Checks that this optimizer can step the parameter at module path `path` of shape
    /// `shape`; run at `init` (and `with_group`) for every parameter it is given.
    ///
    /// # Errors
    /// [`ShardError::InvalidConfig`](crate::ShardError::InvalidConfig) naming the parameter,
    /// its shape and the fix (Muon given a parameter that is not 2-D).
    fn check_param(&self, path: &str, shape: &[usize]) -> Result<(), ShardError> {
        let _ = (path, shape);
        Ok(())
    }

    /// One step of a whole parameter of shape `shape`, `param` and `grad` flattened (`[numel]`,
    /// `param` the `f32` master for a `bf16`/`f16` parameter); returns the new flattened values.
    /// The provided method steps them flat, as an element-wise optimizer may.
    fn step_whole(
        &self,
        lr: LearningRate,
        shape: &[usize],
        param: Tensor<1>,
        grad: Tensor<1>,
        state: Option<Self::State<1>>,
    ) -> (Tensor<1>, Option<Self::State<1>>) {
        let _ = shape;
        self.step(lr, param, grad, state)
    }

    /// The rank of the state tensors kept for a parameter of shape `shape` stepped whole: what
    /// [`MasterWeightStep::rebuild_state`] is asked for, and the shape a checkpoint's
    /// one-value-per-element state is given back in (`shape` itself for a rank above 1). The
    /// provided method says 1 (`State<1>`, as [`MasterWeightStep::step_whole`] keeps it); an
    /// [`AnyOptimizer`](crate::AnyOptimizer) of Burn's Muon, LAMB or Adafactor keeps Burn's
    /// `State<D>`, `D = shape.len()`.
    fn state_rank(&self, shape: &[usize]) -> usize {
        let _ = shape;
        1
    }

    /// Rebuilds a state from a checkpoint's named tensors and scalars (`rank` is the rank of
    /// the tensors the state was made for: 1 for a flat piece, the parameter's for a whole
    /// one); `None` when they are not this optimizer's. The provided method is Burn's
    /// `RecordState::state_unflatten`.
    fn rebuild_state(&self, rank: usize, source: &mut StateSource, device: &Device) -> Option<Self::State<1>> {
        let _ = rank;
        <Self::State<1> as RecordState>::state_unflatten("", source, device)
    }

    /// Which optimizer this is, for the ranks' agreement that they step each parameter with
    /// the same one: a hash of its type (an [`AnyOptimizer`](crate::AnyOptimizer)'s, of the
    /// type it erases and what it needs). Hyper-parameters are not read.
    fn fingerprint(&self) -> u64 {
        let mut h = std::hash::DefaultHasher::new();
        std::hash::Hash::hash(std::any::type_name::<Self>(), &mut h);
        std::hash::Hasher::finish(&h)
    }

    /// `optim`, given to a parameter group, as this type: itself when it is of this type; an
    /// [`AnyOptimizer`](crate::AnyOptimizer) takes any optimizer.
    ///
    /// # Errors
    /// [`ShardError::InvalidConfig`](crate::ShardError::InvalidConfig) when `optim` is of
    /// another type, naming the fix ([`OptimizerGroups`](crate::OptimizerGroups)).
    fn from_group<P: MasterWeightStep>(optim: P) -> Result<Self, ShardError>
    where
        Self: Sized,
    {
        let boxed: Box<dyn std::any::Any> = Box::new(optim);
        boxed.downcast::<Self>().map(|optim| *optim).map_err(|_| {
            ShardError::InvalidConfig(format!(
                "a group's optimizer ({}) is not of the base optimizer's type ({}); to use different optimizers per \
                 group, give ShardConfig::init an OptimizerGroups (OptimizerGroups::new(base).with_group(group, \
                 optimizer, clipping)), as Burn's ModuleOptimizer::with_group takes them",
                std::any::type_name::<P>(),
                std::any::type_name::<Self>()
            ))
        })
    }
}

/// Bytes of Adam's moments as `(on device, elsewhere)`.
pub(crate) fn momentum_bytes(momentum: &AdaptiveMomentumState<1>, device: &Device) -> (usize, usize) {
    let moments = [
        Some(&momentum.moment_1),
        Some(&momentum.moment_2),
        momentum.max_moment_2.as_ref(),
    ];
    moments
        .into_iter()
        .flatten()
        .fold((0, 0), |(on, off), t| match t.device() == *device {
            true => (on + tensor_bytes(t), off),
            false => (on, off + tensor_bytes(t)),
        })
}

impl MasterWeightStep for Adam {
    fn state_bytes(state: &AdamState<1>, device: &Device) -> (usize, usize) {
        momentum_bytes(&state.momentum, device)
    }
}

impl MasterWeightStep for AdamW {
    fn state_bytes(state: &AdamWState<1>, device: &Device) -> (usize, usize) {
        momentum_bytes(&state.momentum, device)
    }
}

impl MasterWeightStep for FusedAdam {
    fn step_with_master(
        &self,
        lr: LearningRate,
        master: Tensor<1>,
        param: Tensor<1>,
        grad: Tensor<1>,
        state: Option<AdamState<1>>,
    ) -> (Tensor<1>, Tensor<1>, Option<AdamState<1>>) {
        FusedAdam::step_with_master(self, lr, master, param, grad, state)
    }

    fn state_bytes(state: &AdamState<1>, device: &Device) -> (usize, usize) {
        momentum_bytes(&state.momentum, device)
    }
}

macro_rules! provided {
    ($($t:ty),*) => {$(impl MasterWeightStep for $t {})*};
}

provided!(Sgd, AdaGrad, RmsProp, Adan, Lion);

/// `master` (`f32`, `[n]`) with each element whose parameter (`param`, `bf16`/`f16`, `[n]`) no
/// longer equals the master rounded to the parameter's dtype replaced by the parameter's value:
/// an edit made since the last step is taken, while unedited elements keep their sub-ulp
/// progress. On `master`'s device (the host when the state lives there).
pub(crate) fn follow_edits(master: Tensor<1>, param: &Tensor<1>) -> Tensor<1> {
    let param = param.clone().to_device(&master.device());
    let edited = master.clone().cast(param.dtype()).not_equal(param.clone());
    master.mask_where(edited, param.cast(DType::F32))
}
