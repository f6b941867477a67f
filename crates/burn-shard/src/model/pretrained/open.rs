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
