//! `cargo xtask bench cluster`: the shakespeare GPT trained by 4 MPI ranks as 2 nodes x 2 ranks
//! on a cluster of network namespaces (`burn-shard-cluster`; Linux, root, OpenMPI), at several
//! link rates, stages 1-3, flat and hybrid (`--replicas 2`, one shard group per node), in one
//! run. Per configuration: the median step time, the bytes that crossed the nodes' links per
//! step (the kernel's counters: Ethernet frames, headers included), and whether the losses are
//! bit for bit those of the same job on one host (`mpirun -np 4`, every rank on shared memory),
//! which also gives the step time without a network.
//!
//! Inside a node the ranks talk through shared memory (OpenMPI's `vader`), as on a real node;
//! every node's ranks share this host's cores, so compute is that of 4 processes on them.
//!
//! Each cluster run is also predicted by `burn_shard::estimate::step_time` from the one-host
//! step time of the same stage and mesh, the round trip measured between the nodes while the
//! job trains, twice rank 0's collective calls per step (each MPI call starts with its
//! signature's all-gather; with `--replicas` the groups' own calls are not counted), and a
//! bandwidth: the link bandwidth `comm-bench` measured on the same cluster for the mesh's
//! pattern (flat or hybrid, the GPT's flat parameter, no compute), as a user would measure
//! their cluster; and, for comparison, the link rate itself. The table ends with the range of
//! predicted/measured over every cluster run, for each.

use std::path::{Path, PathBuf};
use std::process::Command;

use burn_shard::Stage;
use burn_shard::estimate::{ComputeProfile, Links, ParamDtype, step_time};
use burn_shard_cluster::{Cluster, ClusterSpec, mpirun_on_this_host};
use burn_shard_examples::gpu_bench::median;

use crate::bench_infinity::date;

/// Nodes and ranks per node of every run.
const NODES: usize = 2;
const RANKS_PER_NODE: usize = 2;
const MB: f64 = 1e6;
/// When the round trip under load is measured, from the job's start: after its start-up (about
/// 1 s), before its end (the shortest job trains for about 4 s).
const LOADED_AFTER: std::time::Duration = std::time::Duration::from_millis(2500);

/// Arguments of `cargo xtask bench cluster`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Link rates in Mbit/s, comma-separated.
    #[arg(long, default_value = "100,1000,10000")]
    rates: String,
    /// ZeRO stages, comma-separated (1-3).
    #[arg(long, default_value = "1,2,3")]
    stages: String,
    /// Steps of each run; the first `--warmup` are not timed.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Step intervals at the start of each run left out of its step time (of the `--steps - 1`
    /// intervals between step ends).
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Embedding width of the GPT (the job's `--n-embd`).
    #[arg(long, default_value_t = 128)]
    n_embd: usize,
    /// Calls `comm-bench` splits the flat parameter into (as the step's units or buckets).
    #[arg(long, default_value_t = 4)]
    probe_calls: usize,
    /// Folder for each run's `metrics.csv` and this benchmark's `cluster.csv`.
    #[arg(long, default_value = "runs/bench-cluster")]
    out: PathBuf,
}

/// One configuration's run.
#[derive(serde::Serialize)]
struct Row {
    /// Link rate in Mbit/s; `None`: the one-host run.
    rate_mbit: Option<f64>,
    stage: u8,
    /// 1: flat; 2: one shard group per node.
    replicas: usize,
    /// Median seconds per step after the warm-up.
    step_s: f64,
    /// MB (1e6 bytes) each node's link carried per step, each direction: both nodes' sent
    /// bytes over the run, halved, per step (start-up, the validation and the end included;
    /// 0 on one host).
    link_mb_per_step: f64,
    /// What `estimate::step_time` says each link carries per step, MB (payload, no headers).
    model_link_mb: f64,
    /// `estimate::step_time`'s step, from the one-host step, the link bandwidth `comm-bench`
    /// measured and the measured round trip; equal to the one-host step there.
    predicted_s: f64,
    /// The link bandwidth `comm-bench` measured for this mesh on this link, Mbit/s (0 on one
    /// host).
    probe_mbit: f64,
    /// `estimate::step_time`'s step with the link rate as the bandwidth.
    predicted_at_rate_s: f64,
    /// Median round trip between the nodes in microseconds, idle and while the job trains.
    rtt_idle_us: f64,
    rtt_loaded_us: f64,
    /// Train and validation losses equal the one-host run's, bit for bit.
    same_losses: bool,
}

pub fn run(args: &Args) -> Result<(), String> {
    let list = |text: &str, what: &str| -> Result<Vec<f64>, String> {
        text.split(',')
            .map(|s| s.trim().parse::<f64>().map_err(|e| format!("--{what} {text}: {e}")))
            .collect()
    };
    let rates = list(&args.rates, "rates")?;
    let stages: Vec<u8> = list(&args.stages, "stages")?.into_iter().map(|s| s as u8).collect();
    if stages.iter().any(|s| !(1..=3).contains(s)) || args.warmup + 2 > args.steps {
        return Err("give stages 1-3 and --steps at least --warmup + 2".into());
    }
    let bin = crate::mpi_test::build_shakespeare()?;
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    println!(
        "bench cluster, {}: the shakespeare GPT (n_embd {}, 4 layers), {NODES} nodes x {RANKS_PER_NODE} ranks, {} steps \
         ({} timed)",
        date(),
        args.n_embd,
        args.steps,
        args.steps - args.warmup - 1
    );
    let probe_bin = bin.with_file_name("comm-bench");
    // (link rate, replicas) -> link bytes per second that comm-bench measured.
    let mut probed: Vec<((f64, usize), f64)> = Vec::new();
    let mut rows = Vec::new();
    for &stage in &stages {
        for replicas in [1, NODES] {
            let job = Job {
                bin: &bin,
                stage,
                replicas,
                args,
            };
            let reference = job.on_one_host()?;
            let compute_s = reference.step_s(args.warmup);
            let mut row = reference.row(None, 0.0, true, args.warmup);
            (row.predicted_s, row.predicted_at_rate_s) = (compute_s, compute_s);
            rows.push(row);
            for &rate in &rates {
                let (run, sent, rtt) = job.on_cluster(rate)?;
                let same = run.losses == reference.losses;
                let mut row = run.row(Some(rate), sent / 2.0 / args.steps as f64, same, args.warmup);
                let probe = match probed.iter().find(|(key, _)| *key == (rate, replicas)) {
                    Some(&(_, measured)) => measured,
                    None => {
                        let measured = probe_link(&probe_bin, rate, replicas, run.params, args.probe_calls)?;
                        probed.push(((rate, replicas), measured));
                        measured
                    }
                };
                let links = |bytes_per_s: f64| Links {
                    nodes: NODES,
                    ranks_per_node: RANKS_PER_NODE,
                    bytes_per_s,
                    latency_s: rtt / 2.0,
                };
                let compute = ComputeProfile {
                    step_s: compute_s,
                    // Each MPI call is preceded by its signature's all-gather (48 bytes).
                    calls_across: 2.0 * run.calls_per_step,
                    // MPI runs each collective on the caller's thread: nothing is hidden.
                    hidden_share: 0.0,
                };
                let stage = Stage::try_from(stage).map_err(|e| e.to_string())?;
                let predict = |bytes_per_s: f64| {
                    step_time(
                        run.params,
                        stage,
                        replicas,
                        ParamDtype::F32,
                        &links(bytes_per_s),
                        &compute,
                    )
                    .map_err(|e| e.to_string())
                };
                let predicted = predict(probe)?;
                row.predicted_s = predicted.step_s;
                row.predicted_at_rate_s = predict(rate * 1e6 / 8.0)?.step_s;
                row.probe_mbit = probe * 8.0 / 1e6;
                row.model_link_mb = predicted.link_bytes / MB;
                rows.push(row);
            }
        }
    }
    print_table(&rows);
    let csv_path = args.out.join("cluster.csv");
    let mut writer = csv::Writer::from_path(&csv_path).map_err(|e| format!("{}: {e}", csv_path.display()))?;
    for row in &rows {
        writer.serialize(row).map_err(|e| e.to_string())?;
    }
    writer.flush().map_err(|e| e.to_string())?;
    println!("wrote {}", csv_path.display());
    Ok(())
}

/// The link bandwidth (bytes per second) that `comm-bench` measures on a fresh cluster whose
/// links run at `rate_mbit`, for the pattern of `replicas` (flat or one shard group per node)
/// on the flat parameter of `params` `f32` parameters (hybrid: one rank's shard of it) in
/// `calls` calls.
fn probe_link(bin: &Path, rate_mbit: f64, replicas: usize, params: f64, calls: usize) -> Result<f64, String> {
    let cluster = Cluster::create(&ClusterSpec::new(NODES).with_rate_mbit(rate_mbit)).map_err(|e| e.to_string())?;
    let bytes = (params * 4.0) as usize / if replicas == 1 { 1 } else { RANKS_PER_NODE };
    let mut command = cluster.mpirun(RANKS_PER_NODE).map_err(|e| e.to_string())?;
    command.arg(bin).args([
        "--bytes",
        &bytes.to_string(),
        "--calls",
        &calls.to_string(),
        "--replicas",
        &replicas.to_string(),
        "--ranks-per-node",
        &RANKS_PER_NODE.to_string(),
    ]);
    let output = command.output().map_err(|e| format!("cannot start mpirun: {e}"))?;
    let text = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!(
            "comm-bench at {rate_mbit} Mbit/s failed ({}):\n{text}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    print!("probe at {rate_mbit} Mbit/s, replicas {replicas}: {text}");
    // "link bandwidth: 412.3 Mbit/s (...)".
    let mbit: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("link bandwidth: "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("comm-bench printed no link bandwidth:\n{text}"))?;
    Ok(mbit * 1e6 / 8.0)
}

/// One stage and mesh, run on one host or on a cluster.
struct Job<'a> {
    bin: &'a Path,
    stage: u8,
    replicas: usize,
    args: &'a Args,
}

/// What a run recorded: its losses (the CSV cells, as written), its step end times, and what
/// rank 0 printed of the model and its collectives.
struct Recorded {
    stage: u8,
    replicas: usize,
    losses: Vec<(String, String)>,
    seconds: Vec<f64>,
    /// Parameters of the GPT (`Ψ`).
    params: f64,
    /// Rank 0's collective calls per step.
    calls_per_step: f64,
    /// Median round trips between the nodes, seconds: before the job and while it trains
    /// (zeros on one host).
    rtt: [f64; 2],
}

impl Job<'_> {
    fn name(&self, rate: Option<f64>) -> String {
        let mesh = if self.replicas == 1 { "flat" } else { "hsdp" };
        match rate {
            Some(rate) => format!("stage{}-{mesh}-{rate}mbit", self.stage),
            None => format!("stage{}-{mesh}-one-host", self.stage),
        }
    }

    /// The job's own arguments (after the program), writing into `out`.
    fn job_args(&self, out: &Path) -> Vec<String> {
        let steps = self.args.steps.to_string();
        let mut a: Vec<String> = [
            "--world-size",
            &(NODES * RANKS_PER_NODE).to_string(),
            "--stage",
            &self.stage.to_string(),
            "--replicas",
            &self.replicas.to_string(),
            "--steps",
            &steps,
            "--eval-interval",
            &steps,
            "--eval-batches",
            "1",
            "--sample-chars",
            "0",
            "--n-embd",
            &self.args.n_embd.to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(["--out".to_string(), out.display().to_string()]);
        a
    }

    /// Every rank on this host, on shared memory.
    fn on_one_host(&self) -> Result<Recorded, String> {
        let out = self.args.out.join(self.name(None));
        let mut command = mpirun_on_this_host(NODES * RANKS_PER_NODE);
        command.arg(self.bin).args(self.job_args(&out));
        self.finish(command, &out)
    }

    /// On a fresh cluster whose links run at `rate_mbit`; also returns the bytes both nodes
    /// sent on their links and the median round trip between the nodes (seconds) while the
    /// job trains.
    fn on_cluster(&self, rate_mbit: f64) -> Result<(Recorded, f64, f64), String> {
        let out = self.args.out.join(self.name(Some(rate_mbit)));
        let cluster = Cluster::create(&ClusterSpec::new(NODES).with_rate_mbit(rate_mbit)).map_err(|e| e.to_string())?;
        let sent = |cluster: &Cluster| -> Result<u64, String> {
            (0..NODES)
                .map(|node| cluster.link_bytes(node).map(|b| b.sent).map_err(|e| e.to_string()))
                .sum()
        };
        let idle = cluster.round_trip(1, 0, 200).map_err(|e| e.to_string())?.as_secs_f64();
        let before = sent(&cluster)?;
        let mut command = cluster.mpirun(RANKS_PER_NODE).map_err(|e| e.to_string())?;
        command.arg(self.bin).args(self.job_args(&out));
        // The round trip again while the job trains: on a host whose cores the ranks share, a
        // message waits for its receiver to be scheduled, which the idle round trip misses.
        let (recorded, loaded) = std::thread::scope(|scope| {
            let job = scope.spawn(|| self.finish(command, &out));
            std::thread::sleep(LOADED_AFTER);
            let loaded = cluster.round_trip(1, 0, 100).map_err(|e| e.to_string());
            (job.join().expect("the job thread does not panic"), loaded)
        });
        let (mut recorded, loaded) = (recorded?, loaded?.as_secs_f64());
        recorded.rtt = [idle, loaded];
        Ok((recorded, (sent(&cluster)? - before) as f64, loaded))
    }

    /// Runs `command` to its end and reads the job's `metrics.csv` in `out`.
    fn finish(&self, mut command: Command, out: &Path) -> Result<Recorded, String> {
        let _ = std::fs::remove_dir_all(out);
        println!("running {}", out.display());
        let output = command.output().map_err(|e| format!("cannot start mpirun: {e}"))?;
        let text = String::from_utf8_lossy(&output.stdout);
        if !output.status.success() {
            return Err(format!(
                "{} failed ({}):\n{text}\n{}",
                out.display(),
                output.status,
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        if !text.contains("[rank 1]") {
            return Err(format!(
                "{} ran its ranks as threads: build it with the mpi feature (`cargo xtask mpi-test` does)",
                self.bin.display()
            ));
        }
        let path = out.join("metrics.csv");
        let mut reader = csv::Reader::from_path(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let (mut losses, mut seconds) = (Vec::new(), Vec::new());
        for record in reader.records() {
            let record = record.map_err(|e| format!("{}: {e}", path.display()))?;
            let cell = |i: usize| record.get(i).unwrap_or("").to_string();
            losses.push((cell(1), cell(2)));
            if let Ok(s) = cell(4).parse::<f64>() {
                seconds.push(s);
            }
        }
        // "... GPT 817,000 params; ..." and "... | 123.4 collective calls per step | ...".
        let number_before = |marker: &str| -> Option<f64> {
            let line = text.lines().find(|l| l.contains(marker))?;
            line.split(marker).next()?.split_whitespace().last()?.parse().ok()
        };
        let params = number_before(" params;").ok_or("the job printed no parameter count")?;
        let calls_per_step = number_before(" collective calls per step").ok_or("the job printed no call count")?;
        Ok(Recorded {
            stage: self.stage,
            replicas: self.replicas,
            losses,
            seconds,
            params,
            calls_per_step,
            rtt: [0.0; 2],
        })
    }
}

impl Recorded {
    /// The median step time after `warmup` steps.
    fn step_s(&self, warmup: usize) -> f64 {
        let steps: Vec<f64> = self.seconds.windows(2).map(|w| w[1] - w[0]).skip(warmup).collect();
        median(&steps)
    }

    fn row(&self, rate_mbit: Option<f64>, link_per_step: f64, same_losses: bool, warmup: usize) -> Row {
        Row {
            rate_mbit,
            stage: self.stage,
            replicas: self.replicas,
            step_s: self.step_s(warmup),
            link_mb_per_step: link_per_step / MB,
            model_link_mb: 0.0,
            predicted_s: f64::NAN,
            probe_mbit: 0.0,
            predicted_at_rate_s: f64::NAN,
            rtt_idle_us: self.rtt[0] * 1e6,
            rtt_loaded_us: self.rtt[1] * 1e6,
            same_losses,
        }
    }
}

/// The table, then per stage and rate the hybrid run's step time over the flat one's, and the
/// model's range over every cluster run.
fn print_table(rows: &[Row]) {
    println!(
        "| link | stage | mesh | step (s) | probed link (Mbit/s) | predicted (s) | predicted/measured | at the link rate: predicted/measured | MB per link per step (model) | round trip idle / training (us) | losses = one host |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let link = r.rate_mbit.map_or("one host".to_string(), |m| format!("{m} Mbit/s"));
        let mesh = if r.replicas == 1 {
            "flat".to_string()
        } else {
            format!("{NODES} x {RANKS_PER_NODE}")
        };
        println!(
            "| {link} | {} | {mesh} | {:.3} | {:.0} | {:.3} | {:.2} | {:.2} | {:.2} ({:.2}) | {:.0} / {:.0} | {} |",
            r.stage,
            r.step_s,
            r.probe_mbit,
            r.predicted_s,
            r.predicted_s / r.step_s,
            r.predicted_at_rate_s / r.step_s,
            r.link_mb_per_step,
            r.model_link_mb,
            r.rtt_idle_us,
            r.rtt_loaded_us,
            if r.same_losses { "bitwise" } else { "DIFFER" }
        );
    }
    println!("hybrid / flat step time:");
    for flat in rows.iter().filter(|r| r.replicas == 1) {
        if let Some(hybrid) = rows
            .iter()
            .find(|r| r.replicas != 1 && r.stage == flat.stage && r.rate_mbit == flat.rate_mbit)
        {
            let link = flat.rate_mbit.map_or("one host".to_string(), |m| format!("{m} Mbit/s"));
            println!("  stage {} at {link}: {:.3}", flat.stage, hybrid.step_s / flat.step_s);
        }
    }
    // Where hybrid stops paying: its one-host step is longer (one more all-reduce) by `dt`, and
    // it saves `db` bytes per link and step, so below `db / dt` bytes per second it is faster.
    for flat in rows.iter().filter(|r| r.replicas == 1 && r.rate_mbit.is_some()) {
        let find = |replicas: bool, rate: Option<f64>| {
            rows.iter()
                .find(|r| (r.replicas != 1) == replicas && r.stage == flat.stage && r.rate_mbit == rate)
        };
        let (Some(hybrid), Some(flat_host), Some(hybrid_host)) =
            (find(true, flat.rate_mbit), find(false, None), find(true, None))
        else {
            continue;
        };
        if flat.rate_mbit != rows.iter().find_map(|r| r.rate_mbit) {
            continue; // once per stage
        }
        let (dt, db) = (
            hybrid_host.step_s - flat_host.step_s,
            (flat.model_link_mb - hybrid.model_link_mb) * MB,
        );
        match dt > 0.0 && db > 0.0 {
            true => println!(
                "  stage {}: crossover at {:.0} Mbit/s by the model (hybrid's one-host step {:.3} s longer, {:.2} MB less per link)",
                flat.stage,
                db * 8.0 / dt / 1e6,
                dt,
                db / MB
            ),
            false => println!(
                "  stage {}: no crossover by the model (hybrid is never slower)",
                flat.stage
            ),
        }
    }
    let range = |predicted: fn(&Row) -> f64| {
        rows.iter()
            .filter(|r| r.rate_mbit.is_some())
            .map(|r| predicted(r) / r.step_s)
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| (lo.min(x), hi.max(x)))
    };
    let (lo, hi) = range(|r| r.predicted_at_rate_s);
    println!("at the link rate instead of the probed bandwidth: predicted/measured min {lo:.2}, max {hi:.2}");
    let (min, max) = range(|r| r.predicted_s);
    println!("predicted/measured: min {min:.2}, max {max:.2}");
}
