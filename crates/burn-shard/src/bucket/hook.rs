//! The stage 0-2 gradient hook: an identity op on each trainable parameter whose backward hands
//! the parameter's gradient to the [`BucketReducer`], attached as a reparameterization so
//! model code is unchanged.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, backend_extension};
use burn::module::{
    Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, ModuleVisitor, Param,
    Reparameterization, Reparameterizer,
};
use burn::tensor::{Device, Tensor};

use crate::bucket::reducer::BucketReducer;
use crate::fsdp::gather_op::FlatPrimitive;
use crate::fsdp::unit::current_unit;
use crate::model::census::{BUCKET_HOOK_NAME, Census, EntryKind};
use crate::model::layout::FlatLayout;

/// What one hook needs: the rank's reducer and the parameter's place in the layout.
#[derive(Clone, Debug)]
pub struct HookSpec {
    reducer: BucketReducer,
    /// The parameter's layout slot.
    slot: usize,
    /// Elements of the parameter.
    numel: usize,
}

/// The hook as a backend operation: the identity on the CPU `Flex` backend and (with the `cube`
/// feature) on the CubeCL backend, fusion on or off; the autodiff decorator adds the backward
/// that hands the gradient over.
#[backend_extension(Autodiff, Flex, Cube: cfg(feature = "cube"))]
pub trait BucketHookOps: Backend {
    /// `param`, unchanged.
    fn bucket_hook(param: FloatTensor<Self>, spec: HookSpec) -> FloatTensor<Self>;
    /// `param`, unchanged, ordered after `unit_input` in the autodiff graph.
    fn bucket_hook_in_unit(
        param: FloatTensor<Self>,
        unit_input: FloatTensor<Self>,
        spec: HookSpec,
    ) -> FloatTensor<Self>;
}

impl BucketHookOps for Flex {
    fn bucket_hook(param: FlexTensor, _spec: HookSpec) -> FlexTensor {
        param
    }

    fn bucket_hook_in_unit(param: FlexTensor, _unit_input: FlexTensor, _spec: HookSpec) -> FlexTensor {
        param
    }
}

#[cfg(feature = "cube")]
impl BucketHookOps for burn_cubecl::Cube {
    fn bucket_hook(param: FloatTensor<Self>, _spec: HookSpec) -> FloatTensor<Self> {
        param
    }

    fn bucket_hook_in_unit(
        param: FloatTensor<Self>,
        _unit_input: FloatTensor<Self>,
        _spec: HookSpec,
    ) -> FloatTensor<Self> {
        param
    }
}

impl<B: Backend + BucketHookOps + FlatPrimitive, C: CheckpointStrategy> BucketHookOps for Autodiff<B, C> {
    fn bucket_hook(param: FloatTensor<Self>, spec: HookSpec) -> FloatTensor<Self> {
        // Compute-bound: a consumer that needs the value keeps the output, which is the
        // parameter's own buffer (nothing is copied or recomputed).
        let prep = <HookBackward as Backward<B, 1>>::prepare::<C>(HookBackward, [param.node()])
            .compute_bound()
            .stateful();
        match prep {
            OpsKind::Tracked(prep) => prep.finish(spec, param.into_primitive()),
            OpsKind::UnTracked(prep) => prep.finish(param.into_primitive()),
        }
    }

    fn bucket_hook_in_unit(
        param: FloatTensor<Self>,
        unit_input: FloatTensor<Self>,
        spec: HookSpec,
    ) -> FloatTensor<Self> {
        // The unit input is a parent without gradient: it gives the op the unit's depth, so
        // Burn's backward (deepest nodes first) runs it right after the unit's backward instead
        // of at the very end.
        let prep = <HookBackward as Backward<B, 2>>::prepare::<C>(HookBackward, [param.node(), unit_input.node()])
            .compute_bound()
            .stateful();
        drop(unit_input);
        match prep {
            OpsKind::Tracked(prep) => prep.finish(spec, param.into_primitive()),
            OpsKind::UnTracked(prep) => prep.finish(param.into_primitive()),
        }
    }
}

/// The hook's backward: the gradient goes to the reducer, or on to the parameter.
#[derive(Debug)]
struct HookBackward;

impl<B: Backend + FlatPrimitive, const N: usize> Backward<B, N> for HookBackward {
    type State = HookSpec;

    fn backward(self, ops: Ops<HookSpec, N>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let Some(param) = ops.parents.first().and_then(|p| p.as_ref()).map(|p| p.id) else {
            return;
        };
        let spec = ops.state;
        let flat = B::to_flat(grad.clone(), spec.numel);
        if spec.reducer.hand(spec.slot, flat).is_some() {
            grads.register::<B>(param, grad);
        }
    }
}

/// The reparameterization that puts a [`BucketReducer`] hook on a parameter.
#[derive(Clone, Debug)]
pub struct BucketHook {
    spec: HookSpec,
}

impl Reparameterization for BucketHook {
    const NAME: &'static str = BUCKET_HOOK_NAME;

    fn apply<const D: usize>(&self, base: Tensor<D>) -> Tensor<D> {
        // Only a trainable value on an autodiff device with the op has a gradient to hand
        // over; an evaluation copy (`valid()`), a frozen parameter or a model moved to a
        // backend without the op passes unchanged.
        if !(base.is_require_grad() && crate::backend::has_ops(&base.device())) {
            return base;
        }
        let out = match current_unit() {
            Some((input, _)) => {
                <Dispatch as BucketHookOps>::bucket_hook_in_unit(base.into_dispatch(), input, self.spec.clone())
            }
            None => <Dispatch as BucketHookOps>::bucket_hook(base.into_dispatch(), self.spec.clone()),
        };
        Tensor::from_dispatch(out)
    }
}

/// Holds no tensor: traversal passes over it, and it moves with the parameter as it is.
impl Module for BucketHook {
    fn collect_devices(&self, devices: Devices) -> Devices {
        devices
    }

    fn fork(self, _device: &Device) -> Self {
        self
    }

    fn to_device(self, _device: &Device) -> Self {
        self
    }

    fn train(self) -> Self {
        self
    }

    fn valid(&self) -> Self {
        self.clone()
    }

    fn materialize(self) -> Self {
        self
    }

    fn visit<V: ModuleVisitor>(&self, _visitor: &mut V) {}

    fn map<M: ModuleMapper>(self, _mapper: &mut M) -> Self {
        self
    }
}

impl ModuleDisplayDefault for BucketHook {
    fn content(&self, content: Content) -> Option<Content> {
        content
            .add_formatted(&format!("BucketHook {{slot: {}}}", self.spec.slot))
            .optional()
    }
}

impl ModuleDisplay for BucketHook {}

/// Attaches a [`BucketHook`] to every trainable parameter of the layout that carries no
/// reparameterization of its own (one that does keeps it; its gradient is reduced by the step).
pub(crate) struct AttachHooks<'a> {
    pub(crate) reducer: BucketReducer,
    pub(crate) layout: &'a FlatLayout,
    pub(crate) census: &'a Census,
}

impl Reparameterizer for AttachHooks<'_> {
    type Reparam = BucketHook;

    fn reparameterize<const D: usize>(
        &mut self,
        _path: &str,
        param: Param<Tensor<D>>,
    ) -> (Param<Tensor<D>>, Option<BucketHook>) {
        let plain = self.census.get(&param.id).is_some_and(|e| e.kind == EntryKind::Param);
        match self.layout.slot_of(&param.id).filter(|_| plain) {
            Some(slot) => {
                let spec = HookSpec {
                    reducer: self.reducer.clone(),
                    slot,
                    numel: self.layout.slots()[slot].numel,
                };
                (param, Some(BucketHook { spec }))
            }
            None => (param, None),
        }
    }
}
