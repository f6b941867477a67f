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
//! - [`into_cube`] hands out the raw tensor. With fusion it first drains the fusion stream the
//!   tensor lives on (`resolve_tensor_float`: the queued operations are submitted to the device;
//!   nothing waits for the device to finish).
//! - [`from_cube`] turns a raw tensor back into a Burn tensor. With fusion it registers the
//!   buffer's handle with the fusion server and records an init operation on the calling
//!   thread's stream, the route `Fusion::float_from_data` takes, so later operations are ordered
//!   after it.
//!
//! A buffer handed out by [`into_cube`] is written in place only where nothing else holds it
//! (`CubeTensor::can_mut`): with fusion, a tensor that other fusion tensors still share comes
//! out as a second handle of the same buffer, so `can_mut` is false and writers copy first.

use std::any::TypeId;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, BackendTypes};
use burn::tensor::{Device, Tensor};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{Cube, CubeBackend, CubeDevice};
use burn_fusion::stream::StreamId;
use burn_fusion::{Fusion, FusionBackend, NoOp, get_client};
use burn_ir::{InitOperationIr, OperationIr, OperationOutput};

/// A backend whose float tensors convert to and from raw [`CubeTensor`]s: `CubeBackend`, and
/// `Fusion<CubeBackend>` (whichever [`burn_cubecl::Cube`] is in this build).
pub trait CubePrimitive: Backend {
    /// The raw tensor behind `tensor` (see [`into_cube`]).
    fn into_raw(tensor: FloatTensor<Self>) -> CubeTensor;
    /// `tensor` as this backend's float primitive (see [`from_cube`]).
    fn from_raw(tensor: CubeTensor) -> FloatTensor<Self>;
}

impl CubePrimitive for CubeBackend {
    fn into_raw(tensor: CubeTensor) -> CubeTensor {
        tensor
    }

    fn from_raw(tensor: CubeTensor) -> CubeTensor {
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
    fn into_raw(tensor: FloatTensor<Self>) -> CubeTensor {
        tensor.client.clone().resolve_tensor_float::<B>(tensor)
    }

    fn from_raw(tensor: CubeTensor) -> FloatTensor<Self> {
        let client = get_client::<B>(&tensor.device.clone().into());
        let (shape, dtype) = (tensor.meta.shape().clone(), tensor.dtype);
        let handle = B::float_tensor_handle(tensor);
        let desc = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
        client
            .register(StreamId::current(), OperationIr::Init(desc), NoOp::<B>::new())
            .output()
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
/// not a plain float tensor of the CubeCL backend. With fusion, the fusion stream the tensor
/// lives on is drained first (its queued operations submitted), so the buffer holds its value.
pub fn into_cube<const D: usize>(tensor: Tensor<D>) -> Option<CubeTensor> {
    if !is_cube(&tensor) {
        return None;
    }
    let primitive = tensor.try_into_primitive::<Cube>().ok()?;
    Some(<Cube as CubePrimitive>::into_raw(primitive))
}

/// `tensor` as a Burn tensor of rank `D` on its CubeCL device.
///
/// # Panics
/// When `tensor`'s rank is not `D`.
pub fn from_cube<const D: usize>(tensor: CubeTensor) -> Tensor<D> {
    assert_eq!(tensor.meta.shape().num_dims(), D, "from_cube: rank of the raw tensor");
    Tensor::<D>::from_primitive::<Cube>(<Cube as CubePrimitive>::from_raw(tensor))
}

/// The CubeCL device behind a Burn device, or `None` for another backend.
pub fn cube_device(device: &Device) -> Option<CubeDevice> {
    match device.as_dispatch() {
        burn::backend::DispatchDevice::Cube(d) => Some(d.clone()),
        _ => None,
    }
}
