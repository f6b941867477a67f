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

/// Writes what `options` selects of the checkpoint in `dir` as one ordinary file at `out`, in
/// the format it names ([`ConsolidateOptions`]; a [`Selection`] or a [`RecordFormat`] alone
/// converts into options, the other part at its default). No model type is needed, and no
/// collective: run it anywhere the checkpoint is readable. The write is atomic (a temporary file
/// renamed to `out`).
///
/// - **The model** ([`Selection::All`], the default; [`Selection::Trainable`] for the trained
///   entries alone): every entry at full shape under its module path. As
///   [`RecordFormat::Burnpack`] (the default), the record `Module::save_file` writes, with each
///   entry's `ParamId`, which the unsharded model loads with `load_file` / `load_record`;
///   streamed: the rank files are verified against their digests first, then each entry is
///   read from the pieces that hold it while it is written, so memory holds about one entry at
///   a time. As [`RecordFormat::Safetensors`], tensors named by module path in the
///   checkpoint's dtypes, for other tools (Python's `safetensors.torch.load_file`; Burn reads
///   it with `burn-store`'s `SafetensorsStore`); it holds the selected entries in memory while
///   writing (the safetensors writer takes every tensor at once).
/// - **The optimizer state** ([`Selection::OptimizerState`], burnpack only): Burn's own
///   optimizer record (the file `ModuleOptimizer::save` writes: each parameter's state at the
///   parameter's shape, keyed by its `ParamId`, with its step count and rank), so single-device
///   Burn training resumes from it: load the model from the consolidated model, then
///   `AdamWConfig::new().init().load(out)` (the optimizer the run used, as a Burn config;
///   Burn's Adam/AdamW read `FusedAdam`'s state, which is Burn's `AdamState`). The `f32`
///   masters of `bf16`/`f16` parameters have no place in that record and are left out. Holds
///   the whole optimizer state in memory while writing.
///
/// # Errors
/// As [`ShardedOptimizer::load_checkpoint`](crate::ShardedOptimizer::load_checkpoint) for a
/// bad checkpoint; [`CheckpointError::Io`] when `out` cannot be written;
/// [`CheckpointError::BaseNotSaved`] when the model is asked of a checkpoint that holds its
/// frozen base by fingerprint alone
/// ([`FrozenEntries::Fingerprinted`](crate::FrozenEntries::Fingerprinted)): consolidate its
/// trained entries with [`Selection::Trainable`]; [`CheckpointError::InvalidArgument`] for the
/// optimizer state as safetensors (it has scalars, which safetensors cannot hold);
/// [`CheckpointError::Corrupt`] for a dtype safetensors cannot hold.
pub fn consolidate(
    dir: impl AsRef<Path>,
    out: impl AsRef<Path>,
    options: impl Into<ConsolidateOptions>,
) -> Result<ConsolidateReport, CheckpointError> {
    let (dir, out, options) = (dir.as_ref(), out.as_ref(), options.into());
    match (options.selection, options.format) {
        (Selection::OptimizerState, RecordFormat::Burnpack) => optimizer_record(dir, out),
        (Selection::OptimizerState, RecordFormat::Safetensors) => Err(CheckpointError::InvalidArgument(
            "the optimizer state consolidates as burnpack only (Burn's optimizer record holds step counts as \
             scalars, which safetensors has no place for): use RecordFormat::Burnpack"
                .into(),
        )),
        (selection, RecordFormat::Burnpack) => as_burnpack(dir, out, selection),
        (selection, RecordFormat::Safetensors) => as_safetensors(dir, out, selection),
    }
}

/// What [`consolidate`] writes: which part of the checkpoint, in which format. The default is
/// the whole model as burnpack.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConsolidateOptions {
    /// Which part of the checkpoint (default [`Selection::All`]).
    pub selection: Selection,
    /// Which file format (default [`RecordFormat::Burnpack`]).
    pub format: RecordFormat,
}

impl ConsolidateOptions {
    /// The whole model as burnpack.
    pub fn new() -> Self {
        Self::default()
    }

    /// Writes what `selection` picks.
    pub fn with_selection(mut self, selection: Selection) -> Self {
        self.selection = selection;
        self
    }

    /// Writes in `format`.
    pub fn with_format(mut self, format: RecordFormat) -> Self {
        self.format = format;
        self
    }
}

impl From<Selection> for ConsolidateOptions {
    fn from(selection: Selection) -> Self {
        Self::new().with_selection(selection)
    }
}

impl From<RecordFormat> for ConsolidateOptions {
    fn from(format: RecordFormat) -> Self {
        Self::new().with_format(format)
    }
}

/// The file format [`consolidate`] writes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RecordFormat {
    /// Burn's burnpack (what `Module::save_file` and `ModuleOptimizer::save` write).
    #[default]
    Burnpack,
    /// safetensors, for other tools.
    Safetensors,
}

/// Which part of a checkpoint a consolidated file holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Selection {
    /// Every float entry: parameters, frozen ones and buffers (the whole model).
    #[default]
    All,
    /// Only the entries the optimizer trained, under their module paths: a LoRA or head-only
    /// fine-tune's adapters without its frozen base (at every stage; at stage 3 the adapters
    /// themselves, where `materialize()` would merge them into the base). Load them over the
    /// base (burn-store's `load_from` with `allow_partial(true)`, or `init_pretrained` with
    /// `allow_missing`).
    Trainable,
    /// The optimizer state, as Burn's optimizer record (see [`consolidate`]).
    OptimizerState,
}

impl Selection {
    /// Whether a model's entry is written (the optimizer state is written by its own path).
    fn keeps(self, entry: &EntryMeta) -> bool {
        self == Selection::All || entry.trainable
    }
}

/// The model's entries that `selection` keeps, as burnpack, streamed.
fn as_burnpack(dir: &Path, out: &Path, selection: Selection) -> Result<ConsolidateReport, CheckpointError> {
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

/// The model's entries that `selection` keeps, as safetensors.
fn as_safetensors(dir: &Path, out: &Path, selection: Selection) -> Result<ConsolidateReport, CheckpointError> {
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

/// The optimizer state as Burn's optimizer record (burnpack).
fn optimizer_record(dir: &Path, out: &Path) -> Result<ConsolidateReport, CheckpointError> {
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
            // Shaped as Burn's own state of the whole parameter holds it.
            let data = files.read_state_field(entry, &state_name(&entry.path, &field), entry.shape.len())?;
            let (bytes, shape, dtype) = data.into_parts();
            tensors.push(burn_pack::Tensor::new(
                format!("{id}.{field}"),
                dtype,
                shape,
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
