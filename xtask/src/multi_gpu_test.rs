//! `cargo xtask multi-gpu-test`: the GPU suite on every GPU of this machine.
//!
//! Finds the GPUs (`nvidia-smi -L`), builds the test suite with the `cuda` feature and runs its
//! `gpu` module with `BURN_SHARD_GPUS` set: NCCL collectives against host-computed results on
//! all GPUs, sharded training (stages 0-3) against single-GPU training, the fused Adam kernels
//! (`f32`; `bf16`/`f16` with `f32` masters) on CUDA, and the launcher's NCCL rendezvous. Prints
//! one summary table.

use std::process::Command;

/// Arguments of `cargo xtask multi-gpu-test`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// With no GPU, print why and exit 0 (for CI) instead of failing.
    #[arg(long)]
    allow_no_gpu: bool,
}

pub fn run(args: &Args) -> Result<(), String> {
    let gpus = count_gpus();
    if gpus == 0 {
        let reason = "no NVIDIA GPU found (`nvidia-smi -L` listed none or is not installed)";
        if args.allow_no_gpu {
            println!("multi-gpu-test skipped: {reason}");
            return Ok(());
        }
        return Err(format!(
            "multi-gpu-test needs a GPU: {reason}; pass --allow-no-gpu to skip"
        ));
    }
    println!("multi-gpu-test: {gpus} GPU(s)");
    let out = Command::new(env!("CARGO"))
        .args([
            "test",
            "--release",
            "-p",
            "burn-shard-tests",
            "--features",
            "cuda",
            "--",
            "gpu::",
            "--test-threads=1",
        ])
        .env("BURN_SHARD_GPUS", gpus.to_string())
        .output()
        .map_err(|e| format!("cannot run cargo test: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    println!("| test | result |\n|---|---|");
    for line in text.lines().filter(|l| l.starts_with("test ") && l.contains("gpu::")) {
        let name = line.trim_start_matches("test ").split(" ... ").next().unwrap_or(line);
        let result = line.rsplit(" ... ").next().unwrap_or("?");
        println!("| {name} | {result} |");
    }
    if !out.status.success() {
        eprintln!("{}", String::from_utf8_lossy(&out.stderr));
        return Err("the GPU suite failed (output above)".into());
    }
    Ok(())
}

fn count_gpus() -> usize {
    Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.starts_with("GPU "))
                .count()
        })
        .unwrap_or(0)
}
