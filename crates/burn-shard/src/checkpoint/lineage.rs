//! A directory of checkpoints over runs: which checkpoints a resumed run sets aside, where they
//! go, and what a save finds left over from saves that did not finish.

use std::path::{Path, PathBuf};

use super::meta::{CheckpointMeta, Lineage, order};
use super::names::COMPLETE;
use crate::error::CheckpointError;

/// Prefix of the folder inside a checkpoint directory that holds the checkpoints a resumed run
/// set aside: `abandoned-<run id>`.
pub const ABANDONED_PREFIX: &str = "abandoned-";

/// The directories directly inside `root` with a completion marker, in [`order`].
pub(crate) fn complete_dirs(root: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root)
        .map_err(|e| CheckpointError::io(root, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join(COMPLETE).is_file())
        .collect();
    dirs.sort_by(|a, b| order(&name_of(a)).cmp(&order(&name_of(b))));
    Ok(dirs)
}

/// The last component of `dir` (of its canonical form for `.` and the like).
pub(crate) fn name_of(dir: &Path) -> String {
    dir.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .or_else(|| {
            let canonical = dir.canonicalize().ok()?;
            Some(canonical.file_name()?.to_string_lossy().into_owned())
        })
        .unwrap_or_default()
}

/// The lineage recorded in `dir`'s metadata: `None` when the metadata cannot be read (then
/// nothing is known about it), `Some(None)` for a checkpoint saved before lineages existed.
pub(crate) fn lineage_of(dir: &Path) -> Option<Option<Lineage>> {
    CheckpointMeta::read(dir).ok().map(|m| m.lineage)
}

/// The complete checkpoints of `root` that a run of `lineage` sets aside before saving there:
/// for a run resumed from a checkpoint, those that sort after it and are not of its history
/// (the later checkpoints of the run it resumed, of runs resumed from those, or of other runs);
/// none for a fresh run. Checkpoints whose metadata cannot be read are left where they are.
pub(crate) fn to_set_aside(root: &Path, lineage: &Lineage) -> Result<Vec<PathBuf>, CheckpointError> {
    let Some(parent) = &lineage.parent else {
        return Ok(Vec::new());
    };
    if !root.is_dir() {
        return Ok(Vec::new());
    }
    Ok(complete_dirs(root)?
        .into_iter()
        .filter(|dir| {
            let name = name_of(dir);
            order(&name) > order(parent)
                && lineage_of(dir).is_some_and(|other| !lineage.contains(None, &name, other.as_ref()))
        })
        .collect())
}

/// Where [`set_aside`] moves the checkpoints a run of id `run` sets aside in `root`.
pub(crate) fn abandoned_dir(root: &Path, run: &str) -> PathBuf {
    root.join(format!("{ABANDONED_PREFIX}{run}"))
}

/// Moves `dirs` (checkpoints of `root`) into `root/abandoned-<run>/`, each renamed whole (a
/// checkpoint is never half moved), and says so with `tracing::warn!`. Returns their new paths.
pub(crate) fn set_aside(root: &Path, lineage: &Lineage, dirs: &[PathBuf]) -> Result<Vec<PathBuf>, CheckpointError> {
    if dirs.is_empty() {
        return Ok(Vec::new());
    }
    let aside = abandoned_dir(root, &lineage.run);
    std::fs::create_dir_all(&aside).map_err(|e| CheckpointError::io(&aside, e))?;
    let mut moved = Vec::new();
    for dir in dirs {
        let to = aside.join(name_of(dir));
        if to.exists() {
            return Err(CheckpointError::Exists { dir: to });
        }
        std::fs::rename(dir, &to).map_err(|e| CheckpointError::io(dir, e))?;
        moved.push(to);
    }
    tracing::warn!(
        "this run resumed from {}, which is not the newest checkpoint of {}: moved the later ones of \
         another lineage ({}) into {} (nothing deleted; list, keep_last and --resume DIR no longer see them)",
        lineage.parent.as_deref().unwrap_or("?"),
        root.display(),
        dirs.iter().map(|d| name_of(d)).collect::<Vec<_>>().join(", "),
        aside.display()
    );
    Ok(moved)
}

/// Removes what saves that did not finish left in `root`: every `*.partial` directory other
/// than `keep` that holds only a save's files (rank files, digests, metadata, markers,
/// temporary files); says so with `tracing::warn!`. A `*.partial` directory holding anything
/// else, or that cannot be removed, is reported and left alone. Only one run saves into a
/// directory at a time, and its saves are collectives, so no save into `root` is in progress
/// here.
pub(crate) fn clear_leftovers(root: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for path in entries.filter_map(|e| e.ok().map(|e| e.path())) {
        if !path.is_dir() || !name_of(&path).ends_with(".partial") {
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
            && (name.starts_with("rank-")
                || name.ends_with(".tmp")
                || [super::names::META, super::names::SCHEDULER, COMPLETE].contains(&name.as_str()))
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
