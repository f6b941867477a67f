//! `cargo xtask bench init`: what starting a stage-3 run costs in memory, with ranks as threads
//! of one process: the peak resident memory (`VmHWM`) and the bytes read through system calls
//! (`rchar`; a memory-mapped file's pages count in the RSS instead) from before
//! the ranks build their GPT to the end of `ShardConfig::init`, for four ways of starting:
//!
//! - `eager, init`: every rank's parameters initialised before `init` (what reading a parameter,
//!   or any code written for whole models, does);
//! - `lazy, init`: built lazily, as `burn::nn` builds, and initialised one entry at a time;
//! - `load, then init`: pretrained weights loaded into each rank's whole model with burn-store's
//!   `load_from`, then `init`;
//! - `init_pretrained`: the same file loaded straight into the shards.
//!
//! Each case runs in a child process (this program with `--child`), so its peak is its own;
//! the weights file is written once by the parent.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use burn::module::{Module, ModuleMapper, Param};
use burn::optim::AdamWConfig;
use burn::tensor::{Device, Tensor};
use burn_shard::comm::{InProcessGroup, run_ranks};
use burn_shard::{Pretrained, ShardConfig, Stage};
use burn_shard_examples::gpt::Gpt;
use burn_store::{ModuleSnapshot, SafetensorsStore};

use crate::bench_infinity::{corpus, gpt_config, status_bytes};

const CASES: [&str; 4] = ["eager, init", "lazy, init", "load, then init", "init_pretrained"];
const MIB: f64 = (1u64 << 20) as f64;

/// Arguments of `cargo xtask bench init`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Ranks (threads of one process).
    #[arg(long, default_value_t = 4)]
    world_size: usize,
    /// Width (n_embd) of the GPT (heads: n_embd / 128).
    #[arg(long, default_value_t = 1024)]
    n_embd: usize,
    /// Blocks of the GPT.
    #[arg(long, default_value_t = 12)]
    layers: usize,
    /// Where the weights file is written.
    #[arg(long, default_value = "target/bench-init")]
    dir: PathBuf,
    /// Internal: run one case (its index) and print its measurements.
    #[arg(long, hide = true)]
    child: Option<usize>,
}

/// One case's measurements.
#[derive(serde::Serialize, serde::Deserialize)]
struct Measured {
    peak_growth: u64,
    read: u64,
    seconds: f64,
}

pub fn run(args: &Args) -> Result<(), String> {
    let weights = args.dir.join("gpt.safetensors");
    if let Some(case) = args.child {
        let measured = measure(args, case, &weights)?;
        println!("INIT {}", serde_json::to_string(&measured).map_err(|e| e.to_string())?);
        return Ok(());
    }
    std::fs::create_dir_all(&args.dir).map_err(|e| format!("{}: {e}", args.dir.display()))?;
    let model = build(args, &Device::flex())?;
    let (params, model_bytes) = (model.num_params(), 4 * model.num_params() as u64);
    model
        .save_into(&mut SafetensorsStore::from_file(&weights).overwrite(true))
        .map_err(|e| format!("cannot write {}: {e}", weights.display()))?;
    drop(model);
    let mut rows = Vec::new();
    for case in 0..CASES.len() {
        rows.push(spawn(args, case)?);
    }
    println!(
        "\nStarting a stage-3 run: {} ranks as threads of one process, Flex CPU, GPT of {params} parameters \
         ({:.0} MiB of f32; width {}, {} blocks); `cargo xtask bench init`\n",
        args.world_size,
        model_bytes as f64 / MIB,
        args.n_embd,
        args.layers
    );
    println!("| how the ranks start | peak RSS growth (MiB) | × the model | read() bytes (MiB) | seconds |");
    println!("|---|---|---|---|---|");
    for (case, m) in CASES.iter().zip(&rows) {
        println!(
            "| {case} | {:.0} | {:.2} | {:.0} | {:.1} |",
            m.peak_growth as f64 / MIB,
            m.peak_growth as f64 / model_bytes as f64,
            m.read as f64 / MIB,
            m.seconds
        );
    }
    println!(
        "\nThe shards of all ranks together are one model ({:.0} MiB); `× the model` counts the process's peak \
         growth in models. read() bytes: what the process read through system calls (rchar); burn-store's \
         load_from memory-maps the file instead, so its reads are page faults, counted in the RSS.",
        model_bytes as f64 / MIB
    );
    Ok(())
}

/// The GPT of `args`, lazy, on `device`.
fn build(args: &Args, device: &Device) -> Result<Gpt, String> {
    let corpus = corpus()?;
    Ok(Gpt::new(&gpt_config(&corpus, 64, args.n_embd, args.layers), device))
}

/// The child: case `case` on `args.world_size` ranks, measured from before the ranks build.
fn measure(args: &Args, case: usize, weights: &Path) -> Result<Measured, String> {
    let device = Device::flex().autodiff();
    // Threads, collectives and Burn's first ops allocate once: warmed up on a tiny model.
    run_ranks(
        InProcessGroup::new(args.world_size).map_err(|e| e.to_string())?,
        |comm| {
            let tiny = burn::nn::LinearConfig::new(4, 4).init(&device);
            drop(ShardConfig::new(Stage::Three).init(tiny, AdamWConfig::new(), comm));
        },
    )
    .map_err(|e| format!("{e:?}"))?;
    let (rss, read) = (status_bytes("VmRSS"), rchar());
    // Linux: "5" resets the peak RSS (VmHWM) to the current RSS.
    std::fs::write("/proc/self/clear_refs", "5").map_err(|e| format!("/proc/self/clear_refs: {e}"))?;
    let start = Instant::now();
    let held = run_ranks(
        InProcessGroup::new(args.world_size).map_err(|e| e.to_string())?,
        |comm| {
            let model = build(args, &device)?;
            let config = ShardConfig::new(Stage::Three);
            let sharded = match case {
                0 => config.init(model.map(&mut Touch), AdamWConfig::new(), comm),
                1 => config.init(model, AdamWConfig::new(), comm),
                2 => {
                    let mut model = model;
                    model
                        .load_from(&mut SafetensorsStore::from_file(weights))
                        .map_err(|e| e.to_string())?;
                    config.init(model, AdamWConfig::new(), comm)
                }
                _ => config.init_pretrained(model, Pretrained::safetensors(weights), AdamWConfig::new(), comm),
            };
            sharded.map_err(|e| e.to_string())
        },
    )
    .map_err(|e| format!("{e:?}"))?
    .into_iter()
    .collect::<Result<Vec<_>, String>>()?;
    let measured = Measured {
        peak_growth: status_bytes("VmHWM").saturating_sub(rss),
        read: rchar() - read,
        seconds: start.elapsed().as_secs_f64(),
    };
    drop(held);
    Ok(measured)
}

/// Runs case `case` in a child process and reads its measurements.
fn spawn(args: &Args, case: usize) -> Result<Measured, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let out = Command::new(exe)
        .args(["bench", "init", "--child", &case.to_string()])
        .args([
            "--world-size",
            &args.world_size.to_string(),
            "--n-embd",
            &args.n_embd.to_string(),
        ])
        .args(["--layers", &args.layers.to_string()])
        .arg("--dir")
        .arg(&args.dir)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot start the child: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    match (
        out.status.success(),
        stdout.lines().find_map(|l| l.strip_prefix("INIT ")),
    ) {
        (true, Some(line)) => serde_json::from_str(line).map_err(|e| e.to_string()),
        _ => Err(format!("case `{}` failed: {}\n{stdout}", CASES[case], out.status)),
    }
}

/// Bytes read by this process's system calls (`rchar` of /proc/self/io).
fn rchar() -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|io| io.lines().find_map(|l| l.strip_prefix("rchar:")?.trim().parse().ok()))
        .unwrap_or(0)
}

/// Initialises every float entry (`Param::map` reads its value): an eager model.
struct Touch;

impl ModuleMapper for Touch {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.map(|t| t)
    }
}
