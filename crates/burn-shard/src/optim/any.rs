//! [`AnyOptimizer`]: any of Burn's optimizers behind one type, as Burn's `ModuleOptimizer` holds
//! them (type-erased), so that parameter groups can use different optimizers; and which
//! parameters an optimizer needs whole (Muon, LAMB, Adafactor), stepped with their shape.
//!
//! Element-wise optimizers keep the flat path: their states are Burn's `State<1>` of a piece.
//! An optimizer that needs whole parameters is stepped on the parameter reshaped to its own
//! shape, with Burn's `State<D>` of that rank, so the update math is Burn's.

use std::any::{Any, TypeId};
use std::sync::Arc;

use burn::optim::{
    Adafactor, AdafactorConfig, DynOptimizer, DynState, Lamb, LambConfig, LearningRate, Muon, MuonConfig, Optimizer,
    RecordState, StateSink, StateSource,
};
use burn::tensor::{Device, Tensor};

use crate::error::ShardError;
use crate::optim::into_optimizer::IntoOptimizer;
use crate::optim::master::MasterWeightStep;

/// Parameter ranks a whole-parameter step dispatches, as Burn's `DynOptimizer` (a parameter
/// of another rank is refused at `init` by [`AnyOptimizer`]'s parameter check).
const MAX_RANK: usize = 8;

/// Runs `$body` with a `const $d: usize` equal to `$rank` (1 to [`MAX_RANK`]).
macro_rules! with_rank {
    ($rank:expr, $d:ident => $body:expr) => {
        match $rank {
            1 => {
                const $d: usize = 1;
                $body
            }
            2 => {
                const $d: usize = 2;
                $body
            }
            3 => {
                const $d: usize = 3;
                $body
            }
            4 => {
                const $d: usize = 4;
                $body
            }
            5 => {
                const $d: usize = 5;
                $body
            }
            6 => {
                const $d: usize = 6;
                $body
            }
            7 => {
                const $d: usize = 7;
                $body
            }
            8 => {
                const $d: usize = 8;
                $body
            }
            other => panic!("a tensor of rank {other}: whole parameters of ranks 1 to {MAX_RANK} are stepped"),
        }
    };
}

/// What the sharded step asks of one optimizer, object-safe: Burn's [`DynOptimizer`] (shaped
/// steps, state moves and records) plus [`MasterWeightStep`]'s fused master step and state
/// sizes of flat pieces.
trait Erased: Send + Sync {
    /// The concrete optimizer's type (states made by another one are not reused).
    fn kind(&self) -> TypeId;
    /// Its type name, for errors.
    fn name(&self) -> &'static str;
    /// [`Optimizer::step`] on a flat piece (`[len]`).
    fn flat_step(
        &self,
        lr: LearningRate,
        param: Tensor<1>,
        grad: Tensor<1>,
        state: Option<DynState>,
    ) -> (Tensor<1>, Option<DynState>);
    /// [`MasterWeightStep::step_with_master`] on a flat piece.
    fn master_step(
        &self,
        lr: LearningRate,
        master: Tensor<1>,
        param: Tensor<1>,
        grad: Tensor<1>,
        state: Option<DynState>,
    ) -> (Tensor<1>, Tensor<1>, Option<DynState>);
    /// [`Optimizer::step`] on a whole parameter: `param` and `grad` (`[numel]`) reshaped to
    /// `shape` (rank 1 to [`MAX_RANK`]), the result flattened back.
    fn shaped_step(
        &self,
        lr: LearningRate,
        shape: &[usize],
        param: Tensor<1>,
        grad: Tensor<1>,
        state: Option<DynState>,
    ) -> (Tensor<1>, Option<DynState>);
    fn move_state(&self, state: DynState, device: &Device) -> DynState;
    fn flatten_state(&self, state: &DynState, out: &mut StateSink);
    fn rebuild_state(&self, rank: usize, source: &mut StateSource, device: &Device) -> Option<DynState>;
    /// [`MasterWeightStep::check_param`] of the concrete optimizer.
    fn own_check(&self, path: &str, shape: &[usize]) -> Result<(), ShardError>;
    /// [`MasterWeightStep::fingerprint`] of the concrete optimizer.
    fn own_fingerprint(&self) -> u64;
    /// Bytes of `state`'s tensors as `(on device, elsewhere)`.
    fn bytes_of(&self, state: &DynState, device: &Device) -> (usize, usize);
}

impl<P: MasterWeightStep> Erased for P {
    fn kind(&self) -> TypeId {
        TypeId::of::<P>()
    }

    fn name(&self) -> &'static str {
        std::any::type_name::<P>()
    }

    fn flat_step(
        &self,
        lr: LearningRate,
        param: Tensor<1>,
        grad: Tensor<1>,
        state: Option<DynState>,
    ) -> (Tensor<1>, Option<DynState>) {
        let state = state.map(|s| s.downcast::<P::State<1>>());
        let (param, state) = Optimizer::step(self, lr, param, grad, state);
        (param, state.map(|s| DynState::create(s, 1)))
    }

    fn master_step(
        &self,
        lr: LearningRate,
        master: Tensor<1>,
        param: Tensor<1>,
        grad: Tensor<1>,
        state: Option<DynState>,
    ) -> (Tensor<1>, Tensor<1>, Option<DynState>) {
        let state = state.map(|s| s.downcast::<P::State<1>>());
        let (master, param, state) = MasterWeightStep::step_with_master(self, lr, master, param, grad, state);
        (master, param, state.map(|s| DynState::create(s, 1)))
    }

    fn shaped_step(
        &self,
        lr: LearningRate,
        shape: &[usize],
        param: Tensor<1>,
        grad: Tensor<1>,
        state: Option<DynState>,
    ) -> (Tensor<1>, Option<DynState>) {
        // An optimizer that says it needs whole parameters itself steps them with its own
        // `step_whole` (and `State<1>`); Burn's, wrapped in `Shaped`, with their shape.
        if self.needs_whole_params() {
            let state = state.map(|s| s.downcast::<P::State<1>>());
            let (param, state) = MasterWeightStep::step_whole(self, lr, shape, param, grad, state);
            return (param, state.map(|s| DynState::create(s, 1)));
        }
        let numel = param.dims()[0];
        with_rank!(shape.len(), D => {
            let dims: [usize; D] = shape.try_into().expect("shape of rank D");
            let state = state.map(|s| s.downcast::<P::State<D>>());
            let (param, state) = Optimizer::step::<D>(self, lr, param.reshape(dims), grad.reshape(dims), state);
            (param.reshape([numel]), state.map(|s| DynState::create(s, D)))
        })
    }

    fn move_state(&self, state: DynState, device: &Device) -> DynState {
        DynOptimizer::to_device_dyn(self, state, device)
    }

    fn flatten_state(&self, state: &DynState, out: &mut StateSink) {
        DynOptimizer::state_flatten(self, "", state, out)
    }

    fn rebuild_state(&self, rank: usize, source: &mut StateSource, device: &Device) -> Option<DynState> {
        match self.needs_whole_params() {
            true => MasterWeightStep::rebuild_state(self, rank, source, device).map(|s| DynState::create(s, 1)),
            false => DynOptimizer::state_unflatten(self, rank, "", source, device),
        }
    }

    fn own_check(&self, path: &str, shape: &[usize]) -> Result<(), ShardError> {
        self.check_param(path, shape)
    }

    fn own_fingerprint(&self) -> u64 {
        MasterWeightStep::fingerprint(self)
    }

    fn bytes_of(&self, state: &DynState, device: &Device) -> (usize, usize) {
        match state.rank() {
            1 => P::state_bytes(state.downcast_ref::<P::State<1>>(), device),
            _ => {
                let mut sink = StateSink::default();
                self.flatten_state(state, &mut sink);
                let bytes = sink.tensors.iter().map(|(_, d)| d.num_elements() * d.dtype().size());
                (bytes.sum(), 0)
            }
        }
    }
}

/// Which parameters an optimizer can step, beyond any flat piece.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct Needs {
    /// Each parameter whole, with its shape (the update reads other elements of it).
    pub(crate) whole: bool,
    /// Only 2-D parameters (Muon's Newton-Schulz iteration; Burn's `Muon` panics on others).
    pub(crate) matrices: bool,
    /// Whole parameters are stepped with their shape and Burn's `State<D>` (an optimizer
    /// wrapped in `Shaped`); `false` for a `MasterWeightStep` that steps them itself.
    pub(crate) shaped: bool,
}

/// Any of Burn's optimizers, type-erased, as Burn's `ModuleOptimizer` holds each group's: what
/// a [`ShardedOptimizer`](crate::ShardedOptimizer) steps when its groups use different
/// optimizers, or when an optimizer needs whole parameters.
///
/// - Element-wise optimizers (everything [`IntoOptimizer`] accepts: Burn's Adam/AdamW configs
///   as the fused Adam, SGD, AdaGrad, RMSProp, Adan, Lion, [`ElementWise`](crate::ElementWise))
///   step flat pieces of buckets, as they do without erasure (the fused Adam keeps its fused
///   `bf16`/`f16` master step).
/// - Burn's `Muon`, `Lamb` and `Adafactor` (their configs, or built) need whole parameters:
///   Muon orthogonalises each 2-D update by Newton-Schulz, LAMB scales by a per-parameter
///   trust ratio `‖p‖/‖update‖`, Adafactor keeps row and column statistics of each matrix. At
///   stages 1-2 each parameter they step is owned whole by one rank (see
///   [`FlatLayout::from_module_owning`](crate::FlatLayout::from_module_owning)), at stage 3
///   gathered to its owner for the step, and that rank runs Burn's own `step` on it with its
///   shape and Burn's own `State<D>`. Muon takes 2-D
///   parameters only: a group that gives it another is refused at `init`, naming the
///   parameter and its shape.
/// - [`AnyOptimizer::whole_params`] steps any other optimizer whole.
///
/// States are Burn's own (`DynState` of the concrete `State<D>`); a state made by one optimizer
/// type is never handed to another (a parameter moved to a group of another type starts
/// afresh, as Burn's `with_group` resets it). It is an `Optimizer` for burn-shard's sharded
/// step: its [`AnyState`] cannot be rebuilt from a record without it
/// ([`MasterWeightStep::rebuild_state`]), so Burn's own `ModuleOptimizer` would load none;
/// give Burn the concrete optimizers instead.
#[derive(Clone)]
pub struct AnyOptimizer {
    inner: Arc<dyn Erased>,
    needs: Needs,
}

impl std::fmt::Debug for AnyOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AnyOptimizer")
            .field("optimizer", &self.inner.name())
            .field("needs", &self.needs)
            .finish()
    }
}

impl AnyOptimizer {
    /// `optim` as [`IntoOptimizer`] builds it, type-erased (an `AnyOptimizer` is returned as
    /// it is).
    ///
    /// # Errors
    /// What `optim`'s [`IntoOptimizer::into_optimizer`] returns.
    pub fn new<C: IntoOptimizer>(optim: C) -> Result<Self, ShardError> {
        Ok(Self::adopt(optim.into_optimizer()?))
    }

    /// `optim` (any of Burn's optimizers, or the user's own) stepped on whole parameters with
    /// their shapes, whatever its update reads: for an optimizer that is not element-wise and
    /// that Burn does not ship, or to step an element-wise one on whole parameters.
    pub fn whole_params<P: Optimizer>(optim: P) -> Self {
        // Burn's Muon asserts 2-D tensors: its parameters are checked at `init` instead.
        let matrices = TypeId::of::<P>() == TypeId::of::<Muon>();
        Self::erase(
            Shaped(optim),
            Needs {
                whole: true,
                matrices,
                shaped: true,
            },
        )
    }

    /// `optim` type-erased with what it needs.
    fn erase<P: MasterWeightStep>(optim: P, needs: Needs) -> Self {
        Self {
            inner: Arc::new(optim),
            needs,
        }
    }

    /// `optim` type-erased: returned as it is when it is an `AnyOptimizer`; otherwise stepping
    /// flat pieces, or whole parameters with its own [`MasterWeightStep::step_whole`] when it
    /// says it needs them.
    pub(crate) fn adopt<P: MasterWeightStep>(optim: P) -> Self {
        let boxed: Box<dyn Any> = Box::new(optim);
        match boxed.downcast::<AnyOptimizer>() {
            Ok(any) => *any,
            Err(boxed) => {
                let optim = *boxed.downcast::<P>().expect("the type it was boxed as");
                let whole = optim.needs_whole_params();
                Self::erase(
                    optim,
                    Needs {
                        whole,
                        matrices: false,
                        shaped: false,
                    },
                )
            }
        }
    }

    /// `state` when this optimizer made it (a parameter moved to a group of another optimizer
    /// type starts afresh).
    fn own(&self, state: Option<AnyState>) -> Option<DynState> {
        state.filter(|s| s.optim.kind() == self.inner.kind()).map(|s| s.state)
    }

    fn wrap(&self, state: Option<DynState>) -> Option<AnyState> {
        state.map(|state| AnyState {
            optim: self.inner.clone(),
            state,
        })
    }
}

/// Burn's state of one parameter (a flat piece's `State<1>`, or a whole parameter's
/// `State<D>`), with the optimizer that made it (which moves, records and sizes it).
#[derive(Clone)]
pub struct AnyState {
    optim: Arc<dyn Erased>,
    state: DynState,
}

impl RecordState for AnyState {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        let mut sink = StateSink::default();
        self.optim.flatten_state(&self.state, &mut sink);
        for (name, data) in sink.tensors {
            out.push_tensor(prefix, &name, data);
        }
        for (name, value) in sink.scalars {
            out.push_scalar(prefix, &name, value);
        }
    }

    /// Always `None`: which optimizer and rank a state belongs to is not in the record; the
    /// sharded optimizer (checkpoint loads, NVMe offload) rebuilds states through
    /// [`MasterWeightStep::rebuild_state`] instead.
    fn state_unflatten(_prefix: &str, _src: &mut StateSource, _device: &Device) -> Option<Self> {
        None
    }
}

impl Optimizer for AnyOptimizer {
    type State<const D: usize> = AnyState;

    /// A flat step (`D` = 1, the sharded step's pieces); a tensor of another rank is stepped
    /// with its own shape.
    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AnyState>,
    ) -> (Tensor<D>, Option<AnyState>) {
        let shape = tensor.dims();
        let numel = shape.iter().product::<usize>();
        let state = self.own(state);
        let (param, state) = match D {
            1 => self
                .inner
                .flat_step(lr, tensor.reshape([numel]), grad.reshape([numel]), state),
            _ => self
                .inner
                .shaped_step(lr, &shape, tensor.reshape([numel]), grad.reshape([numel]), state),
        };
        (param.reshape(shape), self.wrap(state))
    }

    fn to_device<const D: usize>(state: AnyState, device: &Device) -> AnyState {
        let optim = state.optim.clone();
        AnyState {
            state: optim.move_state(state.state, device),
            optim,
        }
    }
}

impl MasterWeightStep for AnyOptimizer {
    fn step_with_master(
        &self,
        lr: LearningRate,
        master: Tensor<1>,
        param: Tensor<1>,
        grad: Tensor<1>,
        state: Option<AnyState>,
    ) -> (Tensor<1>, Tensor<1>, Option<AnyState>) {
        let (master, param, state) = self.inner.master_step(lr, master, param, grad, self.own(state));
        (master, param, self.wrap(state))
    }

    fn state_bytes(state: &AnyState, device: &Device) -> (usize, usize) {
        state.optim.bytes_of(&state.state, device)
    }

    fn needs_whole_params(&self) -> bool {
        self.needs.whole
    }

    fn check_param(&self, path: &str, shape: &[usize]) -> Result<(), ShardError> {
        let name = self.inner.name();
        if self.needs.matrices && shape.len() != 2 {
            return Err(ShardError::InvalidConfig(format!(
                "`{path}` (shape {shape:?}) is given to {name}, which steps 2-D matrices only (Newton-Schulz); \
                 route it to another optimizer with a group (ParamGroup::from_regex or from_ids, as \
                 ModuleOptimizer::with_group takes them), e.g. AdamW for embeddings, norms, biases and the head"
            )));
        }
        if self.needs.whole && !(1..=MAX_RANK).contains(&shape.len()) {
            return Err(ShardError::InvalidConfig(format!(
                "`{path}` (shape {shape:?}) is given to {name}, which is stepped on whole parameters; ranks 1 \
                 to {MAX_RANK} are supported: route it to an element-wise optimizer with a group"
            )));
        }
        self.inner.own_check(path, shape)
    }

    fn state_rank(&self, shape: &[usize]) -> usize {
        match self.needs.whole && self.needs.shaped {
            true => shape.len(),
            false => 1,
        }
    }

    fn fingerprint(&self) -> u64 {
        let mut h = std::hash::DefaultHasher::new();
        std::hash::Hash::hash(&(self.inner.own_fingerprint(), self.needs), &mut h);
        std::hash::Hasher::finish(&h)
    }

    fn step_whole(
        &self,
        lr: LearningRate,
        shape: &[usize],
        param: Tensor<1>,
        grad: Tensor<1>,
        state: Option<AnyState>,
    ) -> (Tensor<1>, Option<AnyState>) {
        let (param, state) = self.inner.shaped_step(lr, shape, param, grad, self.own(state));
        (param, self.wrap(state))
    }

    fn rebuild_state(&self, rank: usize, source: &mut StateSource, device: &Device) -> Option<AnyState> {
        let state = self.inner.rebuild_state(rank, source, device);
        self.wrap(state)
    }

    fn from_group<P: MasterWeightStep>(optim: P) -> Result<Self, ShardError> {
        Ok(AnyOptimizer::adopt(optim))
    }
}

/// An optimizer stepped on whole parameters ([`AnyOptimizer::whole_params`]).
#[derive(Clone)]
struct Shaped<P>(P);

impl<P: Optimizer> Optimizer for Shaped<P> {
    type State<const D: usize> = P::State<D>;

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
        P::to_device(state, device)
    }
}

impl<P: Optimizer> MasterWeightStep for Shaped<P> {}

/// Burn's optimizers that need whole parameters, from their configs or built.
macro_rules! whole {
    ($($built:ty, $config:ty, $matrices:expr);*) => {$(
        impl IntoOptimizer for $built {
            type Optimizer = AnyOptimizer;

            fn into_optimizer(self) -> Result<AnyOptimizer, ShardError> {
                Ok(AnyOptimizer::erase(Shaped(self), Needs { whole: true, matrices: $matrices, shaped: true }))
            }
        }

        impl IntoOptimizer for $config {
            type Optimizer = AnyOptimizer;

            fn into_optimizer(self) -> Result<AnyOptimizer, ShardError> {
                self.build().into_optimizer()
            }

            fn grad_clipping(&self) -> Result<Option<burn::optim::grad_clipping::GradientClipping>, ShardError> {
                crate::optim::into_optimizer::config_clipping(self, stringify!($config))
            }
        }
    )*};
}

whole!(Muon, MuonConfig, true; Lamb, LambConfig, false; Adafactor, AdafactorConfig, false);

impl IntoOptimizer for AnyOptimizer {
    type Optimizer = AnyOptimizer;

    fn into_optimizer(self) -> Result<AnyOptimizer, ShardError> {
        Ok(self)
    }
}
