//! One ordinary Burn record from a sharded checkpoint.

use std::path::Path;

use burn_pack::{Reader, Writer};

use super::CheckpointError;
use super::files::{RankFiles, rank_file};
use super::meta::{CheckpointMeta, EntryMeta, parse_dtype};

/// What [`consolidate`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConsolidateReport {
    /// Entries (parameters and buffers) in the record.
    pub entries: usize,
    /// Elements over all entries.
    pub elements: usize,
}

/// Writes the model of the checkpoint in `dir` as one ordinary Burn record at `out` (burnpack,
/// as `Module::save_file` writes it: every entry at full shape under its module path, with its
/// `ParamId`), which the unsharded model loads with `load_file` / `load_record`. No model type
/// is needed, and no collective: run it anywhere the checkpoint is readable.
///
/// Streamed: the rank files are verified against their digests first, then each entry is read
/// from the pieces that hold it while it is written, so memory holds about one entry at a time.
/// The write is atomic (a temporary file renamed to `out`).
///
/// # Errors
/// As [`ShardedOptimizer::load_checkpoint`](crate::ShardedOptimizer::load_checkpoint) for a
/// bad checkpoint; [`CheckpointError::Io`] when `out` cannot be written.
pub fn consolidate(dir: impl AsRef<Path>, out: impl AsRef<Path>) -> Result<ConsolidateReport, CheckpointError> {
    let (dir, out) = (dir.as_ref(), out.as_ref());
    let meta = CheckpointMeta::read(dir)?;
    // Verify every file once, up front: a bad file fails before `out` is touched.
    let mut files = RankFiles::new(dir, &meta);
    for rank in 0..meta.world_size {
        files.tensors_under(rank, "")?;
    }
    drop(files);
    let mut tensors = Vec::with_capacity(meta.entries.len());
    for entry in &meta.entries {
        let dtype = parse_dtype(&entry.dtype).ok_or_else(|| CheckpointError::Corrupt {
            file: dir.join(super::META),
            reason: format!("unknown dtype {} for `{}`", entry.dtype, entry.path),
        })?;
        let byte_len = entry.numel() * dtype.size();
        let (dir, entry_owned) = (dir.to_path_buf(), entry.clone());
        tensors.push(burn_pack::Tensor::deferred(
            entry.path.clone(),
            dtype,
            entry.shape.clone(),
            Some(entry.id),
            byte_len,
            move || read_whole(&dir, &entry_owned).map_err(|e| burn_pack::Error::ValidationError(e.to_string())),
        ));
    }
    Writer::new(tensors)
        .auto_extension(false)
        .overwrite(true)
        .write_to_file(out)
        .map_err(|e| CheckpointError::io(out, e))?;
    Ok(ConsolidateReport {
        entries: meta.entries.len(),
        elements: meta.entries.iter().map(EntryMeta::numel).sum(),
    })
}

/// Every element of `entry`, from its pieces (files already verified).
fn read_whole(dir: &Path, entry: &EntryMeta) -> Result<burn::tensor::Bytes, CheckpointError> {
    let mut bytes = Vec::new();
    for piece in &entry.pieces {
        let path = dir.join(rank_file(piece.rank));
        let corrupt = |e: burn_pack::Error| CheckpointError::Corrupt {
            file: path.clone(),
            reason: e.to_string(),
        };
        let name = format!("param/{}", entry.path);
        let tensor = Reader::from_file_exact(&path)
            .and_then(Reader::into_tensors)
            .map_err(corrupt)?
            .into_iter()
            .find(|t| t.name == name)
            .ok_or_else(|| CheckpointError::Corrupt {
                file: path.clone(),
                reason: format!("no tensor {name}"),
            })?;
        bytes.extend_from_slice(&tensor.to_bytes().map_err(corrupt)?);
    }
    let len = bytes.len();
    Ok(burn::tensor::TensorData::from_bytes_vec(bytes, [len], burn::tensor::DType::U8).into_bytes())
}
