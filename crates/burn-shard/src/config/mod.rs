//! [`ShardConfig`]: how to shard, as data: a small tree (the step's options at the top;
//! [`Placement`], [`Stage3Config`], [`MeshConfig`] and [`CheckpointConfig`] nested, as Burn
//! nests its optimizer configs) and the `with_*` builders. `saved.rs` reads `config.json` in
//! this form and in the flat form written before 2026-12-07. The call that turns sharding on,
//! [`ShardConfig::init`], is `init/`'s.

pub(crate) mod parts;
pub(crate) mod placement;
mod saved;

use burn_shard_comm::MeshLayout;

pub use parts::{CheckpointConfig, MeshConfig, Stage3Config};
pub use placement::{Home, Placement};

use crate::optim::loss_scale::LossScaler;
use crate::run::FrozenEntries;
use crate::stage::Stage;

/// Default bucket size: 256 Ki elements (1 MiB of `f32`, the size of PyTorch DDP's first
/// bucket). Buckets are what stages 0-2 reduce inside backward: a bucket starts once all its
/// gradients are in, so smaller buckets start earlier and leave a shorter tail after backward
/// (the example GPT of 0.8M parameters spans 4, the 19M one 73), at one collective call each.
pub const DEFAULT_BUCKET_NUMEL: usize = 256 * 1024;

/// How to shard: the ZeRO stage and the bucket size.
///
/// A Burn [`Config`](burn::config::Config): it nests in a user's `#[derive(Config)]` training
/// config and is saved with it in `config.json` (`stage` as its number; a field left out of
/// the file takes its default, as [`ShardConfig::new`] sets it; `max_grad_norm` may be
/// `"inf"`, which JSON has no number for).
///
/// ```ignore
/// let comm = /* this rank's Collective, e.g. from InProcessGroup */;
/// // Burn's AdamWConfig: the fused Adam step where the backend has one, Burn's AdamW elsewhere.
/// let (model, mut optim) = ShardConfig::new(Stage::Two).init(model, AdamWConfig::new(), comm)?;
/// // each step, on each rank, with that rank's part of the batch:
/// let grads = GradientsParams::from_grads(loss.backward(), &model);
/// model = optim.step(lr, model, grads)?;
/// ```
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(from = "saved::SavedShardConfig")]
pub struct ShardConfig {
    /// ZeRO stage.
    pub stage: Stage,
    /// Maximum elements per bucket (a larger parameter gets its own bucket); per rank for the
    /// buckets of parameters an optimizer reads whole (`world_size · bucket_numel` in all, see
    /// [`FlatLayout::from_module_owning`](crate::FlatLayout::from_module_owning)). Default
    /// `DEFAULT_BUCKET_NUMEL` (256 Ki elements).
    pub bucket_numel: usize,
    /// Stages 0-2: reduce each bucket inside backward, as soon as its gradients are complete,
    /// where the collective overlaps with compute (default `true`; DeepSpeed's
    /// `overlap_comm`, see [`crate::bucket`]'s rules); there, stages 1-2 also start each
    /// bucket's all-gather in `step` as soon as the bucket is updated, while the next one is.
    /// `false` reduces every bucket in `step`, keeps every gradient in `GradientsParams` until
    /// then, and runs every collective to completion before the next. The same results either way,
    /// as long as every backward's gradients reach `step`/`accumulate` or are dropped with
    /// [`ShardedOptimizer::discard_gradients`](crate::ShardedOptimizer::discard_gradients).
    pub overlap_comm: bool,
    /// Clip the averaged gradient to this global L2 norm (over every parameter of every rank)
    /// before the optimizer step, as PyTorch's `clip_grad_norm_`; `None` (default): no
    /// global clipping. `f32::INFINITY` measures the norm without clipping (saved as `"inf"`,
    /// which JSON has no number for). The pre-clip norm is
    /// [`RankReport::last_grad_norm`](crate::RankReport::last_grad_norm).
    #[serde(serialize_with = "saved::norm::serialize")]
    pub max_grad_norm: Option<f32>,
    /// Loss scaling, required for `f16` parameters (default `None`).
    pub loss_scaler: Option<LossScaler>,
    /// Where the optimizer state and the stage-3 parameter shards live (default: on the
    /// model's device). See [`Placement`].
    pub placement: Placement,
    /// Stage 3's gathering: `reshard_after_forward` and the units by module path.
    pub stage3: Stage3Config,
    /// Hybrid sharding's mesh (default: one shard group of every rank).
    pub mesh: MeshConfig,
    /// What checkpoints hold of frozen parameters, and how many saves run in the background.
    pub checkpoint: CheckpointConfig,
}

impl burn::config::Config for ShardConfig {}

/// `config.json` in either form (see `saved.rs`); a field left out takes its default, as
/// [`ShardConfig::new`] sets it.
impl From<saved::SavedShardConfig> for ShardConfig {
    fn from(saved: saved::SavedShardConfig) -> Self {
        let default = ShardConfig::new(saved.stage);
        let flat = saved.flat;
        Self {
            stage: saved.stage,
            bucket_numel: saved.bucket_numel.unwrap_or(default.bucket_numel),
            overlap_comm: saved.overlap_comm.unwrap_or(default.overlap_comm),
            max_grad_norm: saved.max_grad_norm,
            loss_scaler: saved.loss_scaler,
            placement: saved.placement.unwrap_or_else(|| flat.placement()),
            stage3: saved.stage3.unwrap_or_else(|| flat.stage3(default.stage3)),
            mesh: saved.mesh.unwrap_or_else(|| flat.mesh(default.mesh)),
            checkpoint: saved.checkpoint.unwrap_or_else(|| flat.checkpoint(default.checkpoint)),
        }
    }
}

impl ShardConfig {
    /// A configuration for `stage` with the default bucket size.
    pub fn new(stage: Stage) -> Self {
        Self {
            stage,
            bucket_numel: DEFAULT_BUCKET_NUMEL,
            overlap_comm: true,
            max_grad_norm: None,
            loss_scaler: None,
            placement: Placement::default(),
            stage3: Stage3Config::default(),
            mesh: MeshConfig::default(),
            checkpoint: CheckpointConfig::default(),
        }
    }

    /// Stage 3: names the model's units by module path, for a model whose `forward` has no
    /// [`crate::fsdp::unit`] calls (a stock `burn::nn` module such as `TransformerEncoder`,
    /// whose `layers` are `layers.0`, `layers.1`, ...): FSDP2's `fully_shard(submodule)` from
    /// outside the model. Each pattern is a module path whose segments are names or `*` (any
    /// one segment); a parameter belongs to the unit named by the first pattern that matches
    /// the start of its path. A unit's parameters are then all-gathered with one collective,
    /// the next unit's gather is prefetched while the unit computes, and its gradients are
    /// reduce-scattered with one collective, as with `fsdp::unit`: the same collectives and
    /// bytes per step (`tests/suite/stage3.rs` measures it).
    ///
    /// What only `fsdp::unit` in `forward` gives, because it sees the unit's input and output
    /// (Burn has no forward hooks a policy could use): each unit's reduce-scatter starting
    /// during backward, as soon as the unit's backward is done (a policy unit's gradients are
    /// complete only at the end of backward, so every full gradient is kept until then), and
    /// the unit's output kept as a checkpoint under Burn's gradient checkpointing (see
    /// [`crate::fsdp::unit`]). A model's own `fsdp::unit` scopes take precedence over the policy.
    ///
    /// # Errors (at `init`)
    /// [`ShardError::InvalidConfig`](crate::ShardError::InvalidConfig) for a pattern with an empty segment, or one that matches
    /// no sharded parameter.
    pub fn with_units<S: Into<String>>(mut self, patterns: impl IntoIterator<Item = S>) -> Self {
        self.stage3.units = patterns.into_iter().map(Into::into).collect();
        self
    }

    /// Stages 0-2: whether buckets are reduced inside backward (default `true`, see
    /// [`ShardConfig::overlap_comm`]).
    pub fn with_overlap_comm(mut self, overlap_comm: bool) -> Self {
        self.overlap_comm = overlap_comm;
        self
    }

    /// Clips the averaged gradient to global L2 norm `max_norm` at every step (see
    /// [`ShardConfig::max_grad_norm`]).
    pub fn with_max_grad_norm(mut self, max_norm: f32) -> Self {
        self.max_grad_norm = Some(max_norm);
        self
    }

    /// Scales the loss for `f16` training (see [`LossScaler`]).
    pub fn with_loss_scaler(mut self, loss_scaler: LossScaler) -> Self {
        self.loss_scaler = Some(loss_scaler);
        self
    }

    /// Stage 3: whether gathered parameters are freed after forward (default `true`).
    pub fn with_reshard_after_forward(mut self, reshard_after_forward: bool) -> Self {
        self.stage3.reshard_after_forward = reshard_after_forward;
        self
    }

    /// Where this rank keeps its optimizer state and the `f32` masters of `bf16`/`f16`
    /// parameters, and where their update runs (default [`Home::Device`]; see [`Placement`]):
    ///
    /// - [`Home::Host`]: ZeRO-Offload (Ren et al., 2021, §4.1): the state, the masters and the
    ///   update of this rank's shard live in host memory (Burn's `Flex` CPU device; the fused
    ///   CPU Adam for Burn's Adam/AdamW configs, Burn's own step for any other optimizer); the
    ///   accelerator keeps the parameters and gradients. Per step and parameter piece the
    ///   reduced gradient goes device → host in its dtype and the updated piece comes back;
    ///   [`MemoryReport::host_bytes`](crate::MemoryReport::host_bytes) counts what moved (Adam:
    ///   8 bytes per element stepped, 12 with AMSGrad, plus 4 per element of a master) and
    ///   `optimizer_state_bytes` drops to 0.
    /// - [`Home::Disk`]: ZeRO-Infinity's NVMe offload of the state (Rajbhandari et al., SC21;
    ///   DeepSpeed's `offload_optimizer: {device: nvme, nvme_path}`), at any stage and with any
    ///   Burn optimizer: a swap file per rank between steps, stepped in host memory. See
    ///   [`NvmeOffload`](crate::NvmeOffload) for the files, the I/O and the costs.
    ///
    /// `ShardConfig::new(Stage::Two).with_optimizer_state_on(Home::Host)`. Checkpoints are the
    /// same files wherever the state lived, and load into any placement. With the fused Adam
    /// (`AdamConfig`/`AdamWConfig`) results are bitwise those of the state on the device (its
    /// CPU and device kernels compute one expression in one order, tested on wgpu); another
    /// optimizer steps with Burn's own kernels of the host device, which may round otherwise.
    ///
    /// # Errors (at `init`, on every rank)
    /// [`ShardError::InvalidConfig`](crate::ShardError::InvalidConfig) for [`Home::Host`] with a
    /// model already in host memory (Burn's `Flex`: nothing would move; [`Home::Disk`] is what
    /// saves memory there); as [`NvmeOffload`](crate::NvmeOffload) says for [`Home::Disk`].
    pub fn with_optimizer_state_on(mut self, home: Home) -> Self {
        self.placement.optimizer_state = home;
        self
    }

    /// Stage 3: where this rank keeps its parameter shards between uses (default
    /// [`Home::Device`]; see [`Placement`]). Both other homes need the optimizer state off the
    /// device too ([`ShardConfig::with_optimizer_state_on`] with [`Home::Host`] or
    /// [`Home::Disk`]) on an accelerator: the step updates a shard where its state lives.
    ///
    /// **[`Home::Host`]**, on an accelerator (CUDA, wgpu, any CubeCL device): ZeRO-Infinity's
    /// parameter offload to CPU (Rajbhandari et al., SC21, §5.1; DeepSpeed's
    /// `offload_param: {device: cpu}`). The device then holds the parameters of the units being
    /// gathered and used (the unit that computes and the one prefetched) and the gradient shards
    /// until the step; the shards themselves (`Ψ·b/N` bytes for `Ψ` parameters of `b` bytes on
    /// `N` ranks) move to [`MemoryReport::host_bytes`](crate::MemoryReport::host_bytes). Each
    /// gather copies its shards host → device first (a unit's shards, once the schedule has
    /// learned the unit, concatenated and copied with one call per dtype, issued with the unit's
    /// all-gather, so the prefetched unit's copy is issued ahead; with `reshard_after_forward`
    /// the re-gather in backward copies again); the update runs on the host, where the shard
    /// stays, so only the gradient crosses device → host. The shards' compute device is fixed
    /// at `init`: moving the model to another device is not supported with it. Loading a
    /// checkpoint builds each shard in host memory, never on the device.
    ///
    /// **[`Home::Disk`]**: the shards, and the gradient shards from backward to the step, in a
    /// file in `nvme.path` (ZeRO-Infinity's offload to NVMe; DeepSpeed's
    /// `offload_param: {device: nvme, nvme_path}`). On Burn's `Flex` CPU device this is what
    /// takes the parameters and gradients out of memory (with the optimizer state on
    /// [`Home::Disk`] too, memory holds the units being gathered and used, the activations and
    /// one bucket of the step); on an accelerator the shards pass through host memory on their
    /// way to the device, as with [`Home::Host`].
    ///
    /// What the disk costs per step (`Ψ` parameters of `b` bytes on `N` ranks): each pass of the
    /// gathers reads the shards (`Ψ·b/N` per pass: forward, and backward again with
    /// `reshard_after_forward`); backward writes each reduced gradient shard; the step reads
    /// the gradient shards (once more when clipping or loss scaling measures their norm) and
    /// the parameter shards, and writes the updated parameter shards, bucket by bucket, so it
    /// holds one bucket at a time.
    ///
    /// The reads and writes run on `nvme.io_threads` threads per rank, off the compute thread
    /// (ZeRO-Infinity's overlap-centric design, §6.2): once the gather schedule has learned the
    /// units (from the second step), the shards of the unit after the one being prefetched are
    /// read while the current one computes, so a pass waits for the disk only for its first
    /// two units; the step reads the next bucket's gradient and parameter shards while it steps
    /// one. Writes run behind the caller: at most `nvme.max_in_flight` are queued per rank,
    /// each holding its shard's bytes until done (a shard being written reads from memory),
    /// and the step waits for the last ones before it returns. Host memory for the I/O: one
    /// unit (gathers) or bucket (step) read ahead, plus the queued writes.
    /// [`RankReport::nvme_read_on_demand_bytes`](crate::RankReport::nvme_read_on_demand_bytes)
    /// says how many bytes were read without being read ahead. I/O goes through the page cache.
    /// An updated shard is written beside the old one, whose space is reused
    /// once nothing holds the old values, so the file holds up to twice the parameter shards
    /// during a step, plus the gradient shards of the step (of every micro-batch with
    /// `accumulate`). Each shard carries a CRC-32 that every read checks.
    ///
    /// The step applies every gradient shard reduced since the last `step`, `accumulate` or
    /// [`ShardedOptimizer::discard_gradients`](crate::ShardedOptimizer::discard_gradients),
    /// whatever the `grads` passed to it hold for the sharded parameters: call
    /// `discard_gradients` after a backward you do not step with. Checkpoints are the same files
    /// as with the shards in memory and load into either; a load writes each loaded shard to
    /// the file as it reads it.
    ///
    /// The file, `burn-shard-rank{rank}-params.swap.{pid}.{n}`, is unlinked as soon as it is
    /// created: it has no name while the job runs (no other program can delete or overwrite
    /// it, and jobs sharing `nvme.path` do not share it), and its space is freed when the process
    /// ends, also when it is killed.
    ///
    /// On `Flex`, results are bitwise those of the same training with the shards in memory
    /// (tested); on an accelerator the update runs where the state is (see
    /// [`ShardConfig::with_optimizer_state_on`]).
    ///
    /// # Errors
    /// At `init`, on every rank: [`ShardError::InvalidConfig`](crate::ShardError::InvalidConfig)
    /// below stage 3 (every rank holds whole parameters there; move the optimizer state
    /// instead), for [`Home::Host`] with a model already in host memory (Burn's `Flex`: nothing
    /// would move), on an accelerator with the optimizer state on the device, and when
    /// `nvme.io_threads` or `nvme.max_in_flight` is 0; [`ShardError::Nvme`](crate::ShardError::Nvme)
    /// when `nvme.path` is not an existing writable directory. During training:
    /// [`ShardError::Nvme`](crate::ShardError::Nvme) from the step (on every rank, the others
    /// naming the rank whose file failed) when a read or write failed (a full disk) or a read
    /// came back with other bytes, naming the file and the fix.
    pub fn with_params_on(mut self, home: Home) -> Self {
        self.placement.params = home;
        self
    }

    /// What checkpoints hold of the parameters the optimizer does not train:
    /// [`FrozenEntries::Fingerprinted`] keeps a LoRA or head-only fine-tune's frozen base out of
    /// every checkpoint (a fingerprint per entry and the pretrained file's name instead); a
    /// resume then loads the base first (as the run did: `init_pretrained`) and
    /// `load_checkpoint` checks that it is the same. Every rank passes the same value (checked
    /// at `init`).
    pub fn with_frozen_entries(mut self, frozen_entries: FrozenEntries) -> Self {
        self.checkpoint.frozen_entries = frozen_entries;
        self
    }

    /// Lets background saves (`save_checkpoint` with `SaveOptions::in_background`) keep up to `saves` checkpoints in flight (default 1): a
    /// save then waits only for the oldest once `saves` are being written. Each holds its own
    /// staged copy of what the rank keeps in memory (`report().memory`'s
    /// `checkpoint_staging_bytes` counts them all), so host memory for staging grows to
    /// `saves` times one save's; more than 1 helps only when a save takes longer to write than
    /// the steps between saves and the disk is not the bound. Every rank passes the same value
    /// (checked at `init`).
    ///
    /// # Errors
    /// At `init`: [`ShardError::InvalidConfig`](crate::ShardError::InvalidConfig) when `saves` is 0.
    pub fn with_saves_in_flight(mut self, saves: usize) -> Self {
        self.checkpoint.saves_in_flight = saves;
        self
    }

    /// Hybrid sharding (HSDP; PyTorch FSDP2's 2-D `DeviceMesh` `(replicate, shard)`, DeepSpeed's
    /// MiCS): the `world_size` ranks form `replicas` shard groups of `shard_size = world_size /
    /// replicas` ranks ([`ShardConfig::with_mesh_layout`] says which). At stages 1-3 the
    /// optimizer state, gradients (2-3) and parameters (3) are sharded over the `shard_size`
    /// ranks of a group, as a flat run of `shard_size` ranks shards them, and each group holds
    /// a whole copy. A step reduces the gradients within the group (all-reduce or
    /// reduce-scatter, inside backward as before), then all-reduces this rank's gradient shard
    /// (`Ψ / shard_size` elements) with the same shard of the other groups, once per step (not
    /// per micro-batch given to `accumulate`); the update's all-gather and stage 3's gathers stay
    /// in the group. With the groups on nodes, only that all-reduce crosses nodes.
    ///
    /// The numbers are those of a flat run of `world_size` ranks (the mean gradient over every
    /// rank): the global norm for clipping and the loss scaler's overflow check are taken over
    /// the shard group once, on gradients the replicas already share, not summed over them.
    /// Checkpoints are written by the ranks of shard group 0 alone and equal those of a flat run
    /// of `shard_size` ranks, so they resume at any world size, stage and mesh. The collective
    /// passed to `init` is the world's; the backend must be able to split it
    /// ([`Collective::split`](crate::comm::Collective::split): in-process, MPI). `replicas = 1` is the flat run; `replicas =
    /// world_size` is DDP across the ranks with each rank's state whole.
    ///
    /// # Errors
    /// At `init`, on every rank: [`ShardError::InvalidConfig`](crate::ShardError::InvalidConfig) when `replicas` is 0 or does not
    /// divide the world size, or with `replicas > 1` at stage 0 (DDP has nothing to shard; use
    /// stage 0 alone); [`ShardError::ConfigMismatch`](crate::ShardError::ConfigMismatch) when
    /// the ranks pass different meshes (checked before any split); [`ShardError::Comm`](crate::ShardError::Comm) when the
    /// backend cannot split.
    pub fn with_replicas(mut self, replicas: usize) -> Self {
        self.mesh.replicas = replicas;
        self
    }

    /// With [`ShardConfig::with_replicas`]: which ranks form a shard group (default
    /// [`MeshLayout::Consecutive`]: ranks `g·S .. (g+1)·S`, the ranks one node runs when the
    /// launcher places `S` per node). Ranks that pass different layouts fail `init` with
    /// [`ShardError::ConfigMismatch`](crate::ShardError::ConfigMismatch).
    pub fn with_mesh_layout(mut self, layout: MeshLayout) -> Self {
        self.mesh.layout = layout;
        self
    }

    /// Sets the maximum number of elements per bucket.
    pub fn with_bucket_numel(mut self, bucket_numel: usize) -> Self {
        self.bucket_numel = bucket_numel;
        self
    }
}
