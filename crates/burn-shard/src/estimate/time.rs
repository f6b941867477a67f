//! The step time of a stage and mesh on a cluster of nodes ([`step_time`]): the alpha-beta
//! model of the collectives that cross nodes, added to a step measured without them.

use crate::error::ShardError;
use crate::stage::Stage;

use super::dtype::ParamDtype;
use super::traffic::step_traffic;

/// A cluster's nodes and the link between them, as the step-time model sees them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Links {
    /// Nodes `N`, 1 or more.
    pub nodes: usize,
    /// Ranks per node `k`: the world size is `N·k`, rank `r` on node `r / k`.
    pub ranks_per_node: usize,
    /// Each node's link bandwidth, each direction, in bytes per second (`1/β`; 1 Gbit/s is
    /// `1.25e8`). Above `0`.
    pub bytes_per_s: f64,
    /// One-way latency of a message between two nodes in seconds (`α`: half a measured round
    /// trip of a small message, `ping`'s for example). `0` or more.
    pub latency_s: f64,
}

/// What a step costs without the link between nodes: measured on one node (every rank's
/// collectives inside it), or given.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ComputeProfile {
    /// Seconds per step with no collective crossing a node (`t_c`). Above `0`.
    pub step_s: f64,
    /// Collective calls per step that cross nodes, one after another (the latency term's
    /// count): flat, every call of the step; hybrid, the replicas' all-reduces (one per
    /// bucket) and the world's small agreements. `CommStats::get(kind).calls` over a step
    /// counts them.
    pub calls_across: f64,
    /// Share of the inter-node time hidden behind compute, in `[0, 1]`
    /// (`CommStats::hidden_share` of a run; `0` where each collective runs on the caller's
    /// thread, as MPI's do).
    pub hidden_share: f64,
}

/// The predicted step, by part (see [`step_time`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepTime {
    /// Bytes each node's link carries per step, each direction (payload).
    pub link_bytes: f64,
    /// `link_bytes / bytes_per_s`, seconds.
    pub transfer_s: f64,
    /// `calls_across · messages · α`, seconds.
    pub latency_s: f64,
    /// The part of `transfer_s + latency_s` not hidden, seconds.
    pub exposed_s: f64,
    /// `compute.step_s + exposed_s`, seconds.
    pub step_s: f64,
}

/// The step time of `params` (`Ψ`) parameters at `stage`, in `dtype`, on `links.nodes` nodes of
/// `links.ranks_per_node` ranks as `replicas` shard groups, from a step measured without the
/// link (`compute`). Collectives are rings, as NCCL's and the in-process backend's (the
/// volumes of [`step_traffic`]); the ranks of a node are consecutive:
///
/// - **flat** (`replicas = 1`, one group over all `W = N·k` ranks): the ring crosses each
///   node's link once each way, so the link carries one rank's ring volume, `shard_group_bytes`
///   of [`step_traffic`] (`3(W-1)/W·Ψ·b` at stage 3); a call is `W-1` messages in a row (twice
///   for an all-reduce, counted as one call here).
/// - **hybrid, one group per node** (`replicas = N`): only the replicas' all-reduce crosses, `k`
///   rings of `N` ranks (one per rank of a node) over the same link: `k · replica_group_bytes`
///   (`2(N-1)/N·Ψ·b` for any `k`); `2(N-1)` messages a call.
///
/// Then `transfer = link_bytes / bytes_per_s`, `latency = calls_across · messages · α`, and
/// `step = t_c + (1 - hidden_share)·(transfer + latency)`: the alpha-beta (Hockney) model
/// (R. Hockney, "The communication challenge for MPP: Intel Paragon and Meiko CS-2", Parallel
/// Computing 20(3), 1994) with the ring volumes of Patarasuk and Yuan, "Bandwidth optimal
/// all-reduce algorithms for clusters of workstations", JPDC 69(2), 2009. It ignores what the
/// link's protocol adds (TCP/IP headers: about 3% at 1500-byte frames) and the compute the
/// collectives' own copies take.
///
/// # Errors
/// [`ShardError::InvalidConfig`] when `replicas` is neither 1 nor `links.nodes` (a group
/// spanning some nodes is not modelled), at stage 0 with replicas, for 0 nodes or ranks, or a
/// bandwidth, latency, step time or hidden share out of range.
pub fn step_time(
    params: f64,
    stage: Stage,
    replicas: usize,
    dtype: ParamDtype,
    links: &Links,
    compute: &ComputeProfile,
) -> Result<StepTime, ShardError> {
    let invalid = |what: String| Err(ShardError::InvalidConfig(what));
    let Links {
        nodes,
        ranks_per_node,
        bytes_per_s,
        latency_s,
    } = *links;
    if nodes == 0 || ranks_per_node == 0 {
        return invalid(format!(
            "{nodes} nodes of {ranks_per_node} ranks: give 1 or more of each"
        ));
    }
    if !(bytes_per_s > 0.0 && bytes_per_s.is_finite() && latency_s >= 0.0 && latency_s.is_finite()) {
        return invalid(format!(
            "bandwidth {bytes_per_s} bytes/s, latency {latency_s} s: give a positive bandwidth and a latency of 0 or more"
        ));
    }
    let finite = compute.step_s.is_finite() && compute.calls_across.is_finite();
    if !(finite && compute.step_s > 0.0 && compute.calls_across >= 0.0 && (0.0..=1.0).contains(&compute.hidden_share)) {
        return invalid(format!(
            "compute step {} s, {} calls, hidden share {}: give a finite positive step, a finite count of calls of 0 or \
             more, a share in [0, 1]",
            compute.step_s, compute.calls_across, compute.hidden_share
        ));
    }
    if !(params.is_finite() && params >= 0.0) {
        return invalid(format!("{params} parameters: give a finite count of 0 or more"));
    }
    if replicas != 1 && replicas != nodes {
        return invalid(format!(
            "{replicas} replicas on {nodes} nodes: the model covers flat (1) and one shard group per node ({nodes})"
        ));
    }
    if replicas > 1 && stage == Stage::Zero {
        return invalid("stage 0 takes no replicas".into());
    }
    let world = nodes * ranks_per_node;
    let (link_bytes, messages) = if nodes == 1 {
        (0.0, 0.0)
    } else if replicas == 1 {
        let traffic = step_traffic(params, world, 1, stage, dtype);
        (traffic.shard_group_bytes, (world - 1) as f64)
    } else {
        let traffic = step_traffic(params, world, replicas, stage, dtype);
        (
            ranks_per_node as f64 * traffic.replica_group_bytes,
            2.0 * (nodes - 1) as f64,
        )
    };
    let transfer_s = link_bytes / bytes_per_s;
    let latency = compute.calls_across * messages * latency_s;
    let exposed_s = (1.0 - compute.hidden_share) * (transfer_s + latency);
    Ok(StepTime {
        link_bytes,
        transfer_s,
        latency_s: latency,
        exposed_s,
        step_s: compute.step_s + exposed_s,
    })
}
