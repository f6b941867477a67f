//! Command-line options every example shares: the sharding (world size, stage) and the
//! checkpointing (`--save-dir`, `--resume`), with clap's value parsers.

use std::path::PathBuf;

use burn_shard::{ShardConfig, Stage};

/// A `usize` option in `min..=max`; clap names the option and the range in its error.
pub fn at_least(min: u64, max: u64) -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new().range(min..=max)
}

/// A finite `f64` above 0 (learning rates).
pub fn positive_f64(s: &str) -> Result<f64, String> {
    positive(s)
}

/// A finite `f32` above 0 (a gradient norm): a value that rounds to 0 or overflows in `f32`
/// is refused here, not later.
pub fn positive_f32(s: &str) -> Result<f32, String> {
    positive(s)
}

fn positive<T>(s: &str) -> Result<T, String>
where
    T: std::str::FromStr + Into<f64> + Copy + std::fmt::Display,
    T::Err: std::fmt::Display,
{
    match s.parse::<T>() {
        Ok(v) if v.into().is_finite() && v.into() > 0.0 => Ok(v),
        Ok(v) => Err(format!("{v} is not a finite number above 0")),
        Err(e) => Err(e.to_string()),
    }
}

/// Sharding and checkpointing options (`#[command(flatten)]` into an example's options).
#[derive(clap::Args, Debug, Clone)]
pub struct ShardArgs {
    /// Number of ranks (threads), 1-1024; the global batch is split evenly between them.
    #[arg(long, default_value_t = 2, value_parser = at_least(1, 1024))]
    pub world_size: usize,
    /// ZeRO stage: 0 (data parallel), 1 (optimizer state sharded), 2 (+ gradients sharded),
    /// 3 (+ parameters sharded, FSDP). Each example names its default.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub stage: Option<u8>,
    /// Save sharded checkpoints under this directory (`DIR/step-000500`, ...), every
    /// --save-every steps and after the last step.
    #[arg(long)]
    pub save_dir: Option<PathBuf>,
    /// Steps between checkpoints when --save-dir is given (at least 1).
    #[arg(long, default_value_t = 500, value_parser = at_least(1, usize::MAX as u64))]
    pub save_every: usize,
    /// Checkpoints kept under --save-dir (the newest ones; at least 1).
    #[arg(long, default_value_t = 3, value_parser = at_least(1, 1 << 20))]
    pub keep: usize,
    /// Resume from this checkpoint (a `step-*` directory, or a --save-dir, whose newest
    /// checkpoint is taken), at any --world-size and --stage. `auto`: from the newest
    /// checkpoint of --save-dir if it has one, else start afresh (for jobs that
    /// `burn-shard-run --max-restarts` starts again after a failure).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Set by [`ShardArgs::resolve_resume`] when `--resume auto` found a checkpoint: a run
    /// that it finds finished already ends without training instead of failing.
    #[arg(skip)]
    pub resumed_auto: bool,
    /// Clip the gradient to this global L2 norm before each step (PyTorch's
    /// `clip_grad_norm_`, measured over every rank's shard); default: no clipping.
    #[arg(long, value_parser = positive_f32)]
    pub max_grad_norm: Option<f32>,
    /// Hybrid sharding: shard within `replicas` groups of consecutive ranks (one per node under
    /// `--nproc-per-node`) and replicate across them (`ShardConfig::with_replicas`; stages
    /// 1-3, a divisor of the world size). Default 1: one group of every rank.
    #[arg(long, default_value_t = 1, value_parser = at_least(1, 1024))]
    pub replicas: usize,
}

impl ShardArgs {
    /// The sharding of `stage` with these options (`--max-grad-norm`, `--replicas`).
    pub fn shard_config(&self, stage: Stage) -> ShardConfig {
        let config = ShardConfig::new(stage).with_replicas(self.replicas);
        match self.max_grad_norm {
            Some(max_norm) => config.with_max_grad_norm(max_norm),
            None => config,
        }
    }

    /// The `--stage` given, or `default`.
    pub fn stage_or(&self, default: Stage) -> Stage {
        match self.stage {
            Some(s) => Stage::try_from(s).expect("clap keeps --stage in 0..=3"),
            None => default,
        }
    }

    /// Turns a `--resume` that names a `--save-dir` into its newest complete checkpoint (of
    /// the directory's current lineage: see `burn_shard::checkpoint::list`), `--resume auto`
    /// into the newest of `--save-dir` or none (a fresh start), and refuses a run
    /// without `--resume` whose `--save-dir` already holds checkpoints (its saves would mix
    /// with another run's).
    ///
    /// # Errors
    /// The directory cannot be listed, or holds no complete checkpoint; a fresh run's
    /// `--save-dir` holds some; `--resume auto` without `--save-dir`.
    pub fn resolve_resume(&mut self) -> Result<(), String> {
        if self.resume.as_deref() == Some(std::path::Path::new("auto")) {
            let root = self
                .save_dir
                .as_ref()
                .ok_or("--resume auto needs --save-dir: the directory whose newest checkpoint it resumes")?;
            self.resume = burn_shard::checkpoint::newest(root).map_err(|e| e.to_string())?;
            self.resumed_auto = self.resume.is_some();
            return Ok(());
        }
        if let Some(dir) = &self.resume
            && !burn_shard::checkpoint::is_checkpoint(dir)
        {
            let newest = burn_shard::checkpoint::list(dir).map_err(|e| e.to_string())?.pop();
            self.resume =
                Some(newest.ok_or_else(|| format!("--resume {}: no complete checkpoint there", dir.display()))?);
        }
        if let (None, Some(root)) = (&self.resume, &self.save_dir)
            && root.is_dir()
            && let Some(newest) = burn_shard::checkpoint::list(root).map_err(|e| e.to_string())?.pop()
        {
            return Err(format!(
                "--save-dir {} already holds checkpoints (newest: {}); continue them with --resume {0}, \
                 roll back with --resume {0}/step-N (the later ones are then moved aside), or pass another --save-dir",
                root.display(),
                newest.display()
            ));
        }
        Ok(())
    }

    /// Checks that `global_batch` splits evenly over the ranks.
    ///
    /// # Errors
    /// Names both options when it does not.
    pub fn check_batch(&self, global_batch: usize) -> Result<(), String> {
        if global_batch.is_multiple_of(self.world_size) {
            Ok(())
        } else {
            Err(format!(
                "--batch-size {global_batch} must be a positive multiple of --world-size {}",
                self.world_size
            ))
        }
    }
}

/// A probability in `[0, 1)` (dropout).
pub fn probability(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..1.0).contains(&v) => Ok(v),
        Ok(v) => Err(format!("{v} is not in [0, 1)")),
        Err(e) => Err(e.to_string()),
    }
}
