//! [`NvmeOffload`]: where and how the optimizer state is swapped to disk.

use std::path::PathBuf;

use crate::error::ShardError;

/// Keeps the optimizer state and the `f32` master weights on a local disk between steps
/// (ZeRO-Infinity's NVMe offload of the optimizer state, Rajbhandari et al., SC21; DeepSpeed's
/// `offload_optimizer: {device: nvme, nvme_path}`): the settings of [`Home::Disk`](crate::Home::Disk),
/// given to [`ShardConfig::with_optimizer_state_on`](crate::ShardConfig::with_optimizer_state_on)
/// at any stage and with any Burn optimizer (on an accelerator the state is read into host
/// memory and stepped there, as DeepSpeed's CPU Adam does).
/// [`ShardConfig::with_params_on`](crate::ShardConfig::with_params_on) takes the same settings
/// for stage 3's parameter shard file (its own file, in the same or another directory).
///
/// Each rank keeps one swap file, `burn-shard-rank{rank}.swap` in `path`, holding the state of
/// the parameter pieces it steps (for Adam with `f32` parameters 8 bytes per element it steps,
/// 12 with `bf16`/`f16` and their masters: the ZeRO paper's `K`). The step reads each piece's
/// state ahead of stepping it, in stepping order (`io_threads` threads, at most `max_in_flight`
/// reads in flight) and writes it back behind the step (at most `max_in_flight` writes in
/// flight), so host memory holds the pieces in flight instead of the whole state. Between
/// steps nothing of the state is in memory
/// ([`MemoryReport::disk_bytes`](crate::MemoryReport::disk_bytes) counts it instead).
///
/// Costs: every step reads and writes the whole state once (for Adam with `f32` parameters
/// `8Ψ/N` bytes each way per rank, `N` ranks, `Ψ` parameters; `12Ψ/N` with masters), so a step
/// takes at least those bytes over the disk's bandwidth; the reads and writes overlap the
/// update of the other pieces. Checkpoints are the same files as without offload and load into
/// either; a save reads the state from the swap file one tensor at a time, and a load writes it
/// there one piece at a time, beside the live state (made live once every rank has written all
/// of its own, so a failed load changes nothing). The next load reuses the replaced state's
/// space, so a job that loads a checkpoint needs room for twice the state.
///
/// The files are created at `init` (an existing one from a job that was killed is reused), are
/// locked for the job's lifetime so that a second job given the same `path` is refused, and are
/// removed when the optimizer is dropped, also after an error.
///
/// # Errors (at `init`, on every rank)
/// [`ShardError::Nvme`](crate::ShardError::Nvme) when `path` is not an existing directory,
/// cannot be written, or is in use by another job; [`ShardError::InvalidConfig`](crate::ShardError::InvalidConfig)
/// when `io_threads` or `max_in_flight` is 0.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NvmeOffload {
    /// The directory of the swap files: an existing, writable directory on a local disk (an
    /// NVMe drive for speed), with room for this node's ranks' optimizer state. Each job needs
    /// its own.
    pub path: PathBuf,
    /// Threads per rank that read and write the swap file (default 2), or the parameter shard
    /// file.
    #[serde(default = "defaults::io_threads")]
    pub io_threads: usize,
    /// Pieces (one parameter's optimizer state and master each) read ahead at once, and
    /// written behind at once, per rank (default 4): host memory holds at most twice this many
    /// pieces beyond the one being stepped. For the parameter shard file: the shard writes
    /// queued at once per rank (each holds its shard's bytes until written).
    #[serde(default = "defaults::max_in_flight")]
    pub max_in_flight: usize,
}

mod defaults {
    pub(super) fn io_threads() -> usize {
        2
    }

    pub(super) fn max_in_flight() -> usize {
        4
    }
}

impl NvmeOffload {
    /// Swap files in `path`, with 2 I/O threads and 4 pieces in flight per rank.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            io_threads: defaults::io_threads(),
            max_in_flight: defaults::max_in_flight(),
        }
    }

    /// Sets the I/O threads per rank.
    pub fn with_io_threads(mut self, io_threads: usize) -> Self {
        self.io_threads = io_threads;
        self
    }

    /// Sets the pieces in flight per rank.
    pub fn with_max_in_flight(mut self, max_in_flight: usize) -> Self {
        self.max_in_flight = max_in_flight;
        self
    }

    /// # Errors
    /// [`ShardError::InvalidConfig`] when `io_threads` or `max_in_flight` is 0.
    pub(crate) fn check(&self) -> Result<(), ShardError> {
        if self.io_threads == 0 || self.max_in_flight == 0 {
            return Err(ShardError::InvalidConfig(format!(
                "NvmeOffload needs at least one I/O thread and one piece in flight, got io_threads = {} and \
                 max_in_flight = {}",
                self.io_threads, self.max_in_flight
            )));
        }
        Ok(())
    }
}

/// A directory alone: [`NvmeOffload::new`] with the default I/O settings.
impl From<PathBuf> for NvmeOffload {
    fn from(path: PathBuf) -> Self {
        Self::new(path)
    }
}

/// A directory alone: [`NvmeOffload::new`] with the default I/O settings.
impl From<&PathBuf> for NvmeOffload {
    fn from(path: &PathBuf) -> Self {
        Self::new(path.clone())
    }
}

/// A directory alone: [`NvmeOffload::new`] with the default I/O settings.
impl From<&std::path::Path> for NvmeOffload {
    fn from(path: &std::path::Path) -> Self {
        Self::new(path)
    }
}

/// A directory alone: [`NvmeOffload::new`] with the default I/O settings.
impl From<String> for NvmeOffload {
    fn from(path: String) -> Self {
        Self::new(path)
    }
}

/// A directory alone: [`NvmeOffload::new`] with the default I/O settings.
impl From<&str> for NvmeOffload {
    fn from(path: &str) -> Self {
        Self::new(path)
    }
}
