//! Raw CubeCL tensors of Burn tensors, with Burn's `fusion` feature on or off.
//!
//! burn-shard's fused Adam kernel and its NCCL collectives work on raw [`CubeTensor`]s (a
//! device buffer, its layout and its compute client). Which type a CubeCL device's tensors have
//! depends on the build: Burn's default features (what GPU users build with) turn on `fusion`,
//! and then every CubeCL device runs `Fusion<CubeBackend>`, whose tensors are lazy handles;
//! without `fusion` it runs `CubeBackend` itself. Cargo unifies features across the whole build,
//! so this crate cannot choose: it follows [`burn_cubecl::Cube`], the type Burn's dispatch uses,
//! and implements [`CubePrimitive`] for both possibilities.
//!
//! - [`into_cube`] hands out the raw tensor. With fusion it first runs what the fusion stream of
//!   the calling thread has queued up to this tensor (`resolve_tensor_float`: the operations are
//!   submitted to the device, nothing waits for the device to finish).
//! - [`from_cube`] turns a raw tensor back into a Burn tensor. With fusion it registers a
//!   deferred operation that publishes the buffer on the fusion stream, so later operations are
//!   ordered after it (Burn 0.22.1 has no public constructor of a fusion tensor; this is the
//!   route its own backend extensions take, `burn_fusion::custom`).

use std::any::TypeId;
use std::sync::Mutex;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, BackendTypes};
use burn::tensor::{Device, Tensor};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{Cube, CubeBackend, CubeDevice};
use burn_fusion::custom::{CustomOpIr, OperationFn, OperationIr, StreamId, TensorIr};
use burn_fusion::{ExecutionError, Fusion, FusionBackend, get_client};

/// A backend whose float tensors convert to and from raw [`CubeTensor`]s: `CubeBackend`, and
/// `Fusion<CubeBackend>` (whichever [`burn_cubecl::Cube`] is in this build).
pub trait CubePrimitive: Backend {
    /// The raw tensor behind `tensor` (see [`into_cube`]).
    fn into_base(tensor: FloatTensor<Self>) -> CubeTensor;
    /// `tensor` as this backend's float primitive (see [`from_cube`]).
    fn from_base(tensor: CubeTensor) -> FloatTensor<Self>;
}

impl CubePrimitive for CubeBackend {
    fn into_base(tensor: CubeTensor) -> CubeTensor {
        tensor
    }

    fn from_base(tensor: CubeTensor) -> CubeTensor {
        tensor
    }
}

/// Generic over `B` so that it compiles whether or not `CubeBackend` is a `FusionBackend` in
/// this build (it is only with burn-cubecl's `fusion` feature).
impl<B> CubePrimitive for Fusion<B>
where
    B: FusionBackend + BackendTypes<FloatTensorPrimitive = CubeTensor>,
    CubeDevice: Into<<B as BackendTypes>::Device>,
{
    fn into_base(tensor: FloatTensor<Self>) -> CubeTensor {
        tensor.client.clone().resolve_tensor_float::<B>(tensor)
    }

    fn from_base(tensor: CubeTensor) -> FloatTensor<Self> {
        let client = get_client::<B>(&tensor.device.clone().into());
        let id = client.create_empty_handle();
        let output = TensorIr::uninit(id, tensor.meta.shape().clone(), tensor.dtype);
        let desc = CustomOpIr {
            id: "burn_shard_from_cube".into(),
            inputs: Vec::new(),
            outputs: vec![output],
            scalars: Vec::new(),
        };
        // The operation runs once, on the fusion server; it hands over the buffer it holds.
        let held = Mutex::new(Some(tensor));
        let publish = OperationFn(move |handles: &mut burn_fusion::custom::HandleContainer<_>| {
            let tensor = held
                .lock()
                .map_err(|_| ExecutionError::generic("burn-shard: a raw CubeCL tensor's lock was poisoned"))?
                .take()
                .ok_or_else(|| ExecutionError::generic("burn-shard: a raw CubeCL tensor was published twice"))?;
            handles.register_float_tensor::<B>(&id, tensor);
            Ok(())
        });
        client
            .register(StreamId::current(), OperationIr::Custom(desc), publish)
            .pop()
            .expect("one output registered")
    }
}

/// Whether Burn's `fusion` wraps the CubeCL backend in this build (Burn's default features turn
/// it on).
pub fn fusion_on() -> bool {
    TypeId::of::<Cube>() != TypeId::of::<CubeBackend>()
}

/// Whether `tensor` is a plain (not autodiff) float tensor of the CubeCL backend: CUDA, wgpu or
/// CubeCL's CPU runtime, fusion on or off.
pub fn is_cube<const D: usize>(tensor: &Tensor<D>) -> bool {
    !tensor.is_autodiff() && matches!(tensor.device().as_dispatch(), burn::backend::DispatchDevice::Cube(_))
}

/// The raw CubeCL tensor behind `tensor` (any shape; the layout is kept), or `None` when it is
/// not a plain float tensor of the CubeCL backend. With fusion, the operations queued on this
/// thread's fusion stream are submitted first so the buffer holds its value.
pub fn into_cube<const D: usize>(tensor: Tensor<D>) -> Option<CubeTensor> {
    if !is_cube(&tensor) {
        return None;
    }
    let primitive = tensor.try_into_primitive::<Cube>().ok()?;
    Some(<Cube as CubePrimitive>::into_base(primitive))
}

/// `tensor` as a Burn tensor of rank `D` on its CubeCL device.
///
/// # Panics
/// When `tensor`'s rank is not `D`.
pub fn from_cube<const D: usize>(tensor: CubeTensor) -> Tensor<D> {
    assert_eq!(tensor.meta.shape().num_dims(), D, "from_cube: rank of the raw tensor");
    Tensor::<D>::from_primitive::<Cube>(<Cube as CubePrimitive>::from_base(tensor))
}

/// The CubeCL device behind a Burn device, or `None` for another backend.
pub fn cube_device(device: &Device) -> Option<CubeDevice> {
    match device.as_dispatch() {
        burn::backend::DispatchDevice::Cube(d) => Some(d.clone()),
        _ => None,
    }
}
