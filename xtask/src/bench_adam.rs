//! One Adam(W) step on a flat f32 shard, timed for several implementations in one run, with
//! the machine's copy bandwidth as the yardstick.
//!
//! Bytes moved per element: the step reads param, grad, exp_avg, exp_avg_sq (16 B) and writes
//! param, exp_avg, exp_avg_sq (12 B): 28 B. GB/s = 28·n / seconds / 1e9.

use std::hint::black_box;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use burn::optim::{AdamWConfig, Optimizer};
use burn::tensor::{Device, Distribution, Tensor};
use burn_shard_kernels::FusedAdamConfig;

const BYTES_PER_ELEMENT: f64 = 28.0;

/// Arguments of `cargo xtask bench adam`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Shard sizes in elements.
    #[arg(long, value_delimiter = ',', default_values_t = [100_000usize, 1_000_000, 10_000_000, 100_000_000])]
    sizes: Vec<usize>,
    /// Timed steps per size and implementation (after one warm-up step); the fastest is reported.
    #[arg(long, default_value_t = 10)]
    reps: usize,
    /// Skip PyTorch even when it is importable.
    #[arg(long)]
    no_torch: bool,
    /// Install `torch` from the Python registry first when `import torch` fails.
    #[arg(long)]
    install_torch: bool,
}

struct Row {
    size: usize,
    burn_ms: f64,
    fused_ms: f64,
    cube_ms: Option<f64>,
    torch_ms: Option<f64>,
    copy_gbs: f64,
}

pub fn run(args: &Args) -> Result<(), String> {
    let torch = if args.no_torch { None } else { torch_times(args)? };
    let cube_device = cube_device();
    let flex = Device::flex();
    let adamw = |p, g, s| AdamWConfig::new().build().step(1e-3, p, g, s);
    let fused = |p, g, s| FusedAdamConfig::adamw().init().step(1e-3, p, g, s);
    let mut rows = Vec::new();
    for &n in &args.sizes {
        eprintln!("size {n}: Burn AdamW, fused CPU, CubeCL on wgpu, copy bandwidth ...");
        rows.push(Row {
            size: n,
            burn_ms: time_optimizer(&flex, n, args.reps, adamw),
            fused_ms: time_optimizer(&flex, n, args.reps, fused),
            // A driver may refuse a buffer this large: report it as missing, not a crash.
            cube_ms: cube_device
                .as_ref()
                .and_then(|d| std::panic::catch_unwind(|| time_optimizer(d, n, args.reps, fused)).ok()),
            torch_ms: torch
                .as_ref()
                .and_then(|t| t.iter().find(|(s, _)| *s == n).map(|(_, ms)| *ms)),
            copy_gbs: copy_bandwidth(n, args.reps),
        });
    }
    print_table(&rows);
    Ok(())
}

/// The wgpu CPU adapter (lavapipe) for the CubeCL column, when this build and machine have it.
fn cube_device() -> Option<Device> {
    #[cfg(feature = "wgpu")]
    match burn_shard_kernels::wgpu_cpu_device() {
        Ok(d) => return Some(d),
        Err(e) => eprintln!("CubeCL column skipped: {e}"),
    }
    #[cfg(not(feature = "wgpu"))]
    eprintln!("CubeCL column skipped: xtask built without the `wgpu` feature");
    None
}

/// Median milliseconds of one `step` on `[n]` f32 tensors on `device`, the state carried from
/// step to step as in training.
fn time_optimizer<S>(
    device: &Device,
    n: usize,
    reps: usize,
    step: impl Fn(Tensor<1>, Tensor<1>, Option<S>) -> (Tensor<1>, Option<S>),
) -> f64 {
    let mut param = Tensor::<1>::random([n], Distribution::Default, device);
    let grad = Tensor::<1>::random([n], Distribution::Default, device);
    let mut state = None;
    let mut times = Vec::with_capacity(reps);
    for i in 0..=reps {
        // The gradient outlives the step, as `p.grad` does in PyTorch: no free inside the timing.
        let g = grad.clone();
        device.sync().ok(); // nothing queued before the clock starts
        let start = Instant::now();
        let (p, s) = step(param, g, state);
        device.sync().expect("the step ran"); // wait for queued kernels (wgpu runs asynchronously)
        // One element per dimension: Burn's slice takes an array of ranges, not a Vec.
        #[allow(clippy::single_range_in_vec_init)]
        let _ = black_box(p.clone().slice([0..1.min(n)]).into_data());
        if i > 0 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
        param = p;
        state = s;
    }
    best(times)
}

/// GB/s of a plain copy of `n` f32 on all cores (read + write: 8 bytes per element), the
/// machine's practical memory bandwidth for this access pattern.
fn copy_bandwidth(n: usize, reps: usize) -> f64 {
    use rayon::prelude::*;
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let mut times = Vec::new();
    for i in 0..=reps {
        let start = Instant::now();
        dst.par_chunks_mut(1 << 16)
            .zip(black_box(&src).par_chunks(1 << 16))
            .for_each(|(d, s)| d.copy_from_slice(s));
        black_box(&mut dst);
        if i > 0 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    8.0 * n as f64 / best(times) / 1e9
}

/// The fastest of the timed runs: on a shared machine, noise only ever adds time, so the
/// minimum is the most repeatable estimate of what the code costs (the advice of Python's
/// `timeit`); PyTorch's column is taken the same way.
fn best(v: Vec<f64>) -> f64 {
    v.into_iter().fold(f64::INFINITY, f64::min)
}

fn gbs(n: usize, ms: f64) -> f64 {
    BYTES_PER_ELEMENT * n as f64 / (ms / 1e3) / 1e9
}

/// Runs `xtask/bench_adam_torch.py`; `None` when PyTorch is not available.
fn torch_times(args: &Args) -> Result<Option<Vec<(usize, f64)>>, String> {
    let has_torch = || {
        Command::new("python3")
            .args(["-c", "import torch"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    };
    if !has_torch() && args.install_torch {
        eprintln!("installing torch from the Python registry (python3 -m pip install torch) ...");
        let ok = Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", "torch"])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !ok {
            eprintln!("pip install torch failed: the PyTorch column is skipped");
        }
    }
    if !has_torch() {
        eprintln!("PyTorch is not importable: its column is skipped (pass --install-torch to install it)");
        return Ok(None);
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("bench_adam_torch.py");
    let sizes: Vec<String> = args.sizes.iter().map(|s| s.to_string()).collect();
    let out = Command::new("python3")
        .arg(&script)
        .arg("--reps")
        .arg(args.reps.to_string())
        .arg("--sizes")
        .arg(sizes.join(","))
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let times = text
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
        })
        .collect();
    Ok(Some(times))
}

fn print_table(rows: &[Row]) {
    println!();
    println!("One AdamW step on a flat f32 shard, fastest of the timed steps; GB/s counts 28 B per element.");
    println!(
        "Burn AdamW and fused CPU run on Burn's Flex CPU backend; CubeCL is our kernel through wgpu on the CPU (lavapipe);"
    );
    println!("copy = a multi-threaded memcpy of the same size (8 B per element), the machine's practical bandwidth.");
    println!(
        "| elements | Burn AdamW ms | fused CPU ms | CubeCL wgpu-CPU ms | PyTorch fused ms | Burn GB/s | fused GB/s | CubeCL GB/s | PyTorch GB/s | copy GB/s | fused / Burn | fused / PyTorch | fused / copy |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let opt_ms = |v: Option<f64>| v.map_or("n/a".to_string(), |t| format!("{t:.3}"));
    for r in rows {
        let opt_gbs = |v: Option<f64>| v.map_or("n/a".to_string(), |t| format!("{:.1}", gbs(r.size, t)));
        let vs_torch = r
            .torch_ms
            .map_or("n/a".to_string(), |t| format!("{:.2}x", t / r.fused_ms));
        println!(
            "| {} | {:.3} | {:.3} | {} | {} | {:.1} | {:.1} | {} | {} | {:.1} | {:.2}x | {} | {:.0}% |",
            r.size,
            r.burn_ms,
            r.fused_ms,
            opt_ms(r.cube_ms),
            opt_ms(r.torch_ms),
            gbs(r.size, r.burn_ms),
            gbs(r.size, r.fused_ms),
            opt_gbs(r.cube_ms),
            opt_gbs(r.torch_ms),
            r.copy_gbs,
            r.burn_ms / r.fused_ms,
            vs_torch,
            100.0 * gbs(r.size, r.fused_ms) / r.copy_gbs,
        );
    }
}
