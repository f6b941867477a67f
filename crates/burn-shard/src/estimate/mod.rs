//! Per-rank model-state memory before training: which stage fits on which GPU.
//!
//! Two sources, reported in the same [`ModelStateEstimate`]:
//! - [`zero_formula`]: the closed-form per-rank bytes of the ZeRO paper (Rajbhandari et al.,
//!   2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", §5.1) for
//!   `Ψ` parameters on `N` ranks, for mixed-precision Adam (`bf16`/`f16` parameters with `f32`
//!   master weights, `K = 12`) or for plain `f32` Adam, optionally with the optimizer state
//!   offloaded to host memory (Ren et al., 2021, "ZeRO-Offload: Democratizing Billion-Scale
//!   Model Training", §4) or to disk (Rajbhandari et al., SC21, "ZeRO-Infinity: Breaking the
//!   GPU Memory Wall for Extreme Scale Deep Learning", §3, §5.1);
//! - [`estimate_model`]: the same figures for a built Burn model, measured by
//!   [`RankReport::memory`](crate::RankReport::memory) on in-process
//!   groups of 1 and 2 ranks and extrapolated to `N` ranks.
//!
//! "Model state" is the parameters, the gradients and the optimizer state (ZeRO §3.1); it
//! leaves out activations, temporary buffers (the flat bucket being reduced, stage 3's
//! gathered parameters: see [`MemoryReport::temporary_peak_bytes`]) and allocator
//! fragmentation, which come on top.
//!
//! Traffic and time: [`step_traffic`] (`traffic.rs`: the bytes a rank sends per step, ring volumes), and
//! [`step_time`] (`time.rs`: the alpha-beta model of what crosses nodes, on top of a step
//! measured without the link).

mod dtype;
mod time;
mod traffic;

pub use dtype::{MIXED_PRECISION_ADAM_K, ParamDtype};
pub use time::{ComputeProfile, Links, StepTime, step_time};
pub use traffic::{StepTraffic, step_traffic};

use std::sync::Mutex;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::Tensor;
use burn_shard_comm::{Collective, InProcessGroup, run_ranks};

use crate::config::DEFAULT_BUCKET_NUMEL;
use crate::config::ShardConfig;
use crate::error::ShardError;
use crate::model::layout::FlatLayout;
use crate::model::memory::MemoryReport;
use crate::stage::Stage;

/// The four stages, in order.
pub const STAGES: [Stage; 4] = [Stage::Zero, Stage::One, Stage::Two, Stage::Three];

/// Bytes in a GB (10⁹, as the ZeRO paper counts).
pub const GB: f64 = 1e9;

/// Bytes in a GiB (2³⁰).
pub const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Where an offload keeps the optimizer state and the `f32` master weights, for
/// [`zero_formula`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OffloadTarget {
    /// Not offloaded: on the device with the parameters.
    #[default]
    None,
    /// Host memory ([`Home::Host`](crate::Home::Host), ZeRO-Offload).
    Cpu,
    /// A local disk ([`NvmeOffload`](crate::NvmeOffload), ZeRO-Infinity).
    Nvme,
}

/// Per-rank model-state memory of one stage, in bytes (not rounded: the formulas give
/// fractions of a byte per rank).
///
/// `parameters_bytes`, `gradients_bytes` and `optimizer_state_bytes` are held in device
/// memory; `host_bytes` in host memory (the optimizer state with its `f32` master weights, and
/// the stage-3 parameter shards, when offloaded there) and `disk_bytes` on disk (the optimizer
/// state with its masters, when offloaded there); 0 otherwise and for measured estimates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelStateEstimate {
    /// The ZeRO stage.
    pub stage: Stage,
    /// Ranks `N` the model is sharded over.
    pub world_size: usize,
    /// Bytes of parameters on the device of each rank.
    pub parameters_bytes: f64,
    /// Bytes of gradients on the device of each rank.
    pub gradients_bytes: f64,
    /// Bytes of optimizer state on the device of each rank (Adam's moments and, with mixed
    /// precision, the `f32` master weights); 0 when offloaded.
    pub optimizer_state_bytes: f64,
    /// Bytes in the host memory of each rank: the optimizer state (with the `f32` master
    /// weights) when offloaded there (ZeRO-Offload), plus the stage-3 parameter shards with
    /// [`ModelStateEstimate::with_params_offloaded`]; 0 otherwise.
    pub host_bytes: f64,
    /// Bytes on the disk of each rank: the optimizer state (with the `f32` master weights) when
    /// offloaded there (ZeRO-Infinity), plus the stage-3 parameter and gradient shards with
    /// [`ModelStateEstimate::with_params_on_disk`]; 0 otherwise. Not memory: in neither total.
    pub disk_bytes: f64,
}

impl ModelStateEstimate {
    /// Bytes of model state on the device: parameters + gradients + optimizer state.
    pub fn device_bytes(&self) -> f64 {
        self.parameters_bytes + self.gradients_bytes + self.optimizer_state_bytes
    }

    /// Bytes of model state on the device and in host memory together.
    pub fn total_bytes(&self) -> f64 {
        self.device_bytes() + self.host_bytes
    }

    /// This estimate with stage 3's parameter shards in host memory
    /// ([`ShardConfig::with_params_on`](crate::ShardConfig::with_params_on); ZeRO-Infinity,
    /// Rajbhandari et al., SC21, §5.1, counts the `2Ψ/N` parameter bytes of mixed precision, `4Ψ/N`
    /// for `f32`, in host memory then): `parameters_bytes` move to `host_bytes`. Stages 0-2 are
    /// returned unchanged: every rank holds whole parameters there, which parameter offload does
    /// not apply to.
    pub fn with_params_offloaded(mut self) -> Self {
        if self.stage.shards_parameters() {
            self.host_bytes += self.parameters_bytes;
            self.parameters_bytes = 0.0;
        }
        self
    }

    /// This estimate with stage 3's parameter shards and gradient shards on disk
    /// ([`ShardConfig::with_params_on`](crate::ShardConfig::with_params_on);
    /// ZeRO-Infinity, Rajbhandari et al., SC21, §5.1, which places all model states, parameters
    /// and gradients included, on NVMe): `parameters_bytes` and `gradients_bytes` (each `2Ψ/N`
    /// in mixed precision, `4Ψ/N` for `f32`) move to `disk_bytes`; the device and host memory
    /// then hold only the units in flight (not counted here). Stages 0-2 are returned
    /// unchanged.
    pub fn with_params_on_disk(mut self) -> Self {
        if self.stage.shards_parameters() {
            self.disk_bytes += self.parameters_bytes + self.gradients_bytes;
            self.parameters_bytes = 0.0;
            self.gradients_bytes = 0.0;
        }
        self
    }
}

/// The ZeRO paper's per-rank model-state bytes for `params` (`Ψ`, elements) trained with Adam
/// on `world_size` (`N`) ranks at `stage`.
///
/// Mixed precision (`dtype` `Bf16`/`F16`; Rajbhandari et al., 2020, §5.1, `K` = 12, 2-byte
/// parameters and gradients):
///
/// | stage | parameters | gradients | optimizer state | total |
/// |---|---|---|---|---|
/// | 0 | 2Ψ | 2Ψ | KΨ | (2+2+K)Ψ = 16Ψ |
/// | 1 | 2Ψ | 2Ψ | KΨ/N | 4Ψ + 12Ψ/N |
/// | 2 | 2Ψ | 2Ψ/N | KΨ/N | 2Ψ + 14Ψ/N |
/// | 3 | 2Ψ/N | 2Ψ/N | KΨ/N | 16Ψ/N |
///
/// For Ψ = 7.5·10⁹ on N = 64 ranks: 120, 31.4, 16.6 and 1.9 GB (the paper's Figure 1).
///
/// `f32` (`dtype` `F32`, what this crate trains when the parameters are `f32`: no master
/// copy, 4-byte parameters and gradients, 8 bytes of Adam moments): stage 0 `16Ψ`, stage 1
/// `8Ψ + 8Ψ/N`, stage 2 `4Ψ + 12Ψ/N`, stage 3 `16Ψ/N`.
///
/// `offload` [`OffloadTarget::Cpu`] (ZeRO-Offload, Ren et al., 2021, §4): the optimizer
/// state and the `f32` master weights (`12Ψ/N` at stages 1-3 with mixed precision, `12Ψ` at
/// stage 0; `8Ψ/N` and `8Ψ` for `f32`) move to [`ModelStateEstimate::host_bytes`]; the device
/// keeps the parameters and the gradients. (ZeRO-Offload also streams the reduced gradients to
/// the host; they are counted on the device here, an upper bound for it.)
/// [`OffloadTarget::Nvme`] (ZeRO-Infinity, Rajbhandari et al., SC21, §3 and §5.1, which
/// counts the same `12Ψ/N` of optimizer state for NVMe): the same bytes move to
/// [`ModelStateEstimate::disk_bytes`]; host memory holds only the pieces in flight (see
/// [`NvmeOffload`](crate::NvmeOffload)), not counted here.
///
/// # Panics
/// If `world_size` is 0 or `params` is negative or not finite.
pub fn zero_formula(
    params: f64,
    world_size: usize,
    stage: Stage,
    dtype: ParamDtype,
    offload: OffloadTarget,
) -> ModelStateEstimate {
    assert!(world_size > 0, "world size must be at least 1");
    assert!(
        params.is_finite() && params >= 0.0,
        "parameter count must be a finite number >= 0, got {params}"
    );
    let n = world_size as f64;
    let shard = |bytes: f64, sharded: bool| if sharded { bytes / n } else { bytes };
    let optimizer = shard(dtype.optimizer_state_bytes() * params, stage.shards_optimizer_state());
    ModelStateEstimate {
        stage,
        world_size,
        parameters_bytes: shard(dtype.element_bytes() * params, stage.shards_parameters()),
        gradients_bytes: shard(dtype.element_bytes() * params, stage.shards_gradients()),
        optimizer_state_bytes: if offload == OffloadTarget::None { optimizer } else { 0.0 },
        host_bytes: if offload == OffloadTarget::Cpu { optimizer } else { 0.0 },
        disk_bytes: if offload == OffloadTarget::Nvme { optimizer } else { 0.0 },
    }
}

/// The per-rank model-state bytes of a built Burn model at every stage, extrapolated from
/// measurements (see [`estimate_model`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelEstimate {
    /// `Ψ`: elements of the trainable parameters (those that require grad), as
    /// [`FlatLayout`] counts them.
    pub parameter_count: usize,
    /// Ranks `N` the figures are for.
    pub world_size: usize,
    /// Stages 0 to 3, in order ([`ModelStateEstimate::host_bytes`] is 0: nothing is
    /// offloaded).
    pub stages: Vec<ModelStateEstimate>,
}

impl ModelEstimate {
    /// The estimate of `stage`.
    pub fn stage(&self, stage: Stage) -> &ModelStateEstimate {
        &self.stages[stage.number() as usize]
    }
}

/// Per-rank model-state bytes of `model` at every stage on `world_size` ranks, extrapolated
/// from what [`RankReport::memory`](crate::RankReport::memory)
/// measures on 1 and 2 ranks.
///
/// What is measured: for each stage, `model` is sharded with
/// `ShardConfig::new(stage).init(model, AdamWConfig::new(), comm)` on an
/// [`InProcessGroup`] of 1 rank and one of 2 ranks (ranks as threads, on the model's own
/// device), and one step (learning rate 0) is taken with a gradient of ones on every trainable
/// element (the gradient of the sum of all parameters, registered directly), so Adam's state
/// (and the `f32` master weights of `bf16`/`f16` parameters) exists. The report's parameters,
/// gradients and optimizer state bytes are the tensors actually held (shape × dtype size), the
/// largest over the ranks.
///
/// How it is extrapolated: each component is fitted to `bytes(N) = a + b/N` through the two
/// measurements (`a = 2·m₂ − m₁`, `b = 2·(m₁ − m₂)`: `a` is what every rank keeps whole, `b`
/// what is split) and evaluated at `world_size`. This is exact but for padding: a bucket
/// (stages 0-2) or a parameter (stage 3) is padded by fewer than `N` elements to a multiple
/// of `N`, so the result can differ from a measurement at `world_size` ranks by fewer
/// than `world_size` elements per bucket (stages 0-2) or per parameter (stage 3) and per
/// tensor of that size (parameters, gradients, each of Adam's moments, the master copy).
///
/// `model` must be built on an autodiff device (`device.autodiff()`); it is cloned, not
/// consumed. The measurement holds two copies of the model state at once (2 ranks), so run
/// it on a small configuration of the model or on the CPU (Burn's `Flex` device) when the
/// full model does not fit.
///
/// # Errors
/// [`ShardError::InvalidConfig`] when `world_size` is 0, or the model holds no tensor or is
/// not on an autodiff device; any error of [`ShardConfig::init`] or
/// [`ShardedOptimizer::step`](crate::ShardedOptimizer::step).
///
/// # Panics
/// If a rank thread panics (a Burn operation failed).
pub fn estimate_model<M: Module>(model: &M, world_size: usize) -> Result<ModelEstimate, ShardError> {
    if world_size == 0 {
        return Err(ShardError::InvalidConfig("world size must be at least 1".to_string()));
    }
    let parameter_count = FlatLayout::from_module(model, 1, DEFAULT_BUCKET_NUMEL)?.numel();
    let mut stages = Vec::with_capacity(STAGES.len());
    for stage in STAGES {
        let one = busiest_rank(&measure_memory(model, stage, 1)?);
        let two = busiest_rank(&measure_memory(model, stage, 2)?);
        let fit = |m1: usize, m2: usize| {
            let (m1, m2) = (m1 as f64, m2 as f64);
            (2.0 * m2 - m1) + 2.0 * (m1 - m2) / world_size as f64
        };
        stages.push(ModelStateEstimate {
            stage,
            world_size,
            parameters_bytes: fit(one.parameters_bytes, two.parameters_bytes),
            gradients_bytes: fit(one.gradients_bytes, two.gradients_bytes),
            optimizer_state_bytes: fit(one.optimizer_state_bytes, two.optimizer_state_bytes),
            host_bytes: 0.0,
            disk_bytes: 0.0,
        });
    }
    Ok(ModelEstimate {
        parameter_count,
        world_size,
        stages,
    })
}

/// Measures `model` sharded at `stage` on an in-process group of `world_size` ranks (threads,
/// on the model's own device), after one AdamW step with a gradient of ones on every
/// trainable parameter: the [`MemoryReport`] of each rank, in rank order (bytes).
///
/// This is what [`estimate_model`] extrapolates from, and what its estimate can be checked
/// against for a world size that fits on one machine.
///
/// # Errors
/// As [`estimate_model`].
///
/// # Panics
/// If a rank thread panics (a Burn operation failed).
pub fn measure_memory<M: Module>(model: &M, stage: Stage, world_size: usize) -> Result<Vec<MemoryReport>, ShardError> {
    if world_size == 0 {
        return Err(ShardError::InvalidConfig("world size must be at least 1".to_string()));
    }
    let device = model.collect_devices(Vec::new()).into_iter().next();
    let device = match device {
        Some(device) if device.is_autodiff() => device,
        Some(device) => {
            return Err(ShardError::InvalidConfig(format!(
                "the model is on {device:?}, without autodiff: build it on `device.autodiff()` so its \
                 parameters have gradients to measure"
            )));
        }
        None => {
            return Err(ShardError::InvalidConfig(
                "the model holds no tensor: there is no memory to estimate".to_string(),
            ));
        }
    };
    let group = InProcessGroup::new(world_size)?;
    // One copy per rank, taken by that rank's thread (`M` need not be `Sync`).
    let copies: Vec<Mutex<Option<M>>> = (0..world_size).map(|_| Mutex::new(Some(model.clone()))).collect();
    let results = run_ranks(group, |comm| {
        let model = copies[comm.rank()]
            .lock()
            .expect("a rank's model copy")
            .take()
            .expect("each rank takes its copy once");
        // Fresh autodiff leaves per rank, same parameter ids.
        let model = model.fork(&device);
        let (model, mut optim) = ShardConfig::new(stage).init(model, AdamWConfig::new(), comm)?;
        // A gradient of ones for every trainable element: what backward of the sum of all
        // parameters gives, registered directly (at stage 3, for this rank's shard).
        let grads = ones_gradients(&model, optim.report().layout());
        let model = optim.step(0.0, model, grads)?;
        Ok(optim.report().memory(&model))
    })
    .unwrap_or_else(|failure| panic!("measuring stage {stage} on {world_size} ranks: {failure}"));
    // The first error that is not a consequence of another rank's abort.
    let mut reports = Vec::with_capacity(results.len());
    let mut comm_error = None;
    for result in results {
        match result {
            Ok(report) => reports.push(report),
            Err(ShardError::Comm(e)) => {
                comm_error.get_or_insert(ShardError::Comm(e));
            }
            Err(e) => return Err(e),
        }
    }
    match comm_error {
        Some(e) => Err(e),
        None => Ok(reports),
    }
}

/// The largest bytes of each component over `reports` (the rank that holds the most; ranks
/// differ by padding only).
fn busiest_rank(reports: &[MemoryReport]) -> MemoryReport {
    let max = |f: fn(&MemoryReport) -> usize| reports.iter().map(f).max().unwrap_or(0);
    MemoryReport {
        parameters_bytes: max(|r| r.parameters_bytes),
        gradients_bytes: max(|r| r.gradients_bytes),
        optimizer_state_bytes: max(|r| r.optimizer_state_bytes),
        temporary_peak_bytes: max(|r| r.temporary_peak_bytes),
        ..reports.first().copied().unwrap_or_default()
    }
}

/// A gradient of ones, in the parameter's dtype, for every parameter of `layout` (the
/// trainable ones): shaped `[1, .., 1, numel]` with the numel of the layout's slot, the whole
/// parameter at stages 0-2 and this rank's shard at stage 3, where backward's reduce-scatter
/// would have left it.
fn ones_gradients<M: Module>(model: &M, layout: &FlatLayout) -> GradientsParams {
    struct Ones<'a> {
        layout: &'a FlatLayout,
        grads: GradientsParams,
    }
    impl ModuleVisitor for Ones<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(slot) = self.layout.slot_of(&param.id).map(|i| &self.layout.slots()[i]) else {
                return;
            };
            if D == 0 {
                return;
            }
            let mut dims = [1; D];
            dims[D - 1] = slot.numel;
            let device = param.lazy_device().without_autodiff();
            self.grads
                .register::<D>(param.id, Tensor::ones(dims, (&device, slot.dtype)));
        }
    }
    let mut ones = Ones {
        layout,
        grads: GradientsParams::new(),
    };
    model.visit(&mut ones);
    ones.grads
}
