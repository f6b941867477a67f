//! `cargo xtask bench sharding`: the GPT of the shakespeare example trained for a fixed number
//! of steps on the CPU at ZeRO stages 0-3 (world size 2, ranks as threads) and on one rank,
//! next to the same model, batch and AdamW in PyTorch (gloo, started with `torchrun`): DDP,
//! `ZeroRedundancyOptimizer`, FSDP2 `fully_shard` (with and without resharding after forward)
//! and one process. Stage 3 runs twice: on the examples' device (Burn's balanced gradient
//! checkpointing, which also recomputes cheap activations in backward and re-gathers every
//! weight) and on a plain autodiff device (no activation recompute, as PyTorch's rows; weights
//! that `Linear` reshapes are then kept until backward), each next to FSDP2 `fully_shard`.
//! Every configuration runs in a fresh child process, ours and theirs one after the other, so a
//! busy machine slows both sides alike.
//!
//! Ours: step time (median of rank 0's timed steps after the warm-up), tokens/s, per-rank
//! model-state bytes from `RankReport::memory` next to the ZeRO formula for f32
//! AdamW (16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N), bytes sent per rank per step from the
//! collective's `CommStats` next to the ring volumes (2, 3, 2, 3 times (N-1)/N·4Ψ), the time a
//! rank is blocked on collectives and the share of their time hidden behind compute
//! (`CommStats::exposed`, `hidden_share`), and the process's peak RSS. Theirs (`xtask/bench/torch_gpt.py`): step time, tokens/s, the
//! bytes of each rank's parameters, gradients and optimizer state, and each rank's peak RSS.
//! Both sides also split rank 0's step into forward, backward and optimizer step, ours with the
//! time inside collectives per phase (`bench_profile.rs`).
//!
//! Outputs: a markdown table on stdout, a second one of the per-phase profile,
//! `bench_sharding.csv` (both tables' columns), and a sweep of the small model's per-rank model
//! state over world sizes (`bench_sharding_memory.csv` and `.png`, measured next to the formula)
//! in `--out`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::prelude::Device;
use burn_shard::comm::{Collective, CommStats, InProcessGroup, run_ranks};
use burn_shard::{MemoryReport, ShardConfig, ShardError, Stage};
use burn_shard_examples::char_data::{CharCorpus, sample_batch};
use burn_shard_examples::gpt::{Gpt, GptConfig};
pub(crate) use burn_shard_examples::gpu_bench::median;
use burn_shard_examples::training::{lr_at, training_device};
use plotters::prelude::*;
use profile::{Mark, PhaseSeries, Phases};
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_json::{Value, json};

#[path = "bench_profile.rs"]
mod profile;

const MIB: f64 = 1024.0 * 1024.0;
const SEED: u64 = 1337;
const PEAK_LR: f64 = 3e-3;
/// The font of the plot, shipped with the examples (DejaVu Sans Mono, licence next to it).
static FONT: &[u8] = include_bytes!("../../examples/assets/DejaVuSansMono.ttf");

/// The two model sizes.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Size {
    /// The example's default GPT: n_embd 128, 4 heads, 4 layers (about 0.8M parameters).
    #[value(name = "1m")]
    Small,
    /// n_embd 512, 8 heads, 6 layers (about 19M parameters).
    #[value(name = "20m")]
    Large,
}

impl Size {
    fn name(self) -> &'static str {
        match self {
            Size::Small => "1m",
            Size::Large => "20m",
        }
    }

    /// (n_embd, n_head, n_layer).
    fn dims(self) -> (usize, usize, usize) {
        match self {
            Size::Small => (128, 4, 4),
            Size::Large => (512, 8, 6),
        }
    }

    fn default_steps(self) -> usize {
        match self {
            Size::Small => 30,
            Size::Large => 10,
        }
    }

    fn default_warmup(self) -> usize {
        match self {
            Size::Small => 3,
            Size::Large => 2,
        }
    }
}

/// Arguments of `cargo xtask bench sharding`.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Model sizes.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Size::Small, Size::Large])]
    sizes: Vec<Size>,
    /// Timed steps per configuration (default: 30 for 1m, 10 for 20m).
    #[arg(long)]
    steps: Option<usize>,
    /// Untimed warm-up steps before them (default: 3 for 1m, 2 for 20m).
    #[arg(long)]
    warmup: Option<usize>,
    /// Ranks of the sharded runs.
    #[arg(long, default_value_t = 2)]
    world_size: usize,
    /// Cores for the whole job, on both sides: Burn's rayon pool (shared by the rank threads
    /// of the one process) and PyTorch's intra-op threads (this divided by the ranks, per
    /// process). Default: the cores of this machine.
    #[arg(long)]
    threads: Option<usize>,
    /// Global batch (sequences per step over all ranks).
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Context length (characters).
    #[arg(long, default_value_t = 64)]
    block_size: usize,
    /// World sizes of the memory sweep of the small model (one step each).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 2, 4, 8])]
    memory_world_sizes: Vec<usize>,
    /// No memory sweep (and no plot).
    #[arg(long)]
    skip_memory: bool,
    /// Only our side: no PyTorch, nothing installed.
    #[arg(long)]
    skip_torch: bool,
    /// A package index for `pip install torch` (e.g. one serving CPU-only wheels); default:
    /// pip's own (the Python registry).
    #[arg(long)]
    torch_index_url: Option<String>,
    /// Folder of the CSV files and the plot.
    #[arg(long, default_value = "docs/results")]
    out: PathBuf,
    /// Internal: run one configuration of ours, `STAGE:WORLD_SIZE[:plain][:in-step]` (`in-step`:
    /// `ShardConfig::with_overlap_comm(false)`; `plain`: a plain
    /// autodiff device instead of the examples' one), on the first of --sizes,
    /// and print its measurements as one JSON line.
    #[arg(long, hide = true)]
    worker: Option<String>,
}

/// One configuration of the table: ours and PyTorch's counterpart.
#[derive(Clone, Copy)]
struct Config {
    label: &'static str,
    stage: Stage,
    world_size_one: bool,
    /// Build on the examples' training device (stage 3: Burn's balanced gradient checkpointing,
    /// which recomputes memory-bound activations in backward); `false`: a plain autodiff device,
    /// as PyTorch's rows (none of them recompute).
    examples_device: bool,
    /// Stages 0-2: reduce buckets inside backward (`ShardConfig::overlap_comm`, the default);
    /// `false` reduces them in the step, the rows that measure what overlapping gains.
    overlap_comm: bool,
    /// PyTorch's counterpart; empty: none is run (a variant of ours only).
    torch_mode: &'static str,
    torch_label: &'static str,
}

const CONFIGS: [Config; 9] = [
    Config {
        label: "1 rank (stage 0)",
        stage: Stage::Zero,
        world_size_one: true,
        examples_device: true,
        overlap_comm: true,
        torch_mode: "single",
        torch_label: "1 process",
    },
    Config {
        label: "stage 0",
        stage: Stage::Zero,
        world_size_one: false,
        examples_device: true,
        overlap_comm: true,
        torch_mode: "ddp",
        torch_label: "DDP",
    },
    Config {
        label: "stage 1",
        stage: Stage::One,
        world_size_one: false,
        examples_device: true,
        overlap_comm: true,
        torch_mode: "zero",
        torch_label: "DDP + ZeroRedundancyOptimizer",
    },
    Config {
        label: "stage 2",
        stage: Stage::Two,
        world_size_one: false,
        examples_device: true,
        overlap_comm: true,
        torch_mode: "fsdp2-grad",
        torch_label: "FSDP2 reshard_after_forward=False",
    },
    Config {
        label: "stage 3",
        stage: Stage::Three,
        world_size_one: false,
        examples_device: true,
        overlap_comm: true,
        torch_mode: "fsdp2",
        torch_label: "FSDP2 fully_shard",
    },
    Config {
        label: "stage 3, plain autodiff",
        stage: Stage::Three,
        world_size_one: false,
        examples_device: false,
        overlap_comm: true,
        torch_mode: "fsdp2",
        torch_label: "FSDP2 fully_shard",
    },
    Config {
        label: "stage 0, reduced in the step",
        stage: Stage::Zero,
        world_size_one: false,
        examples_device: true,
        overlap_comm: false,
        torch_mode: "",
        torch_label: "(ours only)",
    },
    Config {
        label: "stage 1, reduced in the step",
        stage: Stage::One,
        world_size_one: false,
        examples_device: true,
        overlap_comm: false,
        torch_mode: "",
        torch_label: "(ours only)",
    },
    Config {
        label: "stage 2, reduced in the step",
        stage: Stage::Two,
        world_size_one: false,
        examples_device: true,
        overlap_comm: false,
        torch_mode: "",
        torch_label: "(ours only)",
    },
];

/// What one of our runs measured (parsed from the worker's JSON line).
struct Ours {
    params: usize,
    step_ms: f64,
    /// Median time rank 0 was blocked on collectives per step, ms (exposed communication).
    comm_ms: f64,
    /// Mean time rank 0's collectives ran per step, ms, exposed or hidden.
    comm_busy_ms: f64,
    /// Share of the collectives' time hidden behind compute, `1 - exposed/busy`.
    hidden_share: f64,
    sent_per_step: f64,
    step_ms_min: f64,
    /// Largest per-rank model state (params + grads + optimizer state) over the ranks.
    model_state: usize,
    rss: u64,
    /// Cores other processes kept busy while it ran ([`OthersLoad`]).
    others: f64,
    /// Rank 0's wall time per phase, median over the timed steps, ms.
    phases: Phases,
    /// Rank 0's time inside collective calls per phase, median over the timed steps, ms.
    comm_phases: Phases,
    /// Rank 0's wall time per phase less its time inside collectives, median over the timed
    /// steps of the per-step difference, ms.
    compute_phases: Phases,
}

/// What one PyTorch run measured.
struct Theirs {
    params: usize,
    step_ms: f64,
    step_ms_min: f64,
    /// Rank 0's wall time per phase (collectives included), median over the timed steps, ms.
    phases: Phases,
    model_state: u64,
    rss_max: u64,
    others: f64,
    adamw: String,
    version: String,
}

struct Row {
    size: Size,
    config: Config,
    world_size: usize,
    ours: Ours,
    theirs: Result<Theirs, String>,
}

pub fn run(args: &Args) -> Result<(), String> {
    if let Some(spec) = &args.worker {
        return worker(args, spec);
    }
    let root = workspace_root();
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
    let python = if args.skip_torch {
        None
    } else {
        Some(torch_python(&root, args.torch_index_url.as_deref())?)
    };
    let exe = WorkerExe::new()?;
    let mut rows = Vec::new();
    for &size in &args.sizes {
        let steps = args.steps.unwrap_or(size.default_steps());
        let warmup = args.warmup.unwrap_or(size.default_warmup());
        for config in CONFIGS {
            let n = if config.world_size_one { 1 } else { args.world_size };
            eprintln!(
                "[{}] ours: {} at world size {n}, {warmup} + {steps} steps ...",
                size.name(),
                config.label
            );
            let ours = run_ours(&exe.0, args, size, config, n, (warmup, steps), threads)?;
            let theirs = match &python {
                None => Err("skipped (--skip-torch)".to_string()),
                Some(_) if config.torch_mode.is_empty() => Err("no counterpart".to_string()),
                Some(python) => {
                    eprintln!("[{}] PyTorch: {} ...", size.name(), config.torch_label);
                    run_theirs(
                        python,
                        &root,
                        args,
                        size,
                        config.torch_mode,
                        n,
                        (warmup, steps),
                        threads,
                    )
                }
            };
            if let (Err(e), false) = (&theirs, config.torch_mode.is_empty()) {
                eprintln!("  PyTorch {}: {e}", config.torch_label);
            }
            rows.push(Row {
                size,
                config,
                world_size: n,
                ours,
                theirs,
            });
        }
    }
    let sweep = memory_sweep(&exe.0, args, threads)?;
    print_table(args, &rows, threads, python.is_some());
    profile::print_table(&rows);
    let out = if args.out.is_absolute() {
        args.out.clone()
    } else {
        root.join(&args.out)
    };
    std::fs::create_dir_all(&out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    let csv_path = out.join("bench_sharding.csv");
    write_csv(&csv_path, args, &rows, threads).map_err(|e| format!("cannot write {}: {e}", csv_path.display()))?;
    eprintln!("wrote {}", csv_path.display());
    if let Some((params, points)) = sweep {
        let sweep_csv = out.join("bench_sharding_memory.csv");
        write_sweep_csv(&sweep_csv, params, &points)
            .map_err(|e| format!("cannot write {}: {e}", sweep_csv.display()))?;
        let png = out.join("bench_sharding_memory.png");
        plot_memory(&png, params, &points).map_err(|e| format!("cannot draw {}: {e}", png.display()))?;
        eprintln!("wrote {} and {}", sweep_csv.display(), png.display());
    }
    Ok(())
}

/// A private copy of this program that the workers run: a `cargo build` elsewhere during the
/// bench replaces target/release/xtask, and a worker started from that path would run another
/// build, or find no file. Removed when dropped.
struct WorkerExe(PathBuf);

impl WorkerExe {
    fn new() -> Result<Self, String> {
        let dest = std::env::temp_dir().join(format!("xtask-bench-sharding-{}", std::process::id()));
        // /proc/self/exe still reads after the file on disk was replaced.
        let src = match Path::new("/proc/self/exe").exists() {
            true => PathBuf::from("/proc/self/exe"),
            false => std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?,
        };
        std::fs::copy(&src, &dest).map_err(|e| format!("cannot copy this program to {}: {e}", dest.display()))?;
        Ok(Self(dest))
    }
}

impl Drop for WorkerExe {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits in the workspace")
        .to_path_buf()
}

// ---------------------------------------------------------------------------------------------
// Formulas.

/// Per-rank model-state bytes of ZeRO for `psi` f32 parameters with Adam on `n` ranks.
fn zero_formula(stage: Stage, psi: usize, n: usize) -> f64 {
    let (psi, n) = (psi as f64, n as f64);
    match stage {
        Stage::Zero => 16.0 * psi,
        Stage::One => 8.0 * psi + 8.0 * psi / n,
        Stage::Two => 4.0 * psi + 12.0 * psi / n,
        Stage::Three => 16.0 * psi / n,
    }
}

/// Bytes one rank sends per step with ring collectives: all-reduce 2(N-1)/N·4Ψ (stage 0),
/// all-reduce + all-gather 3(N-1)/N·4Ψ (stage 1), reduce-scatter + all-gather 2(N-1)/N·4Ψ
/// (stage 2), two all-gathers (forward, backward) + reduce-scatter 3(N-1)/N·4Ψ (stage 3).
fn sent_theory(stage: Stage, psi: usize, n: usize) -> f64 {
    let ring = (n as f64 - 1.0) / n as f64 * 4.0 * psi as f64;
    match stage {
        Stage::Zero | Stage::Two => 2.0 * ring,
        Stage::One | Stage::Three => 3.0 * ring,
    }
}

/// `1234567` as `1,234,567`.
fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Our side: a child process per configuration (a fresh rayon pool and a clean peak RSS).

fn run_ours(
    exe: &Path,
    args: &Args,
    size: Size,
    config: Config,
    n: usize,
    (warmup, steps): (usize, usize),
    threads: usize,
) -> Result<Ours, String> {
    let load = OthersLoad::start();
    let stage = config.stage;
    let device = if config.examples_device { "" } else { ":plain" };
    let overlap = if config.overlap_comm { "" } else { ":in-step" };
    let out = Command::new(exe)
        .args(["bench", "sharding", "--sizes", size.name()])
        .arg("--worker")
        .arg(format!("{}:{n}{device}{overlap}", stage.number()))
        .args(["--warmup", &warmup.to_string(), "--steps", &steps.to_string()])
        .args(["--batch-size", &args.batch_size.to_string()])
        .args(["--block-size", &args.block_size.to_string()])
        .env("RAYON_NUM_THREADS", threads.to_string())
        .output()
        .map_err(|e| format!("cannot start the worker: {e}"))?;
    let others = load.cores();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find_map(|l| l.strip_prefix("BENCH_RESULT "));
    let (true, Some(line)) = (out.status.success(), line) else {
        return Err(format!(
            "our run of stage {} at world size {n} failed: {}",
            stage.number(),
            String::from_utf8_lossy(&out.stderr)
        ));
    };
    let v: Value = serde_json::from_str(line).map_err(|e| format!("bad worker output: {e}"))?;
    let num = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    Ok(Ours {
        params: num("params") as usize,
        step_ms: median(&floats(&v["step_ms"])),
        step_ms_min: floats(&v["step_ms"]).into_iter().fold(f64::NAN, f64::min),
        comm_ms: median(&floats(&v["comm_ms"])),
        comm_busy_ms: num("comm_busy_ms"),
        hidden_share: num("hidden_share"),
        sent_per_step: num("sent_per_step"),
        model_state: v["ranks"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| {
                ["params", "grads", "optim"]
                    .iter()
                    .map(|k| r[*k].as_u64().unwrap_or(0))
                    .sum::<u64>()
            })
            .max()
            .unwrap_or(0) as usize,
        rss: v["max_rss_bytes"].as_u64().unwrap_or(0),
        others,
        phases: Phases::median_of(&v, ""),
        comm_phases: Phases::median_of(&v, "comm_"),
        compute_phases: Phases::median_of_difference(&v, "", "comm_"),
    })
}

/// How busy other processes kept the machine while a child ran: the machine's busy CPU time
/// (/proc/stat, steal included) minus the CPU time of this program's waited-for children
/// (/proc/self/stat), in cores on average. NaN where /proc is missing.
struct OthersLoad {
    busy: Option<u64>,
    children: Option<u64>,
    start: Instant,
}

impl OthersLoad {
    /// Clock ticks per second of /proc's counters (USER_HZ, 100 on Linux).
    const TICKS: f64 = 100.0;

    fn start() -> Self {
        Self {
            busy: Self::machine_busy(),
            children: Self::children_cpu(),
            start: Instant::now(),
        }
    }

    fn cores(&self) -> f64 {
        let secs = self.start.elapsed().as_secs_f64();
        match (self.busy, Self::machine_busy(), self.children, Self::children_cpu()) {
            (Some(b0), Some(b1), Some(c0), Some(c1)) => {
                ((b1.saturating_sub(b0) as f64 - c1.saturating_sub(c0) as f64) / Self::TICKS / secs).max(0.0)
            }
            _ => f64::NAN,
        }
    }

    /// user + nice + system + irq + softirq + steal of the `cpu` line.
    fn machine_busy() -> Option<u64> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let f: Vec<u64> = stat
            .lines()
            .next()?
            .split_whitespace()
            .skip(1)
            .filter_map(|x| x.parse().ok())
            .collect();
        Some(f.get(0..3)?.iter().sum::<u64>() + f.get(5..8)?.iter().sum::<u64>())
    }

    /// cutime + cstime: fields 16 and 17 of /proc/self/stat.
    fn children_cpu() -> Option<u64> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let after = &stat[stat.rfind(')')? + 2..];
        let f: Vec<&str> = after.split_whitespace().collect();
        Some(f.get(13)?.parse::<u64>().ok()? + f.get(14)?.parse::<u64>().ok()?)
    }
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().into_iter().flatten().filter_map(Value::as_f64).collect()
}

/// What one rank of a worker measured.
struct RankRun {
    step_ms: Vec<f64>,
    comm_ms: Vec<f64>,
    /// The same steps split into forward, backward and optimizer step.
    phases: PhaseSeries,
    sent: u64,
    /// Time the rank's collectives ran per timed step, ms (`CommStats::busy`).
    busy_ms: f64,
    /// Share of that time hidden behind compute (`CommStats::hidden_share`).
    hidden_share: Option<f64>,
    memory: MemoryReport,
}

/// The child process: trains `--sizes`' first model at `STAGE:WORLD_SIZE` and prints
/// `BENCH_RESULT <json>`.
fn worker(args: &Args, spec: &str) -> Result<(), String> {
    let bad = || format!("--worker wants STAGE:WORLD_SIZE[:plain][:in-step], got {spec:?}");
    let (spec, in_step) = match spec.strip_suffix(":in-step") {
        Some(rest) => (rest, true),
        None => (spec, false),
    };
    let (spec, plain) = match spec.strip_suffix(":plain") {
        Some(rest) => (rest, true),
        None => (spec, false),
    };
    let (stage, n) = spec.split_once(':').ok_or_else(bad)?;
    let stage = Stage::try_from(stage.parse::<u8>().map_err(|_| bad())?).map_err(|e| e.to_string())?;
    let n: usize = n.parse().map_err(|_| bad())?;
    let size = *args.sizes.first().ok_or("no --sizes")?;
    let (warmup, steps) = (
        args.warmup.unwrap_or(size.default_warmup()),
        args.steps.unwrap_or(size.default_steps()),
    );
    if n == 0 || !args.batch_size.is_multiple_of(n) {
        return Err(format!(
            "--batch-size {} must divide by world size {n}",
            args.batch_size
        ));
    }
    let path = burn_shard_examples::examples_data_dir().join("tinyshakespeare.txt");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let corpus = CharCorpus::new(&text);
    let (n_embd, n_head, n_layer) = size.dims();
    let config = GptConfig {
        vocab_size: corpus.vocab_size(),
        block_size: args.block_size,
        n_embd,
        n_head,
        n_layer,
    };
    let rank_device = || match plain {
        true => Device::flex().autodiff(),
        false => training_device(stage),
    };
    let device = rank_device();
    device.seed(SEED);
    let base = Gpt::new(&config, &device);
    let params = base.num_params();
    let total = warmup + steps;
    let local = args.batch_size / n;
    let group = InProcessGroup::new(n).map_err(|e| e.to_string())?;
    let ranks = run_ranks(group, |comm| -> Result<RankRun, ShardError> {
        let rank = comm.rank();
        let device = rank_device();
        // The example's optimizer: Burn's AdamW config, run as the fused AdamW step.
        let optimizer = AdamWConfig::new().with_beta_2(0.99).with_weight_decay(0.1);
        let config = ShardConfig::new(stage).with_overlap_comm(!in_step);
        let (mut model, mut optim) = config.init(base.clone().fork(&device), optimizer, comm)?;
        let mut rng = StdRng::seed_from_u64(SEED.wrapping_add(rank as u64 * 7919));
        let mut run = RankRun {
            step_ms: Vec::new(),
            comm_ms: Vec::new(),
            phases: PhaseSeries::default(),
            sent: 0,
            busy_ms: 0.0,
            hidden_share: None,
            memory: optim.report().memory(&model),
        };
        let mut sent_before = CommStats::default();
        for step in 0..total {
            let (x, y) = sample_batch(&corpus.train, local, args.block_size, &mut rng, &device);
            if step == warmup {
                sent_before = optim.comm().stats();
            }
            // Phase boundaries. Flex runs every op when it is called (no fusion, no queue), so
            // each phase's work is done when its call returns: no read-back needed to close it.
            let start = Mark::now(&optim.comm().stats());
            let loss = model.loss(x, y);
            let forward_done = Mark::now(&optim.comm().stats());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let backward_done = Mark::now(&optim.comm().stats());
            model = optim.step(lr_at(step, total, PEAK_LR, total / 20), model, grads)?;
            let step_done = Mark::now(&optim.comm().stats());
            if step >= warmup {
                let (elapsed, in_comm) = run.phases.push([start, forward_done, backward_done, step_done]);
                run.step_ms.push(elapsed);
                run.comm_ms.push(in_comm);
            }
        }
        let timed = optim.comm().stats().since(&sent_before);
        run.sent = timed.total_bytes_sent();
        run.busy_ms = timed.busy().as_secs_f64() * 1e3 / steps.max(1) as f64;
        run.hidden_share = timed.hidden_share();
        run.memory = optim.report().memory(&model);
        Ok(run)
    })
    .map_err(|f| format!("rank {} panicked: {}", f.rank, f.message))?
    .into_iter()
    .collect::<Result<Vec<_>, _>>()
    .map_err(|e| e.to_string())?;
    let r0 = &ranks[0];
    let mut result = json!({
        "params": params,
        "stage": stage.number(),
        "world_size": n,
        "step_ms": r0.step_ms,
        "comm_ms": r0.comm_ms,
        "comm_busy_ms": r0.busy_ms,
        "hidden_share": r0.hidden_share,
        "sent_per_step": r0.sent as f64 / steps.max(1) as f64,
        "max_rss_bytes": peak_rss(),
        "ranks": ranks.iter().map(|r| json!({
            "params": r.memory.parameters_bytes,
            "grads": r.memory.gradients_bytes,
            "optim": r.memory.optimizer_state_bytes,
            "temp_peak": r.memory.temporary_peak_bytes,
        })).collect::<Vec<_>>(),
    });
    result
        .as_object_mut()
        .expect("a JSON object")
        .extend(r0.phases.to_json());
    println!("BENCH_RESULT {result}");
    Ok(())
}

/// This process's peak resident set (VmHWM), 0 where /proc is missing.
fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

// ---------------------------------------------------------------------------------------------
// PyTorch's side.

/// The Python of `target/bench-venv` with torch importable; creates the environment and
/// installs torch from the Python registry when needed.
fn torch_python(root: &Path, index_url: Option<&str>) -> Result<PathBuf, String> {
    let venv = root.join("target").join("bench-venv");
    let python = venv.join("bin").join("python");
    let ready = || {
        Command::new(&python)
            .args(["-c", "import torch; from torch.distributed.fsdp import fully_shard"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    };
    if ready() {
        return Ok(python);
    }
    if !python.exists() {
        eprintln!("creating {} ...", venv.display());
        let ok = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !ok {
            return Err(format!(
                "python3 -m venv {} failed (Debian: apt-get install python3-venv); or pass --skip-torch",
                venv.display()
            ));
        }
    }
    eprintln!("installing torch into {} (pip install torch) ...", venv.display());
    let mut pip = Command::new(&python);
    pip.args(["-m", "pip", "install", "--quiet", "torch"]);
    if let Some(url) = index_url {
        pip.args(["--index-url", url]);
    }
    let ok = pip.status().map(|s| s.success()).unwrap_or(false);
    if !ok || !ready() {
        return Err("pip install torch failed or FSDP2 (torch >= 2.6) is missing; pass --skip-torch".into());
    }
    Ok(python)
}

#[allow(clippy::too_many_arguments)]
fn run_theirs(
    python: &Path,
    root: &Path,
    args: &Args,
    size: Size,
    mode: &str,
    n: usize,
    (warmup, steps): (usize, usize),
    threads: usize,
) -> Result<Theirs, String> {
    let per_rank = (threads / n).max(1);
    let script = root.join("xtask").join("bench").join("torch_gpt.py");
    let data = burn_shard_examples::examples_data_dir().join("tinyshakespeare.txt");
    let (n_embd, n_head, n_layer) = size.dims();
    let mut last_error = String::new();
    // torch's gloo teardown aborts now and then after a complete run: one more try.
    for _ in 0..2 {
        let load = OthersLoad::start();
        let mut cmd = Command::new(python);
        if mode != "single" {
            cmd.args(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node"])
                .arg(n.to_string());
        }
        let out = cmd
            .arg(&script)
            .args(["--mode", mode])
            .arg("--data")
            .arg(&data)
            .args(["--warmup", &warmup.to_string(), "--steps", &steps.to_string()])
            .args(["--batch-size", &args.batch_size.to_string()])
            .args(["--block-size", &args.block_size.to_string()])
            .args(["--n-embd", &n_embd.to_string(), "--n-head", &n_head.to_string()])
            .args(["--n-layer", &n_layer.to_string(), "--threads", &per_rank.to_string()])
            .env("OMP_NUM_THREADS", per_rank.to_string())
            .output()
            .map_err(|e| format!("cannot start {}: {e}", python.display()))?;
        let others = load.cores();
        let text = String::from_utf8_lossy(&out.stdout);
        let Some(line) = text.lines().find_map(|l| l.strip_prefix("TORCH_RESULT ")) else {
            let err = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = err.lines().rev().take(8).collect();
            last_error = format!(
                "{mode} failed ({}): {}",
                out.status,
                tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
            );
            continue;
        };
        let v: Value = serde_json::from_str(line).map_err(|e| format!("bad PyTorch output: {e}"))?;
        let ranks = v["ranks"].as_array().cloned().unwrap_or_default();
        let field = |r: &Value, k: &str| r[k].as_u64().unwrap_or(0);
        return Ok(Theirs {
            params: v["params"].as_u64().unwrap_or(0) as usize,
            step_ms: median(&floats(&v["step_ms"])),
            step_ms_min: floats(&v["step_ms"]).into_iter().fold(f64::NAN, f64::min),
            phases: Phases::median_of(&v, ""),
            model_state: ranks
                .iter()
                .map(|r| field(r, "params_bytes") + field(r, "grads_bytes") + field(r, "optim_bytes"))
                .max()
                .unwrap_or(0),
            rss_max: ranks.iter().map(|r| field(r, "max_rss_bytes")).max().unwrap_or(0),
            adamw: v["adamw"].as_str().unwrap_or("?").to_string(),
            version: v["torch"].as_str().unwrap_or("?").to_string(),
            others,
        });
    }
    Err(last_error)
}

// ---------------------------------------------------------------------------------------------
// The memory sweep.

struct SweepPoint {
    stage: Stage,
    world_size: usize,
    measured: usize,
}

fn memory_sweep(exe: &Path, args: &Args, threads: usize) -> Result<Option<(usize, Vec<SweepPoint>)>, String> {
    if args.skip_memory || args.memory_world_sizes.is_empty() {
        return Ok(None);
    }
    let mut points = Vec::new();
    let mut params = 0;
    for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
        for &n in &args.memory_world_sizes {
            eprintln!("[memory] stage {} at world size {n}, one step ...", stage.number());
            let config = CONFIGS
                .into_iter()
                .find(|c| c.stage == stage && !c.world_size_one && c.examples_device)
                .expect("every stage has a row");
            let ours = run_ours(exe, args, Size::Small, config, n, (0, 1), threads)?;
            params = ours.params;
            points.push(SweepPoint {
                stage,
                world_size: n,
                measured: ours.model_state,
            });
        }
    }
    Ok(Some((params, points)))
}

fn write_sweep_csv(path: &Path, params: usize, points: &[SweepPoint]) -> Result<(), csv::Error> {
    let mut w = csv::Writer::from_path(path)?;
    w.write_record([
        "params",
        "stage",
        "world_size",
        "measured_model_state_bytes",
        "formula_bytes",
    ])?;
    for p in points {
        w.write_record([
            params.to_string(),
            p.stage.number().to_string(),
            p.world_size.to_string(),
            p.measured.to_string(),
            format!("{:.0}", zero_formula(p.stage, params, p.world_size)),
        ])?;
    }
    w.flush()?;
    Ok(())
}

fn plot_memory(path: &Path, params: usize, points: &[SweepPoint]) -> Result<(), Box<dyn std::error::Error>> {
    static REGISTER: std::sync::Once = std::sync::Once::new();
    REGISTER.call_once(|| {
        assert!(
            plotters::style::register_font("sans-serif", FontStyle::Normal, FONT).is_ok(),
            "the shipped font is a valid TrueType file"
        );
    });
    let max_n = points.iter().map(|p| p.world_size).max().unwrap_or(8).max(2);
    let y_max = (zero_formula(Stage::Zero, params, 1) / MIB)
        .max(points.iter().map(|p| p.measured as f64 / MIB).fold(0.0, f64::max))
        * 1.55; // room for the legend above the stage-0 line
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("Per-rank model state, GPT of {} f32 params, AdamW", thousands(params)),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.8f64..max_n as f64 + 0.2, 0f64..y_max)?;
    chart
        .configure_mesh()
        .x_desc("world size N")
        .x_labels(max_n)
        .x_label_formatter(&|x| format!("{}", x.round() as i64))
        .y_desc("MiB per rank")
        .label_style(("sans-serif", 14))
        .draw()?;
    let colors = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
    ];
    for (i, stage) in [Stage::Zero, Stage::One, Stage::Two, Stage::Three]
        .into_iter()
        .enumerate()
    {
        let color = colors[i];
        let formula: Vec<(f64, f64)> = (1..=max_n)
            .map(|n| (n as f64, zero_formula(stage, params, n) / MIB))
            .collect();
        let name = ["16Ψ", "8Ψ+8Ψ/N", "4Ψ+12Ψ/N", "16Ψ/N"][i];
        chart
            .draw_series(LineSeries::new(formula, color.stroke_width(2)))?
            .label(format!("stage {i} formula {name}"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        let measured: Vec<(f64, f64)> = points
            .iter()
            .filter(|p| p.stage == stage)
            .map(|p| (p.world_size as f64, p.measured as f64 / MIB))
            .collect();
        chart
            .draw_series(measured.iter().map(|&p| Circle::new(p, 5, color.filled())))?
            .label(format!("stage {i} measured (report().memory)"))
            .legend(move |(x, y)| Circle::new((x + 10, y), 4, color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 13))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The table and the CSV.

fn tokens_per_s(args: &Args, ms: f64) -> f64 {
    (args.batch_size * args.block_size) as f64 / (ms / 1e3)
}

/// Our and PyTorch's step time of the world-size-N stage 0 / DDP row of the same size.
fn baseline(rows: &[Row], size: Size) -> (f64, Option<f64>) {
    rows.iter()
        .find(|r| r.size == size && r.config.label == "stage 0")
        .map_or((f64::NAN, None), |r| {
            (r.ours.step_ms, r.theirs.as_ref().ok().map(|t| t.step_ms))
        })
}

fn print_table(args: &Args, rows: &[Row], threads: usize, torch: bool) {
    let n = args.world_size;
    println!();
    println!(
        "GPT of the shakespeare example, global batch {}x{} characters, f32, AdamW (betas 0.9/0.99, eps 1e-5, wd 0.1); \
         step time = median of rank 0's timed steps (forward, backward, optimizer step) after the warm-up.",
        args.batch_size, args.block_size
    );
    println!(
        "Threads: {threads} cores in all on both sides: ours one process, ranks as threads sharing a rayon pool of \
         {threads} (RAYON_NUM_THREADS={threads}); PyTorch {} intra-op thread(s) per rank process \
         (torch.set_num_threads, OMP_NUM_THREADS), {threads} for its one process.",
        (threads / n).max(1)
    );
    if let Some(t) = rows.iter().find_map(|r| r.theirs.as_ref().ok()) {
        println!(
            "PyTorch {} on the CPU, gloo, torchrun; AdamW fused=True for 1 process, DDP and ZeRO, the {} implementation under FSDP2.",
            t.version,
            rows.iter()
                .filter(|r| r.config.torch_mode.starts_with("fsdp2"))
                .find_map(|r| r.theirs.as_ref().ok().map(|t| t.adamw.clone()))
                .unwrap_or_else(|| "default".into())
        );
    } else if !torch {
        println!("PyTorch skipped (--skip-torch).");
    }
    println!(
        "State = params + grads + optimizer state per rank (ours: report().memory, largest rank; formula in parentheses); \
         sent = bytes per rank per step (CommStats; ring theory in parentheses); in collectives = rank 0's time blocked \
         on collectives (CommStats::exposed: synchronous calls whole, waiting included, and the unfinished part of a \
         prefetched gather when it is needed), with the step's share; hidden = share of the time the collectives ran \
         (CommStats::busy) that overlapped compute; RSS = peak resident memory \
         (ours: the one process of all ranks; PyTorch: the largest rank process); others' load = cores kept busy by \
         other processes of the machine while the configuration ran (/proc/stat less this bench's own CPU time)."
    );
    println!();
    println!(
        "| model (Ψ) | ours | PyTorch | ours ms/step | PyTorch ms/step | time ours/PyTorch | ours tokens/s | PyTorch tokens/s \
         | ours / ours stage 0 | PyTorch / DDP | ours state MiB/rank (formula) | PyTorch state MiB/rank \
         | ours sent MiB/rank/step (theory) | ours in collectives ms/step | ours comm hidden | ours RSS MiB | PyTorch RSS MiB/rank \
         | others' load, cores (ours / PyTorch) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let o = &r.ours;
        let (base_ours, base_theirs) = baseline(rows, r.size);
        let t = r.theirs.as_ref().ok();
        let na = || "n/a".to_string();
        let model = match t {
            Some(t) if t.params != o.params => format!(
                "{} ({}; PyTorch {})",
                r.size.name(),
                thousands(o.params),
                thousands(t.params)
            ),
            _ => format!("{} ({})", r.size.name(), thousands(o.params)),
        };
        let ours_label = format!("{}, N={}", r.config.label, r.world_size);
        println!(
            "| {model} | {ours_label} | {} | {:.1} | {} | {} | {:.0} | {} | {:.2}x | {} | {:.2} ({:.2}) | {} | {:.2} ({:.2}) | {:.1} ({:.0}%) | {} | {:.0} | {} | {:.1} / {} |",
            if t.is_some() || torch {
                r.config.torch_label.to_string()
            } else {
                "-".into()
            },
            o.step_ms,
            t.map_or_else(na, |t| format!("{:.1}", t.step_ms)),
            t.map_or_else(na, |t| format!("{:.2}x", o.step_ms / t.step_ms)),
            tokens_per_s(args, o.step_ms),
            t.map_or_else(na, |t| format!("{:.0}", tokens_per_s(args, t.step_ms))),
            o.step_ms / base_ours,
            match (t, base_theirs) {
                (Some(t), Some(b)) => format!("{:.2}x", t.step_ms / b),
                _ => na(),
            },
            o.model_state as f64 / MIB,
            zero_formula(r.config.stage, o.params, r.world_size) / MIB,
            t.map_or_else(na, |t| format!("{:.2}", t.model_state as f64 / MIB)),
            o.sent_per_step / MIB,
            sent_theory(r.config.stage, o.params, r.world_size) / MIB,
            o.comm_ms,
            100.0 * o.comm_ms / o.step_ms,
            if o.hidden_share.is_finite() {
                format!("{:.0}% of {:.1} ms", 100.0 * o.hidden_share, o.comm_busy_ms)
            } else {
                "-".to_string()
            },
            o.rss as f64 / MIB,
            t.map_or_else(na, |t| format!("{:.0}", t.rss_max as f64 / MIB)),
            o.others,
            t.map_or_else(na, |t| format!("{:.1}", t.others)),
        );
    }
    for r in rows {
        if let Err(e) = &r.theirs
            && torch
            && !r.config.torch_mode.is_empty()
        {
            println!(
                "\nPyTorch {} ({}) did not run: {e}",
                r.config.torch_label,
                r.size.name()
            );
        }
    }
}

fn write_csv(path: &Path, args: &Args, rows: &[Row], threads: usize) -> Result<(), csv::Error> {
    let mut w = csv::Writer::from_path(path)?;
    let header = [
        "size",
        "params",
        "ours",
        "stage",
        "world_size",
        "threads",
        "global_batch",
        "block_size",
        "ours_step_ms",
        "ours_step_ms_min",
        "ours_tokens_per_s",
        "ours_model_state_bytes",
        "formula_model_state_bytes",
        "ours_sent_bytes_per_step",
        "theory_sent_bytes_per_step",
        "ours_collective_ms_per_step",
        "ours_collective_busy_ms_per_step",
        "ours_collective_hidden_share",
        "ours_peak_rss_bytes",
        "ours_other_load_cores",
        "pytorch",
        "pytorch_version",
        "pytorch_adamw",
        "pytorch_params",
        "pytorch_step_ms",
        "pytorch_step_ms_min",
        "pytorch_tokens_per_s",
        "pytorch_model_state_bytes",
        "pytorch_peak_rss_bytes_max_rank",
        "pytorch_other_load_cores",
        "step_time_ours_over_pytorch",
        "pytorch_error",
    ];
    w.write_record(header.into_iter().chain(profile::CSV_HEADER))?;
    for r in rows {
        let o = &r.ours;
        let t = r.theirs.as_ref().ok();
        let opt = |f: &dyn Fn(&Theirs) -> String| t.map_or(String::new(), f);
        let fields = [
            r.size.name().to_string(),
            o.params.to_string(),
            r.config.label.to_string(),
            r.config.stage.number().to_string(),
            r.world_size.to_string(),
            threads.to_string(),
            args.batch_size.to_string(),
            args.block_size.to_string(),
            format!("{:.3}", o.step_ms),
            format!("{:.3}", o.step_ms_min),
            format!("{:.1}", tokens_per_s(args, o.step_ms)),
            o.model_state.to_string(),
            format!("{:.0}", zero_formula(r.config.stage, o.params, r.world_size)),
            format!("{:.0}", o.sent_per_step),
            format!("{:.0}", sent_theory(r.config.stage, o.params, r.world_size)),
            format!("{:.3}", o.comm_ms),
            format!("{:.3}", o.comm_busy_ms),
            if o.hidden_share.is_finite() {
                format!("{:.4}", o.hidden_share)
            } else {
                String::new()
            },
            o.rss.to_string(),
            format!("{:.2}", o.others),
            r.config.torch_label.to_string(),
            opt(&|t| t.version.clone()),
            opt(&|t| t.adamw.clone()),
            opt(&|t| t.params.to_string()),
            opt(&|t| format!("{:.3}", t.step_ms)),
            opt(&|t| format!("{:.3}", t.step_ms_min)),
            opt(&|t| format!("{:.1}", tokens_per_s(args, t.step_ms))),
            opt(&|t| t.model_state.to_string()),
            opt(&|t| t.rss_max.to_string()),
            opt(&|t| format!("{:.2}", t.others)),
            opt(&|t| format!("{:.3}", o.step_ms / t.step_ms)),
            r.theirs.as_ref().err().cloned().unwrap_or_default(),
        ];
        w.write_record(fields.into_iter().chain(profile::csv_fields(r)))?;
    }
    w.flush()?;
    Ok(())
}
