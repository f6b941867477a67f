//! A directory of checkpoints over runs: which checkpoints a resumed run sets aside, and where
//! they go. (What a save finds left over from saves that did not finish is `format.rs`'s.)

use std::path::{Path, PathBuf};

use super::format::is_checkpoint;
use super::meta::{CheckpointMeta, Lineage, order};
use crate::error::CheckpointError;

/// Prefix of the folder inside a checkpoint directory that holds the checkpoints a resumed run
/// set aside: `abandoned-<run id>`.
pub const ABANDONED_PREFIX: &str = "abandoned-";

/// The checkpoints directly inside `root` ([`is_checkpoint`]), in [`order`].
pub(crate) fn complete_dirs(root: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root)
        .map_err(|e| CheckpointError::io(root, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| is_checkpoint(p))
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
