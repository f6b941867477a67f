//! Fine-tunes pretrained all-MiniLM-L6-v2 on SST-2 (or TREC) with ZeRO sharding, ranks as
//! threads on the CPU backend. Fetch the weights once with `cargo xtask fetch-minilm`.
//!
//! ```text
//! cargo run --release -p burn-shard-examples --bin finetune-minilm -- --world-size 2 --stage 2
//! ```

use burn_shard_examples::finetune_minilm::{Args, run};
use clap::Parser;

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
