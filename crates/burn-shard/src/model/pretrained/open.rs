//! Opening a pretrained file as burn-store tensors whose bytes are windows of the file
//! (Burn's `Bytes::from_file`): nothing but the header is read here, and a window reads only
//! its own range when accessed, so a sub-window (`Bytes::view`) of a tensor reads one shard.

use std::fs::File;
use std::path::Path;

use burn::tensor::{Bytes, DType};
use burn_pack::Tensor as PackTensor;
use safetensors::Dtype;
use safetensors::tensor::TensorInfo;

use crate::error::ShardError;

/// Tensors of a file whose dtype Burn has no type for: (name, reason).
pub(super) type Unreadable = Vec<(String, String)>;

/// The index a checkpoint split over several safetensors files ships with (Hugging Face's
/// `model.safetensors.index.json`): which file holds each tensor.
#[derive(serde::Deserialize)]
struct SplitIndex {
    weight_map: std::collections::BTreeMap<String, String>,
}

/// What the name of a split checkpoint's index ends with.
const INDEX_SUFFIX: &str = ".safetensors.index.json";

/// The tensors of a safetensors checkpoint given as one file, as the index of a split one
/// (`*.safetensors.index.json`), or as the directory holding either (its
/// `model.safetensors.index.json` or `model.safetensors`, else its only index or only
/// safetensors file), and those of a dtype Burn has no type for. Only headers are read: a rank
/// reads tensor bytes later, and only from the files that hold its ranges.
pub(super) fn safetensors_any(path: &Path) -> Result<(Vec<PackTensor>, Unreadable), ShardError> {
    let origin = || path.display().to_string();
    if path.is_dir() {
        return safetensors_any(&in_directory(path)?);
    }
    if path.to_string_lossy().ends_with(".json") {
        return split(path);
    }
    safetensors(path).map_err(|e| match e {
        ShardError::PretrainedRead { reason, .. } => ShardError::PretrainedRead {
            origin: origin(),
            reason: format!(
                "{reason} (expected a .safetensors file, the {INDEX_SUFFIX} of a checkpoint split over several \
                 files, or the directory that holds them)"
            ),
        },
        other => other,
    })
}

/// The file to open in the directory `dir`: `model.safetensors.index.json`, `model.safetensors`,
/// or its only index or only safetensors file.
fn in_directory(dir: &Path) -> Result<std::path::PathBuf, ShardError> {
    let unreadable = |reason: String| ShardError::PretrainedRead {
        origin: dir.display().to_string(),
        reason,
    };
    for name in ["model.safetensors.index.json", "model.safetensors"] {
        if dir.join(name).is_file() {
            return Ok(dir.join(name));
        }
    }
    let names: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| unreadable(format!("{e}")))?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let indexes: Vec<&String> = names.iter().filter(|n| n.ends_with(INDEX_SUFFIX)).collect();
    let files: Vec<&String> = names.iter().filter(|n| n.ends_with(".safetensors")).collect();
    match (indexes.as_slice(), files.as_slice()) {
        ([index], _) => Ok(dir.join(index)),
        ([], [file]) => Ok(dir.join(file)),
        (indexes, files) => Err(unreadable(format!(
            "a directory with {} safetensors index files and {} safetensors files, and neither \
             model.safetensors.index.json nor model.safetensors; pass the file or the index to load",
            indexes.len(),
            files.len()
        ))),
    }
}

/// The tensors of a checkpoint split over several safetensors files, from its index: each
/// file named by the index is opened for its header, and each tensor is taken from the file the
/// index names for it (a window of that file).
fn split(index: &Path) -> Result<(Vec<PackTensor>, Unreadable), ShardError> {
    let unreadable = |reason: String| ShardError::PretrainedRead {
        origin: index.display().to_string(),
        reason,
    };
    let text = std::fs::read_to_string(index).map_err(|e| unreadable(format!("{e}")))?;
    let parsed: SplitIndex = serde_json::from_str(&text).map_err(|e| {
        unreadable(format!(
            "not a safetensors index (a JSON object with a `weight_map`): {e}"
        ))
    })?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut by_file: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
    for (tensor, file) in &parsed.weight_map {
        by_file.entry(file.as_str()).or_default().push(tensor.as_str());
    }
    let (mut tensors, mut others) = (Vec::new(), Vec::new());
    for (file, names) in by_file {
        // An index names files beside it: a path that leaves its directory is not one.
        let plain = Path::new(file)
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
        if !plain || !file.ends_with(".safetensors") {
            return Err(unreadable(format!(
                "the index names `{file}` for tensor `{}`; expected the name of a .safetensors file beside the \
                 index (PyTorch .bin checkpoints are not read: convert them to safetensors)",
                names[0]
            )));
        }
        let path = dir.join(file);
        if !path.is_file() {
            return Err(unreadable(format!(
                "the index names `{file}` for {} tensors (`{}`, ...), and {} is not a file",
                names.len(),
                names[0],
                path.display()
            )));
        }
        let (in_file, unknown) = safetensors(&path)?;
        let wanted: std::collections::HashSet<&str> = names.iter().copied().collect();
        let held: std::collections::HashSet<String> = in_file
            .iter()
            .map(|t| t.name.clone())
            .chain(unknown.iter().map(|u| u.0.clone()))
            .collect();
        if let Some(absent) = names.iter().find(|n| !held.contains(**n)) {
            return Err(unreadable(format!(
                "the index puts tensor `{absent}` in `{file}`, which does not hold it; the index and the files \
                 are of different checkpoints"
            )));
        }
        // A tensor the index places in another file is that file's.
        tensors.extend(in_file.into_iter().filter(|t| wanted.contains(t.name.as_str())));
        others.extend(unknown.into_iter().filter(|u| wanted.contains(u.0.as_str())));
    }
    Ok((tensors, others))
}

/// The largest safetensors header read (the format's own limit, in bytes).
const MAX_HEADER: u64 = 100_000_000;

/// A safetensors file's tensors, and those of a dtype Burn has no type for.
///
/// The header is read with plain reads (no memory map: a file truncated while mapped would kill
/// the process on access) and checked against the file's length: every tensor's bytes, as its
/// dtype and shape make them, must lie inside the file. A file shorter than its header says
/// (truncated, or still being copied) is an error naming both lengths here, before any rank
/// reads a byte of a tensor.
pub(super) fn safetensors(path: &Path) -> Result<(Vec<PackTensor>, Unreadable), ShardError> {
    use std::io::Read;
    let unreadable = |reason: String| ShardError::PretrainedRead {
        origin: path.display().to_string(),
        reason,
    };
    let mut file = File::open(path).map_err(|e| unreadable(format!("{e}")))?;
    let file_len = file.metadata().map_err(|e| unreadable(format!("{e}")))?.len();
    let not_safetensors = |why: String| unreadable(format!("not a safetensors file: {why}"));
    let mut len_bytes = [0u8; 8];
    file.read_exact(&mut len_bytes)
        .map_err(|_| not_safetensors(format!("{file_len} bytes, shorter than the 8-byte header length")))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER || 8 + header_len > file_len {
        return Err(not_safetensors(format!(
            "its header length says {header_len} bytes, and the file holds {file_len} (at most {MAX_HEADER})"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(|e| unreadable(format!("{e}")))?;
    let entries: std::collections::BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| not_safetensors(format!("its header is not JSON: {e}")))?;
    let data_start = 8 + header_len;
    let data_len = file_len - data_start;
    let mut tensors = Vec::new();
    let mut others = Vec::new();
    for (name, value) in entries {
        if name == "__metadata__" {
            continue;
        }
        let info: TensorInfo = serde_json::from_value(value)
            .map_err(|e| not_safetensors(format!("tensor `{name}` in its header: {e}")))?;
        let (start, end) = (info.data_offsets.0 as u64, info.data_offsets.1 as u64);
        // Checked: a header is untrusted input, and its shape may not fit 64 bits.
        let bits = info
            .shape
            .iter()
            .try_fold(info.dtype.bitsize() as u64, |bits, &d| bits.checked_mul(d as u64));
        let bytes = bits.map(|b| b.div_ceil(8));
        if end < start || Some(end - start) != bytes {
            return Err(not_safetensors(format!(
                "tensor `{name}` spans bytes {start}..{end}, and its shape {:?} of {:?} takes {}",
                info.shape,
                info.dtype,
                bytes.map_or("more than 2^64 bits".to_string(), |b| b.to_string())
            )));
        }
        if end > data_len {
            return Err(unreadable(format!(
                "tensor `{name}` ends at byte {} and the file holds {file_len}: the file is truncated (or still \
                 being written); copy it again",
                data_start + end
            )));
        }
        let Some(dtype) = burn_dtype(info.dtype) else {
            others.push((name, format!("dtype {:?} has no Burn type", info.dtype)));
            continue;
        };
        let window = Bytes::from_file(path, end - start, data_start + start);
        tensors.push(PackTensor::new(name, dtype, info.shape, None, window));
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
