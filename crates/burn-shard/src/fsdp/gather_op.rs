//! The stage-3 autodiff op: a differentiable all-gather of a parameter shard.
//!
//! Forward: all-gather the shard into the full parameter. Backward: the gradient of the full
//! parameter, once every consumer has added its part, goes to the [`reducer`](crate::fsdp::unit_reducer),
//! which reduce-scatters it with the rest of its unit into the shard's gradient (mean over
//! ranks). The op is registered *memory-bound* with a retro-forward: a
//! consumer that needs the full weight in its own backward (a matmul) records "recompute"
//! instead of keeping the buffer, and the retro-forward re-gathers it from the shard when
//! backward reaches it. The full weight therefore lives only while it is used.
//!
//! The op forces Burn's balanced checkpointing for itself only (approach "C" of the project's
//! stage-3 notes), so on a plain autodiff device activations are saved as usual while a weight
//! that feeds its consumer directly is recomputed. A weight that passes through another op
//! first (the reshape `Linear` applies on 3-D inputs) is saved by that op unless the device
//! itself uses balanced checkpointing (`device.gradient_checkpointing()`), which then also
//! recomputes cheap activations: the trade-off FSDP users make with activation checkpointing. With `reshard_after_forward = false` it is
//! compute-bound instead: consumers keep the gathered weight until backward and nothing is
//! re-gathered (ZeRO-2-like memory, two thirds of the traffic).
//!
//! A unit's output goes through a compute-bound identity op ([`FsdpOps::fsdp_unit_boundary`])
//! that Burn's balanced checkpointing saves instead of recomputing, so backward recomputes one
//! unit at a time (see [`crate::fsdp::unit`]).
//!
//! When a [`unit`](crate::fsdp::unit) scope is active, the unit's input is a second, gradient-less
//! parent. The op's depth in the graph then follows the unit, and Burn's backward, which runs
//! nodes by decreasing depth, hands the unit's gradients to the reducer right after the unit's
//! backward instead of at the very end.

use std::marker::PhantomData;
use std::sync::Arc;

use burn::backend::autodiff::{
    Autodiff, NodeId,
    checkpoint::{
        base::Checkpointer,
        retro_forward::RetroForward,
        state::BackwardStates,
        strategy::{BalancedCheckpointing, CheckpointStrategy},
    },
    grads::Gradients,
    ops::{Backward, Ops, OpsKind, unary},
};
use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Flex, backend_extension};
use burn::tensor::{Shape, Tensor};

use crate::fsdp::context::FsdpContext;
use crate::fsdp::shard::Shard;
use crate::fsdp::spec::{ParamSpec, Phase, next_version};

/// What a gather op carries: the rank's shared context and what the gather is of. Reads of the
/// [`ParamSpec`] fields (shard, shapes, tag, version, phase, unit scope) go through `Deref`;
/// changes go through its methods (a new shard needs a new version and a registration).
#[derive(Clone, Debug)]
pub struct GatherSpec {
    pub(crate) ctx: FsdpContext,
    pub(crate) param: ParamSpec,
}

impl GatherSpec {
    /// Puts `shard` in place as the parameter's current shard, under a new version (moved to
    /// host memory with parameter offload, written to the shard file with NVMe parameter
    /// offload, unless it is there already).
    pub(crate) fn set_shard(&mut self, shard: Shard) {
        self.param.shard = match shard {
            Shard::Held(shard) => self.ctx.home().to_home(shard),
            stored @ Shard::Stored(_) => stored,
        };
        self.param.version = next_version();
        self.ctx.register(&self.param);
    }

    /// This gather, run in `phase` (a backward re-gather of a forward gather).
    fn in_phase(&self, phase: Phase) -> Self {
        let mut spec = self.clone();
        spec.param.phase = phase;
        spec
    }
}

impl std::ops::Deref for GatherSpec {
    type Target = ParamSpec;

    fn deref(&self) -> &ParamSpec {
        &self.param
    }
}

/// The stage-3 collectives as backend operations (CPU `Flex` backend, and the CubeCL backend
/// (CUDA, wgpu, CubeCL's CPU runtime) with the `cube` feature; the autodiff decorator adds the
/// backward pass).
#[backend_extension(Autodiff, Flex, Cube: cfg(feature = "cube"))]
pub trait FsdpOps: Backend {
    /// `spec.shard` -> the full parameter (`spec.full_shape`). `placeholder` is the parameter's
    /// stored value (full shape, no data): only the autodiff graph reads it, as the leaf that
    /// receives the shard's gradient.
    fn fsdp_all_gather(placeholder: FloatTensor<Self>, spec: GatherSpec) -> FloatTensor<Self>;
    /// As [`FsdpOps::fsdp_all_gather`], ordered after `unit_input` in the autodiff graph.
    fn fsdp_all_gather_in_unit(
        placeholder: FloatTensor<Self>,
        unit_input: FloatTensor<Self>,
        spec: GatherSpec,
    ) -> FloatTensor<Self>;
    /// `output` of a [`unit`](crate::fsdp::unit), unchanged: under autodiff a compute-bound identity,
    /// so Burn's balanced checkpointing saves it for backward instead of recomputing it from
    /// the units before (see [`crate::fsdp::unit`]).
    fn fsdp_unit_boundary(output: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// Moves a backend's float primitives into and out of the plain `Tensor<1>` the collectives
/// take: the gradients' way from backward to the reduce-scatter and back.
pub trait FlatPrimitive: Backend {
    /// A full gradient of `numel` elements (any shape) -> `[numel]`. On the host, the buffer is
    /// watched as transient memory while it lives (pending or in flight).
    fn into_flat(full: FloatTensor<Self>, numel: usize, ctx: &FsdpContext) -> Tensor<1>;
    /// A `[chunk]` shard -> `shape` (`[1, .., 1, chunk]`).
    fn from_flat(shard: Tensor<1>, shape: Shape) -> FloatTensor<Self>;
    /// A gradient of `numel` elements (any shape) -> `[numel]`, unwatched: a stage 0-2
    /// gradient on its way into a bucket ([`crate::bucket`]).
    fn to_flat(grad: FloatTensor<Self>, numel: usize) -> Tensor<1>;
}

impl FsdpOps for Flex {
    fn fsdp_all_gather(_placeholder: FlexTensor, spec: GatherSpec) -> FlexTensor {
        let full = spec.ctx.gather(&spec);
        let full = full.try_into_primitive::<Flex>().expect("a Flex tensor stays on Flex");
        Flex::float_reshape(full, spec.full_shape.clone())
    }

    fn fsdp_all_gather_in_unit(placeholder: FlexTensor, _unit_input: FlexTensor, spec: GatherSpec) -> FlexTensor {
        Self::fsdp_all_gather(placeholder, spec)
    }

    fn fsdp_unit_boundary(output: FlexTensor) -> FlexTensor {
        output
    }
}

impl FlatPrimitive for Flex {
    fn into_flat(full: FlexTensor, numel: usize, ctx: &FsdpContext) -> Tensor<1> {
        // Watched after the reshape, which copies a non-contiguous gradient into a new buffer.
        let flat = Flex::float_reshape(full, Shape::new([numel]));
        ctx.watch_transient(Arc::downgrade(&flat.data_arc()), numel * flat.dtype().size());
        Tensor::<1>::from_primitive::<Flex>(flat)
    }

    fn from_flat(shard: Tensor<1>, shape: Shape) -> FlexTensor {
        let shard = shard.try_into_primitive::<Flex>().expect("a Flex tensor stays on Flex");
        Flex::float_reshape(shard, shape)
    }

    fn to_flat(grad: FlexTensor, numel: usize) -> Tensor<1> {
        Tensor::<1>::from_primitive::<Flex>(Flex::float_reshape(grad, Shape::new([numel])))
    }
}

/// The same operations on the CubeCL backend, implemented for `burn_cubecl::Cube`: the type
/// Burn's dispatch uses, `Fusion<CubeBackend>` with Burn's default `fusion` feature and
/// `CubeBackend` without it. The collectives take and return Burn tensors, so only the
/// reshapes are backend calls (deferred on the fusion stream like any other op); the
/// transient-memory probes watch host buffers and are CPU-only (GPU memory is the allocator's
/// to report).
#[cfg(feature = "cube")]
impl FsdpOps for burn_cubecl::Cube {
    fn fsdp_all_gather(_placeholder: FloatTensor<Self>, spec: GatherSpec) -> FloatTensor<Self> {
        let full = spec.ctx.gather(&spec);
        let full = full
            .try_into_primitive::<Self>()
            .expect("a CubeCL tensor stays on CubeCL");
        Self::float_reshape(full, spec.full_shape.clone())
    }

    fn fsdp_all_gather_in_unit(
        placeholder: FloatTensor<Self>,
        _unit_input: FloatTensor<Self>,
        spec: GatherSpec,
    ) -> FloatTensor<Self> {
        Self::fsdp_all_gather(placeholder, spec)
    }

    fn fsdp_unit_boundary(output: FloatTensor<Self>) -> FloatTensor<Self> {
        output
    }
}

/// Device memory is its allocator's to report: nothing is watched.
#[cfg(feature = "cube")]
impl FlatPrimitive for burn_cubecl::Cube {
    fn into_flat(full: FloatTensor<Self>, numel: usize, _ctx: &FsdpContext) -> Tensor<1> {
        Tensor::<1>::from_primitive::<Self>(Self::float_reshape(full, Shape::new([numel])))
    }

    fn from_flat(shard: Tensor<1>, shape: Shape) -> FloatTensor<Self> {
        let shard = shard
            .try_into_primitive::<Self>()
            .expect("a CubeCL tensor stays on CubeCL");
        Self::float_reshape(shard, shape)
    }

    fn to_flat(grad: FloatTensor<Self>, numel: usize) -> Tensor<1> {
        Tensor::<1>::from_primitive::<Self>(Self::float_reshape(grad, Shape::new([numel])))
    }
}

impl<B: Backend + FsdpOps + FlatPrimitive, C: CheckpointStrategy> FsdpOps for Autodiff<B, C> {
    fn fsdp_all_gather(placeholder: FloatTensor<Self>, spec: GatherSpec) -> FloatTensor<Self> {
        if spec.ctx.reshard_after_forward() {
            gather::<B, BalancedCheckpointing>(placeholder, spec)
        } else {
            gather_kept::<B, C>(placeholder, spec)
        }
    }

    fn fsdp_all_gather_in_unit(
        placeholder: FloatTensor<Self>,
        unit_input: FloatTensor<Self>,
        spec: GatherSpec,
    ) -> FloatTensor<Self> {
        if spec.ctx.reshard_after_forward() {
            gather_in_unit::<B, BalancedCheckpointing>(placeholder, unit_input, spec)
        } else {
            drop(unit_input);
            gather_kept::<B, C>(placeholder, spec)
        }
    }

    fn fsdp_unit_boundary(output: FloatTensor<Self>) -> FloatTensor<Self> {
        if !output.is_tracked() {
            // Nothing to recompute from (an evaluation pass): no node.
            return output;
        }
        let prep = UnitBoundaryBackward.prepare::<C>([output.node()]).compute_bound();
        prep.stateless(output.into_primitive())
    }
}

/// Backward of the unit boundary: the gradient passes through.
#[derive(Debug)]
struct UnitBoundaryBackward;

impl<B: Backend> Backward<B, 1> for UnitBoundaryBackward {
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        unary::<B, _>(ops.parents, ops.node, grads, |grad| grad);
    }
}

/// Backward of the one-parent gather: the complete full gradient goes to the reducer.
#[derive(Debug)]
struct GatherBackward;

impl<B: Backend + FsdpOps + FlatPrimitive> Backward<B, 1> for GatherBackward {
    type State = GatherSpec;

    fn backward(self, ops: Ops<GatherSpec, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        hand_to_reducer::<B, 1>(grads, ops);
    }
}

/// Backward of the gather inside a unit: same, and the unit input gets no gradient from it.
#[derive(Debug)]
struct GatherInUnitBackward;

impl<B: Backend + FsdpOps + FlatPrimitive> Backward<B, 2> for GatherInUnitBackward {
    type State = GatherSpec;

    fn backward(self, ops: Ops<GatherSpec, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        hand_to_reducer::<B, 2>(grads, ops);
    }
}

/// Hands the gather's full gradient to the reducer (when the placeholder, the first parent,
/// wants one) and registers every shard the reducer has ready on its parameter's placeholder:
/// this one's, or those of the unit reduced before (see [`crate::fsdp::unit_reducer`]).
fn hand_to_reducer<B: Backend + FlatPrimitive, const N: usize>(grads: &mut Gradients, ops: Ops<GatherSpec, N>) {
    let grad = grads.consume::<B>(&ops.node);
    let Some(placeholder) = ops.parents.first().and_then(|p| p.as_ref()).map(|p| p.id) else {
        return;
    };
    let spec = ops.state;
    let full = B::into_flat(grad, spec.numel, &spec.ctx);
    for done in spec.ctx.reduce(&spec, placeholder, full) {
        // With NVMe parameter offload the shard goes to disk instead, for the step.
        if let Some(done) = spec.ctx.keep_reduced(done) {
            grads.register::<B>(done.node, B::from_flat(done.shard, done.shard_shape));
        }
    }
}

/// Re-gathers the full parameter from the shard when backward needs it (the placeholder is
/// the saved parent state that keeps the checkpointer's counts right).
#[derive(Debug)]
struct Regather<B> {
    placeholder: NodeId,
    /// The unit input, when it is a checkpointed parent: its state was counted for this node
    /// and must be consumed once to keep the checkpointer's counts balanced.
    unit_input: Option<NodeId>,
    spec: GatherSpec,
    _backend: PhantomData<B>,
}

impl<B: Backend + FsdpOps> RetroForward for Regather<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        if let Some(input) = self.unit_input {
            let _ = states.get_state::<B::FloatTensorPrimitive>(&input);
        }
        let placeholder = states.get_state::<B::FloatTensorPrimitive>(&self.placeholder);
        states.save(out_node, B::fsdp_all_gather(placeholder, self.spec.clone()));
    }
}

/// Runs the forward all-gather and records it in the graph as `prep` decided (with the spec as
/// backward state when tracked).
fn run_gather<B, BO, C, const N: usize>(
    prep: OpsKind<BO, B, GatherSpec, C, N>,
    placeholder: FloatTensor<B>,
    spec: GatherSpec,
) -> FloatTensor<Autodiff<B, C>>
where
    B: Backend + FsdpOps,
    BO: Backward<B, N, State = GatherSpec>,
    C: CheckpointStrategy,
{
    let out = B::fsdp_all_gather(placeholder, spec.clone());
    match prep {
        OpsKind::Tracked(prep) => prep.finish(spec, out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

/// Memory-bound gather with no unit.
fn gather<B: Backend + FsdpOps + FlatPrimitive, C: CheckpointStrategy>(
    placeholder: FloatTensor<Autodiff<B, C>>,
    spec: GatherSpec,
) -> FloatTensor<Autodiff<B, C>> {
    let retro = Regather::<B> {
        placeholder: placeholder.id(),
        unit_input: None,
        spec: spec.in_phase(Phase::Backward),
        _backend: PhantomData,
    };
    let prep = <GatherBackward as Backward<B, 1>>::prepare::<C>(GatherBackward, [placeholder.node()])
        .memory_bound()
        .retro_forward(retro)
        .parents([&placeholder])
        .stateful();
    run_gather(prep, placeholder.into_primitive(), spec)
}

/// Memory-bound gather ordered after the unit input.
fn gather_in_unit<B: Backend + FsdpOps + FlatPrimitive, C: CheckpointStrategy>(
    placeholder: FloatTensor<Autodiff<B, C>>,
    unit_input: FloatTensor<Autodiff<B, C>>,
    spec: GatherSpec,
) -> FloatTensor<Autodiff<B, C>> {
    let input_tracked = unit_input.is_tracked();
    let retro = Regather::<B> {
        placeholder: placeholder.id(),
        unit_input: input_tracked.then(|| unit_input.id()),
        spec: spec.in_phase(Phase::Backward),
        _backend: PhantomData,
    };
    let prep = <GatherInUnitBackward as Backward<B, 2>>::prepare::<C>(
        GatherInUnitBackward,
        [placeholder.node(), unit_input.node()],
    )
    .memory_bound()
    .retro_forward(retro)
    // An untracked parent here would make the checkpointer give up and save the full
    // weight: list the unit input only when it is tracked.
    .parents(if input_tracked {
        vec![&placeholder, &unit_input]
    } else {
        vec![&placeholder]
    })
    .stateful();
    drop(unit_input);
    run_gather(prep, placeholder.into_primitive(), spec)
}

/// Compute-bound gather (`reshard_after_forward = false`): consumers keep the full weight.
fn gather_kept<B: Backend + FsdpOps + FlatPrimitive, C: CheckpointStrategy>(
    placeholder: FloatTensor<Autodiff<B, C>>,
    spec: GatherSpec,
) -> FloatTensor<Autodiff<B, C>> {
    let prep = <GatherBackward as Backward<B, 1>>::prepare::<C>(GatherBackward, [placeholder.node()])
        .compute_bound()
        .stateful();
    run_gather(prep, placeholder.into_primitive(), spec)
}
