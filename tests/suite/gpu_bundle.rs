//! The parts of `cargo xtask gpu-bundle` that run without a GPU: the bundle's `run.sh` stops at
//! once with the reason on a machine without an NVIDIA driver, and the GPU benchmark's
//! measurements (`burn_shard_examples::gpu_bench`, device-generic) give the values they should
//! on the CPU at toy sizes.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use burn::prelude::*;
use burn_shard::Stage;
use burn_shard_examples::char_data::CharCorpus;
use burn_shard_examples::gpu_bench::{GptSpec, adam_row, gpt_in_process};

use crate::common::scratch;

fn run_sh() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../xtask/gpu_bundle/run.sh")
}

/// Whether this machine has the NVIDIA driver where `run.sh` looks first.
fn has_libcuda() -> bool {
    let listed = Command::new("ldconfig")
        .arg("-p")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("libcuda.so.1 "))
        .unwrap_or(false);
    listed
        || [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
            "/usr/local/nvidia/lib64",
            "/usr/lib/wsl/lib",
        ]
        .iter()
        .any(|d| std::path::Path::new(d).join("libcuda.so.1").exists())
}

/// Without the driver, run.sh exits 2 within seconds, says what is missing and what to do, and
/// has written the same into the results folder's run.log; without its one argument it says
/// how to call it.
#[test]
fn the_bundles_run_script_stops_at_once_with_the_reason_without_a_gpu() {
    if has_libcuda() {
        eprintln!("skipped: this machine has libcuda.so.1, so run.sh would go on to look for a GPU");
        return;
    }
    let bundle = scratch("gpu-bundle", "bundle");
    std::fs::copy(run_sh(), bundle.join("run.sh")).unwrap();
    std::fs::write(bundle.join("MANIFEST.txt"), "commit test\n").unwrap();
    let results = scratch("gpu-bundle", "results").join("nested");
    let start = Instant::now();
    let out = Command::new("bash")
        .arg(bundle.join("run.sh"))
        .arg(&results)
        .output()
        .unwrap();
    let took = start.elapsed();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "exit status 2 without a GPU: {text}");
    assert!(took < Duration::from_secs(10), "run.sh took {took:?} to give up");
    assert!(
        text.contains("no NVIDIA driver")
            && text.contains("libcuda.so.1")
            && text.contains("machine with an NVIDIA GPU"),
        "the reason and the fix: {text}"
    );
    let log = std::fs::read_to_string(results.join("run.log")).expect("run.log in the results folder");
    assert!(log.contains("no NVIDIA driver"), "run.log holds the reason: {log}");

    let out = Command::new("bash").arg(bundle.join("run.sh")).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("usage:"));
}

/// The Adam row on the CPU: both implementations timed, the fused one on its CPU path, GB/s
/// computed from 28 bytes per element.
#[test]
fn the_gpu_benchmarks_adam_row_times_both_steps() {
    let row = adam_row(&Device::flex(), 10_000, 2).unwrap();
    assert!(row.fused_ms > 0.0 && row.burn_ms > 0.0, "{row:?}");
    assert_eq!(row.path, "FusedCpu");
    let gbs = 28.0 * 10_000.0 / (row.fused_ms / 1e3) / 1e9;
    assert!((row.gbs(row.fused_ms) - gbs).abs() <= 1e-9 * gbs, "{row:?}");
}

/// The GPT measurements on the CPU with 2 in-process ranks: the same losses at every stage (the
/// stages train alike), each rank's model state equal to the ZeRO formula for `f32` AdamW
/// (16Ψ at stage 0, 8Ψ + 8Ψ/N at stage 1, 4Ψ + 12Ψ/N at stage 2, 16Ψ/N at stage 3; Rajbhandari
/// et al. 2020, "ZeRO", Figure 1; up to the padding of uneven shards), one time per timed step, traffic and a hidden
/// share where the ranks communicate, and no device allocator bytes on Burn's Flex backend.
#[test]
fn the_gpu_benchmarks_gpt_runs_give_the_zero_memory_and_the_same_losses() {
    let text = std::fs::read_to_string(burn_shard_examples::examples_data_dir().join("tinyshakespeare.txt")).unwrap();
    let corpus = CharCorpus::new(&text);
    let spec = |stage| GptSpec {
        dims: (32, 2, 1),
        block_size: 16,
        global_batch: 4,
        warmup: 1,
        steps: 2,
        stage,
    };
    let n = 2.0;
    let mut first_losses = None;
    for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
        let runs = gpt_in_process(&Device::flex(), 2, &corpus, &spec(stage)).unwrap();
        let psi = runs[0].params as f64;
        let want = match stage {
            Stage::Zero => 16.0 * psi,
            Stage::One => 4.0 * psi + 4.0 * psi + 8.0 * psi / n,
            Stage::Two => 4.0 * psi + 4.0 * psi / n + 8.0 * psi / n,
            Stage::Three => 16.0 * psi / n,
        };
        for (rank, r) in runs.iter().enumerate() {
            let ctx = format!("stage {stage}, rank {rank}");
            let got = r.model_state_bytes as f64;
            assert!(
                (got - want).abs() <= 16.0 * 64.0,
                "{ctx}: model state {got} bytes vs the formula's {want}"
            );
            assert_eq!(r.step_ms.len(), 2, "{ctx}");
            assert_eq!(r.losses.len(), 3, "{ctx}");
            assert!(r.sent_per_step > 0.0 && r.hidden_share.is_some(), "{ctx}: {r:?}");
            assert_eq!(r.device_in_use_peak, None, "{ctx}: Flex reports no allocator");
        }
        let losses = runs[0].losses.clone();
        let reference = first_losses.get_or_insert(losses.clone());
        for (a, b) in losses.iter().zip(reference.iter()) {
            assert!(
                (a - b).abs() <= 1e-4 * b.abs(),
                "stage {stage}: losses {losses:?} vs stage 0's {reference:?}"
            );
        }
    }
}
