//! How ranks that each did their part of an operation agree on its outcome: one all-reduce of
//! one flag per rank (or per slot), so that every rank takes the same branch. The step (which
//! slots got a gradient on some rank, which buckets it still reduces, whether every rank's disk
//! reads and writes succeeded), `map_params` and each phase of a checkpoint save or load ask
//! these functions (the one other agreement, that every rank built the same layout, is
//! `model::layout::check_same_layout`, below this layer).
//!
//! Each is a collective: every rank calls it at the same point with flags of the same length.

use std::path::PathBuf;

use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_shard_comm::{Collective, ReduceOp};

use crate::error::{CheckpointError, ShardError};
use crate::optim::master::MasterWeightStep;
use crate::step::slot_state::SlotStates;
use crate::step::stage_plan::StagePlan;

/// `flags` OR-ed over the ranks: `[flags.len()]` booleans, sent as one `f32` all-reduce (sum) on
/// `device`.
///
/// # Errors
/// [`ShardError::Comm`] when the all-reduce fails.
pub(crate) fn any_rank(comm: &dyn Collective, flags: &[bool], device: &Device) -> Result<Vec<bool>, ShardError> {
    let values: Vec<f32> = flags.iter().map(|&g| if g { 1.0 } else { 0.0 }).collect();
    let n = values.len();
    // `f32` whatever the device's default float dtype.
    let summed = comm.all_reduce(
        Tensor::from_data(TensorData::new(values, [n]), (device, DType::F32)),
        ReduceOp::Sum,
    )?;
    let summed: Vec<f32> = summed.into_data().convert::<f32>().iter::<f32>().collect();
    Ok(summed.iter().map(|&c| c > 0.0).collect())
}

/// Where the small agreement tensors of a phase without a model device live: Burn's `Flex` CPU
/// device, or the device the collective requires (NCCL: its GPU, which takes no host tensor).
pub(crate) fn flag_device(comm: &dyn Collective) -> Device {
    comm.required_device().unwrap_or_else(Device::flex)
}

/// `values` (one `u64` each) summed over the ranks, wrapping: one `f32` all-reduce of their
/// bytes on [`flag_device`]. A sum of bytes over fewer than 65 793 ranks stays
/// below 2^24, where `f32` counts exactly, and the byte sums recombine into the wrapping sum of
/// the `u64`s. With zeros on every rank but one, every rank gets that rank's values.
///
/// # Errors
/// [`ShardError::Comm`] when the all-reduce fails.
pub(crate) fn sum_u64(comm: &dyn Collective, values: &[u64]) -> Result<Vec<u64>, ShardError> {
    let bytes: Vec<f32> = values.iter().flat_map(|v| v.to_le_bytes()).map(f32::from).collect();
    let n = bytes.len();
    let summed = comm
        .all_reduce(
            Tensor::<1>::from_data(TensorData::new(bytes, [n]), (&flag_device(comm), DType::F32)),
            ReduceOp::Sum,
        )?
        .into_data()
        .convert::<f32>();
    let summed: Vec<f32> = summed.iter::<f32>().collect();
    Ok(summed
        .chunks_exact(8)
        .map(|limbs| {
            limbs.iter().enumerate().fold(0u64, |sum, (j, &limb)| {
                sum.wrapping_add((limb as u64).wrapping_shl(8 * j as u32))
            })
        })
        .collect())
}

/// A failed collective file operation's clean-up, once every rank has reached the failure
/// through [`agree`]: rank 0 runs `discard` (removes `DIR.partial`), and a barrier keeps every
/// rank from returning before the removal (none when the group itself failed).
pub(crate) fn after_failed_save(comm: &dyn Collective, error: &ShardError, discard: impl FnOnce()) {
    if comm.rank() == 0 {
        discard();
    }
    if !matches!(error, ShardError::Comm(_)) {
        let _ = comm.barrier();
    }
}

/// The ranks that passed `failed = true`, in increasing order (one all-reduce of
/// `world_size` flags on `device`).
///
/// # Errors
/// [`ShardError::Comm`] when the all-reduce fails.
pub(crate) fn failed_ranks(comm: &dyn Collective, failed: bool, device: &Device) -> Result<Vec<usize>, ShardError> {
    let mut flags = vec![false; comm.world_size()];
    flags[comm.rank()] = failed;
    Ok((any_rank(comm, &flags, device)?.into_iter().enumerate())
        .filter_map(|(rank, failed)| failed.then_some(rank))
        .collect())
}

/// Ends one step of a collective file operation (`op`, e.g. "save_checkpoint") on every rank
/// with the same outcome: a rank that failed returns its own error, every other rank
/// [`CheckpointError::PeerFailed`] naming the failed ranks. No rank is left waiting, and the
/// group stays usable. The flags travel on [`flag_device`] (a checkpoint's phases involve no
/// accelerator where the collective allows it).
///
/// # Errors
/// `result`'s own error, [`CheckpointError::PeerFailed`] (in [`ShardError::Checkpoint`]), or
/// [`ShardError::Comm`] when the all-reduce fails.
pub(crate) fn agree<T>(comm: &dyn Collective, result: Result<T, ShardError>, op: &str) -> Result<T, ShardError> {
    let failed = failed_ranks(comm, result.is_err(), &flag_device(comm))?;
    match result {
        Ok(_) if !failed.is_empty() => Err(CheckpointError::PeerFailed {
            op: op.to_string(),
            ranks: failed,
        }
        .into()),
        result => result,
    }
}

/// NVMe offload (of the optimizer state or of the stage-3 shards): gives a phase (`when`, e.g.
/// "in this step") the same outcome on every rank. A rank whose own reads or writes failed
/// (`own`) returns its error; the others return [`ShardError::Nvme`] naming those ranks, with
/// `dir` (this rank's swap or shard-file directory) as the path.
///
/// # Errors
/// As above, or [`ShardError::Comm`] when the all-reduce fails.
pub(crate) fn agree_on_disk(
    comm: &dyn Collective,
    own: Result<(), ShardError>,
    device: &Device,
    when: &str,
    dir: PathBuf,
) -> Result<(), ShardError> {
    let failed = failed_ranks(comm, own.is_err(), device);
    // This rank's own error first: it names the cause, a failed all-reduce does not.
    own?;
    let failed = failed?;
    match failed.is_empty() {
        true => Ok(()),
        false => Err(ShardError::Nvme {
            path: dir,
            reason: format!(
                "rank(s) {failed:?} could not read or write their swap files {when} (this rank's files are fine)"
            ),
            fix: "see those ranks' errors; then resume from the last checkpoint".into(),
        }),
    }
}

/// The directory a disk agreement's errors name for this rank: the optimizer-state swap file's
/// when the state is offloaded to NVMe, else the stage-3 shard file's (empty without either).
pub(crate) fn disk_dir<O: MasterWeightStep>(slots: &SlotStates<O>, plan: &StagePlan) -> PathBuf {
    slots.swap_dir().unwrap_or_else(|| plan.params().shard_dir())
}

/// `world_size / Σ items` over every rank of `world` (every rank calls it at the same point): the
/// factor that turns the mean over the ranks of their summed gradients into the gradient of the
/// mean over every item (`ShardedOptimizer::step_with_items`, `sharded_optimizer/items.rs`).
///
/// # Errors
/// [`ShardError::Comm`] when the all-reduce fails; [`ShardError::InvalidConfig`] when the total
/// is 0.
pub(crate) fn item_scale(world: &dyn Collective, items: u64) -> Result<f32, ShardError> {
    let total = sum_u64(world, &[items])?[0];
    if total == 0 {
        return Err(ShardError::InvalidConfig(
            "step_with_items: every rank passed 0 items, so there is no mean to take and the step is refused \
             (as every failed step, it stops the group); call step_with_items only for a step with items, \
             passing the number of items (samples or tokens) each rank's summed loss covers"
                .to_string(),
        ));
    }
    Ok((world.world_size() as f64 / total as f64) as f32)
}
