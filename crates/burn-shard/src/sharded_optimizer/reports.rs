//! What a [`ShardedOptimizer`] reports about its rank, behind one handle ([`RankReport`],
//! `optim.report()`): the memory it holds, measured from live tensors ([`MemoryReport`]), the
//! elements it steps, the bytes its NVMe offload moved, what the last step measured, the
//! checkpoints being written, and its state and masters.

use std::path::PathBuf;

use burn::module::Module;
use burn::tensor::Tensor;

use crate::fsdp::exchange;
use crate::model::flat::{self, tensor_bytes};
use crate::model::layout::FlatLayout;
use crate::model::memory::{MemoryReport, module_param_bytes};
use crate::optim::master::MasterWeightStep;
use crate::sharded_optimizer::optimizer::ShardedOptimizer;

impl<O: MasterWeightStep> ShardedOptimizer<O> {
    /// What this rank's optimizer reports: read-only, local (no collective), cheap to take
    /// again after each step.
    pub fn report(&self) -> RankReport<'_, O> {
        RankReport { optim: self }
    }
}

/// What one rank's [`ShardedOptimizer`] reports (`optim.report()`): its memory, the last step's
/// measurements, the NVMe traffic, the checkpoints in flight, and its layout, state and masters.
/// Every call is local to the rank and runs no collective.
pub struct RankReport<'a, O: MasterWeightStep> {
    optim: &'a ShardedOptimizer<O>,
}

impl<'a, O: MasterWeightStep> RankReport<'a, O> {
    /// This rank's memory, measured from the tensors held now (`model`'s parameters and the
    /// optimizer state) and during the last step (gradients, transient buffers).
    ///
    /// Optimizer state (moments, `f32` masters) counts as `optimizer_state_bytes` when its
    /// tensors are on the parameters' device and as `host_bytes` when they are elsewhere (in
    /// host memory, with [`Home::Host`](crate::Home::Host)), tensor by tensor; stage-3 shards count
    /// as `parameters_bytes` on the device, as `host_bytes` in host memory (with
    /// [`Home::Host`](crate::Home::Host) for the parameters) and as `disk_bytes`
    /// in the shard file (with [`Home::Disk`](crate::Home::Disk) for the parameters).
    pub fn memory<M: Module>(&self, model: &M) -> MemoryReport {
        let device = flat::plain_device(model).ok();
        let state = self.optim.slots.bytes(device.as_ref());
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
            rank: self.optim.world().rank(),
            world_size: self.optim.world().world_size(),
            stage: self.optim.stage().number(),
            parameters_bytes,
            gradients_bytes: self.optim.last.gradients_bytes + self.optim.pending.last_cycle_bytes(),
            optimizer_state_bytes: state.on_device,
            host_bytes: state.elsewhere + shards_elsewhere,
            disk_bytes: state.on_disk + shards_on_disk,
            temporary_peak_bytes: self.optim.last.temporary_peak_bytes,
            checkpoint_staging_bytes: self.optim.staged_bytes(),
        }
    }

    /// Elements of the parameters this rank steps (and keeps optimizer state for): every
    /// trainable element at stage 0, this rank's range of each bucket without its padding at
    /// stages 1-2, its shards at stage 3 and the whole parameters it owns there (those an
    /// optimizer reads whole, see [`RankReport::stepped_whole`]).
    pub fn stepped_numel(&self) -> usize {
        let (optim, rank) = (self.optim, self.optim.comm.rank());
        let flat: usize = optim
            .layout
            .buckets()
            .iter()
            .map(|bucket| {
                let range = optim.plan.owned_range(bucket, rank);
                bucket
                    .slots
                    .clone()
                    .filter(|&index| optim.owners.of(index).is_none())
                    .filter_map(|index| optim.layout.slots()[index].within(&range))
                    .map(|part| part.len())
                    .sum::<usize>()
            })
            .sum();
        let owned = (0..optim.layout.slots().len()).filter_map(|index| optim.owners.of(index));
        flat + owned
            .filter(|owner| owner.rank == rank)
            .map(|owner| owner.numel())
            .sum::<usize>()
    }

    /// The parameters this rank steps whole, those whose optimizer reads them whole (Muon,
    /// LAMB, Adafactor), as `(module path, full shape)` in layout order: each on one rank of the
    /// shard group at stages 1-3 (balanced by elements), every one of them at stage 0. Where
    /// their optimizer's work (Muon's Newton-Schulz) and state live.
    pub fn stepped_whole(&self) -> Vec<(String, Vec<usize>)> {
        let (optim, rank) = (self.optim, self.optim.comm.rank());
        let slots = optim.layout.slots().iter().enumerate();
        slots
            .filter(|(index, _)| optim.groups.optim(*index).needs_whole_params())
            .filter(|(index, slot)| match optim.owners.of(*index) {
                Some(owner) => owner.rank == rank,
                None => {
                    let bucket = &optim.layout.buckets()[slot.bucket];
                    slot.within(&optim.plan.owned_range(bucket, rank)).is_some()
                }
            })
            .map(|(index, slot)| (slot.path.clone(), optim.full_shape(index).to_vec()))
            .collect()
    }

    /// With [`NvmeOffload`](crate::NvmeOffload): the bytes the last step read from and wrote to
    /// this rank's swap file, as `(read, written)` (each the whole state and masters of the
    /// pieces it stepped, once); with [`Home::Disk`](crate::Home::Disk) for the parameters
    /// also those of its parameter shard file since the step before (the shards read by the
    /// gathers of forward and backward and by the update, and the updated shards written);
    /// `(0, 0)` without either and before the first step.
    pub fn nvme_io_bytes(&self) -> (u64, u64) {
        let io = self.optim.slots.last_step_io();
        (
            io.read + self.optim.last.param_io.read,
            io.written + self.optim.last.param_io.written,
        )
    }

    /// With [`Home::Disk`](crate::Home::Disk) for the parameters: of
    /// the bytes read from this rank's parameter shard file since the step before (counted in
    /// [`RankReport::nvme_io_bytes`]), those whose read was not started ahead of its use,
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
        self.optim.last.param_io.read_on_demand
    }

    /// Buckets whose reduction started inside backward, before the last `step` or `accumulate`
    /// was called (stages 0-2 with [`ShardConfig::overlap_comm`](crate::ShardConfig::overlap_comm),
    /// see [`crate::bucket`]): every bucket of [`RankReport::layout`] when the backward
    /// matched the learned one; 0 at the first step (which learns), for micro-batches given to
    /// `accumulate` as learned (not when a step was expected instead), at stage 3 and where
    /// buckets are reduced in the step.
    pub fn overlapped_buckets(&self) -> usize {
        self.optim.last.overlapped_buckets
    }

    /// The flat layout of the trainable parameters.
    pub fn layout(&self) -> &'a FlatLayout {
        &self.optim.layout
    }

    /// The global L2 norm of the gradient the last step applied: averaged over the ranks,
    /// divided by the loss scale, before any clipping (every trainable element of every rank
    /// counted once; the value PyTorch's `clip_grad_norm_` returns). Measured only when the step
    /// needs it: with [`ShardConfig::with_max_grad_norm`](crate::ShardConfig::with_max_grad_norm)
    /// (`f32::INFINITY` measures without clipping), a [`LossScaler`](crate::LossScaler), or clipping by norm in a
    /// group; `None` otherwise and before the first step. Non-finite after an overflow.
    pub fn last_grad_norm(&self) -> Option<f64> {
        self.optim.last.grad_norm
    }

    /// Wall time (seconds) of the optimizer's own steps in the last `step` on this rank: the
    /// update of the pieces and whole parameters it owns (Newton-Schulz for Muon's), without
    /// the reduction, the norms and the all-gather; with the state offloaded it includes the
    /// state's reads and copies to and from the host. On a backend that runs operations
    /// as they are called (Burn's CPU `Flex`) this is their compute; an asynchronous GPU
    /// backend returns before its kernels finish, so there it counts launches. 0 before the
    /// first step and after a skipped one.
    pub fn last_optimizer_seconds(&self) -> f64 {
        self.optim.last.optimizer_time.as_secs_f64()
    }

    /// Whether the last [`ShardedOptimizer::step`] updated the parameters: `false` when the
    /// [`LossScaler`](crate::LossScaler) skipped it because the gradient overflowed on some rank (the same answer
    /// on every rank), and before the first step. PyTorch's `GradScaler` users compare the scale
    /// before and after `update()` for the same purpose.
    ///
    /// A learning-rate schedule that should advance on applied steps only (warm-up counted in
    /// updates, not in batches) advances when this is `true`:
    ///
    /// ```ignore
    /// let lr = lr_at(applied, steps);            // the schedule's index: applied steps
    /// model = optim.step(lr, model, grads)?;
    /// if optim.report().last_step_applied() { applied += 1; }
    /// ```
    ///
    /// With a Burn `LrScheduler`, keep a clone from before `scheduler.step()` and put it back
    /// when the step was skipped.
    pub fn last_step_applied(&self) -> bool {
        self.optim.last.applied
    }

    /// The `f32` master weights of this rank's piece of each `bf16`/`f16` parameter of the
    /// layout (same pieces as [`RankReport::slot_states`], flat: `[numel]` for a parameter
    /// stepped whole); `None` for `f32`
    /// parameters and before a parameter's first gradient. They are initialised from the
    /// parameters then; after loading new parameter values later, call
    /// [`ShardedOptimizer::reset_master_weights`]. Empty (every entry `None`) with
    /// [`NvmeOffload`](crate::NvmeOffload), which keeps them on disk between steps.
    pub fn master_weights(&self) -> &'a [Option<Tensor<1>>] {
        &self.optim.slots.masters
    }

    /// Burn's optimizer state of each parameter of the layout ([`FlatLayout::slots`] order), for
    /// the piece of it this rank steps: the whole parameter (stage 0), its part of this rank's
    /// range of the bucket (stages 1-2; `None` when the range holds none of it) or this rank's
    /// shard (stage 3), except that a parameter an optimizer reads whole (Muon, LAMB,
    /// Adafactor; [`RankReport::stepped_whole`]) has its whole state on the rank that steps it
    /// and `None` elsewhere. `None` before the parameter's first gradient, and for every
    /// parameter with [`NvmeOffload`](crate::NvmeOffload), which keeps the states on disk
    /// between steps. Tensors are 1-D, the whole-parameter states' excepted (their optimizer's
    /// shapes behind the type-erased `State<1>`).
    pub fn slot_states(&self) -> &'a [Option<O::State<1>>] {
        &self.optim.slots.states
    }

    /// The directories of every checkpoint being written in the background, oldest first (at
    /// most `ShardConfig::with_saves_in_flight`).
    pub fn checkpoints_in_flight(&self) -> Vec<PathBuf> {
        self.optim.saves.dirs()
    }
}
