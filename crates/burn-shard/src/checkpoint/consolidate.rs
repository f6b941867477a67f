//! One ordinary Burn record from a sharded checkpoint.

use std::path::Path;

use burn_pack::Writer;

use super::files::RankFiles;
use super::format::{META, param_name, state_name, state_prefix};
use super::frozen::refuse_unheld;
use super::meta::{CheckpointMeta, EntryMeta, parse_dtype};
use crate::error::CheckpointError;

/// What to do when the whole model is asked of a checkpoint that refers to its frozen base.
const NEEDS_BASE: &str = "consolidate the trained entries alone (Selection::Trainable, `ckpt consolidate \
     --trainable-only`), or load the base and this checkpoint into the model (init_pretrained, load_checkpoint) and \
     save the model";

/// What [`consolidate`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConsolidateReport {
    /// Entries (parameters and buffers) in the record.
    pub entries: usize,
    /// Elements over all entries.
    pub elements: usize,
}

impl ConsolidateReport {
    fn of(entries: &[EntryMeta]) -> Self {
        Self {
            entries: entries.len(),
            elements: entries.iter().map(EntryMeta::numel).sum(),
        }
    }
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
/// bad checkpoint; [`CheckpointError::Io`] when `out` cannot be written;
/// [`CheckpointError::BaseNotSaved`] for a checkpoint that holds its frozen base by fingerprint
/// alone ([`FrozenEntries::Fingerprinted`](crate::FrozenEntries::Fingerprinted)): consolidate
/// its trained entries with [`Selection::Trainable`].
pub fn consolidate(dir: impl AsRef<Path>, out: impl AsRef<Path>) -> Result<ConsolidateReport, CheckpointError> {
    consolidate_selected(dir, out, Selection::All)
}

/// Which entries of a checkpoint a consolidated file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selection {
    /// Every float entry: parameters, frozen ones and buffers (the whole model).
    All,
    /// Only the entries the optimizer trained, under their module paths: a LoRA or head-only
    /// fine-tune's adapters without its frozen base (at every stage; at stage 3 the adapters
    /// themselves, where `materialize()` would merge them into the base). Load them over the
    /// base (burn-store's `load_from` with `allow_partial(true)`, or `init_pretrained` with
    /// `allow_missing`).
    Trainable,
}

impl Selection {
    fn keeps(self, entry: &EntryMeta) -> bool {
        self == Selection::All || entry.trainable
    }
}

/// [`consolidate`] of the entries `selection` keeps.
///
/// # Errors
/// As [`consolidate`].
pub fn consolidate_selected(
    dir: impl AsRef<Path>,
    out: impl AsRef<Path>,
    selection: Selection,
) -> Result<ConsolidateReport, CheckpointError> {
    let (dir, out) = (dir.as_ref(), out.as_ref());
    let mut meta = CheckpointMeta::read(dir)?;
    meta.entries.retain(|e| selection.keeps(e));
    refuse_unheld(dir, &meta, &meta.entries, NEEDS_BASE)?;
    // Verify every file once, up front: a bad file fails before `out` is touched.
    let mut files = RankFiles::new(dir, &meta);
    for rank in 0..meta.world_size {
        files.tensors_under(rank, "")?;
    }
    drop(files);
    let shared = std::sync::Arc::new(meta.clone());
    let mut tensors = Vec::with_capacity(meta.entries.len());
    for (index, entry) in meta.entries.iter().enumerate() {
        let dtype = parse_dtype(&entry.dtype).ok_or_else(|| CheckpointError::Corrupt {
            file: dir.join(META),
            reason: format!("unknown dtype {} for `{}`", entry.dtype, entry.path),
        })?;
        let (dir, meta) = (dir.to_path_buf(), shared.clone());
        tensors.push(burn_pack::Tensor::deferred(
            entry.path.clone(),
            dtype,
            entry.shape.clone(),
            Some(entry.id),
            entry.numel() * dtype.size(),
            move || {
                let entry = &meta.entries[index];
                RankFiles::verified(&dir, &meta)
                    .read_range(entry, &param_name(&entry.path), 0..entry.numel())
                    .map(|data| data.into_bytes())
                    .map_err(|e| burn_pack::Error::ValidationError(e.to_string()))
            },
        ));
    }
    Writer::new(tensors)
        .auto_extension(false)
        .overwrite(true)
        .write_to_file(out)
        .map_err(|e| CheckpointError::io(out, e))?;
    Ok(ConsolidateReport::of(&meta.entries))
}

/// As [`consolidate`], into a safetensors file (tensors named by module path, full shapes,
/// the checkpoint's dtypes) for other tools, e.g. Python's `safetensors.torch.load_file`; Burn
/// reads it with `burn-store`'s `SafetensorsStore`. Unlike [`consolidate`] it holds the whole
/// model in memory while writing (the safetensors writer takes every tensor at once). Atomic.
///
/// # Errors
/// As [`consolidate`].
pub fn consolidate_safetensors(
    dir: impl AsRef<Path>,
    out: impl AsRef<Path>,
) -> Result<ConsolidateReport, CheckpointError> {
    consolidate_safetensors_selected(dir, out, Selection::All)
}

/// [`consolidate_safetensors`] of the entries `selection` keeps.
///
/// # Errors
/// As [`consolidate`].
pub fn consolidate_safetensors_selected(
    dir: impl AsRef<Path>,
    out: impl AsRef<Path>,
    selection: Selection,
) -> Result<ConsolidateReport, CheckpointError> {
    let (dir, out) = (dir.as_ref(), out.as_ref());
    let mut meta = CheckpointMeta::read(dir)?;
    meta.entries.retain(|e| selection.keeps(e));
    refuse_unheld(dir, &meta, &meta.entries, NEEDS_BASE)?;
    let mut files = RankFiles::new(dir, &meta);
    let mut loaded = Vec::with_capacity(meta.entries.len());
    for entry in &meta.entries {
        let data = files.read_range(entry, &param_name(&entry.path), 0..entry.numel())?;
        let dtype = match data.dtype() {
            burn::tensor::DType::F32 => safetensors::Dtype::F32,
            burn::tensor::DType::F64 => safetensors::Dtype::F64,
            burn::tensor::DType::BF16 => safetensors::Dtype::BF16,
            burn::tensor::DType::F16 => safetensors::Dtype::F16,
            other => {
                return Err(CheckpointError::Corrupt {
                    file: dir.join(META),
                    reason: format!("`{}` has dtype {other:?}, which safetensors cannot hold", entry.path),
                });
            }
        };
        loaded.push((entry, dtype, data));
    }
    let mut tensors = Vec::with_capacity(loaded.len());
    for (entry, dtype, data) in &loaded {
        let view = safetensors::tensor::TensorView::new(*dtype, entry.shape.clone(), data.as_bytes()).map_err(|e| {
            CheckpointError::Corrupt {
                file: dir.join(META),
                reason: format!("`{}`: {e}", entry.path),
            }
        })?;
        tensors.push((entry.path.clone(), view));
    }
    let tmp = out.with_extension("tmp");
    safetensors::tensor::serialize_to_file(tensors, None, &tmp).map_err(|e| CheckpointError::io(out, e))?;
    std::fs::rename(&tmp, out).map_err(|e| CheckpointError::io(out, e))?;
    Ok(ConsolidateReport::of(&meta.entries))
}

/// Writes the checkpoint's optimizer state as Burn's own optimizer record (the burnpack file
/// `ModuleOptimizer::save` writes: each parameter's state at the parameter's shape, keyed by
/// its `ParamId`, with its step count and rank), so single-device Burn training resumes from
/// it: load the model from [`consolidate`]'s record, then
/// `AdamWConfig::new().init().load(out)` (the optimizer the run used, as a Burn config; Burn's
/// Adam/AdamW read `FusedAdam`'s state, which is Burn's `AdamState`). The `f32` masters of
/// `bf16`/`f16` parameters have no place in that record and are left out. Holds the whole
/// optimizer state in memory while writing. Atomic.
///
/// # Errors
/// As [`consolidate`].
pub fn consolidate_optimizer(
    dir: impl AsRef<Path>,
    out: impl AsRef<Path>,
) -> Result<ConsolidateReport, CheckpointError> {
    let (dir, out) = (dir.as_ref(), out.as_ref());
    let meta = CheckpointMeta::read(dir)?;
    let mut files = RankFiles::new(dir, &meta);
    let mut tensors = Vec::new();
    let mut scalars = Vec::new();
    let mut paths = Vec::new();
    let mut entries = 0;
    let mut elements = 0;
    for entry in meta.entries.iter().filter(|e| e.trainable) {
        let Some(first) = entry.pieces.first() else {
            continue;
        };
        let prefix = state_prefix(&entry.path);
        let fields = files.tensors_under(first.rank, &prefix)?;
        let state_scalars = files.scalars_under(first.rank, &prefix)?;
        if fields.is_empty() && state_scalars.is_empty() {
            continue; // never stepped: Burn's optimizer has no state for it either
        }
        let id = entry.id;
        for field in fields {
            let data = files.read_range(entry, &state_name(&entry.path, &field), 0..entry.numel())?;
            let (bytes, _, dtype) = data.into_parts();
            tensors.push(burn_pack::Tensor::new(
                format!("{id}.{field}"),
                dtype,
                entry.shape.clone(),
                Some(id),
                bytes,
            ));
        }
        for (field, value) in state_scalars {
            scalars.push((format!("{id}.{field}"), value));
        }
        scalars.push((format!("{id}.__rank"), burn_pack::Scalar::from(entry.shape.len())));
        paths.push((id.to_string(), entry.path.clone()));
        entries += 1;
        elements += entry.numel();
    }
    let mut writer = Writer::new(tensors).auto_extension(false).overwrite(true);
    for (key, value) in scalars {
        writer = writer.with_scalar(&key, value);
    }
    for (key, value) in paths {
        writer = writer.with_metadata(&key, &value);
    }
    writer.write_to_file(out).map_err(|e| CheckpointError::io(out, e))?;
    Ok(ConsolidateReport { entries, elements })
}
