//! `cargo xtask cluster`: runs a command on every node of a cluster of network namespaces with
//! shaped links (`burn-shard-cluster`), optionally cutting one node's link for a while, and
//! removes everything it made when the command ends, fails or is interrupted (Ctrl-C).
//!
//! Each node's copy of the command gets `NODE_RANK` (0..), `NNODES`, `NODE_ADDR` (its address)
//! and `MASTER_ADDR` (node 0's), as a multi-node launcher expects: for example
//! `cargo xtask cluster --nodes 2 --rate-mbit 1000 -- target/release/burn-shard-run --nnodes 2
//! --node-rank '$NODE_RANK' ...` (through `sh -c` to expand them). The first node whose command
//! fails ends the run (the others are killed with the cluster). With `--mpirun K` the command
//! runs once instead, under OpenMPI's `mpirun` started in node 0, with K ranks on every node
//! (`Cluster::mpirun`: ranks of a node share memory, nodes talk across their links). Each node's
//! bytes sent and received on its link are printed at the end. `cargo xtask cluster -- clean`
//! removes what a killed run left.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use burn_shard_cluster::{Capabilities, Cluster, ClusterSpec, remove_leftovers};

/// Arguments of `cargo xtask cluster`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Number of nodes (network namespaces on one bridge).
    #[arg(long, default_value_t = 2)]
    nodes: usize,
    /// Each node's link rate in Mbit/s, both directions (tc's tbf); unlimited when not given.
    #[arg(long)]
    rate_mbit: Option<f64>,
    /// Added one-way delay in ms (needs the kernel's netem).
    #[arg(long, default_value_t = 0.0)]
    delay_ms: f64,
    /// Jitter of the delay in ms (needs netem).
    #[arg(long, default_value_t = 0.0)]
    jitter_ms: f64,
    /// Packet loss in percent (needs netem).
    #[arg(long, default_value_t = 0.0)]
    loss_percent: f64,
    /// Cuts one node's link for a while: `NODE:AFTER_S:FOR_S` (node 1's link down 5 s after
    /// the start, for 30 s: `1:5:30`).
    #[arg(long)]
    cut: Option<String>,
    /// Runs the command once under OpenMPI's `mpirun` from node 0 with this many ranks on
    /// every node, instead of once per node.
    #[arg(long, value_name = "RANKS_PER_NODE")]
    mpirun: Option<usize>,
    /// Prints what this host can do (root, namespaces, tbf, netem) and exits.
    #[arg(long)]
    probe: bool,
    /// `clean` alone removes the namespaces of runs that were killed; otherwise the command to
    /// run on every node (after `--`).
    #[arg(last = true)]
    command: Vec<String>,
}

/// A link cut: which node, when (from the start) and for how long.
struct Cut {
    node: usize,
    after: Duration,
    duration: Duration,
}

fn parse_cut(text: &str) -> Result<Cut, String> {
    let parts: Vec<&str> = text.split(':').collect();
    let bad = || format!("--cut {text}: give NODE:AFTER_S:FOR_S, for example 1:5:30");
    let [node, after, duration] = parts.as_slice() else {
        return Err(bad());
    };
    let seconds = |s: &str| s.parse::<f64>().ok().and_then(|s| Duration::try_from_secs_f64(s).ok());
    Ok(Cut {
        node: node.parse().map_err(|_| bad())?,
        after: seconds(after).ok_or_else(bad)?,
        duration: seconds(duration).ok_or_else(bad)?,
    })
}

pub fn run(args: &Args) -> Result<(), String> {
    if args.probe {
        println!("{:?}", Capabilities::probe());
        return Ok(());
    }
    if args.command == ["clean"] {
        let removed = remove_leftovers().map_err(|e| e.to_string())?;
        println!("removed {} namespace(s) of killed runs: {removed:?}", removed.len());
        return Ok(());
    }
    let Some((program, program_args)) = args.command.split_first() else {
        return Err("give the command to run on every node after `--`, or `-- clean`".into());
    };
    let cut = args.cut.as_deref().map(parse_cut).transpose()?;
    if let Some(cut) = &cut
        && cut.node >= args.nodes
    {
        return Err(format!("--cut names node {} of {} nodes", cut.node, args.nodes));
    }
    let mut spec = ClusterSpec::new(args.nodes)
        .with_delay_ms(args.delay_ms, args.jitter_ms)
        .with_loss_percent(args.loss_percent);
    spec.link.rate_mbit = args.rate_mbit;
    // Registered before anything is made: an interrupt from here on ends in the cleanup below.
    let interrupted = Arc::new(AtomicBool::new(false));
    for signal in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ] {
        signal_hook::flag::register(signal, interrupted.clone()).map_err(|e| e.to_string())?;
    }
    let cluster = Cluster::create(&spec).map_err(|e| e.to_string())?;
    if interrupted.load(Ordering::Relaxed) {
        return Err("interrupted while the cluster was made: removed".into());
    }
    let master = cluster.address(0).to_string();
    let mut children = Vec::with_capacity(args.nodes);
    if let Some(ranks_per_node) = args.mpirun {
        let child = cluster
            .mpirun(ranks_per_node)
            .map_err(|e| e.to_string())?
            .arg(program)
            .args(program_args)
            .spawn()
            .map_err(|e| format!("starting mpirun in node 0: {e}"))?;
        children.push(Some(child));
    } else {
        for node in 0..args.nodes {
            let child = cluster
                .command(node, program)
                .args(program_args)
                .env("NODE_RANK", node.to_string())
                .env("NNODES", args.nodes.to_string())
                .env("NODE_ADDR", cluster.address(node).to_string())
                .env("MASTER_ADDR", &master)
                .spawn()
                .map_err(|e| format!("starting {program} on node {node}: {e}"))?;
            children.push(Some(child));
        }
    }
    let start = Instant::now();
    let mut link_down = false;
    // Waits for every node, applying the cut on time; `cluster`'s drop kills what still runs.
    while children.iter().any(Option::is_some) {
        if interrupted.load(Ordering::Relaxed) {
            return Err("interrupted: every node's processes killed and the cluster removed".into());
        }
        if let Some(cut) = &cut {
            let elapsed = start.elapsed();
            let down = elapsed >= cut.after && elapsed < cut.after.saturating_add(cut.duration);
            if down != link_down {
                cluster.set_link(cut.node, !down).map_err(|e| e.to_string())?;
                println!(
                    "cluster: node {}'s link {} at {:.1} s",
                    cut.node,
                    if down { "cut" } else { "restored" },
                    elapsed.as_secs_f64()
                );
                link_down = down;
            }
        }
        for (node, slot) in children.iter_mut().enumerate() {
            if let Some(child) = slot
                && let Some(status) = child.try_wait().map_err(|e| e.to_string())?
            {
                *slot = None;
                if args.mpirun.is_some() && !status.success() {
                    return Err(format!("mpirun failed ({status}); every node's processes were stopped"));
                }
                if !status.success() {
                    // The others may wait for this node forever (a rendezvous): end the run.
                    return Err(format!(
                        "the command failed on node {node} ({status}); the other nodes were stopped"
                    ));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for node in 0..args.nodes {
        let bytes = cluster.link_bytes(node).map_err(|e| e.to_string())?;
        println!(
            "cluster: node {node} ({}) sent {} and received {} bytes on its link",
            cluster.address(node),
            bytes.sent,
            bytes.received
        );
    }
    Ok(())
}
