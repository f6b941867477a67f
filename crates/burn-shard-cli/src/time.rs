//! `burn-shard estimate --time`: the step time of every stage, flat and with one shard group per
//! node, on a cluster the user describes (`burn_shard::estimate::step_time`), and the pick.

use burn_shard::Stage;
use burn_shard::estimate::{self, ComputeProfile, GB, Links, OffloadTarget, ParamDtype, step_time};
use clap::Args;

/// The options of `--time`.
#[derive(Args, Debug)]
pub struct TimeArgs {
    /// Also predict the step time on a cluster for every stage, flat and with one shard group
    /// per node whatever --replicas says (burn_shard::estimate::step_time), and pick the
    /// fastest that fits; needs --nodes, --link-gbit and --step-s.
    #[arg(long, requires_all = ["nodes", "link_gbit", "step_s"])]
    pub time: bool,
    /// Nodes the ranks are on (ranks per node: --world-size / --nodes, consecutive ranks on a node).
    #[arg(long, requires = "time", value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    pub nodes: Option<u64>,
    /// Each node's link to the others in Gbit/s, each direction: best the bandwidth the
    /// `comm-bench` example measured on the cluster (what the collectives get), else the NIC's
    /// rate (400 for a 400 Gbit/s NIC), which makes the step a lower bound.
    #[arg(long, requires = "time", value_parser = positive)]
    pub link_gbit: Option<f64>,
    /// One-way latency between two nodes in microseconds: half a measured round trip of a small
    /// message.
    #[arg(long, requires = "time", default_value_t = 5.0, value_parser = at_least_zero)]
    pub latency_us: f64,
    /// Seconds per step with no collective crossing nodes: measured on one node (or one
    /// rank) at the per-rank batch of the run planned.
    #[arg(long, requires = "time", value_parser = positive)]
    pub step_s: Option<f64>,
    /// Collective calls per step that cross nodes, one after another (the latency term;
    /// `CommStats::total_calls` over a step); default 0.
    #[arg(long, requires = "time", default_value_t = 0.0, value_parser = at_least_zero)]
    pub calls_per_step: f64,
    /// Share of the time across nodes hidden behind compute, 0 to 1 (`CommStats::hidden_share`
    /// of a run; 0 for MPI, which runs each collective on the caller's thread).
    #[arg(long, requires = "time", default_value_t = 0.0, value_parser = share)]
    pub hidden_share: f64,
    /// Device memory per rank in GB (1e9 bytes): the pick leaves out what does not fit.
    #[arg(long, requires = "time", value_parser = positive)]
    pub device_gb: Option<f64>,
}

fn number(s: &str) -> Result<f64, String> {
    s.trim()
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite())
        .ok_or_else(|| format!("`{s}` is not a finite number"))
}

fn positive(s: &str) -> Result<f64, String> {
    number(s).and_then(|v| {
        if v > 0.0 {
            Ok(v)
        } else {
            Err(format!("`{s}`: give a number above 0"))
        }
    })
}

fn at_least_zero(s: &str) -> Result<f64, String> {
    number(s).and_then(|v| {
        if v >= 0.0 {
            Ok(v)
        } else {
            Err(format!("`{s}`: give 0 or more"))
        }
    })
}

fn share(s: &str) -> Result<f64, String> {
    number(s).and_then(|v| {
        if (0.0..=1.0).contains(&v) {
            Ok(v)
        } else {
            Err(format!("`{s}`: give a share from 0 to 1"))
        }
    })
}

/// One stage and mesh of the prediction.
struct Row {
    stage: Stage,
    replicas: usize,
    /// Model state per rank in bytes (on the device).
    memory: f64,
    time: estimate::StepTime,
}

/// Prints the predicted step of every stage in `stages`, flat and with one shard group per
/// node, and the pick.
///
/// # Errors
/// The nodes do not divide the world size, or the model refuses the inputs.
pub fn print_time(
    args: &TimeArgs,
    (params, world_size): (f64, usize),
    stages: &[Stage],
    dtype: ParamDtype,
    offload: OffloadTarget,
) -> Result<(), String> {
    let (Some(nodes), Some(gbit), Some(step_s)) = (args.nodes, args.link_gbit, args.step_s) else {
        return Err("--time needs --nodes, --link-gbit and --step-s".into());
    };
    let nodes = nodes as usize;
    if !world_size.is_multiple_of(nodes) {
        return Err(format!(
            "--nodes {nodes} does not divide --world-size {world_size}: give the same number of ranks to every node"
        ));
    }
    let links = Links {
        nodes,
        ranks_per_node: world_size / nodes,
        bytes_per_s: gbit * 1e9 / 8.0,
        latency_s: args.latency_us * 1e-6,
    };
    let compute = ComputeProfile {
        step_s,
        calls_across: args.calls_per_step,
        hidden_share: args.hidden_share,
    };
    let meshes: Vec<usize> = if nodes > 1 { vec![1, nodes] } else { vec![1] };
    let mut rows = Vec::new();
    for &stage in stages {
        for &replicas in &meshes {
            if replicas > 1 && stage == Stage::Zero {
                continue;
            }
            let time = step_time(params, stage, replicas, dtype, &links, &compute).map_err(|e| e.to_string())?;
            let memory = estimate::zero_formula(params, world_size / replicas, stage, dtype, offload).device_bytes();
            rows.push(Row {
                stage,
                replicas,
                memory,
                time,
            });
        }
    }
    println!();
    println!(
        "Step time on {nodes} node(s) x {} ranks, {gbit} Gbit/s and {} us between nodes, {step_s} s per step without the \
         link, {} calls per step across, {:.0}% of it hidden:",
        links.ranks_per_node,
        args.latency_us,
        args.calls_per_step,
        args.hidden_share * 100.0
    );
    println!(
        "{:<7}  {:<22}  {:>14}  {:>16}  {:>10}  {:>10}  {:>10}",
        "", "mesh", "state GB/rank", "GB/link/step", "transfer s", "latency s", "step s"
    );
    let mesh = |replicas: usize| {
        if replicas == 1 {
            "flat".to_string()
        } else {
            format!("{replicas} groups of {}", world_size / replicas)
        }
    };
    for r in &rows {
        println!(
            "{:<7}  {:<22}  {:>14.3}  {:>16.3}  {:>10.4}  {:>10.4}  {:>10.4}",
            format!("stage {}", r.stage),
            mesh(r.replicas),
            r.memory / GB,
            r.time.link_bytes / GB,
            r.time.transfer_s,
            r.time.latency_s,
            r.time.step_s
        );
    }
    let fits = |r: &&Row| args.device_gb.is_none_or(|gb| r.memory <= gb * GB);
    let pick = rows.iter().filter(fits).min_by(|a, b| {
        a.time
            .step_s
            .total_cmp(&b.time.step_s)
            .then(a.memory.total_cmp(&b.memory))
    });
    if let Some(r) = pick {
        let tied: Vec<String> = rows
            .iter()
            .filter(fits)
            .filter(|o| o.time.step_s == r.time.step_s && (o.stage, o.replicas) != (r.stage, r.replicas))
            .map(|o| format!("stage {}, {}", o.stage, mesh(o.replicas)))
            .collect();
        if !tied.is_empty() {
            println!(
                "tie: {} predict the same step (one --step-s for every stage, the same bytes across nodes); the least \
                 memory wins",
                tied.join("; ")
            );
        }
    }
    match pick {
        Some(r) => println!(
            "pick: stage {}, {}: {:.4} s per step, {:.3} GB of model state per rank{}",
            r.stage,
            mesh(r.replicas),
            r.time.step_s,
            r.memory / GB,
            args.device_gb.map_or(String::new(), |gb| format!(" (of {gb} GB)"))
        ),
        None => println!(
            "pick: none fits in {} GB per rank; add nodes, offload (--offload), or a larger device",
            args.device_gb.unwrap_or_default()
        ),
    }
    println!(
        "Extrapolated: the step without the link is taken as measured, so the per-rank batch and device must be those \
         of the run planned; collectives are rings over the ranks in node order (NCCL's trees for small messages are \
         not modelled); the link's protocol overhead, the host CPU a TCP transport takes and congestion between jobs are left \
         out, unless --link-gbit is what comm-bench measured. On a cluster of network namespaces over TCP (OpenMPI) \
         it predicted 0.76-1.02 of the measured steps from comm-bench's bandwidth, and 0.57-0.88 from the links' \
         rate (docs/clusters.md)."
    );
    Ok(())
}
