//! A float entry's shape, dtype and whether it requires grad, read without running its
//! lazy initializer.
//!
//! Every `burn::nn` parameter is built lazily (`Param::uninitialized`: `Initializer::init_with`
//! wraps the random init in a closure that runs on the first `val()`). `ShardConfig::init` must
//! know the model's layout before any parameter exists, so that at stage 3 a rank never holds
//! more than its shards and the one parameter being sharded (`model/root_values.rs`). What
//! Burn 0.22.1 gives without initialising: `lazy_shape()` and `lazy_device()`. What it does not
//! give, and is read here instead:
//! - the dtype: an initializer makes the device's default float dtype
//!   (`Device::settings().float_dtype`, what `Tensor::random` and `Tensor::zeros` use);
//!   `RootValues` checks the value rank 0 materialises against it and names the fix when a
//!   user's own initializer made another;
//! - whether it requires grad, and the shape of the value (which differs from the lazy shape
//!   where a load mapper transposes, as `LinearLayout::Col` does): `Param::lazy_is_require_grad`
//!   is crate-private, so both are read through `Param::transform_for_load`, Burn's own route for
//!   loading a record into a lazy parameter, on a stand-in of the lazy shape expanded from one
//!   element (no memory; the entry's load mapper runs on it; the shared lazy state is not
//!   touched).
//!
//! Deref-ing a `Param` (`param.dtype()`, `param.is_require_grad()`, `param.shape()`) runs the
//! initializer: code that runs before `init` has sharded the model reads entries here.

use burn::module::Param;
use burn::tensor::{DType, Device, Tensor};

/// What `init` needs of a float entry before its value exists.
#[derive(Clone, Debug)]
pub(crate) struct EntryMeta {
    /// The full shape of the value.
    pub(crate) shape: Vec<usize>,
    /// The shape of its record (`lazy_shape`, before the load mapper).
    pub(crate) record_shape: Vec<usize>,
    /// Whether it has a load mapper.
    pub(crate) has_load_mapper: bool,
    /// The dtype: the value's, or for a lazy entry the dtype its initializer will make.
    pub(crate) dtype: DType,
    /// Whether the value requires grad (false on a device without autodiff).
    pub(crate) require_grad: bool,
}

/// `param`'s metadata; never runs its initializer.
pub(crate) fn entry_meta<const D: usize>(param: &Param<Tensor<D>>) -> EntryMeta {
    let shape = param.lazy_shape().to_vec();
    let has_load_mapper = has_load_mapper(param);
    if param.is_initialized() {
        // The stored base (a reparameterization, if any, is not applied).
        let value: &Tensor<D> = param;
        return EntryMeta {
            // Only a save mapper (which comes with a load mapper) changes it.
            record_shape: match has_load_mapper {
                true => param.transform_for_save().base().shape().to_vec(),
                false => shape.clone(),
            },
            has_load_mapper,
            shape,
            dtype: value.dtype(),
            require_grad: value.is_require_grad(),
        };
    }
    let device = param.lazy_device();
    // A stand-in of the lazy (record) shape, expanded from one element, on the entry's own
    // device (autodiff included: `transform_for_load` sets require-grad only on a tensor that
    // has autodiff), through the entry's load mapper: the shape and require-grad the value
    // will have (a `Linear` with `LinearLayout::Col` holds its weight transposed).
    let stand_in = Tensor::<D>::zeros([1; D], &device).expand(param.lazy_shape().dims::<D>());
    let loaded = param.clone().transform_for_load(stand_in, param.id).base();
    EntryMeta {
        shape: loaded.shape().to_vec(),
        record_shape: shape,
        has_load_mapper,
        dtype: lazy_dtype(&device),
        require_grad: loaded.is_require_grad(),
    }
}

/// The dtype a lazy float entry on `device` is initialised with: the device's default float
/// dtype.
pub(crate) fn lazy_dtype(device: &Device) -> DType {
    device.settings().float_dtype.into()
}

/// Whether `param` has a load mapper. Burn 0.22.1 keeps `ParamMapper`'s fields private; its
/// `Debug` (which `Param`'s prints, without initialising) is `ParamMapper { load: <bool>, .. }`.
/// A change of that text makes this say `true`, which only costs a pretrained load its byte
/// ranges (the whole tensor is read), never a wrong value (`tests/suite/pretrained.rs`'s
/// `LinearLayout::Col` case fails if it ever says `false` for a mapped entry).
pub(crate) fn has_load_mapper<const D: usize>(param: &Param<Tensor<D>>) -> bool {
    !format!("{param:?}").contains("load: false")
}
