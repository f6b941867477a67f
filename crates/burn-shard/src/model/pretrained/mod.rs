//! Pretrained weights loaded by `ShardConfig::init_pretrained`, straight into each rank's
//! shards: [`Pretrained`] names the file and how its tensor names and layouts map onto the
//! model (`open`: reading safetensors and burnpack files as byte windows; `plan`: matching
//! them to the model's entries, every check, and reading a whole tensor or a range of one).

mod open;
pub(crate) mod plan;

use std::path::Path;

use burn_pack::Tensor as PackTensor;
use burn_store::{KeyRemapper, ModuleAdapter};
use regex::Regex;

use crate::error::ShardError;

/// Pretrained weights for [`ShardConfig::init_pretrained`](crate::ShardConfig::init_pretrained):
/// a Hugging Face safetensors file, a Burn burnpack record (burn-store's `BurnpackStore`), or
/// tensors of any other format described as burn-store tensors, with burn-store's key
/// remapping and tensor adapters (`PyTorchToBurnAdapter`) as a `SafetensorsStore` takes them.
///
/// Nothing of the tensors' data is read here: opening reads the file's header (names, dtypes,
/// shapes, byte offsets); `init_pretrained` reads, for each entry of the model, the bytes the
/// rank keeps. At stage 3 that is the byte range of the rank's shard (`numel / world_size`
/// elements), read from the file without the rest of the tensor, for an entry whose tensor an
/// adapter does not transform and whose parameter has no load mapper; otherwise, and at
/// stages 0-2 (where every rank holds whole parameters), the whole tensor, one at a time.
/// `PyTorchToBurnAdapter` transposes every `Linear` weight, so with it each rank reads each
/// `Linear` weight whole (and keeps its shard): memory stays at the shards plus one parameter,
/// the bytes read are the whole file per rank.
///
/// A float tensor of another float dtype than its parameter's is cast to the parameter's
/// (as PyTorch's `load_state_dict` copies into the existing parameter): a `bf16` checkpoint
/// loads into an `f32` model. Integer and boolean parameters of the model are not loaded (none
/// of `burn::nn` has one).
///
/// The model's parameters keep their own `ParamId`s (burn-store's `load_from` takes a
/// burnpack's): the sharded optimizer and sharded checkpoints name entries by module path.
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
}

impl std::fmt::Debug for Pretrained {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pretrained")
            .field("origin", &self.origin)
            .field("tensors", &self.tensors.len())
            .field("adapter", &self.adapter.is_some())
            .finish_non_exhaustive()
    }
}

impl Pretrained {
    /// A Hugging Face safetensors file (memory-mapped; only its header is read here).
    ///
    /// # Errors
    /// [`ShardError::PretrainedRead`]: the file cannot be opened or is not safetensors.
    pub fn safetensors(path: impl AsRef<Path>) -> Result<Self, ShardError> {
        let path = path.as_ref();
        let (tensors, unreadable) = open::safetensors(path)?;
        Ok(Self::new(path.display().to_string(), tensors, unreadable))
    }

    /// A burnpack record (`.bpk`, written by burn-store's `BurnpackStore` or burn-shard's
    /// `consolidate`); only its header is read here.
    ///
    /// # Errors
    /// [`ShardError::PretrainedRead`]: the file cannot be opened or is not burnpack.
    pub fn burnpack(path: impl AsRef<Path>) -> Result<Self, ShardError> {
        let path = path.as_ref();
        let tensors = open::burnpack(path)?;
        Ok(Self::new(path.display().to_string(), tensors, Vec::new()))
    }

    /// Tensors of another format, each with its name, dtype, shape and bytes: a resident
    /// tensor whose bytes are a file window (`Bytes::from_file(path, len, offset)`) is read by
    /// range at stage 3; a deferred one is produced whole, one at a time. `origin` names them in
    /// messages (the file they came from).
    pub fn from_tensors(origin: impl Into<String>, tensors: Vec<PackTensor>) -> Self {
        Self::new(origin.into(), tensors, Vec::new())
    }

    fn new(origin: String, tensors: Vec<PackTensor>, unreadable: Vec<(String, String)>) -> Self {
        Self {
            origin,
            tensors,
            unreadable,
            remapper: KeyRemapper::new(),
            adapter: None,
            allow_missing: Vec::new(),
            ignore_unused: Vec::new(),
        }
    }

    /// Renames the file's tensors: every name matching the regex `from` is rewritten with
    /// `to` (`$1` for capture groups), in the order the remappings were added, as
    /// burn-store's `with_key_remapping`.
    ///
    /// # Errors
    /// [`ShardError::InvalidConfig`]: `from` is not a valid regex.
    pub fn with_key_remapping(mut self, from: &str, to: &str) -> Result<Self, ShardError> {
        self.remapper = self
            .remapper
            .add_pattern(from, to)
            .map_err(|e| ShardError::InvalidConfig(format!("pretrained key remapping `{from}`: {e}")))?;
        Ok(self)
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
    /// broadcast): a new classification head, LoRA adapters. `".*"` is burn-store's
    /// `allow_partial(true)`. Any other entry missing from the file is an error.
    ///
    /// # Errors
    /// [`ShardError::InvalidConfig`]: a pattern is not a valid regex.
    pub fn allow_missing<S: AsRef<str>>(mut self, patterns: impl IntoIterator<Item = S>) -> Result<Self, ShardError> {
        self.allow_missing.extend(compile(patterns)?);
        Ok(self)
    }

    /// Tensors of the file (named after remapping) matching one of these regexes may have no
    /// place in the model (a pooler the fine-tune does not use). Any other tensor left unused
    /// is an error: the file is of another architecture or size.
    ///
    /// # Errors
    /// [`ShardError::InvalidConfig`]: a pattern is not a valid regex.
    pub fn ignore_unused<S: AsRef<str>>(mut self, patterns: impl IntoIterator<Item = S>) -> Result<Self, ShardError> {
        self.ignore_unused.extend(compile(patterns)?);
        Ok(self)
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
