//! [`step_traffic`]: the bytes one rank sends per step, by group (ring volumes).

use crate::stage::Stage;

use super::dtype::ParamDtype;

/// Bytes one rank sends per optimizer step in its collectives, by group, from the ring
/// algorithms' volumes (each rank of a group of `n` sends `(n-1)/n` of the buffer for a
/// reduce-scatter or an all-gather, twice that for an all-reduce; NCCL's ring and the
/// in-process backend send these). See [`step_traffic`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepTraffic {
    /// ZeRO stage.
    pub stage: Stage,
    /// Ranks per shard group (`world_size / replicas`).
    pub shard_size: usize,
    /// Shard groups.
    pub replicas: usize,
    /// Bytes sent in the shard group's collectives (the gradients' reduction, the update's
    /// all-gather, stage 3's gathers): within a node when a group is a node's ranks.
    pub shard_group_bytes: f64,
    /// Bytes sent in the replicas' all-reduce of the gradient shard: what crosses nodes when a
    /// group is a node's ranks. 0 without replicas.
    pub replica_group_bytes: f64,
}

/// What one rank sends per optimizer step with `params` (`Ψ`) elements of `dtype` (bf16/f16:
/// 2 bytes, f32: 4; gradients and gathered parameters travel in it) on `world_size` ranks as
/// `replicas` shard groups ([`ShardConfig::with_replicas`](crate::ShardConfig::with_replicas);
/// 1: flat), at `stage`, with `S = world_size / replicas`, `R = replicas`, `b` bytes per
/// element:
///
/// | stage | shard group | replica group |
/// |---|---|---|
/// | 0 | all-reduce `2(S-1)/S·Ψ·b` | — (stage 0 takes no replicas) |
/// | 1 | all-reduce + all-gather `3(S-1)/S·Ψ·b` | all-reduce of the shard `2(R-1)/R·Ψ/S·b` |
/// | 2 | reduce-scatter + all-gather `2(S-1)/S·Ψ·b` | the same |
/// | 3 | 2 all-gathers + reduce-scatter `3(S-1)/S·Ψ·b` | the same |
///
/// Stage 3 counts two all-gathers (forward, and backward's re-gather with
/// `reshard_after_forward`); backward skips the re-gather of a weight whose input needs no
/// gradient (a first layer), so a model sends up to this. The small agreements of a step (a flag
/// per parameter) are not counted. PyTorch FSDP2's HSDP and DeepSpeed's MiCS have the same
/// volumes (Zhang et al. 2022, "MiCS: Near-linear Scaling for Training Gigantic Model on Public
/// Cloud").
///
/// # Panics
/// If `replicas` is 0 or does not divide `world_size`, if `replicas > 1` at stage 0, or if
/// `params` is negative or not finite.
pub fn step_traffic(params: f64, world_size: usize, replicas: usize, stage: Stage, dtype: ParamDtype) -> StepTraffic {
    assert!(
        replicas > 0 && world_size.is_multiple_of(replicas),
        "{replicas} replicas do not divide world size {world_size}"
    );
    assert!(replicas == 1 || stage != Stage::Zero, "stage 0 takes no replicas");
    assert!(
        params.is_finite() && params >= 0.0,
        "parameter count must be a finite number >= 0, got {params}"
    );
    let shard_size = world_size / replicas;
    let (s, r, b) = (shard_size as f64, replicas as f64, dtype.element_bytes());
    let ring = |n: f64| (n - 1.0) / n;
    let passes = match stage {
        Stage::Zero => 2.0,
        Stage::One | Stage::Three => 3.0,
        Stage::Two => 2.0,
    };
    StepTraffic {
        stage,
        shard_size,
        replicas,
        shard_group_bytes: passes * ring(s) * params * b,
        replica_group_bytes: 2.0 * ring(r) * params / s * b,
    }
}
