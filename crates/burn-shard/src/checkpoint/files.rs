//! The rank files: writing one (burnpack, then its digest), and reading verified pieces.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use burn::tensor::{DType, TensorData};
use burn_pack::{Reader, Scalar, Writer};
use sha2::{Digest, Sha256};

use super::format::{META, digest_file, rank_file};
use super::meta::{CheckpointMeta, EntryMeta, FileMeta};
use crate::error::{CheckpointError, ShardError};

/// The tensors and scalars of one rank file, written by [`RankFile::write`].
#[derive(Default)]
pub(crate) struct RankFile {
    tensors: Vec<burn_pack::Tensor>,
    scalars: Vec<(String, Scalar)>,
    /// The first error of a deferred tensor's provider, returned by `write` in place of the
    /// writer's own (which only says that a provider failed).
    deferred_error: Arc<Mutex<Option<ShardError>>>,
    /// Bytes of the tensors held in memory (pushed, not deferred).
    held_bytes: usize,
}

impl RankFile {
    pub(crate) fn push(&mut self, name: String, data: TensorData) {
        let (shape, dtype) = (data.shape().clone(), data.dtype());
        self.held_bytes += data.as_bytes().len();
        self.tensors
            .push(burn_pack::Tensor::new(name, dtype, shape, None, data.into_bytes()));
    }

    /// A tensor of `shape` and `dtype` whose data `provide` makes when the writer reaches it,
    /// so that a rank file is written with one such tensor in memory at a time (burnpack's
    /// deferred tensors). `provide` must return that many elements of `dtype`.
    pub(crate) fn push_deferred(
        &mut self,
        name: String,
        dtype: DType,
        shape: Vec<usize>,
        provide: impl Fn() -> Result<TensorData, ShardError> + Send + Sync + 'static,
    ) {
        let failed = self.deferred_error.clone();
        let numel: usize = shape.iter().product();
        let tensor = burn_pack::Tensor::deferred(name, dtype, shape, None, numel * dtype.size(), move || {
            provide().map(TensorData::into_bytes).map_err(|e| {
                let message = e.to_string();
                failed.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                burn_pack::Error::IoError(message)
            })
        });
        self.tensors.push(tensor);
    }

    /// Bytes of the tensors this file holds in memory until written (deferred ones excluded).
    pub(crate) fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    pub(crate) fn push_scalar(&mut self, name: String, value: Scalar) {
        self.scalars.push((name, value));
    }

    /// Writes `dir/rank-R.bpk` (atomically: a temporary file renamed into place) and then its
    /// digest file.
    ///
    /// # Errors
    /// A deferred tensor's provider's error, or [`CheckpointError`] (in [`ShardError::Checkpoint`])
    /// when the file cannot be written.
    pub(crate) fn write(self, dir: &Path, rank: usize) -> Result<(), ShardError> {
        let deferred_error = self.deferred_error.clone();
        self.write_file(dir, rank).map_err(|e| {
            let deferred = deferred_error.lock().unwrap_or_else(|p| p.into_inner()).take();
            deferred.unwrap_or_else(|| e.into())
        })
    }

    /// [`RankFile::write`] with the writer's own error: for files without deferred tensors (a
    /// reshard's), whose providers cannot fail.
    ///
    /// # Errors
    /// [`CheckpointError::Io`] when the file cannot be written.
    pub(crate) fn write_file(self, dir: &Path, rank: usize) -> Result<(), CheckpointError> {
        let path = dir.join(rank_file(rank));
        let mut writer = Writer::new(self.tensors).auto_extension(false);
        for (name, value) in self.scalars {
            writer = writer.with_scalar(&name, value);
        }
        writer.write_to_file(&path).map_err(|e| CheckpointError::io(&path, e))?;
        let (bytes, sha256) = digest(&path)?;
        let digest_path = dir.join(digest_file(rank));
        let mut f = std::fs::File::create(&digest_path).map_err(|e| CheckpointError::io(&digest_path, e))?;
        writeln!(f, "{sha256} {bytes}")
            .and_then(|_| f.sync_all())
            .map_err(|e| CheckpointError::io(&digest_path, e))
    }
}

/// Size and SHA-256 (lowercase hex) of a file, read in a stream.
pub(crate) fn digest(path: &Path) -> Result<(u64, String), CheckpointError> {
    let mut file = std::fs::File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => CheckpointError::Missing {
            file: path.to_path_buf(),
        },
        _ => CheckpointError::io(path, e),
    })?;
    let mut hasher = Sha256::new();
    let bytes = std::io::copy(&mut file, &mut hasher).map_err(|e| CheckpointError::io(path, e))?;
    Ok((bytes, format!("{:x}", hasher.finalize())))
}

/// What rank `rank` recorded about its file in `dir`.
pub(crate) fn read_digest(dir: &Path, rank: usize) -> Result<FileMeta, CheckpointError> {
    let path = dir.join(digest_file(rank));
    let text = std::fs::read_to_string(&path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => CheckpointError::Missing { file: path.clone() },
        _ => CheckpointError::io(&path, e),
    })?;
    let mut parts = text.split_whitespace();
    let (Some(sha256), Some(bytes)) = (parts.next(), parts.next().and_then(|b| b.parse().ok())) else {
        return Err(CheckpointError::Corrupt {
            file: path,
            reason: "not `SHA256 BYTES`".into(),
        });
    };
    Ok(FileMeta {
        name: rank_file(rank),
        bytes,
        sha256: sha256.to_string(),
    })
}

/// One opened rank file: its tensors (bytes read lazily) and scalars.
struct Opened {
    tensors: HashMap<String, burn_pack::Tensor>,
    scalars: BTreeMap<String, Scalar>,
}

/// The rank files of a checkpoint, each verified against its digest before its first read.
pub(crate) struct RankFiles<'a> {
    dir: PathBuf,
    meta: &'a CheckpointMeta,
    open: HashMap<usize, Opened>,
    /// Skip the digest check (the caller verified the files already).
    verified: bool,
}

impl<'a> RankFiles<'a> {
    pub(crate) fn new(dir: &Path, meta: &'a CheckpointMeta) -> Self {
        Self {
            dir: dir.to_path_buf(),
            meta,
            open: HashMap::new(),
            verified: false,
        }
    }

    /// As [`RankFiles::new`], for files the caller has verified against their digests.
    pub(crate) fn verified(dir: &Path, meta: &'a CheckpointMeta) -> Self {
        Self {
            verified: true,
            ..Self::new(dir, meta)
        }
    }

    fn opened(&mut self, rank: usize) -> Result<&Opened, CheckpointError> {
        if !self.open.contains_key(&rank) {
            let name = rank_file(rank);
            let path = self.dir.join(&name);
            let expected = self
                .meta
                .files
                .iter()
                .find(|f| f.name == name)
                .ok_or_else(|| CheckpointError::Corrupt {
                    file: self.dir.join(META),
                    reason: format!("lists no digest for {name}"),
                })?;
            if !self.verified {
                let (bytes, sha256) = digest(&path)?;
                if bytes != expected.bytes || sha256 != expected.sha256 {
                    return Err(CheckpointError::Corrupt {
                        file: path,
                        reason: format!(
                            "{bytes} bytes with SHA-256 {sha256}, the checkpoint recorded {} bytes with SHA-256 {}",
                            expected.bytes, expected.sha256
                        ),
                    });
                }
            }
            let corrupt = |e: burn_pack::Error| CheckpointError::Corrupt {
                file: path.clone(),
                reason: e.to_string(),
            };
            let reader = Reader::from_file_exact(&path).map_err(corrupt)?;
            let scalars = reader.scalars().clone();
            let tensors = reader
                .into_tensors()
                .map_err(corrupt)?
                .into_iter()
                .map(|t| (t.name.clone(), t))
                .collect();
            self.open.insert(rank, Opened { tensors, scalars });
        }
        Ok(&self.open[&rank])
    }

    /// Dtype and bytes of tensor `name` in `rank`'s file, `None` when the file has no such
    /// tensor.
    fn tensor(&mut self, rank: usize, name: &str) -> Result<Option<(DType, Vec<u8>)>, CheckpointError> {
        let path = self.dir.join(rank_file(rank));
        let Some(tensor) = self.opened(rank)?.tensors.get(name) else {
            return Ok(None);
        };
        let bytes = tensor.to_bytes().map_err(|e| CheckpointError::Corrupt {
            file: path,
            reason: format!("tensor {name}: {e}"),
        })?;
        Ok(Some((tensor.dtype, bytes.to_vec())))
    }

    /// Names of the tensors of `rank`'s file that start with `prefix`, prefix removed.
    pub(crate) fn tensors_under(&mut self, rank: usize, prefix: &str) -> Result<Vec<String>, CheckpointError> {
        Ok(self
            .opened(rank)?
            .tensors
            .keys()
            .filter_map(|n| n.strip_prefix(prefix).map(str::to_string))
            .collect())
    }

    /// Scalars of `rank`'s file whose names start with `prefix`, prefix removed.
    pub(crate) fn scalars_under(
        &mut self,
        rank: usize,
        prefix: &str,
    ) -> Result<Vec<(String, Scalar)>, CheckpointError> {
        Ok(self
            .opened(rank)?
            .scalars
            .iter()
            .filter_map(|(n, v)| n.strip_prefix(prefix).map(|n| (n.to_string(), *v)))
            .collect())
    }

    /// Optimizer-state field `name` (`state/PATH/FIELD`) of the whole of `entry`, for an
    /// optimizer that keeps state tensors of rank `state_rank`: one value per parameter element
    /// (Adam's moments, Muon's momentum) gathered from the pieces, shaped as the parameter for
    /// `state_rank` above 1 (`[numel]` otherwise); or, saved whole by the one rank that owned the
    /// parameter with a shape of its own ([`RankFiles::is_factored`]), that tensor as saved.
    ///
    /// # Errors
    /// [`CheckpointError::Corrupt`] when the field is missing or its pieces do not fit.
    pub(crate) fn read_state_field(
        &mut self,
        entry: &EntryMeta,
        name: &str,
        state_rank: usize,
    ) -> Result<TensorData, CheckpointError> {
        if self.is_factored(entry, name)? {
            let rank = entry.pieces[0].rank;
            let shape = self.opened(rank)?.tensors[name].shape.clone();
            let (dtype, bytes) = self.tensor(rank, name)?.expect("is_factored found it");
            return Ok(TensorData::from_bytes_vec(bytes, shape, dtype));
        }
        let data = self.read_range(entry, name, 0..entry.numel())?;
        let shape = match state_rank > 1 {
            true => entry.shape.clone(),
            false => vec![entry.numel()],
        };
        let dtype = data.dtype();
        Ok(TensorData::from_bytes_vec(data.into_bytes().to_vec(), shape, dtype))
    }

    /// Whether tensor `name` of `entry` was saved whole, by the one rank holding the entry,
    /// with a shape of its own: neither `[numel]` nor the parameter's shape (a factored
    /// optimizer state such as Adafactor's row and column statistics, or a larger one).
    pub(crate) fn is_factored(&mut self, entry: &EntryMeta, name: &str) -> Result<bool, CheckpointError> {
        let [piece] = entry.pieces.as_slice() else {
            return Ok(false);
        };
        let numel = entry.numel();
        Ok(self.opened(piece.rank)?.tensors.get(name).is_some_and(|t| {
            let dims: Vec<usize> = t.shape.iter().copied().collect();
            dims != [numel] && dims != entry.shape
        }))
    }

    /// Elements `range` of tensor `name` of `entry` (`param/PATH`, `state/PATH/FIELD` or
    /// `master/PATH`), gathered from the pieces that hold them: `[range.len()]`, in the dtype
    /// the writer stored.
    pub(crate) fn read_range(
        &mut self,
        entry: &EntryMeta,
        name: &str,
        range: Range<usize>,
    ) -> Result<TensorData, CheckpointError> {
        let mut out = Vec::new();
        let mut dtype = None;
        let mut next = range.start;
        for piece in &entry.pieces {
            let (lo, hi) = (range.start.max(piece.start), range.end.min(piece.end));
            if lo >= hi {
                continue;
            }
            let file = self.dir.join(rank_file(piece.rank));
            if lo != next {
                return Err(CheckpointError::Corrupt {
                    file: self.dir.join(META),
                    reason: format!("the pieces of `{}` leave elements {next}..{lo} out", entry.path),
                });
            }
            let (piece_dtype, bytes) = self.tensor(piece.rank, name)?.ok_or_else(|| CheckpointError::Corrupt {
                file: file.clone(),
                reason: format!("no tensor {name}, which the metadata places there"),
            })?;
            let elem = piece_dtype.size();
            if bytes.len() != (piece.end - piece.start) * elem || dtype.is_some_and(|d| d != piece_dtype) {
                return Err(CheckpointError::Corrupt {
                    file,
                    reason: format!(
                        "tensor {name} has {} bytes of {piece_dtype:?}, its piece {}..{} needs {}",
                        bytes.len(),
                        piece.start,
                        piece.end,
                        (piece.end - piece.start) * elem
                    ),
                });
            }
            dtype = Some(piece_dtype);
            out.extend_from_slice(&bytes[(lo - piece.start) * elem..(hi - piece.start) * elem]);
            next = hi;
        }
        match dtype {
            Some(dtype) if next == range.end => Ok(TensorData::from_bytes_vec(out, [range.len()], dtype)),
            _ => Err(CheckpointError::Corrupt {
                file: self.dir.join(META),
                reason: format!("no piece of `{}` holds elements {next}..{}", entry.path, range.end),
            }),
        }
    }
}
