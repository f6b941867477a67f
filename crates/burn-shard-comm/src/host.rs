//! [`HostBuffer`]: a flat float tensor copied to host `f32`, for the backends that move host
//! memory (in-process, MPI).

use burn::tensor::{DType, Device, Tensor, TensorData};

use crate::CommError;

/// Host copy of a flat float tensor, with what is needed to rebuild it: `values` in `f32`
/// whatever the tensor's float dtype (bf16 and f16 are widened exactly), the original `dtype`
/// and `device`.
pub(crate) struct HostBuffer {
    pub(crate) values: Vec<f32>,
    pub(crate) dtype: DType,
    pub(crate) device: Device,
}

impl HostBuffer {
    /// Copies `tensor` (shape `[len]`) to the host.
    ///
    /// # Errors
    /// [`CommError::UnsupportedDtype`] for a tensor that is not f32, bf16 or f16.
    pub(crate) fn read(tensor: Tensor<1>) -> Result<Self, CommError> {
        let dtype = tensor.dtype();
        if !matches!(dtype, DType::F32 | DType::Flex32 | DType::F16 | DType::BF16) {
            return Err(CommError::UnsupportedDtype(format!("{dtype:?}")));
        }
        let device = tensor.device();
        let values = tensor
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| CommError::UnsupportedDtype(format!("{dtype:?} ({e:?})")))?;
        Ok(Self { values, dtype, device })
    }

    /// A `[values.len()]` tensor of `dtype` on `device` (rounded to nearest from `f32`).
    pub(crate) fn into_tensor(values: Vec<f32>, dtype: DType, device: &Device) -> Tensor<1> {
        let len = values.len();
        Tensor::from_data(TensorData::new(values, [len]), (device, dtype))
    }
}
