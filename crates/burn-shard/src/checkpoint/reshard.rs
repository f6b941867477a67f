//! Offline tools on a checkpoint directory: inspect it, and rewrite it for another world size.

use std::path::{Path, PathBuf};

use super::files::{RankFile, RankFiles, digest, read_digest};
use super::format::{META, begin, discard, finish, master_name, param_name, remove, state_name, state_prefix};
use super::lineage::{complete_dirs, lineage_of, name_of};
use super::meta::CheckpointMeta;
use super::pieces::{Holding, pieces};
use crate::error::CheckpointError;
use crate::stage::Stage;

/// The state of one rank file, as [`inspect`] found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FileStatus {
    /// Size and SHA-256 match the metadata.
    Ok,
    /// The file is not there.
    Missing,
    /// Size or digest differ from the metadata.
    Mismatch {
        /// Bytes found.
        bytes: u64,
    },
}

/// What a checkpoint directory holds, and whether its files are intact.
#[derive(Clone, Debug)]
pub struct Inspection {
    /// The metadata.
    pub meta: CheckpointMeta,
    /// Each rank file with its status, in rank order.
    pub files: Vec<(PathBuf, FileStatus)>,
}

impl Inspection {
    /// Whether every file is intact.
    pub fn is_intact(&self) -> bool {
        self.files.iter().all(|(_, s)| *s == FileStatus::Ok)
    }

    /// Bytes each rank's pieces take, by rank (values, state and masters counted through the
    /// files' sizes).
    pub fn bytes_per_rank(&self) -> Vec<u64> {
        self.meta.files.iter().map(|f| f.bytes).collect()
    }
}

/// Reads `dir`'s metadata and checks every rank file against its digest.
///
/// # Errors
/// [`CheckpointError::Incomplete`], [`CheckpointError::Io`], [`CheckpointError::Corrupt`]
/// (unreadable metadata), [`CheckpointError::Version`]. Bad rank files are reported in the
/// result, not as errors.
pub fn inspect(dir: impl AsRef<Path>) -> Result<Inspection, CheckpointError> {
    let dir = dir.as_ref();
    let meta = CheckpointMeta::read(dir)?;
    let mut files = Vec::new();
    for expected in &meta.files {
        let path = dir.join(&expected.name);
        let status = match digest(&path) {
            Ok((bytes, sha)) if bytes == expected.bytes && sha == expected.sha256 => FileStatus::Ok,
            Ok((bytes, _)) => FileStatus::Mismatch { bytes },
            Err(CheckpointError::Missing { .. }) => FileStatus::Missing,
            Err(e) => return Err(e),
        };
        files.push((path, status));
    }
    Ok(Inspection { meta, files })
}

/// Rewrites the checkpoint in `dir` for `world_size` ranks into the new directory `out`:
/// every entry (values, optimizer state, masters) is cut into `world_size` chunks of
/// `ceil(numel / world_size)` elements. [`ShardedOptimizer::load_checkpoint`] reads any
/// layout, so this is never required; it spreads the files (and the reading) over the new
/// ranks. Payload and stage are kept, and so are the fingerprints of a frozen base the
/// checkpoint does not hold. Atomic like a save: `out` appears complete or not at all.
///
/// [`ShardedOptimizer::load_checkpoint`]: crate::ShardedOptimizer::load_checkpoint
///
/// # Errors
/// As [`inspect`] for a bad checkpoint; [`CheckpointError::Exists`] when `out` exists;
/// [`CheckpointError::Io`].
pub fn reshard(
    dir: impl AsRef<Path>,
    world_size: usize,
    out: impl AsRef<Path>,
) -> Result<CheckpointMeta, CheckpointError> {
    let (dir, out) = (dir.as_ref(), out.as_ref());
    if world_size == 0 {
        return Err(CheckpointError::InvalidArgument(
            "the world size of a resharded checkpoint must be at least 1".into(),
        ));
    }
    let meta = CheckpointMeta::read(dir)?;
    let partial = begin(out)?;
    // A failed rewrite leaves nothing behind.
    let written = (|| -> Result<CheckpointMeta, CheckpointError> {
        let mut files = RankFiles::new(dir, &meta);
        let mut entries = meta.entries.clone();
        // Entries held by fingerprint alone stay so (the fingerprint does not depend on the
        // layout).
        for entry in entries.iter_mut().filter(|e| e.is_held()) {
            entry.pieces = pieces(Stage::Three, Holding::Chunks, entry.numel(), world_size);
        }
        for rank in 0..world_size {
            let mut file = RankFile::default();
            for (old, new) in meta.entries.iter().zip(&entries) {
                let Some(piece) = new.pieces.iter().find(|p| p.rank == rank) else {
                    continue;
                };
                let range = piece.start..piece.end;
                let first = old
                    .pieces
                    .first()
                    .map(|p| p.rank)
                    .ok_or_else(|| CheckpointError::Corrupt {
                        file: dir.join(META),
                        reason: format!("`{}` has no pieces", old.path),
                    })?;
                let path = &old.path;
                let mut names = vec![param_name(path)];
                let state = state_prefix(path);
                names.extend(
                    files
                        .tensors_under(first, &state)?
                        .into_iter()
                        .map(|f| state_name(path, &f)),
                );
                if files
                    .tensors_under(first, &master_name(path))?
                    .iter()
                    .any(String::is_empty)
                {
                    names.push(master_name(path));
                }
                for name in names {
                    if files.is_factored(old, &name)? {
                        return Err(CheckpointError::InvalidArgument(format!(
                            "`{name}` is an optimizer state saved whole with another shape than `{path}` \
                             (Adafactor's factored statistics), which cannot be cut into pieces offline; load the \
                             checkpoint at the new world size instead (load_checkpoint reshards it)"
                        )));
                    }
                    let data = files.read_range(old, &name, range.clone())?;
                    file.push(name, data);
                }
                for (field, value) in files.scalars_under(first, &state)? {
                    file.push_scalar(state_name(path, &field), value);
                }
            }
            file.write_file(&partial, rank)?;
        }
        let resharded = CheckpointMeta {
            world_size,
            entries,
            files: (0..world_size)
                .map(|r| read_digest(&partial, r))
                .collect::<Result<_, _>>()?,
            ..meta.clone()
        };
        finish(out, &resharded)?;
        Ok(resharded)
    })();
    if written.is_err() {
        discard(&partial);
    }
    written
}

/// The complete checkpoints directly inside `root` of its current lineage, oldest first: by
/// the number that ends the directory's name (`step-123` before `step-1000`), then by name.
///
/// The current lineage is the newest checkpoint's history (see [`Lineage`]): its run's
/// checkpoints and those of the runs it resumed, up to where each was resumed. Checkpoints of
/// other lineages (a run that was resumed from an earlier point, another run's) are not
/// listed; nor are those a resumed run set aside into `root/abandoned-<run>/`. When the newest
/// checkpoint has no lineage (saved by an earlier version), every complete checkpoint is
/// listed, as before; directories whose metadata cannot be read always are.
///
/// [`Lineage`]: super::Lineage
///
/// # Errors
/// [`CheckpointError::Io`] when `root` cannot be listed.
pub fn list(root: impl AsRef<Path>) -> Result<Vec<PathBuf>, CheckpointError> {
    let dirs = complete_dirs(root.as_ref())?;
    let Some(newest) = dirs.last() else {
        return Ok(dirs);
    };
    let Some(Some(current)) = lineage_of(newest) else {
        return Ok(dirs);
    };
    let upto = name_of(newest);
    Ok(dirs
        .into_iter()
        .filter(|dir| match lineage_of(dir) {
            None => true,
            Some(other) => current.contains(Some(&upto), &name_of(dir), other.as_ref()),
        })
        .collect())
}

/// The newest complete checkpoint of `root`'s current lineage (the last of [`list`]), or
/// `None` when there is none yet, `root` missing included: what a job restarted after a
/// failure resumes from (`burn-shard-run --max-restarts`, the examples' `--resume auto`).
///
/// # Errors
/// [`CheckpointError::Io`] when `root` exists but cannot be listed.
pub fn newest(root: impl AsRef<Path>) -> Result<Option<PathBuf>, CheckpointError> {
    let root = root.as_ref();
    if !root.exists() {
        return Ok(None);
    }
    Ok(list(root)?.pop())
}

/// Removes all but the `keep` newest complete checkpoints of `root`'s current lineage (see
/// [`list`]); returns the removed ones. Checkpoints of other lineages, those set aside into
/// `root/abandoned-<run>/`, and incomplete directories (a save in progress or failed) are left
/// alone. Call it on one rank, after a save has returned.
///
/// # Errors
/// [`CheckpointError::Io`].
pub fn keep_last(root: impl AsRef<Path>, keep: usize) -> Result<Vec<PathBuf>, CheckpointError> {
    let dirs = list(root)?;
    let old = dirs.len().saturating_sub(keep);
    let removed: Vec<PathBuf> = dirs.into_iter().take(old).collect();
    for dir in &removed {
        remove(dir)?;
    }
    Ok(removed)
}
