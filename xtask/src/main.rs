//! `cargo xtask <task>`: project tasks that are programs rather than tests.
//!
//! - `cargo xtask bench adam`: the fused-Adam benchmark table (see `bench_adam.rs`).

mod bench_adam;

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
}

#[derive(Subcommand)]
enum Bench {
    /// One Adam step on flat f32 shards: Burn's Adam, the fused CPU path, PyTorch's fused AdamW.
    Adam(bench_adam::Args),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.task {
        Task::Bench {
            which: Bench::Adam(args),
        } => bench_adam::run(&args),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
