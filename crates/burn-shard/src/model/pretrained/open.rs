//! Opening a pretrained file as burn-store tensors whose bytes are windows of the file
//! (Burn's `Bytes::from_file`): nothing but the header is read here, and a window reads only
//! its own range when accessed, so a sub-window (`Bytes::view`) of a tensor reads one shard.

use std::fs::File;
use std::path::Path;

use burn::tensor::{Bytes, DType};
use burn_pack::Tensor as PackTensor;
use safetensors::{Dtype, SafeTensors};

use crate::error::ShardError;

/// Tensors of a file whose dtype Burn has no type for: (name, reason).
pub(super) type Unreadable = Vec<(String, String)>;

/// A safetensors file's tensors, and those of a dtype Burn has no type for.
pub(super) fn safetensors(path: &Path) -> Result<(Vec<PackTensor>, Unreadable), ShardError> {
    let unreadable = |reason: String| ShardError::PretrainedRead {
        origin: path.display().to_string(),
        reason,
    };
    let file = File::open(path).map_err(|e| unreadable(format!("{e}")))?;
    // SAFETY: the map is read while the header is parsed and dropped before this returns; a
    // file changed meanwhile gives a parse error, never undefined behaviour in safe code
    // reading the copied metadata.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| unreadable(format!("{e}")))?;
    let (header_len, metadata) =
        SafeTensors::read_metadata(&map).map_err(|e| unreadable(format!("not a safetensors file: {e}")))?;
    let data_start = 8 + header_len as u64;
    let mut tensors = Vec::new();
    let mut others = Vec::new();
    let mut infos: Vec<_> = metadata.tensors().into_iter().collect();
    infos.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, info) in infos {
        let Some(dtype) = burn_dtype(info.dtype) else {
            others.push((name, format!("dtype {:?} has no Burn type", info.dtype)));
            continue;
        };
        let (start, end) = info.data_offsets;
        let bytes = Bytes::from_file(path, (end - start) as u64, data_start + start as u64);
        tensors.push(PackTensor::new(name, dtype, info.shape.clone(), None, bytes));
    }
    Ok((tensors, others))
}

/// A burnpack file's tensors (burn-pack's reader keeps them as file windows).
pub(super) fn burnpack(path: &Path) -> Result<Vec<PackTensor>, ShardError> {
    let unreadable = |reason: String| ShardError::PretrainedRead {
        origin: path.display().to_string(),
        reason,
    };
    burn_pack::Reader::from_file(path)
        .and_then(|reader| reader.into_tensors())
        .map_err(|e| unreadable(format!("not a burnpack file: {e}")))
}

fn burn_dtype(dtype: Dtype) -> Option<DType> {
    Some(match dtype {
        Dtype::F64 => DType::F64,
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::I32 => DType::I32,
        Dtype::I16 => DType::I16,
        Dtype::I8 => DType::I8,
        Dtype::U64 => DType::U64,
        Dtype::U32 => DType::U32,
        Dtype::U16 => DType::U16,
        Dtype::U8 => DType::U8,
        _ => return None,
    })
}
