//! Moving values between a module's parameters and the flat bucket buffers.
//!
//! All buffers here are plain (non-autodiff) 1-D tensors on the parameters' inner device.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};

use crate::error::ShardError;
use crate::model::layout::{Bucket, FlatLayout};
use crate::model::lazy::lazy_dtype;

/// One flat `[numel]` tensor per layout slot; `None` where the value is absent (a parameter
/// that received no gradient this step), which reads as zeros.
pub(crate) type SlotValues = Vec<Option<Tensor<1>>>;

/// Flat views of the trainable parameters' current values, in layout order, and their (plain)
/// device; `None` for an empty layout.
pub(crate) fn param_values<M: Module>(
    module: &M,
    layout: &FlatLayout,
) -> Result<(SlotValues, Option<Device>), ShardError> {
    let mut v = SlotVisitor::new(layout, None);
    module.visit(&mut v);
    v.finish()
}

/// Takes (removes) every trainable parameter's gradient out of `grads`, flattened, in layout
/// order. A gradient only has to have the slot's element count: at stage 3 the parameter is a
/// full-shape placeholder and its gradient this rank's `[1, .., 1, chunk]` shard.
pub(crate) fn take_grads<M: Module>(
    module: &M,
    layout: &FlatLayout,
    grads: &mut GradientsParams,
) -> Result<(SlotValues, Option<Device>), ShardError> {
    let mut v = SlotVisitor::new(layout, Some(grads));
    module.visit(&mut v);
    v.finish()
}

/// Elements `range` of bucket `bucket` assembled from per-slot values: shape `[range.len()]`,
/// dtype `bucket.dtype`, zeros for absent values and for the padding tail.
pub(crate) fn assemble(
    layout: &FlatLayout,
    bucket: &Bucket,
    values: &SlotValues,
    range: Range<usize>,
    device: &Device,
) -> Tensor<1> {
    let mut pieces = Vec::new();
    for (index, slot) in bucket.slots.clone().zip(&layout.slots()[bucket.slots.clone()]) {
        if let Some(part) = slot.within(&range) {
            let at = slot.offset + part.start;
            pieces.push((at, slot_piece(&values[index], slot, part, bucket.dtype, device)));
        }
    }
    join_range(pieces, bucket, range, device)
}

/// Elements `part` (of the flattened parameter) of a slot's `value`: a view of it, or zeros of
/// `dtype` when the value is absent.
pub(crate) fn slot_piece(
    value: &Option<Tensor<1>>,
    slot: &crate::model::layout::ParamSlot,
    part: Range<usize>,
    dtype: burn::tensor::DType,
    device: &Device,
) -> Tensor<1> {
    match value {
        Some(t) if part.len() == slot.numel => t.clone(),
        Some(t) => t.clone().narrow(0, part.start, part.len()),
        None => Tensor::zeros([part.len()], (device, dtype)),
    }
}

/// `range` of `bucket` from the pieces of its parameters that lie in it, each with the bucket
/// offset of its first element, in bucket order: the padding (zeros) between them and after the
/// last is filled in (a bucket of whole-owned parameters pads each rank's segment), and the
/// pieces become one `[range.len()]` tensor of the bucket's dtype.
pub(crate) fn join_range(
    pieces: Vec<(usize, Tensor<1>)>,
    bucket: &Bucket,
    range: Range<usize>,
    device: &Device,
) -> Tensor<1> {
    let zeros = |len: usize| Tensor::<1>::zeros([len], (device, bucket.dtype));
    let mut parts = Vec::with_capacity(pieces.len() + 1);
    let mut at = range.start;
    for (start, piece) in pieces {
        if start > at {
            parts.push(zeros(start - at));
        }
        at = start + piece.dims()[0];
        parts.push(piece);
    }
    if range.end > at {
        parts.push(zeros(range.end - at));
    }
    match parts.len() {
        0 => zeros(0),
        1 => parts.pop().expect("one piece"),
        _ => Tensor::cat(parts, 0),
    }
}

/// Replaces every trainable parameter of `module` with its elements of `full_buckets`
/// (one `[padded_numel]` tensor per bucket), keeping ids, autodiff, require-grad and
/// checkpointing settings. Each new value is a fresh autodiff leaf. Slots with `keep[i]` set
/// keep their current value.
pub(crate) fn scatter_into<M: Module>(module: M, layout: &FlatLayout, full_buckets: &[Tensor<1>], keep: &[bool]) -> M {
    let values = layout
        .slots()
        .iter()
        .enumerate()
        .filter(|(i, slot)| !keep.get(*i).copied().unwrap_or(false) && slot.numel > 0)
        .map(|(_, slot)| {
            let value = full_buckets[slot.bucket].clone().narrow(0, slot.offset, slot.numel);
            (slot.id, value)
        })
        .collect();
    replace_values(module, values)
}

/// Replaces the value of every float entry of `module` named in `values` (flat `[numel]`
/// tensors, reshaped and cast to the entry's shape and dtype) by a fresh leaf that keeps the
/// entry's id, autodiff, require-grad and checkpointing settings. Running-state buffers take the
/// value too (Burn's `RunningState` writes it into its cell).
pub(crate) fn replace_values<M: Module>(module: M, values: HashMap<ParamId, Tensor<1>>) -> M {
    module.map(&mut ReplaceMapper { values })
}

/// The current value of every float entry of `module` named in `ids`, flattened to `[numel]`
/// and plain (no autodiff). At stage 3 a sharded parameter's value here is its placeholder:
/// read shards through `fsdp::exchange`.
pub(crate) fn values_by_id<M: Module>(module: &M, ids: &HashSet<ParamId>) -> HashMap<ParamId, Tensor<1>> {
    struct Read<'a> {
        ids: &'a HashSet<ParamId>,
        values: HashMap<ParamId, Tensor<1>>,
    }
    impl ModuleVisitor for Read<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.ids.contains(&param.id) {
                let value = param.val().inner();
                let numel = value.shape().num_elements();
                self.values.insert(param.id, value.reshape([numel]));
            }
        }
    }
    let mut read = Read {
        ids,
        values: HashMap::new(),
    };
    module.visit(&mut read);
    read.values
}

/// The ids of every float entry of `module`.
pub(crate) fn ids_of<M: Module>(module: &M) -> HashSet<ParamId> {
    struct Ids(HashSet<ParamId>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.insert(param.id);
        }
    }
    let mut ids = Ids(HashSet::new());
    module.visit(&mut ids);
    ids.0
}

/// The plain (non-autodiff) device of a module's first tensor.
pub(crate) fn plain_device<M: Module>(model: &M) -> Result<Device, ShardError> {
    model
        .devices()
        .into_iter()
        .next()
        .map(Device::without_autodiff)
        .ok_or_else(|| ShardError::InvalidConfig("the model holds no tensor, so there is nothing to shard".into()))
}

/// Byte size of a tensor: elements × dtype size.
pub(crate) fn tensor_bytes<const D: usize>(t: &Tensor<D>) -> usize {
    t.shape().num_elements() * t.dtype().size()
}

struct SlotVisitor<'a> {
    layout: &'a FlatLayout,
    grads: Option<&'a mut GradientsParams>,
    out: SlotValues,
    path: Vec<String>,
    device: Option<Device>,
    error: Option<ShardError>,
}

impl<'a> SlotVisitor<'a> {
    fn new(layout: &'a FlatLayout, grads: Option<&'a mut GradientsParams>) -> Self {
        Self {
            layout,
            grads,
            out: vec![None; layout.slots().len()],
            path: Vec::new(),
            device: None,
            error: None,
        }
    }

    fn finish(self) -> Result<(SlotValues, Option<Device>), ShardError> {
        match self.error {
            Some(e) => Err(e),
            None => Ok((self.out, self.device)),
        }
    }
}

impl ModuleVisitor for SlotVisitor<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.error.is_some() {
            return;
        }
        let Some(i) = self.layout.slot_of(&param.id) else {
            // Frozen and empty parameters are outside the training layout; a trainable one
            // must be in it.
            if param.is_require_grad() && param.lazy_shape().num_elements() > 0 {
                self.error = Some(ShardError::UnknownParam {
                    path: self.path.join("."),
                    id: param.id.to_string(),
                });
            }
            return;
        };
        let slot = &self.layout.slots()[i];
        let value = param.val().inner();
        let dims = value.shape().to_vec();
        if self.grads.is_none() && dims != slot.shape {
            self.error = Some(ShardError::ShapeChanged {
                path: slot.path.clone(),
                expected: slot.shape.clone(),
                found: dims,
            });
            return;
        }
        if value.dtype() != slot.dtype {
            self.error = Some(ShardError::DTypeChanged {
                path: slot.path.clone(),
                expected: format!("{:?}", slot.dtype),
                found: format!("{:?}", value.dtype()),
            });
            return;
        }
        if self.device.is_none() {
            self.device = Some(value.device());
        }
        let flat = match self.grads.as_deref_mut() {
            Some(grads) => grads.remove::<D>(param.id),
            None => Some(value),
        };
        if let Some(t) = &flat
            && t.shape().num_elements() != slot.numel
        {
            self.error = Some(ShardError::ShapeChanged {
                path: slot.path.clone(),
                expected: slot.shape.clone(),
                found: t.shape().to_vec(),
            });
            return;
        }
        self.out[i] = flat.map(|t| t.inner().reshape([slot.numel]));
    }
}

struct ReplaceMapper {
    values: HashMap<ParamId, Tensor<1>>,
}

impl ModuleMapper for ReplaceMapper {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        match self.values.remove(&param.id) {
            Some(flat) => replace_value(param, flat),
            None => param,
        }
    }
}

/// `param` with the value `flat` (`[numel]`, reshaped and cast to the entry's shape and dtype):
/// a fresh leaf that keeps the entry's id, autodiff, require-grad and checkpointing settings. A
/// lazy entry takes it through Burn's `transform_for_load` (as a record load would), so its
/// initializer never runs; the value then goes to the entry's device and its load mapper, if
/// any, applies.
pub(crate) fn replace_value<const D: usize>(param: Param<Tensor<D>>, flat: Tensor<1>) -> Param<Tensor<D>> {
    if !param.is_initialized() {
        let value: Tensor<D> = flat.cast(lazy_dtype(&param.lazy_device())).reshape(param.lazy_shape());
        return load_lazy(param, value);
    }
    let (id, old, mapper) = param.consume();
    let mut value: Tensor<D> = flat.cast(old.dtype()).reshape(old.shape());
    if old.is_autodiff() {
        let strategy = old.gradient_checkpointing_strategy();
        value = value.autodiff();
        if let Some(s) = strategy {
            value = value.with_gradient_checkpointing_strategy(s);
        }
        if old.is_require_grad() {
            value = value.require_grad();
        }
    }
    Param::from_mapped_value(id, value, mapper)
}

/// A lazy `param` holding a stand-in of its value: one element, expanded (stride 0) to its
/// record shape, through its load mapper: an initialised parameter with the value's shape,
/// dtype, device, autodiff, require-grad and checkpointing settings, that costs no memory and
/// never ran its initializer. For stage 3 when the shard comes from a pretrained file: the
/// sharder reads those settings and keeps the shard. An initialised `param` is returned as is.
pub(crate) fn stand_in<const D: usize>(param: Param<Tensor<D>>) -> Param<Tensor<D>> {
    if param.is_initialized() {
        return param;
    }
    let device = param.lazy_device();
    let value = Tensor::<D>::zeros([1; D], (&device.clone().without_autodiff(), lazy_dtype(&device)))
        .expand(param.lazy_shape().dims::<D>());
    load_lazy(param, value)
}

/// A lazy `param` loaded with `value` (its record shape) through Burn's `transform_for_load`,
/// as a record load would: its initializer never runs, the value goes to the entry's device
/// and through its load mapper.
fn load_lazy<const D: usize>(param: Param<Tensor<D>>, mut value: Tensor<D>) -> Param<Tensor<D>> {
    let id = param.id;
    // As if made on the entry's device, as its initializer would: with that device's
    // autodiff and checkpointing strategy (moving a value keeps its own, so a plain value
    // would stay plain and `transform_for_load` could not make it require grad).
    if let Some(strategy) = param.lazy_device().gradient_checkpointing_strategy() {
        value = value.autodiff().with_gradient_checkpointing_strategy(strategy);
    }
    param.transform_for_load(value, id)
}
