//! `gpu-bench`: the GPU benchmark of `cargo xtask gpu-bundle` (feature `cuda`), run by the
//! bundle's `run.sh` on a machine with an NVIDIA GPU.
//!
//! - Adam: one AdamW step on flat `f32` shards of 1e6-1e9 elements, burn-shard's fused CubeCL
//!   kernel next to Burn's own AdamW on the same GPU and next to a device-to-device copy of the
//!   same bytes (`cuMemcpyDtoD`, the physical limit of a memory-bound step). Each step is timed
//!   from the host around a device synchronisation, so the smallest sizes include the launch
//!   and synchronisation overhead.
//! - GPT: the shakespeare example's GPT at about 20M and about 300M parameters, stages 0-3,
//!   through NCCL (one rank per GPU) and through the in-process backend (2 ranks as threads on
//!   GPU 0): step time, tokens/s, each rank's model state (`report().memory`), the device
//!   allocator's bytes, bytes sent per step and the share of collective time hidden behind
//!   compute. One child process (`--worker`) per model size and backend runs the four stages;
//!   a child that outlives its share of `--budget` is stopped, and what it measured is kept.
//!
//! Writes `adam.csv`, `gpt.csv` and `results.md` (both tables) into `--out`, row by row, so a
//! run stopped by a time limit keeps what it measured.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::prelude::*;
use burn_shard::Stage;
use burn_shard::comm::{NcclComm, NcclId, cuda_copy_bandwidth, cuda_device_count};
use burn_shard_examples::char_data::CharCorpus;
use burn_shard_examples::gpu_bench::{
    ADAM_BYTES_PER_ELEMENT, GptRankRun, GptSpec, adam_row, gpt_base, gpt_in_process, train_gpt_rank,
};
use burn_shard_examples::training::training_device_on;
use clap::Parser;
use serde_json::{Value, json};

#[derive(Parser, Debug)]
#[command(about = "burn-shard's GPU benchmark: the fused Adam kernel and the example GPT per stage")]
struct Args {
    /// Folder for adam.csv, gpt.csv and results.md (created).
    #[arg(long, default_value = "gpu-bench-results")]
    out: PathBuf,
    /// The tiny shakespeare text (the bundle ships it as data/tinyshakespeare.txt).
    #[arg(long)]
    data: PathBuf,
    /// Seconds for the whole benchmark: the GPT table's children share equally what the Adam
    /// table leaves.
    #[arg(long, default_value_t = 600)]
    budget: u64,
    /// Shard sizes of the Adam table, elements.
    #[arg(long, value_delimiter = ',', default_values_t = [1_000_000usize, 10_000_000, 100_000_000, 1_000_000_000])]
    adam_sizes: Vec<usize>,
    /// Timed steps per Adam size and implementation (after one warm-up step); the fastest counts.
    #[arg(long, default_value_t = 10)]
    reps: usize,
    /// GPT sizes: 20m (n_embd 512, 8 heads, 6 layers), 300m (1024, 16, 24).
    #[arg(long, value_delimiter = ',', default_values_t = [String::from("20m"), String::from("300m")])]
    gpt_sizes: Vec<String>,
    /// Skip the Adam table.
    #[arg(long)]
    no_adam: bool,
    /// Skip the GPT table.
    #[arg(long)]
    no_gpt: bool,
    /// Internal: run one model size on one backend (`SIZE:nccl:N` or `SIZE:in-process:N`) at
    /// stages 0-3 and print `BENCH_RESULT <json>` after each.
    #[arg(long, hide = true)]
    worker: Option<String>,
}

fn main() {
    let args = Args::parse();
    let result = match &args.worker {
        Some(spec) => worker(&args, spec),
        None => run(&args),
    };
    if let Err(e) = result {
        eprintln!("gpu-bench: {e}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> Result<(), String> {
    let start = Instant::now();
    let gpus = cuda_device_count().map_err(|e| format!("no usable GPU: {e}"))?;
    if gpus == 0 {
        return Err("no CUDA device: this benchmark needs an NVIDIA GPU".into());
    }
    std::fs::create_dir_all(&args.out).map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    if !args.data.is_file() {
        return Err(format!("--data {}: no such file", args.data.display()));
    }
    let mut md = Report::create(&args.out.join("results.md"))?;
    md.line(&format!(
        "GPUs: {gpus} (the device-to-device copy and the Adam table use GPU 0)"
    ))?;
    if !args.no_adam {
        adam_table(args, &mut md)?;
    }
    if !args.no_gpt {
        let left = Duration::from_secs(args.budget).saturating_sub(start.elapsed());
        gpt_table(args, gpus, left, &mut md)?;
    }
    Ok(())
}

/// A markdown file and stdout, written line by line.
struct Report(std::fs::File);

impl Report {
    fn create(path: &Path) -> Result<Self, String> {
        std::fs::File::create(path)
            .map(Report)
            .map_err(|e| format!("cannot create {}: {e}", path.display()))
    }

    fn line(&mut self, text: &str) -> Result<(), String> {
        println!("{text}");
        writeln!(self.0, "{text}")
            .and_then(|_| self.0.flush())
            .map_err(|e| format!("cannot write the report: {e}"))
    }
}

fn csv_writer(path: &Path, header: &[&str]) -> Result<csv::Writer<std::fs::File>, String> {
    let mut w = csv::Writer::from_path(path).map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    w.write_record(header).map_err(|e| e.to_string())?;
    w.flush().map_err(|e| e.to_string())?;
    Ok(w)
}

fn adam_table(args: &Args, md: &mut Report) -> Result<(), String> {
    let device = Device::cuda(0);
    let mut csv = csv_writer(
        &args.out.join("adam.csv"),
        &[
            "elements",
            "fused_ms",
            "burn_adamw_ms",
            "fused_gbs",
            "burn_gbs",
            "copy_gbs",
            "path",
        ],
    )?;
    md.line("")?;
    md.line(&format!(
        "One AdamW step on a flat f32 shard on GPU 0, fastest of {} timed steps; GB/s counts {ADAM_BYTES_PER_ELEMENT} B per element; \
         copy = cuMemcpyDtoD of the same bytes (14 B per element read and written).",
        args.reps
    ))?;
    md.line(
        "| elements | fused ms | Burn AdamW ms | fused GB/s | Burn GB/s | copy GB/s | fused / copy | Burn / fused |",
    )?;
    md.line("|---|---|---|---|---|---|---|---|")?;
    for &n in &args.adam_sizes {
        eprintln!("adam: {n} elements ...");
        // A size the device cannot hold panics inside CubeCL: a row that says so, not the end.
        let row = std::panic::catch_unwind(|| adam_row(&device, n, args.reps))
            .unwrap_or_else(|_| Err("panicked (out of device memory?)".into()));
        let row = match row {
            Ok(row) => row,
            Err(e) => {
                md.line(&format!("| {n} | failed: {e} | | | | | | |"))?;
                continue;
            }
        };
        let copy = cuda_copy_bandwidth(0, n * (ADAM_BYTES_PER_ELEMENT as usize) / 2, args.reps)
            .inspect_err(|e| eprintln!("copy bandwidth at {n} elements: {e}"))
            .ok();
        let (fused, burn) = (row.gbs(row.fused_ms), row.gbs(row.burn_ms));
        let or_na = |v: Option<String>| v.unwrap_or_else(|| "n/a".into());
        md.line(&format!(
            "| {n} | {:.3} | {:.3} | {fused:.0} | {burn:.0} | {} | {} | {:.2}x |",
            row.fused_ms,
            row.burn_ms,
            or_na(copy.map(|c| format!("{c:.0}"))),
            or_na(copy.map(|c| format!("{:.0}%", 100.0 * fused / c))),
            row.burn_ms / row.fused_ms
        ))?;
        csv.write_record([
            n.to_string(),
            format!("{:.4}", row.fused_ms),
            format!("{:.4}", row.burn_ms),
            format!("{fused:.1}"),
            format!("{burn:.1}"),
            or_na(copy.map(|c| format!("{c:.1}"))),
            row.path.clone(),
        ])
        .and_then(|_| csv.flush().map_err(Into::into))
        .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// (n_embd, n_head, n_layer), global batch, warm-up and timed steps of a size name.
fn gpt_size(name: &str) -> Result<GptSpec, String> {
    let (dims, global_batch, warmup, steps) = match name {
        "20m" => ((512, 8, 6), 16, 3, 5),
        "300m" => ((1024, 16, 24), 8, 2, 3),
        other => return Err(format!("unknown GPT size {other:?}: use 20m or 300m")),
    };
    Ok(GptSpec {
        dims,
        block_size: 256,
        global_batch,
        warmup,
        steps,
        stage: Stage::Zero,
    })
}

const GPT_COLUMNS: [&str; 14] = [
    "size",
    "params",
    "comm",
    "world_size",
    "stage",
    "step_ms",
    "tokens_per_s",
    "model_state_mib_per_rank",
    "device_in_use_mib",
    "device_reserved_mib",
    "sent_mib_per_step",
    "hidden_share",
    "loss_first",
    "loss_last",
];

fn gpt_table(args: &Args, gpus: usize, budget: Duration, md: &mut Report) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let mut csv = csv_writer(&args.out.join("gpt.csv"), &GPT_COLUMNS)?;
    md.line("")?;
    md.line(
        "The shakespeare GPT (block 256), AdamW, median step after the warm-up; stage 3 recomputes activations in backward \
         (Burn's balanced gradient checkpointing), stages 0-2 do not. Model state = one rank's parameters + gradients + \
         optimizer state (report().memory). Device = the peak bytes in use of GPU 0's allocator, sampled after backward and \
         after the step (ranks of the in-process backend share it). CubeCL's matmul autotune may run f32 matmuls as TF32.",
    )?;
    md.line(&format!("| {} |", GPT_COLUMNS.join(" | ")))?;
    md.line(&format!("|{}", "---|".repeat(GPT_COLUMNS.len())))?;
    let start = Instant::now();
    let mut jobs = Vec::new();
    for size in &args.gpt_sizes {
        gpt_size(size)?;
        jobs.push(format!("{size}:nccl:{gpus}"));
        jobs.push(format!("{size}:in-process:2"));
    }
    for (i, job) in jobs.iter().enumerate() {
        let left = budget.saturating_sub(start.elapsed());
        let share = left / (jobs.len() - i) as u32;
        eprintln!("gpt: {job} (at most {} s) ...", share.as_secs());
        let (lines, outcome) = run_worker(&exe, job, &args.data, share)?;
        let mut rows = 0;
        for line in &lines {
            let Some(Ok(v)) = line.strip_prefix("BENCH_RESULT ").map(serde_json::from_str::<Value>) else {
                continue;
            };
            let row: Vec<String> = GPT_COLUMNS.iter().map(|k| cell(&v[*k])).collect();
            md.line(&format!("| {} |", row.join(" | ")))?;
            csv.write_record(&row)
                .and_then(|_| csv.flush().map_err(Into::into))
                .map_err(|e| e.to_string())?;
            rows += 1;
        }
        if rows < 4 {
            md.line(&format!("| {job} | {outcome} after {rows} of 4 stages |"))?;
        }
    }
    Ok(())
}

/// Runs `--worker job` with stderr shown, collects its stdout lines, and stops it after
/// `limit`. Returns the lines and how it ended.
fn run_worker(exe: &Path, job: &str, data: &Path, limit: Duration) -> Result<(Vec<String>, String), String> {
    let mut child = Command::new(exe)
        .arg("--worker")
        .arg(job)
        .arg("--data")
        .arg(data)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("cannot start a worker: {e}"))?;
    let lines = Arc::new(Mutex::new(Vec::new()));
    let stdout = child.stdout.take().expect("piped");
    let reader = {
        let lines = Arc::clone(&lines);
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                lines.lock().expect("reader").push(line);
            }
        })
    };
    let deadline = Instant::now() + limit;
    let outcome = loop {
        match child.try_wait().map_err(|e| format!("worker: {e}"))? {
            Some(status) if status.success() => break "done".to_string(),
            Some(status) => break format!("failed ({status}; its error is in the log above)"),
            None if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                break format!("stopped at its time limit of {} s", limit.as_secs());
            }
            None => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    let _ = reader.join();
    let lines = std::mem::take(&mut *lines.lock().expect("reader"));
    Ok((lines, outcome))
}

fn cell(v: &Value) -> String {
    match v {
        Value::Null => "n/a".into(),
        Value::String(s) => s.clone(),
        Value::Number(n) => match n.as_f64() {
            Some(x) if x.fract() != 0.0 => format!("{x:.3}"),
            _ => n.to_string(),
        },
        other => other.to_string(),
    }
}

/// One model size on one backend, in this child process, at stages 0-3: `SIZE:nccl:N` (one
/// rank per GPU, threads of this process, NCCL) or `SIZE:in-process:N` (N ranks as threads on
/// GPU 0). The kernels compiled for one stage serve the next; the allocator's pages are handed
/// back between stages.
fn worker(args: &Args, job: &str) -> Result<(), String> {
    let bad = || format!("--worker wants SIZE:nccl:N or SIZE:in-process:N, got {job:?}");
    let [size, comm, n] = job.split(':').collect::<Vec<_>>()[..] else {
        return Err(bad());
    };
    let world_size: usize = n.parse().map_err(|_| bad())?;
    let text = std::fs::read_to_string(&args.data).map_err(|e| format!("cannot read {}: {e}", args.data.display()))?;
    let corpus = CharCorpus::new(&text);
    let gpu = Device::cuda(0);
    for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
        let mut spec = gpt_size(size)?;
        spec.stage = stage;
        gpu.memory_cleanup();
        let runs = match comm {
            "in-process" => gpt_in_process(&gpu, world_size, &corpus, &spec)?,
            "nccl" => gpt_nccl(world_size, &corpus, &spec)?,
            _ => return Err(bad()),
        };
        let r0 = &runs[0];
        let mib = |b: f64| b / (1024.0 * 1024.0);
        let step_ms = r0.median_step_ms();
        let tokens = (spec.global_batch * spec.block_size) as f64;
        let result = json!({
            "size": size,
            "params": r0.params,
            "comm": comm,
            "world_size": world_size,
            "stage": stage.number(),
            "step_ms": step_ms,
            "tokens_per_s": (tokens / (step_ms / 1e3)).round(),
            "model_state_mib_per_rank": mib(runs.iter().map(|r| r.model_state_bytes).max().unwrap_or(0) as f64),
            "device_in_use_mib": r0.device_in_use_peak.map(|b| mib(b as f64)),
            "device_reserved_mib": r0.device_reserved_peak.map(|b| mib(b as f64)),
            "sent_mib_per_step": mib(r0.sent_per_step),
            "hidden_share": r0.hidden_share,
            "loss_first": r0.losses.first(),
            "loss_last": r0.losses.last(),
        });
        println!("BENCH_RESULT {result}");
        std::io::stdout().flush().map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// One rank per GPU, as threads of this process, joined to one NCCL communicator.
fn gpt_nccl(world_size: usize, corpus: &CharCorpus, spec: &GptSpec) -> Result<Vec<GptRankRun>, String> {
    let id = NcclId::new().map_err(|e| e.to_string())?;
    let base = gpt_base(spec, corpus.vocab_size());
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let (id, base) = (&id, &base);
                s.spawn(move || {
                    let comm = NcclComm::new(rank, rank, world_size, id).map_err(|e| e.to_string())?;
                    let device = training_device_on(comm.device(), spec.stage);
                    train_gpt_rank(comm, &device, base.clone().fork(&device), corpus, spec)
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| h.join().map_err(|_| format!("rank {rank} panicked"))?)
            .collect()
    })
}
