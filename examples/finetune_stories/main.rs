//! Loads the pretrained stories260K tiny Llama (llama2.c format), prints its greedy story, then
//! fine-tunes it on tiny shakespeare with ZeRO sharding (stage 3 by default), ranks as threads.
//!
//! ```text
//! cargo run --release -p burn-shard-examples --bin finetune-stories -- --world-size 2 --stage 3
//! ```

use burn_shard_examples::finetune_stories::{Args, run};
use clap::Parser;

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
