//! The names of a checkpoint's files and of a save's working directory: the one place the
//! writer, the reader, the lineage and the tools take them from.

use std::path::{Path, PathBuf};

/// The metadata file.
pub(crate) const META: &str = "meta.json";
/// The learning-rate scheduler's record (optional), written by rank 0.
pub(crate) const SCHEDULER: &str = "scheduler.bpk";
/// The completion marker, written last.
pub(crate) const COMPLETE: &str = "COMPLETE";

/// `dir` with `.partial` appended: where a save writes before it is complete.
pub(crate) fn partial_dir(dir: &Path) -> PathBuf {
    let mut name = dir.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".partial");
    dir.with_file_name(name)
}
