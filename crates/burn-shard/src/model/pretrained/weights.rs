//! [`Pretrained`]: a pretrained file, burn-store's key remapping and adapter, which entries of
//! the model may be missing from it and which of its tensors may go unused.

use std::path::Path;

use burn_pack::Tensor as PackTensor;
use burn_store::{KeyRemapper, ModuleAdapter};
use regex::Regex;

use super::open;
use crate::error::ShardError;

/// Pretrained weights for [`ShardConfig::init_pretrained`](crate::ShardConfig::init_pretrained):
/// a Hugging Face safetensors file, a Burn burnpack record (burn-store's `BurnpackStore`), or
/// tensors of any other format described as burn-store tensors, with burn-store's key
/// remapping and tensor adapters (`PyTorchToBurnAdapter`) as a `SafetensorsStore` takes them.
///
/// Nothing of the tensors' data is read here: opening reads the file's header (names, dtypes,
/// shapes, byte offsets); `init_pretrained` reads, for each entry of the model, the bytes the
/// rank keeps. At stage 3 that is the byte range of the rank's shard (`ceil(numel /
/// world_size)` elements, the last rank's zero-padded), read from the file without the rest of
/// the tensor, for an entry whose tensor no adapter transforms and whose parameter has no load
/// mapper; otherwise, and at stages 0-2 (where every rank holds whole parameters), the whole
/// tensor, one at a time. `PyTorchToBurnAdapter` transposes every `Linear` weight, so with it
/// each rank reads each `Linear` weight whole (and keeps its shard): memory stays at the shards
/// plus one parameter (and the copies of the transpose), the bytes read are then the whole
/// tensor per rank.
///
/// A float tensor of another float dtype than its parameter's is cast to the parameter's
/// (as PyTorch's `load_state_dict` copies into the existing parameter): a `bf16` checkpoint
/// loads into an `f32` model. Only float entries are loaded: a tensor of the file for an
/// integer or boolean parameter of the model (none of `burn::nn` has one), or for a quantized
/// one, is an error naming it.
///
/// The model's parameters keep their own `ParamId`s (burn-store's `load_from` takes a
/// burnpack's): the sharded optimizer and sharded checkpoints name entries by module path.
///
/// The constructors and builder methods never fail: a file that cannot be opened or a pattern
/// that is not a regex is kept and returned by `init_pretrained` on every rank (which then
/// stops the group, so no rank waits for one that failed alone). [`Pretrained::problem`] reads
/// it earlier.
pub struct Pretrained {
    /// What the tensors came from, for messages (the file's path).
    pub(crate) origin: String,
    /// The tensors, named by module path once `remapper` has run.
    pub(crate) tensors: Vec<PackTensor>,
    /// Tensors of the file this crate cannot read (a dtype Burn has no type for), by name.
    pub(crate) unreadable: Vec<(String, String)>,
    pub(crate) remapper: KeyRemapper,
    pub(crate) adapter: Option<Box<dyn ModuleAdapter>>,
    pub(crate) allow_missing: Vec<Regex>,
    pub(crate) ignore_unused: Vec<Regex>,
    /// The first error of opening or building: returned by `init_pretrained`.
    pub(crate) error: Option<ShardError>,
}

impl std::fmt::Debug for Pretrained {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pretrained")
            .field("origin", &self.origin)
            .field("tensors", &self.tensors.len())
            .field("adapter", &self.adapter.is_some())
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

impl Pretrained {
    /// Hugging Face safetensors weights (each file's header read, not memory-mapped, and checked
    /// against the file's length):
    /// one `.safetensors` file; the `model.safetensors.index.json` of a checkpoint split over
    /// several files (each tensor taken from the file its `weight_map` names; a rank reads
    /// bytes only from the files that hold its ranges); or the directory holding either
    /// (`model.safetensors.index.json`, else `model.safetensors`, else its only index or only
    /// safetensors file). A path that cannot be opened, is none of these, an index naming a
    /// file that is missing or a tensor its file does not hold, is
    /// [`ShardError::PretrainedRead`] naming what was given and what is expected, returned by
    /// `init_pretrained`.
    pub fn safetensors(path: impl AsRef<Path>) -> Self {
        let path = path.as_ref();
        match open::safetensors_any(path) {
            Ok((tensors, unreadable)) => Self::new(path.display().to_string(), tensors, unreadable, None),
            Err(e) => Self::new(path.display().to_string(), Vec::new(), Vec::new(), Some(e)),
        }
    }

    /// A burnpack record (written by burn-store's `BurnpackStore` or burn-shard's
    /// `consolidate`; `.bpk` is appended to a path without extension that does not exist, as
    /// `BurnpackStore` does); only its header is read here. A file that cannot be opened or is
    /// not burnpack is [`ShardError::PretrainedRead`], returned by `init_pretrained`.
    pub fn burnpack(path: impl AsRef<Path>) -> Self {
        let path = path.as_ref();
        match open::burnpack(path) {
            Ok(tensors) => Self::new(path.display().to_string(), tensors, Vec::new(), None),
            Err(e) => Self::new(path.display().to_string(), Vec::new(), Vec::new(), Some(e)),
        }
    }

    /// Tensors of another format, each with its name, dtype, shape and bytes: a resident
    /// tensor whose bytes are a file window (`Bytes::from_file(path, len, offset)`) is read by
    /// range at stage 3; a deferred one, or one in memory, is produced whole, one at a time.
    /// `origin` names them in messages (the file they came from).
    pub fn from_tensors(origin: impl Into<String>, tensors: Vec<PackTensor>) -> Self {
        Self::new(origin.into(), tensors, Vec::new(), None)
    }

    fn new(
        origin: String,
        tensors: Vec<PackTensor>,
        unreadable: Vec<(String, String)>,
        error: Option<ShardError>,
    ) -> Self {
        Self {
            origin,
            tensors,
            unreadable,
            remapper: KeyRemapper::new(),
            adapter: None,
            allow_missing: Vec::new(),
            ignore_unused: Vec::new(),
            error,
        }
    }

    /// The error `init_pretrained` will return before looking at the model, if any: the file
    /// could not be opened, or a pattern is not a regex.
    pub fn problem(&self) -> Option<&ShardError> {
        self.error.as_ref()
    }

    /// Renames the file's tensors: every name matching the regex `from` is rewritten with
    /// `to` (`$1` for capture groups), in the order the remappings were added, as
    /// burn-store's `with_key_remapping`. An invalid regex is
    /// [`ShardError::InvalidConfig`], returned by `init_pretrained`.
    pub fn with_key_remapping(mut self, from: &str, to: &str) -> Self {
        match self.remapper.clone().add_pattern(from, to) {
            Ok(remapper) => self.remapper = remapper,
            Err(e) => self.fail(ShardError::InvalidConfig(format!(
                "pretrained key remapping `{from}`: {e}"
            ))),
        }
        self
    }

    /// Transforms each tensor on its way into its parameter, given the module type it sits
    /// in: burn-store's `PyTorchToBurnAdapter` transposes `Linear` weights and finds
    /// normalisation parameters under PyTorch's names (`weight`, `bias` for `gamma`, `beta`).
    pub fn with_from_adapter(mut self, adapter: impl ModuleAdapter + 'static) -> Self {
        self.adapter = Some(Box::new(adapter));
        self
    }

    /// Entries of the model whose module path matches one of these regexes may be absent from
    /// the file: they are initialised as without pretrained weights (rank 0's initializer,
    /// broadcast): a new classification head. (Entries a reparameterization adds, LoRA's
    /// adapters `PARAM.lora.a`/`.b`, need no pattern: they are never in a base file, and are
    /// initialised so, with their count logged.) `".*"` is burn-store's
    /// `allow_partial(true)`. Any other entry missing from the file is an error. An invalid
    /// regex is [`ShardError::InvalidConfig`], returned by `init_pretrained`.
    pub fn allow_missing<S: AsRef<str>>(mut self, patterns: impl IntoIterator<Item = S>) -> Self {
        match compile(patterns) {
            Ok(patterns) => self.allow_missing.extend(patterns),
            Err(e) => self.fail(e),
        }
        self
    }

    /// Tensors of the file (named after remapping) matching one of these regexes may have no
    /// place in the model: a pooler the fine-tune does not use, PyTorch BatchNorm's
    /// `num_batches_tracked` (`r"num_batches_tracked$"`). Any other tensor left unused is an
    /// error (burn-store's `load_from` only reports it): the file is of another architecture or
    /// size. An invalid regex is [`ShardError::InvalidConfig`], returned by `init_pretrained`.
    pub fn ignore_unused<S: AsRef<str>>(mut self, patterns: impl IntoIterator<Item = S>) -> Self {
        match compile(patterns) {
            Ok(patterns) => self.ignore_unused.extend(patterns),
            Err(e) => self.fail(e),
        }
        self
    }

    fn fail(&mut self, error: ShardError) {
        self.error.get_or_insert(error);
    }
}

fn compile<S: AsRef<str>>(patterns: impl IntoIterator<Item = S>) -> Result<Vec<Regex>, ShardError> {
    patterns
        .into_iter()
        .map(|p| {
            Regex::new(p.as_ref())
                .map_err(|e| ShardError::InvalidConfig(format!("pretrained pattern `{}`: {e}", p.as_ref())))
        })
        .collect()
}
