//! Fine-tunes pretrained all-MiniLM-L6-v2 on TREC (or SST-2) through burn-train's Learner, with
//! burn-shard's `ShardedStrategy` as the only sharding-specific line. Fetch the weights once
//! with `cargo xtask fetch-minilm`.
//!
//! ```text
//! cargo run --release -p burn-shard-examples --bin finetune-minilm-learner -- --world-size 2 --stage 3
//! ```

use burn_shard_examples::finetune_minilm_learner::{Args, run};
use clap::Parser;

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
