//! `cargo xtask bench infinity`: a GPT whose model state is larger than this machine's memory,
//! trained at stage 3 with its parameter shards and optimizer state on disk
//! (`ShardConfig::with_params_on(Home::Disk(..))` and [`NvmeOffload`], ZeRO-Infinity's NVMe offload),
//! and one table from one run:
//!
//! - the model state (`16Ψ` bytes for `f32` AdamW: parameters, gradients, two moments; the
//!   ZeRO paper's accounting) against the machine's memory (`MemTotal`);
//! - the peak resident memory of the training process (`VmHWM`, reset after `init` so the
//!   build of the model is reported apart);
//! - the bytes the swap files read and wrote per step, and the disk's sequential write and read
//!   bandwidth measured in the same run (a probe file written with `fdatasync` and read back
//!   after dropping it from the page cache);
//! - the step time against two bounds: the disk bound (bytes read / read bandwidth + bytes
//!   written / write bandwidth) and the compute bound (a 2-layer GPT of the same width trained
//!   in memory in the same run, its step time × layers / 2);
//! - a checkpoint of the large GPT saved and loaded back: bytes, seconds and peak resident
//!   memory of each;
//! - and, at a size that fits in memory, the same training with and without NVMe offload, loss
//!   for loss.
//!
//! The large model trains in a child process (this program with `--child`), so that its peak
//! memory is its own.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::Device;
use burn_shard::checkpoint::SaveOptions;
use burn_shard::comm::InProcessGroup;
use burn_shard::{Home, NvmeOffload, ShardConfig, Stage};
use burn_shard_examples::char_data::{CharCorpus, sample_batch};
use burn_shard_examples::gpt::{Gpt, GptConfig};
use burn_shard_examples::gpu_bench::median;
use burn_shard_examples::training::training_device_on;
use rand::SeedableRng;
use rand::rngs::StdRng;

const GB: f64 = 1e9;
const GIB: f64 = (1u64 << 30) as f64;
/// AdamW's learning rate of the width-2048 GPTs up to [`LR_DEPTH`] layers (see [`lr_wide`]).
const LR_WIDE: f64 = 2e-5;
/// The depth up to which [`LR_WIDE`] is used as is.
const LR_DEPTH: usize = 16;
/// AdamW's learning rate of the small GPT.
const LR_SMALL: f64 = 1e-3;

/// Arguments of `cargo xtask bench infinity`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Parameters Ψ of the large GPT; default: the fewest whose f32 model state (16Ψ bytes) is
    /// 5 % above this machine's memory.
    #[arg(long)]
    params: Option<f64>,
    /// Width (n_embd) of the large GPT; its layers follow from --params (heads: n_embd / 128).
    #[arg(long, default_value_t = 2048)]
    n_embd: usize,
    /// Directory of the swap files, the checkpoint and the disk probe, on the disk to measure:
    /// needs 36Ψ bytes free (the optimizer state twice, 16Ψ, with a checkpoint loaded back; the
    /// parameter shards twice, 8Ψ, while a step or a load writes them beside the live ones;
    /// the checkpoint, 12Ψ).
    #[arg(long, default_value = "target/infinity-swap")]
    swap_dir: PathBuf,
    /// Steps of the large GPT (the first is reported apart: it writes the state but reads none).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 2)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 16)]
    block: usize,
    /// GiB written and read back by the disk probe.
    #[arg(long, default_value_t = 4.0)]
    probe_gib: f64,
    /// Internal: train the large GPT of `--layers` layers in this process and print its
    /// measurements.
    #[arg(long, hide = true)]
    child: bool,
    /// Leave out the checkpoint save and load of the large GPT (the disk then needs 16Ψ bytes
    /// instead of 36Ψ): how a model larger than the disk's room for a checkpoint is measured.
    #[arg(long)]
    no_checkpoint: bool,
    /// Also save a checkpoint in the background (`save_checkpoint` with `SaveOptions::in_background`) before the last
    /// step, so that the step runs while the writer reads the swap files: the disk then needs
    /// 40Ψ bytes instead of 36Ψ (the state and shards the step writes beside the pinned ones).
    #[arg(long, conflicts_with = "no_checkpoint")]
    background_save: bool,
    #[arg(long, hide = true)]
    layers: Option<usize>,
}

/// What the child measured on the large GPT.
#[derive(serde::Serialize, serde::Deserialize, Debug)]
struct BigRun {
    params: usize,
    layers: usize,
    /// Seconds to build the model and `init` it.
    init_s: f64,
    /// Peak resident bytes up to the end of `init`.
    init_peak_rss: u64,
    /// Peak resident bytes during the training steps (`VmHWM` reset after `init`).
    train_peak_rss: u64,
    step_s: Vec<f64>,
    losses: Vec<f32>,
    /// Swap-file bytes (read, written) of each step.
    io: Vec<(u64, u64)>,
    /// Of the bytes read, those not read ahead (`nvme_read_on_demand_bytes`), per step.
    on_demand: Vec<u64>,
    /// `report().memory` after the last step: parameters, gradients, in-memory optimizer state,
    /// on-disk optimizer state.
    report: (usize, usize, usize, usize),
    /// The checkpoint saved after the last step and loaded back.
    checkpoint: Option<CheckpointRun>,
}

pub fn run(args: &Args) -> Result<(), String> {
    if args.steps < 2 {
        return Err("--steps must be at least 2: the first step writes the state and reads none".into());
    }
    let corpus = corpus()?;
    if args.child {
        let layers = args.layers.ok_or("--child needs --layers")?;
        let run = big_run(args, &corpus, layers)?;
        println!("INFINITY {}", serde_json::to_string(&run).map_err(|e| e.to_string())?);
        return Ok(());
    }
    let mem_total = mem_total_bytes()?;
    let (base, per_layer) = gpt_params(&corpus, args)?;
    let target = args.params.unwrap_or(mem_total as f64 * 1.05 / 16.0);
    let layers = (((target - base as f64) / per_layer as f64).ceil() as usize).max(1);
    let psi = base + per_layer * layers;
    std::fs::create_dir_all(&args.swap_dir).map_err(|e| format!("{}: {e}", args.swap_dir.display()))?;
    // The swap file (8Ψ), the parameter shards twice (8Ψ); with the checkpoint (parameters and
    // state, 12Ψ) and the loaded state written past the live one (8Ψ more); the probe.
    let per_param = match (args.no_checkpoint, args.background_save) {
        (true, _) => 16,
        (false, false) => 36,
        (false, true) => 40,
    };
    let needed = (per_param * psi) as f64 + args.probe_gib * GIB;
    let free = free_bytes(&args.swap_dir)?;
    if free < needed * 1.05 {
        let fix = match args.no_checkpoint {
            true => "",
            false => ", pass --no-checkpoint (16Ψ)",
        };
        return Err(format!(
            "{} has {:.1} GB free; the swap files{} of {psi} parameters ({per_param}Ψ) and the probe need {:.1} GB: \
             free space there{fix} or pass --swap-dir on a larger disk",
            args.swap_dir.display(),
            free / GB,
            if args.no_checkpoint { "" } else { " and checkpoint" },
            needed / GB
        ));
    }
    eprintln!(
        "disk probe: {:.1} GiB written and read in {} ...",
        args.probe_gib,
        args.swap_dir.display()
    );
    let (write_bps, read_bps) = probe_disk(&args.swap_dir, args.probe_gib)?;
    eprintln!("small GPT with and without NVMe offload ...");
    let small = compare_small(&corpus, &args.swap_dir)?;
    eprintln!("compute bound: a 2-layer GPT of width {} in memory ...", args.n_embd);
    let two_layer_s = two_layer_step(&corpus, args)?;
    eprintln!(
        "large GPT: {psi} parameters ({layers} layers), model state {:.1} GB, in a child process ...",
        16.0 * psi as f64 / GB
    );
    let big = spawn_big(args, layers)?;
    print_table(args, mem_total, write_bps, read_bps, &small, two_layer_s, &big);
    Ok(())
}

pub(crate) fn corpus() -> Result<CharCorpus, String> {
    let path = burn_shard_examples::examples_data_dir().join("tinyshakespeare.txt");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    Ok(CharCorpus::new(&text))
}

pub(crate) fn gpt_config(corpus: &CharCorpus, block: usize, n_embd: usize, n_layer: usize) -> GptConfig {
    GptConfig {
        vocab_size: corpus.vocab_size(),
        block_size: block,
        n_embd,
        n_head: (n_embd / 128).max(1),
        n_layer,
    }
}

/// The large GPT's parameters outside the blocks and per block, counted on built 1- and
/// 2-block models.
fn gpt_params(corpus: &CharCorpus, args: &Args) -> Result<(usize, usize), String> {
    let device = Device::flex();
    let count = |layers| Gpt::new(&gpt_config(corpus, args.block, args.n_embd, layers), &device).num_params();
    let (one, two) = (count(1), count(2));
    Ok((2 * one - two, two - one))
}

/// `MemTotal` of /proc/meminfo, bytes.
fn mem_total_bytes() -> Result<u64, String> {
    let info = std::fs::read_to_string("/proc/meminfo").map_err(|e| format!("/proc/meminfo: {e}"))?;
    info.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .ok_or_else(|| "no MemTotal in /proc/meminfo".into())
}

/// A field of /proc/self/status in bytes (`VmHWM`, `VmRSS`).
pub(crate) fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| {
            v.trim_start_matches(':')
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map_or(0, |kib| kib * 1024)
}

/// Free bytes of the filesystem holding `dir`.
fn free_bytes(dir: &Path) -> Result<f64, String> {
    let path = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a NUL-terminated string and `stat` a valid out-pointer.
    if unsafe { libc::statvfs(path.as_ptr(), &mut stat) } != 0 {
        return Err(format!(
            "statvfs {}: {}",
            dir.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(stat.f_bavail as f64 * stat.f_frsize as f64)
}

/// Sequential write bandwidth (`fdatasync` included) and read bandwidth (after dropping the
/// file from the page cache) of `gib` GiB in 64 MiB blocks, bytes per second.
fn probe_disk(dir: &Path, gib: f64) -> Result<(f64, f64), String> {
    const BLOCK: usize = 64 << 20;
    let path = dir.join("disk-probe");
    let err = |e: std::io::Error| format!("{}: {e}", path.display());
    let blocks = ((gib * GIB) as usize).div_ceil(BLOCK).max(1);
    let bytes = (blocks * BLOCK) as f64;
    let block: Vec<u8> = (0..BLOCK).map(|i| (i * 31 % 251) as u8).collect();
    let start = Instant::now();
    let mut file = File::create(&path).map_err(err)?;
    for _ in 0..blocks {
        file.write_all(&block).map_err(err)?;
    }
    file.sync_data().map_err(err)?;
    let write = bytes / start.elapsed().as_secs_f64();
    // SAFETY: a valid open descriptor; advice only.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    drop(file);
    let mut file = File::open(&path).map_err(err)?;
    let mut buf = vec![0u8; BLOCK];
    let start = Instant::now();
    for _ in 0..blocks {
        file.read_exact(&mut buf).map_err(err)?;
    }
    let read = bytes / start.elapsed().as_secs_f64();
    drop(file);
    std::fs::remove_file(&path).map_err(err)?;
    Ok((write, read))
}

/// Losses and step times of one run.
struct Trained {
    losses: Vec<f32>,
    step_s: Vec<f64>,
    io: Vec<(u64, u64)>,
    on_demand: Vec<u64>,
    /// `report().memory` after the last step: parameters, gradients, optimizer state in memory,
    /// optimizer state on disk (bytes).
    report: (usize, usize, usize, usize),
    /// Peak resident bytes (`VmHWM`) at the end of the last step, before any checkpoint.
    peak_rss: u64,
    /// The checkpoint saved after the last step and loaded back, when asked for.
    checkpoint: Option<CheckpointRun>,
}

/// A checkpoint of the trained model saved and loaded back into the same optimizer, measured.
#[derive(serde::Serialize, serde::Deserialize, Debug, Clone, Copy)]
struct CheckpointRun {
    /// Bytes of the checkpoint's files.
    bytes: u64,
    save_s: f64,
    /// Peak resident bytes during the save (`VmHWM` reset before it).
    save_peak_rss: u64,
    load_s: f64,
    /// Peak resident bytes during the load (`VmHWM` reset before it).
    load_peak_rss: u64,
    /// Resident bytes before the save: what the trained job holds anyway.
    rss_before: u64,
    /// The background save before the last step, when asked for (`--background-save`).
    #[serde(default)]
    background: Option<BackgroundSave>,
}

/// A background `save_checkpoint` before the last step, measured.
#[derive(serde::Serialize, serde::Deserialize, Debug, Clone, Copy)]
struct BackgroundSave {
    /// Seconds the call took (agreement and staging: what the training thread waits for).
    call_s: f64,
    /// Bytes it staged in memory (`checkpoint_staging_bytes`).
    staged: usize,
    /// Seconds of the last step, which ran while the writer worked, and of the step before.
    step_s: f64,
    plain_step_s: f64,
    /// Seconds `wait_for_checkpoint` waited for the writer after the last step.
    wait_s: f64,
    /// Bytes of the checkpoint's files.
    bytes: u64,
}

/// `steps` steps of `model` at stage 3 on one rank, with `config`; then, with `checkpoint`, a
/// checkpoint saved there, loaded back and removed; with its flag, first one saved in the
/// background before the last step (beside it, removed after).
#[allow(clippy::too_many_arguments)]
fn train(
    corpus: &CharCorpus,
    model: Gpt,
    config: &ShardConfig,
    device: &Device,
    steps: usize,
    (batch, block, lr): (usize, usize, f64),
    mut after_init: impl FnMut(),
    checkpoint: Option<(&Path, bool)>,
) -> Result<Trained, String> {
    let comm = InProcessGroup::new(1)
        .map_err(|e| e.to_string())?
        .into_comms()
        .pop()
        .unwrap();
    let optimizer = AdamWConfig::new().with_beta_2(0.99).with_weight_decay(0.1);
    let (mut model, mut optim) = config.init(model, optimizer, comm).map_err(|e| e.to_string())?;
    after_init();
    let mut rng = StdRng::seed_from_u64(1337);
    let mut out = Trained {
        losses: Vec::new(),
        step_s: Vec::new(),
        io: Vec::new(),
        on_demand: Vec::new(),
        report: (0, 0, 0, 0),
        peak_rss: 0,
        checkpoint: None,
    };
    let background_dir = checkpoint.and_then(|(dir, bg)| bg.then(|| dir.with_extension("background")));
    let mut background = None;
    for step in 0..steps {
        if let (Some(dir), true) = (&background_dir, step + 1 == steps) {
            if dir.exists() {
                std::fs::remove_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            }
            let start = Instant::now();
            optim
                .save_checkpoint(&model, dir, SaveOptions::new(serde_json::json!({})).in_background())
                .map_err(|e| e.to_string())?;
            let call_s = start.elapsed().as_secs_f64();
            let staged = optim.report().memory(&model).checkpoint_staging_bytes;
            eprintln!(
                "  background save started in {call_s:.2} s ({:.3} GB staged)",
                staged as f64 / GB
            );
            background = Some((call_s, staged));
        }
        let (x, y) = sample_batch(&corpus.train, batch, block, &mut rng, device);
        let start = Instant::now();
        let loss = model.loss(x, y);
        out.losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr, model, grads).map_err(|e| e.to_string())?;
        out.step_s.push(start.elapsed().as_secs_f64());
        out.io.push(optim.report().nvme_io_bytes());
        out.on_demand.push(optim.report().nvme_read_on_demand_bytes());
        eprintln!(
            "  step {step}: {:.2} s, loss {:.4}, swap read {:.2} GB ({:.2} GB not read ahead), written {:.2} GB, RSS {:.2} GiB",
            out.step_s[step],
            out.losses[step],
            out.io[step].0 as f64 / GB,
            out.on_demand[step] as f64 / GB,
            out.io[step].1 as f64 / GB,
            status_bytes("VmRSS") as f64 / GIB
        );
    }
    let background = match (background, &background_dir) {
        (Some((call_s, staged)), Some(dir)) => {
            let start = Instant::now();
            optim.wait_for_checkpoint().map_err(|e| e.to_string())?;
            let wait_s = start.elapsed().as_secs_f64();
            let bytes = burn_shard::checkpoint::inspect(dir)
                .map_err(|e| e.to_string())?
                .bytes_per_rank()
                .iter()
                .sum();
            std::fs::remove_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            eprintln!("  background save complete {wait_s:.1} s after the last step");
            Some(BackgroundSave {
                call_s,
                staged,
                step_s: out.step_s[steps - 1],
                plain_step_s: out.step_s[steps - 2],
                wait_s,
                bytes,
            })
        }
        _ => None,
    };
    let r = optim.report().memory(&model);
    out.report = (
        r.parameters_bytes,
        r.gradients_bytes,
        r.optimizer_state_bytes,
        r.disk_bytes,
    );
    out.peak_rss = status_bytes("VmHWM");
    if let Some((dir, _)) = checkpoint {
        let rss_before = status_bytes("VmRSS");
        // Linux: "5" resets the peak RSS (VmHWM) to the current RSS.
        let _ = std::fs::write("/proc/self/clear_refs", "5");
        let start = Instant::now();
        optim
            .save_checkpoint(&model, dir, serde_json::json!({}))
            .map_err(|e| e.to_string())?;
        let (save_s, save_peak_rss) = (start.elapsed().as_secs_f64(), status_bytes("VmHWM"));
        let bytes = burn_shard::checkpoint::inspect(dir)
            .map_err(|e| e.to_string())?
            .bytes_per_rank()
            .iter()
            .sum();
        eprintln!("  checkpoint saved: {:.1} GB in {save_s:.1} s", bytes as f64 / GB);
        let _ = std::fs::write("/proc/self/clear_refs", "5");
        let start = Instant::now();
        let (loaded, _) = optim.load_checkpoint(model, dir).map_err(|e| e.to_string())?;
        let (load_s, load_peak_rss) = (start.elapsed().as_secs_f64(), status_bytes("VmHWM"));
        eprintln!("  checkpoint loaded in {load_s:.1} s");
        drop(loaded);
        std::fs::remove_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        out.checkpoint = Some(CheckpointRun {
            bytes,
            save_s,
            save_peak_rss,
            load_s,
            load_peak_rss,
            rss_before,
            background,
        });
    }
    Ok(out)
}

/// AdamW's learning rate of a width-2048 GPT of `layers` layers: [`LR_WIDE`] up to
/// [`LR_DEPTH`] layers, then `LR_WIDE · LR_DEPTH / layers`. Measured here with 3 steps of 32
/// tokens from Burn's default initialisation (`cargo test` probe, 2026-12-06): at 2e-5 the
/// losses fall at 8 and 16 layers (16: 4.42, 4.09, 3.54), and rise at 33 (4.22, 5.26, 5.14).
/// Each layer adds its own change to the function at every step, so keeping `lr · layers`
/// constant keeps the change per step of a deeper model that of the 16-layer one.
/// (GPT-2's scaled initialisation, N(0, 0.02) and N(0, 0.02/sqrt(2L)) on the residual
/// projections, diverged at 8 layers with 2e-5: 4.65, 9.00, 9.59.)
fn lr_wide(layers: usize) -> f64 {
    LR_WIDE * (LR_DEPTH as f64 / layers as f64).min(1.0)
}

/// A GPT of `dims` built from seed 1337 on the stage-3 training device.
fn seeded_gpt(corpus: &CharCorpus, block: usize, n_embd: usize, layers: usize) -> (Gpt, Device) {
    let device = training_device_on(&Device::flex(), Stage::Three);
    device.seed(1337);
    (Gpt::new(&gpt_config(corpus, block, n_embd, layers), &device), device)
}

/// The small GPT (width 256, 4 layers) for 8 steps with and without NVMe offload.
fn compare_small(corpus: &CharCorpus, swap: &Path) -> Result<(Trained, Trained, usize), String> {
    const STEPS: usize = 8;
    let (batch, block) = (8, 64);
    let plain = ShardConfig::new(Stage::Three);
    let nvme = plain
        .clone()
        .with_optimizer_state_on(Home::Disk(NvmeOffload::new(swap)))
        .with_params_on(Home::Disk(NvmeOffload::new(swap)));
    let (model, device) = seeded_gpt(corpus, block, 256, 4);
    let params = model.num_params();
    let shape = (batch, block, LR_SMALL);
    let memory = train(corpus, model, &plain, &device, STEPS, shape, || {}, None)?;
    let (model, device) = seeded_gpt(corpus, block, 256, 4);
    let disk = train(corpus, model, &nvme, &device, STEPS, shape, || {}, None)?;
    Ok((memory, disk, params))
}

/// Median step time of a 2-layer GPT of the large one's width, in memory (1 warm-up step, 3
/// timed).
fn two_layer_step(corpus: &CharCorpus, args: &Args) -> Result<f64, String> {
    let (model, device) = seeded_gpt(corpus, args.block, args.n_embd, 2);
    let shape = (args.batch, args.block, lr_wide(2));
    let run = train(
        corpus,
        model,
        &ShardConfig::new(Stage::Three),
        &device,
        4,
        shape,
        || {},
        None,
    )?;
    Ok(median(&run.step_s[1..]))
}

/// The child: the large GPT with NVMe offload, measured.
fn big_run(args: &Args, corpus: &CharCorpus, layers: usize) -> Result<BigRun, String> {
    let start = Instant::now();
    let (model, device) = seeded_gpt(corpus, args.block, args.n_embd, layers);
    let params = model.num_params();
    let config = ShardConfig::new(Stage::Three)
        .with_optimizer_state_on(Home::Disk(NvmeOffload::new(&args.swap_dir)))
        .with_params_on(Home::Disk(NvmeOffload::new(&args.swap_dir)));
    let (mut init_s, mut init_peak_rss) = (0.0, 0);
    let shape = (args.batch, args.block, lr_wide(layers));
    let checkpoint = args.swap_dir.join("checkpoint");
    // One left by an interrupted run would make the save fail after the whole training.
    if checkpoint.exists() {
        std::fs::remove_dir_all(&checkpoint).map_err(|e| format!("{}: {e}", checkpoint.display()))?;
    }
    let after_init = || {
        init_s = start.elapsed().as_secs_f64();
        init_peak_rss = status_bytes("VmHWM");
        // Linux: "5" resets the peak RSS (VmHWM) to the current RSS.
        let _ = std::fs::write("/proc/self/clear_refs", "5");
    };
    let trained = train(
        corpus,
        model,
        &config,
        &device,
        args.steps,
        shape,
        after_init,
        (!args.no_checkpoint).then_some((checkpoint.as_path(), args.background_save)),
    )?;
    Ok(BigRun {
        params,
        layers,
        init_s,
        init_peak_rss,
        train_peak_rss: trained.peak_rss,
        step_s: trained.step_s,
        losses: trained.losses,
        io: trained.io,
        on_demand: trained.on_demand,
        report: trained.report,
        checkpoint: trained.checkpoint,
    })
}

/// Runs [`big_run`] in a child process and reads its measurements.
fn spawn_big(args: &Args, layers: usize) -> Result<BigRun, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let out = Command::new(exe)
        .args(["bench", "infinity", "--child", "--layers", &layers.to_string()])
        .args(["--n-embd", &args.n_embd.to_string(), "--steps", &args.steps.to_string()])
        .args(["--batch", &args.batch.to_string(), "--block", &args.block.to_string()])
        .args(args.no_checkpoint.then_some("--no-checkpoint"))
        .args(args.background_save.then_some("--background-save"))
        .arg("--swap-dir")
        .arg(&args.swap_dir)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot start the child: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().find_map(|l| l.strip_prefix("INFINITY "));
    use std::os::unix::process::ExitStatusExt;
    let why = match out.status.signal() {
        Some(9) => " (SIGKILL: most likely the kernel's OOM killer; pass a smaller --params)",
        _ => "",
    };
    match (out.status.success(), line) {
        (true, Some(line)) => serde_json::from_str(line).map_err(|e| e.to_string()),
        _ => Err(format!("the large GPT's process failed: {}{why}\n{stdout}", out.status)),
    }
}

#[allow(clippy::too_many_arguments)]
fn print_table(
    args: &Args,
    mem_total: u64,
    write_bps: f64,
    read_bps: f64,
    (memory, disk, small_params): &(Trained, Trained, usize),
    two_layer_s: f64,
    big: &BigRun,
) {
    let psi = big.params as f64;
    let model_state = 16.0 * psi;
    let steady: Vec<usize> = (1..big.step_s.len()).collect();
    let step_s = median(&steady.iter().map(|&i| big.step_s[i]).collect::<Vec<_>>());
    let (read, written) = steady.last().map_or((0, 0), |&i| big.io[i]);
    let on_demand = steady.last().map_or(0, |&i| big.on_demand[i]);
    let disk_bound = read as f64 / read_bps + written as f64 / write_bps;
    let compute_bound = two_layer_s * big.layers as f64 / 2.0;
    let fs = filesystem_of(&args.swap_dir);
    println!(
        "\nZeRO-Infinity bench: NVMe offload of the parameter shards and the optimizer state, stage 3, 1 rank, Flex CPU ({} cores), {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        date()
    );
    println!("swap dir {} ({fs})\n", args.swap_dir.display());
    println!("| quantity | value |\n|---|---|");
    println!(
        "| GPT | {} parameters (Ψ), width {}, {} layers, {} × {} tokens per step |",
        big.params, args.n_embd, big.layers, args.batch, args.block
    );
    println!(
        "| model state, 16Ψ (f32 parameters, gradients, Adam moments) | {:.1} GB = {:.2} × this machine's memory ({:.1} GB) |",
        model_state / GB,
        model_state / mem_total as f64,
        mem_total as f64 / GB
    );
    println!(
        "| peak RSS while training | {:.1} GB = {:.2} × the model state (issue's goal < 0.25) |",
        big.train_peak_rss as f64 / GB,
        big.train_peak_rss as f64 / model_state
    );
    println!(
        "| peak RSS while building and sharding the model | {:.1} GB ({:.0} s) |",
        big.init_peak_rss as f64 / GB,
        big.init_s
    );
    println!(
        "| swap files per step (after the first) | read {:.2} GB, written {:.2} GB (state 8Ψ = {:.2} GB each way; \
         4Ψ = {:.2} GB: parameter shards read by forward, backward and the update, and written by it; \
         gradient shards written by backward, read by the update) |",
        read as f64 / GB,
        written as f64 / GB,
        8.0 * psi / GB,
        4.0 * psi / GB
    );
    println!(
        "| of those reads, parameter and gradient shards the compute thread waited for (not read ahead: the first \
         two units of each pass, the first bucket of the update) | {:.2} GB = {:.2} of the bytes read |",
        on_demand as f64 / GB,
        on_demand as f64 / read.max(1) as f64
    );
    println!(
        "| disk, sequential, this run | write {:.0} MB/s, read {:.0} MB/s |",
        write_bps / 1e6,
        read_bps / 1e6
    );
    println!(
        "| step time, median of steps 2-{} | {step_s:.1} s (first step {:.1} s) |",
        big.step_s.len(),
        big.step_s.first().copied().unwrap_or(f64::NAN)
    );
    println!(
        "| disk bound (read / read bw + written / write bw) | {disk_bound:.1} s: step / bound = {:.2} |",
        step_s / disk_bound
    );
    println!(
        "| compute bound (2-layer step in memory {two_layer_s:.2} s × {} / 2) | {compute_bound:.1} s: step / bound = {:.2} |",
        big.layers,
        step_s / compute_bound
    );
    println!(
        "| step / max(bounds) | {:.2} (goal ≤ 1.5) |",
        step_s / disk_bound.max(compute_bound)
    );
    if let Some(c) = &big.checkpoint {
        let state = |peak: u64| {
            format!(
                "peak RSS {:.1} GB = {:.2} × the model state ({:.1} GB held before the save)",
                peak as f64 / GB,
                peak as f64 / model_state,
                c.rss_before as f64 / GB
            )
        };
        println!(
            "| checkpoint save after the last step (state read from the swap file a tensor at a time) | {:.1} GB in {:.1} s, {} |",
            c.bytes as f64 / GB,
            c.save_s,
            state(c.save_peak_rss)
        );
        if let Some(b) = &c.background {
            println!(
                "| background save before the last step (`save_checkpoint` in the background: the writer reads the swap files while the step runs) | \
                 {:.1} GB; the call took {:.2} s ({:.3} GB staged in memory); the last step {:.1} s against {:.1} s for the step before; \
                 then {:.1} s of waiting for the writer |",
                b.bytes as f64 / GB,
                b.call_s,
                b.staged as f64 / GB,
                b.step_s,
                b.plain_step_s,
                b.wait_s
            );
        }
        println!(
            "| checkpoint load into the same optimizer (state and shards written to the swap files a piece at a time) | {:.1} s, {} |",
            c.load_s,
            state(c.load_peak_rss)
        );
    } else {
        println!("| checkpoint save and load | not run (--no-checkpoint) |");
    }
    let (p, g, o, d) = big.report;
    println!(
        "| report().memory after the last step | parameters {:.2} GB, gradients {:.2} GB, optimizer state in memory {:.2} GB, on disk (shards and state) {:.2} GB |",
        p as f64 / GB,
        g as f64 / GB,
        o as f64 / GB,
        d as f64 / GB
    );
    println!(
        "| losses (AdamW, learning rate {:.2e}: see `lr_wide`) | {:?} |",
        lr_wide(big.layers),
        big.losses
    );
    println!(
        "\nThe same GPT code at {small_params} parameters (width 256, 4 layers), 8 steps, in memory vs NVMe offload:\n"
    );
    println!(
        "| step | loss in memory | loss with NVMe offload | step s in memory | step s with NVMe |\n|---|---|---|---|---|"
    );
    for (i, (m, d)) in memory.losses.iter().zip(&disk.losses).enumerate() {
        println!(
            "| {i} | {m:.6} | {d:.6} | {:.3} | {:.3} |",
            memory.step_s[i], disk.step_s[i]
        );
    }
    let same = memory
        .losses
        .iter()
        .zip(&disk.losses)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    println!(
        "\nlosses bitwise equal: {same}; median step with / without NVMe offload: {:.2}",
        median(&disk.step_s[1..]) / median(&memory.step_s[1..])
    );
}

/// The filesystem type of `dir` (from /proc/mounts: the longest mount point above it).
fn filesystem_of(dir: &Path) -> String {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 2 && dir.starts_with(f[1])).then(|| (f[1].len(), format!("{} on {}", f[2], f[0])))
        })
        .max()
        .map_or_else(|| "filesystem unknown".into(), |(_, fs)| fs)
}

pub(crate) fn date() -> String {
    Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d %H:%M UTC")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}
