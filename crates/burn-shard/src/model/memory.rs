//! Per-rank memory accounting, measured from the tensors actually held.

use std::fmt;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;

use crate::model::flat::tensor_bytes;

/// Bytes one rank holds, measured from live tensors (shape × dtype size), not from a formula.
///
/// Compare with the ZeRO paper's model-state formula (Rajbhandari et al., 2020, §5.1): for `Ψ`
/// fp32 parameters and Adam on `N` ranks, optimizer state is `8Ψ` (stage 0) or `8Ψ/N`
/// (stages 1-3), gradients `4Ψ` (stages 0-1) or `4Ψ/N` (stages 2-3), parameters `4Ψ` (stages
/// 0-2) or `4Ψ/N` (stage 3), plus padding of fewer than `N` elements per bucket (stages 0-2)
/// or per parameter (stage 3).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// This rank (in the world: with hybrid sharding, not its rank in the shard group).
    pub rank: usize,
    /// Ranks in the job (with hybrid sharding the state is sharded over a shard group of
    /// `world_size / replicas` of them).
    pub world_size: usize,
    /// ZeRO stage (0 to 3).
    pub stage: u8,
    /// Bytes of every float parameter of the module (trainable and frozen) on its device; at
    /// stage 3 the shards this rank stores there (none with
    /// [`Home::Host`](crate::Home::Host) for the parameters, which keeps them in
    /// [`MemoryReport::host_bytes`]).
    pub parameters_bytes: usize,
    /// Bytes of the reduced gradient buffers held while the last step ran the optimizer
    /// (whole buckets for stages 0-1, this rank's shards for stage 2), plus the peak of the
    /// micro-batch gradient sums held by `ShardedOptimizer::accumulate` before it (unreduced
    /// and whole at stages 0-2, shards at stage 3); 0 with
    /// [`Home::Disk`](crate::Home::Disk) for the parameters, whose
    /// gradient shards go to disk as backward reduces them.
    pub gradients_bytes: usize,
    /// Bytes of the optimizer state this rank holds on the parameters' device (e.g. Adam's two
    /// moments, and the `f32` master weights of `bf16`/`f16` parameters); 0 with
    /// [`Home::Host`](crate::Home::Host), which keeps them in host memory ([`MemoryReport::host_bytes`]).
    pub optimizer_state_bytes: usize,
    /// Bytes of model state this rank holds in host memory, off the parameters' device: the
    /// optimizer state (moments and `f32` master weights) with [`Home::Host`](crate::Home::Host)
    /// (ZeRO-Offload), and the stage-3 parameter shards with
    /// [`Home::Host`](crate::Home::Host) for the parameters; 0 otherwise. Measured
    /// by the device each tensor is on, so a model on the host itself (Burn's `Flex` CPU device)
    /// counts its state as device-resident.
    pub host_bytes: usize,
    /// Bytes of optimizer state (moments and `f32` master weights) this rank keeps on disk
    /// between steps, with [`NvmeOffload`](crate::NvmeOffload) (ZeRO-Infinity), and of stage-3
    /// parameter shards with [`Home::Disk`](crate::Home::Disk) for the parameters
    /// (their values, not the file's free space); 0 otherwise. Not
    /// in memory, so in neither [`MemoryReport::model_state_bytes`] nor
    /// [`MemoryReport::total_bytes`].
    pub disk_bytes: usize,
    /// Peak bytes of transient buffers alive at once during the last step (the flat,
    /// not-yet-reduced gradient bucket, the parameter shard and the all-gathered bucket) on the
    /// parameters' device (host memory that parameter offload updates its shards in is not
    /// counted).
    /// Stage 3: the peak over the forward, backward and step that preceded the report of the
    /// gathered full parameters and full gradients alive at once (measured by liveness probes
    /// on their buffers, sampled at every all-gather and reduce-scatter).
    pub temporary_peak_bytes: usize,
    /// Host bytes of the checkpoint being written in the background
    /// ([`ShardedOptimizer::save_checkpoint`](crate::ShardedOptimizer::save_checkpoint) in the background):
    /// this rank's staged values, optimizer state and masters, reported until the save settles (at
    /// the first step after every rank's writer is done, or at `wait_for_checkpoint`);
    /// 0 without one. Not in [`MemoryReport::model_state_bytes`] nor
    /// [`MemoryReport::total_bytes`].
    pub checkpoint_staging_bytes: usize,
}

impl MemoryReport {
    /// Parameters + gradients + optimizer state on the device: the persistent model state
    /// resident on the parameters' device (what ZeRO partitions and what must fit in device
    /// memory). Optimizer state offloaded to host memory is not in it: see
    /// [`MemoryReport::host_bytes`] and [`MemoryReport::total_bytes`].
    pub fn model_state_bytes(&self) -> usize {
        self.parameters_bytes + self.gradients_bytes + self.optimizer_state_bytes
    }

    /// Persistent model state on the device and in host memory together:
    /// [`MemoryReport::model_state_bytes`] + [`MemoryReport::host_bytes`].
    pub fn total_bytes(&self) -> usize {
        self.model_state_bytes() + self.host_bytes
    }
}

impl fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const MIB: f64 = 1024.0 * 1024.0;
        write!(
            f,
            "rank {}/{} stage {}: params {:.2} MiB, grads {:.2} MiB, optim {:.2} MiB, temp peak {:.2} MiB",
            self.rank,
            self.world_size,
            self.stage,
            self.parameters_bytes as f64 / MIB,
            self.gradients_bytes as f64 / MIB,
            self.optimizer_state_bytes as f64 / MIB,
            self.temporary_peak_bytes as f64 / MIB,
        )?;
        if self.host_bytes > 0 {
            write!(f, ", host (offloaded) {:.2} MiB", self.host_bytes as f64 / MIB)?;
        }
        if self.disk_bytes > 0 {
            write!(f, ", disk (NVMe) {:.2} MiB", self.disk_bytes as f64 / MIB)?;
        }
        if self.checkpoint_staging_bytes > 0 {
            write!(
                f,
                ", checkpoint staged {:.2} MiB",
                self.checkpoint_staging_bytes as f64 / MIB
            )?;
        }
        Ok(())
    }
}

/// Bytes of every float parameter of `module` except those `skip` names (stage 3's
/// placeholders, whose shards are counted instead).
pub(crate) fn module_param_bytes<M: Module>(module: &M, skip: impl Fn(&ParamId) -> bool) -> usize {
    struct Bytes<F>(usize, F);
    impl<F: Fn(&ParamId) -> bool> ModuleVisitor for Bytes<F> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !(self.1)(&param.id) {
                self.0 += tensor_bytes(&param.val());
            }
        }
    }
    let mut b = Bytes(0, skip);
    module.visit(&mut b);
    b.0
}

/// Tracks the transient bytes alive at once and their peak.
#[derive(Default, Debug)]
pub(crate) struct PeakTracker {
    live: usize,
    peak: usize,
}

impl PeakTracker {
    pub(crate) fn alloc(&mut self, bytes: usize) {
        self.live += bytes;
        self.peak = self.peak.max(self.live);
    }

    pub(crate) fn free(&mut self, bytes: usize) {
        self.live -= bytes;
    }

    pub(crate) fn peak(&self) -> usize {
        self.peak
    }
}
