//! Measures the link bandwidth a sharded step's collectives get across a cluster's nodes, with
//! no compute (`burn_shard_examples::comm_bench`), for `burn-shard estimate --time --link-gbit`:
//!
//! ```text
//! cargo build --release -p burn-shard-examples --features mpi --bin comm-bench
//! mpirun -np 16 --map-by ppr:8:node target/release/comm-bench --bytes 400000000          # flat
//! mpirun -np 16 --map-by ppr:8:node target/release/comm-bench --bytes 50000000 --replicas 2
//! ```
//!
//! Under `mpirun` each process is a rank (ranks per node from OpenMPI's
//! `OMPI_COMM_WORLD_LOCAL_SIZE`, or `--ranks-per-node`); otherwise the ranks are threads of this
//! process, on one node, and no link is crossed (the result says so).

use std::sync::Arc;

use burn::prelude::*;
use burn_shard::comm::{Collective, InProcessGroup, ReduceOp, run_ranks};
use burn_shard::{Mesh, MeshLayout};
use burn_shard_examples::cli::at_least;
use burn_shard_examples::comm_bench::{LinkBandwidth, measure};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "The link bandwidth a sharded step's collectives get across nodes (for estimate --time --link-gbit)")]
struct Args {
    /// Bytes of f32 each rank reduces per iteration: the flat parameter (4 bytes a parameter),
    /// or with --replicas one rank's shard of it.
    #[arg(long, default_value_t = 3_280_000, value_parser = at_least(4, 1 << 40))]
    bytes: usize,
    /// Calls the bytes are split into (as a step's buckets or units).
    #[arg(long, default_value_t = 8, value_parser = at_least(1, 1 << 20))]
    calls: usize,
    /// Timed iterations (the median is reported), after 2 untimed ones.
    #[arg(long, default_value_t = 20, value_parser = at_least(1, 1 << 20))]
    iterations: usize,
    /// 1: flat (reduce-scatter + all-gather over every rank); the number of nodes: one shard
    /// group per node (the replicas' all-reduce).
    #[arg(long, default_value_t = 1, value_parser = at_least(1, 1 << 20))]
    replicas: usize,
    /// Ranks per node (default: OMPI_COMM_WORLD_LOCAL_SIZE under mpirun, else every rank).
    #[arg(long)]
    ranks_per_node: Option<usize>,
    /// Ranks as threads when not started by mpirun.
    #[arg(long, default_value_t = 2, value_parser = at_least(1, 1024))]
    world_size: usize,
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("comm-bench: {e}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> Result<(), String> {
    if let Some(comm) = mpi_comm()? {
        let local = |var: &str| std::env::var(var).ok().and_then(|v| v.parse::<usize>().ok());
        let ranks_per_node = args
            .ranks_per_node
            .or(local("OMPI_COMM_WORLD_LOCAL_SIZE"))
            .unwrap_or(comm.world_size());
        let rank = comm.rank();
        // The patterns count link bytes for consecutive ranks on a node (`--map-by` slot or
        // ppr, not node): every rank checks its place, and all agree before any fails.
        let placed = local("OMPI_COMM_WORLD_LOCAL_RANK").is_none_or(|l| l == rank % ranks_per_node.max(1));
        let flag = Tensor::<1>::from_floats([f32::from(u8::from(!placed))], &Device::flex());
        let misplaced = comm
            .all_reduce(flag, ReduceOp::Sum)
            .map_err(|e| e.to_string())?
            .into_scalar::<f32>();
        if misplaced > 0.0 {
            return Err(format!(
                "{misplaced} rank(s) are not the consecutive ranks of their node that {ranks_per_node} ranks per node \
                 mean: start mpirun with --map-by slot (or ppr:{ranks_per_node}:node), not --map-by node"
            ));
        }
        let result = rank_bench(args, Arc::new(comm), ranks_per_node)?;
        if rank == 0 {
            report(args, &result, ranks_per_node);
        }
        return Ok(());
    }
    let group = InProcessGroup::new(args.world_size).map_err(|e| e.to_string())?;
    let ranks_per_node = args.ranks_per_node.unwrap_or(args.world_size);
    let results =
        run_ranks(group, |comm| rank_bench(args, Arc::new(comm), ranks_per_node)).map_err(|e| e.to_string())?;
    report(args, &results.into_iter().next().expect("rank 0")?, ranks_per_node);
    Ok(())
}

fn rank_bench(args: &Args, world: Arc<dyn Collective>, ranks_per_node: usize) -> Result<LinkBandwidth, String> {
    let mesh = Mesh::new(world, args.replicas, MeshLayout::Consecutive).map_err(|e| e.to_string())?;
    measure(&mesh, args.bytes, args.calls, (2, args.iterations), ranks_per_node).map_err(|e| e.to_string())
}

fn report(args: &Args, result: &LinkBandwidth, ranks_per_node: usize) {
    let pattern = match args.replicas {
        1 => "flat (reduce-scatter + all-gather)".to_string(),
        r => format!("hybrid, {r} replicas (all-reduce across nodes)"),
    };
    println!(
        "comm-bench: {pattern}, {} bytes per rank in {} calls, {ranks_per_node} ranks per node: median {:.4} s per \
         iteration, {:.2} MB per link",
        args.bytes,
        args.calls,
        result.iteration_s,
        result.link_bytes / 1e6
    );
    if result.link_bytes == 0.0 {
        println!("comm-bench: one node: nothing crossed a link");
    } else {
        println!(
            "link bandwidth: {:.1} Mbit/s (estimate --time --link-gbit {:.3})",
            result.link_bytes_per_s * 8.0 / 1e6,
            result.link_bytes_per_s * 8.0 / 1e9
        );
    }
}

#[cfg(feature = "mpi")]
fn mpi_comm() -> Result<Option<burn_shard::comm::MpiComm>, String> {
    use burn_shard::comm::{MpiComm, launched_by_mpirun};
    if !launched_by_mpirun() {
        return Ok(None);
    }
    MpiComm::init().map(Some).map_err(|e| e.to_string())
}

#[cfg(not(feature = "mpi"))]
fn mpi_comm() -> Result<Option<burn_shard::comm::InProcessComm>, String> {
    Ok(None)
}
