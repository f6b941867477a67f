//! The checkpoint format in one place: its version, the names of a checkpoint's files and of the
//! tensors in a rank file, and the steps that write a checkpoint directory atomically. The
//! writer, the reader, the lineage, the resharding and the tools take them from here; this
//! module imports none of them.
//!
//! A save goes [`begin`] (clear leftovers, create `DIR.partial`), the rank files, then
//! [`finish`] (metadata, completion marker, rename to `DIR`, fsync of the parent); a failed save
//! calls [`discard`]. Every file is written with [`write_atomically`] or synced before the
//! directory that holds it is.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::CheckpointError;

/// The newest version of the layout described here; a reader reads it and every earlier one,
/// and refuses later ones. Version 2 adds entries held by fingerprint alone (`base` in the
/// metadata): a writer writes it only for such a checkpoint, and version 1 otherwise, so that
/// earlier readers refuse what they would misread and read everything else. Optional fields
/// added within a version (`loss_scaler`, `lineage`) do not change it: readers ignore them,
/// and checkpoints without them still load.
pub const FORMAT_VERSION: u32 = 2;

/// The version a checkpoint is written with: 2 when it holds some entry by fingerprint alone,
/// else 1 (see [`FORMAT_VERSION`]).
pub(crate) fn version_for(refers_to_base: bool) -> u32 {
    if refers_to_base { 2 } else { 1 }
}

/// The metadata file.
pub(crate) const META: &str = "meta.json";
/// The learning-rate scheduler's record (optional), written by rank 0.
pub(crate) const SCHEDULER: &str = "scheduler.bpk";
/// The completion marker, written last.
pub(crate) const COMPLETE: &str = "COMPLETE";
/// What the names of the rank files and their digests start with.
const RANK_PREFIX: &str = "rank-";

/// `rank-R.bpk`.
pub(crate) fn rank_file(rank: usize) -> String {
    format!("{RANK_PREFIX}{rank}.bpk")
}

/// `rank-R.sha256`: `HEX BYTES`, written after the rank file.
pub(crate) fn digest_file(rank: usize) -> String {
    format!("{RANK_PREFIX}{rank}.sha256")
}

/// `param/PATH`: the values of the entry at module path `path`.
pub(crate) fn param_name(path: &str) -> String {
    format!("param/{path}")
}

/// `state/PATH/`: what the names of the optimizer state of the entry at `path` start with.
pub(crate) fn state_prefix(path: &str) -> String {
    format!("state/{path}/")
}

/// `state/PATH/FIELD`: one field of the optimizer state of the entry at `path`, in Burn's
/// `RecordState` flattening (`momentum.moment_1`, `momentum.time`, ...).
pub(crate) fn state_name(path: &str, field: &str) -> String {
    format!("{}{field}", state_prefix(path))
}

/// `master/PATH`: the `f32` master of the `bf16`/`f16` entry at `path`.
pub(crate) fn master_name(path: &str) -> String {
    format!("master/{path}")
}

/// What the name of a directory a save is writing ends with.
const PARTIAL_SUFFIX: &str = ".partial";

/// `dir` with `.partial` appended: where a save writes before it is complete.
pub(crate) fn partial_dir(dir: &Path) -> PathBuf {
    let mut name = dir.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(PARTIAL_SUFFIX);
    dir.with_file_name(name)
}

/// Whether `dir`'s name is that of a save's working directory (`DIR.partial`).
pub(crate) fn is_partial(dir: &Path) -> bool {
    dir.file_name()
        .is_some_and(|n| n.to_string_lossy().ends_with(PARTIAL_SUFFIX))
}

/// The one rule for "is this a checkpoint": a directory whose name is not a save's working
/// name (`DIR.partial`) and that holds the `COMPLETE` marker. A `DIR.partial` that holds
/// `COMPLETE` is a save killed between the marker and the rename (see [`finish`]): not a
/// checkpoint (the next save there removes it), whatever it holds. Every reader, lister and
/// remover asks this (also the examples' `--resume` and burn-shard-train's Learner).
pub fn is_checkpoint(dir: &Path) -> bool {
    dir.is_dir() && !is_partial(dir) && dir.join(COMPLETE).is_file()
}

/// Removes the checkpoint `dir`: its `COMPLETE` marker first, so that a removal interrupted
/// half-way leaves a directory [`is_checkpoint`] refuses, never a half checkpoint that counts.
/// A directory that is not a checkpoint (no marker) is removed as it is. Call it on one rank.
///
/// # Errors
/// [`CheckpointError::Io`] when the marker or the directory cannot be removed.
pub fn remove(dir: &Path) -> Result<(), CheckpointError> {
    match std::fs::remove_file(dir.join(COMPLETE)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(CheckpointError::io(dir, e)),
        _ => {}
    }
    std::fs::remove_dir_all(dir).map_err(|e| CheckpointError::io(dir, e))
}

/// The directory that holds the checkpoint directory `dir` (`.` for a bare name).
pub(crate) fn parent_of(dir: &Path) -> PathBuf {
    match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Refuses a checkpoint directory named `*.partial`, the name of a save in progress: such a
/// directory would never count as a checkpoint ([`is_checkpoint`]), and the next save beside it
/// would remove it. Asked by every rank before a save, and by [`begin`].
///
/// # Errors
/// [`CheckpointError::InvalidArgument`] naming the directory and the fix.
pub(crate) fn check_name(dir: &Path) -> Result<(), CheckpointError> {
    match is_partial(dir) {
        true => Err(CheckpointError::InvalidArgument(format!(
            "{}: a checkpoint's name cannot end in {PARTIAL_SUFFIX}, which names a save in progress (it would \
             never count as a checkpoint, and the next save there would remove it); choose another name",
            dir.display()
        ))),
        false => Ok(()),
    }
}

/// Starts a checkpoint directory: refuses a `dir` named `*.partial` (a save's working name) and
/// an existing `dir`, removes what saves that did not
/// finish left next to it (`*.partial`, see [`clear_leftovers`]) and creates `DIR.partial`.
/// Returns `DIR.partial`.
pub(crate) fn begin(dir: &Path) -> Result<PathBuf, CheckpointError> {
    check_name(dir)?;
    if dir.exists() {
        return Err(CheckpointError::Exists { dir: dir.to_path_buf() });
    }
    clear_leftovers(&parent_of(dir));
    let partial = partial_dir(dir);
    if partial.exists() {
        // What a save that failed left behind.
        std::fs::remove_dir_all(&partial).map_err(|e| CheckpointError::io(&partial, e))?;
    }
    std::fs::create_dir_all(&partial).map_err(|e| CheckpointError::io(&partial, e))?;
    Ok(partial)
}

/// The `DIR.partial` directories this process is still writing in the background
/// (background saves): not leftovers, whatever other saves into the same directory (another
/// optimizer's, a reshard's) find. Canonical paths.
static WRITING: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Marks a `DIR.partial` as being written while it lives.
pub(crate) struct Writing(Option<PathBuf>);

impl Writing {
    /// Marks `partial` (which exists).
    pub(crate) fn mark(partial: &Path) -> Self {
        let path = std::fs::canonicalize(partial).ok();
        if let Some(path) = &path {
            WRITING.lock().unwrap_or_else(|p| p.into_inner()).push(path.clone());
        }
        Self(path)
    }

    fn holds(path: &Path) -> bool {
        let Ok(path) = std::fs::canonicalize(path) else {
            return false;
        };
        WRITING.lock().unwrap_or_else(|p| p.into_inner()).contains(&path)
    }
}

impl Drop for Writing {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let mut writing = WRITING.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(i) = writing.iter().position(|p| *p == path) {
                writing.swap_remove(i);
            }
        }
    }
}

/// Completes a checkpoint whose rank files are in `DIR.partial`: writes `meta` as `meta.json`,
/// then the `COMPLETE` marker, then renames the directory to `dir` and syncs `dir`'s parent, so
/// that after a power loss the checkpoint is there whole or not at all (a rename is durable only
/// once its directory is synced).
pub(crate) fn finish(dir: &Path, meta: &impl Serialize) -> Result<(), CheckpointError> {
    let partial = partial_dir(dir);
    let json = serde_json::to_string_pretty(meta).expect("metadata serialises");
    write_atomically(&partial.join(META), json.as_bytes())?;
    write_atomically(&partial.join(COMPLETE), b"")?;
    std::fs::rename(&partial, dir)
        .and_then(|()| sync_dir(&parent_of(dir)))
        .map_err(|e| CheckpointError::io(dir, e))
}

/// Writes `bytes` to `path` through a temporary file, synced, renamed into place, and the
/// directory synced (so the rename survives a power loss).
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)
        .and_then(|_| std::fs::File::open(&tmp)?.sync_all())
        .and_then(|_| std::fs::rename(&tmp, path))
        .and_then(|_| sync_dir(&parent_of(path)))
        .map_err(|e| CheckpointError::io(path, e))
}

/// `fsync` of directory `dir`: makes the renames and creations in it durable.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Removes what saves that did not finish left in `root`: every `*.partial` directory that
/// holds only a save's files (rank files, digests, metadata, markers, temporary files); says
/// so with `tracing::warn!`. A `*.partial` directory holding anything
/// else, or that cannot be removed, is reported and left alone. Only one run saves into a
/// directory at a time, and its saves are collectives, so no save into `root` is in progress
/// here.
pub(crate) fn clear_leftovers(root: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for path in entries.filter_map(|e| e.ok().map(|e| e.path())) {
        if !path.is_dir() || !is_partial(&path) || Writing::holds(&path) {
            continue;
        }
        if !holds_only_save_files(&path) {
            tracing::warn!(
                "{} looks like an unfinished checkpoint save but holds other files: left alone; remove it by hand",
                path.display()
            );
            continue;
        }
        if let Err(e) = std::fs::remove_dir_all(&path) {
            tracing::warn!(
                "{} is left from a save that did not finish, and cannot be removed: {e}",
                path.display()
            );
            continue;
        }
        tracing::warn!(
            "removed {}: what a save that did not finish (a crashed process) left behind",
            path.display()
        );
        removed.push(path);
    }
    removed
}

/// Whether every entry of `dir` is a plain file a save writes.
fn holds_only_save_files(dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.into_iter().all(|e| {
        let Ok(e) = e else { return false };
        let name = e.file_name().to_string_lossy().into_owned();
        e.file_type().is_ok_and(|t| t.is_file())
            && (name.starts_with(RANK_PREFIX)
                || name.ends_with(".tmp")
                || [META, SCHEDULER, COMPLETE].contains(&name.as_str()))
    })
}

/// Removes the `DIR.partial` of a save that failed (best effort: a failure to remove it is
/// reported, and the next save removes it).
pub(crate) fn discard(partial: &Path) {
    if partial.exists()
        && let Err(e) = std::fs::remove_dir_all(partial)
    {
        tracing::warn!(
            "the failed save's {} could not be removed: {e}; the next save into its directory removes it",
            partial.display()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One rule: a directory with `COMPLETE` is a checkpoint unless its name is a save's working
    /// name; `remove` leaves no directory that counts; a save refuses a working name.
    #[test]
    fn a_checkpoint_is_a_complete_directory_not_named_partial() {
        let root = std::env::temp_dir().join(format!("burn-shard-unit-format-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let made = |name: &str, complete: bool| {
            let dir = root.join(name);
            std::fs::create_dir_all(&dir).unwrap();
            if complete {
                std::fs::write(dir.join(COMPLETE), b"").unwrap();
            }
            dir
        };
        assert!(is_checkpoint(&made("step-9", true)));
        assert!(!is_checkpoint(&made("step-10", false)), "no marker");
        let killed = made("step-12.partial", true);
        assert!(!is_checkpoint(&killed), "killed between the marker and the rename");
        assert_eq!(partial_dir(&root.join("step-12")), killed);
        assert!(check_name(&killed).is_err() && check_name(&root.join("step-12")).is_ok());
        assert!(!is_checkpoint(&root.join("absent")));
        remove(&root.join("step-9")).unwrap();
        assert!(!root.join("step-9").exists());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
