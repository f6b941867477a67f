//! A collective's tensors as NCCL gets them: [`Item`] (a tensor and its output length),
//! [`Buffer`] (checked, dense, on this GPU), [`Launch`] (what one NCCL call gets, with the
//! invariants its `unsafe` calls rely on), and the conversions to NCCL's types and raw pointers.

use std::ffi::c_void;

use burn::tensor::{DType, Tensor};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use cudarc::nccl::sys as ncclsys;

use crate::{CommError, ReduceOp};

/// The CUDA server type of CubeCL (not nameable otherwise).
type CudaServer = <CudaRuntime as Runtime>::Server;

/// One tensor of a collective: its input, its output length and the elements this rank sends.
pub(super) struct Item {
    pub(super) input: Tensor<1>,
    pub(super) out_len: usize,
    pub(super) sent_elems: usize,
}

/// An item once checked: dense input on this GPU, fresh output.
pub(super) struct Buffer {
    pub(super) src: CubeTensor,
    pub(super) dst: CubeTensor,
    pub(super) dtype: ncclsys::ncclDataType_t,
    /// Bytes per element of `dtype` (`DType::size`, which equals the NCCL type's size).
    pub(super) elem_bytes: usize,
    /// Elements of `src`.
    pub(super) in_len: usize,
    /// Elements of `dst`.
    pub(super) out_len: usize,
    pub(super) sent_bytes: u64,
}

/// What one NCCL call of a collective gets. [`NcclComm::run_group`] guarantees, for as long as
/// the call and the GPU work it enqueues run:
/// - `src` is the device address of a dense buffer of at least the item's input length
///   (`tensor.dims()[0]`) elements of `dtype`, and `dst` of at least its `out_len` elements; both
///   on this communicator's GPU, in the primary context NCCL uses; distinct (`dst` is a fresh
///   allocation); checked against the allocation's size;
/// - both allocations are pinned (CubeCL neither frees, reuses nor moves them) until the stream
///   is seen drained, or forever when it is not; CubeCL's queued writes to `src` are complete
///   and nothing else writes to either while NCCL runs (this call holds the tensors);
/// - `comm` is live (not aborted or destroyed) and the calling thread holds its lock, from the
///   group's start to its end;
/// - `stream` is this communicator's stream, alive while the lock is held.
///
/// Counts given to NCCL are in elements of `dtype`, not bytes.
///
/// [`NcclComm::run_group`]: super::comm::NcclComm::run_group
pub(super) struct Launch {
    /// The item's index in the call's list.
    pub(super) index: usize,
    pub(super) src: *const c_void,
    pub(super) dst: *mut c_void,
    pub(super) dtype: ncclsys::ncclDataType_t,
    pub(super) comm: ncclsys::ncclComm_t,
    pub(super) stream: ncclsys::cudaStream_t,
}

/// The NCCL type of a float dtype: same element size and encoding (IEEE binary32, binary16,
/// bfloat16).
pub(super) fn nccl_dtype(dtype: DType) -> Result<ncclsys::ncclDataType_t, CommError> {
    match dtype {
        DType::F32 => Ok(ncclsys::ncclDataType_t::ncclFloat32),
        DType::F16 => Ok(ncclsys::ncclDataType_t::ncclFloat16),
        DType::BF16 => Ok(ncclsys::ncclDataType_t::ncclBfloat16),
        other => Err(CommError::UnsupportedDtype(format!("{other:?}"))),
    }
}

pub(super) fn cube(t: Tensor<1>) -> Result<CubeTensor, CommError> {
    // With Burn's `fusion` on, this submits what the fusion stream queued up to `t` first.
    burn_shard_cube::into_cube(t.inner()).ok_or_else(|| {
        CommError::Backend("NCCL collectives take tensors on a CUDA device (Device::cuda(i))".to_string())
    })
}

/// Raw device address (offset included) and the guard that pins the allocation, checked to span
/// at least `bytes` bytes.
pub(super) fn device_ptr(t: &CubeTensor, bytes: usize) -> Result<(u64, impl Sized + use<>), CommError> {
    let res = t
        .client
        .get_resource::<CudaServer>(t.handle.clone())
        .map_err(|e| CommError::Backend(format!("tensor is not a CUDA buffer: {e:?}")))?;
    let size = res.resource().size;
    if size < bytes as u64 {
        return Err(CommError::Backend(format!(
            "internal error: a collective needs {bytes} bytes but the tensor's buffer has {size}"
        )));
    }
    Ok((res.resource().ptr, res))
}

pub(super) fn nccl_op(op: ReduceOp) -> ncclsys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => ncclsys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => ncclsys::ncclRedOp_t::ncclAvg,
    }
}
