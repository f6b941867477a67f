//! What a [`ShardedOptimizer`] reports about its rank: the memory it holds, measured from live
//! tensors ([`MemoryReport`]), the elements it steps, and the bytes its NVMe offload moved.

use burn::module::Module;

use crate::hooks::exchange;
use crate::model::flat::{self, tensor_bytes};
use crate::model::memory::{MemoryReport, module_param_bytes};
use crate::optim::master::MasterWeightStep;
use crate::step::optimizer::ShardedOptimizer;

impl<O: MasterWeightStep> ShardedOptimizer<O> {
    /// This rank's memory, measured from the tensors held now (`model`'s parameters and the
    /// optimizer state) and during the last step (gradients, transient buffers).
    ///
    /// Optimizer state (moments, `f32` masters) counts as `optimizer_state_bytes` when its
    /// tensors are on the parameters' device and as `host_bytes` when they are elsewhere (in
    /// host memory, with [`Offload`](crate::Offload)), tensor by tensor; stage-3 shards count
    /// as `parameters_bytes` on the device, as `host_bytes` in host memory (with
    /// [`ShardConfig::offload_params`](crate::ShardConfig::offload_params)) and as `disk_bytes`
    /// in the shard file (with [`ShardConfig::nvme_offload_params`](crate::ShardConfig::nvme_offload_params)).
    pub fn memory_report<M: Module>(&self, model: &M) -> MemoryReport {
        let device = flat::plain_device(model).ok();
        let state = self.slots.bytes(device.as_ref());
        // Stage 3: shards by where they live (host memory with parameter offload, disk with
        // NVMe parameter offload); none at stages 0-2, whose parameters are whole.
        let (mut shards_on_device, mut shards_elsewhere, mut shards_on_disk) = (0, 0, 0);
        let shards = exchange::collect_shards(model);
        for shard in shards.values() {
            match shard.held() {
                None => shards_on_disk += shard.numel() * shard.dtype().size(),
                Some(held) if device.as_ref().is_none_or(|d| held.device() == *d) => {
                    shards_on_device += tensor_bytes(held)
                }
                Some(held) => shards_elsewhere += tensor_bytes(held),
            }
        }
        let parameters_bytes = shards_on_device + module_param_bytes(model, |id| shards.contains_key(id));
        MemoryReport {
            rank: self.world().rank(),
            world_size: self.world().world_size(),
            stage: self.stage().number(),
            parameters_bytes,
            gradients_bytes: self.last.gradients_bytes + self.pending.last_cycle_bytes(),
            optimizer_state_bytes: state.on_device,
            host_bytes: state.elsewhere + shards_elsewhere,
            disk_bytes: state.on_disk + shards_on_disk,
            temporary_peak_bytes: self.last.temporary_peak_bytes,
            checkpoint_staging_bytes: self.staged_bytes(),
        }
    }

    /// Elements of the parameters this rank steps (and keeps optimizer state for): every
    /// trainable element at stage 0, this rank's range of each bucket without its padding at
    /// stages 1-2, its shards at stage 3.
    pub fn stepped_numel(&self) -> usize {
        self.layout
            .buckets()
            .iter()
            .map(|bucket| {
                let range = self.plan.owned_range(bucket, self.comm.rank());
                range.end.min(bucket.numel).saturating_sub(range.start)
            })
            .sum()
    }

    /// With [`NvmeOffload`](crate::NvmeOffload): the bytes the last step read from and wrote to
    /// this rank's swap file, as `(read, written)` (each the whole state and masters of the
    /// pieces it stepped, once); with [`ShardConfig::nvme_offload_params`](crate::ShardConfig::nvme_offload_params)
    /// also those of its parameter shard file since the step before (the shards read by the
    /// gathers of forward and backward and by the update, and the updated shards written);
    /// `(0, 0)` without either and before the first step.
    pub fn nvme_io_bytes(&self) -> (u64, u64) {
        let io = self.slots.last_step_io();
        (
            io.read + self.last.param_io.read,
            io.written + self.last.param_io.written,
        )
    }

    /// With [`ShardConfig::nvme_offload_params`](crate::ShardConfig::nvme_offload_params): of
    /// the bytes read from this rank's parameter shard file since the step before (counted in
    /// [`ShardedOptimizer::nvme_io_bytes`]), those whose read was not started ahead of its use,
    /// so that the thread that needed them waited for the disk. In a pass of `U` units learned
    /// by the gather schedule these are the shards of its first two units (the one gathered and
    /// the one prefetched on entering it) and of parameters gathered outside units; the other
    /// units' shards are read while the unit two before computes. The step reads each bucket's
    /// gradient and parameter shards while the previous bucket is stepped, so there these are
    /// the first bucket's (its gradient shards once more when clipping or loss scaling
    /// measures their norm first). Shards whose write is still queued are taken from memory
    /// and count as neither. 0 without NVMe
    /// parameter offload and before the first step.
    pub fn nvme_read_on_demand_bytes(&self) -> u64 {
        self.last.param_io.read_on_demand
    }
}
