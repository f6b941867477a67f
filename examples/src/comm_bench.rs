//! The collectives of a sharded step on their own, without compute: what bandwidth a cluster's
//! links give a training job, in the units `burn-shard estimate --time --link-gbit` takes
//! (`burn_shard::estimate::Links::bytes_per_s`). As nccl-tests' "bus bandwidth" does for one
//! collective, it divides the bytes a ring would carry by the measured time, so that the number
//! folds in everything the job's collectives meet and the link rate does not say: the MPI
//! library's algorithms, the protocol's headers, the host's TCP stack, a shaper's queue.
//!
//! Two patterns, those that cross the nodes' links in `estimate::step_time`:
//! - **flat** (`replicas = 1`): a reduce-scatter then an all-gather over all `W` ranks, the
//!   step of stage 2 (stage 1 adds an all-gather, stage 3 another: the same calls). A ring
//!   crosses each node's link once each way: the link carries one rank's ring volume,
//!   `2(W-1)/W · bytes` per iteration.
//! - **hybrid** (`replicas = nodes`, one shard group per node): an all-reduce in each replica
//!   group (`R` ranks, one per node), all `k` groups at once, as the replicas' gradient
//!   all-reduce: the link carries `k · 2(R-1)/R · bytes`.
//!
//! Source of the volumes: Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for
//! clusters of workstations", JPDC 69(2), 2009; of the bus bandwidth: NVIDIA's nccl-tests,
//! `doc/PERFORMANCE.md`.

use std::time::Instant;

use burn::prelude::*;
use burn_shard::Stage;
use burn_shard::comm::{CommError, Mesh, ReduceOp};
use burn_shard::estimate::{ComputeProfile, Links, ParamDtype, step_time};

use crate::gpu_bench::median;

/// What [`measure`] measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkBandwidth {
    /// Median seconds of one iteration (all `calls` calls, from a barrier to the barrier after
    /// them), over the timed iterations, on rank 0.
    pub iteration_s: f64,
    /// Bytes one node's link carries per iteration by the ring volumes (one direction; no
    /// headers).
    pub link_bytes: f64,
    /// `link_bytes / iteration_s`: bytes per second, what `Links::bytes_per_s` takes.
    pub link_bytes_per_s: f64,
}

/// Runs `iterations` (after `warmup` untimed ones) of the pattern of `mesh` (flat when it has
/// one replica, else hybrid; see the module docs) on `bytes` bytes of `f32` per rank, split into
/// `calls` calls, with `ranks_per_node` consecutive ranks per node, and returns the link
/// bandwidth. A collective: every rank of `mesh` calls it with the same arguments.
///
/// `bytes` is the buffer each rank reduces: flat, the whole flat parameter of a step
/// (`Ψ·4`); hybrid, one rank's shard (`Ψ·4/k`), as the replicas' all-reduce of stage 2-3.
/// Each call gets `bytes / calls` rounded down to a multiple of `4·W` (flat) or `4` (hybrid).
///
/// # Errors
/// [`CommError::InvalidMesh`] for `calls` or `iterations` of 0, a hybrid mesh whose replica
/// groups do not span `world_size / ranks_per_node` nodes, or a call smaller than one element
/// per rank; the collectives' errors.
pub fn measure(
    mesh: &Mesh,
    bytes: usize,
    calls: usize,
    (warmup, iterations): (usize, usize),
    ranks_per_node: usize,
) -> Result<LinkBandwidth, CommError> {
    let world = mesh.world();
    let w = world.world_size();
    let invalid = |what: String| Err(CommError::InvalidMesh(what));
    if calls == 0 || iterations == 0 || ranks_per_node == 0 || !w.is_multiple_of(ranks_per_node) {
        return invalid(format!(
            "{calls} calls, {iterations} iterations, {ranks_per_node} ranks per node of {w}: give 1 or more calls and \
             iterations, and ranks per node that divide the world size"
        ));
    }
    let nodes = w / ranks_per_node;
    let flat = mesh.replicas() == 1;
    if !flat && (mesh.replicas() != nodes || mesh.shard_size() != ranks_per_node) {
        return invalid(format!(
            "{} replicas of {} ranks on {nodes} nodes of {ranks_per_node}: the hybrid pattern is one shard group per \
             node",
            mesh.replicas(),
            mesh.shard_size()
        ));
    }
    let unit = if flat { w } else { 1 };
    let elements = bytes / 4 / calls / unit * unit;
    if elements == 0 {
        return invalid(format!(
            "{bytes} bytes in {calls} calls: less than one element per rank a call"
        ));
    }
    let device = Device::flex();
    let buffer = Tensor::<1>::ones([elements], &device);
    let mut times = Vec::with_capacity(iterations);
    for i in 0..warmup + iterations {
        world.barrier()?;
        let start = Instant::now();
        for _ in 0..calls {
            if flat {
                let shard = world.reduce_scatter(buffer.clone(), ReduceOp::Sum)?;
                let _ = world.all_gather(shard)?;
            } else {
                let _ = mesh.replicate().all_reduce(buffer.clone(), ReduceOp::Sum)?;
            }
        }
        // Until every rank's calls are done: the hybrid pattern's rings share a link, and
        // rank 0's ring may finish first.
        world.barrier()?;
        if i >= warmup {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    // The model's own count for a stage-2 step of the flat parameter these calls carry (hybrid:
    // each rank's buffer is a shard, 1/k of it): one place decides what crosses a link.
    let params = (elements * calls * if flat { 1 } else { ranks_per_node }) as f64;
    let links = Links {
        nodes,
        ranks_per_node,
        bytes_per_s: 1.0,
        latency_s: 0.0,
    };
    let compute = ComputeProfile {
        step_s: 1.0,
        calls_across: 0.0,
        hidden_share: 0.0,
    };
    let link_bytes = step_time(params, Stage::Two, mesh.replicas(), ParamDtype::F32, &links, &compute)
        .map_err(|e| CommError::InvalidMesh(e.to_string()))?
        .link_bytes;
    let iteration_s = median(&times);
    Ok(LinkBandwidth {
        iteration_s,
        link_bytes,
        link_bytes_per_s: link_bytes / iteration_s,
    })
}
