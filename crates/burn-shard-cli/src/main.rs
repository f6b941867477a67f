//! `burn-shard`: tools for sharded checkpoints, no model type needed.
//!
//! ```text
//! burn-shard ckpt inspect DIR
//! burn-shard ckpt consolidate DIR --out model.bpk [--trainable-only]
//! burn-shard ckpt reshard DIR --world-size 8 --out DIR8
//! burn-shard estimate --params 7.5e9 --world-size 64 [--stage N] [--dtype bf16|f16|f32] [--offload [cpu|nvme]] [--offload-params [cpu|nvme]] [--replicas R]
//!     [--time --nodes 8 --link-gbit 400 --step-s 0.9 [--latency-us 5] [--calls-per-step C] [--hidden-share H] [--device-gb 80]]
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use burn_shard::Stage;
use burn_shard::checkpoint::{self, FileStatus};
use burn_shard::estimate::{self, GB, GIB, ModelStateEstimate, OffloadTarget, ParamDtype};
use clap::{Args, Parser, Subcommand, ValueEnum};

mod time;

#[derive(Parser, Debug)]
#[command(
    name = "burn-shard",
    version,
    about = "Tools for burn-shard: sharded checkpoints, memory estimates"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Sharded checkpoints (directories written by ShardedOptimizer::save_checkpoint).
    #[command(subcommand)]
    Ckpt(Ckpt),
    /// Per-rank model-state memory (parameters, gradients, Adam state) of each ZeRO stage, from
    /// the ZeRO paper's formulas: pick a stage before renting GPUs.
    Estimate(Estimate),
}

#[derive(Args, Debug)]
struct Estimate {
    /// Number of parameters (Ψ), e.g. 7.5e9.
    #[arg(long, value_parser = parse_params, allow_negative_numbers = true)]
    params: f64,
    /// Data-parallel ranks (N, GPUs) the model is sharded over.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1 << 32))]
    world_size: u64,
    /// Only this stage (0 to 3); default: every stage.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=3))]
    stage: Option<u8>,
    /// Parameter dtype: bf16 or f16 (mixed precision with f32 master weights, as the ZeRO paper),
    /// or f32 (no master copy).
    #[arg(long, value_enum, default_value_t = Dtype::Bf16)]
    dtype: Dtype,
    /// Optimizer state and f32 master weights in host memory (`cpu`, ZeRO-Offload; what
    /// `--offload` alone means) or on a local disk (`nvme`, ZeRO-Infinity).
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "cpu")]
    offload: Option<Target>,
    /// Stage 3: the parameter shards in host memory too (`cpu`, ShardConfig::with_params_on(Home::Host);
    /// what `--offload-params` alone means), or the parameter and gradient shards on a local disk
    /// (`nvme`, ShardConfig::with_params_on(Home::Disk)); both step the shards with the optimizer
    /// offloaded, so they need --offload; stages 0-2 are unchanged.
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "cpu", requires = "offload")]
    offload_params: Option<Target>,
    /// Hybrid sharding (ShardConfig::with_replicas): the ranks form this many shard groups (one
    /// per node), each sharding the model over world-size / replicas ranks; default 1 (flat).
    /// Must divide --world-size; stages 1-3.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1 << 32))]
    replicas: u64,
    /// The step time on a cluster (`--time` and its options).
    #[command(flatten)]
    time: time::TimeArgs,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    Cpu,
    Nvme,
}

impl Estimate {
    /// Where `--offload` puts the optimizer state.
    fn offload(&self) -> OffloadTarget {
        match self.offload {
            None => OffloadTarget::None,
            Some(Target::Cpu) => OffloadTarget::Cpu,
            Some(Target::Nvme) => OffloadTarget::Nvme,
        }
    }
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum Dtype {
    Bf16,
    F16,
    F32,
}

impl From<Dtype> for ParamDtype {
    fn from(d: Dtype) -> Self {
        match d {
            Dtype::Bf16 => ParamDtype::Bf16,
            Dtype::F16 => ParamDtype::F16,
            Dtype::F32 => ParamDtype::F32,
        }
    }
}

/// `--params`: a finite number above 0 (`7.5e9`, `125000000`).
fn parse_params(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number (write e.g. 7.5e9 or 125000000)"))?;
    if !v.is_finite() || v <= 0.0 {
        return Err(format!(
            "the parameter count must be a finite number above 0, got `{s}`"
        ));
    }
    Ok(v)
}

#[derive(Subcommand, Debug)]
enum Ckpt {
    /// Prints what a checkpoint holds (parameters, shapes, dtypes, world size, stage, bytes
    /// per rank) and checks every rank file against its SHA-256; exits 1 if one is bad.
    Inspect {
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// Writes the full model as one ordinary Burn record (burnpack, as `Module::save_file`
    /// writes it, which the unsharded model loads with `load_file`), or as safetensors.
    Consolidate {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The file to write (e.g. model.bpk, model.safetensors).
        #[arg(long)]
        out: PathBuf,
        /// `burnpack` (Burn's record) or `safetensors`; default: by the extension of --out.
        #[arg(long, value_parser = ["burnpack", "safetensors"])]
        format: Option<String>,
        /// Also write the optimizer state as Burn's own optimizer record here, for
        /// `ModuleOptimizer::load` (single-device Burn training resumes from both files).
        #[arg(long)]
        optimizer_out: Option<PathBuf>,
        /// Only the trained entries (a LoRA or head-only fine-tune's adapters, without the
        /// frozen base), under their module paths.
        #[arg(long)]
        trainable_only: bool,
    },
    /// Rewrites a checkpoint for another number of ranks (loading works at any world size
    /// without it; this spreads the files over the new ranks).
    Reshard {
        /// The checkpoint directory.
        dir: PathBuf,
        /// Ranks of the new checkpoint (at least 1).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=65536))]
        world_size: u64,
        /// The new checkpoint directory (must not exist).
        #[arg(long)]
        out: PathBuf,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode, checkpoint::CheckpointError> {
    match cli.command {
        Command::Ckpt(command) => run_ckpt(command),
        Command::Estimate(args) => {
            if !args.world_size.is_multiple_of(args.replicas) {
                eprintln!(
                    "error: --replicas {} does not divide --world-size {}: the ranks form replicas × shard size, so \
                     pass a divisor of the world size (1 for no replication)",
                    args.replicas, args.world_size
                );
                return Ok(ExitCode::from(2));
            }
            if args.replicas > 1 && args.stage == Some(0) {
                eprintln!("error: --replicas at stage 0: stage 0 (DDP) shards nothing; choose stage 1, 2 or 3");
                return Ok(ExitCode::from(2));
            }
            print_estimate(&args);
            if args.time.time {
                let stages: Vec<Stage> = match args.stage {
                    Some(n) => vec![Stage::try_from(n).expect("clap checked 0..=3")],
                    None => estimate::STAGES.to_vec(),
                };
                let model = (args.params, args.world_size as usize);
                if let Err(e) = time::print_time(&args.time, model, &stages, args.dtype.into(), args.offload()) {
                    eprintln!("error: {e}");
                    return Ok(ExitCode::from(2));
                }
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Prints one table of per-rank model-state memory, a row per stage, with its source.
fn print_estimate(args: &Estimate) {
    let dtype = ParamDtype::from(args.dtype);
    let stages: Vec<Stage> = match args.stage {
        Some(n) => vec![Stage::try_from(n).expect("clap checked 0..=3")],
        // With replicas, stage 0 (which takes none) is left out.
        None => estimate::STAGES
            .into_iter()
            .filter(|s| args.replicas == 1 || *s != Stage::Zero)
            .collect(),
    };
    // With replicas each shard group holds the model sharded over its own ranks.
    let shard_size = (args.world_size / args.replicas) as usize;
    let rows: Vec<ModelStateEstimate> = stages
        .iter()
        .map(|&stage| estimate::zero_formula(args.params, shard_size, stage, dtype, args.offload()))
        .map(|row| match args.offload_params {
            Some(Target::Cpu) => row.with_params_offloaded(),
            Some(Target::Nvme) => row.with_params_on_disk(),
            None => row,
        })
        .collect();
    let precision = match dtype {
        ParamDtype::F32 => "f32 parameters, Adam".to_string(),
        d => format!("{d} mixed precision (f32 master weights), Adam"),
    };
    match args.replicas {
        1 => println!(
            "Per-rank model-state memory: {:e} parameters (Ψ) on {} ranks (N), {precision}",
            args.params, args.world_size
        ),
        r => println!(
            "Per-rank model-state memory: {:e} parameters (Ψ) on {} ranks as {r} replicas of shard groups of N = {} \
             (hybrid sharding), {precision}",
            args.params, args.world_size, shard_size
        ),
    }
    let mut header = vec!["stage", "parameters", "gradients", "optimizer state", "total"];
    match args.offload() {
        OffloadTarget::None => {}
        OffloadTarget::Cpu => {
            header[4] = "total on device";
            header.push("host (offloaded)");
            if args.offload_params == Some(Target::Nvme) {
                header.push("disk (offloaded)");
            }
        }
        OffloadTarget::Nvme => {
            header[4] = "total on device";
            if args.offload_params == Some(Target::Cpu) {
                header.push("host (offloaded)");
            }
            header.push("disk (offloaded)");
        }
    }
    let mut table: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    for row in &rows {
        let mut cells = vec![
            row.stage.to_string(),
            size(row.parameters_bytes),
            size(row.gradients_bytes),
            size(row.optimizer_state_bytes),
            size(row.device_bytes()),
        ];
        match args.offload() {
            OffloadTarget::None => {}
            OffloadTarget::Cpu => {
                cells.push(size(row.host_bytes));
                if args.offload_params == Some(Target::Nvme) {
                    cells.push(size(row.disk_bytes));
                }
            }
            OffloadTarget::Nvme => {
                if args.offload_params == Some(Target::Cpu) {
                    cells.push(size(row.host_bytes));
                }
                cells.push(size(row.disk_bytes));
            }
        }
        table.push(cells);
    }
    let widths: Vec<usize> = (0..table[0].len())
        .map(|c| table.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    for row in &table {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(c, (cell, &w))| match c {
                0 => format!("{cell:<w$}"),
                _ => format!("{cell:>w$}"),
            })
            .collect();
        println!("{}", line.join("  ").trim_end());
    }
    let source: &[&str] = match dtype {
        ParamDtype::F32 => &[
            "Source: the ZeRO paper's model-state accounting (Rajbhandari et al. 2020, \"ZeRO: Memory Optimizations",
            "Toward Training Trillion Parameter Models\", §5.1) for f32 Adam, no master copy: 4Ψ parameters, 4Ψ",
            "gradients, 8Ψ Adam moments; stage 0 16Ψ, 1: 8Ψ+8Ψ/N, 2: 4Ψ+12Ψ/N, 3: 16Ψ/N.",
        ],
        _ => &[
            "Source: ZeRO paper (Rajbhandari et al. 2020, \"ZeRO: Memory Optimizations Toward Training Trillion",
            "Parameter Models\", §5.1), K=12 for mixed-precision Adam (f32 master weights, momentum, variance):",
            "stage 0 (2+2+K)Ψ, 1: 2Ψ+2Ψ+KΨ/N, 2: 2Ψ+(2+K)Ψ/N, 3: (2+2+K)Ψ/N.",
        ],
    };
    let offload: &[&str] = match args.offload() {
        OffloadTarget::Cpu => &[
            "Offload: ZeRO-Offload (Ren et al. 2021, \"ZeRO-Offload: Democratizing Billion-Scale Model Training\",",
            "§4): optimizer state and f32 master weights in host memory; gradients and parameters on the device",
            "unless --offload-params moves them.",
        ],
        OffloadTarget::Nvme => &[
            "Offload: ZeRO-Infinity (Rajbhandari et al. SC21, \"ZeRO-Infinity: Breaking the GPU Memory Wall for",
            "Extreme Scale Deep Learning\", §3, §5.1): optimizer state and f32 master weights on disk (NvmeOffload),",
            "read and written once per step; host memory holds only the pieces in flight; gradients and parameters",
            "on the device unless --offload-params moves them.",
        ],
        OffloadTarget::None => &[],
    };
    let params: &[&str] = match args.offload_params {
        Some(Target::Cpu) => &[
            "Parameter offload (ZeRO-Infinity, SC21, §5.1): at stage 3 the parameter shards live in host memory;",
            "the device holds the units being gathered (not counted here) and the gradients.",
        ],
        Some(Target::Nvme) => &[
            "Parameter offload to NVMe (ZeRO-Infinity, SC21, §5.1): at stage 3 the parameter shards, and the",
            "gradient shards from backward to the step, live on disk; memory holds the units in flight (not",
            "counted here).",
        ],
        None => &[],
    };
    for line in source.iter().chain(offload).chain(params) {
        println!("{line}");
    }
    println!(
        "GB = 1e9 bytes, GiB = 2^30 bytes. Not included: activations, temporary buffers, allocator fragmentation."
    );
    print_traffic(args, &stages, dtype);
}

/// The bytes one rank sends per step, within its shard group and across the replicas
/// ([`estimate::step_traffic`]).
fn print_traffic(args: &Estimate, stages: &[Stage], dtype: ParamDtype) {
    let (world_size, replicas) = (args.world_size as usize, args.replicas as usize);
    println!();
    println!(
        "Bytes one rank sends per step ({} shard group{} of {} ranks):",
        replicas,
        if replicas == 1 { "" } else { "s" },
        world_size / replicas
    );
    // Rows read "stage N", so that the memory table's rows stay the only ones that start with
    // a stage number.
    let mut table = vec![vec![
        String::new(),
        "in its shard group".to_string(),
        "across replicas".to_string(),
    ]];
    for &stage in stages {
        let t = estimate::step_traffic(args.params, world_size, replicas, stage, dtype);
        table.push(vec![
            format!("stage {stage}"),
            size(t.shard_group_bytes),
            size(t.replica_group_bytes),
        ]);
    }
    for row in &table {
        println!("{:<7}  {:>24}  {:>24}", row[0], row[1], row[2]);
    }
    println!(
        "Ring volumes: an all-reduce sends 2(n-1)/n of its buffer per rank, a reduce-scatter or all-gather (n-1)/n; stage 3 \
         counts two all-gathers (forward, backward). With one shard group per node, only the replicas' all-reduce of \
         each rank's gradient shard (Ψ/S elements) crosses nodes."
    );
}

/// `bytes` in GB and GiB: one decimal from 1 GB up (as the ZeRO paper), three significant
/// digits below.
fn size(bytes: f64) -> String {
    let digits = |v: f64| -> usize {
        if v >= 1.0 || v == 0.0 {
            1
        } else {
            (2.0 - v.log10().floor()).clamp(1.0, 12.0) as usize
        }
    };
    let (gb, gib) = (bytes / GB, bytes / GIB);
    format!("{gb:.a$} GB / {gib:.b$} GiB", a = digits(gb), b = digits(gib))
}

fn run_ckpt(command: Ckpt) -> Result<ExitCode, checkpoint::CheckpointError> {
    match command {
        Ckpt::Inspect { dir } => {
            let inspection = checkpoint::inspect(&dir)?;
            let meta = &inspection.meta;
            println!(
                "{}: format {}, world size {}, stage {}, payload {}",
                dir.display(),
                meta.format_version,
                meta.world_size,
                meta.stage,
                meta.payload
            );
            println!(
                "{:<48} {:<16} {:<5} {:<16} {:>9} pieces",
                "parameter", "shape", "dtype", "kind", "trainable"
            );
            for e in &meta.entries {
                println!(
                    "{:<48} {:<16} {:<5} {:<16} {:>9} {}",
                    e.path,
                    format!("{:?}", e.shape),
                    e.dtype,
                    e.kind,
                    if e.trainable { "yes" } else { "no" },
                    match &e.fingerprint {
                        None => e.pieces.len().to_string(),
                        Some(f) => format!("none: base entry, fingerprint {f}"),
                    }
                );
            }
            if let Some(base) = &meta.base {
                println!(
                    "frozen base not saved, loaded from {} (fingerprint {}): load it before resuming",
                    base.origin.as_deref().unwrap_or("the model given to init"),
                    base.fingerprint
                );
            }
            println!("{:<16} {:>14} {:<64} status", "file", "bytes", "sha256");
            for ((path, status), expected) in inspection.files.iter().zip(&meta.files) {
                let status = match status {
                    FileStatus::Ok => "ok".to_string(),
                    FileStatus::Missing => "MISSING".to_string(),
                    FileStatus::Mismatch { bytes } => format!("CORRUPT ({bytes} bytes on disk)"),
                };
                let name = path
                    .file_name()
                    .map(|n| n.to_string_lossy().to_string())
                    .unwrap_or_default();
                println!("{:<16} {:>14} {:<64} {}", name, expected.bytes, expected.sha256, status);
            }
            Ok(if inspection.is_intact() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Ckpt::Consolidate {
            dir,
            out,
            format,
            optimizer_out,
            trainable_only,
        } => {
            let safetensors = match format.as_deref() {
                Some(f) => f == "safetensors",
                None => out.extension().is_some_and(|e| e == "safetensors"),
            };
            let selection = match trainable_only {
                true => checkpoint::Selection::Trainable,
                false => checkpoint::Selection::All,
            };
            let format = match safetensors {
                true => checkpoint::RecordFormat::Safetensors,
                false => checkpoint::RecordFormat::Burnpack,
            };
            let options = checkpoint::ConsolidateOptions::new()
                .with_selection(selection)
                .with_format(format);
            let report = checkpoint::consolidate(&dir, &out, options)?;
            println!(
                "{}: {} entries, {} elements, from {}",
                out.display(),
                report.entries,
                report.elements,
                dir.display()
            );
            if let Some(optimizer_out) = optimizer_out {
                let report = checkpoint::consolidate(&dir, &optimizer_out, checkpoint::Selection::OptimizerState)?;
                println!(
                    "{}: optimizer state of {} parameters ({} elements)",
                    optimizer_out.display(),
                    report.entries,
                    report.elements
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Ckpt::Reshard { dir, world_size, out } => {
            let meta = checkpoint::reshard(&dir, world_size as usize, &out)?;
            println!("{}: {} ranks, from {}", out.display(), meta.world_size, dir.display());
            Ok(ExitCode::SUCCESS)
        }
    }
}
