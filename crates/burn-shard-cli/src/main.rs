//! `burn-shard`: tools for sharded checkpoints, no model type needed.
//!
//! ```text
//! burn-shard ckpt inspect DIR
//! burn-shard ckpt consolidate DIR --out model.bpk
//! burn-shard ckpt reshard DIR --world-size 8 --out DIR8
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use burn_shard::checkpoint::{self, FileStatus};
use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(name = "burn-shard", version, about = "Tools for burn-shard's sharded checkpoints")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Sharded checkpoints (directories written by ShardedOptimizer::save_checkpoint).
    #[command(subcommand)]
    Ckpt(Ckpt),
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
    let Command::Ckpt(command) = cli.command;
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
                    e.pieces.len()
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
        } => {
            let safetensors = match format.as_deref() {
                Some(f) => f == "safetensors",
                None => out.extension().is_some_and(|e| e == "safetensors"),
            };
            let report = match safetensors {
                true => checkpoint::consolidate_safetensors(&dir, &out)?,
                false => checkpoint::consolidate(&dir, &out)?,
            };
            println!(
                "{}: {} entries, {} elements, from {}",
                out.display(),
                report.entries,
                report.elements,
                dir.display()
            );
            if let Some(optimizer_out) = optimizer_out {
                let report = checkpoint::consolidate_optimizer(&dir, &optimizer_out)?;
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
