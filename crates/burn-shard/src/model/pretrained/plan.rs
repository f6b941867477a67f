//! Which tensor of a pretrained file goes into which entry of the model, decided and checked
//! before anything is read or any entry changes, and the reads themselves.
//!
//! Matching follows burn-store's `Applier` (the route `load_from` takes into a whole model), so
//! that a file loads into a sharded model exactly as into a whole one: the key remapping runs
//! on the file's names; an entry is found under its module path, else under the name the
//! adapter offers for it (`gamma` as `weight` in a norm); the adapter then transforms it, given
//! the module type it sits in; its shape must equal the entry's record shape (`lazy_shape`,
//! before the load mapper). What differs, and why: every problem is collected and reported at
//! once, on every rank, before any entry changes (burn-store reports after applying, and
//! falls back to the initializer on a mismatch); a float tensor of another width is cast to
//! the entry's dtype (the sharded layout fixed it from the model); an entry missing from the
//! file is an error unless [`Pretrained::allow_missing`] names it; a tensor of the file with no
//! place in the model is an error unless [`Pretrained::ignore_unused`] names it (burn-store
//! reports it and loads the rest).

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};

use burn::module::ParamId;
use burn::tensor::{Bytes, DType, Device, Tensor, TensorData};
use burn_pack::Tensor as PackTensor;
use burn_std::ViewError;
use burn_store::ModuleContext;

use super::weights::Pretrained;
use crate::error::{ShardError, listed};
use crate::model::census::{Census, Entry};
use crate::model::layout::SUPPORTED;

/// How many names an error lists before it says how many more there are.
const LISTED: usize = 8;

/// The file's tensor for each entry that takes one; see the module docs.
pub(crate) struct PretrainedPlan {
    origin: String,
    sources: HashMap<ParamId, Source>,
    fingerprint: u64,
}

struct Source {
    /// The file's name of it (before the adapter renamed it), for messages.
    name: String,
    /// The adapted tensor: bytes in record form, the entry's record shape.
    tensor: PackTensor,
    /// Whether a range of its elements is a range of the entry's value (no load mapper).
    ranged: bool,
}

impl PretrainedPlan {
    /// Matches `pretrained`'s tensors to `census`'s entries; reads no tensor data.
    ///
    /// # Errors
    /// [`ShardError::PretrainedMismatch`] listing every entry missing from the file (and not
    /// allowed to be), every tensor whose shape or kind of dtype does not fit its entry or that
    /// cannot be read, and every tensor of the file with no place in the model (and not
    /// ignored).
    pub(crate) fn resolve(pretrained: Pretrained, census: &Census) -> Result<Self, ShardError> {
        let Pretrained {
            origin,
            tensors,
            unreadable,
            remapper,
            adapter,
            allow_missing,
            ignore_unused,
            error,
        } = pretrained;
        if let Some(error) = error {
            return Err(error);
        }
        // The file's own name of each remapped name, for messages.
        let (tensors, renamed) = remapper.remap(tensors);
        let mut file_name: HashMap<String, String> = renamed.into_iter().collect();
        // Unreadable tensors are renamed by the same remapper, as empty stand-ins.
        let (reasons, stand_ins): (Vec<String>, Vec<PackTensor>) = unreadable
            .into_iter()
            .map(|(name, reason)| {
                (
                    reason,
                    PackTensor::new(name, DType::U8, [0], None, Bytes::from_bytes_vec(Vec::new())),
                )
            })
            .unzip();
        let (stand_ins, renamed) = remapper.remap(stand_ins);
        file_name.extend(renamed);
        let unreadable: HashMap<String, String> = stand_ins.into_iter().map(|t| t.name).zip(reasons).collect();
        let mut problems = Vec::new();
        let mut by_name: HashMap<String, PackTensor> = HashMap::new();
        for tensor in tensors {
            if let Some(old) = by_name.insert(tensor.name.clone(), tensor) {
                problems.push(format!(
                    "two tensors of the file are named `{}` after the key remapping",
                    old.name
                ));
            }
        }
        let mut used = HashSet::new();
        let mut missing = Vec::new();
        let mut sources = HashMap::new();
        let mut hasher = DefaultHasher::new();
        for path in census.non_float_paths() {
            if by_name.contains_key(path) {
                problems.push(format!(
                    "tensor `{}` is for `{path}`, an integer or boolean parameter: init_pretrained loads float \
                     entries only; load it into the model before init (burn-store's load_from) and skip it here \
                     with Pretrained::ignore_unused",
                    file_name.get(path).unwrap_or(path)
                ));
                used.insert(path.clone());
            }
        }
        let entry_paths: HashSet<&str> = census.entries().map(|(_, e)| e.path.as_str()).collect();
        let mut added = Vec::new();
        for (index, (id, entry)) in census.entries().enumerate() {
            if entry.numel() == 0 {
                // Nothing to load: a tensor of the file under its path is not unused.
                used.insert(entry.path.clone());
                continue;
            }
            if !SUPPORTED.contains(&entry.dtype) {
                if by_name.contains_key(&entry.path) {
                    problems.push(format!(
                        "`{}` is {:?} (quantized), which init_pretrained does not load: load it into the model \
                         before init (burn-store's load_from) and skip it here with Pretrained::ignore_unused",
                        entry.path, entry.dtype
                    ));
                    used.insert(entry.path.clone());
                }
                continue;
            }
            let context = ModuleContext::new(&entry.containers);
            let mut key = entry.path.clone();
            if !by_name.contains_key(&key)
                && let (Some(adapter), Some(module_type)) = (&adapter, context.module_type())
                && let Some((parent, leaf)) = split_leaf(&entry.path)
                && let Some(alternative) = adapter.get_alternative_param_name(leaf, module_type)
            {
                key = match parent {
                    Some(parent) => format!("{parent}.{alternative}"),
                    None => alternative,
                };
            }
            let name = file_name.get(&key).cloned().unwrap_or_else(|| key.clone());
            if let Some(reason) = unreadable.get(&key) {
                problems.push(format!("tensor `{name}` for `{}`: {reason}", entry.path));
                used.insert(key);
                continue;
            }
            let Some(tensor) = by_name.get(&key) else {
                if added_by_reparameterization(&entry.path, &entry_paths) {
                    added.push(format!("`{}`", entry.path));
                } else if !allow_missing.iter().any(|p| p.is_match(&entry.path)) {
                    missing.push(format!("`{}` {:?}", entry.path, entry.record_shape));
                }
                continue;
            };
            used.insert(key);
            let mut tensor = tensor.clone();
            if let Some(adapter) = &adapter {
                tensor.name = entry.path.clone();
                tensor = adapter.adapt(tensor, context);
            }
            if !is_float(tensor.dtype) {
                problems.push(format!(
                    "tensor `{name}` is {:?}, and `{}` is a float parameter ({:?})",
                    tensor.dtype, entry.path, entry.dtype
                ));
                continue;
            }
            let shape = tensor.shape.to_vec();
            let declared = shape.iter().product::<usize>() * tensor.dtype.size();
            if tensor.byte_len() != declared {
                problems.push(format!(
                    "tensor `{name}` holds {} bytes where its shape {shape:?} and dtype {:?} make {declared}",
                    tensor.byte_len(),
                    tensor.dtype
                ));
                continue;
            }
            if shape != entry.record_shape {
                problems.push(format!(
                    "tensor `{name}` has shape {shape:?}{}, and `{}` has shape {:?}",
                    if adapter.is_some() { " after the adapter" } else { "" },
                    entry.path,
                    entry.record_shape
                ));
                continue;
            }
            (index, format!("{:?}", tensor.dtype), &shape).hash(&mut hasher);
            sources.insert(
                id,
                Source {
                    name,
                    tensor,
                    ranged: !entry.has_load_mapper,
                },
            );
        }
        if !added.is_empty() {
            // As PEFT does: a base checkpoint holds no adapters, so the model initialises them.
            tracing::info!(
                "{} entries added by a reparameterization of the model (LoRA adapters) are not in {origin}: \
                 initialised by the model (rank 0's values): {}",
                added.len(),
                listed(&added, LISTED)
            );
        }
        if !missing.is_empty() {
            problems.push(format!(
                "{} of the model's entries are not in the file: {}; if they are new (a head), let them be \
                 initialised with Pretrained::allow_missing([..regex of their paths..]), or map the file's names onto \
                 them with Pretrained::with_key_remapping",
                missing.len(),
                listed(&missing, LISTED)
            ));
        }
        let mut unused: Vec<String> = by_name
            .keys()
            .chain(unreadable.keys())
            .filter(|name| !used.contains(*name) && !ignore_unused.iter().any(|p| p.is_match(name)))
            .map(|name| format!("`{}`", file_name.get(name).unwrap_or(name)))
            .collect();
        unused.sort();
        if !unused.is_empty() {
            problems.push(format!(
                "{} tensors of the file have no place in the model: {}; is the model built with the configuration \
                 the weights came with? (Pretrained::ignore_unused([..]) skips tensors on purpose)",
                unused.len(),
                listed(&unused, LISTED)
            ));
        }
        if !problems.is_empty() {
            return Err(ShardError::PretrainedMismatch {
                origin,
                problems: problems.join("\n  - "),
            });
        }
        Ok(Self {
            origin,
            sources,
            fingerprint: hasher.finish(),
        })
    }

    /// What the ranks must agree on: which entries come from the file, with which dtype and
    /// shape (a rank that would broadcast an entry the others read would desynchronise them).
    pub(crate) fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Whether `id`'s value comes from the file.
    pub(crate) fn has(&self, id: &ParamId) -> bool {
        self.sources.contains_key(id)
    }

    /// Whether `id`'s value comes from the file and a range of it can be read alone.
    pub(crate) fn ranged(&self, id: &ParamId) -> bool {
        self.sources.get(id).is_some_and(|s| s.ranged)
    }

    /// The whole record of `id` (`[numel]`, record order, cast to `entry.dtype`) on `device`.
    ///
    /// # Errors
    /// [`ShardError::PretrainedRead`] when the bytes cannot be read.
    pub(crate) fn read_whole(&self, id: &ParamId, entry: &Entry, device: &Device) -> Result<Tensor<1>, ShardError> {
        self.read(id, entry, 0, entry.numel(), device)
    }

    /// Elements `[start, start + len)` of `id`'s value, flattened (`[len]`, zeros past its
    /// end: a shard's padding), cast to `entry.dtype`, on `device`. Reads only those bytes
    /// when the tensor's bytes are a file window (no adapter transformed them).
    ///
    /// # Errors
    /// [`ShardError::PretrainedRead`] when the bytes cannot be read.
    pub(crate) fn read_range(
        &self,
        id: &ParamId,
        entry: &Entry,
        start: usize,
        len: usize,
        device: &Device,
    ) -> Result<Tensor<1>, ShardError> {
        let end = (start + len).min(entry.numel());
        if start >= end {
            // A rank whose shard is all padding (a parameter smaller than the group).
            return Ok(Tensor::<1>::zeros([len], (device, entry.dtype)));
        }
        let piece = self.read(id, entry, start, end, device)?;
        Ok(match end - start < len {
            true => Tensor::cat(
                vec![piece, Tensor::zeros([len - (end - start)], (device, entry.dtype))],
                0,
            ),
            false => piece,
        })
    }

    fn read(
        &self,
        id: &ParamId,
        entry: &Entry,
        start: usize,
        end: usize,
        device: &Device,
    ) -> Result<Tensor<1>, ShardError> {
        let source = &self.sources[id];
        let failed = |reason: String| ShardError::PretrainedRead {
            origin: self.origin.clone(),
            reason: format!("tensor `{}`: {reason}", source.name),
        };
        let dtype = source.tensor.dtype;
        let size = dtype.size();
        // A file window stays unread until accessed; a tensor an adapter transformed is
        // produced whole here.
        let bytes = source
            .tensor
            .clone()
            .into_bytes()
            .map_err(|e| failed(format!("{e:?}")))?;
        let whole = start == 0 && end * size == bytes.len();
        let piece = match bytes.view(start * size, end * size) {
            _ if whole => bytes,
            Ok(window) => window,
            // Bytes in memory (produced by an adapter): copy the range out.
            Err(ViewError::Unsupported) => {
                let all = bytes
                    .read(burn_std::Reader::new())
                    .map_err(|e| failed(format!("{e:?}")))?;
                Bytes::from_bytes_vec(all[start * size..end * size].to_vec())
            }
            Err(e) => {
                let range = format!("bytes {}..{} of {}", start * size, end * size, bytes.len());
                return Err(failed(format!("{e:?} for {range}")));
            }
        };
        // Read here, where a failure is an error, rather than inside `from_data` (a panic).
        piece
            .read(burn_std::Reader::new())
            .map_err(|e| failed(format!("{e:?}")))?;
        // Cast on the host: the device then receives the entry's dtype (a device without `f64`
        // never sees the file's).
        let data = TensorData::from_bytes(piece, [end - start], dtype).convert_dtype(entry.dtype);
        Ok(Tensor::<1>::from_data(data, (device, entry.dtype)))
    }
}

/// Whether the entry at `path` was added by a reparameterization of another entry: its path
/// extends another entry's path (`l1.weight.lora.a` under `l1.weight`, Burn's `Lora`), which no
/// module can give, a parameter being a leaf of the module tree. A base checkpoint never holds
/// such entries.
fn added_by_reparameterization(path: &str, entry_paths: &HashSet<&str>) -> bool {
    path.match_indices('.').any(|(at, _)| entry_paths.contains(&path[..at]))
}

/// `("a.b", "c")` for `"a.b.c"`; `(None, "c")` for `"c"`.
fn split_leaf(path: &str) -> Option<(Option<&str>, &str)> {
    match path.rsplit_once('.') {
        Some((parent, leaf)) => Some((Some(parent), leaf)),
        None => (!path.is_empty()).then_some((None, path)),
    }
}

fn is_float(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::F64 | DType::F32 | DType::F16 | DType::BF16 | DType::Flex32
    )
}
